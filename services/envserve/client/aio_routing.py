"""AsyncRoutedClient: the routed client for asyncio trainers, with an EnvPool-style stream that
spans replicas: send to any session, recv whatever any replica has finished. Lost sessions are
rebuilt on live replicas as by RoutedClient (routing.py), on the stream too."""
from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any, Iterable, Mapping, Sequence

import grpc

from envserve.common.tables import count_problem, sessions_per_table
from envserve.directory import ReplicaInfo, replica_of
from envserve.v1 import envserve_pb2 as pb

from . import _requests as rq
from .aio import AsyncEnvClient, InteractStream
from .errors import EnvServeError, UnavailableError, make_error
from .recovery import replica_gone
from .routing import _RETRY_ELSEWHERE, Router, _on, broken_call_code, indices_by_replica


class AsyncRoutedClient(Router):
    """Same routing as RoutedClient; the directory (a blocking store) is read off the event loop.

    stream_steps: reset and step items travel on one Interact stream per replica, shared by every
    caller of this client, instead of a Step call each: a lone caller writes and reads on the
    stream itself, overlapping callers share its messages (see InteractStream). Results, routing
    and recovery are the same either way."""

    client_class = AsyncEnvClient

    def __init__(self, *args, stream_steps: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.stream_steps = stream_steps
        self._streams: dict[AsyncEnvClient, InteractStream] = {}
        self._retired: list = []  # clients of replicas that are gone, closed on this client's loop

    def _retire(self, clients: list) -> None:
        # Called wherever the listing is read, often in a worker thread: the loop closes them.
        with self._lock:
            self._retired.extend(clients)

    async def _close_retired(self) -> None:
        with self._lock:
            retired, self._retired = self._retired, []
        for c in retired:
            if isinstance(c, AsyncEnvClient):
                s = self._streams.pop(c, None)
                if s is not None:
                    await s.__aexit__(None, None, None)
                await c.close()
            else:
                c.close()

    async def _refresh(self, env_id: str | None = None) -> list[ReplicaInfo]:
        found = await asyncio.to_thread(self.replicas, env_id)
        if self._retired:
            await self._close_retired()
        return found

    async def _resolve(self, session_id: str) -> ReplicaInfo | None:
        r = self._known.get(replica_of(session_id))
        return r if r is not None else await asyncio.to_thread(self._replica_for, session_id)

    async def open(self, env_id: str, count: int = 1, config: Mapping[str, Any] | None = None,
                   action_format: str = "") -> list[str]:
        return (await self.open_with_prompt(env_id, count, config, action_format))[0]

    async def get_spec(self, env_id: str) -> pb.EnvSpec:
        replicas = await self._refresh(env_id)
        if not replicas:
            await asyncio.to_thread(self.check_served, env_id)
            raise UnavailableError(grpc.StatusCode.UNAVAILABLE, f"no live replica serves {env_id!r}")
        return await self.client_for(replicas[0]).get_spec(env_id)

    async def _any_replica(self, env_id: str, call):
        """await call(client) on the first replica serving env_id that answers (see RoutedClient's)."""
        replicas = await self._refresh(env_id)
        if not replicas:
            await asyncio.to_thread(self.check_served, env_id)
            raise UnavailableError(grpc.StatusCode.UNAVAILABLE, f"no live replica serves {env_id!r}")
        for r in replicas[:-1]:
            try:
                return await call(self.client_for(r))
            except UnavailableError:
                continue
        return await call(self.client_for(replicas[-1]))

    async def list_tasks(self, env_id: str, split: str = "", page_size: int = 0,
                         page_token: str = "") -> pb.ListTasksResponse:
        """A page of a split's tasks, from any replica serving the env (they list the same tasks)."""
        return await self._any_replica(env_id, lambda c: c.list_tasks(env_id, split, page_size, page_token))

    async def task_stats(self, env_id: str, scope: str | None = None) -> list[pb.TaskStat]:
        return await self._any_replica(env_id, lambda c: c.task_stats(env_id, scope))

    async def open_with_prompt(self, env_id: str, count: int = 1, config: Mapping[str, Any] | None = None,
                               action_format: str = "") -> tuple[list[str], str]:
        """(session ids, their system prompt); the replicas of one env give the same prompt."""
        await self._refresh(env_id)
        prompt = ""
        opened: list[str] = []
        tried: set[str] = set()
        last_error: EnvServeError | None = None
        await asyncio.to_thread(self.check_served, env_id)
        if sessions_per_table(config) > 1 and count_problem(count):
            raise make_error(grpc.StatusCode.INVALID_ARGUMENT, count_problem(count))
        deadline = self.open_deadline()
        while len(opened) < count:
            claims = self.claim(env_id, count - len(opened), tried, sessions_per_table(config))
            if not claims:
                if time.monotonic() >= deadline or self.listed(env_id):
                    break  # full or refusing replicas answer at once; only an empty listing is waited out
                await asyncio.sleep(0.2)  # no replica now: wait for one (see Router.open_deadline)
                await asyncio.to_thread(self._refresh_quietly)
                tried.clear()
                continue
            rids = list(claims)
            replies = await asyncio.gather(
                *[self.client_for(self._known[rid]).open_sessions(env_id, claims[rid][0], config, action_format)
                  for rid in rids], return_exceptions=True)
            for rid, reply in zip(rids, replies):
                if isinstance(reply, BaseException):
                    self.settle(rid, claims[rid][1], 0)
                else:
                    self.settle(rid, claims[rid][1], len(reply.session_ids), reply)
            refused: BaseException | None = None
            for rid, reply in zip(rids, replies):
                if isinstance(reply, EnvServeError) and reply.code in _RETRY_ELSEWHERE:
                    last_error = reply
                    tried.add(rid)
                elif isinstance(reply, BaseException):
                    refused = refused or reply
                else:
                    opened.extend(reply.session_ids)
                    prompt = reply.system_prompt
            if refused is not None:
                await self.close_sessions(opened)  # every replica's that opened, all or nothing
                raise refused
        if len(opened) < count:
            await self.close_sessions(opened)
            raise last_error or UnavailableError(
                grpc.StatusCode.UNAVAILABLE, f"no live replica serving {env_id!r} has room for {count} sessions")
        self.sessions.opened(opened, env_id, config, action_format, self.state_readers, self.stats_scope)
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
        if len(plans) == 1:  # one replica (a lone caller's item): no task to schedule
            r, idx = plans[0]
            try:
                replies = [await call(self.client_for(r), [items[i] for i in idx])]
            except Exception as e:  # noqa: BLE001 (as gather's return_exceptions: judged below)
                replies = [e]
        else:
            replies = await asyncio.gather(*[call(self.client_for(r), [items[i] for i in idx]) for r, idx in plans],
                                           return_exceptions=True)
        for (r, indices), reply in zip(plans, replies):
            if isinstance(reply, EnvServeError):
                code = broken_call_code(reply.code)
                gone = code == grpc.StatusCode.UNAVAILABLE and not await asyncio.to_thread(
                    self.still_listed, r.replica_id)
                details = reply.message if code == reply.code else f"{reply.code.name}: {reply.message}"
                reply = [self._unreachable(sid_of(items[i]), r, code, details, gone) for i in indices]
            elif isinstance(reply, BaseException):
                raise reply
            for i, res in zip(indices, reply):
                results[i] = res
        return results

    async def reset(self, session_ids: Sequence[str], seeds=None, task_id: str = "", split: str = "",
                    same_task: bool = False) -> list[pb.StepResult]:
        items = list(rq.reset_request(session_ids, seeds, task_id, split, same_task).items)

        async def call(c: AsyncEnvClient, its):  # in calls the replica takes (its max_batch_items)
            return await c._batched(c.env.Reset, its, lambda part: pb.ResetRequest(items=part))
        return await self._items(items, self._over_stream if self.stream_steps else call, step=False)

    async def step(self, actions: "Mapping[str, str] | Iterable[tuple]") -> list[pb.StepResult]:
        items = list(rq.step_request(actions).items)

        async def call(c: AsyncEnvClient, its):
            return await c._batched(c.env.Step, its, lambda part: pb.StepRequest(items=part))
        return await self._items(items, self._over_stream if self.stream_steps else call, step=True)

    async def step_one(self, session_id: str, action: str) -> pb.StepResult:
        """One caller's step, the common case of a sync adapter: straight onto its replica's
        stream when the session is where it was and the stream is up, with no deadline of its own
        (the caller waits with one); anything else (a first call, a lost session, a broken
        stream) takes step()'s whole path."""
        real = self.sessions.current(session_id)
        r = self._known.get(replica_of(real))
        s = self._streams.get(self.client_for(r)) if r is not None and self.stream_steps else None
        if s is not None:
            try:
                result = await s.exchange(pb.StepItem(session_id=real, action=action))
            except (EOFError, EnvServeError):
                pass  # step() drops the broken stream, opens another and reports or recovers
            else:
                if not (result.status.code and self.sessions.recoverable(session_id, result.status.code)):
                    return self.sessions.answer(session_id, result, action)
        return (await self.step([(session_id, action)]))[0]

    async def _over_stream(self, c: AsyncEnvClient, items: list) -> list[pb.StepResult]:
        """Items as items of the replica's shared Interact stream, opened on first use and again
        after one ended. A stream that broke fails its items as the call would (UNAVAILABLE, the
        server's status), so routing and recovery treat them alike."""
        s = self._streams.get(c)
        if s is None:
            s = self._streams[c] = await InteractStream(c.env, c.metadata, c.limits).__aenter__()
        exchange = s.exchange(items[0]) if len(items) == 1 else asyncio.gather(*[s.exchange(it) for it in items])
        timeout = self.client_kw["timeout"]
        try:
            if timeout is None:
                got = await exchange
            elif hasattr(asyncio, "timeout"):  # 3.11: no task per call
                async with asyncio.timeout(timeout):
                    got = await exchange
            else:
                got = await asyncio.wait_for(exchange, timeout)
            return [got] if len(items) == 1 else list(got)
        except (TimeoutError, asyncio.TimeoutError):
            # The items stay on the stream; their results, when they come, go nowhere.
            raise make_error(grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer on the stream within {timeout:g} s") from None
        except (EOFError, EnvServeError) as e:
            if self._streams.get(c) is s:
                del self._streams[c]
                await s.__aexit__(type(e), e, None)
            if isinstance(e, EnvServeError):
                raise
            raise UnavailableError(grpc.StatusCode.UNAVAILABLE, f"its Interact stream ended: {e}") from None

    async def _items(self, items: list, call, step: bool) -> list[pb.StepResult]:
        """As RoutedClient._items: sent where each session is now, lost ones rebuilt and sent again."""
        table = self.sessions

        async def send(positions):
            return await self._fan_out([_on(items[i], table.current(items[i].session_id)) for i in positions],
                                       lambda it: it.session_id, call)
        results = await send(range(len(items)))
        given_up: set[int] = set()
        for _ in range(table.settings.attempts):
            lost = self._lost_items(items, results, given_up)
            if not lost:
                break
            moved = await asyncio.to_thread(self.restore, [items[i].session_id for i in lost],
                                            self._avoid(items, results, lost))
            again = []
            for i in lost:
                got = moved[items[i].session_id]
                if isinstance(got, str):
                    again.append(i)
                else:
                    results[i] = got
                    given_up.add(i)
            for i, r in zip(again, await send(again)):
                results[i] = r
        return [table.answer(it.session_id, r, it.action if step else None) for it, r in zip(items, results)]

    async def _with_recovery(self, session_id: str, call):
        """await call(id of the session now) for one caller session, rebuilt once if it was lost."""
        table = self.sessions
        real = table.current(session_id)
        try:
            return await call(real)
        except EnvServeError as e:
            if e.code == grpc.StatusCode.UNAVAILABLE and await asyncio.to_thread(self.moved_address, real):
                return await self._with_recovery(session_id, call)
            if not table.recoverable(session_id, e.code.value[0]):
                raise
            avoid = {replica_of(real)} if e.code == grpc.StatusCode.UNAVAILABLE else set()
            got = (await asyncio.to_thread(self.restore, [session_id], avoid))[session_id]
            if not isinstance(got, str):
                raise make_error(grpc.StatusCode.DATA_LOSS, got.status.message, session_id) from None
            return await call(got)

    async def close_sessions(self, session_ids: Sequence[str]) -> list[pb.ItemStatus]:
        if not session_ids:
            return []
        real = [self.sessions.current(s) for s in session_ids]
        self.sessions.closed(session_ids)
        out = await self._fan_out(real, lambda s: s, lambda c, its: c.close_sessions(its))
        return [r if isinstance(r, pb.ItemStatus) else r.status for r in out]

    async def _session_client(self, session_id: str) -> AsyncEnvClient:
        r = await self._resolve(session_id)
        if r is None:
            raise make_error(grpc.StatusCode.DATA_LOSS,
                             f"session lost: its replica {replica_of(session_id)!r} is gone", session_id)
        return self.client_for(r)

    async def get_state(self, session_id: str, turn: int = -1, episode: int | None = None,
                        trial: int | None = None, on_behalf_of: str | None = None) -> pb.GetStateResponse:
        async def call(real):
            return await (await self._session_client(real)).get_state(real, turn, episode, trial, on_behalf_of)
        state = await self._with_recovery(session_id, call)
        state.session_id = session_id
        return state

    async def fork(self, session_id: str, count: int = 1) -> list[str]:
        async def call(real):
            return await (await self._session_client(real)).fork(real, count)
        children = await self._with_recovery(session_id, call)
        self.sessions.forked(session_id, children)
        return children

    def stream(self) -> "RoutedStream":
        return RoutedStream(self)

    async def list_envs(self) -> list[pb.EnvSpec]:
        """Every environment some live replica serves (one spec per env)."""
        specs: dict[str, pb.EnvSpec] = {}
        for r in await self._refresh():
            if not all(e in specs for e in r.envs):
                for spec in await self.client_for(r).list_envs():
                    specs.setdefault(spec.env_id, spec)
        return list(specs.values())

    async def close(self) -> None:
        await self._close_retired()
        streams, self._streams = list(self._streams.values()), {}
        for s in streams:
            await s.__aexit__(None, None, None)
        for c in list(self._clients.values()):
            await c.close()
        self._clients.clear()
        for b in list(self._blocking.values()):
            b.close()
        self._blocking.clear()
        if self._owns_directory:
            await asyncio.to_thread(self.directory.close)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()


class RoutedStream:
    """One Interact stream per replica, opened on first use, behind one send/recv interface.
    Tags are this stream's own; recv() returns (tag, StepResult) pairs from whichever replicas
    have results (at least one pair). An item whose session was lost waits while the session is
    rebuilt on a live replica and is sent again there; its caller sees only the result."""

    def __init__(self, client: AsyncRoutedClient):
        self._client = client
        self._tags = itertools.count(1)
        self._streams: dict[str, InteractStream] = {}
        self._readers: dict[InteractStream, asyncio.Task] = {}
        self._tag_map: dict[tuple[InteractStream, int], int] = {}  # (stream, its tag) -> our tag
        # stream -> our tag -> (caller's session id, item, recovery attempts so far); per stream, not
        # per replica: a replica's broken stream still settles its own items after a new one opened
        self._pending: dict[InteractStream, dict[int, tuple]] = {}
        self._ready: asyncio.Queue = asyncio.Queue()
        self._lost: list[tuple] = []  # (our tag, session, item, attempts, avoid) awaiting a rebuild
        self._recovery: asyncio.Task | None = None
        self.in_flight = 0

    async def __aenter__(self) -> "RoutedStream":
        return self

    async def __aexit__(self, *exc) -> None:
        tasks = [*self._readers.values(), *([self._recovery] if self._recovery else [])]
        for task in tasks:
            task.cancel()
        # Wait for them to end before closing their streams under them.
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in list(self._streams.values()):
            await s.__aexit__(*exc)

    async def _stream_for(self, r: ReplicaInfo) -> InteractStream:
        s = self._streams.get(r.replica_id)
        if s is None:
            c = self._client.client_for(r)
            s = self._streams[r.replica_id] = await InteractStream(c.env, c.metadata, c.limits).__aenter__()
            self._pending[s] = {}
            self._readers[s] = asyncio.get_running_loop().create_task(self._read(r, s))
        return s

    async def _read(self, r: ReplicaInfo, s: InteractStream) -> None:
        try:
            while True:
                for local, result in await s.recv():
                    ours = self._tag_map.pop((s, local))
                    sid, item, attempts = self._pending[s].pop(ours)
                    self._settle(ours, sid, item, attempts, result)
        except (EnvServeError, EOFError) as e:
            # The replica's stream broke: everything still in flight there fails, alone (or is rebuilt).
            code = e.code if isinstance(e, EnvServeError) else grpc.StatusCode.UNAVAILABLE
            code = broken_call_code(code)
            gone = code == grpc.StatusCode.UNAVAILABLE and not await asyncio.to_thread(
                self._client.still_listed, r.replica_id)
            if self._streams.get(r.replica_id) is s:
                self._streams.pop(r.replica_id, None)
            self._readers.pop(s, None)
            for ours, (sid, item, attempts) in self._pending.pop(s, {}).items():
                real = self._client.sessions.current(sid)
                self._settle(ours, sid, item, attempts, self._client._unreachable(real, r, code, str(e), gone))

    def _settle(self, ours: int, sid: str, item: tuple, attempts: int, result: pb.StepResult) -> None:
        """A result for our tag: the caller's, or (session lost) queued for a rebuild and a resend."""
        table = self._client.sessions
        if attempts < table.settings.attempts and table.recoverable(sid, result.status.code):
            avoid = {replica_of(table.current(sid))} if replica_gone(result) else set()
            self._lost.append((ours, sid, item, attempts + 1, avoid))
            if self._recovery is None:
                self._recovery = asyncio.get_running_loop().create_task(self._rebuild())
            return
        self._ready.put_nowait((ours, table.answer(sid, result, item[1] if item[0] == "step" else None)))

    async def _rebuild(self) -> None:
        """Rebuilds the sessions lost so far, together, then sends their items again."""
        try:
            while self._lost:
                await asyncio.sleep(0)  # let the rest of a broken stream's items join this batch
                batch, self._lost = self._lost, []
                avoid = set().union(*(b[4] for b in batch))
                moved = await asyncio.to_thread(self._client.restore, [b[1] for b in batch], avoid)
                for ours, sid, item, attempts, _ in batch:
                    got = moved[sid]
                    if isinstance(got, str):
                        await self._put(ours, sid, item, attempts)
                    else:
                        self._settle(ours, sid, item, self._client.sessions.settings.attempts, got)
        finally:
            self._recovery = None

    async def _put(self, ours: int, sid: str, item: tuple, attempts: int = 0) -> None:
        """Sends item (("step", action, tokens) or ("reset", seed, task_id, split, same_task)) for the caller's
        session sid to wherever that session is now."""
        real = self._client.sessions.current(sid)
        r = await self._client._resolve(real)
        if r is None:
            self._settle(ours, sid, item, attempts, self._client._lost(real, replica_of(real)))
            return
        s = await self._stream_for(r)
        try:
            local = s.send_step(real, *item[1:]) if item[0] == "step" else s.send_reset(real, *item[1:])
        except EOFError as e:
            # The call ended before its reader noticed: forget the stream; the next send opens another.
            if self._streams.get(r.replica_id) is s:
                self._streams.pop(r.replica_id, None)
            self._settle(ours, sid, item, attempts, self._client._unreachable(
                real, r, grpc.StatusCode.UNAVAILABLE, str(e), False))
            return
        self._tag_map[(s, local)] = ours
        self._pending[s][ours] = (sid, item, attempts)

    async def _send(self, session_id: str, item: tuple) -> int:
        ours = next(self._tags)
        self.in_flight += 1
        await self._put(ours, session_id, item)
        return ours

    async def send_step(self, session_id: str, action: str, generated_tokens: int = 0) -> int:
        """generated_tokens: what the caller's model generated for the action, counted into the
        episode's outcome statistics where the session has a stats scope."""
        return await self._send(session_id, ("step", action, generated_tokens))

    async def send_steps(self, actions: "Mapping[str, str] | Iterable[tuple]") -> list[int]:
        items = actions.items() if isinstance(actions, Mapping) else actions
        return [await self.send_step(*it) for it in items]

    async def send_reset(self, session_id: str, seed: int | None = None, task_id: str = "", split: str = "",
                         same_task: bool = False) -> int:
        return await self._send(session_id, ("reset", seed, task_id, split, same_task))

    async def recv(self) -> list[tuple[int, pb.StepResult]]:
        out = [await self._ready.get()]
        while not self._ready.empty():
            out.append(self._ready.get_nowait())
        self.in_flight -= len(out)
        return out
