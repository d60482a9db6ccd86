"""Process-reward methods inside the training loop, against a real envserve server on loopback:
AgentPRM (Q-hat from visits plus forked rollouts, the step scorer's BCE, KL to the previous
policy), InversePRM (the expert's transitions against the policy's) and ProgRM (recipes from
successes, progress labels, progress rewards), each for two iterations with the tiny model."""
from __future__ import annotations

import grpc
import pytest

from serverproc import ServerProcess

from envserve.v1 import envserve_pb2 as pb
from envserve.v1 import envserve_pb2_grpc as pb_grpc
from envserve_trainer.config.train_config import TrainConfig
from envserve_trainer.models.small import weights_digest
from envserve_trainer.process_training import ProgRM, action_key, transitions
from envserve_trainer.train import Connection
from envserve_trainer.rollout.trajectory import Episode, Turn

from test_training_e2e import FROZENLAKE_GRPO, run_training  # noqa: E402  (same folder: the e2e test's small run)

pytestmark = pytest.mark.slow


# The e2e test's FrozenLake run, on REINFORCE++ (per-step rewards count) with KL to the previous policy.
BASE = {**FROZENLAKE_GRPO, "algo": {"estimator": "reinforce_pp"},
        "update": {**FROZENLAKE_GRPO["update"], "kl_coef": 0.01, "reference": "previous"},
        "run": {"iterations": 2, "checkpoint_every": 0, "progress": False}}


@pytest.fixture(scope="module")
def server():
    with ServerProcess(["frozenlake"], workers=1, metrics=False) as s:
        yield s


def _cfg(**sections) -> TrainConfig:
    return TrainConfig.from_mapping(BASE).with_overrides(**sections)


def _live(address: str) -> list[str]:
    with grpc.insecure_channel(address) as ch:
        reply = pb_grpc.MonitorServiceStub(ch).ListSessions(pb.ListSessionsRequest(env_id="frozenlake", limit=10000))
    return [s.session_id for s in reply.sessions]


def _run(cfg, server, tmp_path):
    return run_training(cfg, server.address, tmp_path)


def test_agentprm_forks_trains_its_scorer_and_keeps_kl_to_the_previous_policy(server, tmp_path):
    before = set(_live(server.address))
    cfg = _cfg(process={"method": "agentprm", "mc_rollouts": 3, "mc_states": 4, "prm_epochs": 3})
    trainer, start, records = _run(cfg, server, tmp_path)
    assert [r["iteration"] for r in records] == [1, 2]
    for r in records:
        p = r["process"]
        # 4 least-visited (s, a) pairs each got 3 forked rollouts (at least one env step each).
        assert p["mc_states"] == 4 and p["mc_failed"] == 0 and p["mc_env_steps"] >= 12
        assert p["prm_examples"] > 0 and p["q_hat_states"] > 0
        assert 0.0 < p["prm_score_mean"] < 1.0            # sigma(Q_phi): strictly inside (0, 1)
        assert abs(p["process_reward_mean"]) < 1e-6       # centred (process.center_reward)
        assert r["update"]["samples"] > 0
    # The scorer's buffer grows across iterations (iteration 1's examples still count in 2).
    assert records[1]["process"]["prm_examples"] > records[0]["process"]["prm_examples"]
    # KL to the previous policy: the reference is the policy before the last update, neither the
    # starting weights nor the final ones.
    ref = weights_digest(trainer.learner.reference)
    assert ref != start and ref != weights_digest(trainer.learner.model)
    # Every fork the estimate opened is closed (the rollout's own sessions are closed at the end too).
    assert set(_live(server.address)) <= before


def test_inverse_prm_separates_the_experts_transitions_from_the_policys(server, tmp_path):
    cfg = _cfg(process={"method": "inverse_prm", "expert_episodes": 8, "prm_epochs": 6, "prm_lr": 3e-4},
               run={"iterations": 2, "checkpoint_every": 0, "progress": False})
    trainer, start, records = _run(cfg, server, tmp_path)
    p = records[-1]["process"]
    # 8 expert episodes of FrozenLake 4x4 (the shortest path: each a few turns), all ending in the goal.
    assert p["expert_transitions"] >= 8 and p["policy_transitions"] > 0
    # The classifier finds the expert's transitions more expert-like than the random policy's.
    assert p["expert_prob_expert"] > p["expert_prob_policy"]
    assert p["prm_loss_last"] < p["prm_loss_first"]
    assert weights_digest(trainer.learner.model) != start


def test_progrm_labels_a_trajectory_by_its_clusters_recipe(server, tmp_path):
    cfg = _cfg(process={"method": "progrm"})
    from envserve_trainer.train import build_policy_model
    model, tok = build_policy_model(cfg, "cpu", Connection(env_address=server.address))
    method = ProgRM(cfg, model, tok)

    def episode(actions, success, group="g"):
        ep = Episode("frozenlake", "", 0, group, 0, 0)
        for i, a in enumerate(actions):
            ep.turns.append(Turn(i, [1, 2], [3], [0.0], a, f"<answer>{a}</answer>", "", 0.0,
                                 parsed_actions=[a], success=success and i == len(actions) - 1,
                                 done=i == len(actions) - 1))
        return ep

    for seq in (["A", "B", "X", "C", "D"], ["A", "Y", "B", "C", "D"]):
        method.successes["g"].append(seq)
    # The recipe is LCS(ABXCD, AYBCD) = ABCD; a 7-step trajectory matching A, B and D of it is
    # labelled 1/4 at A, 2/4 at B, carried over the misses, and 3/4 at D (the third key step it
    # matches: C is missing).
    assert method.recipes_for(episode([], False)) == [["A", "B", "C", "D"]]
    assert method.labels(episode(["A", "Q", "B", "Q", "Q", "D", "Q"], False)) == [0.25, 0.25, 0.5, 0.5, 0.5, 0.75, 0.75]
    # Another task's group has no successes yet, hence no recipe and no labels.
    assert method.labels(episode(["A", "B"], False, group="other")) is None
    assert action_key(Turn(0, [], [], [], "", "<answer>x</answer>", "", 0.0)) == "<answer>x</answer>"


def test_progrm_trains_with_progress_rewards(server, tmp_path):
    cfg = _cfg(process={"method": "progrm", "progrm": {"min_cluster_size": 1}},
               run={"iterations": 3, "checkpoint_every": 0, "progress": False})
    trainer, start, records = _run(cfg, server, tmp_path)
    for r in records:
        p = r["process"]
        # Progress rewards telescope to the last Prog, a probability: their mean lies in (-1, 1).
        assert -1.0 < p["process_reward_mean"] < 1.0
    assert any(r["process"]["labelled_trajectories"] > 0 for r in records) or \
        all(r["train"]["success_rate"] == 0 for r in records)


def test_transitions_leave_out_a_cut_trajectorys_last_step():
    steps = [([1], [2]), ([3], [4]), ([5], [6])]
    ended = transitions(steps, ended=True, expert=True)
    assert [(t.prompt_ids, t.next_prompt_ids) for t in ended] == [([1], [3]), ([3], [5]), ([5], None)]
    cut = transitions(steps, ended=False, expert=False)
    assert [(t.prompt_ids, t.next_prompt_ids) for t in cut] == [([1], [3]), ([3], [5])]
    assert not any(t.expert for t in cut)


def test_unknown_process_method_is_refused():
    with pytest.raises(ValueError, match="process.method"):
        _cfg(process={"method": "magic"})
    with pytest.raises(ValueError, match="unknown"):
        _cfg(process={"method": "agentprm", "agentprm": {"gama": 0.9}})


ONE_WORD = {"env_config": {"size": 4, "max_actions_per_turn": 1}}   # the expert answers a word a turn


def test_ipr_builds_step_and_outcome_pairs_on_the_experts_trajectories(server, tmp_path):
    before = set(_live(server.address))
    cfg = _cfg(env=ONE_WORD, process={"method": "ipr", "ipr": {"rollouts_per_step": 3}},
               update={"lr": 1e-3, "micro_batch_size": 16, "kl_coef": 0.0})
    trainer, start, records = _run(cfg, server, tmp_path)
    for r in records:
        p, u = r["process"], r["update"]
        # 2 tasks with expert trajectories; the random policy proposes other steps than the expert's
        # at some of them, and forked rollouts after each side separate some of those.
        assert p["expert_tasks"] == 2 and p["alternatives"] > 0 and p["mc_failed"] == 0
        assert p["step_pairs"] > 0 and p["outcome_pairs"] > 0
        assert p["expert_wins"] <= p["step_pairs"]
        assert u["pairs"] == p["step_pairs"] + p["outcome_pairs"] and u["sft_rows"] > 0
        assert all(torch_finite(v) for v in u.values())
    assert weights_digest(trainer.learner.model) != start
    assert set(_live(server.address)) <= before


def test_rro_searches_until_the_reward_rises_and_closes_its_sessions(server, tmp_path):
    before = set(_live(server.address))
    cfg = _cfg(env=ONE_WORD, process={"method": "rro", "rro": {"rollouts_per_prefix": 3, "max_candidates": 4}},
               rollout={"max_turns": 6}, update={"lr": 1e-3, "micro_batch_size": 16, "kl_coef": 0.0})
    trainer, start, records = _run(cfg, server, tmp_path)
    for r in records:
        p = r["process"]
        assert p["walks"] == 2 and p["walks_failed"] == 0
        # At least one candidate a step, at most max_candidates; a pair only where rewards differed.
        assert 1.0 <= p["candidates_per_step"] <= 4.0
        assert p["step_pairs"] <= p["steps_searched"]
    assert sum(r["process"]["step_pairs"] for r in records) > 0
    assert set(_live(server.address)) <= before


def test_preference_update_moves_the_policy_towards_the_chosen_side(server, tmp_path):
    from envserve_trainer.update.learner import Learner
    from envserve_trainer.update.distributed import Dist
    from envserve_trainer.update.losses import PreferencePair, side_logprobs
    from envserve_trainer.train import build_policy_model
    import copy
    cfg = _cfg(update={"lr": 3e-3, "micro_batch_size": 8, "kl_coef": 0.0, "epochs": 8})
    model, tok = build_policy_model(cfg, "cpu", Connection(env_address=server.address))
    reference = copy.deepcopy(model)
    learner = Learner(model, tok, cfg, Dist.from_env("cpu"), reference=reference)
    ids = lambda w: tok(w, add_special_tokens=False)["input_ids"]
    prompt = ids("the player is left of the goal")
    pairs = [PreferencePair("step", [(prompt, ids("Right"))], [(prompt, ids("Left"))]),
             PreferencePair("outcome", [(prompt, ids("Right")), (prompt, ids("Down"))],
                            [(prompt, ids("Left")), (prompt, ids("Up"))])]
    stats = learner.preference_update(pairs, sft_rows=[(prompt, ids("Right"))], beta=0.1)
    assert stats["pairs"] == 2 and stats["step_loss"] > 0 and stats["outcome_loss"] > 0
    with __import__("torch").no_grad():
        pc, pr, rc, rr = side_logprobs(learner.model, reference, pairs, pad_token_id=learner.pad_token_id)
    # Both pairs now prefer their chosen side more than the reference does.
    assert ((pc - rc) - (pr - rr) > 0).all()


def torch_finite(v) -> bool:
    import math
    return math.isfinite(float(v))
