"""The replica's own bookkeeping, on a real Replica whose sessions live in this process (--inline):
sessions a worker holds that the front never recorded are closed by the sweep, and a batch's reply
never passes the message limit."""
from __future__ import annotations

import asyncio

from envserve.server.config import ServerConfig
from envserve.server.metrics import Metrics
from envserve.server.service import Replica
from envserve.v1 import envserve_pb2 as pb


def _replica(**kw) -> Replica:
    return Replica(ServerConfig(env_ids=["frozenlake"], inline=True, **kw), Metrics())


def test_the_sweep_closes_sessions_the_front_does_not_know():
    async def main():
        r = _replica()
        await r.start("r")
        try:
            ids, _ = await r.open("frozenlake", 2, {}, "")
            w = r.pool.workers[0]
            # Sessions a worker built for an Open whose record never came (its caller left, and
            # closing them failed): the worker holds them, the front does not know them.
            assert (await r.pool.call(w, "open", ("frozenlake", {}, "", ["r/lost1", "r/lost2"], "")))[0] == "ok"
            r.building.add("r/opening")   # one still being built is left alone
            assert (await r.pool.call(w, "open", ("frozenlake", {}, "", ["r/opening"], "")))[0] == "ok"
            assert await r.sweep_orphans() == 2
            assert sorted(await r.pool.call(w, "held", None)) == sorted([*ids, "r/opening"])
            assert await r.sweep_orphans() == 0
        finally:
            await r.close()

    asyncio.run(main())


def test_a_reply_over_the_message_limit_drops_results_not_the_call():
    async def main():
        r = _replica(max_message_bytes=16384)
        await r.start("r")
        try:
            # Results with an image (about a kilobyte each) and a limit that holds a few of them.
            ids, _ = await r.open("frozenlake", 40, {"render_image": True}, "")
            reply = pb.BatchResponse.FromString(await r.run_batch([("reset", sid, 1, "", "", False) for sid in ids]))
            assert len(reply.results) == 40 and len(reply.SerializeToString()) <= 16384
            codes = [res.status.code for res in reply.results]
            kept = codes.index(8)           # the first result that did not fit, RESOURCE_EXHAUSTED
            assert kept > 0 and set(codes[:kept]) == {0} and set(codes[kept:]) == {8}
            assert "ReadState" in reply.results[-1].status.message
            # The resets ran all the same: every session steps.
            after = pb.BatchResponse.FromString(await r.run_batch([("step", sid, "<answer>Left</answer>") for sid in ids[-3:]]))
            assert [res.turn for res in after.results] == [1, 1, 1]
        finally:
            await r.close()

    asyncio.run(main())
