"""Monte-Carlo values over Fork against real replicas: the estimate is the mean of the forks'
returns and every fork is closed; Fork and replay agree under a deterministic policy (from live
sessions and from a recorded trajectory's earlier turns); forks continue from exactly the parent's
state; Q(s, a) is r(s, a) + gamma V(s'); the number of live sessions stays within its bound, also
when m exceeds it; a replica killed mid-estimate fails the states it held and only those; a
cancelled estimate or a failing policy leaves no fork behind."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from envserve.client import AsyncRoutedClient
from envserve.client.aio import AsyncEnvClient
from envserve.directory import open_directory, replica_of
from envserve.v1 import envserve_pb2 as pb
from envserve.v1 import envserve_pb2_grpc as pb_grpc
from envserve_trainer.methods.process.montecarlo import (MCSettings, StatePoint, discounted, estimate, prefix_points,
                                                         random_valid_policy)
from serverproc import RedisProcess, ServerProcess

MOVES = ("Left", "Down", "Right", "Up")
# A guard against a hang, not a performance bound: far above what any of these estimates takes.
HANG_GUARD_S = 300


def cycle_policy(log: list | None = None):
    """Deterministic: the move is a function of the turn only, so a fork and a replayed session
    in the same state choose the same moves."""
    async def policy(results):
        if log is not None:
            log.append([r.session_id for r in results])
        return [f"<answer>{MOVES[(r.turn * 7 + 3) % 4]}</answer>" for r in results]
    return policy


def live_sessions(address: str, env_id: str) -> list[str]:
    with grpc.insecure_channel(address) as ch:
        reply = pb_grpc.MonitorServiceStub(ch).ListSessions(pb.ListSessionsRequest(env_id=env_id, limit=10000))
    return [s.session_id for s in reply.sessions]


async def _until(condition, guard_s: float = HANG_GUARD_S) -> None:
    deadline = time.monotonic() + guard_s
    while not condition() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


@pytest.fixture(scope="module")
def server():
    with ServerProcess(["frozenlake", "sokoban"], workers=2, metrics=False) as s:
        yield s


async def _points(ac, env_id: str, seeds, depth: int, config=None, fmt="no_think"):
    """Sessions walked `depth` turns along the cycle policy: the states to estimate."""
    config = dict(config or {})
    ids = await ac.open(env_id, len(seeds), config, fmt)
    results = await ac.reset(ids, seeds=list(seeds))
    prefixes = [[] for _ in ids]
    policy = cycle_policy()
    for _ in range(depth):
        live = [i for i, r in enumerate(results) if not (r.done or r.truncated)]
        answers = await policy([results[i] for i in live])
        stepped = await ac.step([(ids[i], a) for i, a in zip(live, answers)])
        for i, a, r in zip(live, answers, stepped):
            prefixes[i].append(a)
            results[i] = r
    return [StatePoint(sid, env_id, seed, tuple(p), config, fmt, last)
            for sid, seed, p, last in zip(ids, seeds, prefixes, results)]


@pytest.mark.parametrize("env_id,config", [("frozenlake", {"max_turns": 12}), ("sokoban", {"max_turns": 8})])
def test_fork_and_replay_agree_and_forks_are_closed(server, env_id, config):
    async def main():
        async with AsyncEnvClient(server.address) as ac:
            points = await _points(ac, env_id, range(6), depth=2, config=config)
            settings = MCSettings(rollouts_per_state=3, gamma=0.9)
            forked = await estimate(ac, points, cycle_policy(), settings, by="fork")
            replayed = await estimate(ac, points, cycle_policy(), settings, by="replay")
            for f, r in zip(forked, replayed):
                assert not f.failed and not r.failed
                assert len(f.returns) == 3 and f.sessions_opened == 3
                assert f.value == pytest.approx(sum(f.returns) / 3)
                assert f.returns == pytest.approx(r.returns)
                # Replay paid for the prefix again: 2 turns x 3 sessions more.
                assert r.env_steps - f.env_steps == 3 * len(f.point.prefix)
            # Some state has a non-zero value, so the agreement is not 0 == 0 everywhere.
            assert any(f.returns != [0.0] * 3 for f in forked) or env_id == "frozenlake"
            # Only the parents are left: every fork and replay session was closed.
            assert sorted(live_sessions(server.address, env_id)) == sorted(p.session_id for p in points)
            await ac.close_sessions([p.session_id for p in points])
    asyncio.run(main())


def test_a_recorded_trajectory_s_turns_fork_from_one_reached_session(server):
    """Points without a live session: Fork replays the prefix once and forks that session; replay
    replays it for every rollout. Same returns; the reaching sessions are closed too."""
    async def main():
        async with AsyncEnvClient(server.address) as ac:
            [walked] = await _points(ac, "sokoban", [5], depth=4, config={"max_turns": 12})
            await ac.close_sessions([walked.session_id])
            points = prefix_points("sokoban", 5, walked.prefix, {"max_turns": 12}, "no_think")
            assert [len(p.prefix) for p in points] == [0, 1, 2, 3]
            fresh = MCSettings(rollouts_per_state=4, gamma=0.95, reuse_sessions=False)
            forked = await estimate(ac, points, cycle_policy(), fresh, by="fork")
            replayed = await estimate(ac, points, cycle_policy(), fresh, by="replay")
            for f, r in zip(forked, replayed):
                assert not f.failed and not r.failed
                assert f.returns == pytest.approx(r.returns)
                assert f.sessions_opened == 1 + 4 and r.sessions_opened == 4
                assert r.env_steps - f.env_steps == (4 - 1) * len(f.point.prefix)
            assert live_sessions(server.address, "sokoban") == []
            # Reusing sessions (reset, then the prefix again): the same returns, and with room for
            # one state at a time (5 < 2 x 4) the first state's 4 sessions serve all four states.
            reused = await estimate(ac, points, cycle_policy(),
                                    MCSettings(rollouts_per_state=4, gamma=0.95, max_alive=5), by="replay")
            assert [v.returns for v in reused] == [pytest.approx(f.returns) for f in forked]
            assert sum(v.sessions_opened for v in reused) == 4
            assert live_sessions(server.address, "sokoban") == []
    asyncio.run(main())


def test_a_fork_continues_from_the_parents_exact_state(server):
    async def main():
        async with AsyncEnvClient(server.address) as ac:
            [point] = await _points(ac, "sokoban", [11], depth=3, config={"max_turns": 20})
            parent = await ac.get_state(point.session_id)
            assert parent.turn == 3
            seen = []

            async def policy(results):
                for r in results:
                    if r.turn == parent.turn:   # each fork's first turn: read its ground truth first
                        seen.append(await ac.get_state(r.session_id))
                return ["<answer>Up</answer>"] * len(results)
            values = await estimate(ac, [point], policy, MCSettings(rollouts_per_state=4, horizon=1))
            assert not values[0].failed and len(seen) == 4
            assert {s.session_id for s in seen}.isdisjoint({point.session_id})
            for s in seen:
                assert s.anchor == parent.anchor and s.turn == parent.turn
                assert s.state == parent.state and list(s.relations) == list(parent.relations)
            # The parent did not move while its forks stepped.
            assert (await ac.get_state(point.session_id)).turn == parent.turn
            await ac.close_sessions([point.session_id])
    asyncio.run(main())


def test_q_of_an_action_is_its_reward_plus_the_discounted_value_after_it(server):
    """Deterministic env and policy: Q(s, a) = r(s, a) + gamma * V(s'), where s' is the state
    a leads to (here reached by a live session that took a)."""
    async def main():
        async with AsyncEnvClient(server.address) as ac:
            gamma = 0.8
            settings = MCSettings(rollouts_per_state=2, gamma=gamma)
            checked = 0
            for seed in range(6):
                [s] = await _points(ac, "sokoban", [seed], depth=1, config={"max_turns": 10})
                if s.last_result.done or s.last_result.truncated:
                    # A terminal state: nothing to roll out, whatever the action.
                    [q] = await estimate(ac, [s], cycle_policy(), settings, first_actions=["<answer>Up</answer>"])
                    assert q.returns == [0.0, 0.0] and q.env_steps == 0
                    await ac.close_sessions([s.session_id])
                    continue
                for move in MOVES:
                    action = f"<answer>{move}</answer>"
                    [q] = await estimate(ac, [s], cycle_policy(), settings, first_actions=[action])
                    after = await ac.fork(s.session_id, 1)
                    [step] = await ac.step([(after[0], action)])
                    nxt = StatePoint(after[0], "sokoban", seed, s.prefix + (action,), s.config, "no_think", step)
                    [v] = await estimate(ac, [nxt], cycle_policy(), settings)
                    await ac.close_sessions(after)
                    assert not q.failed and not v.failed
                    expected = step.reward + (gamma * v.value if not (step.done or step.truncated) else 0.0)
                    assert q.value == pytest.approx(expected)
                    checked += 1
                await ac.close_sessions([s.session_id])
            assert checked >= 16
    asyncio.run(main())


def test_the_bound_on_live_sessions_holds_also_when_m_exceeds_it(server):
    assert discounted([1.0, 1.0, 10.0], 0.5) == 1.0 + 0.5 + 2.5
    with pytest.raises(ValueError):
        MCSettings(max_alive=1)

    async def main():
        async with AsyncEnvClient(server.address) as ac:
            points = await _points(ac, "frozenlake", range(8), depth=1, config={"max_turns": 10})
            parents = {p.session_id for p in points}
            peak = [0]

            async def policy(results):
                alive = set(live_sessions(server.address, "frozenlake")) - parents
                peak[0] = max(peak[0], len(alive))
                return [f"<answer>{MOVES[r.turn % 4]}</answer>" for r in results]
            for by in ("fork", "replay"):
                peak[0] = 0
                # m = 6 over at most 4 sessions: each state runs its rollouts in chunks of 4 and 2.
                values = await estimate(ac, points, policy, MCSettings(rollouts_per_state=6, max_alive=4), by=by)
                assert all(not v.failed and len(v.returns) == 6 for v in values)
                assert 2 <= peak[0] <= 4, by
                assert sorted(live_sessions(server.address, "frozenlake")) == sorted(parents)
            # Per-point budgets: 1 and 5 rollouts.
            values = await estimate(ac, points[:2], policy, MCSettings(max_alive=4), rollouts=[1, 5])
            assert [len(v.returns) for v in values] == [1, 5]
            await ac.close_sessions(list(parents))
    asyncio.run(main())


def test_a_cancelled_estimate_and_a_failing_policy_leave_no_fork(server):
    async def main():
        async with AsyncEnvClient(server.address) as ac:
            points = await _points(ac, "frozenlake", range(4), depth=1, config={"max_turns": 1000})
            parents = sorted(p.session_id for p in points)
            started = asyncio.Event()

            async def slow(results):
                started.set()
                await asyncio.sleep(0.05)
                return ["<answer>Left</answer>"] * len(results)
            task = asyncio.ensure_future(estimate(ac, points, slow, MCSettings(rollouts_per_state=3, horizon=500)))
            await started.wait()
            assert len(live_sessions(server.address, "frozenlake")) > len(parents)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            # The shielded opens and closes finish in the background after the cancel returns.
            await _until(lambda: sorted(live_sessions(server.address, "frozenlake")) == parents)
            assert sorted(live_sessions(server.address, "frozenlake")) == parents

            calls = [0]

            async def broken(results):
                calls[0] += 1
                if calls[0] == 3:
                    raise RuntimeError("policy bug")
                return ["<answer>Left</answer>"] * len(results)
            with pytest.raises(RuntimeError, match="policy bug"):
                await estimate(ac, points, broken, MCSettings(rollouts_per_state=3, horizon=500))
            assert sorted(live_sessions(server.address, "frozenlake")) == parents
            await ac.close_sessions(parents)
    asyncio.run(main())


def test_random_valid_policy_reads_the_listed_actions(server):
    async def main():
        async with AsyncEnvClient(server.address) as ac:
            config = {"max_turns": 6, "include_valid_actions": True}
            points = await _points(ac, "sokoban", range(3), depth=2, config=config)
            assert all("valid_actions" in p.last_result.info for p in points)
            sent = []
            inner = random_valid_policy(seed=1)

            async def policy(results):
                answers = await inner(results)
                sent.extend((list(r.info["valid_actions"]), a) for r, a in zip(results, answers))
                return answers
            values = await estimate(ac, points, policy, MCSettings(rollouts_per_state=2, horizon=3))
            assert all(not v.failed for v in values) and sent
            assert all(a.removeprefix("<answer>").removesuffix("</answer>") in valid for valid, a in sent)
            await ac.close_sessions([p.session_id for p in points])
    asyncio.run(main())


def test_a_replica_killed_mid_estimate_fails_its_states_only():
    try:
        redis_server = RedisProcess()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    extra = ["--directory", redis_server.url, "--heartbeat-seconds", "0.5"]
    a = ServerProcess(["frozenlake"], workers=1, metrics=False, extra=[*extra, "--replica-id", "mc-a"])
    b = ServerProcess(["frozenlake"], workers=1, metrics=False, extra=[*extra, "--replica-id", "mc-b"])
    try:
        d = open_directory(redis_server.url)
        while len(d.replicas()) < 2:
            time.sleep(0.05)

        async def main():
            # Without recovery: what a lost state does to the estimate (with it, the state is rebuilt).
            async with AsyncRoutedClient(redis_server.url, recovery=False) as rc:
                points = await _points(rc, "frozenlake", range(8), depth=1, config={"max_turns": 1000})
                on_a = {p.session_id for p in points if replica_of(p.session_id) == "mc-a"}
                assert 0 < len(on_a) < len(points)
                calls = [0]

                async def policy(results):
                    calls[0] += 1
                    if calls[0] == 6:
                        a.kill()
                    return ["<answer>Left</answer>"] * len(results)
                values = await asyncio.wait_for(
                    estimate(rc, points, policy, MCSettings(rollouts_per_state=2, horizon=40, max_alive=64)),
                    timeout=HANG_GUARD_S)
                for v in values:
                    if v.point.session_id in on_a:
                        assert v.failed and v.value is None
                        assert v.error.split(":")[0] in ("UNAVAILABLE", "DATA_LOSS", "NOT_FOUND"), v.error
                    else:
                        assert not v.failed and len(v.returns) == 2, v.error
                assert sorted(live_sessions(b.address, "frozenlake")) == \
                    sorted(p.session_id for p in points if p.session_id not in on_a)
        asyncio.run(main())
    finally:
        a.kill()
        b.kill()
        redis_server.stop()


def test_a_trainer_policy_backend_rolls_out_and_fork_and_replay_agree(server, grid_tokenizer):
    """chat_policy over the trainer's HF backend (a tiny random model restricted to the four
    moves), greedy so that the same observation gives the same move in a fork and a replay."""
    from envserve_trainer.models.small import build_small_model
    from envserve_trainer.policies.hf import HFPolicy
    from envserve_trainer.methods.process.montecarlo import chat_policy

    tok = grid_tokenizer
    ids = [tok.convert_tokens_to_ids(w) for w in MOVES]
    model = HFPolicy(build_small_model(tok, "tiny", seed=1), tok, allowed_token_ids=ids)

    async def main():
        async with AsyncEnvClient(server.address) as ac:
            points = await _points(ac, "frozenlake", range(3), depth=1, config={"max_turns": 8})
            policy = chat_policy(model, "Move on the lake.", max_new_tokens=1, temperature=0.0,
                                 response_prefix="<answer>", response_suffix="</answer>")
            settings = MCSettings(rollouts_per_state=2, horizon=4)
            forked = await estimate(ac, points, policy, settings, by="fork")
            replayed = await estimate(ac, points, policy, settings, by="replay")
            for f, r in zip(forked, replayed):
                assert not f.failed and not r.failed and len(f.returns) == 2
                assert f.returns == pytest.approx(r.returns)
                assert f.env_steps > 0
            await ac.close_sessions([p.session_id for p in points])
    asyncio.run(main())
