"""Core results to protocol messages. Runs in worker processes, so the front only frames bytes."""
from __future__ import annotations

import io
import json

import grpc
from google.protobuf import json_format, struct_pb2

from envserve.core.env import EnvSpec
from envserve.core.session import TurnResult, full_spec
from envserve.v1 import envserve_pb2 as pb

CODES = {c.name: c.value[0] for c in grpc.StatusCode}


def code_number(name: str) -> int:
    return CODES.get(name, CODES["UNKNOWN"])


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


def png_image(array, name: str = "observation") -> pb.Image:
    from PIL import Image as PILImage
    buf = io.BytesIO()
    PILImage.fromarray(array).save(buf, format="PNG", compress_level=1)
    h, w = array.shape[:2]
    channels = array.shape[2] if array.ndim == 3 else 1
    return pb.Image(png=buf.getvalue(), height=h, width=w, channels=channels, name=name)


def turn_to_proto(session_id: str, r: TurnResult) -> pb.StepResult:
    msg = pb.StepResult(
        session_id=session_id,
        reward=r.reward,
        done=r.done,
        truncated=r.truncated,
        success=r.success,
        action_valid=r.valid,
        actions_executed=r.actions_executed,
        parsed_actions=r.parsed_actions,
        anchor=r.anchor,
        transition=r.transition,
        feedback=r.feedback,
        turn=r.turn,
        episode=r.episode,
    )
    obs = msg.observation
    obs.text = r.text
    obs.turn = r.turn
    obs.episode = r.episode
    if r.image is not None:
        obs.images.append(png_image(r.image))
    msg.reward_components.update(r.components)
    msg.reasoning.update(r.reasoning)
    if r.info:
        msg.info.CopyFrom(to_struct(r.info))
    return msg


def error_result(session_id: str, code: str, message: str) -> pb.StepResult:
    return pb.StepResult(session_id=session_id, status=pb.ItemStatus(code=code_number(code), message=message))


def state_to_proto(session_id: str, record: dict) -> pb.GetStateResponse:
    return pb.GetStateResponse(
        session_id=session_id, turn=record["turn"], episode=record["episode"],
        state=to_struct(record["state"]), relations=record["relations"], anchor=record["anchor"],
        observation_text=record["observation_text"],
    )


def spec_to_proto(spec: EnvSpec) -> pb.EnvSpec:
    from envserve.core.formats import format_names
    spec = full_spec(spec)
    return pb.EnvSpec(
        env_id=spec.env_id, description=spec.description, system_prompt=spec.system_prompt,
        default_action_format=spec.default_action_format,
        action_formats=list(spec.action_formats or format_names()),
        max_turns=spec.max_turns, max_actions_per_turn=spec.max_actions_per_turn,
        modalities=list(spec.modalities), config_schema_json=json.dumps(spec.config_schema()),
        splits=[pb.Split(name=s.name, description=s.description) for s in spec.splits],
        action_space=spec.action_space, supports_snapshot=spec.supports_snapshot,
    )


def struct_to_dict(s: struct_pb2.Struct) -> dict:
    return json_format.MessageToDict(s)


def frame_repeated(field_number: int, items: list[bytes]) -> bytes:
    """Concatenate serialized messages as a repeated message field: the wire form of a
    repeated field is just its elements one after another, so no re-encoding is needed."""
    tag = _varint((field_number << 3) | 2)
    return b"".join(tag + _varint(len(b)) + b for b in items)


def interact_result(tag: int, step_result: bytes) -> bytes:
    """A serialized InteractResult (tag = field 1, result = field 2)."""
    return b"\x08" + _varint(tag) + b"\x12" + _varint(len(step_result)) + step_result


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)
