"""AsyncRoutedClient: the routed client for asyncio trainers, with an EnvPool-style stream that
spans replicas: send to any session, recv whatever any replica has finished."""
from __future__ import annotations

import asyncio
import itertools
from typing import Any, Iterable, Mapping, Sequence

import grpc

from envserve.directory import ReplicaInfo, replica_of
from envserve.v1 import envserve_pb2 as pb

from . import _requests as rq
from .aio import AsyncEnvClient, InteractStream
from .errors import EnvServeError, UnavailableError, make_error
from .routing import _RETRY_ELSEWHERE, Router, indices_by_replica


class AsyncRoutedClient(Router):
    """Same routing as RoutedClient; the directory (a blocking store) is read off the event loop."""

    client_class = AsyncEnvClient

    async def _refresh(self, env_id: str | None = None) -> list[ReplicaInfo]:
        return await asyncio.to_thread(self.replicas, env_id)

    async def _resolve(self, session_id: str) -> ReplicaInfo | None:
        r = self._known.get(replica_of(session_id))
        return r if r is not None else await asyncio.to_thread(self._replica_for, session_id)

    async def open(self, env_id: str, count: int = 1, config: Mapping[str, Any] | None = None,
                   action_format: str = "") -> list[str]:
        return (await self.open_with_prompt(env_id, count, config, action_format))[0]

    async def get_spec(self, env_id: str) -> pb.EnvSpec:
        replicas = await self._refresh(env_id)
        if not replicas:
            raise UnavailableError(grpc.StatusCode.UNAVAILABLE, f"no live replica serves {env_id!r}")
        return await self.client_for(replicas[0]).get_spec(env_id)

    async def open_with_prompt(self, env_id: str, count: int = 1, config: Mapping[str, Any] | None = None,
                               action_format: str = "") -> tuple[list[str], str]:
        """(session ids, their system prompt); the replicas of one env give the same prompt."""
        await self._refresh(env_id)
        prompt = ""
        opened: list[str] = []
        tried: set[str] = set()
        last_error: EnvServeError | None = None
        while len(opened) < count:
            shares = self.plan(env_id, count - len(opened), tried)
            if not shares:
                break
            rids = list(shares)
            replies = await asyncio.gather(
                *[self.client_for(self._known[rid]).open_with_prompt(env_id, shares[rid], config, action_format)
                  for rid in rids], return_exceptions=True)
            for rid, reply in zip(rids, replies):
                if isinstance(reply, EnvServeError) and reply.code in _RETRY_ELSEWHERE:
                    last_error = reply
                    tried.add(rid)
                elif isinstance(reply, BaseException):
                    await self.close_sessions(opened)
                    raise reply
                else:
                    ids, prompt = reply
                    opened.extend(ids)
                    self.note_opened(rid, len(ids))
        if len(opened) < count:
            await self.close_sessions(opened)
            raise last_error or UnavailableError(
                grpc.StatusCode.UNAVAILABLE, f"no live replica serving {env_id!r} has room for {count} sessions")
        return opened, prompt

    async def _fan_out(self, items: list, sid_of, call) -> list:
        """call(client, items) -> per-item replies; one replica failing fails only its items."""
        results: list = [None] * len(items)
        plans = []
        for rid, indices in indices_by_replica(items, sid_of).items():
            r = await self._resolve(sid_of(items[indices[0]]))
            if r is None:
                for i in indices:
                    results[i] = self._lost(sid_of(items[i]), rid)
            else:
                plans.append((r, indices))
        replies = await asyncio.gather(*[call(self.client_for(r), [items[i] for i in idx]) for r, idx in plans],
                                       return_exceptions=True)
        for (r, indices), reply in zip(plans, replies):
            if isinstance(reply, EnvServeError):
                gone = reply.code == grpc.StatusCode.UNAVAILABLE and not await asyncio.to_thread(
                    self.still_listed, r.replica_id)
                reply = [self._unreachable(sid_of(items[i]), r, reply.code, reply.message, gone) for i in indices]
            elif isinstance(reply, BaseException):
                raise reply
            for i, res in zip(indices, reply):
                results[i] = res
        return results

    async def reset(self, session_ids: Sequence[str], seeds=None, task_id: str = "", split: str = "",
                    same_task: bool = False) -> list[pb.StepResult]:
        items = list(rq.reset_request(session_ids, seeds, task_id, split, same_task).items)

        async def call(c: AsyncEnvClient, its):
            return list((await c._call(c.env.Reset, pb.ResetRequest(items=its))).results)
        return await self._fan_out(items, lambda it: it.session_id, call)

    async def step(self, actions: "Mapping[str, str] | Iterable[tuple[str, str]]") -> list[pb.StepResult]:
        pairs = list(actions.items() if isinstance(actions, Mapping) else actions)
        return await self._fan_out(pairs, lambda p: p[0], lambda c, its: c.step(its))

    async def close_sessions(self, session_ids: Sequence[str]) -> list[pb.ItemStatus]:
        if not session_ids:
            return []
        out = await self._fan_out(list(session_ids), lambda s: s, lambda c, its: c.close_sessions(its))
        return [r if isinstance(r, pb.ItemStatus) else r.status for r in out]

    async def _session_client(self, session_id: str) -> AsyncEnvClient:
        r = await self._resolve(session_id)
        if r is None:
            raise make_error(grpc.StatusCode.DATA_LOSS,
                             f"session lost: its replica {replica_of(session_id)!r} is gone", session_id)
        return self.client_for(r)

    async def get_state(self, session_id: str, turn: int = -1, episode: int | None = None,
                        trial: int | None = None) -> pb.GetStateResponse:
        return await (await self._session_client(session_id)).get_state(session_id, turn, episode, trial)

    async def fork(self, session_id: str, count: int = 1) -> list[str]:
        return await (await self._session_client(session_id)).fork(session_id, count)

    def stream(self) -> "RoutedStream":
        return RoutedStream(self)

    async def close(self) -> None:
        for c in list(self._clients.values()):
            await c.close()
        self._clients.clear()
        if self._owns_directory:
            await asyncio.to_thread(self.directory.close)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()


class RoutedStream:
    """One Interact stream per replica, opened on first use, behind one send/recv interface.
    Tags are this stream's own; recv() returns (tag, StepResult) pairs from whichever replicas
    have results (at least one pair)."""

    def __init__(self, client: AsyncRoutedClient):
        self._client = client
        self._tags = itertools.count(1)
        self._streams: dict[str, InteractStream] = {}
        self._readers: dict[str, asyncio.Task] = {}
        self._tag_map: dict[tuple[str, int], int] = {}  # (replica, its tag) -> our tag
        self._pending: dict[str, dict[int, str]] = {}  # replica -> our tag -> session id
        self._ready: asyncio.Queue = asyncio.Queue()
        self.in_flight = 0

    async def __aenter__(self) -> "RoutedStream":
        return self

    async def __aexit__(self, *exc) -> None:
        for task in self._readers.values():
            task.cancel()
        for s in self._streams.values():
            await s.__aexit__(*exc)

    async def _stream_for(self, r: ReplicaInfo) -> InteractStream:
        s = self._streams.get(r.replica_id)
        if s is None:
            c = self._client.client_for(r)
            s = self._streams[r.replica_id] = await InteractStream(c.env, c.metadata).__aenter__()
            self._pending[r.replica_id] = {}
            self._readers[r.replica_id] = asyncio.get_running_loop().create_task(self._read(r, s))
        return s

    async def _read(self, r: ReplicaInfo, s: InteractStream) -> None:
        try:
            while True:
                for local, result in await s.recv():
                    ours = self._tag_map.pop((r.replica_id, local))
                    self._pending[r.replica_id].pop(ours, None)
                    self._ready.put_nowait((ours, result))
        except (EnvServeError, EOFError) as e:
            # The replica's stream broke: everything still in flight there fails, alone.
            code = e.code if isinstance(e, EnvServeError) else grpc.StatusCode.UNAVAILABLE
            gone = code == grpc.StatusCode.UNAVAILABLE and not await asyncio.to_thread(
                self._client.still_listed, r.replica_id)
            for ours, sid in self._pending.pop(r.replica_id, {}).items():
                self._ready.put_nowait((ours, self._client._unreachable(sid, r, code, str(e), gone)))
            self._streams.pop(r.replica_id, None)
            self._readers.pop(r.replica_id, None)

    async def _send(self, session_id: str, send) -> int:
        ours = next(self._tags)
        self.in_flight += 1
        r = await self._client._resolve(session_id)
        if r is None:
            self._ready.put_nowait((ours, self._client._lost(session_id, replica_of(session_id))))
            return ours
        s = await self._stream_for(r)
        local = send(s)
        self._tag_map[(r.replica_id, local)] = ours
        self._pending[r.replica_id][ours] = session_id
        return ours

    async def send_step(self, session_id: str, action: str) -> int:
        return await self._send(session_id, lambda s: s.send_step(session_id, action))

    async def send_steps(self, actions: "Mapping[str, str] | Iterable[tuple[str, str]]") -> list[int]:
        pairs = actions.items() if isinstance(actions, Mapping) else actions
        return [await self.send_step(sid, a) for sid, a in pairs]

    async def send_reset(self, session_id: str, seed: int | None = None, task_id: str = "", split: str = "",
                         same_task: bool = False) -> int:
        return await self._send(session_id, lambda s: s.send_reset(session_id, seed, task_id, split, same_task))

    async def recv(self) -> list[tuple[int, pb.StepResult]]:
        out = [await self._ready.get()]
        while not self._ready.empty():
            out.append(self._ready.get_nowait())
        self.in_flight -= len(out)
        return out
