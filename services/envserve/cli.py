"""envserve command line: serve | up | ls | play."""
from __future__ import annotations

import argparse
import json
import os
import sys


def _server_args(p: argparse.ArgumentParser, default_port: int) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 in containers)")
    p.add_argument("--port", type=int, default=default_port, help="gRPC port (0: any free port)")
    p.add_argument("--workers", type=int, default=0, help="worker processes (0: one per CPU)")
    p.add_argument("--inline", action="store_true",
                   default=os.environ.get("ENVSERVE_INLINE", "").lower() in ("1", "true", "yes"),
                   help="step sessions in the front process, no workers (microsecond envs: the grid games) "
                        "[$ENVSERVE_INLINE=1]")
    p.add_argument("--max-sessions", type=int, default=10_000)
    p.add_argument("--lease-seconds", type=float, default=300.0)
    p.add_argument("--metrics-port", type=int, default=-1, help="Prometheus port (-1: off, 0: any free port)")
    p.add_argument("--drain-timeout", type=float, default=60.0)
    p.add_argument("--no-migrate-on-drain", dest="migrate_on_drain", action="store_false",
                   help="on SIGTERM, leave live sessions to end with this replica instead of moving them")
    p.add_argument("--metrics-host", default="127.0.0.1", help="address of the metrics endpoint")
    p.add_argument("--replica-id", default=os.environ.get("ENVSERVE_REPLICA_ID", ""))
    p.add_argument("--openenv-port", type=int, default=-1,
                   help="also serve OpenEnv's protocol at http://HOST:PORT/openenv/<env_id>/ (WebSocket /ws, "
                        "/reset /step /state ...) from this process, no facade hop; plain HTTP even with --tls-cert, "
                        "tokens checked as on gRPC (-1: off, 0: any free port)")
    p.add_argument("--openenv-host", default="", help="address of the OpenEnv endpoint (default: --host)")
    p.add_argument("--openenv-idle-seconds", type=float, default=300.0,
                   help="close OpenEnv sessions opened over plain HTTP after this many seconds without a call")
    # Containers and pods set these through the environment.
    env = os.environ.get
    p.add_argument("--directory", default=env("ENVSERVE_DIRECTORY", "memory://"),
                   help="memory:// (this process) or redis://host:6379/0 [$ENVSERVE_DIRECTORY]")
    p.add_argument("--advertise", default=env("ENVSERVE_ADVERTISE", ""),
                   help="host:port other services reach this replica on [$ENVSERVE_ADVERTISE]")
    p.add_argument("--external-address", default=env("ENVSERVE_EXTERNAL_ADDRESS", ""),
                   help="host:port reachable from outside, e.g. a published port [$ENVSERVE_EXTERNAL_ADDRESS]")
    p.add_argument("--heartbeat-seconds", type=float, default=float(env("ENVSERVE_HEARTBEAT_SECONDS", "2.0")))
    p.add_argument("--token-file", default=env("ENVSERVE_TOKEN_FILE", ""),
                   help="bearer tokens, one per line (also $ENVSERVE_TOKENS, comma separated)")
    p.add_argument("--state-token-file", default=env("ENVSERVE_STATE_TOKEN_FILE", ""),
                   help="tokens for the ground-truth services (also $ENVSERVE_STATE_TOKENS)")
    p.add_argument("--tls-cert", default=env("ENVSERVE_TLS_CERT", ""))
    p.add_argument("--tls-key", default=env("ENVSERVE_TLS_KEY", ""))
    p.add_argument("--tls-client-ca", default=env("ENVSERVE_TLS_CLIENT_CA", ""),
                   help="require client certificates signed by this CA (mutual TLS)")


def _config(args, env_ids):
    from envserve.rpc.auth import read_tokens
    from envserve.server.config import ServerConfig
    return ServerConfig(env_ids=list(env_ids), host=args.host, port=args.port, workers=args.workers,
                        inline=args.inline,
                        max_sessions=args.max_sessions, lease_seconds=args.lease_seconds,
                        metrics_port=args.metrics_port, metrics_host=args.metrics_host,
                        drain_timeout_seconds=args.drain_timeout, migrate_on_drain=args.migrate_on_drain,
                        replica_id=args.replica_id, openenv_port=args.openenv_port,
                        openenv_host=args.openenv_host, openenv_idle_seconds=args.openenv_idle_seconds,
                        directory_url=args.directory, advertise_address=args.advertise,
                        external_address=args.external_address, heartbeat_seconds=args.heartbeat_seconds,
                        tokens=read_tokens(args.token_file, os.environ.get("ENVSERVE_TOKENS", "")),
                        state_tokens=read_tokens(args.state_token_file, os.environ.get("ENVSERVE_STATE_TOKENS", "")),
                        tls_cert_file=args.tls_cert, tls_key_file=args.tls_key,
                        tls_client_ca_file=args.tls_client_ca)


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
    from envserve.core.registry import env_ids
    from envserve.server.app import run
    unknown = sorted(set(args.envs) - set(env_ids()))
    if unknown:
        print(f"unknown environment(s) {unknown}; registered: {env_ids()}", file=sys.stderr)
        return 2
    run(_config(args, args.envs), openenv_endpoint=_openenv_endpoint(args))
    return 0


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
    from envserve.server.app import run
    envs = args.envs or env_ids()
    print(f"envserve up: {len(envs)} environments; connect with EnvClient('{args.host}:{args.port}')", flush=True)
    if args.http_port >= 0:
        _web_beside_replica(args)
    run(_config(args, envs), openenv_endpoint=_openenv_endpoint(args))
    return 0


def _web_beside_replica(args) -> None:
    """The HTTP facade in this process; it finds the replica through the same directory
    (memory:// by default, where the replica registers itself)."""
    from envserve.web import create_app, start_in_thread
    from envserve.web.server import display
    _, port = start_in_thread(create_app(directory_url=args.directory or "memory://"), args.http_host, args.http_port)
    print(f"envserve web on {display(args.http_host, port)}", flush=True)


def cmd_web(args) -> int:
    """The HTTP/JSON facade and the live sessions page, over the replicas of a directory and/or
    fixed addresses."""
    from envserve.web import create_app, serve
    if not args.directory and not args.replica:
        print("envserve web: give --directory URL and/or --replica HOST:PORT", file=sys.stderr)
        return 2
    root = None
    if args.tls_ca:
        with open(args.tls_ca, "rb") as f:
            root = f.read()
    token = os.environ.get("ENVSERVE_MONITOR_TOKEN", "")
    if args.monitor_token_file:
        from envserve.rpc.auth import read_tokens
        token = (read_tokens(args.monitor_token_file) or ("",))[0]
    app = create_app(directory_url=args.directory, replicas=args.replica, root_certificates=root,
                     use_external=args.external, monitor_token=token or None, timeout=args.timeout,
                     openenv_idle_seconds=args.openenv_idle_seconds)
    sources = ([f"directory {args.directory}"] if args.directory else []) + list(args.replica)
    serve(app, args.host, args.port, announce=f" over {', '.join(sources)}")
    return 0


def cmd_judge(args) -> int:
    """The JudgeService over the replicas of a directory or one fixed replica."""
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
    from envserve.core.registry import env_ids, get_env_class
    for e in env_ids():
        spec = get_env_class(e).spec
        print(f"{e:16s} {','.join(spec.modalities):11s} {spec.description}")
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


def cmd_play(args) -> int:
    """A person plays one episode in the terminal, against a server or an embedded one."""
    from envserve.client import EnvClient
    if args.address:
        return _play(EnvClient(args.address), args)
    import threading
    import asyncio
    from envserve.server.app import ReplicaServer
    from envserve.server.config import ServerConfig

    holder = {}
    ready = threading.Event()

    def serve():
        async def main():
            server = ReplicaServer(ServerConfig(env_ids=[args.env], port=0, workers=1))
            await server.start()
            holder["server"], holder["loop"] = server, asyncio.get_running_loop()
            ready.set()
            await server.wait()
        asyncio.run(main())

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    ready.wait()
    try:
        return _play(EnvClient(holder["server"].address), args)
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


def cmd_demo(args) -> int:
    from envserve.demo import main as demo_main
    return demo_main(args.address, args.port)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="envserve", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("serve", help="serve environments on one replica")
    p.add_argument("envs", nargs="+")
    _server_args(p, 50051)
    p.set_defaults(fn=cmd_serve)
    p = sub.add_parser("up", help="a local stack of all registered environments")
    p.add_argument("envs", nargs="*", help="default: all registered")
    _server_args(p, 50051)
    p.add_argument("--http-port", type=int, default=-1, help="also serve the HTTP facade and live page (-1: off)")
    p.add_argument("--http-host", default="127.0.0.1")
    p.add_argument("--containers", action="store_true",
                   help="run each environment in its family's image (docker or podman) with Redis")
    p.add_argument("--image-tag", default="latest", help="with --containers: the images' tag")
    p.add_argument("--redis-image", default="", help="with --containers: default redis:7-alpine "
                   "[$ENVSERVE_REDIS_IMAGE]")
    p.set_defaults(fn=cmd_up)
    p = sub.add_parser("web", help="HTTP/JSON facade and live sessions page over replicas")
    p.add_argument("--directory", default=os.environ.get("ENVSERVE_DIRECTORY", ""),
                   help="redis://host:6379/0 (or memory://) [$ENVSERVE_DIRECTORY]")
    p.add_argument("--replica", action="append", default=[], metavar="HOST:PORT", help="a fixed replica (repeatable)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080, help="HTTP port (0: any free port)")
    p.add_argument("--tls-ca", default="", help="CA certificate of replicas that serve TLS")
    p.add_argument("--external", action="store_true", help="reach replicas at their external addresses")
    p.add_argument("--monitor-token-file", default="",
                   help="token the page watches sessions with when a request brings none [$ENVSERVE_MONITOR_TOKEN]")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per gRPC call")
    p.add_argument("--openenv-idle-seconds", type=float, default=300.0,
                   help="OpenEnv endpoint (/openenv/<env>/): close sessions opened over plain HTTP after this "
                        "many seconds without a call (WebSocket sessions close with their socket)")
    p.set_defaults(fn=cmd_web)
    p = sub.add_parser("judge", help="score agents' grounding and world modelling against ground truth")
    env = os.environ.get
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 in containers)")
    p.add_argument("--port", type=int, default=50070, help="gRPC port (0: any free port)")
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
    p.add_argument("--llm-model", default=env("ENVSERVE_JUDGE_LLM_MODEL", ""))
    p.add_argument("--llm-mode", default="", help="yesno (VAGEN's YES/NO) or structured (relations scored by F1)")
    p.add_argument("--max-concurrent-items", type=int, default=64)
    p.add_argument("--metrics-port", type=int, default=-1, help="Prometheus port (-1: off, 0: any free port)")
    p.add_argument("--metrics-host", default="127.0.0.1")
    p.add_argument("--token-file", default=env("ENVSERVE_JUDGE_TOKEN_FILE", ""),
                   help="bearer tokens callers must send (also $ENVSERVE_JUDGE_TOKENS)")
    p.add_argument("--tls-cert", default=env("ENVSERVE_TLS_CERT", ""))
    p.add_argument("--tls-key", default=env("ENVSERVE_TLS_KEY", ""))
    p.add_argument("--tls-client-ca", default=env("ENVSERVE_TLS_CLIENT_CA", ""))
    p.set_defaults(fn=cmd_judge)
    p = sub.add_parser("ls", help="list environments (registered here, or served at --address)")
    p.add_argument("--address", default="")
    p.set_defaults(fn=cmd_ls)
    p = sub.add_parser("replicas", help="list the live replicas in a directory")
    p.add_argument("--directory", default=os.environ.get("ENVSERVE_DIRECTORY", ""),
                   help="redis://host:6379/0 [$ENVSERVE_DIRECTORY]")
    p.add_argument("--env", default="", help="only replicas serving this environment")
    p.set_defaults(fn=cmd_replicas)
    p = sub.add_parser("play", help="play an environment in the terminal")
    p.add_argument("env")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--config", default="", help="JSON object of config overrides")
    p.add_argument("--address", default="", help="a running server; default: start one in-process")
    p.set_defaults(fn=cmd_play)
    p = sub.add_parser("health", help="check a replica's gRPC health service (exit 0 when serving)")
    p.add_argument("--address", default="127.0.0.1:50051")
    p.add_argument("--service", default="")
    p.add_argument("--tls-ca", default="", help="CA certificate, when the replica serves TLS")
    p.add_argument("--timeout", type=float, default=3.0)
    p.set_defaults(fn=cmd_health)
    p = sub.add_parser("demo", help="start `up` and play each grid env with a scripted agent")
    p.add_argument("--address", default="", help="a running server; default: start `envserve up`")
    p.add_argument("--port", type=int, default=50051)
    p.set_defaults(fn=cmd_demo)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
