"""Protobuf wire encoding of StepResult, written by hand for the worker's hot path.

Building upb messages for every result leaves the worker's heap fragmented (their arenas
interleave with long-lived session data, so closed sessions' memory never goes back to the
OS) and costs more than writing the bytes directly. Field numbers follow
proto/envserve/v1/envserve.proto; tests/unit/test_wire.py decodes the output with the
generated classes and compares every field.
"""
from __future__ import annotations

import math
from struct import Struct as _Packer

from envserve.rpc.values import json_text

_DOUBLE = _Packer("<d")
_ONE_BYTE = [bytes((n,)) for n in range(0x80)]


def varint(n: int) -> bytes:
    if n < 0:
        n += 1 << 64  # negative int32/int64 take ten bytes, as in protobuf
    if n < 0x80:
        return _ONE_BYTE[n]
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _len_prefixed(data: bytes) -> bytes:
    n = len(data)
    return (_ONE_BYTE[n] if n < 0x80 else varint(n)) + data


def _key(field: int, wire_type: int) -> bytes:
    return varint((field << 3) | wire_type)


def _utf8(s: str) -> bytes:
    return s.encode("utf-8", "replace")


def field_bytes(field: int, data: bytes) -> bytes:
    return _key(field, 2) + _len_prefixed(data)


def field_str(field: int, s: str) -> bytes:
    return field_bytes(field, _utf8(s)) if s else b""


def field_int(field: int, n: int) -> bytes:
    return _key(field, 0) + varint(int(n)) if n else b""


# google.protobuf.Value: null 1, number 2, string 3, bool 4, struct 5, list 6.
def _value(v) -> bytes:
    if v is None:
        return b"\x08\x00"
    if isinstance(v, bool):
        return b"\x20" + (b"\x01" if v else b"\x00")
    if isinstance(v, (int, float)):
        return b"\x11" + _DOUBLE.pack(float(v))
    if isinstance(v, str):
        return field_bytes(3, _utf8(v))
    if isinstance(v, dict):
        return field_bytes(5, struct_bytes(v))
    if isinstance(v, (list, tuple)):
        return field_bytes(6, b"".join(field_bytes(1, _value(x)) for x in v))
    if hasattr(v, "tolist"):  # numpy scalars and arrays
        return _value(v.tolist())
    return field_bytes(3, _utf8(str(v)))


def struct_bytes(d: dict) -> bytes:
    """google.protobuf.Struct: map<string, Value> fields = 1 (entries: key 1, value 2)."""
    lp = _len_prefixed
    return b"".join(b"\x0a" + lp(b"\x0a" + lp(_utf8(str(k))) + b"\x12" + lp(_value(v))) for k, v in d.items())


def _map_str_double(field: int, d: dict) -> bytes:
    return b"".join(field_bytes(field, field_bytes(1, _utf8(k)) + _key(2, 1) + _DOUBLE.pack(float(v)))
                    for k, v in d.items())


def _map_str_str(field: int, d: dict) -> bytes:
    return b"".join(field_bytes(field, field_str(1, k) + field_str(2, v)) for k, v in d.items())


def image_bytes(png: bytes, height: int, width: int, channels: int, name: str) -> bytes:
    return (field_bytes(1, png) + field_int(2, height) + field_int(3, width) + field_int(4, channels)
            + field_str(5, name))


def step_result(session_id: str, r, images: list[bytes] = ()) -> bytes:
    """A serialized envserve.v1.StepResult from a core TurnResult; `images` are serialized Images.

    Inlined (one function, constant keys) because it runs once per step."""
    lp = _len_prefixed
    turn, episode = r.turn, r.episode
    obs = [b"\x0a" + lp(r.text.encode("utf-8", "replace"))] if r.text else []
    for im in images:
        obs.append(b"\x12" + lp(im))
    if turn:
        obs.append(b"\x18" + varint(turn))
    if episode:
        obs.append(b"\x20" + varint(episode))
    # status (field 2) is written even when OK, as an empty ItemStatus: clients in languages that
    # show an absent message as null read status.code without a check.
    out = [b"\x0a" + lp(session_id.encode("utf-8", "replace")), b"\x12\x00", b"\x1a" + lp(b"".join(obs))]
    reward = float(r.reward)
    if reward != 0.0 or math.copysign(1.0, reward) < 0:
        out.append(b"\x21" + _DOUBLE.pack(reward))
    for k, v in r.components.items():
        out.append(b"\x2a" + lp(b"\x0a" + lp(k.encode("utf-8", "replace")) + b"\x11" + _DOUBLE.pack(float(v))))
    if r.done:
        out.append(b"\x30\x01")
    if r.truncated:
        out.append(b"\x38\x01")
    if r.success:
        out.append(b"\x40\x01")
    if r.valid:
        out.append(b"\x48\x01")
    if r.actions_executed:
        out.append(b"\x50" + varint(r.actions_executed))
    for a in r.parsed_actions:
        out.append(b"\x5a" + lp(a.encode("utf-8", "replace")))
    for k, v in r.reasoning.items():
        out.append(b"\x62" + lp(field_str(1, k) + field_str(2, v)))
    if r.anchor:
        out.append(b"\x6a" + lp(r.anchor.encode("utf-8", "replace")))
    if r.feedback:
        out.append(b"\x72" + lp(r.feedback.encode("utf-8", "replace")))
    if r.info:
        out.append(b"\x7a" + lp(struct_bytes(r.info)))
    if turn:
        out.append(b"\x80\x01" + varint(turn))
    if episode:
        out.append(b"\x88\x01" + varint(episode))
    if r.transition:
        out.append(b"\x92\x01" + lp(r.transition.encode("utf-8", "replace")))
    if r.trial:
        out.append(b"\x98\x01" + varint(r.trial))
    if r.info:
        out.append(b"\xa2\x01" + lp(json_text(r.info).encode("utf-8", "replace")))
    return b"".join(out)
