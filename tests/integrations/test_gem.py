"""envserve.integrations.gem: GEM's make, make_vec (for loop and thread pool) and wrappers over real
sessions (a real server on loopback). GEM ships no env checker; its wrappers and vector envs are the
helpers that drive environments, and they drive envserve here."""
from __future__ import annotations

import gc

import numpy as np
import pytest

pytest.importorskip("gem")

import gem  # noqa: E402
from gem.wrappers.episode_tracking_wrapper import EpisodeTrackingWrapper  # noqa: E402
from gem.wrappers.wrapper_factory import get_wrapper_fns  # noqa: E402

from adapter_support import ExpertPolicy, live_session_ids  # noqa: E402
from envserve.client import EnvClient  # noqa: E402
from envserve.integrations.gem import EnvServeEnv, register  # noqa: E402


@pytest.fixture(scope="module")
def env_ids(grid_server):
    return register(grid_server.address, ["sokoban", "frozenlake", "minesweeper"])


def play(env, policy, seed=None):
    """One episode through GEM's single-env API; returns (first obs, steps)."""
    obs, info = env.reset(seed=seed)
    steps, done = [], False
    while not done:
        step = env.step(policy())
        steps.append(step)
        done = step[2] or step[3]
    return obs, info, steps


def test_register_and_make(grid_server, env_ids):
    assert env_ids == ["envserve:sokoban", "envserve:frozenlake", "envserve:minesweeper"]
    env = gem.make("envserve:sokoban", seed=3)
    assert isinstance(env, EnvServeEnv) and isinstance(env, gem.Env)
    assert env.env_id == "envserve:sokoban" and env.session.env_id == "sokoban"   # gem.make names it
    env.close()
    assert register(grid_server.address, "sokoban") == ["envserve:sokoban"]      # same settings: as is
    with pytest.raises(ValueError, match="other settings"):
        register(grid_server.address, "sokoban", config={"max_turns": 5})
    assert sorted(register(grid_server.address, prefix="all:")) == ["all:frozenlake", "all:minesweeper", "all:sokoban"]
    with pytest.raises(ValueError, match="not served"):
        register(grid_server.address, ["chess"])


def test_a_bad_config_is_a_value_error_at_construction(grid_server, env_ids):
    with pytest.raises(ValueError, match="unknown config key 'bogus'"):
        gem.make("envserve:sokoban", config={"bogus": 1})
    with pytest.raises(ValueError, match="unknown action format"):
        gem.make("envserve:sokoban", action_format="shouting")
    with pytest.raises(ValueError, match="not served"):
        EnvServeEnv(grid_server.address, "chess")
    with pytest.raises(ValueError, match="seed must be an int"):
        gem.make("envserve:sokoban", seed="3")


@pytest.mark.parametrize("env_id", ["sokoban", "frozenlake"])
def test_an_expert_plays_whole_episodes_to_success_through_gems_wrappers(env_ids, env_id):
    # GEM's observation history (concat_with_action) under its episode statistics, as its trainers wrap.
    env = gem.make(f"envserve:{env_id}")
    for wrap in get_wrapper_fns("concat_with_action,episode_tracking"):
        env = wrap(env)
    base = env.unwrapped
    assert isinstance(base, EnvServeEnv)
    policy = ExpertPolicy(base.session)
    for seed in range(4):
        obs, info, steps = play(env, policy, seed=seed)
        assert info["seed"] == seed and info["step_counter"] == 0 and obs.startswith(f"You are playing")
        *middle, (last_obs, reward, terminated, truncated, last_info) = steps
        assert terminated and not truncated and last_info["success"] and reward > 0
        assert "The episode is over: success." in last_obs
        assert not any(s[2] or s[3] for s in middle) and all(s[4]["action_valid"] for s in steps)
        assert last_info["step_counter"] == len(steps)
        assert last_info["cumulative_rewards"] == pytest.approx(sum(s[1] for s in steps))
        assert base.episode_return == pytest.approx(last_info["cumulative_rewards"])
        # The history wrapper replays the first observation and every answer before the latest one.
        assert last_obs.startswith(obs.rstrip("\n")) and policy.session.answer(["x"])[:8] in last_obs
    sid = base.session_id
    base.close()
    assert sid not in live_session_ids(env.unwrapped.session.endpoint.address, env_id)


@pytest.mark.parametrize("async_mode", [False, True])
def test_make_vec_plays_every_env_to_success_and_autoresets(grid_server, env_ids, async_mode):
    vec = gem.make_vec(["envserve:sokoban", "envserve:frozenlake"] * 2, wrappers=[EpisodeTrackingWrapper],
                       async_mode=async_mode, seed=10)
    bases = [e.unwrapped for e in vec.envs]
    policies = [ExpertPolicy(b.session) for b in bases]
    obs, infos = vec.reset()
    assert [i["seed"] for i in infos] == [10, 11, 12, 13]         # make_vec's seed + index
    finished: dict[int, list] = {i: [] for i in range(vec.num_envs)}
    returns = [0.0] * vec.num_envs
    while any(len(f) < 2 for f in finished.values()):
        actions = {i: policies[i]() for i in range(vec.num_envs) if len(finished[i]) < 2}
        obs, rewards, terminated, truncated, infos = vec.step(actions)
        assert isinstance(rewards, np.ndarray) and len(obs) == len(actions)
        for k, i in enumerate(actions):
            returns[i] += rewards[k]
            if terminated[k] or truncated[k]:
                # SAME_STEP autoreset: the vector env has reset this env already; obs and info are the
                # next episode's, the episode tracker's prev_ep_* the finished one's.
                assert obs[k].startswith("You are playing") and infos[k]["turn"] == 0
                finished[i].append((bool(terminated[k]), float(rewards[k]), infos[k]["prev_ep_cumulative_rewards"],
                                    returns[i]))
                returns[i] = 0.0
            else:
                assert infos[k]["action_valid"] and infos[k]["step_counter"] > 0
    for i, episodes in finished.items():
        # Ended by the env (no turn limit) on a paying step: the goal (every expert episode succeeds).
        assert all(term and last > 0 and tracked == pytest.approx(ret) for term, last, tracked, ret in episodes)
    # Seedless resets follow from the first seed: a vector env's episodes are reproducible.
    # Env 0 played two episodes and was reset for a third: a fresh env seeded alike, reset three times.
    alike = EnvServeEnv(grid_server.address, "sokoban", seed=10)
    seeds = [alike.reset()[1]["seed"] for _ in range(3)]
    assert seeds[0] == 10 and len(set(seeds)) == 3 and bases[0].seed == seeds[2]
    alike.close()
    sids = [b.session_id for b in bases]
    del vec, bases, policies, obs, infos
    gc.collect()                                                   # GEM never closes a vector env
    assert not set(sids) & (live_session_ids(grid_server.address, "sokoban") |
                            live_session_ids(grid_server.address, "frozenlake"))


def test_same_seed_same_first_observation(grid_server, env_ids):
    a, b = gem.make("envserve:sokoban"), gem.make("envserve:sokoban", seed=5)
    first = a.reset(seed=5)[0]
    assert b.reset()[0] == first == a.reset(seed=5)[0]
    assert a.session_id != b.session_id
    assert len({a.reset(seed=s)[0] for s in range(6, 10)} | {first}) > 1
    assert "<answer>" in first                                     # the rules include the answer format
    bare = gem.make("envserve:sokoban", include_rules=False)
    assert bare.reset(seed=5)[0] == first.rsplit("\n\n", 1)[1]
    for env in (a, b, bare):
        env.close()


def test_invalid_answers_are_feedback_and_random_actions_are_valid(env_ids):
    env = gem.make("envserve:frozenlake", config={"max_turns": 3})
    assert env.step("<answer>Left</answer>")[2]                    # before any reset: over
    env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step("I will go left")
    assert (reward, terminated, truncated) == (pytest.approx(-0.1), False, False)
    assert "Invalid format" in obs and info["action_valid"] is False
    obs, reward, terminated, truncated, info = env.step("<answer>Sideways</answer>")
    assert reward == pytest.approx(-0.1) and "Invalid action" in obs and not terminated
    obs, reward, terminated, truncated, info = env.step("<answer>Left</answer>")   # the env's max_turns
    assert truncated and not terminated and "turn limit" in obs and info["truncated"]
    assert env.step("<answer>Left</answer>")[1:4] == (0.0, True, False)
    env.close()
    for env_id in ("sokoban", "frozenlake", "minesweeper"):
        env = gem.make(f"envserve:{env_id}", seed=1)
        env.reset()
        answers = {env.sample_random_action() for _ in range(20)}
        assert len(answers) > 1 and all(a.startswith("<answer>") for a in answers)
        assert env.step(env.sample_random_action())[4]["action_valid"]
        env.close()


def test_spawn_forks_the_session_in_its_state(env_ids):
    env = gem.make("envserve:sokoban", config={"max_actions_per_turn": 1})
    env.reset(seed=2)
    policy = ExpertPolicy(env.session)
    env.step(policy())
    twin = env.spawn(same_state=True)
    assert twin.session_id != env.session_id
    move = policy()
    a, b = env.step(move), twin.step(move)
    assert a[:4] == b[:4] and a[4]["turn"] == b[4]["turn"] == 2
    fresh = env.spawn(config={"max_actions_per_turn": 2})
    assert fresh.session.config == {"max_actions_per_turn": 2} and fresh.reset(seed=2)[0] != ""
    for e in (env, twin, fresh):
        e.close()


def test_a_session_closed_under_the_env_is_rebuilt_by_replay_or_ends_the_episode(grid_server, env_ids):
    env, twin = gem.make("envserve:frozenlake"), gem.make("envserve:frozenlake")
    first, _ = env.reset(seed=2)
    assert twin.reset(seed=2)[0] == first
    sid = env.session_id
    assert sid in live_session_ids(grid_server.address, "frozenlake")
    assert env.step("<answer>Left</answer>")[1:4] == twin.step("<answer>Left</answer>")[1:4]
    with EnvClient(grid_server.address) as c:
        c.close_sessions([sid])                                    # as an expired lease would
    # Rebuilt from its history on the replica, the step answered as the twin's: same id for GEM.
    got, want = env.step("<answer>Down</answer>"), twin.step("<answer>Down</answer>")
    assert got[:4] == want[:4] and got[4]["turn"] == want[4]["turn"] == 2
    assert env.session_id == sid and env.session.real_id != sid
    rebuilt = env.session.real_id
    assert rebuilt in live_session_ids(grid_server.address, "frozenlake")
    env.close()
    twin.close()
    assert rebuilt not in live_session_ids(grid_server.address, "frozenlake")

    # Without recovery the episode ends with the error, and the next reset opens a new session.
    lone = gem.make("envserve:frozenlake", recovery=False)
    first, _ = lone.reset(seed=2)
    sid = lone.session_id
    with EnvClient(grid_server.address) as c:
        c.close_sessions([sid])
    obs, reward, terminated, truncated, info = lone.step("<answer>Left</answer>")
    assert (reward, terminated, truncated) == (0.0, False, True) and info["error_code"] == "NOT_FOUND"
    assert obs.startswith("Error: the environment failed (NOT_FOUND")
    assert lone.reset(seed=2)[0] == first and lone.session_id != sid  # a new session, same start
    live = lone.session_id
    lone.close()
    assert live not in live_session_ids(grid_server.address, "frozenlake")


def test_a_replica_killed_mid_episode_truncates_the_episode_with_a_message(own_server):
    # Recovery off: the only replica is gone (across replicas: tests/integrations/test_replicas.py).
    (name,) = register(own_server.address, ["frozenlake"], prefix="doomed:", timeout=10, recovery=False)
    env = gem.make(name)
    env.reset(seed=0)
    assert not any(env.step("<answer>Left</answer>")[2:4])
    own_server.kill()
    obs, reward, terminated, truncated, info = env.step("<answer>Left</answer>")
    assert (reward, terminated, truncated) == (0.0, False, True)
    assert info["error"].startswith("Error: the environment failed (DATA_LOSS") and obs == info["error"]
    assert "no longer answers at its address" in obs
    env.close()  # best effort, quick with the replica gone


def test_sessions_survive_close_channels_and_are_closed_at_exit(grid_server, env_ids):
    import subprocess
    import sys

    from envserve.integrations import close_channels
    env = gem.make("envserve:frozenlake")
    env.reset(seed=0)
    close_channels()                                               # the next call takes a new channel
    assert env.step("<answer>Left</answer>")[4]["action_valid"]
    env.close()
    # A process that never closes its envs (GEM's vector envs have no close) leaves nothing open.
    code = ("import gem\n"
            "from envserve.integrations.gem import register\n"
            f"register({grid_server.address!r}, ['frozenlake'])\n"
            "envs = [gem.make('envserve:frozenlake') for _ in range(3)]\n"
            "[e.reset(seed=1) for e in envs]\n"
            "print(' '.join(e.session_id for e in envs))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    sids = set(out.split())
    assert len(sids) == 3
    assert not sids & live_session_ids(grid_server.address, "frozenlake")
