"""envserve.integrations.skyrl: skyrl_gym's make and registry over real sessions (a real server on
loopback). skyrl-train's generator (the loop that drives a BaseTextEnv in training) needs Python 3.12,
ray and vllm, so `rollout` below follows its protocol with skyrl_gym alone: make per trajectory with
env_config and extras (max_turns included), init, step until done, get_metrics, close, many
trajectories at once on a thread pool, and skyrl_gym's own metric aggregation."""
from __future__ import annotations

import copy
import gc
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("skyrl_gym")

import skyrl_gym  # noqa: E402
from omegaconf import DictConfig  # noqa: E402
from skyrl_gym.envs.base_text_env import BaseTextEnv  # noqa: E402
from skyrl_gym.metrics import aggregate_for_environment  # noqa: E402

import adapter_support  # noqa: E402
from adapter_support import ExpertPolicy, live_session_ids  # noqa: E402
from envserve.client import EnvClient, RoutedClient  # noqa: E402
from envserve.directory import open_directory, replica_of  # noqa: E402
from envserve.integrations.skyrl import EnvServeTextEnv, register  # noqa: E402

PROMPT = [{"role": "system", "content": "You are a careful player."},
          {"role": "user", "content": "Solve the puzzle."}]


@pytest.fixture(scope="module")
def env_classes(grid_server):
    return register(grid_server.address, ["sokoban", "frozenlake", "minesweeper"])


def rollout(env_class: str, extras: dict, policy, env_config=None) -> dict:
    """One trajectory as SkyRL's generator runs it; policy(env, chat) is the model's next text."""
    env = skyrl_gym.make(env_class, env_config=env_config if env_config is not None else DictConfig({}),
                         extras=copy.deepcopy(extras))
    chat, meta = env.init(copy.deepcopy(PROMPT))
    rewards, steps, done = [], [], False
    while not done:
        text = policy(env, chat)
        out = env.step(text)
        chat = chat + [{"role": "assistant", "content": text}] + out["observations"]
        rewards.append(out["reward"])
        steps.append(out)
        done = out["done"]
    metrics = env.get_metrics()
    sid = env.session_id
    env.close()
    return {"rewards": rewards, "steps": steps, "metrics": metrics, "chat": chat, "init": meta, "session_id": sid}


def expert_policy(env, chat):
    if not hasattr(env, "_expert"):
        env._expert = ExpertPolicy(env.session)
    return env._expert()


# -- registration ----------------------------------------------------------------------------------
def test_register_makes_skyrl_gym_env_classes(grid_server, env_classes):
    assert env_classes == ["envserve-sokoban", "envserve-frozenlake", "envserve-minesweeper"]
    env = skyrl_gym.make("envserve-frozenlake", env_config=DictConfig({}), extras={"seed": 1})
    assert isinstance(env, EnvServeTextEnv) and isinstance(env, BaseTextEnv)
    assert env.spec.id == "envserve-frozenlake" and env.env_id == "frozenlake"
    env.close()
    # Registering again with the same settings is a no-op; every env the replica serves by default.
    assert register(grid_server.address, "sokoban") == ["envserve-sokoban"]
    assert sorted(register(grid_server.address, prefix="all-")) == [
        "all-frozenlake", "all-minesweeper", "all-sokoban"]
    with pytest.raises(ValueError, match="not served"):
        register(grid_server.address, ["chess"])
    # SkyRL's env_config (environment.skyrl_gym.<env_class>) overrides what register stored.
    env = skyrl_gym.make("envserve-frozenlake", env_config=DictConfig({"config": {"max_turns": 2}}), extras={})
    assert env.max_turns == 2 and env.session.config == {"max_turns": 2}
    env.close()


def test_a_bad_config_is_a_value_error_at_construction(grid_server, env_classes, monkeypatch):
    monkeypatch.delenv("ENVSERVE_ADDRESS", raising=False)
    with pytest.raises(ValueError, match="unknown config key 'bogus'"):
        skyrl_gym.make("envserve-sokoban", env_config=DictConfig({"config": {"bogus": 1}}), extras={})
    with pytest.raises(ValueError, match="max_turns: 'many' is not of type 'integer'"):
        skyrl_gym.make("envserve-sokoban", env_config={"config": {"max_turns": "many"}}, extras={})
    with pytest.raises(ValueError, match="unknown action format"):
        skyrl_gym.make("envserve-sokoban", env_config={"action_format": "shouting"}, extras={})
    with pytest.raises(ValueError, match="needs an address.*ENVSERVE_ADDRESS is not set.*not in a Ray cluster"):
        EnvServeTextEnv(env_config={"env_id": "sokoban"})   # outside Ray, no ENVSERVE_ADDRESS (see fleet below)
    with pytest.raises(ValueError, match="not served"):
        EnvServeTextEnv(env_config={"env_id": "chess", "address": grid_server.address})
    with pytest.raises(ValueError, match="seed must be a whole number"):
        skyrl_gym.make("envserve-sokoban", env_config={}, extras={"seed": "x"})
    with pytest.raises(ValueError, match="unknown envserve settings"):
        EnvServeTextEnv(env_config={}, adress="127.0.0.1:1")


# -- whole episodes --------------------------------------------------------------------------------
@pytest.mark.parametrize("env_id", ["sokoban", "frozenlake"])
def test_an_expert_plays_whole_episodes_to_success(grid_server, env_classes, env_id):
    seeds = list(range(6))
    # As the generator does: every trajectory at once, env calls on a thread pool; max_turns from it.
    with ThreadPoolExecutor(len(seeds)) as pool:
        runs = list(pool.map(lambda s: rollout(f"envserve-{env_id}", {"seed": s, "max_turns": 50}, expert_policy),
                             seeds))
    for run in runs:
        last = run["steps"][-1]
        assert last["done"] and last["metadata"]["success"] and not last["metadata"]["truncated"]
        assert last["observations"] == []                          # nothing to read after the end
        assert all(s["observations"][0]["role"] == "user" for s in run["steps"][:-1])
        assert [s["metadata"]["turn"] for s in run["steps"]] == list(range(1, len(run["steps"]) + 1))
        assert all(s["metadata"]["action_valid"] for s in run["steps"])
        assert run["metrics"] == {"turns": len(run["steps"]), "return": pytest.approx(sum(run["rewards"])),
                                  "success": True, "invalid_actions": 0}
        assert run["init"]["seed"] in seeds
        # Closed on the server once the trajectory ended.
        assert run["session_id"] not in live_session_ids(grid_server.address, env_id)
    assert len({run["chat"][1]["content"] for run in runs}) > 1   # the seeds are different tasks
    assert all(r > 0 for run in runs for r in run["rewards"][-1:])   # the winning step pays
    metrics = aggregate_for_environment(f"envserve-{env_id}", [run["metrics"] for run in runs])
    assert metrics["success"] == 1.0 and metrics["invalid_actions"] == 0.0


def test_rewards_equal_a_direct_session_playing_the_same_answers(grid_server, env_classes):
    answers: list[str] = []

    def recording(env, chat):
        answers.append(expert_policy(env, chat))
        return answers[-1]

    one = {"max_actions_per_turn": 1}                              # a turn per move: a longer episode
    run = rollout("envserve-sokoban", {"extra_info": {"seed": 2}}, recording, DictConfig({"config": one}))
    with EnvClient(grid_server.address) as c:
        sid = c.open("sokoban", 1, one, "no_think")[0]
        first = c.reset_one(sid, 2)
        direct = [c.step_one(sid, a).reward for a in answers]
        c.close_sessions([sid])
    assert run["rewards"] == pytest.approx(direct) and len(direct) > 2 and direct[-1] > 1
    assert first.observation.text in run["chat"][1]["content"]


def test_same_seed_same_first_observation_and_the_prompt_it_extends(env_classes):
    def first(extras, prompt=PROMPT):
        env = skyrl_gym.make("envserve-sokoban", env_config=DictConfig({}), extras=extras)
        chat, meta = env.init(copy.deepcopy(prompt))
        env.close()
        return chat, meta

    a, meta = first({"seed": 7})
    b, _ = first({"extra_info": {"seed": 7}, "reward_spec": {"ground_truth": None}})
    assert a == b and meta["seed"] == 7
    assert len({first({"seed": s})[0][-1]["content"] for s in range(8, 12)} | {a[-1]["content"]}) > 1
    # The system message stays; the rules (with the answer format) and the grid extend the user turn.
    assert a[0] == PROMPT[0] and len(a) == 2
    assert a[1]["content"].startswith("Solve the puzzle.\n\nYou are playing Sokoban")
    assert "<answer>" in a[1]["content"] and a[1]["content"].rstrip().endswith("#")
    assert PROMPT[1]["content"] == "Solve the puzzle."          # the caller's prompt is not modified
    alone, _ = first({"seed": 7}, prompt=[])
    assert alone == [{"role": "user", "content": a[1]["content"].split("\n\n", 1)[1]}]
    no_rules = EnvServeTextEnv(env_config={**skyrl_gym.spec("envserve-sokoban").kwargs, "include_rules": False},
                               extras={"seed": 7})
    assert no_rules.init([])[0][0]["content"] == a[1]["content"].rsplit("\n\n", 1)[1]
    no_rules.close()


def test_invalid_answers_are_feedback_and_max_turns_ends_the_episode(env_classes):
    env = skyrl_gym.make("envserve-frozenlake", env_config=DictConfig({}), extras={"seed": 0, "max_turns": 3})
    env.init([])
    out = env.step("I think I will go left")                    # no <answer>: the format's penalty
    assert not out["done"] and out["reward"] == pytest.approx(-0.1)
    assert out["metadata"]["action_valid"] is False and "Invalid format" in out["observations"][0]["content"]
    out = env.step("<answer>Sideways</answer>")                   # parsed, but not an action
    assert not out["done"] and out["reward"] == pytest.approx(-0.1) and not out["metadata"]["action_valid"]
    assert "Invalid action" in out["observations"][0]["content"]
    out = env.step("<answer>Left</answer>")                       # the generator's max_turns (3) ends it
    assert out["done"] and out["metadata"]["truncated"] and out["metadata"]["action_valid"]
    assert out["observations"] == []
    assert env.get_metrics() == {"turns": 3, "return": pytest.approx(out["reward"] - 0.2), "success": False,
                                 "invalid_actions": 2}
    late = env.step("<answer>Down</answer>")
    assert late["done"] and late["reward"] == 0.0 and "over" in late["metadata"]["error"]
    env.close()


# -- sessions on the server ------------------------------------------------------------------------
def test_close_and_garbage_collection_release_the_session(grid_server, env_classes):
    env = skyrl_gym.make("envserve-frozenlake", env_config=DictConfig({}), extras={"seed": 0})
    env.init([])
    sid = env.session_id
    assert sid in live_session_ids(grid_server.address, "frozenlake")
    env.close()
    assert sid not in live_session_ids(grid_server.address, "frozenlake")
    env.close()  # twice is fine
    dropped = skyrl_gym.make("envserve-frozenlake", env_config=DictConfig({}), extras={"seed": 0})
    sid = dropped.session_id
    assert sid in live_session_ids(grid_server.address, "frozenlake")
    del dropped
    gc.collect()
    assert sid not in live_session_ids(grid_server.address, "frozenlake")


def test_a_lost_session_is_rebuilt_or_without_recovery_ends_a_step_and_is_reopened_by_init(grid_server, env_classes):
    env = skyrl_gym.make("envserve-frozenlake", env_config=DictConfig({}), extras={"seed": 2})
    twin = skyrl_gym.make("envserve-frozenlake", env_config=DictConfig({}), extras={"seed": 2})
    first, _ = env.init([])
    assert twin.init([])[0] == first
    with EnvClient(grid_server.address) as c:
        c.close_sessions([env.session_id])                       # as an expired lease would
    got, want = env.step("<answer>Down</answer>"), twin.step("<answer>Down</answer>")
    assert (got["observations"], got["reward"], got["done"]) == (want["observations"], want["reward"], want["done"])
    assert "error" not in got["metadata"] and env.session.real_id != env.session_id
    env.close()
    twin.close()

    lone = skyrl_gym.make("envserve-frozenlake", env_config=DictConfig({"recovery": False}), extras={"seed": 2})
    first, _ = lone.init([])
    with EnvClient(grid_server.address) as c:
        c.close_sessions([lone.session_id])
    out = lone.step("<answer>Down</answer>")
    assert out["done"] and out["reward"] == 0.0 and out["observations"] == []
    assert out["metadata"]["error_code"] == "NOT_FOUND" and "Error: the environment failed" in out["metadata"]["error"]
    again, _ = lone.init([])                                      # a new session, same start
    assert again == first
    lone.close()


def test_a_replica_killed_mid_episode_ends_the_episode_with_a_message(own_server):
    # Recovery off: the only replica is gone (across replicas: tests/integrations/test_replicas.py).
    (name,) = register(own_server.address, ["frozenlake"], prefix="doomed-", timeout=10, recovery=False)
    env = skyrl_gym.make(name, env_config=DictConfig({}), extras={"seed": 0})
    env.init([])
    assert not env.step("<answer>Left</answer>")["done"]          # into the wall: nothing happens
    own_server.kill()
    out = env.step("<answer>Down</answer>")
    assert out["done"] and out["reward"] == 0.0 and out["observations"] == []
    assert out["metadata"]["error"].startswith("Error: the environment failed (DATA_LOSS")
    assert env.get_metrics()["turns"] == 2
    env.close()  # best effort, quick with the replica gone


# -- in a Ray cluster, with no address ---------------------------------------------------------------
@pytest.fixture
def fleet():
    """A Ray of its own (2 CPUs) and an envserve.ray Fleet of one grid replica in the `ray://`
    directory, for one test. Ray is shut down after it, so no other test of this module or a later
    one runs in a process that has joined a Ray cluster (where an env without an address goes to
    ray://)."""
    ray = pytest.importorskip("ray")
    from envserve.ray import Fleet, FleetConfig
    assert not ray.is_initialized(), "another test left Ray running"
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    # The task below plays with this module's rollout and the tests' expert, which Ray's workers
    # cannot import by name.
    shipped = (sys.modules[__name__], adapter_support)
    for module in shipped:
        ray.cloudpickle.register_pickle_by_value(module)
    try:
        fleet = Fleet(FleetConfig(families=["grid"], replicas=1, serve_args=["--workers", "1", "--heartbeat-seconds", "0.5"]))
        try:
            (info,) = fleet.start()
            directory = open_directory("ray://")
            deadline = time.monotonic() + 60
            while [r.replica_id for r in directory.replicas("sokoban")] != [info["replica_id"]]:
                assert time.monotonic() < deadline, "the fleet's replica never listed in ray://"
                time.sleep(0.2)
            yield info
        finally:
            fleet.shutdown()
    finally:
        for module in shipped:
            ray.cloudpickle.unregister_pickle_by_value(module)
        ray.shutdown()


def play_in_a_ray_task(seeds: list[int]) -> list[dict]:
    """What skyrl-train's entrypoint task does with envserve's envs: register them, with no address,
    and play a trajectory per row through skyrl_gym.make. Runs in a Ray worker."""
    register(None, ["sokoban"])
    answers: dict[int, list[str]] = {}

    def recording(seed):
        def policy(env, chat):
            answers.setdefault(seed, []).append(expert_policy(env, chat))
            return answers[seed][-1]
        return policy

    with ThreadPoolExecutor(len(seeds)) as pool:
        runs = list(pool.map(lambda s: rollout("envserve-sokoban", {"seed": s, "max_turns": 50}, recording(s)), seeds))
    return [{"session_id": run["session_id"], "rewards": run["rewards"], "metrics": run["metrics"],
             "answers": answers[seed], "first": run["chat"][1]["content"]} for run, seed in zip(runs, seeds)]


def test_envs_made_in_a_ray_task_with_no_address_play_on_the_clusters_fleet(fleet):
    import ray
    seeds = [1, 2, 3]
    # As a Ray worker of a trainer's cluster: no address anywhere (an empty ENVSERVE_ADDRESS is none).
    task = ray.remote(play_in_a_ray_task).options(runtime_env={"env_vars": {"ENVSERVE_ADDRESS": ""}})
    runs = ray.get(task.remote(seeds), timeout=300)
    # Every session lived on the fleet's replica, was played to success and is closed there.
    assert {replica_of(run["session_id"]) for run in runs} == {fleet["replica_id"]}
    assert all(run["metrics"]["success"] and run["metrics"]["invalid_actions"] == 0 for run in runs)
    assert not {run["session_id"] for run in runs} & live_session_ids(fleet["address"], "sokoban")
    # The same answers in fresh sessions, reached through ray:// from the driver, earn the same rewards.
    client = RoutedClient("ray://")
    try:
        for run, seed in zip(runs, seeds):
            sid = client.open("sokoban", 1, None, "no_think")[0]
            first = client.reset([sid], [seed])[0]
            assert first.observation.text in run["first"]
            assert [client.step([(sid, a)])[0].reward for a in run["answers"]] == pytest.approx(run["rewards"])
            client.close_sessions([sid])
    finally:
        client.close()
