"""IPR's and RRO's pair builders on Sokoban and on generated ALFWorld games, through a real replica:
the expert's trajectory (the grid planner, ALFWorld's handcoded expert), the tiny random-weight
model's alternatives and candidates, Monte-Carlo returns by Fork, and every session closed after."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from serverproc import ServerProcess

from envserve.client import EnvClient
from envserve.client.aio import AsyncEnvClient
from envserve.v1 import envserve_pb2 as pb
from envserve.v1 import envserve_pb2_grpc as pb_grpc
from envserve_trainer.config.train_config import TrainConfig
from envserve_trainer.models.small import build_small_model, build_tokenizer, corpus_from_envs
from envserve_trainer.policies.hf import HFPolicy
from envserve_trainer.process_training import Context, build_method, spaced
from envserve_trainer.rollout.engine import RolloutEngine, Task

ENVS = {
    # Sokoban: the planner's pushes, one action a turn (as the tiny model writes one).
    "sokoban": {"env_config": {"max_actions_per_turn": 1}, "horizon": 0, "steps": 4},
    # ALFWorld: the handcoded expert on a generated game; rollouts cut at 2 turns (a garbage policy
    # never finishes one), comparing 3 of the expert's steps.
    "alfworld": {"env_config": {}, "horizon": 2, "steps": 3},
}


def _live(address: str, env_id: str) -> set[str]:
    with grpc.insecure_channel(address) as ch:
        reply = pb_grpc.MonitorServiceStub(ch).ListSessions(pb.ListSessionsRequest(env_id=env_id, limit=10000))
    return {s.session_id for s in reply.sessions}


def test_spaced_steps():
    assert spaced(10, 3) == [0, 4, 9] or spaced(10, 3) == [0, 5, 9]
    assert spaced(4, 0) == [0, 1, 2, 3] and spaced(4, 9) == [0, 1, 2, 3] and spaced(5, 1) == [4]


@pytest.mark.parametrize("env_id", list(ENVS))
def test_ipr_and_rro_build_pairs(env_id):
    spec = ENVS[env_id]
    with ServerProcess([env_id], workers=1, metrics=False) as server:
        with EnvClient(server.address, timeout=600) as sync:
            tok = build_tokenizer(corpus_from_envs(sync, (env_id,), seeds=range(1), steps=3))
            before = _live(server.address, env_id)
            cfg = TrainConfig.from_mapping({
                "env": {"env_id": env_id, "env_config": spec["env_config"], "num_tasks": 1},
                "rollout": {"group_size": 2, "tasks_per_iteration": 1, "history_turns": 0, "max_new_tokens": 8,
                            "max_turns": 3},
                "model": {"random_init": "tiny"},
                "process": {"method": "ipr", "mc_horizon": spec["horizon"], "mc_max_alive": 8,
                            "ipr": {"rollouts_per_step": 2, "max_steps": spec["steps"]},
                            "rro": {"rollouts_per_prefix": 2, "max_candidates": 2}},
            })
            model = build_small_model(tok, "tiny", seed=0)
            policy = HFPolicy(model, tok)
            ipr = build_method(cfg, model, tok, sync)
            rro = build_method(cfg.with_overrides(process={"method": "rro"}), model, tok)

        async def run():
            client = AsyncEnvClient(server.address, timeout=600)
            engine = RolloutEngine(client, policy, tok, cfg, seed=0)
            try:
                trials = await engine.collect([Task(0)], 2)
                ctx = Context(client, policy, engine.system_prompt, 0, engine.admissible)
                ipr_out = await ipr.pairs(trials, ctx)
                rro_out = await rro.pairs(trials, ctx)
            finally:
                await engine.close()
                await client.close()
            return ipr_out, rro_out

        (pairs, sft, m), (rro_pairs, _, rm) = asyncio.run(run())
        # IPR: the expert's trajectory of task 0 is the SFT data; the model's alternatives differ from
        # the expert's steps, and the forked returns after each side separate some of them (an
        # invalid or malformed alternative at least costs its penalty).
        assert m["expert_tasks"] == 1 and len(sft) >= 1 and m["mc_failed"] == 0
        assert 1 <= m["alternatives"] <= spec["steps"]
        assert m["step_pairs"] >= 1
        for p in pairs:
            assert p.chosen and p.rejected and p.kind in ("step", "outcome")
            if p.kind == "step":
                assert p.chosen[0][0] == p.rejected[0][0] and p.chosen[0][1] != p.rejected[0][1]
        # RRO: one walk over at most 3 turns, each step with 1 or 2 candidates explored.
        assert rm["walks"] == 1 and rm["walks_failed"] == 0
        assert 1 <= rm["steps_searched"] <= 3 and 1.0 <= rm["candidates_per_step"] <= 2.0
        assert rm["step_pairs"] == len(rro_pairs) <= rm["steps_searched"]
        # Every fork, replay and walk session is closed.
        assert _live(server.address, env_id) <= before
