"""openenv:<module>:<Class> through a real server on loopback: answers read into the class's
Action model (JSON, or plain text for a one-field Action), invalid fields named in the feedback,
the env's state as ground truth, forks copied or replayed, bad ids refused, and OpenEnv's own
client reaching a served class through envserve's OpenEnv endpoint."""
import asyncio
import json
import subprocess
import sys

import pytest

pytest.importorskip("openenv")

import openenv_envs  # noqa: E402
from openenv_envs import ECHO, GRID, GUESS, LOCKED  # noqa: E402
from envserve.client import EnvClient, state_dict  # noqa: E402
from envserve.client.errors import EnvNotFoundError  # noqa: E402
from serverproc import ServerProcess, serve_refusal  # noqa: E402

pytestmark = pytest.mark.slow


SERVED = [ECHO, GUESS, GRID, LOCKED]


@pytest.fixture(scope="module")
def server():
    with ServerProcess(SERVED, workers=2, metrics=False, env_vars=openenv_envs.on_path()) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with EnvClient(server.address) as c:
        yield c


def _open(c, env_id):
    return c.open(env_id, 1, {"include_valid_actions": True}, "no_think")[0]


def _answer(a: str) -> str:
    return f"<answer>{a}</answer>"


def test_guessing_by_the_hints_wins_with_the_envs_own_reward_and_state(client):
    sid = _open(client, GUESS)
    r = client.reset_one(sid, seed=42)
    assert "hint: I picked a number from 1 to 100." in r.observation.text
    target = state_dict(client.get_state(sid, 0))["target"]
    lo, hi, n = 1, 100, 0
    while not r.done:
        guess = (lo + hi) // 2
        # Plain text and JSON both read into GuessAction.
        r = client.step_one(sid, _answer(str(guess) if n % 2 else json.dumps({"guess": guess})))
        assert r.action_valid, r.feedback
        n += 1
        if "Higher" in r.observation.text:
            lo = guess + 1
        elif "Lower" in r.observation.text:
            hi = guess - 1
    assert r.success and r.reward == 1.0 and "hint: Correct!" in r.observation.text
    truth = state_dict(client.get_state(sid, -1))
    assert truth["target"] == target and truth["step_count"] == n and truth["guesses"][-1] == target
    client.close_sessions([sid])


def test_invalid_fields_are_named_and_the_batch_goes_on(client):
    c = client
    grid, guess, echo = _open(c, GRID), _open(c, GUESS), _open(c, ECHO)
    for s in (grid, guess, echo):
        c.reset_one(s, seed=3)
    results = c.step([(grid, _answer('{"direction": "north"}')), (guess, _answer('{"guess": 500}')),
                      (echo, _answer("hello there"))])
    assert [r.status.code for r in results] == [0, 0, 0]
    assert not results[0].action_valid and "direction" in results[0].feedback and "up" in results[0].feedback
    assert not results[1].action_valid and "guess" in results[1].feedback and "100" in results[1].feedback
    assert results[2].action_valid and "echoed_message: hello there" in results[2].observation.text
    assert results[2].reward == pytest.approx(1.0)
    # A multi-field Action needs JSON; missing and unknown fields are both named.
    r = c.step_one(grid, _answer('{"steps": 2, "speed": 3}'))
    assert not r.action_valid and "direction" in r.feedback and "speed" in r.feedback
    r = c.step_one(grid, _answer("left"))
    assert not r.action_valid and "JSON object" in r.feedback
    # The env's own refusal (it raises) is an invalid action too, and the session still steps.
    r = c.step_one(grid, _answer('{"direction": "up", "steps": 9}'))
    assert not r.action_valid and "steps must be" in r.feedback
    assert c.step_one(grid, _answer(r.info["valid_actions"][0])).action_valid
    c.close_sessions([grid, guess, echo])


@pytest.mark.parametrize("env_id,copied", [(GRID, True), (LOCKED, False)])
def test_forks_copy_where_the_env_copies_and_replay_where_it_cannot(client, env_id, copied):
    c = client
    spec = c.get_spec(env_id)
    assert spec.supports_snapshot is copied
    sid = _open(c, env_id)
    c.reset_one(sid, seed=8)  # a start whose goal these moves do not reach
    moves = ['{"direction": "down"}', '{"direction": "right"}'] if env_id == GRID else ["2", "3"]
    for m in moves:
        assert c.step_one(sid, _answer(m)).action_valid
    fork = c.fork(sid, 1)[0]
    assert state_dict(c.get_state(fork, -1)) == state_dict(c.get_state(sid, -1))
    nxt = moves[0]
    a, b = c.step_one(sid, _answer(nxt)), c.step_one(fork, _answer(nxt))
    assert (a.observation.text, a.reward, a.anchor) == (b.observation.text, b.reward, b.anchor)
    c.close_sessions([sid, fork])


@pytest.mark.parametrize("env_id,reason", [
    ("openenv:no_such_module_anywhere:Env", "no_such_module_anywhere"),
    ("openenv:openenv_envs.echo:NoSuchClass", "NoSuchClass"),
    ("openenv:openenv_envs.locked:NotAnEnvironment", "not an OpenEnv Environment"),
    ("openenv:openenv_envs.echo", "openenv:<module>:<Class>"),
])
def test_bad_ids_are_refused_at_serve_with_the_reason(client, env_id, reason):
    with pytest.raises(EnvNotFoundError):
        client.open(env_id, 1)
    out = serve_refusal(env_id, openenv_envs.on_path())
    assert out.returncode == 2 and reason in out.stderr


def test_an_open_never_imports_the_module_a_caller_names(client, tmp_path):
    # The replica was started with this variable unset in its environment: set it for a fresh one.
    wire = tmp_path / "imported"
    with ServerProcess(SERVED[:1], workers=1, metrics=False,
                       env_vars={**openenv_envs.on_path(), "ENVSERVE_TRIPWIRE": str(wire)}) as s, \
            EnvClient(s.address) as c:
        with pytest.raises(EnvNotFoundError):
            c.open("openenv:openenv_envs.tripwire:Anything", 1)
        assert c.open(SERVED[0], 1)     # and the replica serves on
    assert not wire.exists()


def test_serve_refuses_a_module_that_is_not_there():
    out = subprocess.run([sys.executable, "-m", "envserve.cli", "serve", "openenv:nope:X", "--port", "0"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "nope" in out.stderr


def test_openenvs_own_client_reaches_the_class_through_the_facade_and_grpc(server):
    from openenv import GenericEnvClient
    from webproc import WebProcess

    async def play(url):
        async with GenericEnvClient(base_url=f"{url}/openenv/{GUESS}") as env:
            first = await env.reset(seed=42, action_format="no_think")
            sid = (await env.state())["session_id"]
            r = await env.step({"message": _answer('{"guess": 50}')})
            return first, r, sid

    with WebProcess.facade([server.address], env_vars=openenv_envs.on_path()) as web:
        first, r, sid = asyncio.run(play(web.url))
    assert "guesses_left: 8" in first.observation["text"] and first.done is False
    assert r.metadata["valid_action"] is True and "guesses_left: 7" in r.observation["text"]
    # The same class over gRPC, same seed: the same first observation and the same answer to 50.
    with EnvClient(server.address) as c:
        s = _open(c, GUESS)
        g = c.reset_one(s, seed=42)
        assert g.observation.text == first.observation["text"]
        assert c.step_one(s, _answer("50")).observation.text == r.observation["text"]
        c.close_sessions([s])
