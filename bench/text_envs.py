"""ScienceWorld and ALFWorld: steps/s through the gRPC service against each package's own
in-process loop, both with one process per core.

Baseline: P processes, each runs the package's env (scienceworld.ScienceWorldEnv; alfworld's
TextWorld PddlEnv wrapped the way AlfredTWEnv wraps it) over a fixed action list, resetting
when the list ends. Service: `envserve serve` with P workers and P sessions stepped as one
batch through the same list, resetting at the same points. Ratio = service / baseline steps/s.
ALFWorld is measured twice: as served (engine caches on) and with engine_caches=false, the
package's own code paths inside the engine process.

Memory per session (`--memory N`): N ScienceWorld sessions opened and reset on one worker, the
growth of the proportional set size (PSS: shared pages split among the processes sharing them) of
the worker and its JVMs, divided by N; once with `sessions_per_jvm: 1` (a JVM per session, the
earlier design) and once with the default (several sessions per JVM), and the steps/s of the same
N sessions stepped as a batch under each. ALFWorld likewise: an engine process per session either
way, started as a fresh interpreter (`engine_template: false`, the earlier design) or forked from
the worker's warmed template engine (the default). The template, started during the measurement,
is counted in the per-session figure.

Run: `.venv/bin/python bench/text_envs.py [--seconds 20] [--memory 16] [--json]`; with --json the last line
is one JSON object (keys ratio_scienceworld, ratio_scienceworld_equal_work, ratio_alfworld,
ratio_alfworld_nocache, ...). ScienceWorld's package step also computes the valid actions, look
and inventory each time; the service only on request, so ratio_scienceworld_equal_work asks for
them (include_valid_actions and a GetState) on every step.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from envserve.client import EnvClient, check, state_dict  # noqa: E402
from serverproc import ServerProcess  # noqa: E402

SW_TASK = "find-living-thing"
# A round of ordinary commands that keeps the agent moving between rooms.
SW_ACTIONS = ["look around", "open door to hallway", "go to hallway", "look around", "inventory",
              "open door to kitchen", "go to kitchen", "look around", "open door to hallway", "go to hallway",
              "open door to art studio", "go to art studio", "look around", "go to hallway", "go to kitchen"]
ALF_SEED = 0  # a generated train game; its walkthrough is the action list


def answer(a: str) -> str:
    return f"<answer>{a}</answer>"


# -- the packages' own loops, one per process ------------------------------------------------
def _play(env, actions: list[str], seconds: float, out) -> None:
    """Steps through the actions and resets, over and over, for `seconds`; reports (steps, time)."""
    env.reset()
    steps, t0 = 0, time.perf_counter()
    while time.perf_counter() < t0 + seconds:
        for a in actions:
            env.step(a)
            steps += 1
        env.reset()
    out.put((steps, time.perf_counter() - t0))
    out.close()
    out.join_thread()  # the queue's feeder thread must deliver before an os._exit


def _sw_package(seconds: float, out) -> None:
    from scienceworld import ScienceWorldEnv
    env = ScienceWorldEnv()
    env.load(SW_TASK, _sw_variation(), "")
    _play(env, SW_ACTIONS, seconds, out)
    env.close()


def _alf_package(game_file: str, actions: list[str], seconds: float, out) -> None:
    from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos
    from textworld import EnvInfos
    from textworld.envs import PddlEnv
    env = AlfredInfos(AlfredDemangler(PddlEnv(EnvInfos(admissible_commands=True, won=True, facts=True))))
    env.load(game_file)
    _play(env, actions, seconds, out)
    os._exit(0)  # as the engine does: no teardown of the planner library


def package_rate(target, args, procs: int, seconds: float) -> float:
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=target, args=(*args, seconds, q)) for _ in range(procs)]
    for p in ps:
        p.start()
    # Each process times its own stepping (after imports, JVM start and the first load), as the
    # service loop below starts timing after Open and the first Reset.
    results = [q.get() for _ in ps]
    for p in ps:
        p.join()
    return sum(steps / elapsed for steps, elapsed in results)


# -- the service ---------------------------------------------------------------------------------
def service_rate(client: EnvClient, env_id: str, config: dict, seed: int, actions: list[str],
                 sessions: int, seconds: float, truth_each_step: bool = False) -> float:
    sids = client.open(env_id, sessions, {"max_turns": 100_000, **config}, "no_think")
    for s in sids:
        client.reset_one(s, seed=seed)
    steps, t_end = 0, time.perf_counter() + seconds
    t0 = time.perf_counter()
    while time.perf_counter() < t_end:
        for a in actions:
            for r in client.step([(s, answer(a)) for s in sids]):
                check(r)
            if truth_each_step:
                for s in sids:
                    client.get_state(s, -1)
            steps += len(sids)
        for s in sids:
            client.reset_one(s, seed=seed)
    rate = steps / (time.perf_counter() - t0)
    client.close_sessions(sids)
    return rate


def tree_pss_mib(pid: int) -> float:
    """PSS of a process and all its descendants, in MiB (Linux smaps_rollup)."""
    import psutil
    total = 0
    for p in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        try:
            with open(f"/proc/{p.pid}/smaps_rollup") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("Pss:"))
        except (FileNotFoundError, ProcessLookupError, StopIteration):
            pass
    return total / 1024


def memory_per_session(server: ServerProcess, client: EnvClient, env_id: str, config: dict, seed: int,
                       actions: list[str], sessions: int, seconds: float) -> tuple[float, float]:
    """(MiB of PSS per session, steps/s of the same sessions as one batch) on a one-worker server."""
    (worker,) = server.worker_pids()
    before = tree_pss_mib(worker)
    sids = client.open(env_id, sessions, {"max_turns": 100_000, **config}, "no_think")
    for s in sids:
        client.reset_one(s, seed=seed)
    for a in actions[:3]:   # a few steps, so each simulator has built what a step builds
        client.step([(s, answer(a)) for s in sids])
    time.sleep(1.0)
    per_session = (tree_pss_mib(worker) - before) / sessions
    client.close_sessions(sids)
    return per_session, service_rate(client, env_id, config, seed, actions, sessions, seconds)


def earlier_and_now(server: ServerProcess, client: EnvClient, env_id: str, earlier: dict, seed: int,
                    actions: list[str], sessions: int, seconds: float, names: tuple[str, str]) -> dict:
    """Memory per session and steps/s under the earlier design's config and under the defaults."""
    old, old_rate = memory_per_session(server, client, env_id, earlier, seed, actions, sessions, seconds)
    new, new_rate = memory_per_session(server, client, env_id, {}, seed, actions, sessions, seconds)
    return {f"{env_id}_mib_per_session_{names[0]}": round(old, 1), f"{env_id}_mib_per_session_{names[1]}": round(new, 1),
            f"{env_id}_{names[0]}_steps_s": round(old_rate, 2), f"{env_id}_{names[1]}_steps_s": round(new_rate, 2),
            f"ratio_{env_id}_memory": round(new / old, 3), f"ratio_{env_id}_{names[1]}_steps": round(new_rate / old_rate, 3)}


def memory_report(sessions: int, seconds: float, only: str | None) -> dict:
    out: dict = {"memory_sessions": sessions}
    with ServerProcess(["scienceworld", "alfworld"], workers=1, metrics=False) as server, \
            EnvClient(server.address) as client:
        if only in (None, "scienceworld"):
            out.update(earlier_and_now(server, client, "scienceworld", {"sessions_per_jvm": 1}, _sw_seed(),
                                       SW_ACTIONS, sessions, seconds, ("own_jvm", "shared_jvm")))
        if only in (None, "alfworld"):
            _, walk = alfworld_game(client)
            out.update(earlier_and_now(server, client, "alfworld", {"engine_template": False}, ALF_SEED,
                                       walk, sessions, seconds, ("own_interpreter", "template_fork")))
    return out


def alfworld_game(client: EnvClient) -> tuple[str, list[str]]:
    sid = client.open("alfworld", 1, {}, "no_think")[0]
    client.reset_one(sid, seed=ALF_SEED)
    key = state_dict(client.get_state(sid, 0))["game"]
    client.close_sessions([sid])
    from envserve.envs.alfworld.games import default_games_dir
    path = os.path.join(default_games_dir(), "json_2.1.1", key, "game.tw-pddl")
    with open(path) as f:
        return path, json.load(f)["walkthrough"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--procs", type=int, default=0, help="processes / workers / sessions (0: one per CPU)")
    ap.add_argument("--only", choices=["scienceworld", "alfworld"], default=None)
    ap.add_argument("--memory", type=int, default=0, metavar="N",
                    help="measure memory per session with N sessions (one worker) instead of the step rates")
    args = ap.parse_args()
    if args.memory:
        out = memory_report(args.memory, args.seconds, args.only)
        for k, v in out.items():
            print(f"{k:40s} {v}")
        if args.json:
            print(json.dumps(out))
        return
    procs = args.procs or os.cpu_count() or 1
    out: dict = {"procs": procs, "seconds": args.seconds}
    with ServerProcess(["scienceworld", "alfworld"], workers=procs, metrics=False) as server, \
            EnvClient(server.address) as client:
        if args.only in (None, "scienceworld"):
            base = package_rate(_sw_package, (), procs, args.seconds)
            seed = _sw_seed()
            svc = service_rate(client, "scienceworld", {}, seed, SW_ACTIONS, procs, args.seconds)
            # The package's step also lists the valid actions and reads look and inventory every
            # time; the service does that only when asked. Equal work: ask for all of it each step.
            full = service_rate(client, "scienceworld", {"include_valid_actions": True}, seed, SW_ACTIONS,
                                procs, args.seconds, truth_each_step=True)
            out.update(scienceworld_package_steps_s=round(base, 1), scienceworld_service_steps_s=round(svc, 1),
                       scienceworld_service_equal_work_steps_s=round(full, 1),
                       ratio_scienceworld=round(svc / base, 3), ratio_scienceworld_equal_work=round(full / base, 3))
        if args.only in (None, "alfworld"):
            game_file, walk = alfworld_game(client)
            base = package_rate(_alf_package, (game_file, walk), procs, args.seconds)
            svc = service_rate(client, "alfworld", {}, ALF_SEED, walk, procs, args.seconds)
            raw = service_rate(client, "alfworld", {"engine_caches": False}, ALF_SEED, walk, procs, args.seconds)
            out.update(alfworld_walkthrough_steps=len(walk), alfworld_package_steps_s=round(base, 2),
                       alfworld_service_steps_s=round(svc, 2), alfworld_service_nocache_steps_s=round(raw, 2),
                       ratio_alfworld=round(svc / base, 3), ratio_alfworld_nocache=round(raw / base, 3))
    for k, v in out.items():
        print(f"{k:36s} {v}")
    if args.json:
        print(json.dumps(out))


def _sw_variation() -> int:
    from envserve.envs.scienceworld.catalog import load_catalog
    return next(t for t in load_catalog()["tasks"] if t["name"] == SW_TASK)["train"][0]


def _sw_seed() -> int:
    """The L0 seed of SW_TASK's first train variation (the one the baseline plays)."""
    from envserve.envs.scienceworld.env import ScienceWorldEnv, _tasks_by_split
    cfg = ScienceWorldEnv.spec.config_defaults
    pairs = _tasks_by_split(frozenset(cfg["heldout_tasks"].split(",")), {"L0": "train", "L1": "test", "L2": "test"})["L0"]
    k = next(i for i, (name, _) in enumerate(pairs) if name == SW_TASK)
    return ScienceWorldEnv.spec.split("L0").seed_offset + k


if __name__ == "__main__":
    main()
