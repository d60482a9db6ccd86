"""The rollout examples as a user runs them (subprocesses) against real servers on loopback: SkyRL's
and GEM's APIs over envserve sessions, OpenEnv's own client on a replica's --openenv-port, and a
rollout scored by `envserve judge` (the rule judge)."""
from __future__ import annotations

import re

import pytest

from exampleproc import live_session_ids, run_example
from serverproc import JudgeProcess, ServerProcess

EPISODE = re.compile(r"episode seed=(\d+): turns=(\d+) return=(-?[\d.]+) success=(True|False)")


@pytest.fixture(scope="module")
def replica():
    """Sokoban, with the OpenEnv endpoint too."""
    with ServerProcess(["sokoban"], workers=1, metrics=False, extra=["--openenv-port", "0"]) as server:
        line = next(x for x in server.output if "envserve openenv on " in x)
        server.openenv_url = line.split("envserve openenv on ")[1].split()[0]
        yield server


def test_skyrl_example_plays_episodes_to_the_end(replica):
    pytest.importorskip("skyrl_gym")
    out = run_example(["skyrl_sokoban.py", "--address", replica.address, "--episodes", "2"]).stdout
    episodes = EPISODE.findall(out)
    assert [int(s) for s, *_ in episodes] == [0, 1]
    # The planner solves each level: Sokoban's finishing bonus makes the return positive.
    assert all(success == "True" and float(ret) > 0 and int(turns) >= 1 for _, turns, ret, success in episodes)
    assert "invalid_actions=0" in out
    # A random policy hits the turn limit and the episode still ends.
    out = run_example(["skyrl_sokoban.py", "--address", replica.address, "--episodes", "1", "--policy", "random",
                       "--max-turns", "3", "--first-seed", "5"]).stdout
    (_, turns, _, _), = EPISODE.findall(out)
    assert int(turns) == 3
    assert not live_session_ids(replica.address, "sokoban")


def test_gem_example_plays_episodes_and_a_vector_env(replica):
    pytest.importorskip("gem")
    out = run_example(["gem_sokoban.py", "--address", replica.address, "--episodes", "2", "--vector", "3"]).stdout
    episodes = EPISODE.findall(out)
    assert [int(s) for s, *_ in episodes] == [0, 1]
    assert all(success == "True" and float(ret) > 0 for _, _, ret, success in episodes)
    vec = re.search(r"vector env: 3 sessions, 3 steps, rewards \[(.*)\]", out)
    assert vec and len(vec[1].split(",")) == 3
    assert not live_session_ids(replica.address, "sokoban")


def test_openenv_client_example_finishes_an_episode(replica):
    pytest.importorskip("openenv")
    url = replica.openenv_url + "/sokoban"
    out = run_example(["openenv_client.py", "--url", url, "--max-turns", "4", "--seed", "2"]).stdout
    assert "#" in out.splitlines()[0]                   # the first grid
    over = re.search(r"episode over: turns=(\d+) return=(-?[\d.]+) success=(\w+) truncated=(\w+)", out)
    assert over and int(over[1]) == len(re.findall(r"^turn \d+: ", out, re.M))
    assert over[3] == "True" or (int(over[1]) == 4 and over[4] == "True")   # won, or cut at the limit
    # With the replica's gRPC address, the planner's moves win.
    out = run_example(["openenv_client.py", "--url", url, "--seed", "3", "--grpc-address", replica.address]).stdout
    over = re.search(r"episode over: turns=(\d+) return=(-?[\d.]+) success=True", out)
    assert over and float(over[2]) > 0


def test_judge_loop_scores_true_texts_above_false_ones(replica):
    with JudgeProcess(replica.address) as judge:
        true = run_example(["judge_loop.py", "--address", replica.address, "--judge", judge.address,
                            "--seed", "0"]).stdout
        false = run_example(["judge_loop.py", "--address", replica.address, "--judge", judge.address,
                             "--seed", "0", "--wrong-every", "1"]).stdout
    pattern = re.compile(r"turn (\d+): grounding ([\d.-]+) world_modeling ([\d.-]+)")
    right, wrong = pattern.findall(true), pattern.findall(false)
    assert right and len(right) == len(wrong)            # the same moves, only the texts differ
    assert all(float(g) == 1.0 and float(w) == 1.0 for _, g, w in right)
    assert all(float(g) < 1.0 for _, g, _ in wrong) and "judge: grounding:" in false
    summary = re.compile(r"success=True env_return=([\d.-]+) mean_reasoning_reward=([\d.-]+)")
    (ret_t, mean_t), (ret_f, mean_f) = summary.search(true).groups(), summary.search(false).groups()
    assert ret_t == ret_f and float(mean_f) < float(mean_t)
    assert not live_session_ids(replica.address, "sokoban")
