"""ors:<base url>#<env name>: envserve serving an environment that another server serves over ORS.
The other server is ors-sdk's own Server running games written on ors-sdk's Environment
(tests/ors_envs), on loopback; envserve's client plays them through a real replica: the remote
splits as ListTasks, answers read into tool calls, the tool's errors as invalid actions, rewards and
the end from the tool output, and ids the replica cannot serve refused with the reason."""
import json
import os
import subprocess
import sys
import time

import pytest

pytest.importorskip("ors")

import httpx  # noqa: E402

from envserve.client import EnvClient, state_dict  # noqa: E402
from envserve.client.errors import EnvNotFoundError, EnvServeError  # noqa: E402
from llm_fixtures import free_port  # noqa: E402
from serverproc import ServerProcess, serve_refusal  # noqa: E402

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ON_PATH = {"PYTHONPATH": os.pathsep.join(p for p in (TESTS, os.environ.get("PYTHONPATH", "")) if p)}


@pytest.fixture(scope="module")
def ors_url():
    """ors-sdk's Server with the test games, in a process of its own."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "ors_envs", str(port)], env=dict(os.environ, **ON_PATH),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"{url}/list_environments", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "the ORS server did not start"
        time.sleep(0.2)
    yield url
    proc.terminate()
    proc.wait(30)


@pytest.fixture(scope="module")
def ids(ors_url):
    return {"guess": f"ors:{ors_url}#guess", "hint": f"ors:{ors_url}#guesswithhint"}


@pytest.fixture(scope="module")
def client(ids):
    with ServerProcess(list(ids.values()), workers=2, metrics=False) as s, EnvClient(s.address) as c:
        yield c


def _answer(a) -> str:
    return f"<answer>{a if isinstance(a, str) else json.dumps(a)}</answer>"


def _open(c, env_id):
    [sid] = c.open(env_id, 1, action_format="no_think")
    return sid


def test_the_remote_splits_and_tasks_are_listed_with_their_goal(client, ids):
    spec = client.get_spec(ids["guess"])
    assert [(s.name, s.num_tasks) for s in spec.splits] == [("train", 40), ("test", 10)]
    assert "guess(number (integer))" in spec.system_prompt
    listed = client.list_tasks(ids["guess"], "test", 4)
    assert listed.total == 10 and len(listed.tasks) == 4
    first = listed.tasks[0]
    assert first.description == "Find the hidden number between 1 and 20." and first.task_type == "guess"
    # Task i of the test split hides (i * 7 + 3) % 20 + 1 (tests/ors_envs/games.py).
    assert [t.parameters["secret"] for t in listed.tasks] == [(i * 7 + 3) % 20 + 1 for i in range(4)]


def test_a_task_is_played_to_success_with_plain_answers_and_the_remote_reward(client, ids):
    task = client.list_tasks(ids["guess"], "test", 10).tasks[6]
    sid = _open(client, ids["guess"])
    r = client.reset_one(sid, task_id=task.task_id)
    assert "You have 6 guesses." in r.observation.text
    secret = int(task.parameters["secret"])   # a Struct number: a float on the wire
    assert state_dict(client.get_state(sid, -1))["task"]["secret"] == secret
    lo, hi = 1, 20
    while not r.done:
        guess = (lo + hi) // 2
        r = client.step_one(sid, _answer(str(guess)))
        assert r.action_valid, r.feedback
        if "higher" in r.observation.text:
            lo = guess + 1
        elif "lower" in r.observation.text:
            hi = guess - 1
    assert r.success and r.reward == 1.0 and f"{secret} is right." in r.observation.text
    truth = state_dict(client.get_state(sid, -1))
    assert truth["finished"] is True and truth["rewards"][-1] == 1.0 and truth["metadata"]["success"] is True
    client.close_sessions([sid])


def test_the_same_seed_starts_the_same_task_in_any_session(client, ids):
    a, b = _open(client, ids["guess"]), _open(client, ids["guess"])
    ra, rb = client.reset_one(a, seed=5), client.reset_one(b, seed=5)
    other = client.reset_one(_open(client, ids["guess"]), seed=6)
    assert ra.anchor == rb.anchor != other.anchor
    assert state_dict(client.get_state(a, -1))["task"] == state_dict(client.get_state(b, -1))["task"]


def test_bad_answers_are_invalid_actions_with_the_reason_and_the_episode_goes_on(client, ids):
    sid = _open(client, ids["guess"])
    client.reset_one(sid, seed=0)                    # train[0] hides 1
    r = client.step_one(sid, _answer("banana"))
    assert not r.action_valid and "number" in r.feedback and not r.done
    r = client.step_one(sid, _answer({"tool": "shout", "input": {}}))
    assert not r.action_valid and "guess" in r.feedback
    for _ in range(5):
        r = client.step_one(sid, _answer("9"))
        assert r.action_valid and "lower" in r.observation.text and not r.done
    r = client.step_one(sid, _answer("9"))           # the sixth guess: out of guesses, no success
    assert r.done and not r.success and r.reward == 0.0 and "No guesses left." in r.observation.text
    with pytest.raises(EnvServeError, match="episode is over"):
        client.step_one(sid, _answer("1"))


def test_an_env_with_several_tools_takes_named_calls(client, ids):
    sid = _open(client, ids["hint"])
    client.reset_one(sid, seed=1)                    # train[1] hides 8
    r = client.step_one(sid, _answer("8"))
    assert not r.action_valid and '"tool"' in r.feedback   # plain text names no tool here
    r = client.step_one(sid, _answer({"tool": "hint"}))
    assert r.action_valid and r.observation.text == "even" and not r.done
    r = client.step_one(sid, _answer({"name": "guess", "input": {"number": 8}}))
    assert r.action_valid and r.done and r.success


def test_ids_the_replica_cannot_serve_are_refused_with_the_reason(client, ors_url):
    with pytest.raises(EnvNotFoundError):
        client.open(f"ors:{ors_url}#guess2", 1)     # only the ids the replica was started with
    for env_id, reason in [(f"ors:{ors_url}#nosuchgame", "no environment 'nosuchgame'"),
                           ("ors:not-a-url#guess", "ors:<http(s) base url>#<env name>"),
                           (f"ors:http://127.0.0.1:{free_port()}#guess", "cannot read the ORS environment")]:
        out = serve_refusal(env_id, ON_PATH)
        assert out.returncode == 2 and reason in out.stderr, out.stderr[-2000:]
