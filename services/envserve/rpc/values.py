"""gRPC status codes by name and Python values as protobuf Structs, as the services put them in replies."""
from __future__ import annotations

import json
import math

import grpc
from google.protobuf import struct_pb2


CODES = {c.name: c.value[0] for c in grpc.StatusCode}


_BY_NUMBER = {number: grpc.StatusCode[name] for name, number in CODES.items()}


def code_number(name: str) -> int:
    return CODES.get(name, CODES["UNKNOWN"])


def status_code(number: int) -> grpc.StatusCode:
    """The StatusCode of a per-item status's number (UNKNOWN for a number gRPC does not define)."""
    return _BY_NUMBER.get(number, grpc.StatusCode.UNKNOWN)


class BadValue(ValueError):
    """A request value the server cannot take (a NaN in a config, nesting too deep). The method
    handlers of rpc/parsing answer it as INVALID_ARGUMENT with this message."""


def struct_to_dict(struct: struct_pb2.Struct, max_depth: int = 32, path: str = "config") -> dict:
    """A Struct as plain values, as json_format.MessageToDict gives them (numbers as floats), but
    refusing what a config cannot hold, with BadValue (a ValueError) naming the path: NaN or an
    infinity (MessageToDict raises a ValueError that names no field) and objects or lists nested
    deeper than max_depth (the Struct itself is level 1; MessageToDict recurses as deep as the
    message goes)."""
    return _struct(struct, 1, max_depth, path)


def _too_deep(path: str, max_depth: int) -> BadValue:
    return BadValue(f"{path}: nested deeper than {max_depth} levels")


def _struct(struct: struct_pb2.Struct, level: int, max_depth: int, path: str) -> dict:
    if level > max_depth:
        raise _too_deep(path, max_depth)
    return {key: _value(v, level, max_depth, f"{path}.{_short(key)}") for key, v in struct.fields.items()}


def _short(key: str) -> str:
    # A caller's key goes into an error message: a long one is cut.
    return key if len(key) <= 64 else key[:64] + "..."


def _value(v: struct_pb2.Value, level: int, max_depth: int, path: str):
    kind = v.WhichOneof("kind")
    if kind == "number_value":
        number = v.number_value
        if not math.isfinite(number):
            raise BadValue(f"{path}: {number} is not a finite number")
        return number
    if kind == "string_value":
        return v.string_value
    if kind == "bool_value":
        return v.bool_value
    if kind == "struct_value":
        return _struct(v.struct_value, level + 1, max_depth, path)
    if kind == "list_value":
        if level + 1 > max_depth:
            raise _too_deep(path, max_depth)
        return [_value(item, level + 1, max_depth, f"{path}[{i}]") for i, item in enumerate(v.list_value.values)]
    return None  # null_value, or no kind set (MessageToDict gives None too)


def to_struct(data: dict) -> struct_pb2.Struct:
    s = struct_pb2.Struct()
    try:
        s.update(data)
    except (TypeError, ValueError):
        # Tuples, numpy scalars and other values become plain JSON values first.
        s.Clear()
        s.update(json.loads(json.dumps(data, default=_json_default)))
    return s


def _json_default(o):
    if hasattr(o, "tolist"):
        return o.tolist()
    return str(o)


# One encoder for every *_json field: json.dumps with options builds a new one per call, which cost
# more than encoding a step's small info.
_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False, default=_json_default)


def json_text(data) -> str:
    """`data` as the JSON text of a `*_json` field (the sibling of a Struct): integers stay
    integers, numpy values become plain ones, and NaN or an infinity, which JSON cannot spell and
    other languages' parsers refuse, becomes null."""
    try:
        return _JSON.encode(data)
    except ValueError:
        return _JSON.encode(_finite(json.loads(json.dumps(data, default=_json_default))))


def _finite(v):
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_finite(x) for x in v]
    return v


def _no_constant(name: str):
    raise ValueError(f"{name} is not a finite number")


def json_object(text: str, max_depth: int = 32, path: str = "config_json") -> dict:
    """A `*_json` request field's text as a dict, refusing with BadValue (naming `path`) what a
    config cannot hold: text that is not JSON or not an object, NaN or an infinity, and nesting
    deeper than max_depth (as struct_to_dict does for the Struct)."""
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise _too_deep(path, max_depth) from None
    except ValueError as e:
        raise BadValue(f"{path}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise BadValue(f"{path}: must be a JSON object, got {type(value).__name__}")
    _check_depth(value, 1, max_depth, path)
    return value


def _check_depth(value, level: int, max_depth: int, path: str) -> None:
    if level > max_depth:
        raise _too_deep(path, max_depth)
    children = value.values() if isinstance(value, dict) else value
    for child in children:
        if isinstance(child, (dict, list)):
            _check_depth(child, level + 1, max_depth, path)


def config_of(message, max_depth: int = 32) -> dict:
    """The config of a message that carries it twice (OpenRequest, SessionHistory): `config_json`
    or the `config` Struct, {} when neither is set; BadValue when both are, or when the one set
    cannot be read."""
    has_struct = message.HasField("config")
    if message.config_json:
        if has_struct:
            raise BadValue("set config or config_json, not both")
        return json_object(message.config_json, max_depth)
    return struct_to_dict(message.config, max_depth) if has_struct else {}
