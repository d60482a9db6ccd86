"""Episodes survive faults: the same episodes played through RoutedClient twice on 3 replicas behind a
real redis-server, once without faults and once while a random replica is killed -9 (and started
again) every --kill-every seconds and Redis is restarted --redis-restarts times. Every episode's
trajectory (observation texts, rewards, flags, anchors, counters) is hashed; the two runs' digests
are compared episode by episode. One JSON line.

    .venv/bin/python bench/chaos.py --episodes 10000 --kill-every 60 --redis-restarts 2 --json
    .venv/bin/python bench/chaos.py --episodes 10000 --text webshop=300,alfworld=60 --json

--text adds episodes of text envs (their actions chosen among the listed valid actions), played in
the same batches as the grid games.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from serverproc import RedisProcess, ServerProcess, stop_on_sigterm  # noqa: E402

from envserve.client import RoutedClient  # noqa: E402
from envserve.client.experts import plain_answer  # noqa: E402

GRID = ["sokoban", "frozenlake", "minesweeper"]
MOVES = {"sokoban": ["Up", "Right", "Down", "Left"], "frozenlake": ["Right", "Down", "Left", "Up"],
         "minesweeper": ["(0, 0)", "(2, 3)", "(5, 5)", "(1, 4)", "(4, 1)", "(3, 3)"]}


class Replicas:
    def __init__(self, url: str, n: int, heartbeat: float, envs: list[str]):
        self.url, self.heartbeat, self.envs = url, heartbeat, envs
        self.procs = {f"chaos-{i}": None for i in range(n)}
        for rid in self.procs:
            self.start(rid)

    def start(self, rid: str) -> None:
        self.procs[rid] = ServerProcess(self.envs, workers=1, metrics=False, extra=[
            "--directory", self.url, "--heartbeat-seconds", str(self.heartbeat), "--replica-id", rid])

    def close(self) -> None:
        for p in self.procs.values():
            p.kill()


def _digest(views: list) -> str:
    return hashlib.blake2b(json.dumps(views).encode(), digest_size=12).hexdigest()


def _view(r) -> list:
    return [r.status.code, r.observation.text, round(r.reward, 9), r.done, r.truncated, r.success, r.anchor,
            r.turn, r.episode, r.trial, r.action_valid]


def _action(env_id: str, i: int, t: int, last) -> str:
    if env_id in MOVES:
        moves = MOVES[env_id]
        return plain_answer("free_think", [moves[(i + t) % len(moves)]])
    valid = list(last.info["valid_actions"]) if "valid_actions" in last.info else []
    return f"<answer>{valid[(3 * t + i) % len(valid)] if valid else 'look'}</answer>"


def play(url: str, plan: list[str], batch: int, turns: int) -> tuple[dict, dict]:
    """Episode i is (plan[i], seed i), played with actions from (i, turn) and what the env lists
    as valid. {i: digest}."""
    digests: dict[int, str] = {}
    with RoutedClient(url, refresh_seconds=0.25) as client:
        for start in range(0, len(plan), batch):
            idx = list(range(start, min(len(plan), start + batch)))
            sids = [client.open(plan[i], 1, None if plan[i] in MOVES else {"include_valid_actions": True},
                                "free_think" if plan[i] in MOVES else "no_think")[0] for i in idx]
            last = dict(zip(idx, client.reset(sids, idx)))
            views = {i: [_view(r)] for i, r in last.items()}
            for t in range(turns):
                actions = [(s, _action(plan[i], i, t, last[i])) for i, s in zip(idx, sids)]
                for i, r in zip(idx, client.step(actions)):
                    views[i].append(_view(r))
                    if r.status.code == 0:
                        last[i] = r
            client.close_sessions(sids)
            digests.update({i: _digest(v) for i, v in views.items()})
        stats = {"recovered": client.sessions.recovered}
    return digests, stats


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--episodes", type=int, default=10_000)
    ap.add_argument("--batch", type=int, default=64, help="episodes played together")
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--kill-every", type=float, default=60.0, help="seconds between kill -9 of a random replica")
    ap.add_argument("--redis-restarts", type=int, default=2)
    ap.add_argument("--heartbeat", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--text", default="", help="text env episodes beside the grid ones: webshop=300,alfworld=60")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    stop_on_sigterm()  # a SIGTERM stops the servers this run started, too

    text = {k: int(v) for k, v in (x.split("=") for x in args.text.split(",") if x)}
    plan = [GRID[i % 3] for i in range(args.episodes)]
    for env_id, n in text.items():  # spread through the run, so faults hit them too
        step = max(1, len(plan) // max(1, n))
        for k in range(n):
            plan.insert(min(len(plan), k * (step + 1)), env_id)
    redis = RedisProcess()
    replicas = Replicas(redis.url, args.replicas, args.heartbeat, GRID + list(text))
    try:
        t0 = time.monotonic()
        reference, _ = play(redis.url, plan, args.batch, args.turns)
        clean_s = time.monotonic() - t0

        stop = threading.Event()
        faults = {"kills": 0, "redis_restarts": 0}

        def chaos():
            rng = random.Random(args.seed)
            # Redis restarts halfway between kills, the first ones of the run.
            started = time.monotonic()
            redis_at = [started + args.kill_every * (k + 0.5) for k in range(args.redis_restarts)]
            next_kill = started + args.kill_every
            while not stop.wait(0.05):
                now = time.monotonic()
                if redis_at and now >= redis_at[0]:
                    redis_at.pop(0)
                    redis.restart()
                    faults["redis_restarts"] += 1
                if now >= next_kill:
                    rid = rng.choice(sorted(replicas.procs))
                    replicas.procs[rid].kill()
                    faults["kills"] += 1
                    replicas.start(rid)  # back under the same id, on a new port
                    next_kill = time.monotonic() + args.kill_every
        thread = threading.Thread(target=chaos, daemon=True)
        t1 = time.monotonic()
        thread.start()
        faulted, stats = play(redis.url, plan, args.batch, args.turns)
        stop.set()
        thread.join()
        chaos_s = time.monotonic() - t1
        equal = sum(reference[i] == faulted.get(i) for i in reference)
        per_env = {e: sum(1 for p in plan if p == e) for e in dict.fromkeys(plan)}
        out = {"episodes": len(plan), "per_env": per_env, "replicas": args.replicas, "kill_every_s": args.kill_every,
               **faults, "recovered_sessions": stats["recovered"], "completed": len(faulted),
               "equal_to_fault_free": equal, "lost_or_different": len(plan) - equal,
               "fault_free_s": round(clean_s, 1), "chaos_s": round(chaos_s, 1)}
        print(json.dumps(out) if args.json else "\n".join(f"{k}: {v}" for k, v in out.items()))
        sys.exit(0 if equal == len(plan) else 1)
    finally:
        replicas.close()
        redis.stop()


if __name__ == "__main__":
    main()
