"""ARPO's branching rollout and its training step against a real envserve server on loopback
(FrozenLake 4x4, the tiny random-weight model): branches are Forks taken before the parent's answer
at the branching turn is stepped, so they start from exactly the parent's state and context; the
budget is M trajectories per task (N initial, the rest branched or independent); every fork is
closed; one training iteration runs end to end and logs the branching metrics. Plus the pure
pieces (the budget's bookkeeping, the builder copy) with hand-worked numbers."""
from __future__ import annotations

import asyncio
import dataclasses
import math
from collections import Counter, defaultdict

import grpc
import pytest

from serverproc import ServerProcess

from envserve.client import AsyncEnvClient
from envserve.v1 import envserve_pb2 as pb
from envserve.v1 import envserve_pb2_grpc as pb_grpc
from envserve_trainer.config.train_config import TrainConfig
from envserve_trainer.models.small import weights_digest
from envserve_trainer.policies.hf import HFPolicy
from envserve_trainer.rollout.branching import (BRANCH, INDEPENDENT, INITIAL, BranchingRollout, TaskBudget,
                                                fork_builder, support_size)
from envserve_trainer.process_training import build_method
from envserve_trainer.rollout.prompting import ChatLayout, ContextBuilder
from envserve_trainer.rollout.engine import Task
from envserve_trainer.train import Connection, allowed_token_ids, build_policy_model

from test_training_e2e import FROZENLAKE_GRPO, run_training  # noqa: E402  (same folder: the e2e test's small run)

M, N, Z = 6, 2, 2
FORCED = {"alpha": 1.0}                   # P = 1 + 0.2 dH > 0.5 for any |dH| <= 1 (log_vocab scale)
NEVER = {"alpha": 0.0, "beta": 0.0}       # P = 0: never above 0.5
TASKS = [Task(0), Task(1), Task(2), Task(3)]


@pytest.fixture(scope="module")
def server():
    with ServerProcess(["frozenlake"], workers=1, metrics=False) as s:
        yield s


def _cfg(**arpo) -> TrainConfig:
    return TrainConfig.from_mapping(FROZENLAKE_GRPO).with_overrides(
        process={"method": "arpo", "arpo": {"total_rollouts": M, "initial_rollouts": N, "branches": Z, **arpo}},
        run={"iterations": 1, "checkpoint_every": 0, "progress": False})


@pytest.fixture(scope="module")
def policy(server):
    cfg = _cfg()
    model, tok = build_policy_model(cfg, "cpu", Connection(env_address=server.address))
    return HFPolicy(model, tok, allowed_token_ids=allowed_token_ids(tok, cfg.rollout.allowed_words,
                                                                     cfg.rollout.max_new_tokens))


def _live(address: str) -> set[str]:
    with grpc.insecure_channel(address) as ch:
        reply = pb_grpc.MonitorServiceStub(ch).ListSessions(pb.ListSessionsRequest(env_id="frozenlake", limit=10000))
    return {s.session_id for s in reply.sessions}


def _collect(server, policy, cfg, on_fork=None, entropy=None, tasks=TASKS):
    async def main():
        async with AsyncEnvClient(server.address) as client:
            rollout = BranchingRollout(client, policy, policy.tokenizer, cfg, iteration=0, entropy=entropy,
                                       on_fork=on_fork and (lambda parent, sids: on_fork(client, parent, sids)))
            return await rollout.collect(tasks)
    return asyncio.run(main())


def _by_task(trials):
    out = defaultdict(list)
    for t in trials:
        out[t.group].append(t)
    return out


# -- the state a branch starts from -------------------------------------------------------------------
def test_branches_start_from_the_parents_exact_state_and_every_fork_is_closed(server, policy):
    before = _live(server.address)
    seen = []            # (parent sample, group, branching turn index, the parent's and the forks' GetState)

    async def on_fork(client, parent, sids):
        # Read the ground truth before anything steps: the parent is still in the state its answer
        # at this turn was sampled in, and so must every fork be.
        states = [await client.get_state(s) for s in [parent.session_id, *sids]]
        seen.append((parent.trial.sample, parent.task.group, len(parent.episode.turns), states))

    trials, metrics = _collect(server, policy, _cfg(**FORCED), on_fork)
    assert seen and metrics["branches"] > 0
    for _, _, _, (parent, *forks) in seen:
        assert len(forks) <= Z
        for f in forks:
            assert f.session_id != parent.session_id
            assert (f.turn, f.anchor, f.observation_text) == (parent.turn, parent.anchor, parent.observation_text)
            assert f.state == parent.state and list(f.relations) == list(parent.relations)

    by_sample = {(t.group, t.sample): t for t in trials}
    checked = same_answer = 0
    for sample, group, t, (state, *_) in seen:
        parent = by_sample[(group, sample)].episodes[0]
        # The fork was taken at the turn the parent then answered: that turn acted in the forked
        # state (a fork after the parent's step would hold the next state instead).
        assert parent.turns[t].state_anchor == state.anchor and parent.turns[t].turn == state.turn
        branches = [tr for tr in trials if tr.group == group and tr.info.get("branch_of") == sample
                    and tr.info.get("branch_turn") == t]
        assert branches
        for tr in branches:
            ep = tr.episodes[0]
            assert tr.info["arpo"] == BRANCH and "error" not in tr.info
            # The parent's prefix, token for token, then the branch's own answer in the same context.
            assert [(x.prompt_ids, x.completion_ids, x.action, x.anchor) for x in ep.turns[:t]] == \
                   [(x.prompt_ids, x.completion_ids, x.action, x.anchor) for x in parent.turns[:t]]
            assert ep.turns[t].prompt_ids == parent.turns[t].prompt_ids
            assert ep.turns[t].state_anchor == state.anchor
            if ep.turns[t].completion_ids == parent.turns[t].completion_ids:
                # FrozenLake is deterministic: the same answer in the same state leads to the same state.
                assert ep.turns[t].anchor == parent.turns[t].anchor
                same_answer += 1
            checked += 1
    assert checked == metrics["branches"]
    assert same_answer < checked            # branches re-sample the turn, not copy the parent's answer
    assert _live(server.address) <= before  # every fork and every initial session closed


# -- the budget ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("arpo, branching", [(FORCED, True), (NEVER, False)])
def test_every_task_gets_m_trajectories_n_of_them_initial(server, policy, arpo, branching):
    trials, metrics = _collect(server, policy, _cfg(**arpo))
    groups = _by_task(trials)
    assert sorted(groups) == sorted(t.group for t in TASKS)
    for group, ts in groups.items():
        kinds = Counter(t.info["arpo"] for t in ts)
        assert len(ts) == M and sorted(t.sample for t in ts) == list(range(M))
        assert kinds[INITIAL] == N and kinds[BRANCH] + kinds[INDEPENDENT] == M - N
        # Each branching point took Z branches, or what was left of M - N.
        points = Counter((t.info["branch_of"], t.info["branch_turn"]) for t in ts if t.info["arpo"] == BRANCH)
        assert all(1 <= n <= Z for n in points.values())
        assert all(t.episodes[0].turns for t in ts)
    assert metrics["rollouts_per_task"] == M
    assert metrics["decisions"] > 0
    assert metrics["branches"] + metrics["independent"] == len(TASKS) * (M - N)
    assert metrics["branches"] == sum(t.info["arpo"] == BRANCH for t in trials)
    if branching:
        # alpha 1: every decision branches, and the budget runs out on them.
        assert metrics["branch_points"] == metrics["decisions"] and metrics["branches"] > 0
    else:
        assert metrics["branch_points"] == 0 and metrics["branches"] == 0
        assert metrics["independent"] == len(TASKS) * (M - N)


def test_the_entropy_change_is_measured_against_the_first_answer(server, policy):
    """An entropy of 1 nat on a trajectory's first answer and 3 on every later one: dH = 2 on the
    raw scale, P = 0.5 + 0.2 * 2 = 0.9 > 0.5 at each decision, and a branch's own first answer (at
    the turn it was forked at) is no decision."""
    def entropy(prompts, completions):
        return [1.0 if _is_first(p) else 3.0 for p in prompts]
    first_prompts = set()

    def _is_first(prompt):
        return tuple(prompt) in first_prompts
    # The first answer's prompt is the system block plus the reset observation, with no history
    # (kept here, so that no later prompt equals it): built from the tasks' reset results.
    cfg = _cfg(entropy_scale="none").with_overrides(rollout={"history_turns": 10})

    async def firsts():
        async with AsyncEnvClient(server.address) as c:
            sids, prompt = await c.open_with_prompt("frozenlake", len(TASKS), {"size": 4}, "no_think")
            results = await c.reset(sids, seeds=[t.seed for t in TASKS])
            await c.close_sessions(sids)
        ro = cfg.rollout
        for r in results:
            b = ContextBuilder(ChatLayout(policy.tokenizer), prompt, ro.template, ro.history_turns,
                               ro.response_prefix, ro.response_suffix)
            first_prompts.add(tuple(b.prompt_ids(r.observation.text, r.turn)[0]))
    asyncio.run(firsts())
    trials, metrics = _collect(server, policy, cfg, entropy=entropy)
    assert metrics["decisions"] > 0 and metrics["mean_dh"] == pytest.approx(2.0)
    assert metrics["branch_points"] == metrics["decisions"]
    # Decisions: one per answer after the first, less each branch's re-sampled answer.
    answers = sum(len(t.episodes[0].turns) - (t.info.get("branch_turn", 0) if t.info["arpo"] == BRANCH else 0)
                  for t in trials if t.info["arpo"] != INDEPENDENT)
    firsts_answered = sum(t.info["arpo"] == INITIAL for t in trials)
    branch_turns = sum(t.info["arpo"] == BRANCH for t in trials)
    assert metrics["decisions"] == answers - firsts_answered - branch_turns


# -- the training step ----------------------------------------------------------------------------------
def test_one_arpo_iteration_trains_on_m_trajectories_per_task_and_logs_the_branching(server, tmp_path):
    before = _live(server.address)
    cfg = _cfg(**FORCED)
    trainer, start, records = run_training(cfg, server.address, tmp_path)
    (r,) = records
    p = r["process"]
    tasks = cfg.rollout.tasks_per_iteration
    assert p["rollouts_per_task"] == M and r["train"]["trials"] == tasks * M and r["dropped_trials"] == 0
    assert p["branches"] + p["independent"] == tasks * (M - N) and p["fork_failed"] == 0
    assert p["branches"] > 0 and p["branch_points_used"] >= p["branches"] / Z
    assert math.isfinite(p["mean_dh"]) and -1.0 <= p["mean_dh"] <= 1.0        # log_vocab: within +-1
    # |V| = the 4 allowed words (one token each): entropies are at most ln 4.
    assert 0.0 < p["mean_entropy"] <= math.log(4) + 1e-6
    assert r["update"]["samples"] > 0 and "rollout_s" in r["timing"] and "process_s" not in r["timing"]
    assert weights_digest(trainer.learner.model) != start
    assert _live(server.address) <= before


def test_the_method_is_built_from_the_config_and_refuses_what_it_cannot_train(server, policy):
    method = build_method(_cfg(), policy.model, policy.tokenizer)
    assert method.name == "arpo" and method.collects and not method.preference
    with pytest.raises(ValueError, match="advantage_mode 'hard'"):
        build_method(_cfg(advantage_mode="hard"), policy.model, policy.tokenizer)
    with pytest.raises(ValueError, match="episodes_per_trial"):
        build_method(_cfg().with_overrides(rollout={"episodes_per_trial": 2}), policy.model, policy.tokenizer)
    with pytest.raises(ValueError, match="mc_max_alive"):
        build_method(_cfg(total_rollouts=80, initial_rollouts=8).with_overrides(process={"mc_max_alive": 64}),
                     policy.model, policy.tokenizer)
    assert support_size(policy) == 4       # the restricted vocabulary: Left, Down, Right, Up


# -- pure pieces ----------------------------------------------------------------------------------------
def test_the_task_budget_spends_m_minus_n_in_decision_order():
    b = TaskBudget(total=8, initial=4, branches=3)
    # M - N = 4: the first branching point takes Z = 3, a refusal takes 0, the next takes the last 1,
    # and a later branching point finds nothing left.
    assert [b.decide(True, 0.1), b.decide(False, -0.2), b.decide(True, 0.3), b.decide(True, 0.4)] == [3, 0, 1, 0]
    assert b.plan.branches == (3, 0, 1, 0) and b.plan.independent == 0 and b.plan.total == 8
    assert b.changes == [0.1, -0.2, 0.3, 0.4]
    never = TaskBudget(total=8, initial=4, branches=3)
    never.decide(False, 0.0)
    assert never.plan.independent == 4
    assert [never.take_sample() for _ in range(3)] == [0, 1, 2]


def test_a_forked_builder_extends_its_own_history(policy):
    layout = ChatLayout(policy.tokenizer)
    parent = ContextBuilder(layout, "rules", history_turns=2)
    parent.record("obs 0", [1, 2], [3], "Left")
    branch = fork_builder(parent)
    branch.record("obs 1", [4], [5], "Up")
    branch.history[0].feedback = "bumped"
    assert [h.action for h in parent.history] == ["Left"] and parent.history[0].feedback == ""
    assert [h.action for h in branch.history] == ["Left", "Up"]
    assert dataclasses.replace(parent).layout is branch.layout      # the tokenizer is shared, not copied
