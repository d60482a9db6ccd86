"""Fork scenarios for the streaming client, each run in a fresh interpreter: what a fork sees depends
on every asyncio gRPC object the process holds, and a test process holds whatever earlier tests
left. `python forkproc.py SCENARIO TARGET [REPLICA_ADDRESS ...]` prints one JSON object.

worker    a forked worker (as PyTorch's DataLoader starts them) plays its own episode and steps a
          session the parent opened; the parent plays again after it.
hook      what the fork hook leaves a child (threads inside gRPC), and a session whose env the
          hook's own collection finalized, closed once the fork is done.
foreign   as worker, with an asyncio gRPC channel of the process's own open across the fork.
"""
from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MOVES = ["Right", "Down", "Left", "Up", "Down", "Right"]


def play(cls, seed: int) -> list[str]:
    env = cls()
    texts = [env.reset(seed=seed)]
    texts += [env.move(m) for m in MOVES]
    texts.append(env.get_reward())
    return texts


def _child(cls, parents_env, queue):
    from envserve.client import EnvServeError
    started = time.monotonic()
    try:
        mine = play(cls, 7)
        inherited = parents_env.move("Down")    # a session the parent opened, stepped from the child
        queue.put({"status": "ok", "mine": mine, "inherited": inherited})
    except EnvServeError as e:
        queue.put({"status": e.code.name, "message": e.message, "seconds": time.monotonic() - started})
    except BaseException as e:  # noqa: BLE001 (reported to the parent)
        queue.put({"status": "error", "message": repr(e)})


def worker(cls) -> dict:
    expected = play(cls, 7)                     # the parent's loop thread and streams are running
    parents = cls()
    parents.reset(seed=3)
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child, args=(cls, parents, queue), daemon=True)  # ends with this one
    child.start()
    out = queue.get(timeout=300)
    child.join(60)
    out.update(expected=expected, after=play(cls, 7))   # the parent's client goes on
    return out


def hook(cls, addresses: list[str]) -> dict:
    from adapter_support import live_session_ids
    from envserve.client import streaming
    expected = play(cls, 5)
    # An env left in a reference cycle: the hook's own collection runs its finalizer, which closes
    # its session (that call once waited for the fork to end, inside the fork: a hang).
    leftover = cls()
    leftover.reset(seed=1)
    sid = leftover._session.real_id
    address = next(a for a in addresses if sid in live_session_ids(a, "frozenlake"))
    leftover.cycle = leftover
    del leftover
    from envserve.client import sync_lane
    # On a starved machine (the contention stage: burners and another test process beside the
    # replicas) closing the channels to every replica can take most of the default 30 s; the hook
    # gets the time it needs, and a poller that never ends still fails the test.
    streaming.FORK_WAIT = 120.0
    lane_threads = list(sync_lane._STARTED)
    out = {"pollers_before": len(streaming._grpc_pollers()), "lanes_before": len(sync_lane._OPEN),
           "lane_threads_before": sum(t.is_alive() for t in lane_threads)}
    started = time.monotonic()
    streaming._before_fork()
    try:
        out["hook_seconds"] = round(time.monotonic() - started, 2)
        out["pollers_at_fork"] = len(streaming._grpc_pollers())
        out["loop_threads_at_fork"] = sum(t.name == "envserve-client-loop" for t in threading.enumerate())
        out["lanes_at_fork"] = len(sync_lane._OPEN)
        out["lane_threads_at_fork"] = sum(t.is_alive() for t in lane_threads)
    finally:
        streaming._after_fork(False)
    deadline = time.monotonic() + 60
    while sid in live_session_ids(address, "frozenlake") and time.monotonic() < deadline:
        time.sleep(0.1)
    out["leftover_closed"] = sid not in live_session_ids(address, "frozenlake")
    out["same_after"] = play(cls, 5) == expected  # the next call makes the loop and the channels again
    return out


def foreign(cls, addresses: list[str]) -> dict:
    import grpc

    from envserve.client import streaming
    # The hook waits for the poller up to FORK_WAIT, and this one never ends: the refusal is the
    # same after 5 s.
    streaming.FORK_WAIT = 5.0
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    async def connect():
        channel = grpc.aio.insecure_channel(addresses[0])
        await channel.channel_ready()
        return channel
    channel = asyncio.run_coroutine_threadsafe(connect(), loop).result(60)
    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger(streaming.__name__).addHandler(handler)
    try:
        return {**worker(cls), "warnings": warnings}
    finally:
        asyncio.run_coroutine_threadsafe(channel.close(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)


def main() -> None:
    scenario, target, *addresses = sys.argv[1:]
    from envserve.integrations.trl import environment_factory
    cls = environment_factory(target, "frozenlake", include_rules=False)
    try:
        out = {"worker": lambda: worker(cls), "hook": lambda: hook(cls, addresses),
               "foreign": lambda: foreign(cls, addresses)}[scenario]()
    finally:
        cls.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
