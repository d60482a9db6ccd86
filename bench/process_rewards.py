"""Monte-Carlo Q-hat through Fork against replaying each prefix from a fresh reset (what a framework
without Fork must do): same states, same rollout policy, same server, same run.

States: `--states` (64; `--alfworld-states`, 8, on ALFWorld) live sessions at depths spread over
[0, --max-depth] of trajectories on a quarter as many tasks (4 depths each): on ALFWorld
(generated games, train split) the handcoded expert's trajectories (read from GetState's
expert_action in sessions opened with expert: true), elsewhere random valid actions. The states
to estimate are sessions without the expert, walked along those prefixes (not timed).

Rollouts: `--rollouts` (8) per state of at most `--horizon` turns, random valid actions (a cheap
policy, so what is measured is the environment and the service, not a model). Three ways, timed
one after the other on the same replica:
  fork          one Fork call per state, the forks stepped as one batch per turn, then closed;
  replay        sessions reset to the task and stepped through the recorded prefix before each
                rollout, reusing the sessions the estimate opened (a framework's env pool);
  replay_fresh  the same with a new session per rollout (`--replay-fresh`; off by default on
                ALFWorld, where a new session costs an engine process).
Reported per env: wall seconds, env steps and sessions opened of each, and the speed-ups
fork_speedup = replay / fork wall time (on ALFWorld, Fork is meant to be at least 3x faster).

ALFWorld keeps a game's state in its engine process: Fork copies that process (os.fork of a frozen
copy, one copy per fork; the env's fork_copies), where replay resets sessions and steps each
prefix again. The default, 64 states x 8 rollouts, takes about 7 minutes on 2 cores (most
of it the replay); `--alfworld-states 8` is a quick look. At most `--max-alive` (32) rollout
sessions are open at once either way, so replay reuses 32 sessions.

    python bench/process_rewards.py --json                     # ALFWorld and Sokoban, 64 x 8 each
    python bench/process_rewards.py --envs alfworld --alfworld-states 8 --json   # a quick look
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "trainer"))

from envserve.client.aio import AsyncEnvClient  # noqa: E402
from envserve_trainer.api import MCSettings, StatePoint, estimate, random_valid_policy  # noqa: E402
from serverproc import ServerProcess  # noqa: E402

FORMAT = "no_think"


def env_config(env_id: str, args) -> dict:
    if env_id == "alfworld":
        return {"include_valid_actions": True, "isolation": args.alfworld_isolation}
    return {"include_valid_actions": True, "max_turns": 60}


def answer(action: str) -> str:
    return f"<answer>{action}</answer>"


async def trajectories(ac: AsyncEnvClient, env_id: str, seeds: list[int], length: int, config: dict,
                       rng: random.Random) -> list[list[str]]:
    """Answer texts of one trajectory per seed, `length` turns at most: ALFWorld's expert, or
    random valid actions."""
    expert = env_id == "alfworld"
    ids = await ac.open(env_id, len(seeds), {**config, "expert": True} if expert else config, FORMAT)
    try:
        results = await ac.reset(ids, seeds=seeds)
        actions: list[list[str]] = [[] for _ in ids]
        for _ in range(length):
            live = [i for i, r in enumerate(results) if not (r.done or r.truncated)]
            if not live:
                break
            if expert:
                states = await asyncio.gather(*[ac.get_state(ids[i]) for i in live])
                chosen = [str(s.state["expert_action"] or "look") for s in states]
            else:
                chosen = [rng.choice(list(results[i].info["valid_actions"]) or ["look"]) for i in live]
            stepped = await ac.step([(ids[i], answer(a)) for i, a in zip(live, chosen)])
            for i, a, r in zip(live, chosen, stepped):
                actions[i].append(answer(a))
                results[i] = r
        return actions
    finally:
        await ac.close_sessions(ids)


async def make_points(ac: AsyncEnvClient, env_id: str, args) -> list[StatePoint]:
    config = env_config(env_id, args)
    n_states = args.alfworld_states if env_id == "alfworld" else args.states
    games = max(1, n_states // 4)
    seeds = list(range(args.seed, args.seed + games))
    trajs = await trajectories(ac, env_id, seeds, args.max_depth + 1, config, random.Random(args.seed))
    # 4 depths per task over [0, max_depth], never the last state of a trajectory (it may be terminal).
    plan = []
    for seed, traj in zip(seeds, trajs):
        deepest = min(args.max_depth, max(0, len(traj) - 1))
        plan += [(seed, traj[:round(deepest * k / 3)]) for k in range(4)]
    plan = plan[:n_states]
    ids = await ac.open(env_id, len(plan), config, FORMAT)
    results = await ac.reset(ids, seeds=[s for s, _ in plan])
    for turn in range(max(len(p) for _, p in plan)):
        live = [i for i, (_, p) in enumerate(plan) if turn < len(p)]
        for i, r in zip(live, await ac.step([(ids[i], plan[i][1][turn]) for i in live])):
            results[i] = r
    return [StatePoint(sid, env_id, s, tuple(p), config, FORMAT, last)
            for sid, (s, p), last in zip(ids, plan, results)]


async def run_env(address: str, env_id: str, args) -> dict:
    async with AsyncEnvClient(address, timeout=1200) as ac:
        t = time.perf_counter()
        points = await make_points(ac, env_id, args)
        setup = time.perf_counter() - t
        ways = [("fork", "fork", True), ("replay", "replay", True)]
        if args.replay_fresh or (args.replay_fresh is None and env_id != "alfworld"):
            ways.append(("replay_fresh", "replay", False))
        out: dict = {"config": env_config(env_id, args), "setup_seconds": round(setup, 2),
                     "mean_prefix_turns": sum(len(p.prefix) for p in points) / len(points),
                     "terminal_states": sum(bool(p.last_result.done or p.last_result.truncated) for p in points)}
        for name, by, reuse in ways:
            settings = MCSettings(rollouts_per_state=args.rollouts, gamma=args.gamma, horizon=args.horizon,
                                  max_alive=args.max_alive, reuse_sessions=reuse)
            t = time.perf_counter()
            values = await estimate(ac, points, random_valid_policy(args.seed + 1), settings, by=by)
            wall = time.perf_counter() - t
            errors = [v.error for v in values if v.failed]
            out[name] = {"seconds": round(wall, 2), "env_steps": sum(v.env_steps for v in values),
                         "sessions_opened": sum(v.sessions_opened for v in values),
                         "rollouts": sum(len(v.returns) for v in values),
                         "mean_value": sum(v.value or 0 for v in values) / len(values), "errors": len(errors)}
            if errors:
                out[name]["first_error"] = errors[0][:300]
        await ac.close_sessions([p.session_id for p in points])
        for name, _, _ in ways[1:]:
            out[f"fork_speedup_vs_{name}"] = round(out[name]["seconds"] / out["fork"]["seconds"], 2)
        return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--envs", default="alfworld,sokoban")
    ap.add_argument("--states", type=int, default=64)
    ap.add_argument("--rollouts", type=int, default=8)
    ap.add_argument("--horizon", type=int, default=5, help="turns per rollout at most")
    ap.add_argument("--gamma", type=float, default=1.0)
    ap.add_argument("--max-depth", type=int, default=12, help="deepest state, in turns from the reset")
    ap.add_argument("--max-alive", type=int, default=32, help="rollout sessions alive at once (both ways)")
    ap.add_argument("--alfworld-states", type=int, default=64, help="states on ALFWorld (--states elsewhere)")
    ap.add_argument("--alfworld-isolation", default="process", choices=("process", "none"))
    ap.add_argument("--replay-fresh", action=argparse.BooleanOptionalAction, default=None,
                    help="also time replay with a new session per rollout (default: not on ALFWorld)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    results = {}
    extra = ["--max-sessions", str(2 * max(args.states, args.alfworld_states) + args.max_alive + 16)]
    if args.alfworld_isolation == "none":
        # An engine in the worker is the operator's choice (a crash takes the worker's sessions).
        limits = os.path.join(tempfile.mkdtemp(prefix="envserve-bench-"), "limits.json")
        with open(limits, "w") as f:
            json.dump({"alfworld": {"isolation": {"enum": ["process", "none"]}}}, f)
        extra += ["--config-limits", limits]
    for env_id in args.envs.split(","):
        with ServerProcess([env_id], workers=args.workers, metrics=False,
                           extra=extra if env_id == "alfworld" else extra[:2]) as server:
            results[env_id] = asyncio.run(run_env(server.address, env_id, args))
    print("| env | way | s | env steps | sessions opened | Fork speed-up |\n|---|---|---|---|---|---|")
    for env_id, r in results.items():
        for name in ("fork", "replay", "replay_fresh"):
            if name in r:
                ratio = "" if name == "fork" else f"{r[f'fork_speedup_vs_{name}']:.2f}x"
                print(f"| {env_id} | {name} | {r[name]['seconds']:.1f} | {r[name]['env_steps']} | "
                      f"{r[name]['sessions_opened']} | {ratio} |")
    if args.json:
        print(json.dumps({"states": args.states, "alfworld_states": args.alfworld_states, "rollouts": args.rollouts, "horizon": args.horizon,
                          "max_depth": args.max_depth, "policy": "random valid actions",
                          "cpus": os.cpu_count(), **results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
