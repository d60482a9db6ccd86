"""The inline pool (`serve --inline`): the worker's operations run in the front's own process.
Driven through the real WorkerPool on an event loop, as the replica drives it."""
import asyncio

import grpc
import pytest

from envserve.core.registry import get_env_class, register, unregister
from envserve.server.pool import WorkerPool
from envserve.v1 import envserve_pb2 as pb


def _faulty_sokoban():
    """Sokoban whose 'Up' raises: an env bug, to see that it fails its own item only."""
    base = get_env_class("sokoban")

    class FaultySokoban(base):
        def step(self, action):
            if action == "Up":
                raise RuntimeError("env bug on Up")
            return super().step(action)
    return FaultySokoban


def drive(envs, body):
    """Runs `await body(pool, handle, deaths)` on an inline pool serving `envs`, then closes it."""
    async def main():
        deaths = []
        pool = WorkerPool(0, envs, deaths.append, inline=True)
        await pool.start()
        try:
            (h,) = pool.alive_workers()
            await body(pool, h, deaths)
        finally:
            await pool.close()
    asyncio.run(main())


@pytest.fixture
def faulty_sokoban():
    register("faulty_sokoban", _faulty_sokoban())
    yield "faulty_sokoban"
    unregister("faulty_sokoban")  # later tests list the registered envs


def test_an_env_exception_fails_its_item_and_the_rest_of_the_batch_steps(faulty_sokoban):
    async def body(pool, h, deaths):
        ids = ["r/a", "r/b", "r/c"]
        assert (await pool.call(h, "open", ("faulty_sokoban", {}, "no_think", ids, "")))[0] == "ok"
        await pool.call(h, "batch", [("reset", sid, k, "", "", False) for k, sid in enumerate(ids)])
        reply = await pool.call(h, "batch", [("step", "r/a", "<answer>Left</answer>"),
                                             ("step", "r/b", "<answer>Up</answer>"),
                                             ("step", "r/c", "<answer>Right</answer>")])
        results = list(pb.BatchResponse.FromString(b"".join(data for data, _ in reply)).results)
        assert [r.session_id for r in results] == ids
        assert results[0].status.code == 0 and results[0].turn == 1
        assert results[1].status.code == grpc.StatusCode.INTERNAL.value[0]
        assert "env bug on Up" in results[1].status.message
        assert results[2].status.code == 0 and results[2].turn == 1
        assert deaths == [] and h.alive
    drive([faulty_sokoban], body)


def test_an_exported_session_shares_nothing_with_its_parent():
    async def body(pool, h, _):
        await pool.call(h, "open", ("sokoban", {}, "no_think", ["r/p"], ""))
        await pool.call(h, "batch", [("reset", "r/p", 3, "", "", False)])
        status, blob = await pool.call(h, "export", "r/p")
        assert status == "ok"
        assert (await pool.call(h, "adopt", (blob, ["r/f"])))[0] == "ok"
        before = (await pool.call(h, "get_state", ("r/f", -1, None, None)))[1]
        for action in ("Left", "Down", "Right", "Up", "Left"):
            await pool.call(h, "batch", [("step", "r/p", f"<answer>{action}</answer>")])
        # The parent moved on five turns; the fork's latest state is still the one it was made at.
        assert (await pool.call(h, "get_state", ("r/f", -1, None, None)))[1] == before
        parent = pb.GetStateResponse.FromString((await pool.call(h, "get_state", ("r/p", -1, None, None)))[1])
        assert parent.turn == 5
    drive(["sokoban"], body)


def test_stream_answers_every_item_at_once():
    async def body(pool, h, _):
        ids = [f"r/{k}" for k in range(4)]
        await pool.call(h, "open", ("sokoban", {}, "", ids, ""))
        got = []
        pool.stream(h, [("reset", sid, k, "", "", False) for k, sid in enumerate(ids)], got.extend)
        assert sorted(i for i, _, _ in got) == [0, 1, 2, 3]
        assert [pb.StepResult.FromString(d).session_id for _, d, _ in sorted(got)] == ids
        assert await pool.call(h, "close", ids) == [True] * 4
        assert h.worker.sessions == {}
    drive(["sokoban"], body)


def test_a_close_still_frees_a_session_cycle_made_after_the_startup_objects_are_frozen():
    """Replicas freeze their startup objects so a Close's full collection is short; what sessions
    make afterwards is still collected: a closed session's env caught in a reference cycle is gone
    when the close returns."""
    import gc
    import weakref

    from envserve.server.worker import freeze_startup_objects
    made = []

    class CyclicSokoban(get_env_class("sokoban")):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.me = self  # freed by a collection only
            made.append(weakref.ref(self))

    register("cyclic_sokoban", CyclicSokoban)
    frozen_before = gc.get_freeze_count()
    try:
        freeze_startup_objects()
        assert gc.get_freeze_count() > frozen_before

        async def body(pool, h, _):
            assert (await pool.call(h, "open", ("cyclic_sokoban", {}, "no_think", ["r/c"], "")))[0] == "ok"
            await pool.call(h, "batch", [("reset", "r/c", 1, "", "", False)])
            assert made and made[-1]() is not None
            assert await pool.call(h, "close", ["r/c"]) == [True]
            assert made[-1]() is None, "the closed session's env is collected"
        drive(["cyclic_sokoban"], body)
    finally:
        gc.unfreeze()
        unregister("cyclic_sokoban")
