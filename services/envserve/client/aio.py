"""AsyncEnvClient: asyncio client with EnvPool-style send/recv over the Interact stream."""
from __future__ import annotations

import asyncio
import itertools
from typing import Any, AsyncIterator, Iterable, Mapping, Sequence

import grpc

from envserve.v1 import envserve_pb2 as pb
from envserve.v1 import envserve_pb2_grpc as pb_grpc

from envserve.common.headers import ON_BEHALF
from envserve.common.tables import sessions_per_table

from . import _requests as rq
from . import seats
from .call_limits import ReplicaLimits, merged_open, parts
from .client import auth_metadata, make_channel
from .errors import EnvServeError, env_error, from_rpc_error, from_unary_error


class AsyncEnvClient:
    """The asyncio twin of EnvClient, with the same arguments; Open takes any count and a batch any
    number of items, as there (several calls in turn where the replica takes fewer in one)."""

    def __init__(self, address: str, timeout: float | None = 60.0, token: str | None = None,
                 state_token: str | None = None, root_certificates: "bytes | str | None" = None,
                 tls: bool = False, state_readers: Sequence[str] = (), stats_scope: str = "",
                 max_open_per_call: int = 0):
        self.address = address
        self.max_open_per_call = max_open_per_call
        self.limits = ReplicaLimits()
        self.state_readers = tuple(state_readers)  # see EnvClient
        self.stats_scope = stats_scope
        self.timeout = timeout
        self.channel = make_channel(address, root_certificates, tls, aio=True)
        self.env = pb_grpc.EnvServiceStub(self.channel)
        self.state = pb_grpc.StateServiceStub(self.channel)
        self.metadata = auth_metadata(token)
        self.state_metadata = auth_metadata(state_token or token)

    async def _call(self, method, request, metadata=None):
        try:
            return await method(request, timeout=self.timeout, metadata=metadata or self.metadata)
        except grpc.RpcError as e:
            raise from_unary_error(e) from None

    async def _learned_smaller(self, kind: str, sent: int) -> bool:
        """As EnvClient's: after INVALID_ARGUMENT for `sent`, whether the replica's limit, asked now, is smaller."""
        if sent <= 1 or not self.limits.unsaid(kind):
            return False
        try:
            self.limits.note(await self._call(self.env.ListEnvs, pb.ListEnvsRequest()))
        except EnvServeError:
            return False
        return self.limits.refused_as_too_many(kind, sent)

    async def _batched(self, method, items: list, build, field: str = "results") -> list:
        """A batch call's `field`, in item order, sent in parts of at most the replica's max_batch_items."""
        out: list = []
        start = 0
        while True:
            part = items[start:start + self.limits.batch_size()]
            try:
                reply = await self._call(method, build(part))
            except EnvServeError as e:
                if e.code == grpc.StatusCode.INVALID_ARGUMENT and await self._learned_smaller("batch", len(part)):
                    continue
                raise
            out.extend(getattr(reply, field))
            start += len(part)
            if start >= len(items):
                return out

    async def open(self, env_id: str, count: int = 1, config: Mapping[str, Any] | None = None,
                   action_format: str = "") -> list[str]:
        return (await self.open_with_prompt(env_id, count, config, action_format))[0]

    async def open_with_prompt(self, env_id: str, count: int = 1, config: Mapping[str, Any] | None = None,
                               action_format: str = "") -> tuple[list[str], str]:
        """(session ids, the system prompt they share: the env's rules plus the answer format)."""
        r = await self.open_sessions(env_id, count, config, action_format)
        return list(r.session_ids), r.system_prompt

    async def open_sessions(self, env_id: str, count: int = 1, config: Mapping[str, Any] | None = None,
                            action_format: str = "") -> pb.OpenResponse:
        """Open, returning the whole reply: ids, lease, the sessions' system prompt, the replica's load.
        All or none, as EnvClient.open_sessions: a count split over several Opens that fails part
        way (or is cancelled) closes what it opened."""
        replies: list[pb.OpenResponse] = []
        opened = 0
        unit = sessions_per_table(config)
        try:
            while not replies or opened < count:
                size = self.limits.open_size(self.max_open_per_call, unit)
                n = count - opened if count - opened <= size else size
                try:
                    r = await self._call(self.env.Open, rq.open_request(env_id, n, config, action_format,
                                                                        self.state_readers, self.stats_scope))
                except EnvServeError as e:
                    if e.code == grpc.StatusCode.INVALID_ARGUMENT and await self._learned_smaller("open", n):
                        continue
                    raise env_error(e) from None
                self.limits.note(r)
                replies.append(r)
                opened += len(r.session_ids)
        except BaseException:
            await self._discard([sid for r in replies for sid in r.session_ids])
            raise
        r = merged_open(replies)
        seats.note_opened(r.session_ids, config)
        return r

    async def _discard(self, session_ids: list[str]) -> None:
        """Close the sessions of an Open that failed part way (their leases reclaim them if this fails too)."""
        if session_ids:
            try:
                await self.close_sessions(session_ids)
            except (EnvServeError, asyncio.CancelledError):
                pass

    async def list_envs(self) -> list[pb.EnvSpec]:
        reply = await self._call(self.env.ListEnvs, pb.ListEnvsRequest())
        self.limits.note(reply)
        return list(reply.envs)

    async def get_spec(self, env_id: str) -> pb.EnvSpec:
        try:
            return await self._call(self.env.GetSpec, pb.GetSpecRequest(env_id=env_id))
        except EnvServeError as e:
            raise env_error(e) from None

    async def list_tasks(self, env_id: str, split: str = "", page_size: int = 0,
                         page_token: str = "") -> pb.ListTasksResponse:
        try:
            return await self._call(self.env.ListTasks, pb.ListTasksRequest(
                env_id=env_id, split=split, page_size=page_size, page_token=page_token))
        except EnvServeError as e:
            raise env_error(e) from None

    async def task_stats(self, env_id: str, scope: str | None = None) -> list[pb.TaskStat]:
        try:
            return list((await self._call(self.env.GetTaskStats, pb.GetTaskStatsRequest(
                env_id=env_id, scope=self.stats_scope if scope is None else scope))).stats)
        except EnvServeError as e:
            raise env_error(e) from None

    async def reset(self, session_ids: Sequence[str], seeds=None, task_id: str = "", split: str = "",
                    same_task: bool = False) -> list[pb.StepResult]:
        items = list(rq.reset_request(session_ids, seeds, task_id, split, same_task).items)
        return await self._batched(self.env.Reset, items, lambda part: pb.ResetRequest(items=part))

    async def step(self, actions) -> list[pb.StepResult]:
        items = list(rq.step_request(actions).items)
        return await self._batched(self.env.Step, items, lambda part: pb.StepRequest(items=part))

    async def fork(self, session_id: str, count: int = 1) -> list[str]:
        return list((await self._call(self.env.Fork, pb.ForkRequest(session_id=session_id, count=count))).session_ids)

    async def close_sessions(self, session_ids: Sequence[str]) -> list[pb.ItemStatus]:
        seats.note_closed(session_ids)
        return await self._batched(self.env.CloseSessions, list(session_ids),
                                   lambda part: pb.CloseRequest(session_ids=part), "statuses")

    async def restore(self, histories: Sequence[pb.SessionHistory]) -> pb.RestoreResponse:
        """Rebuild sessions here from their histories (one RestoredSession per history, in order).
        More than the replica rebuilds in one call (its max_open_per_call) go in several; when one of
        them fails, the sessions the others rebuilt are closed and its error raised."""
        histories = list(histories)
        size = self.limits.open_size()
        if len(histories) <= size:
            return await self._call(self.env.Restore, pb.RestoreRequest(sessions=histories))
        replies: list[pb.RestoreResponse] = []
        try:
            for part in parts(histories, size):
                replies.append(await self._call(self.env.Restore, pb.RestoreRequest(sessions=part)))
        except BaseException:
            await self._discard([s.session_id for r in replies for s in r.sessions if s.session_id])
            raise
        return pb.RestoreResponse(sessions=[s for r in replies for s in r.sessions],
                                  lease_seconds=min(r.lease_seconds for r in replies))

    async def get_state(self, session_id: str, turn: int = -1, episode: int | None = None,
                        trial: int | None = None, on_behalf_of: str | None = None) -> pb.GetStateResponse:
        """on_behalf_of: for a judge, the digest of its own caller's token (rpc.auth.owner_of): the
        replica then answers only for that caller's sessions."""
        md = self.state_metadata if on_behalf_of is None else (*self.state_metadata, (ON_BEHALF, on_behalf_of))
        return await self._call(self.state.ReadState, rq.get_state_request(session_id, turn, episode, trial), md)

    def stream(self) -> "InteractStream":
        return InteractStream(self.env, self.metadata, self.limits)

    async def step_as_completed(self, actions: "Mapping[str, str] | Iterable[tuple[str, str]]"
                                ) -> AsyncIterator[pb.StepResult]:
        """Step a batch and yield each result as soon as its session is done."""
        pairs = list(actions.items() if isinstance(actions, Mapping) else actions)
        async with self.stream() as s:
            s.send_steps(pairs)
            while s.in_flight:
                for _, result in await s.recv():
                    yield result

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()


class InteractStream:
    """One Interact call, two ways to use it.

    EnvPool style: send_* return tags at once; recv() returns the (tag, StepResult) pairs that are
    ready, whichever sessions finish first (at least one).

    One caller per session (TRL, SkyRL, OpenEnv clients: each rollout waits for its own step):
    `await stream.step(session_id, action)` / `await stream.reset(session_id, seed)` return that
    item's StepResult. Use one way or the other on a stream, not both.

    Callers that overlap share the stream: everything sent in one turn of the event loop (and
    whatever is sent while the previous message is being written) travels as one InteractRequest,
    so 64 callers stepping at once cost the wire and the server one message, not 64; a writer task
    sends and a reader task hands each result to its caller. Until a second caller first overlaps
    one in progress, a lone caller writes its item and reads its result itself, with no hand-off
    to either task (a one-session step is then a bare write and read on the call). gRPC cancels
    the call when a task awaiting one of its reads or writes is cancelled; a lone caller
    cancelled there loses only its own item, and the next send opens a new call. A message
    carries at most the replica's max_batch_items (limits: as its client heard them); more sent
    together go in several."""

    def __init__(self, stub: pb_grpc.EnvServiceStub, metadata: tuple = (), limits: "ReplicaLimits | None" = None):
        self._stub = stub
        self._metadata = metadata
        self._limits = limits or ReplicaLimits()
        self._call = None
        self._reopen = False       # a lone caller was cancelled mid-call: gRPC cancelled the call
        self._pending: list[pb.InteractItem] = []
        self._writer: asyncio.Task | None = None
        self._reader: asyncio.Task | None = None
        self._alone: asyncio.Future | None = None  # set while a lone caller holds the call
        self._waiters: dict[int, asyncio.Future] = {}
        self._closing = False
        self._tags = itertools.count(1)
        self.in_flight = 0
        self.messages_sent = 0

    async def __aenter__(self) -> "InteractStream":
        self._call = self._stub.Interact(metadata=self._metadata)
        return self

    async def __aexit__(self, *exc) -> None:
        self._closing = True
        try:
            if exc[0] is None and not self.in_flight and not self._reopen:
                await self._half_close()
            else:
                await self._abort()
        finally:
            # Also when the half-close itself is cancelled: no task is left on the call.
            for task in (self._writer, self._reader):
                if task is not None:
                    task.cancel()

    async def _half_close(self) -> None:
        """Tells the server nothing more comes, so it ends the call. The call may be ending under
        the half-close: gRPC cancels it when a task awaiting one of its reads is cancelled (a recv()
        task cancelled just before the close, as a routed stream's readers are), and grpc.aio then
        fails done_writing() with its core's batch error (ExecuteBatchError, an InternalError, not
        an RpcError: unlike write(), done_writing() does not turn it into the call's status).
        Nothing waits on the call any more, so either way it is over."""
        call = self._call
        try:
            await call.done_writing()
        except (grpc.RpcError, grpc.aio.InternalError):
            call.cancel()  # a no-op on a call that ended; ends one the half-close could not

    async def _abort(self) -> None:
        """Cancels the call; its callers still waiting get EOFError. A lone caller's write first
        waits for the call to start (grpc.aio's write() awaits the initial metadata being sent),
        and a call cancelled before it started never releases that wait: the call starts first."""
        call = self._call
        try:
            if self._alone is not None:
                await call.wait_for_connection()
        except grpc.RpcError:
            pass  # the call ended: its callers learn why from it
        except asyncio.CancelledError:
            if _task_cancelled():
                raise
            # cancelled under the wait (a lone caller cancelled in its write): over already
        finally:
            call.cancel()

    def _live_call(self):
        if self._reopen:
            self._reopen = False
            self._call.cancel()  # already cancelled, unless the caller was cancelled before its write began
            self._call = self._stub.Interact(metadata=self._metadata)
        return self._call

    def _send(self, items: list[pb.InteractItem]) -> list[int]:
        if items:
            if self._closing:
                raise EOFError("Interact stream is closed")
            if not self._reopen and self._call.done():
                raise EOFError("Interact stream ended")
            self._pending.extend(items)
            self.in_flight += len(items)
            if self._writer is None:
                self._writer = asyncio.get_running_loop().create_task(self._write_pending())
        return [it.tag for it in items]

    async def _write_pending(self) -> None:
        # Started by the first send of a loop turn, it writes on the next: that turn's sends go together.
        try:
            while self._pending:
                if self._alone is not None:
                    await asyncio.shield(self._alone)  # the lone caller's read and write come first
                    continue
                size = self._limits.batch_size()
                items, self._pending = self._pending[:size], self._pending[size:]
                self.messages_sent += 1
                await self._live_call().write(pb.InteractRequest(items=items))
        except (grpc.RpcError, asyncio.InvalidStateError):
            pass  # the call broke: its reader (recv, or the reader task) reports why
        except asyncio.CancelledError:
            if _task_cancelled():
                raise
            # The call was cancelled under the write (the stream closed): the reader reports it.
        finally:
            self._writer = None

    def send_steps(self, actions: "Mapping[str, str] | Iterable[tuple]") -> list[int]:
        """Steps from {session: action} or (session, action[, generated tokens]) tuples; their tags."""
        items = actions.items() if isinstance(actions, Mapping) else actions
        return self._send([pb.InteractItem(tag=next(self._tags), step=rq.step_item(*it)) for it in items])

    def send_step(self, session_id: str, action: str, generated_tokens: int = 0) -> int:
        return self.send_steps([(session_id, action, generated_tokens)])[0]

    def send_reset(self, session_id: str, seed: int | None = None, task_id: str = "", split: str = "",
                   same_task: bool = False) -> int:
        return self._send([self._reset_item(session_id, seed, task_id, split, same_task)])[0]

    def _reset_item(self, session_id, seed, task_id, split, same_task) -> pb.InteractItem:
        return pb.InteractItem(tag=next(self._tags), reset=rq.reset_item(session_id, seed, task_id, split, same_task))

    async def recv(self) -> list[tuple[int, pb.StepResult]]:
        if self._reader is not None or self._alone is not None:
            raise RuntimeError("this stream is read by step()/reset(): recv() would take their results")
        try:
            resp = await self._live_call().read()
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        except asyncio.CancelledError:
            if _task_cancelled():
                raise
            raise EOFError("Interact stream closed") from None
        if resp is grpc.aio.EOF:
            raise EOFError("Interact stream ended")
        self.in_flight -= len(resp.results)
        return [(r.tag, r.result) for r in resp.results]

    # -- one caller per session ---------------------------------------------------------------------
    async def step(self, session_id: str, action: str) -> pb.StepResult:
        return await self._exchange(pb.InteractItem(tag=next(self._tags),
                                                    step=pb.StepItem(session_id=session_id, action=action)))

    async def reset(self, session_id: str, seed: int | None = None, task_id: str = "", split: str = "",
                    same_task: bool = False) -> pb.StepResult:
        return await self._exchange(self._reset_item(session_id, seed, task_id, split, same_task))

    async def exchange(self, item: "pb.StepItem | pb.ResetItem") -> pb.StepResult:
        """One Step or Reset item (as a batch call takes them), awaited for its own result."""
        tag = next(self._tags)
        return await self._exchange(pb.InteractItem(tag=tag, step=item) if isinstance(item, pb.StepItem)
                                    else pb.InteractItem(tag=tag, reset=item))

    def send_to_waiters(self, pairs: "Sequence[tuple[pb.StepItem, Any]]") -> None:
        """Step items whose results go to waiters instead of awaiting tasks: anything with done(),
        set_result() and set_exception(), set on this loop by the reader task (a blocking caller's
        one-shot, handed over from its own thread with no task per item). Raises EOFError, and
        registers nothing, when the stream is closed or ended."""
        items = [pb.InteractItem(tag=next(self._tags), step=step) for step, _ in pairs]
        self._send(items)
        for item, (_, waiter) in zip(items, pairs):
            self._waiters[item.tag] = waiter
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read_all())

    async def _exchange(self, item: pb.InteractItem) -> pb.StepResult:
        if (self._reader is None and self._alone is None and self._writer is None and not self.in_flight
                and not self._closing and not seats.is_seat(_session_of(item))):
            return await self._exchange_alone(item)
        tag = self._send([item])[0]
        fut = asyncio.get_running_loop().create_future()
        self._waiters[tag] = fut
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read_all())
        return await fut

    async def _exchange_alone(self, item: pb.InteractItem) -> pb.StepResult:
        """Write the item and read its result in the caller's own task. Nothing else is written
        meanwhile (the writer waits for self._alone), so the first result read is this item's."""
        alone = self._alone = asyncio.get_running_loop().create_future()
        call = self._live_call()
        if call.done():
            self._alone = None
            alone.set_result(None)
            raise EOFError("Interact stream ended")
        self.in_flight += 1
        try:
            self.messages_sent += 1
            await call.write(pb.InteractRequest(items=[item]))
            resp = await call.read()
            if resp is grpc.aio.EOF:
                raise EOFError("Interact stream ended")
            return resp.results[0].result
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        except asyncio.CancelledError:
            if not _task_cancelled():
                raise EOFError("Interact stream closed") from None  # the call was cancelled, not the caller
            self._reopen = True  # gRPC cancelled the call with this task; only this item was on it
            raise
        finally:
            self.in_flight -= 1
            self._alone = None
            alone.set_result(None)

    async def _read_all(self) -> None:
        error: BaseException = EOFError("Interact stream ended")
        try:
            if self._alone is not None:
                await asyncio.shield(self._alone)  # a lone caller is reading its own result
            while True:
                resp = await self._live_call().read()
                if resp is grpc.aio.EOF:
                    break
                self.in_flight -= len(resp.results)
                for r in resp.results:
                    fut = self._waiters.pop(r.tag, None)
                    if fut is not None and not fut.done():
                        fut.set_result(r.result)
        except grpc.RpcError as e:
            error = from_rpc_error(e)
        except asyncio.CancelledError:
            error = EOFError("Interact stream closed")
            if _task_cancelled():
                raise
        finally:
            # Callers still waiting learn why instead of waiting forever.
            for fut in self._waiters.values():
                if not fut.done():
                    fut.set_exception(error)
            self._waiters.clear()


def _session_of(item: pb.InteractItem) -> str:
    return item.step.session_id if item.HasField("step") else item.reset.session_id


def _task_cancelled() -> bool:
    """Whether the running task is being cancelled. grpc.aio raises CancelledError from a read or
    write on a call cancelled locally (by the stream's close, say) in tasks nobody cancelled; those
    callers get EOFError instead. Before Python 3.11 the two cannot be told apart: assumed cancelled."""
    cancelling = getattr(asyncio.current_task(), "cancelling", None)
    return cancelling is None or cancelling() > 0
