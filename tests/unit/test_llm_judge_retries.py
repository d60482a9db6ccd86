"""The LLM judge's HTTP behaviour against a misbehaving endpoint: retries with backoff and
Retry-After, which statuses are retried, the rate limit, the concurrency limit, the cache and
single-flight, unreadable replies and the request it sends.

A hosted API's throttling cannot be run here, so `ScriptedEndpointDouble` stands in for one: a TEST
DOUBLE, a plain HTTP server on loopback that answers each request with the next scripted response
(status, headers, body, delay) and records what it received. It runs no model. The real protocol
path against a real model server is tests/integration/test_llm_judge.py.
"""
from __future__ import annotations

import asyncio
import json
import random
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from envserve.judge import GROUNDING, WORLD_MODELING
from envserve.judge.base import Judge, JudgeError, JudgeInput
from envserve.judge.llm_judge import LLMJudge, LLMJudgeConfig
from envserve.judge.prompts import yesno_prompt

# A real GetState record shape (Sokoban, seed 7 in test_rule_judge.py), written out: these tests are
# about HTTP, not about the env.
TRUTH = {"state": {"player": [2, 2], "boxes": [[2, 3]], "targets": [[3, 4]], "boxes_on_target": 0,
                   "grid": ["######", "##___#", "##PX_#", "###_O#", "###__#", "######"]},
         "relations": ["box is at the same row and to the right of the player",
                       "target is below and on the right side of the player"],
         "anchor": "a4d4f38852eea820", "observation_text": ""}
TEXT = "The box is to the right of the player."


def completion(content: str | None, status: int = 200, headers: dict | None = None, delay: float = 0.0) -> dict:
    body = {"id": "x", "object": "chat.completion", "model": "judge",
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": content}}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}}
    return {"status": status, "headers": headers or {}, "body": json.dumps(body), "delay": delay}


def error(status: int, headers: dict | None = None, body: str = '{"error": "scripted"}', delay: float = 0.0) -> dict:
    return {"status": status, "headers": headers or {}, "body": body, "delay": delay}


YES = completion("The box is right of the player. <answer>YES</answer>")


class ScriptedEndpointDouble:
    """TEST DOUBLE of an OpenAI-compatible endpoint: scripted responses, recorded requests."""

    def __init__(self, script: list[dict], default: dict | None = None):
        self.script, self.default = list(script), default
        self.requests: list[dict] = []          # arrival time, path, headers, JSON body
        self.open = self.peak_open = 0
        self.lock = threading.Lock()
        double = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with double.lock:
                    double.requests.append({"t": time.monotonic(), "path": self.path, "headers": dict(self.headers),
                                            "body": json.loads(raw or b"{}")})
                    double.open += 1
                    double.peak_open = max(double.peak_open, double.open)
                    step = double.script.pop(0) if double.script else double.default
                try:
                    time.sleep(step.get("delay", 0.0))
                    data = step["body"].encode()
                    self.send_response(step["status"])
                    for k, v in step["headers"].items():
                        self.send_header(k, v)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass   # the client gave up (its timeout): nothing to answer
                finally:
                    with double.lock:
                        double.open -= 1

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def endpoint():
    doubles = []

    def make(script, default=None):
        d = ScriptedEndpointDouble(script, default)
        doubles.append(d)
        return d

    yield make
    for d in doubles:
        d.close()


def judge_for(base_url: str, **overrides) -> LLMJudge:
    settings = {"base_url": base_url, "model": "judge", "max_retries": 3, "backoff_base_s": 0.05,
                "backoff_max_s": 2.0, "timeout_s": 5.0, **overrides}
    return LLMJudge(LLMJudgeConfig.from_mapping(settings), rng=random.Random(0))


def run(judge: LLMJudge, *items: JudgeInput):
    """Judges the items concurrently in one event loop; exceptions come back as values."""
    async def main():
        try:
            return await asyncio.gather(*(judge.judge(i) for i in items), return_exceptions=True)
        finally:
            await judge.aclose()
    return asyncio.run(main())


def item(text: str = TEXT, field: str = GROUNDING, previous=None) -> JudgeInput:
    return JudgeInput("sokoban", field, text, TRUTH, previous)


# -- the request ------------------------------------------------------------------------------------------
def test_sends_the_env_prompt_and_reads_yes(endpoint, monkeypatch):
    monkeypatch.setenv("ENVSERVE_TEST_JUDGE_KEY", "secret-123")
    ep = endpoint([YES])
    judge = judge_for(ep.base_url, api_key_env="ENVSERVE_TEST_JUDGE_KEY", max_tokens=64, temperature=0.2)
    assert isinstance(judge, Judge) and judge.supports("anything-at-all")
    [j] = run(judge, item())
    assert (j.score, j.verdict, j.cached, j.judge) == (1.0, True, False, "llm:judge")
    assert j.details["answer"] == "YES" and j.details["prompt_family"] == "sokoban" and j.details["attempts"] == 1
    assert "answered YES" in j.reasoning and "box is right of the player" in j.reasoning
    [req] = ep.requests
    assert req["path"] == "/v1/chat/completions"
    assert req["headers"]["Authorization"] == "Bearer secret-123"
    assert req["body"] == {"model": "judge", "temperature": 0.2, "max_tokens": 64,
                           "messages": list(yesno_prompt("sokoban", GROUNDING, TEXT, TRUTH).messages)}
    assert judge.stats()["requests"] == 1 and judge.stats()["completions"] == 1


def test_missing_key_variable_is_a_config_error(monkeypatch):
    monkeypatch.delenv("ENVSERVE_TEST_JUDGE_KEY", raising=False)
    with pytest.raises(ValueError, match="ENVSERVE_TEST_JUDGE_KEY"):
        judge_for("http://127.0.0.1:9/v1", api_key_env="ENVSERVE_TEST_JUDGE_KEY")


# -- retries ---------------------------------------------------------------------------------------------
def test_429_with_retry_after_then_500_then_success(endpoint):
    ep = endpoint([error(429, {"Retry-After": "1"}), error(500), YES])
    judge = judge_for(ep.base_url, backoff_base_s=0.2)
    [j] = run(judge, item())
    assert j.verdict is True and j.details["attempts"] == 3
    t = [r["t"] for r in ep.requests]
    assert len(t) == 3
    assert t[1] - t[0] >= 1.0            # Retry-After: 1 honoured
    # second retry (n=1): backoff drawn from [0.2 * 2 / 2, 0.2 * 2] = [0.2, 0.4]
    assert t[2] - t[1] >= 0.2
    s = judge.stats()
    assert (s["requests"], s["retries"], s["completions"], s["failures"]) == (3, 2, 1, 0)


def test_retry_after_as_an_http_date(endpoint):
    from email.utils import formatdate
    when = time.time() + 3
    ep = endpoint([error(503, {"Retry-After": formatdate(when, usegmt=True)}), YES])
    started = time.monotonic() - time.time()  # wall clock to the fixture's monotonic clock
    [j] = run(judge_for(ep.base_url, backoff_max_s=5.0), item())
    assert j.verdict is True
    # Not before the date (whole seconds), however late the 503 itself came on a busy machine; the
    # 0.05 s backoff alone would retry at once.
    assert ep.requests[1]["t"] >= int(when) + started - 0.05


def test_retry_after_beyond_the_longest_wait_ends_at_once(endpoint):
    ep = endpoint([error(429, {"Retry-After": "120"})], default=YES)
    [e] = run(judge_for(ep.base_url, backoff_max_s=2.0), item())
    assert isinstance(e, JudgeError) and e.code == "RESOURCE_EXHAUSTED" and "120" in e.message
    assert len(ep.requests) == 1


@pytest.mark.parametrize("status", [408, 409, 429, 500, 502, 503, 504])
def test_retried_statuses(endpoint, status):
    ep = endpoint([error(status), error(status), YES])
    judge = judge_for(ep.base_url)
    [j] = run(judge, item())
    assert j.verdict is True and len(ep.requests) == 3 and judge.stats()["retries"] == 2


@pytest.mark.parametrize("status, code", [(400, "INVALID_ARGUMENT"), (401, "UNAUTHENTICATED"),
                                          (403, "PERMISSION_DENIED"), (404, "NOT_FOUND"),
                                          (422, "INVALID_ARGUMENT"), (418, "FAILED_PRECONDITION")])
def test_other_4xx_are_not_retried(endpoint, status, code):
    ep = endpoint([error(status, body='{"error": "model not found"}')], default=YES)
    judge = judge_for(ep.base_url)
    [e] = run(judge, item())
    assert isinstance(e, JudgeError) and e.code == code and str(status) in e.message
    assert len(ep.requests) == 1 and judge.stats()["retries"] == 0 and judge.stats()["failures"] == 1


def test_exhausted_retries(endpoint):
    ep = endpoint([], default=error(503))
    judge = judge_for(ep.base_url, max_retries=2)
    [e] = run(judge, item())
    assert isinstance(e, JudgeError) and e.code == "UNAVAILABLE" and "3 attempt(s)" in e.message
    assert len(ep.requests) == 3
    ep = endpoint([], default=error(429))
    [e] = run(judge_for(ep.base_url, max_retries=1), item())
    assert e.code == "RESOURCE_EXHAUSTED" and len(ep.requests) == 2


def test_unreachable_endpoint_is_unavailable():
    with socket.socket() as s:   # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    judge = judge_for(f"http://127.0.0.1:{port}/v1", max_retries=2)
    [e] = run(judge, item())
    assert isinstance(e, JudgeError) and e.code == "UNAVAILABLE" and "ConnectError" in e.message
    s = judge.stats()
    assert (s["requests"], s["retries"], s["completions"], s["failures"]) == (3, 2, 0, 1)


def test_timeout_is_retried(endpoint):
    ep = endpoint([completion("<answer>NO</answer>", delay=1.5), YES])
    judge = judge_for(ep.base_url, timeout_s=0.5)
    [j] = run(judge, item())
    assert j.verdict is True and j.details["attempts"] == 2 and judge.stats()["retries"] == 1


def test_a_200_without_a_completion_is_an_error(endpoint):
    ep = endpoint([error(200, body="<html>not an API</html>")])
    [e] = run(judge_for(ep.base_url), item())
    assert isinstance(e, JudgeError) and e.code == "INTERNAL" and len(ep.requests) == 1


# -- replies ---------------------------------------------------------------------------------------------
def test_unreadable_replies_score_zero_and_are_counted(endpoint):
    ep = endpoint([completion("I think it is right."), completion("<answer>maybe</answer>"), completion(None),
                   completion("<answer>no</answer>")])
    judge = judge_for(ep.base_url, max_concurrency=1)
    results = run(judge, item("a"), item("b"), item("c"), item("d"))
    for j in results[:3]:
        assert (j.score, j.verdict) == (0.0, False) and "could not be read" in j.reasoning and j.details["parse_error"]
    assert "no <answer>" in results[0].reasoning and "'maybe'" in results[1].reasoning
    assert (results[3].score, results[3].verdict, results[3].details["answer"]) == (0.0, False, "NO")
    assert "parse_error" not in results[3].details
    s = judge.stats()
    assert (s["parse_failures"], s["completions"], s["failures"]) == (3, 4, 0)


def test_structured_mode_scores_the_reading_by_f1(endpoint):
    reading = ('```json\n[{"subject": "box", "relation": "right_of", "object": "player"},\n'
               ' {"subject": "box", "relation": "above", "object": "player"}]\n```')
    ep = endpoint([completion(reading), completion("The box is right of the player.")])
    judge = judge_for(ep.base_url, mode="structured", max_concurrency=1)
    good, bad = run(judge, item("first"), item("second"))
    # box right_of (true), box above (wrong: same row): P 1/2; 1 of 4 facts: R 1/4; F1 1/3
    assert (good.precision, good.recall) == (0.5, 0.25) and good.f1 == pytest.approx(1 / 3)
    assert good.score == good.f1 and good.verdict is False
    assert good.details["claims"] == ["box right_of player", "box above player"]
    assert good.details["wrong"] == ["box above player"] and len(good.details["reference"]) == 4
    assert "structured" == good.details["mode"] and "JSON list" in ep.requests[0]["body"]["messages"][0]["content"]
    assert (bad.score, bad.verdict, bad.f1) == (0.0, False, 0.0) and "not valid JSON" in bad.reasoning
    assert judge.stats()["parse_failures"] == 1


def test_structured_mode_asks_yes_no_where_no_claims_exist(endpoint):
    ep = endpoint([YES])
    judge = judge_for(ep.base_url, mode="structured")
    [j] = run(judge, JudgeInput("svg", GROUNDING, "A red triangle.", {"state": {"shapes": []}, "relations": []}))
    assert j.verdict is True and j.details["mode"] == "yesno" and j.details["prompt_family"] == "generic"
    assert "<answer>YES</answer>" in ep.requests[0]["body"]["messages"][0]["content"]


def test_empty_text_is_not_sent(endpoint):
    ep = endpoint([], default=YES)
    judge = judge_for(ep.base_url)
    [j] = run(judge, item("  \n"))
    assert (j.score, j.verdict) == (0.0, False) and not ep.requests


def test_bad_field_is_invalid_argument(endpoint):
    ep = endpoint([], default=YES)
    [e] = run(judge_for(ep.base_url), item(field="reasoning"))
    assert isinstance(e, JudgeError) and e.code == "INVALID_ARGUMENT" and not ep.requests


# -- traffic control ---------------------------------------------------------------------------------------
def test_rate_limit_spaces_request_starts(endpoint):
    ep = endpoint([], default=YES)
    judge = judge_for(ep.base_url, requests_per_second=4, max_concurrency=8)
    results = run(judge, *(item(f"text {i}") for i in range(5)))
    assert all(j.verdict for j in results)
    # one token refilled at 4/s: the 5 starts span 4 intervals of 0.25 s. Both figures below leave one
    # interval of slack: time spent sending a request counts toward the next token, and the first request
    # also opens a connection, so it can arrive late. Unlimited, all 5 arrive within milliseconds.
    assert judge.stats()["rate_limit_wait_s"] >= 3 * 0.25
    t = sorted(r["t"] for r in ep.requests)
    assert t[-1] - t[0] >= 3 * 0.25


def test_concurrency_limit(endpoint):
    ep = endpoint([], default={**YES, "delay": 0.2})
    judge = judge_for(ep.base_url, max_concurrency=2)
    results = run(judge, *(item(f"text {i}") for i in range(6)))
    assert all(j.verdict for j in results) and len(ep.requests) == 6
    assert ep.peak_open == 2 and judge.stats()["peak_in_flight"] == 2 and judge.stats()["in_flight"] == 0


# -- cache and single-flight ----------------------------------------------------------------------------------
def test_single_flight_then_cache(endpoint):
    ep = endpoint([], default={**YES, "delay": 0.2})
    judge = judge_for(ep.base_url)

    async def main():
        try:
            first = await asyncio.gather(*(judge.judge(item()) for _ in range(5)))
            again = await judge.judge(item())
            other = await judge.judge(item(TEXT + " And the target is below me."))
            return first, again, other
        finally:
            await judge.aclose()

    first, again, other = asyncio.run(main())
    assert len(ep.requests) == 2                      # one for the five, none for the repeat, one for `other`
    assert sorted(j.cached for j in first) == [False, True, True, True, True]
    assert again.cached and again.verdict and not other.cached
    s = judge.stats()
    assert (s["shared"], s["cache_hits"], s["requests"], s["cache_entries"]) == (4, 1, 2, 2)


def test_world_modelling_cache_depends_on_the_previous_turn(endpoint):
    ep = endpoint([], default=YES)
    judge = judge_for(ep.base_url, max_concurrency=1)
    before = {**TRUTH, "anchor": "before-1"}
    other = {**TRUTH, "anchor": "before-2"}

    async def main():
        try:
            a = await judge.judge(item(field=WORLD_MODELING, previous=before))
            b = await judge.judge(item(field=WORLD_MODELING, previous=before))
            c = await judge.judge(item(field=WORLD_MODELING, previous=other))
            return a, b, c
        finally:
            await judge.aclose()

    a, b, c = asyncio.run(main())
    assert (a.cached, b.cached, c.cached) == (False, True, False) and len(ep.requests) == 2
    # the world-modelling prompt shows both turns
    content = ep.requests[0]["body"]["messages"][1]["content"]
    assert "State before the action(s):" in content and "True state after the action(s):" in content


def test_lru_eviction_and_disabled_cache(endpoint):
    ep = endpoint([], default=YES)
    judge = judge_for(ep.base_url, cache_size=2, max_concurrency=1)

    async def seq(j, texts):
        try:
            return [await j.judge(item(t)) for t in texts]
        finally:
            await j.aclose()

    # a, b, a (hit: a is now newest), c (evicts b), a (hit), b (miss)
    out = asyncio.run(seq(judge, ["a", "b", "a", "c", "a", "b"]))
    assert [j.cached for j in out] == [False, False, True, False, True, False]
    assert len(ep.requests) == 4 and judge.stats()["cache_entries"] == 2
    ep2 = endpoint([], default=YES)
    nocache = judge_for(ep2.base_url, cache_size=0)
    out = asyncio.run(seq(nocache, ["a", "a"]))
    assert [j.cached for j in out] == [False, False] and len(ep2.requests) == 2


def test_errors_are_not_cached_and_a_cancelled_caller_does_not_cancel_the_call(endpoint):
    ep = endpoint([error(400), {**YES, "delay": 0.3}])
    judge = judge_for(ep.base_url)

    async def main():
        try:
            with pytest.raises(JudgeError):
                await judge.judge(item())
            leader = asyncio.ensure_future(judge.judge(item()))
            await asyncio.sleep(0.05)
            follower = asyncio.ensure_future(judge.judge(item()))
            await asyncio.sleep(0.05)
            leader.cancel()
            return await follower, leader.cancelled()
        finally:
            await judge.aclose()

    j, cancelled = asyncio.run(main())
    assert cancelled and j.verdict is True and j.cached is True
    assert len(ep.requests) == 2 and judge.stats()["cache_entries"] == 1


def test_reused_in_a_second_event_loop_after_aclose(endpoint):
    # the semaphore is contended in both loops: one bound to the first loop would fail in the second
    ep = endpoint([], default={**YES, "delay": 0.05})
    judge = judge_for(ep.base_url, max_concurrency=1, requests_per_second=100)
    first = run(judge, item("a"), item("b"))
    second = run(judge, item("c"), item("d"), item("a"))
    assert all(j.verdict for j in first + second), first + second
    assert [j.cached for j in second] == [False, False, True] and len(ep.requests) == 4
