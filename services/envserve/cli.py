"""envserve command line: serve | up | ls | play."""
from __future__ import annotations

import argparse
import json
import sys


def _server_args(p: argparse.ArgumentParser, default_port: int) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 in containers)")
    p.add_argument("--port", type=int, default=default_port, help="gRPC port (0: any free port)")
    p.add_argument("--workers", type=int, default=0, help="worker processes (0: one per CPU)")
    p.add_argument("--max-sessions", type=int, default=10_000)
    p.add_argument("--lease-seconds", type=float, default=300.0)
    p.add_argument("--metrics-port", type=int, default=-1, help="Prometheus port (-1: off, 0: any free port)")
    p.add_argument("--drain-timeout", type=float, default=60.0)
    p.add_argument("--replica-id", default="")


def _config(args, env_ids):
    from envserve.server.config import ServerConfig
    return ServerConfig(env_ids=list(env_ids), host=args.host, port=args.port, workers=args.workers,
                        max_sessions=args.max_sessions, lease_seconds=args.lease_seconds,
                        metrics_port=args.metrics_port, drain_timeout_seconds=args.drain_timeout,
                        replica_id=args.replica_id)


def cmd_serve(args) -> int:
    from envserve.core.registry import env_ids
    from envserve.server.app import run
    unknown = sorted(set(args.envs) - set(env_ids()))
    if unknown:
        print(f"unknown environment(s) {unknown}; registered: {env_ids()}", file=sys.stderr)
        return 2
    run(_config(args, args.envs))
    return 0


def cmd_up(args) -> int:
    """Every registered environment on one local replica, worker processes per CPU."""
    from envserve.core.registry import env_ids
    from envserve.server.app import run
    envs = args.envs or env_ids()
    print(f"envserve up: {len(envs)} environments; connect with EnvClient('{args.host}:{args.port}')", flush=True)
    run(_config(args, envs))
    return 0


def cmd_ls(args) -> int:
    if args.address:
        from envserve.client import EnvClient
        with EnvClient(args.address) as c:
            specs = c.list_envs()
        for s in specs:
            print(f"{s.env_id:14s} {','.join(s.modalities):11s} max_turns={s.max_turns:<3d} "
                  f"actions/turn={s.max_actions_per_turn}  {s.description}")
        return 0
    from envserve.core.registry import env_ids, get_env_class
    for e in env_ids():
        spec = get_env_class(e).spec
        print(f"{e:14s} {','.join(spec.modalities):11s} {spec.description}")
    return 0


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
    p.set_defaults(fn=cmd_up)
    p = sub.add_parser("ls", help="list environments (registered here, or served at --address)")
    p.add_argument("--address", default="")
    p.set_defaults(fn=cmd_ls)
    p = sub.add_parser("play", help="play an environment in the terminal")
    p.add_argument("env")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--config", default="", help="JSON object of config overrides")
    p.add_argument("--address", default="", help="a running server; default: start one in-process")
    p.set_defaults(fn=cmd_play)
    p = sub.add_parser("demo", help="start `up` and play each grid env with a scripted agent")
    p.add_argument("--address", default="", help="a running server; default: start `envserve up`")
    p.add_argument("--port", type=int, default=50051)
    p.set_defaults(fn=cmd_demo)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
