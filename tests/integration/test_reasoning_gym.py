"""reasoning_gym:<dataset> through a real server on loopback: rewards are the dataset's own
score_answer, retries with feedback, the test split, forks mid-retry, and bad names and configs."""
import subprocess
import sys

import grpc
import pytest

rg = pytest.importorskip("reasoning_gym")

from envserve.client import EnvClient, state_dict  # noqa: E402
from envserve.client.errors import EnvNotFoundError, EnvServeError  # noqa: E402
from envserve.envs.reasoning_gym.env import CONFIG_DEFAULTS, TEST_SEED_OFFSET  # noqa: E402
from serverproc import ServerProcess, serve_refusal  # noqa: E402

# spell_backward gives partial credit to a wrong answer; prime_factorization's checker raises on text.
LEGS, SPELL, PRIMES = "reasoning_gym:leg_counting", "reasoning_gym:spell_backward", "reasoning_gym:prime_factorization"


@pytest.fixture(scope="module")
def client():
    with ServerProcess([LEGS, SPELL, PRIMES], workers=1, metrics=False) as server, EnvClient(server.address) as c:
        yield c


def _open(c, env_id, config=None):
    return c.open(env_id, 1, config or {}, "no_think")[0]


def _answer(a: str) -> str:
    return f"<answer>{a}</answer>"


def _dataset(name, seed_key="train_dataset_seed"):
    # Built here the way reasoning-gym's users build it, with the env's default seed and size.
    return rg.create_dataset(name, seed=CONFIG_DEFAULTS[seed_key], size=CONFIG_DEFAULTS["size"])


@pytest.mark.parametrize("env_id", [LEGS, SPELL])
def test_reward_is_the_datasets_own_score(client, env_id):
    name = env_id.split(":", 1)[1]
    ds = _dataset(name)
    entry = ds[5]
    right, wrong = entry["answer"], entry["answer"][:-1] + "#"
    for text in (right, wrong):
        sid = _open(client, env_id)
        r = client.reset_one(sid, seed=5)
        assert r.observation.text == entry["question"]
        r = client.step_one(sid, _answer(text))
        expected = ds.score_answer(text, entry)
        assert r.reward == pytest.approx(expected) and r.done
        assert r.success == (expected >= 1.0)
        truth = state_dict(client.get_state(sid, -1))
        assert truth["answer"] == entry["answer"] and truth["attempts"] == [{"answer": text, "score": expected}]
        client.close_sessions([sid])
    assert ds.score_answer(right, entry) == 1.0 and ds.score_answer(wrong, entry) < 1.0


def test_a_checker_that_raises_scores_zero_with_the_reason(client):
    sid = _open(client, PRIMES)
    client.reset_one(sid, seed=3)
    r = client.step_one(sid, _answer("not a number"))
    assert r.status.code == 0 and r.reward == 0.0 and r.done and not r.success
    assert "could not be checked" in r.feedback
    client.close_sessions([sid])


def test_retries_get_feedback_until_right_and_the_return_is_the_best_score(client):
    ds = _dataset("spell_backward")
    entry = ds[8]
    wrong = entry["answer"][:-1] + "#"
    partial = ds.score_answer(wrong, entry)
    assert 0 < partial < 1  # partial credit, so the reward of the right answer after it is what it adds
    sid = _open(client, SPELL, {"max_attempts": 3})
    client.reset_one(sid, seed=8)
    r1 = client.step_one(sid, _answer(wrong))
    assert not r1.done and "2 attempts left" in r1.feedback and r1.reward == pytest.approx(partial)
    assert "2 attempts left" in r1.observation.text
    # Forked mid-retry, each copy keeps the attempts made and goes on alike.
    fork = client.fork(sid, 1)[0]
    for s in (sid, fork):
        r2 = client.step_one(s, _answer(entry["answer"]))
        assert r2.done and r2.success and r2.reward == pytest.approx(1.0 - partial)
        assert state_dict(client.get_state(s, -1))["attempts_left"] == 1
    client.close_sessions([sid, fork])


def test_attempts_run_out(client):
    sid = _open(client, LEGS, {"max_attempts": 2})
    client.reset_one(sid, seed=1)
    assert not client.step_one(sid, _answer("-1")).done
    r = client.step_one(sid, _answer("-2"))
    assert r.done and not r.success and "No attempts left" in r.feedback
    client.close_sessions([sid])


def test_test_split_is_the_test_dataset_seed(client):
    sid = _open(client, LEGS)
    r = client.reset_one(sid, seed=TEST_SEED_OFFSET + 4)
    assert r.observation.text == _dataset("leg_counting", "test_dataset_seed")[4]["question"]
    assert state_dict(client.get_state(sid, 0))["split"] == "test"
    client.close_sessions([sid])


def test_dataset_params_reach_the_dataset(client):
    params = {"min_animals": 1, "max_animals": 1}
    sid = _open(client, LEGS, {"dataset_params": params})
    r = client.reset_one(sid, seed=0)
    ds = rg.create_dataset("leg_counting", seed=0, size=CONFIG_DEFAULTS["size"], **params)
    assert r.observation.text == ds[0]["question"]
    client.close_sessions([sid])


def test_an_unserved_dataset_is_not_found_and_the_operator_is_told_why(client):
    with pytest.raises(EnvNotFoundError) as e:
        client.open("reasoning_gym:no_such_dataset", 1)
    assert "no_such_dataset" in str(e.value)
    out = serve_refusal("reasoning_gym:no_such_dataset")
    assert out.returncode == 2 and "no_such_dataset" in out.stderr


@pytest.mark.parametrize("config", [{"dataset_params": "not an object"}, {"dataset_params": {"no_such_field": 1}},
                                    {"dataset_params": {"min_animals": 5, "max_animals": 1}},
                                    {"dataset_params": {"seed": 3}}, {"max_attempts": 0}, {"size": 0},
                                    {"test_dataset_seed": 10}, {"max_attempts": "two"}])
def test_malformed_config_is_invalid_argument(client, config):
    with pytest.raises(EnvServeError) as e:
        client.open(LEGS, 1, config)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_ls_lists_the_family_with_examples():
    out = subprocess.run([sys.executable, "-m", "envserve.cli", "ls"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "reasoning_gym:<id>" in out.stdout and "reasoning_gym:leg_counting" in out.stdout
