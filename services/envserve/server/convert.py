"""Core results to protocol messages. Runs in worker processes, so the front only frames bytes."""
from __future__ import annotations

import io
import json

from envserve.core.env import EnvSpec
from envserve.core.session import TurnResult, full_spec
from envserve.rpc.values import code_number, config_of, json_text, to_struct
from envserve.v1 import envserve_pb2 as pb

from . import wire

def png_bytes(array) -> bytes:
    from PIL import Image as PILImage
    buf = io.BytesIO()
    PILImage.fromarray(array).save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def image_of(r: TurnResult) -> bytes | None:
    """The turn's image as a serialized Image (PNG), or None."""
    if r.image is None:
        return None
    h, w = r.image.shape[:2]
    channels = r.image.shape[2] if r.image.ndim == 3 else 1
    return wire.image_bytes(png_bytes(r.image), h, w, channels, "observation")


def encode_turn(session_id: str, r: TurnResult, image: bytes | None = None) -> bytes:
    """The serialized StepResult of a turn (see wire.py for why it is written by hand);
    `image` is the turn's image_of() when the caller already encoded it."""
    if image is None:
        image = image_of(r)
    return wire.step_result(session_id, r, [image] if image is not None else [])


def summary_bytes(session_id: str, summary: dict, image: bytes | None) -> bytes:
    """A serialized SessionSummary from Session.summary() and the latest serialized Image."""
    msg = pb.SessionSummary(session_id=session_id, **summary)
    if image is not None:
        msg.image.ParseFromString(image)
    return msg.SerializeToString()


def error_result(session_id: str, code: str, message: str) -> pb.StepResult:
    return pb.StepResult(session_id=session_id, status=pb.ItemStatus(code=code_number(code), message=message))


def state_to_proto(session_id: str, record: dict, env_id: str = "") -> pb.GetStateResponse:
    return pb.GetStateResponse(
        session_id=session_id, env_id=env_id, turn=record["turn"], episode=record["episode"],
        trial=record.get("trial", 0),
        state=to_struct(record["state"]), state_json=json_text(record["state"]), relations=record["relations"],
        anchor=record["anchor"], observation_text=record["observation_text"],
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
        splits=[pb.Split(name=s.name, description=s.description, num_tasks=s.num_tasks) for s in spec.splits],
        action_space=spec.action_space, supports_snapshot=spec.supports_snapshot,
        replay_exact=spec.replay_exact, seed_varies_start=spec.seed_varies_start,
    )


def history_to_proto(h: dict) -> pb.SessionHistory:
    """Session.replay_record() as the SessionHistory a Restore call carries."""
    msg = pb.SessionHistory(env_id=h["env_id"], action_format=h["action_format"], trial=h["trial"],
                            episode=h["episode"], reset_anchor=h["reset_anchor"],
                            turns=[pb.ReplayTurn(action=a, anchor=n) for a, n in zip(h["actions"], h["anchors"])])
    msg.config.CopyFrom(to_struct(h["config"]))
    if h["seed"] is not None:
        msg.seed = int(h["seed"])
    msg.stats_scope = h.get("stats_scope", "")
    return msg


def config_from_proto(message) -> dict:
    """The config of an OpenRequest or a SessionHistory (config_json or the Struct) as a dict ({}
    when unset). Both set, text that is not a JSON object, NaN, an infinity or nesting deeper than
    32 levels raise rpc.values.BadValue naming the field, which the method handlers
    (rpc/parsing.py) answer as INVALID_ARGUMENT."""
    return config_of(message)


def history_from_proto(h: pb.SessionHistory) -> dict:
    """A SessionHistory as the keyword values of Session.restore (picklable, for a worker); see
    config_from_proto for a config that cannot be read."""
    return {
        "env_id": h.env_id, "action_format": h.action_format,
        "config": config_from_proto(h),
        "seed": h.seed if h.HasField("seed") else None, "trial": h.trial, "episode": h.episode,
        "reset_anchor": h.reset_anchor, "actions": [t.action for t in h.turns],
        "anchors": [t.anchor for t in h.turns],
    }


def frame_repeated(field_number: int, items: list[bytes]) -> bytes:
    """Concatenate serialized messages as a repeated message field: the wire form of a
    repeated field is just its elements one after another, so no re-encoding is needed."""
    return b"".join(wire.field_bytes(field_number, b) for b in items)


def batch_element(step_result: bytes) -> bytes:
    """A serialized StepResult framed as one element of BatchResponse.results (field 1):
    a BatchResponse is these elements joined."""
    return wire.field_bytes(1, step_result)


def interact_result(tag: int, step_result: bytes) -> bytes:
    """A serialized InteractResult (tag = field 1, result = field 2)."""
    return b"\x08" + wire.varint(tag) + wire.field_bytes(2, step_result)


def task_to_proto(task) -> pb.Task:
    """A core.tasks.Task as the wire's Task."""
    return pb.Task(task_id=task.task_id, split=task.split, description=task.description,
                   task_type=task.task_type, parameters=to_struct(dict(task.parameters)),
                   parameters_json=json_text(dict(task.parameters)), seed=task.seed)
