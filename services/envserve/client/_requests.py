"""Building requests, shared by the sync and async clients."""
from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

from google.protobuf import struct_pb2

from envserve.v1 import envserve_pb2 as pb


def open_request(env_id: str, count: int, config: Mapping[str, Any] | None, action_format: str,
                 state_readers: Sequence[str] = (), stats_scope: str = "") -> pb.OpenRequest:
    req = pb.OpenRequest(env_id=env_id, count=count, action_format=action_format, state_readers=list(state_readers),
                         stats_scope=stats_scope)
    if config:
        s = struct_pb2.Struct()
        s.update(dict(config))
        req.config.CopyFrom(s)
    return req


def reset_item(session_id: str, seed: int | None = None, task_id: str = "", split: str = "",
               same_task: bool = False) -> pb.ResetItem:
    item = pb.ResetItem(session_id=session_id, task_id=task_id, split=split, same_task=same_task)
    if seed is not None:
        item.seed = int(seed)
    return item


def reset_request(session_ids: Sequence[str], seeds=None, task_id: str = "", split: str = "",
                  same_task: bool = False) -> pb.ResetRequest:
    if seeds is None or isinstance(seeds, int):
        seeds = [seeds] * len(session_ids)
    if len(seeds) != len(session_ids):
        raise ValueError("one seed per session")
    return pb.ResetRequest(items=[reset_item(s, seed, task_id, split, same_task)
                                  for s, seed in zip(session_ids, seeds)])


def step_item(session_id: str, action: str, generated_tokens: int = 0) -> pb.StepItem:
    return pb.StepItem(session_id=session_id, action=action, generated_tokens=int(generated_tokens))


def step_request(actions: "Mapping[str, str] | Iterable[tuple]") -> pb.StepRequest:
    """Items from {session: action} or (session, action[, generated tokens]) tuples."""
    items = actions.items() if isinstance(actions, Mapping) else actions
    return pb.StepRequest(items=[step_item(*it) for it in items])


def get_state_request(session_id: str, turn: int = -1, episode: int | None = None,
                      trial: int | None = None) -> pb.ReadStateRequest:
    req = pb.ReadStateRequest(session_id=session_id, turn=turn)
    if episode is not None:
        req.episode = episode
    if trial is not None:
        req.trial = trial
    return req
