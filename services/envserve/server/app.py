"""Running a replica: the gRPC server with health, reflection, metrics and a SIGTERM drain."""
from __future__ import annotations

import asyncio
import logging
import signal
import sys
import threading
import time

import grpc
from grpc_health.v1 import health_pb2
from grpc_health.v1._async import HealthServicer

from envserve.v1 import envserve_pb2 as pb
from envserve.v1 import envserve_pb2_grpc as pb_grpc

from envserve.core import limits
from envserve.directory import Directory, DirectoryUnavailable, ReplicaInfo, open_directory

from envserve.rpc.parsing import add_handlers, add_health_and_reflection, add_service
from envserve.rpc.serving import add_port, server_options
from envserve.rpc.tls import server_credentials

from .config import ServerConfig
from .metrics import Metrics
from .monitor import MonitorService
from .service import EnvService, Replica, StateService
from .worker import freeze_startup_objects

log = logging.getLogger("envserve.server")
SERVICE_NAMES = ("envserve.v1.EnvService", "envserve.v1.StateService", "envserve.v1.MonitorService")


def add_env_service(servicer: EnvService, server: grpc.aio.Server) -> None:
    """Like the generated add_EnvServiceServicer_to_server, except that Reset, Step and Interact
    return bytes already serialized (results are encoded once, in the workers)."""
    def unary(fn, req, raw=False):
        return grpc.unary_unary_rpc_method_handler(
            fn, request_deserializer=req.FromString, response_serializer=None if raw else _serialize)
    handlers = {
        "ListEnvs": unary(servicer.ListEnvs, pb.ListEnvsRequest),
        "GetSpec": unary(servicer.GetSpec, pb.GetSpecRequest),
        "Open": unary(servicer.Open, pb.OpenRequest),
        "Reset": unary(servicer.Reset, pb.ResetRequest, raw=True),
        "Step": unary(servicer.Step, pb.StepRequest, raw=True),
        "Interact": grpc.stream_stream_rpc_method_handler(
            servicer.Interact, request_deserializer=pb.InteractRequest.FromString, response_serializer=None),
        "Fork": unary(servicer.Fork, pb.ForkRequest),
        "CloseSessions": unary(servicer.CloseSessions, pb.CloseRequest),
        # CloseSessions under the name release 0.1.0 gave it, for clients generated from that proto.
        "Close": unary(servicer.CloseSessions, pb.CloseRequest),
        "Restore": unary(servicer.Restore, pb.RestoreRequest),
        "ListTasks": unary(servicer.ListTasks, pb.ListTasksRequest),
        "GetTaskStats": unary(servicer.GetTaskStats, pb.GetTaskStatsRequest),
    }
    missing = set(pb.DESCRIPTOR.services_by_name["EnvService"].methods_by_name) - set(handlers)
    assert not missing, f"EnvService methods without a handler: {missing}"
    add_handlers(server, "envserve.v1.EnvService", handlers)


def _serialize(message) -> bytes:
    return message.SerializeToString()


class ReplicaServer:
    def __init__(self, config: ServerConfig, openenv_endpoint=None, mcp_endpoint=None):
        """openenv_endpoint: with config.openenv_port, makes the OpenEnv endpoint from a gateway over
        this replica's sessions (gateway, host, port, idle_seconds, config=) -> object with start(),
        stop() and url; the command line hands in envserve.web's (the server depends on no HTTP front).
        mcp_endpoint: the same for the MCP endpoint, with config.mcp_port."""
        if not config.env_ids:
            raise ValueError("serve at least one environment")
        self.config = config
        limits.install(config.config_limits, check=True, env_ids=config.env_ids)  # workers get them from the pool
        self.metrics = Metrics()
        self.replica = Replica(config, self.metrics)
        self.health = HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.port = 0
        self.metrics_port = 0
        self.directory: Directory | None = None
        self.started_unix = time.time()
        self._heartbeat: asyncio.Task | None = None
        self._stats_flush: asyncio.Task | None = None
        # Directory writes run in threads that outlive a cancelled await: the lock and the flag keep
        # a heartbeat already under way from rewriting the record after deregistration removed it.
        self._directory_lock = threading.Lock()
        self._deregistered = False
        self._stopped = asyncio.Event()
        self.openenv = None  # the OpenEnv endpoint, with --openenv-port
        self._openenv_endpoint = openenv_endpoint
        self.mcp = None  # the MCP endpoint, with --mcp-port
        self._mcp_endpoint = mcp_endpoint

    async def start(self) -> int:
        opts = [*server_options(self.config.max_message_bytes, self.config.max_pending_calls), ("grpc.so_reuseport", 0)]
        self.server = grpc.aio.server(options=opts)
        add_env_service(EnvService(self.replica), self.server)
        add_service(pb_grpc.add_StateServiceServicer_to_server, StateService(self.replica), self.server)
        add_service(pb_grpc.add_MonitorServiceServicer_to_server, MonitorService(self.replica), self.server)
        add_health_and_reflection(self.server, self.health, SERVICE_NAMES)
        self.port = add_port(self.server, self.config.host, self.config.port, server_credentials(self.config))
        await self.replica.start(self.config.resolved_replica_id(self.port))
        try:
            self.metrics.replica_capacity.set(self.config.max_sessions)
            if self.config.metrics_port >= 0:
                self.metrics_port = self.metrics.serve_http(self.config.metrics_host, self.config.metrics_port)
            await self.server.start()
            if self.config.openenv_port >= 0:
                if self._openenv_endpoint is None:
                    raise ValueError("an OpenEnv port needs the endpoint to serve on it (envserve.web's)")
                from .openenv_front import LocalGateway
                # The endpoint reads its limits and TLS files from the config.
                self.openenv = self._openenv_endpoint(LocalGateway(self.replica),
                                                      self.config.openenv_host or self.config.host,
                                                      self.config.openenv_port, self.config.openenv_idle_seconds,
                                                      config=self.config)
                self.openenv.start()
            if self.config.mcp_port >= 0:
                if self._mcp_endpoint is None:
                    raise ValueError("an MCP port needs the endpoint to serve on it (envserve.web's)")
                from .openenv_front import LocalGateway
                self.mcp = self._mcp_endpoint(LocalGateway(self.replica), self.config.mcp_host or self.config.host,
                                              self.config.mcp_port, self.config.mcp_idle_seconds, config=self.config)
                self.mcp.start()
        except BaseException:  # a port taken: the workers already started go with the rest
            await self.stop()
            raise
        for name in ("", *SERVICE_NAMES):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self.directory = open_directory(self.config.directory_url)
        self.replica.directory = self.directory
        await self._beat()
        self._heartbeat = asyncio.get_running_loop().create_task(self._heartbeat_loop())
        self._stats_flush = asyncio.get_running_loop().create_task(self._stats_loop())
        return self.port

    def replica_info(self) -> ReplicaInfo:
        address = self.config.resolved_advertise(self.port)
        metrics_host = address.rpartition(":")[0]
        return ReplicaInfo(
            replica_id=self.replica.replica_id, address=address,
            external_address=self.config.external_address, envs=list(self.config.env_ids),
            capacity=self.config.max_sessions, live_sessions=len(self.replica.sessions),
            draining=self.replica.draining, tls=bool(self.config.tls_cert_file),
            http_address=f"{metrics_host}:{self.metrics_port}" if self.metrics_port else "",
            started_unix=self.started_unix, counted_unix=time.time(),
            max_open_per_call=self.config.max_open_per_call, max_batch_items=self.config.max_batch_items)

    async def _beat(self) -> bool:
        try:
            return await asyncio.to_thread(self._write_heartbeat, self.replica_info(),
                                           2 * self.config.heartbeat_seconds)
        except DirectoryUnavailable as e:
            log.warning("directory heartbeat failed (will retry): %s", e)
            return False

    def _write_heartbeat(self, info: ReplicaInfo, ttl_seconds: float) -> bool:
        with self._directory_lock:
            if self._deregistered:
                return False
            self.directory.heartbeat(info, ttl_seconds)
            return True

    def _deregister(self) -> None:
        with self._directory_lock:
            self._deregistered = True
            self.directory.deregister(self.replica.replica_id)

    async def _heartbeat_loop(self) -> None:
        # Heartbeats rewrite the whole record, so a restarted Redis is whole again after one period.
        # Between them the loop looks at the count every heartbeat_on_change_seconds and beats early
        # when it changed: a listing's counts are then at most that old, not a period.
        period = self.config.heartbeat_seconds
        poll = self.config.heartbeat_on_change_seconds
        poll = min(poll, period) if poll > 0 else period
        last, beaten = self._counted(), time.monotonic()
        while True:
            await asyncio.sleep(poll)
            now = self._counted()
            if now == last and time.monotonic() - beaten < period - poll / 2:
                continue
            try:
                await self._beat()
            except Exception:
                log.exception("heartbeat failed")
            last, beaten = now, time.monotonic()

    async def _stats_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.stats_flush_seconds)
            await self.flush_stats()

    async def flush_stats(self) -> None:
        """Sends the episodes finished since the last flush to the directory (GetTaskStats). What
        the directory cannot take now is dropped, with a warning: statistics guide sampling, they
        are not a ledger."""
        try:
            found = await self.replica.collect_outcomes()
            for key, outcomes in found.items():
                await asyncio.to_thread(self.directory.record_outcomes, key, outcomes,
                                        self.config.stats_ttl_seconds, self.config.stats_max_tasks)
        except DirectoryUnavailable as e:
            log.warning("episode statistics not recorded: %s", e)
        except Exception:
            log.exception("episode statistics not recorded")

    def _counted(self) -> tuple[int, bool]:
        return len(self.replica.sessions), self.replica.draining

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    async def drain_and_stop(self) -> None:
        """Refuse new sessions, let in-flight calls finish, then stop."""
        if self.replica.draining:
            return
        self.replica.begin_drain()
        for name in ("", *SERVICE_NAMES):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        deadline = time.monotonic() + self.config.drain_timeout_seconds
        if self.directory is not None:
            await self._beat()  # clients stop opening sessions here at once
        finished = await self.replica.wait_idle(self.config.drain_timeout_seconds)
        log.info("drained (%s)", "all calls finished" if finished else "timed out")
        if self.config.migrate_on_drain and self.replica.sessions and deadline - time.monotonic() > 0.5:
            await self._move_sessions(deadline)
        await self.stop()

    async def _move_sessions(self, deadline: float) -> None:
        """Moves the live sessions to the other replicas in the directory, and records where each
        went there, so that clients follow. Sessions of a replica with tokens or TLS stay (a moved
        session would belong to another token; the other replicas' names are not in this one's
        certificate): their clients rebuild them from their own histories."""
        if self.config.tokens or self.config.tls_cert_file:
            log.info("drain: %d sessions not moved (tokens or TLS)", len(self.replica.sessions))
            return
        try:
            targets = await asyncio.to_thread(self.directory.replicas)
        except DirectoryUnavailable as e:
            log.warning("drain: no directory to move sessions through: %s", e)
            return
        moves, stayed = await self.replica.migrate(targets, deadline - time.monotonic())
        if moves:
            try:
                await asyncio.to_thread(self.directory.record_moves, moves, self.config.lease_seconds)
            except DirectoryUnavailable as e:
                log.warning("drain: moves not recorded (clients rebuild from their histories): %s", e)
        await self.replica.finish_moves(moves)
        self.metrics.sessions_moved.inc(len(moves))
        log.info("drain: moved %d sessions to other replicas, %d stay and end with this one", len(moves), stayed)

    async def stop(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        if self._stats_flush is not None:
            self._stats_flush.cancel()
            await self.flush_stats()   # the episodes finished since the last flush
        if self.directory is not None:
            try:
                await asyncio.wait_for(asyncio.to_thread(self._deregister), 3)
            except Exception as e:  # the TTL removes it anyway
                log.warning("deregister failed: %s", e)
        if self.openenv is not None:
            await self.openenv.stop()
        if self.mcp is not None:
            await self.mcp.stop()
        if self.server is not None:
            await self.server.stop(grace=1.0)
        await self.replica.close()
        self.metrics.close()
        self._stopped.set()

    async def wait(self) -> None:
        await self._stopped.wait()


async def serve_forever(config: ServerConfig, ready=None, openenv_endpoint=None, mcp_endpoint=None) -> None:
    server = ReplicaServer(config, openenv_endpoint, mcp_endpoint)
    await server.start()
    freeze_startup_objects()  # the front's collections (and an --inline Close's) skip its startup
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: loop.create_task(server.drain_and_stop()))
    if config.tokens and not config.tls_cert_file and config.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("tokens without TLS on %s: bearer tokens cross the network in clear; serve with --tls-cert "
                    "--tls-key unless a private network or a mesh protects this port", config.host)
    if config.inline and config.item_time_limit_seconds > 0:
        log.info("--inline: items run in the front itself, so --item-time-limit is not enforced")
    envs = ", ".join(config.env_ids)
    extra = f", metrics on :{server.metrics_port}" if server.metrics_port else ""
    inline = " (sessions step in this process)" if config.inline else ""
    if server.openenv is not None:
        print(f"envserve openenv on {server.openenv.url} (/<env_id>/ws)", flush=True)
    if server.mcp is not None:
        print(f"envserve mcp on {server.mcp.url} (/<env_id>)", flush=True)
    print(f"envserve serving {envs} on {server.address} with {config.resolved_workers()} workers{extra}{inline}",
          flush=True)
    if ready is not None:
        ready(server)
    await server.wait()


def run(config: ServerConfig, openenv_endpoint=None, mcp_endpoint=None) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    asyncio.run(serve_forever(config, openenv_endpoint=openenv_endpoint, mcp_endpoint=mcp_endpoint))
