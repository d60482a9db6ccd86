"""EnvClient: a thin synchronous client over the envserve.v1 protocol."""
from __future__ import annotations

import io
import json
from typing import Any, Iterable, Mapping, Sequence

import grpc

from envserve.v1 import envserve_pb2 as pb
from envserve.v1 import envserve_pb2_grpc as pb_grpc

from envserve.common.tables import sessions_per_table

from . import _requests as rq
from . import seats
from .call_limits import ReplicaLimits, merged_open, parts
from .errors import EnvServeError, check, env_error, from_rpc_error, from_unary_error

CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 * 1024 * 1024),
                   ("grpc.max_send_message_length", 64 * 1024 * 1024)]


def channel_credentials(root_certificates: "bytes | str | None", tls: bool):
    """TLS credentials when asked for: root_certificates is PEM bytes or a file path; tls=True alone
    uses the system roots."""
    if root_certificates is None and not tls:
        return None
    if isinstance(root_certificates, str):
        with open(root_certificates, "rb") as f:
            root_certificates = f.read()
    return grpc.ssl_channel_credentials(root_certificates)


def make_channel(address: str, root_certificates=None, tls: bool = False, aio: bool = False):
    mod = grpc.aio if aio else grpc
    creds = channel_credentials(root_certificates, tls)
    if creds is None:
        return mod.insecure_channel(address, options=CHANNEL_OPTIONS)
    return mod.secure_channel(address, creds, options=CHANNEL_OPTIONS)


def auth_metadata(token: str | None) -> tuple:
    return (("authorization", f"Bearer {token}"),) if token else ()


class ChannelOwner:
    """A blocking client that owns its channel: close() and use as a context manager."""
    channel: grpc.Channel

    def close(self) -> None:
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class EnvClient(ChannelOwner):
    """Batch calls return one StepResult per item, in order; an item's failure is in its
    `status` (see errors.check), never an exception for the whole batch. Calls that fail as a
    whole raise EnvServeError subclasses carrying the gRPC code.

    token: the bearer token sessions are bound to. state_token: a separate token for StateService,
    where the replica requires one. state_readers: names of the replica's state tokens (a judge's)
    that may read the ground truth of the sessions this client opens. stats_scope: a name (a training
    run's) under which the replica records these sessions' finished episodes (task_stats).
    root_certificates (PEM bytes or path) or tls=True: TLS.

    Open takes any count and a batch any number of items: what the replica takes in one call (its
    max_open_per_call and max_batch_items, which it says in its replies) goes in several calls, one
    after another. max_open_per_call: the most sessions this client asks for in one Open (0: as many
    as the replica takes)."""

    def __init__(self, address: str, timeout: float | None = 60.0, channel: grpc.Channel | None = None,
                 token: str | None = None, state_token: str | None = None,
                 root_certificates: "bytes | str | None" = None, tls: bool = False, state_readers: Sequence[str] = (),
                 stats_scope: str = "", max_open_per_call: int = 0):
        self.address = address
        self.max_open_per_call = max_open_per_call
        self.limits = ReplicaLimits()
        self.state_readers = tuple(state_readers)
        self.stats_scope = stats_scope
        self.timeout = timeout
        self.channel = channel or make_channel(address, root_certificates, tls)
        self.env = pb_grpc.EnvServiceStub(self.channel)
        self.state = pb_grpc.StateServiceStub(self.channel)
        self.metadata = auth_metadata(token)
        self.state_metadata = auth_metadata(state_token or token)

    def _call(self, method, request, metadata=None):
        try:
            return method(request, timeout=self.timeout, metadata=metadata or self.metadata)
        except grpc.RpcError as e:
            raise from_unary_error(e) from None

    def list_envs(self) -> list[pb.EnvSpec]:
        reply = self._call(self.env.ListEnvs, pb.ListEnvsRequest())
        self.limits.note(reply)
        return list(reply.envs)

    def _learned_smaller(self, kind: str, sent: int) -> bool:
        """After INVALID_ARGUMENT for a call of `sent` sessions or items: whether the replica, asked its
        limits now because it had not said them, takes fewer than that, so the call may go again in parts."""
        if sent <= 1 or not self.limits.unsaid(kind):
            return False
        try:
            self.limits.note(self._call(self.env.ListEnvs, pb.ListEnvsRequest()))
        except EnvServeError:
            return False
        return self.limits.refused_as_too_many(kind, sent)

    def _batched(self, method, items: list, build, field: str = "results") -> list:
        """A batch call's `field`, in item order, sent in parts of at most the replica's max_batch_items."""
        out: list = []
        start = 0
        while True:
            part = items[start:start + self.limits.batch_size()]
            try:
                reply = self._call(method, build(part))
            except EnvServeError as e:
                if e.code == grpc.StatusCode.INVALID_ARGUMENT and self._learned_smaller("batch", len(part)):
                    continue
                raise
            out.extend(getattr(reply, field))
            start += len(part)
            if start >= len(items):
                return out

    def get_spec(self, env_id: str) -> pb.EnvSpec:
        try:
            return self._call(self.env.GetSpec, pb.GetSpecRequest(env_id=env_id))
        except EnvServeError as e:
            raise env_error(e) from None

    def list_tasks(self, env_id: str, split: str = "", page_size: int = 0, page_token: str = "") -> pb.ListTasksResponse:
        """One page of a split's tasks (the first page with no token); iter_tasks walks them all."""
        try:
            return self._call(self.env.ListTasks, pb.ListTasksRequest(env_id=env_id, split=split, page_size=page_size,
                                                                      page_token=page_token))
        except EnvServeError as e:
            raise env_error(e) from None

    def task_stats(self, env_id: str, scope: str | None = None) -> list[pb.TaskStat]:
        """The finished episodes per task of a stats scope (default: this client's), as the replicas
        sharing this one's directory recorded them."""
        try:
            return list(self._call(self.env.GetTaskStats, pb.GetTaskStatsRequest(
                env_id=env_id, scope=self.stats_scope if scope is None else scope)).stats)
        except EnvServeError as e:
            raise env_error(e) from None

    def open(self, env_id: str, count: int = 1, config: Mapping[str, Any] | None = None,
             action_format: str = "") -> list[str]:
        return list(self.open_sessions(env_id, count, config, action_format).session_ids)

    def open_sessions(self, env_id: str, count: int = 1, config: Mapping[str, Any] | None = None,
                      action_format: str = "") -> pb.OpenResponse:
        """Open, returning the whole reply: ids, lease and the sessions' system prompt. All or none:
        when a count larger than one Open takes fails part way, the sessions it opened are closed
        and the failure raised."""
        replies: list[pb.OpenResponse] = []
        opened = 0
        unit = sessions_per_table(config)
        try:
            while not replies or opened < count:
                size = self.limits.open_size(self.max_open_per_call, unit)
                n = count - opened if count - opened <= size else size
                try:
                    r = self._call(self.env.Open, rq.open_request(env_id, n, config, action_format,
                                                                  self.state_readers, self.stats_scope))
                except EnvServeError as e:
                    if e.code == grpc.StatusCode.INVALID_ARGUMENT and self._learned_smaller("open", n):
                        continue
                    raise env_error(e) from None
                self.limits.note(r)
                replies.append(r)
                opened += len(r.session_ids)
        except BaseException:
            self._discard([sid for r in replies for sid in r.session_ids])
            raise
        r = merged_open(replies)
        seats.note_opened(r.session_ids, config)
        return r

    def _discard(self, session_ids: list[str]) -> None:
        """Close the sessions of an Open that failed part way; if the replica cannot be reached
        either, their leases reclaim them."""
        if session_ids:
            try:
                self.close_sessions(session_ids)
            except EnvServeError:
                pass

    def reset(self, session_ids: Sequence[str], seeds: "int | Sequence[int | None] | None" = None,
              task_id: str = "", split: str = "", same_task: bool = False) -> list[pb.StepResult]:
        items = list(rq.reset_request(session_ids, seeds, task_id, split, same_task).items)
        return self._batched(self.env.Reset, items, lambda part: pb.ResetRequest(items=part))

    def step(self, actions: "Mapping[str, str] | Iterable[tuple]") -> list[pb.StepResult]:
        items = list(rq.step_request(actions).items)
        return self._batched(self.env.Step, items, lambda part: pb.StepRequest(items=part))

    def reset_one(self, session_id: str, seed: int | None = None, **kw) -> pb.StepResult:
        return check(self.reset([session_id], [seed], **kw)[0])

    def step_one(self, session_id: str, action: str) -> pb.StepResult:
        return check(self.step([(session_id, action)])[0])

    def fork(self, session_id: str, count: int = 1) -> list[str]:
        return list(self._call(self.env.Fork, pb.ForkRequest(session_id=session_id, count=count)).session_ids)

    def close_sessions(self, session_ids: Sequence[str]) -> list[pb.ItemStatus]:
        seats.note_closed(session_ids)
        return self._batched(self.env.CloseSessions, list(session_ids), lambda part: pb.CloseRequest(session_ids=part),
                             "statuses")

    def restore(self, histories: Sequence[pb.SessionHistory]) -> pb.RestoreResponse:
        """Rebuild sessions here from their histories (one RestoredSession per history, in order).
        More than the replica rebuilds in one call (its max_open_per_call) go in several; when one of
        them fails, the sessions the others rebuilt are closed and its error raised."""
        histories = list(histories)
        size = self.limits.open_size()
        if len(histories) <= size:
            return self._call(self.env.Restore, pb.RestoreRequest(sessions=histories))
        replies: list[pb.RestoreResponse] = []
        try:
            for part in parts(histories, size):
                replies.append(self._call(self.env.Restore, pb.RestoreRequest(sessions=part)))
        except BaseException:
            self._discard([s.session_id for r in replies for s in r.sessions if s.session_id])
            raise
        return pb.RestoreResponse(sessions=[s for r in replies for s in r.sessions],
                                  lease_seconds=min(r.lease_seconds for r in replies))

    def get_state(self, session_id: str, turn: int = -1, episode: int | None = None,
                  trial: int | None = None) -> pb.GetStateResponse:
        return self._call(self.state.ReadState, rq.get_state_request(session_id, turn, episode, trial),
                          self.state_metadata)

    def interact(self, requests: Iterable[pb.InteractRequest]):
        """Blocking iterator over InteractResponses, in order of completion (see AsyncEnvClient.stream
        for the send/recv interface)."""
        try:
            yield from self.env.Interact(iter(requests), timeout=self.timeout, metadata=self.metadata)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None



def decode_image(image: pb.Image):
    """A protocol Image as an RGB uint8 numpy array."""
    import numpy as np
    from PIL import Image as PILImage
    return np.asarray(PILImage.open(io.BytesIO(image.png)).convert("RGB"))


def json_field(message, name: str) -> dict:
    """An environment-shaped value of a message (`state`, `info`, `parameters`, `config`) as plain
    Python values: its `<name>_json` text where the replica sent one, so integers stay integers,
    else the Struct (every number a float, as replicas before the JSON fields sent it)."""
    text = getattr(message, f"{name}_json", "")
    if text:
        return json.loads(text)
    from google.protobuf import json_format
    return json_format.MessageToDict(getattr(message, name))


def state_dict(response: pb.GetStateResponse) -> dict:
    """The ground truth of a GetState/ReadState reply."""
    return json_field(response, "state")


def info_dict(result: pb.StepResult) -> dict:
    """A step result's info."""
    return json_field(result, "info")
