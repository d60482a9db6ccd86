"""Thin clients of the JudgeService: submit (session, turn, field, text) items, read scores by key.

The async client is what a trainer uses beside its rollout loop: `submit` returns at once and the
results arrive on their own task, so stepping never waits for the judge.
"""
from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Iterable, Sequence

import grpc

from envserve.v1 import envserve_pb2 as pb
from envserve.v1 import envserve_pb2_grpc as pb_grpc

from .client import ChannelOwner, auth_metadata, make_channel
from .errors import from_rpc_error


@dataclass(frozen=True)
class ReasoningReward:
    total: float
    components: dict[str, float] = field(default_factory=dict)


def reasoning_reward(grounding: float | None, world_modeling: float | None, beta_grounding: float,
                     beta_world_modeling: float, format_valid: bool = True) -> ReasoningReward:
    """r_reason = beta_g * grounding + beta_w * world_modeling, from the judged scores (each an F1 or
    the repetition penalty). One definition for the judge service and every trainer, here because both
    sit on the client. A turn may carry only one of the two fields (the grounding or the worldmodeling
    format): the missing one adds nothing. As in VAGEN, a turn whose text did not parse earns no
    reasoning reward at all, whatever its fields say."""
    components: dict[str, float] = {}
    if format_valid:
        if grounding is not None:
            components["grounding"] = beta_grounding * float(grounding)
        if world_modeling is not None:
            components["world_modeling"] = beta_world_modeling * float(world_modeling)
    return ReasoningReward(sum(components.values()), components)


def new_scope(label: str = "run") -> str:
    """A fresh JudgeTask.scope: one run's repetition counts, apart from every other caller's."""
    return f"{label}-{uuid.uuid4().hex[:12]}"


@dataclass(frozen=True)
class JudgeTask:
    """One text to judge. `turn` is the turn of the observation the agent answered."""
    key: str
    session_id: str
    turn: int
    field: str                # "grounding" | "world_modeling"
    text: str
    episode: int | None = None
    env_id: str = ""
    trial: int | None = None      # StepResult.trial: set it when the session may move to a new task first
    scope: str = ""               # whose repetition counts it joins: one per training run ("": shared)

    def to_proto(self) -> pb.JudgeItem:
        item = pb.JudgeItem(key=self.key, session_id=self.session_id, turn=self.turn, field=self.field,
                            text=self.text, env_id=self.env_id, scope=self.scope)
        if self.episode is not None:
            item.episode = self.episode
        if self.trial is not None:
            item.trial = self.trial
        return item


def _request(tasks: Iterable["JudgeTask | pb.JudgeItem"]) -> pb.JudgeRequest:
    return pb.JudgeRequest(items=[t.to_proto() if isinstance(t, JudgeTask) else t for t in tasks])


class JudgeClient(ChannelOwner):
    """Blocking client: `judge` returns every result of a batch, in order of completion."""

    def __init__(self, address: str, token: str | None = None, root_certificates=None, tls: bool = False,
                 timeout: float | None = 300.0):
        self.channel = make_channel(address, root_certificates, tls)
        self.stub = pb_grpc.JudgeServiceStub(self.channel)
        self.metadata, self.timeout = auth_metadata(token), timeout

    def judge(self, tasks: Sequence["JudgeTask | pb.JudgeItem"]) -> list[pb.JudgeResult]:
        try:
            return list(self.stub.Judge(_request(tasks), timeout=self.timeout, metadata=self.metadata))
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    def info(self) -> pb.JudgeInfo:
        try:
            return self.stub.GetJudgeInfo(pb.GetJudgeInfoRequest(), timeout=self.timeout, metadata=self.metadata)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None



class AsyncJudgeClient:
    """asyncio client. `judge` yields results as they finish; `submit` hands a batch to a background
    task and `results` (an asyncio.Queue) receives them, so the caller's loop never awaits the judge."""

    def __init__(self, address: str, token: str | None = None, root_certificates=None, tls: bool = False,
                 timeout: float | None = 300.0):
        self.channel = make_channel(address, root_certificates, tls, aio=True)
        self.stub = pb_grpc.JudgeServiceStub(self.channel)
        self.metadata, self.timeout = auth_metadata(token), timeout
        self.results: asyncio.Queue[pb.JudgeResult] = asyncio.Queue()
        self._pending: set[asyncio.Task] = set()

    async def judge(self, tasks: Sequence["JudgeTask | pb.JudgeItem"]) -> AsyncIterator[pb.JudgeResult]:
        call = self.stub.Judge(_request(tasks), timeout=self.timeout, metadata=self.metadata)
        try:
            async for result in call:
                yield result
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    def submit(self, tasks: Sequence["JudgeTask | pb.JudgeItem"]) -> asyncio.Task:
        """Judges in the background; each result is put on `self.results`. A failed call puts one
        result per undelivered item carrying the call's status, so no item is silently lost."""
        items = list(_request(tasks).items)

        async def run():
            delivered: set[str] = set()
            try:
                async for r in self.judge(items):
                    delivered.add(r.key)
                    self.results.put_nowait(r)
            except Exception as e:
                code = getattr(getattr(e, "code", None), "value", (2,))[0]
                for it in items:
                    if it.key in delivered:
                        continue
                    self.results.put_nowait(pb.JudgeResult(key=it.key, field=it.field, status=pb.ItemStatus(
                        code=code, message=f"judge call failed: {e}")))

        task = asyncio.get_running_loop().create_task(run())
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)
        return task

    async def drain(self) -> None:
        """Waits for every submitted batch."""
        while self._pending:
            await asyncio.gather(*list(self._pending))

    async def info(self) -> pb.JudgeInfo:
        try:
            return await self.stub.GetJudgeInfo(pb.GetJudgeInfoRequest(), timeout=self.timeout,
                                                metadata=self.metadata)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    async def close(self) -> None:
        for t in list(self._pending):
            t.cancel()
        await self.channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()
