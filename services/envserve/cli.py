"""envserve command line: serve | up | web | mcp | judge | ls | replicas | play | state | new-env | health | demo."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys


_NAMES_DEFAULT = re.compile(r"(?<!by )\bdefault\b", re.IGNORECASE)


class _HelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to an option's help where X says something: not for flags, nor for an
    empty or unset default (whose meaning the help text gives), nor where the help already names
    its default."""

    def _get_help_string(self, action):
        text = action.help or ""
        if ("%(default)" in text or _NAMES_DEFAULT.search(text) or action.nargs == 0
                or action.default in (None, "", [], argparse.SUPPRESS)):
            return text
        return text + " (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line (what was wrong, and where the help is), not the whole usage; each
    option's help shows its default (subcommands' parsers are _Parsers too)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} -h)\n")


def _number(text: str, cast, low, high, what: str, allowed: str):
    """text as cast(text) within [low, high] (NaN refused), or an argparse error naming `allowed`."""
    try:
        n = cast(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not {what}: {text!r}; {allowed}") from None
    if not low <= n <= high:
        raise argparse.ArgumentTypeError(f"{allowed}, got {text}")
    return n


def _port(text: str) -> int:
    """A TCP port to listen on: 0..65535, 0 for any free one."""
    return _number(text, int, 0, 65535, "a port number", "a port is 0..65535 (0: any free port)")


def _port_or_off(text: str) -> int:
    """A TCP port, or -1 for off."""
    return _number(text, int, -1, 65535, "a port number", "a port is 0..65535 (0: any free port), or -1 for off")


def _positive(text: str) -> int:
    return _number(text, int, 1, float("inf"), "a whole number", "must be >= 1")


def _seconds(text: str) -> float:
    return _number(text, float, 0, 1e300, "a number of seconds", "must be a finite number >= 0")


def _http_args(p: argparse.ArgumentParser, openenv: bool = True) -> None:
    """What an HTTP front accepts (envserve web and mcp, and a replica's --openenv-port, --mcp-port
    and up's --http-port); openenv: the OpenEnv endpoint's own limit too."""
    from envserve.common.http import MAX_BODY_BYTES, OPENENV_MAX_HTTP_SESSIONS
    p.add_argument("--max-body-bytes", type=_positive, default=MAX_BODY_BYTES,
                   help="HTTP fronts: refuse request bodies and WebSocket messages larger than this (413), while "
                        "they are read (default: %(default)s)")
    if openenv:
        p.add_argument("--openenv-max-http-sessions", type=_positive, default=OPENENV_MAX_HTTP_SESSIONS,
                       help="OpenEnv endpoint: sessions opened over plain HTTP (POST /reset) held at once; more "
                            "answer RESOURCE_EXHAUSTED (default: %(default)s)")
    p.add_argument("--allow-plain-http-tokens", action="store_true",
                   help="HTTP fronts: accept bearer tokens over plain HTTP from other machines (TLS ended by a "
                        "proxy in front); by default only over TLS or from this machine")


def _front_args(p: argparse.ArgumentParser, default_port: int) -> None:
    """Where an HTTP front over replicas (envserve web, mcp) finds them, and how it serves."""
    p.add_argument("--directory", default=os.environ.get("ENVSERVE_DIRECTORY", ""),
                   help="redis://host:6379/0, ray:// (or memory://) [$ENVSERVE_DIRECTORY]")
    p.add_argument("--replica", action="append", default=[], metavar="HOST:PORT", help="a fixed replica (repeatable)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 in containers)")
    p.add_argument("--port", type=_port, default=default_port, help="HTTP port (0: any free port)")
    p.add_argument("--tls-ca", default="", help="CA certificate of replicas that serve TLS")
    p.add_argument("--external", action="store_true", help="reach replicas at their external addresses")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per gRPC call")
    p.add_argument("--tls-cert", default=os.environ.get("ENVSERVE_WEB_TLS_CERT", ""),
                   help="serve HTTPS with this certificate (PEM) [$ENVSERVE_WEB_TLS_CERT]")
    p.add_argument("--tls-key", default=os.environ.get("ENVSERVE_WEB_TLS_KEY", ""),
                   help="the certificate's key (PEM) [$ENVSERVE_WEB_TLS_KEY]")
    p.add_argument("--tls-client-ca", default=os.environ.get("ENVSERVE_WEB_TLS_CLIENT_CA", ""),
                   help="require client certificates signed by this CA (mutual TLS) [$ENVSERVE_WEB_TLS_CLIENT_CA]")


def _mcp_args(p: argparse.ArgumentParser, prefix: str) -> None:
    """What an MCP endpoint holds (envserve mcp, and a replica's --mcp-port)."""
    from envserve.common.http import MCP_MAX_SESSIONS
    p.add_argument(f"{prefix}idle-seconds", type=_positive_seconds, default=300.0,
                   help="MCP endpoint: end an MCP session (and close its envserve session) after this many seconds "
                        "without a request")
    p.add_argument(f"{prefix}max-sessions", type=_positive, default=MCP_MAX_SESSIONS,
                   help="MCP endpoint: MCP sessions held at once; opening more answers 503 (default: %(default)s)")
    p.add_argument(f"{prefix}ground-truth", action="store_true",
                   help="MCP endpoint: offer the `state` tool (ReadState), read with the caller's token where the "
                        "replica lets it; off by default, so an agent under evaluation cannot read the answer")


def _positive_seconds(text: str) -> float:
    return _number(text, float, 1e-3, 1e300, "a number of seconds", "must be a finite number > 0")


def _server_args(p: argparse.ArgumentParser, default_port: int) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 in containers)")
    p.add_argument("--port", type=_port, default=default_port, help="gRPC port (0: any free port)")
    p.add_argument("--workers", type=int, default=0, help="worker processes (0: one per CPU)")
    p.add_argument("--inline", action="store_true",
                   default=os.environ.get("ENVSERVE_INLINE", "").lower() in ("1", "true", "yes"),
                   help="step sessions in the front process, no workers (microsecond envs: the grid games) "
                        "[$ENVSERVE_INLINE=1]")
    p.add_argument("--lone-reply-wait-us", type=float, default=float(os.environ.get("ENVSERVE_LONE_REPLY_WAIT_US", "300")),
                   help="while one caller steps alone, the front polls for each step's reply from its worker this "
                        "many microseconds before it sleeps (0: never) [$ENVSERVE_LONE_REPLY_WAIT_US]")
    p.add_argument("--lone-request-wait-us", type=float,
                   default=float(os.environ.get("ENVSERVE_LONE_REQUEST_WAIT_US", "1000")),
                   help="while one caller steps alone, a worker that answered its step polls for the next one "
                        "this many microseconds before it sleeps (0: never) [$ENVSERVE_LONE_REQUEST_WAIT_US]")
    p.add_argument("--max-sessions", type=_positive, default=10_000,
                   help="live sessions this replica holds at most; Open beyond answers RESOURCE_EXHAUSTED")
    p.add_argument("--max-open-per-call", type=_positive, default=4096,
                   help="sessions one Open, Fork or Restore makes at most (default: %(default)s)")
    p.add_argument("--max-tasks-page", type=_positive, default=1000,
                   help="tasks one ListTasks page holds at most; a bigger page_size is cut to it "
                        "(default: %(default)s)")
    p.add_argument("--stats-ttl-seconds", type=_seconds, default=7 * 24 * 3600.0,
                   help="a task's episode statistics (GetTaskStats) are forgotten this long after its last "
                        "recorded episode (default: %(default)s)")
    p.add_argument("--stats-max-tasks", type=_positive, default=20_000,
                   help="tasks one stats scope keeps; the least recently recorded go first (default: %(default)s)")
    p.add_argument("--max-message-bytes", type=_positive, default=64 * 1024 * 1024,
                   help="largest gRPC message received or sent (default: %(default)s)")
    p.add_argument("--max-batch-items", type=_positive, default=4096,
                   help="items of one Step, Reset, CloseSessions or Interact request at most (default: %(default)s)")
    p.add_argument("--max-stream-items", type=_positive, default=4096,
                   help="items of one Interact stream in flight or unread by its client; past it the stream's "
                        "requests wait (default: %(default)s)")
    p.add_argument("--item-time-limit", type=_seconds, default=60.0,
                   help="seconds one step, reset, fork copy or replay may run before it is stopped with "
                        "DEADLINE_EXCEEDED (0: no limit; not enforced with --inline) (default: %(default)s)")
    p.add_argument("--stuck-grace", type=_seconds, default=30.0,
                   help="seconds past --item-time-limit after which a worker still running the item is "
                        "replaced (its sessions lost, as after a crash) (default: %(default)s)")
    p.add_argument("--orphan-sweep-seconds", type=_seconds, default=30.0,
                   help="how often workers are asked which sessions they hold, to close any the front does "
                        "not know (default: %(default)s)")
    p.add_argument("--lease-seconds", type=_seconds, default=300.0,
                   help="seconds a session lives without a call before the replica closes it")
    p.add_argument("--metrics-port", type=_port_or_off, default=-1, help="Prometheus port (-1: off, 0: any free port)")
    p.add_argument("--drain-timeout", type=_seconds, default=60.0,
                   help="on SIGTERM, seconds for calls in flight to finish and live sessions to move before the "
                        "replica stops")
    p.add_argument("--no-migrate-on-drain", dest="migrate_on_drain", action="store_false",
                   help="on SIGTERM, leave live sessions to end with this replica instead of moving them")
    p.add_argument("--metrics-host", default="127.0.0.1", help="address of the metrics endpoint")
    p.add_argument("--replica-id", default=os.environ.get("ENVSERVE_REPLICA_ID", ""),
                   help="this replica's id in the directory and in its session ids (empty: HOST-PORT-random) "
                        "[$ENVSERVE_REPLICA_ID]")
    p.add_argument("--openenv-port", type=_port_or_off, default=-1,
                   help="also serve OpenEnv's protocol at http(s)://HOST:PORT/openenv/<env_id>/ (WebSocket /ws, "
                        "/reset /step /state ...) from this process, no facade hop; HTTPS with --tls-cert, "
                        "tokens checked as on gRPC (-1: off, 0: any free port)")
    p.add_argument("--openenv-host", default="", help="address of the OpenEnv endpoint (default: --host)")
    p.add_argument("--openenv-idle-seconds", type=float, default=300.0,
                   help="close OpenEnv sessions opened over plain HTTP after this many seconds without a call")
    p.add_argument("--mcp-port", type=_port_or_off, default=-1,
                   help="also serve the environments as MCP tools (streamable HTTP) at "
                        "http(s)://HOST:PORT/mcp/<env_id> from this process, no facade hop; HTTPS with --tls-cert, "
                        "tokens checked as on gRPC (-1: off, 0: any free port)")
    p.add_argument("--mcp-host", default="", help="address of the MCP endpoint (default: --host)")
    _mcp_args(p, "--mcp-")
    _http_args(p)
    # Containers and pods set these through the environment.
    env = os.environ.get
    p.add_argument("--directory", default=env("ENVSERVE_DIRECTORY", "memory://"),
                   help="memory:// (this process), redis://host:6379/0 or ray:// (a Ray cluster) [$ENVSERVE_DIRECTORY]")
    p.add_argument("--advertise", default=env("ENVSERVE_ADVERTISE", ""),
                   help="host:port other services reach this replica on [$ENVSERVE_ADVERTISE]")
    p.add_argument("--external-address", default=env("ENVSERVE_EXTERNAL_ADDRESS", ""),
                   help="host:port reachable from outside, e.g. a published port [$ENVSERVE_EXTERNAL_ADDRESS]")
    p.add_argument("--heartbeat-seconds", type=float, default=float(env("ENVSERVE_HEARTBEAT_SECONDS", "2.0")),
                   help="how often the replica rewrites its directory record, which expires after two periods "
                        "[$ENVSERVE_HEARTBEAT_SECONDS]")
    p.add_argument("--heartbeat-on-change-seconds", type=float, default=0.25,
                   help="also heartbeat this soon after the live-session count changed (0: off)")
    p.add_argument("--token-file", default=env("ENVSERVE_TOKEN_FILE", ""),
                   help="bearer tokens, one per line, each optionally followed by name=, grants=, max_sessions=, "
                        "max_in_flight=, opens_per_second=; a line '* key=value...' sets every token's default "
                        "quotas (also $ENVSERVE_TOKENS, comma separated; see docs/security.md)")
    p.add_argument("--state-token-file", default=env("ENVSERVE_STATE_TOKEN_FILE", ""),
                   help="tokens for the ground-truth services, each optionally followed by name= and reads=* "
                        "(also $ENVSERVE_STATE_TOKENS)")
    p.add_argument("--tls-cert", default=env("ENVSERVE_TLS_CERT", ""),
                   help="serve TLS with this certificate (PEM; empty: plain gRPC) [$ENVSERVE_TLS_CERT]")
    p.add_argument("--tls-key", default=env("ENVSERVE_TLS_KEY", ""),
                   help="the certificate's key (PEM) [$ENVSERVE_TLS_KEY]")
    p.add_argument("--tls-client-ca", default=env("ENVSERVE_TLS_CLIENT_CA", ""),
                   help="require client certificates signed by this CA (mutual TLS) [$ENVSERVE_TLS_CLIENT_CA]")
    p.add_argument("--config-limits", default=env("ENVSERVE_CONFIG_LIMITS", ""), metavar="FILE",
                   help="JSON or YAML mapping env ids (or '*' for the session keys every env has) to config keys "
                        "and the JSON Schema keywords that replace their built-in bounds, e.g. "
                        "'{\"sokoban\": {\"dim_room\": {\"maximum\": 12}}}' (see docs/server.md) "
                        "[$ENVSERVE_CONFIG_LIMITS]")


def _config(args, env_ids):
    from envserve.rpc.auth import Authenticator, TokenFileError, read_token_entries
    from envserve.server.config import ServerConfig
    tokens = read_token_entries(args.token_file, os.environ.get("ENVSERVE_TOKENS", ""))
    state_tokens = read_token_entries(args.state_token_file, os.environ.get("ENVSERVE_STATE_TOKENS", ""))
    try:
        Authenticator(tokens, state_tokens)
    except TokenFileError as e:
        raise SystemExit(f"envserve: {e}") from None
    return ServerConfig(env_ids=list(env_ids), host=args.host, port=args.port, workers=args.workers,
                        inline=args.inline, lone_reply_wait_seconds=args.lone_reply_wait_us / 1e6,
                        lone_request_wait_seconds=args.lone_request_wait_us / 1e6,
                        max_sessions=args.max_sessions, lease_seconds=args.lease_seconds,
                        metrics_port=args.metrics_port, metrics_host=args.metrics_host,
                        drain_timeout_seconds=args.drain_timeout, migrate_on_drain=args.migrate_on_drain,
                        replica_id=args.replica_id, openenv_port=args.openenv_port,
                        openenv_host=args.openenv_host, openenv_idle_seconds=args.openenv_idle_seconds,
                        mcp_port=args.mcp_port, mcp_host=args.mcp_host, mcp_idle_seconds=args.mcp_idle_seconds,
                        mcp_max_sessions=args.mcp_max_sessions, mcp_ground_truth=args.mcp_ground_truth,
                        directory_url=args.directory, advertise_address=args.advertise,
                        external_address=args.external_address, heartbeat_seconds=args.heartbeat_seconds,
                        heartbeat_on_change_seconds=args.heartbeat_on_change_seconds,
                        max_open_per_call=args.max_open_per_call, max_message_bytes=args.max_message_bytes,
                        max_tasks_page=args.max_tasks_page, stats_ttl_seconds=args.stats_ttl_seconds,
                        stats_max_tasks=args.stats_max_tasks,
                        max_batch_items=args.max_batch_items, max_stream_items=args.max_stream_items,
                        item_time_limit_seconds=args.item_time_limit, stuck_grace_seconds=args.stuck_grace,
                        orphan_sweep_seconds=args.orphan_sweep_seconds,
                        tokens=tokens, state_tokens=state_tokens,
                        tls_cert_file=args.tls_cert, tls_key_file=args.tls_key,
                        tls_client_ca_file=args.tls_client_ca,
                        max_body_bytes=args.max_body_bytes, openenv_max_http_sessions=args.openenv_max_http_sessions,
                        allow_plain_http_tokens=args.allow_plain_http_tokens,
                        config_limits=_config_limits(args.config_limits, env_ids))


def _config_limits(path: str, env_ids) -> dict:
    """The --config-limits file, checked against the served envs; a bad one ends the command with
    its one-line reason."""
    if not path:
        return {}
    from envserve.core.limits import LimitsError, load
    try:
        return load(path, env_ids)
    except LimitsError as e:
        raise SystemExit(f"envserve: {e}") from None


def cmd_health(args) -> int:
    """Exit 0 when the replica's gRPC health service answers SERVING (container health checks)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    if args.tls_ca:
        with open(args.tls_ca, "rb") as f:
            channel = grpc.secure_channel(args.address, grpc.ssl_channel_credentials(f.read()))
    else:
        channel = grpc.insecure_channel(args.address)
    with channel:
        try:
            status = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout).status
        except grpc.RpcError as e:
            print(f"unhealthy: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
    print(name)
    return 0 if status == health_pb2.HealthCheckResponse.SERVING else 1


def cmd_serve(args) -> int:
    from envserve.core.registry import UnknownEnvironment, get_env_class
    problems = []
    for e in args.envs:
        try:
            get_env_class(e)  # a prefix id (gymnasium:CartPole-v1) is built here to find out
        except UnknownEnvironment as err:
            problems.append(str(err))
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 2
    _run_replica(_config(args, args.envs), args)
    return 0


def _run_replica(config, args) -> None:
    """The replica, with its OpenEnv endpoint (--openenv-port) and its MCP endpoint (--mcp-port)
    where asked: envserve.web's, handed in so that the server depends on no HTTP front."""
    from envserve.server.app import run
    mcp_endpoint = None
    if config.mcp_port >= 0:
        from envserve.web.replica_endpoint import McpEndpoint
        mcp_endpoint = McpEndpoint
    run(config, openenv_endpoint=_openenv_endpoint(args), mcp_endpoint=mcp_endpoint)


def _openenv_endpoint(args):
    """The HTTP front a replica serves OpenEnv clients on, where --openenv-port asks for one."""
    if getattr(args, "openenv_port", -1) < 0:
        return None
    from envserve.web.replica_endpoint import OpenEnvEndpoint
    return OpenEnvEndpoint


def cmd_up(args) -> int:
    """Every registered environment on one local replica, worker processes per CPU; or, with
    --containers, one container per environment from the family images, with Redis."""
    if args.containers:
        if args.inline:
            print("--inline runs one process's sessions in its front; with --containers, set "
                  "ENVSERVE_INLINE=1 on the grid games' container instead", file=sys.stderr)
            return 2
        from envserve.containers import up
        return up(args.envs or None, tag=args.image_tag, redis_image=args.redis_image,
                  first_port=args.port, workers=args.workers)
    from envserve.core.registry import env_ids
    envs = args.envs or env_ids()
    print(f"envserve up: {len(envs)} environments; connect with EnvClient('{args.host}:{args.port}')", flush=True)
    if args.http_port >= 0:
        _web_beside_replica(args)
    _run_replica(_config(args, envs), args)
    return 0


def _web_beside_replica(args) -> None:
    """The HTTP facade in this process; it finds the replica through the same directory
    (memory:// by default, where the replica registers itself). With the replica's TLS files it
    serves HTTPS, and reaches the replica trusting --tls-ca (default: the replica's certificate,
    which is enough for a self-signed one)."""
    from envserve.web import create_app, start_in_thread
    from envserve.web.server import TlsFiles, display
    tls = TlsFiles.of(args.tls_cert, args.tls_key, args.tls_client_ca)
    root = None
    if tls is not None:
        with open(args.tls_ca or args.tls_cert, "rb") as f:
            root = f.read()
    app = create_app(directory_url=args.directory or "memory://", root_certificates=root,
                     openenv_idle_seconds=args.openenv_idle_seconds, limits=_http_limits(args))
    _, port = start_in_thread(app, args.http_host, args.http_port, tls)
    print(f"envserve web on {display(args.http_host, port, tls is not None)}", flush=True)


def _http_limits(args):
    from envserve.web.limits import HttpLimits
    return HttpLimits(max_body_bytes=args.max_body_bytes, openenv_max_http_sessions=args.openenv_max_http_sessions,
                      allow_plain_http_tokens=args.allow_plain_http_tokens)


def _front_over_replicas(args, name: str):
    """(its TLS files, the replicas' CA) for an HTTP front over replicas (`web`, `mcp`), or None
    after saying on stderr what is wrong with its arguments."""
    from envserve.web.server import TlsFiles
    if not args.directory and not args.replica:
        print(f"envserve {name}: give --directory URL and/or --replica HOST:PORT", file=sys.stderr)
        return None
    try:
        tls = TlsFiles.of(args.tls_cert, args.tls_key, args.tls_client_ca)
    except ValueError as e:
        print(f"envserve {name}: {e}", file=sys.stderr)
        return None
    root = None
    if args.tls_ca:
        with open(args.tls_ca, "rb") as f:
            root = f.read()
    return tls, root


def cmd_web(args) -> int:
    """The HTTP/JSON facade and the live sessions page, over the replicas of a directory and/or
    fixed addresses."""
    from envserve.web import create_app, serve
    front = _front_over_replicas(args, "web")
    if front is None:
        return 2
    tls, root = front
    token = os.environ.get("ENVSERVE_MONITOR_TOKEN", "")
    if args.monitor_token_file:
        from envserve.rpc.auth import read_tokens
        token = (read_tokens(args.monitor_token_file) or ("",))[0]
    app = create_app(directory_url=args.directory, replicas=args.replica, root_certificates=root,
                     use_external=args.external, monitor_token=token or None, timeout=args.timeout,
                     openenv_idle_seconds=args.openenv_idle_seconds, limits=_http_limits(args))
    sources = ([f"directory {args.directory}"] if args.directory else []) + list(args.replica)
    try:
        serve(app, args.host, args.port, announce=f" over {', '.join(sources)}", tls=tls)
    except ValueError as e:  # TLS files it cannot use
        print(f"envserve web: {e}", file=sys.stderr)
        return 2
    return 0


def cmd_mcp(args) -> int:
    """Environments as MCP tools (streamable HTTP) at /mcp/<env_id>, over the replicas of a
    directory and/or fixed addresses, routed and authorised as the HTTP facade's doors are."""
    from envserve.web.gateway import Gateway
    from envserve.web.limits import HttpLimits
    from envserve.web.mcp import McpSettings, create_mcp_app
    from envserve.web.routing import ReplicaTable
    from envserve.web.server import serve
    front = _front_over_replicas(args, "mcp")
    if front is None:
        return 2
    tls, root = front
    limits = HttpLimits(max_body_bytes=args.max_body_bytes, allow_plain_http_tokens=args.allow_plain_http_tokens)
    table = ReplicaTable(args.directory, args.replica, root, args.external, 1.0, args.timeout)
    settings = McpSettings(idle_seconds=args.idle_seconds, max_sessions=args.max_sessions,
                           ground_truth=args.ground_truth)
    app = create_mcp_app(Gateway(table, args.timeout, limits.token_cache_entries), settings, limits)
    sources = ([f"directory {args.directory}"] if args.directory else []) + list(args.replica)
    try:
        serve(app, args.host, args.port, announce=f" over {', '.join(sources)}", tls=tls, name="mcp",
              path="/mcp")
    except ValueError as e:  # TLS files it cannot use
        print(f"envserve mcp: {e}", file=sys.stderr)
        return 2
    return 0


def cmd_judge(args) -> int:
    """The JudgeService over the replicas of a directory or one fixed replica; with --preview, the
    prompt its LLM judge would send for one agent reply."""
    if args.preview:
        return cmd_judge_preview(args)
    from envserve.judge.app import JudgeServer, JudgeServerConfig, run
    from envserve.rpc.auth import read_tokens
    settings = JudgeServerConfig.read_file(args.config) if args.config else {}
    judges = dict(settings.get("judges") or {})
    for pair in args.judge:
        env_id, sep, name = pair.partition("=")
        if not sep:
            print(f"envserve judge: --judge takes ENV=JUDGE, got {pair!r}", file=sys.stderr)
            return 2
        judges[env_id] = name
    llm = dict(settings.get("llm") or {})
    for key, value in (("base_url", args.llm_base_url), ("model", args.llm_model), ("mode", args.llm_mode)):
        if value:
            llm[key] = value
    # The first token of the file or of the variable (a Secret may hold a comma-separated list).
    state_token = (read_tokens(args.state_token_file,
                               "" if args.state_token_file else os.environ.get("ENVSERVE_STATE_TOKEN", ""))
                   or ("",))[0]
    try:
        config = JudgeServerConfig(
            host=args.host, port=args.port, env_address=args.env_address,
            directory_url="" if args.env_address else args.directory, state_token=state_token,
            env_tls_ca_file=args.env_tls_ca, scoring=settings.get("scoring") or {}, llm=llm or None,
            judges=judges, fallback=args.fallback or settings.get("fallback", "") or ("llm" if llm else ""),
            max_concurrent_items=int(settings.get("max_concurrent_items", args.max_concurrent_items)),
            truth_cache_records=int(settings.get("truth_cache_records", JudgeServerConfig.truth_cache_records)),
            truth_cache_seconds=float(settings.get("truth_cache_seconds", JudgeServerConfig.truth_cache_seconds)),
            metrics_port=args.metrics_port, metrics_host=args.metrics_host,
            tokens=read_tokens(args.token_file, os.environ.get("ENVSERVE_JUDGE_TOKENS", "")),
            tls_cert_file=args.tls_cert, tls_key_file=args.tls_key, tls_client_ca_file=args.tls_client_ca)
        server = JudgeServer(config)  # refuses unknown settings and judges before anything starts
    except ValueError as e:
        print(f"envserve judge: {e}", file=sys.stderr)
        return 2
    run(server)
    return 0


def cmd_ls(args) -> int:
    if args.address:
        from envserve.client import EnvClient
        with EnvClient(args.address) as c:
            specs = c.list_envs()
        for s in specs:
            print(f"{s.env_id:16s} {','.join(s.modalities):11s} max_turns={s.max_turns:<3d} "
                  f"actions/turn={s.max_actions_per_turn}  {s.description}")
        return 0
    from envserve.core.registry import env_ids, get_env_class, prefix_examples, prefixes
    for e in env_ids():
        spec = get_env_class(e).spec
        print(f"{e:16s} {','.join(spec.modalities):11s} {spec.description}")
    # Prefix families serve open-ended ids: their description and the ids they can serve here.
    for prefix, family in sorted(prefixes().items()):
        print(f"{prefix + ':<id>':16s} {'':11s} {family.description}")
        for e in prefix_examples(prefix):
            print(f"  {e:30s} {','.join(get_env_class(e).spec.modalities)}")
    return 0


def cmd_replicas(args) -> int:
    """The live replicas a directory lists, with their load."""
    from envserve.directory import open_directory
    with open_directory(args.directory) as d:
        found = d.replicas(args.env or None)
    for r in sorted(found, key=lambda r: r.replica_id):
        state = "draining" if r.draining else "serving"
        print(f"{r.replica_id:28s} {r.address:22s} {r.live_sessions:>6d}/{r.capacity:<6d} {state:8s} "
              f"{','.join(r.envs)}")
    if not found:
        print("no live replicas", file=sys.stderr)
    return 0 if found else 1


def cmd_ray_up(args) -> int:
    """A fleet of replicas as Ray actors on the cluster at --address, sized by load until
    interrupted (SIGINT/SIGTERM drain it); clients anywhere in the cluster find it at ray://."""
    import signal
    import threading
    try:
        import ray
    except ImportError:
        print("envserve ray: needs ray (pip install 'envserve[ray]')", file=sys.stderr)
        return 2
    from envserve.ray import Fleet, FleetConfig
    serve_args = args.serve_args[1:] if args.serve_args[:1] == ["--"] else args.serve_args
    try:
        config = FleetConfig(families=[f.strip() for f in args.families.split(",") if f.strip()],
                             replicas_per_node=args.replicas_per_node, min_replicas=args.min_replicas,
                             max_replicas=args.max_replicas, replica_cpus=args.replica_cpus,
                             replica_gpus=args.replica_gpus, serve_args=serve_args, directory_url=args.directory,
                             target_load=args.target_load, scale_down_after_seconds=args.scale_down_after)
    except ValueError as e:
        print(f"envserve ray: {e}", file=sys.stderr)
        return 2
    try:
        ray.init(address=args.address, log_to_driver=args.replica_logs, configure_logging=False)
    except ConnectionError as e:
        print(f"envserve ray: no Ray cluster at {args.address}: {e}", file=sys.stderr)
        return 1
    fleet = Fleet(config)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        try:
            started = fleet.start()
        except ray.exceptions.RayError as e:  # a replica that cannot start (an env not installed there)
            print(f"envserve ray: the fleet did not start: {e}", file=sys.stderr)
            return 1
        for r in sorted(started, key=lambda r: (r["family"], r["replica_id"])):
            print(f"envserve ray: {r['family']} replica {r['replica_id']} at {r['address']} "
                  f"on node {r['node_id'][:12]}", flush=True)
        print(f"envserve ray: fleet up ({', '.join(f'{k}: {v}' for k, v in fleet.sizes().items())}); "
              f"clients in the cluster use {fleet.config.directory_url}", flush=True)
        if args.autoscale_seconds > 0:
            fleet.run_autoscaler(args.autoscale_seconds)
        stop.wait()
    finally:
        print("envserve ray: draining the fleet", flush=True)
        fleet.shutdown()
    return 0


def cmd_play(args) -> int:
    """A person plays one episode in the terminal, against a server or an embedded one."""
    from envserve.client import EnvClient
    if args.address:
        return _play(EnvClient(args.address), args)
    with _embedded_server([args.env]) as address:
        return _play(EnvClient(address), args)


@contextlib.contextmanager
def _embedded_server(env_ids):
    """A replica with one worker in a thread of this process, on a free loopback port; yields its address."""
    import asyncio
    import threading
    from envserve.server.app import ReplicaServer
    from envserve.server.config import ServerConfig

    holder = {}
    ready = threading.Event()

    def serve():
        async def main():
            try:
                server = ReplicaServer(ServerConfig(env_ids=list(env_ids), port=0, workers=1))
                await server.start()
            except BaseException as e:   # reported by the caller's thread
                holder["error"] = e
                ready.set()
                return
            holder["server"], holder["loop"] = server, asyncio.get_running_loop()
            ready.set()
            await server.wait()
        asyncio.run(main())

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    ready.wait()
    if "error" in holder:
        raise holder["error"]
    try:
        yield holder["server"].address
    finally:
        asyncio.run_coroutine_threadsafe(holder["server"].stop(), holder["loop"]).result(10)


def _play(client, args) -> int:
    from envserve.client import check
    spec = client.get_spec(args.env)
    config = json.loads(args.config) if args.config else None
    sid = client.open(args.env, 1, config, "no_think")[0]
    print(spec.system_prompt)
    print(f"\nType actions as in: {spec.action_space}. Several per turn are separated by commas. "
          f"'q' quits.\n")
    r = check(client.reset([sid], [args.seed])[0])
    total = 0.0
    while True:
        print(r.observation.text)
        if r.feedback:
            print(f"({r.feedback})")
        if r.done or r.truncated:
            outcome = "solved" if r.success else ("out of turns" if r.truncated else "failed")
            print(f"\nEpisode over: {outcome}; return {total:.2f}")
            break
        try:
            line = input(f"turn {r.turn + 1}> ")
        except EOFError:
            break
        if line.strip().lower() in ("q", "quit", "exit"):
            break
        r = check(client.step([(sid, f"<answer>{line}</answer>")])[0])
        total += r.reward
        print(f"reward {r.reward:+.2f} {dict(r.reward_components)}\n")
    client.close_sessions([sid])
    client.close()
    return 0


# -- ground truth from the command line: `state` and `judge --preview` ---------------------------------
class _CliError(Exception):
    """Bad input or a failed call: the message goes to stderr, the exit status is `status`."""

    def __init__(self, message: str, status: int = 2):
        super().__init__(message)
        self.status = status


def _first_token(path: str) -> str | None:
    from envserve.rpc.auth import read_tokens
    return (read_tokens(path) or (None,))[0] if path else None


@contextlib.contextmanager
def _truth_client(env_id: str, address: str, token_file: str = "", state_token_file: str = "", tls_ca: str = ""):
    """A client of the replica at `address`, or of a replica started in this process for env_id."""
    from envserve.client import EnvClient
    if address:
        with EnvClient(address, token=_first_token(token_file), state_token=_first_token(state_token_file),
                       root_certificates=tls_ca or None) as client:
            yield client
        return
    from envserve.core.registry import env_ids, is_known
    if not is_known(env_id):
        raise _CliError(f"unknown environment {env_id!r}; registered here: {env_ids()} (or give a replica's address)")
    with _embedded_server([env_id]) as local, EnvClient(local) as client:
        yield client


def cmd_tasks(args) -> int:
    """`tasks list`: a split's tasks as a table; `tasks export`: as the dataset a trainer reads."""
    from envserve.client.errors import EnvServeError
    try:
        return _tasks(args)
    except _CliError as e:
        print(f"envserve tasks {args.tasks_command}: {e}", file=sys.stderr)
        return e.status
    except EnvServeError as e:
        print(f"envserve tasks {args.tasks_command}: {e}", file=sys.stderr)
        return 1


def _tasks(args) -> int:
    from envserve.client import iter_tasks
    if args.limit < 0:
        raise _CliError(f"--limit must be >= 0, got {args.limit}")
    with _truth_client(args.env, args.address, args.token_file, tls_ca=args.tls_ca) as client:
        spec = client.get_spec(args.env)
        split = args.split or spec.splits[0].name
        total = next((s.num_tasks for s in spec.splits if s.name == split), None)
        if total is None:
            raise _CliError(f"unknown split {split!r}; {args.env} has {[s.name for s in spec.splits]}")
        tasks = iter_tasks(client, args.env, split, limit=args.limit or None)
        if args.tasks_command == "list":
            for t in tasks:
                print(f"{t.task_id:>12s}  {t.task_type:30s} {t.description}")
            print(f"{split}: {total} tasks", file=sys.stderr)
            return 0
        from envserve.integrations import task_rows
        data = task_rows.rows(args.format, spec, (task_rows.task_dict(args.env, t) for t in tasks), args.agent_name)
    task_rows.write(args.format, data, args.out)
    print(f"wrote {args.out}: {len(data)} {args.format} rows of {args.env} {split} ({total} tasks in the split)")
    return 0


def _turn_text(action: str) -> str:
    """An action as a turn's text: a bare action goes in <answer> tags; a full reply stays as it is."""
    return action if "<" in action else f"<answer>{action}</answer>"


def _env_config(text: str) -> dict | None:
    if not text:
        return None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise _CliError(f"the env config must be a JSON object: {e}") from None
    if not isinstance(config, dict):
        raise _CliError(f"the env config must be a JSON object, got {text!r}")
    return config


def _fresh_session(client, env_id: str, config: dict | None, seed: int, actions) -> tuple[str, object]:
    """A new session of env_id reset with seed, after one turn per action; (session id, last result).
    Invalid actions are reported on stderr and count as turns, as they do for an agent."""
    from envserve.client import check
    sid = client.open(env_id, 1, config, "no_think")[0]
    r = check(client.reset([sid], [seed])[0])
    for k, action in enumerate(actions, 1):
        if r.done or r.truncated:
            client.close_sessions([sid])
            raise _CliError(f"the episode ended at turn {r.turn}, before action {k} ({action!r})", 1)
        r = check(client.step([(sid, _turn_text(action))])[0])
        if not r.action_valid:
            print(f"turn {r.turn}: {action!r} was not valid: {r.feedback}", file=sys.stderr)
    return sid, r


def _plain_numbers(value):
    """Struct carries every number as a double: show the integral ones as integers. Its maps keep
    no order: keys are sorted, so the same state prints the same."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _plain_numbers(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [_plain_numbers(v) for v in value]
    return value


def _pretty_json(value, indent: int = 0, width: int = 100) -> str:
    """Indented JSON; a list that fits in the width, or holds no list or object, stays on one line."""
    pad, inner = " " * indent, " " * (indent + 2)
    one_line = json.dumps(value, ensure_ascii=False)
    if isinstance(value, list) and len(one_line) + indent <= width:
        return one_line
    if isinstance(value, dict) and value:
        items = [f"{inner}{json.dumps(k, ensure_ascii=False)}: {_pretty_json(v, indent + 2, width)}"
                 for k, v in value.items()]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    if isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value):
        return "[\n" + ",\n".join(f"{inner}{_pretty_json(v, indent + 2, width)}" for v in value) + f"\n{pad}]"
    return one_line


def _record_json(response, session_id: str = "") -> dict:
    from envserve.client import state_dict
    out = {"env_id": response.env_id}
    if session_id:
        out["session_id"] = session_id
    out.update(trial=response.trial, episode=response.episode, turn=response.turn, anchor=response.anchor,
               observation_text=response.observation_text, state=_plain_numbers(state_dict(response)))
    return out


def cmd_state(args) -> int:
    """A session's ground truth (GetState): a live session's on a replica, or a fresh session's after
    --seed and --action turns."""
    from envserve.client.errors import EnvServeError
    try:
        if args.session and (args.action or args.seed is not None or args.config):
            raise _CliError("give --session (a live session) or --seed/--action/--config (a fresh one), not both")
        if args.session and not args.address:
            raise _CliError("--session needs the --address of the replica that holds it")
        with _truth_client(args.env, args.address, args.token_file, args.state_token_file, args.tls_ca) as client:
            if args.session:
                response = client.get_state(args.session, args.turn, args.episode)
                if response.env_id != args.env:
                    raise _CliError(f"session {args.session} is a {response.env_id!r} session, not {args.env!r}")
                sid = args.session
            else:
                sid, _ = _fresh_session(client, args.env, _env_config(args.config), args.seed or 0, args.action)
                try:
                    response = client.get_state(sid, args.turn)
                finally:
                    client.close_sessions([sid])
                sid = ""
    except _CliError as e:
        print(f"envserve state: {e}", file=sys.stderr)
        return e.status
    except EnvServeError as e:
        print(f"envserve state: {e}", file=sys.stderr)
        return 1
    record = _record_json(response, sid)
    if args.json:
        record["relations"] = list(response.relations)
        print(json.dumps(record, indent=2, ensure_ascii=False))
        return 0
    print(_pretty_json(record))
    if response.relations:
        print("\nRelations:")
        for sentence in response.relations:
            print(f"- {sentence}")
    return 0


_REPLY_FIELDS = {"grounding": "observation", "world_modeling": "prediction"}


def _tag(text: str, tag: str) -> str | None:
    m = re.search(rf"<{tag}>(.*?)</{tag}>", text, re.DOTALL | re.IGNORECASE)
    return m.group(1).strip() if m else None


def cmd_judge_preview(args) -> int:
    """The prompt(s) the LLM judge would send for one agent reply, with the ground truth it reads."""
    from envserve.client.errors import EnvServeError
    try:
        prompts = _judge_previews(args)
    except _CliError as e:
        print(f"envserve judge --preview: {e}", file=sys.stderr)
        return e.status
    except EnvServeError as e:
        print(f"envserve judge --preview: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({p["field"]: p["body"] for p in prompts}, indent=2, ensure_ascii=False))
        return 0
    for k, p in enumerate(prompts):
        if k:
            print()
        for line in p["notes"]:
            print(f"# {line}")
        for message in p["body"]["messages"] if p["body"] else ():
            print(f"--- {message['role']} ---")
            print(message["content"])
    return 0


def _judge_previews(args) -> list[dict]:
    from envserve.client.errors import EnvServeError
    from envserve.judge import JudgeConfig
    from envserve.judge.app import JudgeServerConfig
    from envserve.judge.prompts import MAX_STATE_CHARS, judge_prompt, prompt_family, state_cut
    from envserve.judge.service import record_of

    if not args.env and not args.session:
        raise _CliError("--preview needs --env ENV (a fresh session) or --env-address and --session SID")
    if args.session and not args.env_address:
        raise _CliError("--session needs the --env-address of the replica that holds it")
    if args.session and (args.action or args.seed is not None or args.env_config):
        raise _CliError("give --session (a live session) or --seed/--action/--env-config (a fresh one), not both")
    reply = sys.stdin.read() if args.reply == "-" else args.reply
    if reply is None:
        raise _CliError("--preview needs the agent's --reply (its whole text for the turn; '-' reads stdin)")
    if args.field:
        fields = [args.field]
    else:
        fields = [f for f, tag in _REPLY_FIELDS.items() if _tag(reply, tag) is not None]
        if not fields:
            raise _CliError("the reply has no <observation> or <prediction>: give --field to judge the whole "
                            "reply as that field's text")
    settings = JudgeServerConfig.read_file(args.config) if args.config else {}
    try:
        scoring = JudgeConfig.from_mapping(settings.get("scoring") or {})
    except ValueError as e:
        raise _CliError(f"scoring settings: {e}") from None
    llm = dict(settings.get("llm") or {})
    for key, value in (("base_url", args.llm_base_url), ("model", args.llm_model), ("mode", args.llm_mode)):
        if value:
            llm[key] = value
    mode = llm.get("mode") or "yesno"
    llm_config = None
    if args.json:
        from envserve.judge.llm_judge import LLMJudgeConfig
        try:
            llm_config = LLMJudgeConfig.from_mapping(llm)
        except ValueError as e:
            raise _CliError(f"--json prints the whole request, which needs the judge's LLM settings "
                            f"(--llm-model, or llm in --config): {e}") from None
    texts = {f: _tag(reply, _REPLY_FIELDS[f]) for f in fields}
    texts = {f: (t if t is not None else reply.strip()) for f, t in texts.items()}

    with _truth_client(args.env, args.env_address, args.env_token_file, args.state_token_file,
                       args.env_tls_ca) as client:
        if args.session:
            now = client.get_state(args.session, args.turn)
            env_id = now.env_id
            if args.env and args.env != env_id:
                raise _CliError(f"session {args.session} is a {env_id!r} session, not {args.env!r}")

            def after():
                try:
                    return client.get_state(args.session, now.turn + 1, now.episode, now.trial)
                except EnvServeError as e:
                    raise _CliError(f"world modelling reads turn {now.turn + 1}, which the session does not "
                                    f"have ({e})", 1) from None
            sid = ""
        else:
            env_id = args.env
            sid, _ = _fresh_session(client, env_id, _env_config(args.env_config), args.seed or 0, args.action)
            now = client.get_state(sid, -1)

            def after():
                answer = _tag(reply, "answer")
                if answer is None:
                    raise _CliError("world modelling is judged against the state after the reply's action(s): "
                                    "the reply needs its <answer>")
                from envserve.client import check
                r = check(client.step([(sid, f"<answer>{answer}</answer>")])[0])
                if not r.action_valid:
                    print(f"the reply's action {answer!r} was not valid: {r.feedback}", file=sys.stderr)
                return client.get_state(sid, -1)
        try:
            records = {"grounding": record_of(now)}
            if "world_modeling" in fields:
                records["world_modeling"] = record_of(after())
        finally:
            if sid:
                client.close_sessions([sid])

    out = []
    for f in fields:
        truth = records[f]
        previous = records["grounding"] if f == "world_modeling" else None
        family = prompt_family(env_id, truth["state"])
        used = mode if mode != "structured" or _family_has_claims(family) else "yesno"
        notes = [f"LLM judge prompt: env {env_id}, field {f}, mode {used}, prompt family {family}",
                 f"ground truth: turn {truth['turn']} of episode {truth['episode']} (anchor {truth['anchor']})"
                 + (f", after the state of turn {previous['turn']}" if previous else "")]
        for record in ([previous] if previous else []) + [truth]:
            cut = state_cut(family, record)
            if cut:
                notes.append(f"the state JSON of turn {record['turn']} is cut at {MAX_STATE_CHARS} characters: "
                             f"{cut} more are left out")
        if not texts[f]:
            notes.append(f"the agent wrote no {f} text: the judge scores 0 without asking the model")
            out.append({"field": f, "notes": notes, "body": None})
            continue
        try:
            prompt = judge_prompt(used, env_id, f, texts[f], truth, previous, scoring)
        except ValueError as e:
            raise _CliError(str(e)) from None
        if llm_config is not None:
            from envserve.judge.llm_judge import request_body
            body = request_body(llm_config, prompt)
        else:
            body = {"messages": list(prompt.messages)}
        out.append({"field": f, "notes": notes, "body": body})
    return out


def _family_has_claims(family: str) -> bool:
    from envserve.judge.prompts import claim_family
    return claim_family(family) is not None


def cmd_new_env(args) -> int:
    """Writes an out-of-tree environment package: pyproject with the entry point, the env, its tests."""
    from envserve.scaffold import scaffold
    try:
        root = scaffold(args.name, args.dir or args.name)
    except ValueError as e:
        print(f"envserve new-env: {e}", file=sys.stderr)
        return 2
    print(f"wrote the {args.name!r} environment package to {root}")
    print(f"next: pip install -e {root}  (registers it with envserve), then: envserve serve {args.name}")
    print(f"      pytest {root}/tests  (its own test and envserve's conformance suite)")
    return 0


def cmd_demo(args) -> int:
    from envserve.demo import main as demo_main
    return demo_main(args.address, args.port)


def build_parser() -> argparse.ArgumentParser:
    """The parser of every subcommand; building it imports no server and starts nothing."""
    parser = _Parser(prog="envserve", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("serve", help="serve environments on one replica")
    p.add_argument("envs", nargs="+", help="environment ids to serve (see `envserve ls`)")
    _server_args(p, 50051)
    p.set_defaults(fn=cmd_serve)
    p = sub.add_parser("up", help="a local stack of all registered environments")
    p.add_argument("envs", nargs="*", help="default: all registered")
    _server_args(p, 50051)
    p.add_argument("--http-port", type=_port_or_off, default=-1,
                   help="also serve the HTTP facade and live page (-1: off); HTTPS with --tls-cert")
    p.add_argument("--http-host", default="127.0.0.1", help="address the HTTP facade binds")
    p.add_argument("--tls-ca", default="", help="with --http-port and --tls-cert: the CA the facade trusts the "
                                                "replica's certificate by (default: that certificate itself)")
    p.add_argument("--containers", action="store_true",
                   help="run each environment in its family's image (docker or podman) with Redis")
    p.add_argument("--image-tag", default="latest", help="with --containers: the images' tag")
    p.add_argument("--redis-image", default="", help="with --containers: default redis:7-alpine "
                   "[$ENVSERVE_REDIS_IMAGE]")
    p.set_defaults(fn=cmd_up)
    p = sub.add_parser("web", help="HTTP/JSON facade and live sessions page over replicas")
    _front_args(p, 8080)
    p.add_argument("--monitor-token-file", default="",
                   help="the token that shows every session on the live page (a state token of the replicas): "
                        "/v1/live then needs a bearer token, and another token sees what the replicas show it "
                        "[$ENVSERVE_MONITOR_TOKEN]")
    p.add_argument("--openenv-idle-seconds", type=float, default=300.0,
                   help="OpenEnv endpoint (/openenv/<env>/): close sessions opened over plain HTTP after this "
                        "many seconds without a call (WebSocket sessions close with their socket)")
    _http_args(p)
    p.set_defaults(fn=cmd_web)
    p = sub.add_parser("mcp", help="environments as MCP tools (streamable HTTP) over replicas")
    _front_args(p, 8090)
    _mcp_args(p, "--")
    _http_args(p, openenv=False)
    p.set_defaults(fn=cmd_mcp)
    p = sub.add_parser("judge", help="score agents' grounding and world modelling against ground truth")
    env = os.environ.get
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 in containers)")
    p.add_argument("--port", type=_port, default=50070, help="gRPC port (0: any free port)")
    p.add_argument("--env-address", default=env("ENVSERVE_ENV_ADDRESS", ""),
                   help="one replica to read ground truth from [$ENVSERVE_ENV_ADDRESS]")
    p.add_argument("--directory", default=env("ENVSERVE_DIRECTORY", ""),
                   help="or the directory of replicas, redis://host:6379/0 [$ENVSERVE_DIRECTORY]")
    p.add_argument("--state-token-file", default=env("ENVSERVE_STATE_TOKEN_FILE", ""),
                   help="the token StateService needs, where replicas require one (also $ENVSERVE_STATE_TOKEN)")
    p.add_argument("--env-tls-ca", default="", help="CA certificate of replicas that serve TLS")
    p.add_argument("--config", default=env("ENVSERVE_JUDGE_CONFIG", ""),
                   help="JSON/YAML settings: scoring, llm, judges, fallback [$ENVSERVE_JUDGE_CONFIG]")
    p.add_argument("--judge", action="append", default=[], metavar="ENV=JUDGE",
                   help="the judge of an env: rule or llm (repeatable)")
    p.add_argument("--fallback", default="", help="judge of envs the rule judge cannot score (default: llm if set)")
    p.add_argument("--llm-base-url", default=env("ENVSERVE_JUDGE_LLM_URL", ""),
                   help="OpenAI-compatible endpoint, e.g. http://vllm:8000/v1 [$ENVSERVE_JUDGE_LLM_URL]")
    p.add_argument("--llm-model", default=env("ENVSERVE_JUDGE_LLM_MODEL", ""),
                   help="the model name the endpoint serves [$ENVSERVE_JUDGE_LLM_MODEL]")
    p.add_argument("--llm-mode", default="", help="yesno (VAGEN's YES/NO) or structured (relations scored by F1)")
    p.add_argument("--max-concurrent-items", type=int, default=64,
                   help="items scored at once across all calls (a settings file's max_concurrent_items wins)")
    p.add_argument("--metrics-port", type=_port_or_off, default=-1, help="Prometheus port (-1: off, 0: any free port)")
    p.add_argument("--metrics-host", default="127.0.0.1", help="address of the metrics endpoint")
    p.add_argument("--token-file", default=env("ENVSERVE_JUDGE_TOKEN_FILE", ""),
                   help="bearer tokens callers must send (also $ENVSERVE_JUDGE_TOKENS)")
    p.add_argument("--tls-cert", default=env("ENVSERVE_TLS_CERT", ""),
                   help="serve TLS with this certificate (PEM; empty: plain gRPC) [$ENVSERVE_TLS_CERT]")
    p.add_argument("--tls-key", default=env("ENVSERVE_TLS_KEY", ""),
                   help="the certificate's key (PEM) [$ENVSERVE_TLS_KEY]")
    p.add_argument("--tls-client-ca", default=env("ENVSERVE_TLS_CLIENT_CA", ""),
                   help="require client certificates signed by this CA (mutual TLS) [$ENVSERVE_TLS_CLIENT_CA]")
    g = p.add_argument_group("preview", "print the prompt the LLM judge would send for one agent reply, "
                                        "then exit (nothing is served; no model is called)")
    g.add_argument("--preview", action="store_true", help="print the prompt instead of serving")
    g.add_argument("--env", default="", help="environment of a fresh session (default: the live session's)")
    g.add_argument("--seed", type=int, default=None, help="the fresh session's reset seed (default 0)")
    g.add_argument("--action", action="append", default=[], metavar="A",
                   help="one turn before the reply, e.g. Up or 'go to fridge 1' (repeatable)")
    g.add_argument("--env-config", default="", help="JSON object: the fresh session's env config")
    g.add_argument("--session", default="", help="a live session on --env-address instead of a fresh one")
    g.add_argument("--turn", type=int, default=-1, help="with --session: the turn the reply answered (-1: latest)")
    g.add_argument("--env-token-file", default="", help="token to open sessions with, where the replica needs one")
    g.add_argument("--reply", default=None,
                   help="the agent's reply for the turn, tags and all ('-': read stdin); its <observation> is "
                        "judged for grounding, its <prediction> for world modelling, after its <answer>")
    g.add_argument("--field", default="", choices=("", "grounding", "world_modeling"),
                   help="only this field (default: each one the reply has); a reply without the field's tag "
                        "is judged whole")
    g.add_argument("--json", action="store_true",
                   help="print the chat-completions request bodies (needs the judge model: --llm-model)")
    p.set_defaults(fn=cmd_judge)
    p = sub.add_parser("ls", help="list environments (registered here, or served at --address)")
    p.add_argument("--address", default="", help="a running replica, HOST:PORT (empty: the registered ones)")
    p.set_defaults(fn=cmd_ls)
    p = sub.add_parser("replicas", help="list the live replicas in a directory")
    p.add_argument("--directory", default=os.environ.get("ENVSERVE_DIRECTORY", ""),
                   help="redis://host:6379/0 [$ENVSERVE_DIRECTORY]")
    p.add_argument("--env", default="", help="only replicas serving this environment")
    p.set_defaults(fn=cmd_replicas)
    p = sub.add_parser("ray", help="envserve on a Ray cluster")
    ray_sub = p.add_subparsers(dest="ray_command", required=True)
    t = ray_sub.add_parser("up", help="a fleet of replicas as Ray actors, sized by load, until interrupted",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    t.add_argument("--address", default=os.environ.get("RAY_ADDRESS", "auto"),
                   help="the Ray cluster (its GCS address, ray://HOST:PORT, or auto) [$RAY_ADDRESS]")
    t.add_argument("--families", default="grid",
                   help="comma-separated families (grid, alfworld, scienceworld, svg, maniskill, navigation) or env ids")
    t.add_argument("--replicas-per-node", type=_positive, default=1, help="replicas of each family per node at start")
    t.add_argument("--min-replicas", type=int, default=0, help="per family (0: the start count)")
    t.add_argument("--max-replicas", type=int, default=0, help="per family (0: the start count, a fixed size)")
    t.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs Ray reserves per replica")
    t.add_argument("--replica-gpus", type=float, default=None,
                   help="GPUs per replica (default: 1 for maniskill and navigation where the cluster has GPUs)")
    t.add_argument("--target-load", type=float, default=0.5, help="live sessions per unit of capacity aimed at")
    t.add_argument("--scale-down-after", type=_seconds, default=60.0,
                   help="seconds a family's load must ask for fewer replicas before one is drained")
    t.add_argument("--autoscale-seconds", type=_seconds, default=5.0, help="how often the load is read (0: fixed size)")
    t.add_argument("--directory", default="ray://", help="ray:// or ray://?name=N&namespace=S (several fleets)")
    t.add_argument("--replica-logs", action="store_true", help="print the replicas' output here")
    t.add_argument("serve_args", nargs=argparse.REMAINDER,
                   help="after --: more `envserve serve` arguments for every replica, e.g. -- --workers 2")
    t.set_defaults(fn=cmd_ray_up)
    p = sub.add_parser("play", help="play an environment in the terminal")
    p.add_argument("env", help="the environment id (see `envserve ls`)")
    p.add_argument("--seed", type=int, default=0, help="the reset seed")
    p.add_argument("--config", default="", help="JSON object of config overrides")
    p.add_argument("--address", default="", help="a running server; default: start one in-process")
    p.set_defaults(fn=cmd_play)
    p = sub.add_parser("state", help="print a session's ground truth (GetState): a live one, or a seed's "
                                     "after given actions")
    p.add_argument("env", help="the environment id (see `envserve ls`)")
    p.add_argument("--seed", type=int, default=None, help="reset a fresh session with this seed (default 0)")
    p.add_argument("--action", action="append", default=[], metavar="A",
                   help="one turn's action before reading the state, e.g. Up or 'Up, Left' (repeatable); a text "
                        "with tags is sent as it is")
    p.add_argument("--config", default="", help="JSON object of the fresh session's config overrides")
    p.add_argument("--address", default="", help="a running replica; default: start one in this process")
    p.add_argument("--session", default="", help="a live session on --address instead of a fresh one")
    p.add_argument("--turn", type=int, default=-1, help="which turn (-1: the latest)")
    p.add_argument("--episode", type=int, default=None, help="with --session: which episode (default: the latest)")
    p.add_argument("--json", action="store_true", help="one JSON object, the relation sentences in it")
    p.add_argument("--token-file", default="", help="token to open sessions with, where the replica needs one")
    p.add_argument("--state-token-file", default="", help="token for StateService, where the replica needs one")
    p.add_argument("--tls-ca", default="", help="CA certificate, when the replica serves TLS")
    p.set_defaults(fn=cmd_state)
    p = sub.add_parser("tasks", help="a split's tasks (ListTasks): list them, or export them as a trainer's dataset")
    tasks_sub = p.add_subparsers(dest="tasks_command", required=True)
    for name, what in (("list", "print a split's tasks: id, task type, description"),
                       ("export", "write a split's tasks as the rows a trainer reads (TRL, verl, SkyRL)")):
        t = tasks_sub.add_parser(name, help=what, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        t.add_argument("env", help="environment id")
        t.add_argument("--split", default="", help="split name (empty: the env's first)")
        t.add_argument("--limit", type=int, default=0 if name == "export" else 20,
                       help="this many tasks from the split's start (0: the whole split)")
        t.add_argument("--address", default="", help="a running replica, HOST:PORT (empty: start one here)")
        t.add_argument("--token-file", default="", help="token for the replica, where it needs one")
        t.add_argument("--tls-ca", default="", help="CA certificate, when the replica serves TLS")
        if name == "export":
            t.add_argument("--format", default="tasks", choices=["tasks", "trl", "verl", "skyrl"],
                           help="tasks/trl: JSON lines; verl/skyrl: parquet (see envserve.integrations.task_rows)")
            t.add_argument("--out", required=True, help="the file to write")
            t.add_argument("--agent-name", default="envserve_agent", choices=["envserve_agent", "tool_agent"],
                           help="verl: which agent loop plays the rows")
        t.set_defaults(fn=cmd_tasks)
    p = sub.add_parser("new-env", help="scaffold an environment package of your own that passes the "
                                       "conformance suite")
    p.add_argument("name", help="the environment's id, e.g. line-walk (letters, digits, - and _)")
    p.add_argument("--dir", default="", help="where to write the package (default: ./NAME)")
    p.set_defaults(fn=cmd_new_env)
    p = sub.add_parser("health", help="check a replica's gRPC health service (exit 0 when serving)")
    p.add_argument("--address", default="127.0.0.1:50051", help="the replica, HOST:PORT")
    p.add_argument("--service", default="",
                   help="the gRPC service to ask about, e.g. envserve.v1.EnvService (empty: the whole server)")
    p.add_argument("--tls-ca", default="", help="CA certificate, when the replica serves TLS")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    p.set_defaults(fn=cmd_health)
    p = sub.add_parser("demo", help="start `up` and play each grid env with a scripted agent")
    p.add_argument("--address", default="", help="a running server; default: start `envserve up`")
    p.add_argument("--port", type=_port, default=50051, help="the port of the `envserve up` it starts")
    p.set_defaults(fn=cmd_demo)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from envserve.rpc.serving import ListenError
    try:
        return args.fn(args)
    except ListenError as e:  # a port taken or refused: one line, not a traceback
        print(f"envserve: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
