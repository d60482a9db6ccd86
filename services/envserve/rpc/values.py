"""gRPC status codes by name and Python values as protobuf Structs, as the services put them in replies."""
from __future__ import annotations

import json

import grpc
from google.protobuf import struct_pb2


CODES = {c.name: c.value[0] for c in grpc.StatusCode}


_BY_NUMBER = {number: grpc.StatusCode[name] for name, number in CODES.items()}


def code_number(name: str) -> int:
    return CODES.get(name, CODES["UNKNOWN"])


def status_code(number: int) -> grpc.StatusCode:
    """The StatusCode of a per-item status's number (UNKNOWN for a number gRPC does not define)."""
    return _BY_NUMBER.get(number, grpc.StatusCode.UNKNOWN)


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
