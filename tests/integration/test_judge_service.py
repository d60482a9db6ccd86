"""The JudgeService end to end: a real env server, a real `envserve judge` process reading its
ground truth over StateService, agents' texts judged by key, with the expected scores."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import urllib.request
from fractions import Fraction

import grpc
import pytest

from envserve.client import AsyncJudgeClient, EnvClient, JudgeClient, JudgeTask
from envserve.client.judge import new_scope
from envserve.client.errors import EnvServeError
from serverproc import JudgeProcess, ServerProcess

OK, INVALID_ARGUMENT, NOT_FOUND, UNIMPLEMENTED, UNAUTHENTICATED = 0, 3, 5, 12, 16


@pytest.fixture(scope="module")
def judge(grid_server):
    with JudgeProcess(grid_server.address, metrics=True) as j:
        yield j


@pytest.fixture
def jc(judge):
    with JudgeClient(judge.address) as c:
        yield c


def f1(p: Fraction, r: Fraction) -> float:
    return float(2 * p * r / (p + r)) if p + r else 0.0


def opened(client: EnvClient, env_id: str, seed: int) -> str:
    sid = client.open(env_id, 1)[0]
    client.reset([sid], seeds=[seed])
    return sid


def by_key(results) -> dict:
    out = {r.key: r for r in results}
    assert len(out) == len(results), "every key once"
    return out


# Sokoban seed 3 (6x6): player (4,1), box (3,1), target (2,1): box and target straight above the player.
def test_sokoban_grounding_correct_wrong_partly_and_equivalent(client, jc):
    sid = opened(client, "sokoban", 3)
    assert client.get_state(sid, 0).env_id == "sokoban"
    texts = {
        "correct": "The box is above me in the same column, and the target is above me too, in my column.",
        "equivalent": "The player is below the box and below the target; the player is in the same column as "
                      "the box; the player is in the same column as the target.",
        "partly": "The box is above the player.",
        "wrong": "The box is below the player and to the right of the player.",
        "hallucinated": "The box is above the player and a monster is left of the player.",
    }
    res = by_key(jc.judge([JudgeTask(k, sid, 0, "grounding", t) for k, t in texts.items()]))
    expected = {  # (precision, recall) over the 4 true relations box/target x above/same_column
        "correct": (Fraction(4, 4), Fraction(4, 4)), "equivalent": (Fraction(4, 4), Fraction(4, 4)),
        "partly": (Fraction(1, 1), Fraction(1, 4)), "wrong": (Fraction(0, 2), Fraction(0, 4)),
        "hallucinated": (Fraction(1, 2), Fraction(1, 4)),
    }
    anchor = client.get_state(sid, 0).anchor
    for key, (p, r) in expected.items():
        got = res[key]
        assert got.status.code == OK, got.status.message
        assert (got.precision, got.recall) == pytest.approx((float(p), float(r))), key
        assert got.score == pytest.approx(f1(p, r)) and got.raw_score == pytest.approx(f1(p, r)), key
        assert got.verdict == (f1(p, r) >= 0.7), key
        assert got.judge == "rule" and got.truth_turn == 0 and got.truth_anchor == anchor
        assert got.env_id == "sokoban" and got.field == "grounding"
    assert "Wrong: box below player; box right_of player." in res["wrong"].reasoning
    assert "?monster" in res["hallucinated"].reasoning


def test_world_modeling_is_scored_against_turn_t_plus_1(client, jc):
    sid = opened(client, "sokoban", 3)
    step = client.step({sid: "<think>push</think><answer>Up</answer>"})[0]
    assert step.action_valid and step.turn == 1
    # after Up: player (3,1), box on the target (2,1)
    prediction = ("The box will be on the target, above me in my column. The target will be above me "
                  "in the same column.")
    res = by_key(jc.judge([JudgeTask("wm", sid, 0, "world_modeling", prediction),
                           JudgeTask("as-grounding", sid, 0, "grounding", prediction)]))
    wm = res["wm"]
    # 6 claims all true at t+1 (box on target: same row and column, outside the reference), 4/4 stated
    assert wm.status.code == OK and wm.truth_turn == 1 and wm.truth_anchor == client.get_state(sid, 1).anchor
    assert (wm.precision, wm.recall, wm.score, wm.verdict) == (1.0, 1.0, 1.0, True)
    # at turn t the box is one row below the target: "box same_row target" is the one false claim
    g = res["as-grounding"]
    assert g.truth_turn == 0 and g.precision == pytest.approx(5 / 6) and g.recall == 1.0
    assert g.score == pytest.approx(f1(Fraction(5, 6), Fraction(1)))
    assert "Wrong: box same_row target." in g.reasoning


def test_a_new_task_does_not_lose_the_last_trial_to_the_judge(client, jc):
    sid = opened(client, "sokoban", 3)
    first = client.step({sid: "<think>push</think><answer>Up</answer>"})[0]
    anchor = first.anchor
    assert first.trial == 0 and first.action_valid and anchor != client.get_state(sid, 0).anchor
    # the trainer resets to a new task before the judge has read the last turn
    again = client.reset([sid], seeds=[5])[0]
    assert again.trial == 1 and again.episode == 0
    assert client.get_state(sid, 1, trial=0).anchor == anchor
    prediction = "The box will be on the target, above me in my column."
    res = by_key(jc.judge([JudgeTask("kept", sid, 0, "world_modeling", prediction, episode=0, trial=0),
                           JudgeTask("current", sid, 0, "world_modeling", prediction)]))
    assert res["kept"].status.code == OK and res["kept"].truth_anchor == anchor and res["kept"].precision == 1.0
    # without the trial, the judge reads the new task, which has no turn 1 yet
    assert res["current"].status.code == NOT_FOUND and "turn 1" in res["current"].status.message


# FrozenLake seed 3 (4x4): player (0,0), hole (0,2), goal (3,3).
def test_frozenlake_grounding_and_world_modeling(client, jc):
    sid = opened(client, "frozenlake", 3)
    assert client.get_state(sid, 0).state["player"] == [0.0, 0.0]
    client.step({sid: "<think>down</think><answer>Down</answer>"})  # player (1,0)
    tasks = [
        JudgeTask("correct", sid, 0, "grounding",
                  "The goal is below and to the right of me. The hole is in my row, to my right."),
        JudgeTask("equivalent", sid, 0, "grounding",
                  "I am above and to the left of the goal. I am to the left of the hole, in the same row."),
        JudgeTask("partly", sid, 0, "grounding", "The goal is at the lower right."),
        JudgeTask("wrong", sid, 0, "grounding", "The hole is below me and the goal is to my left."),
        JudgeTask("predicted", sid, 0, "world_modeling",
                  "I will be below the hole and to its left. The goal will be below and to the right of me."),
    ]
    res = by_key(jc.judge(tasks))
    assert [res[k].score for k in ("correct", "equivalent")] == [1.0, 1.0]
    assert res["partly"].precision == 1.0 and res["partly"].recall == 0.5
    assert res["partly"].score == pytest.approx(2 / 3) and not res["partly"].verdict
    assert res["wrong"].precision == 0.0 and res["wrong"].score == 0.0
    wm = res["predicted"]
    assert wm.truth_turn == 1 and wm.score == 1.0 and wm.verdict


def test_one_failing_item_never_fails_its_batch(client, jc):
    sid = opened(client, "sokoban", 3)
    mines = opened(client, "minesweeper", 0)
    res = by_key(jc.judge([
        JudgeTask("good", sid, 0, "grounding", "The box is above me, in my column."),
        JudgeTask("no-session", "nosuch-session", 0, "grounding", "x"),
        JudgeTask("bad-field", sid, 0, "vision", "x"),
        JudgeTask("negative-turn", sid, -1, "grounding", "x"),
        JudgeTask("not-played", sid, 7, "grounding", "x"),
        JudgeTask("future-prediction", sid, 0, "world_modeling", "x"),  # turn 1 does not exist yet
        JudgeTask("wrong-env", sid, 0, "grounding", "x", env_id="frozenlake"),
        JudgeTask("no-judge", mines, 0, "grounding", "The mine is left of me."),
    ]))
    assert res["good"].status.code == OK and res["good"].precision == 1.0 and res["good"].recall == 0.5
    codes = {k: r.status.code for k, r in res.items() if k != "good"}
    assert codes == {"no-session": NOT_FOUND, "bad-field": INVALID_ARGUMENT, "negative-turn": INVALID_ARGUMENT,
                     "not-played": NOT_FOUND, "future-prediction": NOT_FOUND, "wrong-env": INVALID_ARGUMENT,
                     "no-judge": UNIMPLEMENTED}
    assert "turn 1" in res["future-prediction"].status.message
    assert "minesweeper" in res["no-judge"].status.message and "LLM" in res["no-judge"].status.message


def test_repetition_penalty_for_a_frequent_low_score(client, judge):
    # its own env/field counts: FrozenLake world modelling is judged nowhere else in this module
    sids = [opened(client, "frozenlake", 3) for _ in range(4)]
    client.step({s: "<think>go</think><answer>Right</answer>" for s in sids})  # player (0,1), hole (0,2) right of it
    stock = "The goal is to my left."
    good = "The hole will be in my row to my right. The goal will be below and to the right of me."
    tasks = [JudgeTask(f"stock{i}", s, 0, "world_modeling", stock) for i, s in enumerate(sids[:3])]
    tasks += [JudgeTask(f"good{i}", s, 0, "world_modeling", good) for i, s in enumerate(sids[:2])]
    tasks += [JudgeTask("once", sids[3], 0, "world_modeling", "The goal is above me.")]
    with JudgeClient(judge.address) as jc:
        res = by_key(jc.judge(tasks))
    for i in range(3):
        r = res[f"stock{i}"]
        assert r.raw_score == 0.0 and r.repetition_penalized and r.score == pytest.approx(-0.1)
        assert "Repetition penalty" in r.reasoning
    for i in range(2):  # frequent too, but above the 0.7 threshold
        assert res[f"good{i}"].score == 1.0 and not res[f"good{i}"].repetition_penalized
    assert res["once"].score == 0.0 and not res["once"].repetition_penalized  # wrong, but said once


def test_repetition_counts_are_kept_per_scope(client, judge):
    # A training run's counts are its own: what an evaluation or another run sends to the same judge
    # (another scope) neither adds to them nor reads them.
    sids = [opened(client, "frozenlake", 3) for _ in range(3)]
    stock = "The goal is above me and to my left."     # wrong at the reset of seed 3: F1 0
    run, evaluation = new_scope("train"), new_scope("eval")
    assert run != evaluation

    def judged(scope: str, n: int, tag: str) -> list:
        with JudgeClient(judge.address) as jc:
            res = by_key(jc.judge([JudgeTask(f"{tag}{i}", s, 0, "grounding", stock, scope=scope)
                                   for i, s in enumerate(sids[:n])]))
        return [res[f"{tag}{i}"] for i in range(n)]

    assert all(r.repetition_penalized and r.score == pytest.approx(-0.1) for r in judged(evaluation, 3, "e"))
    # Said once in the run's scope: not frequent there, whatever the evaluation repeated.
    (first,) = judged(run, 1, "r")
    assert first.raw_score == 0.0 and first.score == 0.0 and not first.repetition_penalized
    # The run's own repeats do count.
    assert all(r.repetition_penalized for r in judged(run, 2, "s"))


def test_async_submit_never_waits_and_every_result_arrives(client, judge):
    sid = opened(client, "sokoban", 3)

    async def main():
        async with AsyncJudgeClient(judge.address) as ajc:
            task = ajc.submit([JudgeTask(f"k{i}", sid, 0, "grounding", "The box is above me.") for i in range(20)])
            assert not task.done()  # submit returned before any result
            await ajc.drain()
            got = [ajc.results.get_nowait() for _ in range(ajc.results.qsize())]
            info = await ajc.info()
            return got, info

    got, info = asyncio.run(main())
    assert sorted(r.key for r in got) == sorted(f"k{i}" for i in range(20))
    assert all(r.status.code == OK and r.recall == 0.25 for r in got)
    assert info.config["f1_threshold"] == 0.7 and info.config["repetition_penalty"] == -0.1
    assert "rule" in info.judges and info.fallback_judge == ""


def test_metrics_count_judged_items(client, jc, judge):
    sid = opened(client, "sokoban", 3)
    jc.judge([JudgeTask("m", sid, 0, "grounding", "The box is above me.")])
    with urllib.request.urlopen(f"http://127.0.0.1:{judge.metrics_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    assert 'envserve_judge_items_total{code="OK",field="grounding",judge="rule"}' in text
    assert "envserve_judge_seconds_bucket" in text


def test_tokens_for_callers_and_for_ground_truth():
    # The judge's callers are the teams themselves (their session tokens): each is judged on its own
    # sessions only, even those that let the judge read them.
    play, other, truth = "play-token", "other-team-token", "truth-token"
    with ServerProcess(["sokoban"], workers=1, metrics=False,
                       env_vars={"ENVSERVE_TOKENS": f"{play},{other}",
                                 "ENVSERVE_STATE_TOKENS": f"{truth} name=judge"}) as s, \
            JudgeProcess(s.address, env_vars={"ENVSERVE_STATE_TOKEN": f"{truth},spare-token",  # the first is used
                                               "ENVSERVE_JUDGE_TOKENS": f"{play},{other}"}) as j, \
            JudgeProcess(s.address) as blind:
        # The trainer grants the judge's state token (by its name) the sessions it opens.
        with EnvClient(s.address, token=play, state_readers=["judge"]) as c:
            sid = opened(c, "sokoban", 3)
        with EnvClient(s.address, token=play) as c:
            private = opened(c, "sokoban", 3)
        task = JudgeTask("t", sid, 0, "grounding", "The box is above me.")
        with JudgeClient(j.address) as anonymous, pytest.raises(EnvServeError) as e:
            anonymous.judge([task])
        assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
        with JudgeClient(j.address, token=play) as ok:
            assert ok.judge([task])[0].status.code == OK
            # a session that did not grant the judge stays unread: its item says so
            r = ok.judge([JudgeTask("p", private, 0, "grounding", "The box is above me.")])[0]
            assert r.status.code == grpc.StatusCode.PERMISSION_DENIED.value[0] and "grants" in r.status.message
        # another team cannot have the judge read (and score) this team's session, cached or not
        with JudgeClient(j.address, token=other) as them:
            r = them.judge([task])[0]
            assert r.status.code == grpc.StatusCode.PERMISSION_DENIED.value[0] and "caller" in r.status.message
        # a judge without the state token cannot read the truth: the item says so, the call succeeds
        with JudgeClient(blind.address) as jc:
            r = jc.judge([task])[0]
        assert r.status.code == UNAUTHENTICATED and "StateService" in r.status.message


@pytest.mark.parametrize("args, message", [
    ([], "give exactly one of env_address"),
    (["--env-address", "127.0.0.1:1", "--judge", "sokoban"], "ENV=JUDGE"),
    (["--env-address", "127.0.0.1:1", "--judge", "sokoban=llm"], "judge 'llm' for sokoban is not configured"),
])
def test_cli_refuses_bad_settings(args, message):
    out = subprocess.run([sys.executable, "-m", "envserve.cli", "judge", "--port", "0", *args],
                         capture_output=True, text=True, timeout=60,
                         env={k: v for k, v in os.environ.items() if not k.startswith("ENVSERVE_")})
    assert out.returncode == 2 and message in out.stderr


def test_truth_records_are_shared_while_fresh_and_dropped_by_age_and_count(client, grid_server):
    """The judge's cache of ground truth: a second read of a turn is the same record, a record
    unused for its age limit is dropped (so memory levels off at the rate of new turns), and the
    count bound holds."""
    from envserve.client import AsyncEnvClient
    from envserve.judge.service import TruthCache

    sid = opened(client, "sokoban", 3)
    client.step({sid: "<answer>Left</answer>"})
    client.step({sid: "<answer>Right</answer>"})
    now = [0.0]

    async def main():
        async with AsyncEnvClient(grid_server.address) as source:
            cache = TruthCache(source, size=2, max_age_seconds=60.0, clock=lambda: now[0])
            first = await cache.get(sid, 0, None, None)
            again = await cache.get(sid, 0, first["episode"], first["trial"])
            assert again is first and len(cache) == 1
            now[0] = 30.0
            await cache.get(sid, 1, first["episode"], first["trial"])
            await cache.get(sid, 2, first["episode"], first["trial"])
            assert len(cache) == 2, "the count bound drops the least recently used"
            refetched = await cache.get(sid, 0, first["episode"], first["trial"])
            assert refetched is not first and refetched == first
            now[0] = 200.0
            turn2 = await cache.get(sid, 2, first["episode"], first["trial"])
            assert len(cache) == 1 and turn2["turn"] == 2, "records unused for 60 s are gone"

    asyncio.run(main())
    client.close_sessions([sid])


def test_truth_cache_bounds_are_checked(tmp_path):
    from envserve.judge.app import JudgeServerConfig
    with pytest.raises(ValueError, match="truth_cache_seconds"):
        JudgeServerConfig(env_address="127.0.0.1:1", truth_cache_seconds=0)
    settings = tmp_path / "judge.json"
    settings.write_text('{"truth_cache_records": 0}')
    out = subprocess.run([sys.executable, "-m", "envserve.cli", "judge", "--port", "0", "--env-address",
                          "127.0.0.1:1", "--config", str(settings)], capture_output=True, text=True, timeout=60,
                         env={k: v for k, v in os.environ.items() if not k.startswith("ENVSERVE_")})
    assert out.returncode == 2 and "truth_cache_records" in out.stderr
