"""gymnasium:<id> through a real server on loopback: bad ids and configs, out-of-space actions,
and forks (copied where the env copies, replayed where it cannot)."""
import json
import subprocess
import sys

import grpc
import pytest

pytest.importorskip("gymnasium")

from envserve.client import EnvClient, state_dict  # noqa: E402
from envserve.client.errors import EnvNotFoundError, EnvServeError  # noqa: E402
from serverproc import ServerProcess, serve_refusal  # noqa: E402

CARTPOLE, TAXI, PENDULUM = "gymnasium:CartPole-v1", "gymnasium:Taxi-v4", "gymnasium:Pendulum-v1"


@pytest.fixture(scope="module")
def gym_client():
    import gymnasium
    served = [e for e in (CARTPOLE, TAXI, PENDULUM) if e.split(":", 1)[1] in gymnasium.registry]
    if len(served) < 3:
        pytest.skip(f"this gymnasium ({gymnasium.__version__}) names these envs differently: {served}")
    with ServerProcess(served, workers=2, metrics=False) as server, EnvClient(server.address) as c:
        yield c


def _open(c, env_id, config=None):
    return c.open(env_id, 1, {"include_valid_actions": True, **(config or {})}, "no_think")[0]


def _answer(a: str) -> str:
    return f"<answer>{a}</answer>"


def test_an_unserved_gymnasium_id_is_not_found_and_the_operator_is_told_why(gym_client):
    # A replica serves the ids it was started with; it builds no other for a caller.
    with pytest.raises(EnvNotFoundError) as e:
        gym_client.open("gymnasium:NoSuchEnv-v9", 1)
    assert "NoSuchEnv-v9" in str(e.value) and CARTPOLE in str(e.value)
    out = serve_refusal("gymnasium:NoSuchEnv-v9")
    assert out.returncode == 2 and "gymnasium has no environment 'NoSuchEnv-v9'" in out.stderr


@pytest.mark.parametrize("config", [{"kwargs": "not an object"}, {"kwargs": {"no_such_argument": 1}},
                                    {"kwargs": {"render_mode": "human"}}])
def test_malformed_config_is_invalid_argument(gym_client, config):
    with pytest.raises(EnvServeError) as e:
        gym_client.open(CARTPOLE, 1, config)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_kwargs_reach_gymnasium_make(gym_client):
    sid = _open(gym_client, CARTPOLE, {"kwargs": {"max_episode_steps": 3}})
    r = gym_client.reset_one(sid, seed=0)
    for _ in range(3):
        r = gym_client.step_one(sid, _answer("Left" if r.turn % 2 else "Right"))
    # The env's own time limit ends the episode as truncated, not done.
    assert r.truncated and not r.done
    gym_client.close_sessions([sid])


def test_action_outside_the_space_is_invalid_and_the_batch_goes_on(gym_client):
    c = gym_client
    bad, good, taxi = _open(c, PENDULUM), _open(c, PENDULUM), _open(c, TAXI)
    for s in (bad, good, taxi):
        c.reset_one(s, seed=4)
    results = c.step([(bad, _answer("2.5")), (good, _answer("1.25")), (taxi, _answer("7"))])
    assert [r.status.code for r in results] == [0, 0, 0]
    assert not results[0].action_valid and "[-2, 2]" in results[0].feedback
    assert results[1].action_valid and results[1].actions_executed == 1
    assert not results[2].action_valid and "South" in results[2].feedback
    # Names and numbers both read as Discrete actions; the failed sessions still step.
    assert c.step_one(taxi, _answer("north")).action_valid
    assert c.step_one(bad, _answer("-2")).action_valid
    c.close_sessions([bad, good, taxi])


def _future(c, sid, actions):
    out = []
    for a in actions:
        r = c.step_one(sid, _answer(a))
        out.append((r.observation.text, r.reward, r.done, r.truncated, r.anchor,
                    json.dumps(state_dict(c.get_state(sid, -1)), sort_keys=True)))
        if r.done or r.truncated:
            break
    return out


def test_copied_fork_has_the_same_future(gym_client):
    c = gym_client
    assert c.get_spec(CARTPOLE).supports_snapshot  # CartPole's env copies by pickling
    sid = _open(c, CARTPOLE)
    c.reset_one(sid, seed=21)
    c.step_one(sid, _answer("Left"))
    forks = c.fork(sid, 2)
    plan = ["Right", "Right", "Left", "1", "0", "Right", "Left", "Left"]
    futures = [_future(c, s, plan) for s in (sid, *forks)]
    assert len(futures[0]) > 2 and futures[0] == futures[1] == futures[2]
    c.close_sessions([sid, *forks])


def test_replayed_fork_has_the_same_future(gym_client):
    """An image session holds the renderer's surfaces, which do not copy: its fork is replayed."""
    c = gym_client
    if "image" not in c.get_spec(CARTPOLE).modalities:
        pytest.skip("CartPole cannot render images here (pygame missing)")
    sid = _open(c, CARTPOLE, {"render_image": True, "image_size": 32})
    c.reset_one(sid, seed=8)
    c.step_one(sid, _answer("Right"))
    c.step_one(sid, _answer("Left"))
    fork = c.fork(sid, 1)[0]
    plan = ["Left", "Left", "Right", "0", "1", "Right"]
    mine, theirs = _future(c, sid, plan), _future(c, fork, plan)
    assert len(mine) > 2 and mine == theirs
    c.close_sessions([sid, fork])


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "envserve.cli", *args], capture_output=True, text=True, timeout=300)


def test_serve_refuses_an_unknown_gymnasium_id():
    out = _cli("serve", "gymnasium:NoSuchEnv-v9", "--port", "0")
    assert out.returncode == 2 and "NoSuchEnv-v9" in out.stderr


def test_ls_lists_the_gymnasium_source():
    out = _cli("ls")
    assert out.returncode == 0, out.stderr
    assert "gymnasium:<id>" in out.stdout and "gymnasium:CartPole-v1" in out.stdout
