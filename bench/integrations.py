"""What each framework adapter (envserve.integrations) adds to a step, against calling EnvClient
directly, with 64 rollouts stepping concurrently (one thread each, as TRL's pool and SkyRL's and
GEM's env workers call them).

Both sides run in the same process against the same real server on loopback, alternating in rounds
(each round starting with another side) so that load on the machine hits them alike: the direct side
calls `EnvClient.step` with the answer text; an adapter side calls what its framework calls (TRL: the
`move` tool; SkyRL: the env's `step` with the answer text, a fresh env made per episode as SkyRL's
generator does; GEM: `step`). Per side: steps/s over all rollouts, the p50/p90 latency of one call
and this process's CPU time per step; per adapter: its steps/s as a ratio of direct's, and the p50
and CPU per step it adds over direct (medians of the differences to direct in the same round). With
64 threads on a few cores a step's latency is mostly queueing for the GIL, so the CPU an adapter adds
is the steadier figure; `--rollouts 1` shows the latency of one step alone. Adapters whose framework
is not installed are skipped.

    .venv/bin/python bench/integrations.py --json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

DIRECTIONS = ["Up", "Left", "Down", "Right"]
# Sokoban with no turn limit: episodes end only when a room is solved, so steps dominate resets.
ENV_ID, CONFIG = "sokoban", {"max_turns": 1_000_000}


class Rollout:
    """One concurrent rollout of one side: `step(i)` makes the i-th call and says whether the episode
    ended (the driver then resets it, outside the timing)."""

    def reset(self, seed: int) -> None: ...
    def step(self, i: int) -> bool: ...
    def close(self) -> None: ...


class DirectRollout(Rollout):
    def __init__(self, client):
        self.client = client
        self.sid = client.open_sessions(ENV_ID, 1, CONFIG, "no_think").session_ids[0]

    def reset(self, seed):
        self.client.reset_one(self.sid, seed)

    def step(self, i):
        r = self.client.step([(self.sid, f"<answer>{DIRECTIONS[i % 4]}</answer>")])[0]
        return r.done or r.truncated

    def close(self):
        self.client.close_sessions([self.sid])


class TRLRollout(Rollout):
    def __init__(self, cls):
        self.env = cls()

    def reset(self, seed):
        self.env.reset(seed=seed)

    def step(self, i):
        self.env.move(DIRECTIONS[i % 4])
        r = self.env.last_result
        return r.done or r.truncated


def trl_side(address: str) -> tuple[Callable[[], Rollout], Callable[[], None]] | None:
    try:
        from envserve.integrations.trl import environment_factory
    except ImportError:
        return None
    cls = environment_factory(address, ENV_ID, CONFIG, include_rules=False)
    return (lambda: TRLRollout(cls)), cls.close


class SkyRLRollout(Rollout):
    """As SkyRL's generator: a fresh env per trajectory (made and init'ed in reset, outside the timing)."""

    def __init__(self, env_class):
        self.env_class, self.env = env_class, None

    def reset(self, seed):
        import skyrl_gym
        self.close()
        self.env = skyrl_gym.make(self.env_class, env_config={}, extras={"seed": seed})
        self.env.init([])

    def step(self, i):
        return self.env.step(f"<answer>{DIRECTIONS[i % 4]}</answer>")["done"]

    def close(self):
        if self.env is not None:
            self.env.close()


def skyrl_side(address: str) -> tuple[Callable[[], Rollout], Callable[[], None]] | None:
    try:
        from envserve.integrations.skyrl import register
    except ImportError:
        return None
    (env_class,) = register(address, [ENV_ID], prefix="bench-", config=CONFIG, include_rules=False)
    return (lambda: SkyRLRollout(env_class)), lambda: None


class GEMRollout(Rollout):
    def __init__(self, env_id):
        import gem
        self.env = gem.make(env_id)

    def reset(self, seed):
        self.env.reset(seed)

    def step(self, i):
        _, _, terminated, truncated, _ = self.env.step(f"<answer>{DIRECTIONS[i % 4]}</answer>")
        return terminated or truncated

    def close(self):
        self.env.close()


def gem_side(address: str) -> tuple[Callable[[], Rollout], Callable[[], None]] | None:
    try:
        from envserve.integrations.gem import register
    except ImportError:
        return None
    (env_id,) = register(address, [ENV_ID], prefix="bench:", config=CONFIG, include_rules=False)
    return (lambda: GEMRollout(env_id)), lambda: None


def run_side(make: Callable[[], Rollout], rollouts: int, seconds: float) -> dict:
    """`rollouts` threads stepping for `seconds`; latency of every step call."""
    envs = [make() for _ in range(rollouts)]
    for k, env in enumerate(envs):
        env.reset(k)
    latencies: list[list[float]] = [[] for _ in envs]
    start = threading.Barrier(rollouts + 1)
    stop = threading.Event()

    def loop(k: int) -> None:
        env, lat, i = envs[k], latencies[k], 0
        start.wait()
        while not stop.is_set():
            t = time.perf_counter()
            done = env.step(i)
            lat.append(time.perf_counter() - t)
            i += 1
            if done:
                env.reset(k + 1000 * i)

    threads = [threading.Thread(target=loop, args=(k,), daemon=True) for k in range(rollouts)]
    for t in threads:
        t.start()
    start.wait()
    t0, cpu0 = time.perf_counter(), time.process_time()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    for env in envs:
        env.close()
    flat = sorted(x for lat in latencies for x in lat)
    # cpu: this process's CPU time (every thread: the rollouts' Python and gRPC's) per step; the
    # server is another process. Under load from elsewhere it moves much less than latency does.
    return {"steps": len(flat), "seconds": elapsed, "steps_per_s": len(flat) / elapsed,
            "p50_ms": 1e3 * flat[len(flat) // 2], "p90_ms": 1e3 * flat[int(len(flat) * 0.9)],
            "cpu_us_per_step": 1e6 * cpu / max(1, len(flat))}


def merge(rounds: list[dict], direct: list[dict] | None = None) -> dict:
    """A side over its rounds; against direct's rounds, what it adds: the median over rounds of the
    difference to direct in the same round (paired, so load that changes between rounds cancels)."""
    steps = sum(r["steps"] for r in rounds)
    out = {"steps": steps, "steps_per_s": steps / sum(r["seconds"] for r in rounds),
           "p50_ms": statistics.median(r["p50_ms"] for r in rounds),
           "p90_ms": statistics.median(r["p90_ms"] for r in rounds),
           "cpu_us_per_step": statistics.median(r["cpu_us_per_step"] for r in rounds)}
    if direct is not None:
        out["added_p50_ms"] = statistics.median(r["p50_ms"] - d["p50_ms"] for r, d in zip(rounds, direct))
        out["added_cpu_us_per_step"] = statistics.median(r["cpu_us_per_step"] - d["cpu_us_per_step"]
                                                         for r, d in zip(rounds, direct))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rollouts", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=3.0, help="per side per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--json", action="store_true", help="print the summary as JSON on the last line")
    args = ap.parse_args()

    from envserve.client import EnvClient
    from serverproc import ServerProcess

    with ServerProcess([ENV_ID], workers=args.workers, metrics=False) as server, \
            EnvClient(server.address) as client:
        sides: dict[str, tuple] = {"direct": ((lambda: DirectRollout(client)), lambda: None)}
        for name, build in {"trl": trl_side, "skyrl": skyrl_side, "gem": gem_side}.items():
            side = build(server.address)
            if side is None:
                print(f"{name}: framework not installed, skipped")
            else:
                sides[name] = side
        rounds: dict[str, list[dict]] = {name: [] for name in sides}
        names = list(sides)
        for k in range(args.rounds):
            # Each round starts with another side, so no side always follows the same one.
            for name in names[k % len(names):] + names[:k % len(names)]:
                rounds[name].append(run_side(sides[name][0], args.rollouts, args.seconds))
        for _, close in sides.values():
            close()

    results = {name: merge(r, None if name == "direct" else rounds["direct"]) for name, r in rounds.items()}
    direct = results["direct"]
    summary = {"env": ENV_ID, "rollouts": args.rollouts, "rounds": args.rounds, "load_average": os.getloadavg(),
               "direct": direct}
    print("| side | steps/s | ratio to direct | p50 ms | added p50 ms | p90 ms | client CPU us/step | added CPU us |\n"
          "|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        if name != "direct":
            r = dict(r, steps_per_s_ratio=r["steps_per_s"] / direct["steps_per_s"])
            summary[name] = r
        print(f"| {name} | {r['steps_per_s']:.0f} | {r.get('steps_per_s_ratio', 1.0):.2f} | {r['p50_ms']:.2f} | "
              f"{r.get('added_p50_ms', 0.0):+.3f} | {r['p90_ms']:.2f} | {r['cpu_us_per_step']:.0f} | "
              f"{r.get('added_cpu_us_per_step', 0.0):+.0f} |")
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
