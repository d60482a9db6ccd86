from __future__ import annotations

import os
import secrets
import socket
from dataclasses import dataclass, field

from envserve.common import http as http_defaults


@dataclass
class ServerConfig:
    env_ids: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 50051  # 0 picks a free port
    workers: int = 0  # 0: one per CPU
    # Step sessions in the front process, with no worker processes: for envs whose step takes
    # microseconds (the grid games), where the worker hop costs more than the step. A step
    # blocks the front while it runs, and an env that crashes the interpreter takes the replica.
    inline: bool = False
    # While one caller steps alone, the front polls its worker's reply pipe this long for each
    # step's reply before it sleeps (0: never): the reply then costs no wake-up of the front.
    lone_reply_wait_seconds: float = 0.0003
    # ... and a worker that answered such a step polls this long for the caller's next one before
    # it sleeps (0: never): the next request then costs no wake-up of the worker.
    lone_request_wait_seconds: float = 0.001
    max_sessions: int = 10_000
    max_open_per_call: int = 4096
    # Tasks one ListTasks page holds at most (a bigger page_size is cut to it), and a page's size
    # when the caller names none.
    max_tasks_page: int = 1000
    default_tasks_page: int = 100
    # Outcome statistics (GetTaskStats): how often finished episodes go to the directory, how long
    # a task unseen is remembered, and how many tasks one scope keeps (the least recent go first).
    stats_flush_seconds: float = 2.0
    stats_ttl_seconds: float = 7 * 24 * 3600.0
    stats_max_tasks: int = 20_000
    # Items of one Step, Reset, CloseSessions or InteractRequest at most (a bigger call is INVALID_ARGUMENT).
    max_batch_items: int = 4096
    # Items of one Interact stream in flight or answered but not yet read by its client; past this
    # the stream's requests wait unread (backpressure instead of memory).
    max_stream_items: int = 4096
    # Seconds one step, reset, fork copy or replay may run (0: no limit): past it the item is
    # stopped and answers DEADLINE_EXCEEDED; a worker still busy with it stuck_grace_seconds later
    # (an env that cannot be interrupted) is replaced, its sessions lost as after a crash.
    item_time_limit_seconds: float = 60.0
    stuck_grace_seconds: float = 30.0
    # How often workers are asked which sessions they hold, to close those the front does not know.
    orphan_sweep_seconds: float = 30.0
    lease_seconds: float = 300.0
    reap_interval_seconds: float = 0.0  # 0: a tenth of the lease, at most 5 s
    metrics_port: int = -1  # -1: no metrics endpoint; 0: a free port
    metrics_host: str = "127.0.0.1"
    drain_timeout_seconds: float = 60.0
    # On drain, move live sessions to other replicas in the directory (replayed there by Restore)
    # and record the moves, so clients follow; within the drain timeout.
    migrate_on_drain: bool = True
    # Lost sessions answer 'session lost' for this long, then 'unknown session'.
    lost_memory_seconds: float = 3600.0
    max_message_bytes: int = 64 * 1024 * 1024
    # Calls gRPC queues for the servicer before it refuses more (rpc/serving.py: grpc core's own
    # limit cancelled calls beyond 1,000 waiting ones).
    max_pending_calls: int = 65_536
    replica_id: str = ""
    # Also serve OpenEnv's protocol (WebSocket /openenv/<env>/ws and its HTTP routes) from this
    # process, straight to the workers (-1: off; 0: a free port); host "" means `host`.
    openenv_port: int = -1
    openenv_host: str = ""
    openenv_idle_seconds: float = 300.0
    # Also serve the environments as MCP tools (streamable HTTP at /mcp/<env>) from this process
    # (-1: off; 0: a free port); host "" means `host`. MCP sessions end after mcp_idle_seconds
    # without a request, at most mcp_max_sessions are held, and the ground-truth tool is offered
    # only with mcp_ground_truth.
    mcp_port: int = -1
    mcp_host: str = ""
    mcp_idle_seconds: float = 300.0
    mcp_max_sessions: int = http_defaults.MCP_MAX_SESSIONS
    mcp_ground_truth: bool = False
    # The replica's HTTP fronts (the OpenEnv endpoint, and `up --http-port`'s facade): request
    # bodies and WebSocket messages up to this size, OpenEnv sessions opened over plain HTTP up to
    # this many, and bearer tokens over plain HTTP from other machines only when allowed (TLS ended
    # by a proxy in front). Over TLS they serve tls_cert_file, as the gRPC port does.
    max_body_bytes: int = http_defaults.MAX_BODY_BYTES
    openenv_max_http_sessions: int = http_defaults.OPENENV_MAX_HTTP_SESSIONS
    allow_plain_http_tokens: bool = False
    # The directory replicas register in (memory:// in this process, or redis://host:port/db).
    directory_url: str = "memory://"
    advertise_address: str = ""  # host:port others reach this replica on; default host:port
    external_address: str = ""  # host:port reachable from outside (a published container port)
    heartbeat_seconds: float = 2.0  # the directory forgets a replica after two missed periods
    # Also heartbeat this soon after the live-session count or the draining flag changed, so routers
    # see closes and opens well within a period (0: every heartbeat_seconds only).
    heartbeat_on_change_seconds: float = 0.25
    # Bearer tokens: empty means no authentication. A session belongs to the token that opened it.
    tokens: tuple[str, ...] = ()
    # Tokens for StateService and MonitorService (ground truth): when set, only these read state.
    state_tokens: tuple[str, ...] = ()
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_client_ca_file: str = ""  # set: clients must present a certificate signed by this CA
    # The operator's bounds on env configs (envserve.core.limits): env id or "*" -> key -> JSON
    # Schema keywords replacing the built-in ones.
    config_limits: dict = field(default_factory=dict)

    def resolved_advertise(self, port: int) -> str:
        if self.advertise_address:
            return self.advertise_address
        host = self.host if self.host not in ("0.0.0.0", "::", "[::]", "") else socket.gethostname()
        return f"{host}:{port}"

    def resolved_workers(self) -> int:
        if self.inline:
            return 0
        return self.workers if self.workers > 0 else (os.cpu_count() or 1)

    def resolved_replica_id(self, port: int) -> str:
        # A fresh suffix per start: sessions of an earlier process on the same host and port
        # then read as lost (their replica is gone) rather than as never opened.
        rid = self.replica_id or f"{socket.gethostname()}-{port}-{secrets.token_hex(2)}"
        if "/" in rid:
            raise ValueError(f"replica id {rid!r} must not contain '/' (session ids are '<replica>/<token>')")
        return rid

    def reap_interval(self) -> float:
        return self.reap_interval_seconds or min(5.0, max(0.05, self.lease_seconds / 10))
