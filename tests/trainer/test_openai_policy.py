"""The openai backend against a real OpenAI-compatible server: `transformers serve` on loopback
(tests/llm_fixtures.ModelServer) running the trainer's own tiny model, saved with pretrained.save_model.

Greedy replies are checked token for token against the hf backend on the same weights (the server
reports its token counts, and its text is the hf backend's decoded text), seeded sampling against
itself, and the traffic controls against the server's own log. Retries are exercised through
ThrottlingProxy, a real HTTP server on loopback in front of the model server that answers the first
requests with 429 and 503 and forwards the rest, recording every body it was sent.

`transformers serve` ignores `logprobs` and reports no token ids, so the lists stay empty here; the
parsing of servers that do report them (vLLM's shapes) is checked on literal responses in the unit
part at the end.
"""
from __future__ import annotations

import asyncio
import http.server
import json
import threading
import urllib.request
from importlib.util import find_spec

import pytest

pytest.importorskip("httpx")
pytest.importorskip("torch")
pytest.importorskip("transformers")

from envserve_trainer.policies import Policy  # noqa: E402
from envserve_trainer.policies.hf import HFPolicy, encode_chat, row_seed  # noqa: E402
from envserve_trainer.policies.openai import (EndpointError, OpenAIPolicy, OpenAIPolicyConfig, finish_reason,
                                              parse_logprobs, retry_after_s)

PROMPTS = [[{"role": "system", "content": "You are playing Sokoban."}, {"role": "user", "content": "#PX_O#\nWhere?"}],
           [{"role": "user", "content": "Up"}],
           [{"role": "user", "content": "P_O_\n____\nReach the goal."}],
           [{"role": "user", "content": "You are on a frozen lake."}],
           [{"role": "user", "content": "Left Right Left"}]]
MAX_NEW = 12


@pytest.fixture(scope="module")
def served_model(tmp_path_factory, grid_tokenizer):
    """(model dir, hf model, tokenizer, server). The saved generation config samples by default:
    `transformers serve` only switches sampling off for temperature 0, never on, so without it
    every request would decode greedily."""
    missing = [m for m in ("fastapi", "uvicorn", "tokenizers") if find_spec(m) is None]
    if missing:
        pytest.skip(f"`transformers serve` needs transformers[serving]; missing {missing}")
    from envserve_trainer.models.small import build_small_model
    from envserve_trainer.models.pretrained import save_model
    from llm_fixtures import ModelServer
    tok = grid_tokenizer
    model = build_small_model(tok, "tiny", seed=0)
    model.generation_config.do_sample = True
    path = save_model(tmp_path_factory.mktemp("openai-policy-model"), model, tok)
    server = ModelServer(path, tmp_path_factory.mktemp("hf-home"))
    yield path, model, tok, server
    server.stop()


def make_policy(url: str, model: str, **overrides) -> OpenAIPolicy:
    return OpenAIPolicy({"base_url": url, "model": model, "timeout_s": 60.0, "max_retries": 2,
                         "backoff_base_s": 0.01, "backoff_max_s": 0.05, **overrides})


def test_greedy_replies_equal_the_hf_backend(served_model):
    path, model, tok, server = served_model
    with make_policy(server.base_url, server.model) as policy:
        assert isinstance(policy, Policy)
        got = policy.generate(PROMPTS, MAX_NEW, temperature=0.0)
    want = HFPolicy(model, tok).generate(PROMPTS, MAX_NEW, temperature=0.0)
    for messages, g, w in zip(PROMPTS, got, want):
        # the server saw exactly the chat-templated prompt the hf backend encodes ...
        assert g.extra["prompt_tokens"] == len(encode_chat(tok, messages)) == len(w.prompt_token_ids)
        # ... and generated what the hf backend generates from it. The server's response parser for
        # qwen2-type models trims the content's surrounding whitespace, hence the strip.
        assert "<think>" not in w.text
        assert g.text == w.text.strip() and g.text
        assert g.extra["completion_tokens"] == len(w.completion_token_ids)
        assert g.finish_reason == w.finish_reason
        assert g.completion_logprobs == [] and g.completion_token_ids == [] and g.prompt_token_ids == []
        assert g.extra["attempts"] == 1


def test_seeded_sampling_repeats_and_rows_differ(served_model):
    *_, server = served_model
    # one request at a time: `transformers serve` seeds torch's global generator per request
    with make_policy(server.base_url, server.model, max_concurrency=1) as policy:
        a = policy.generate(PROMPTS[:2], MAX_NEW, temperature=1.0, seed=7)
        b = policy.generate(PROMPTS[:2], MAX_NEW, temperature=1.0, seed=7)
        c = policy.generate(PROMPTS[:2], MAX_NEW, temperature=1.0, seed=8)
        greedy = policy.generate(PROMPTS[:2], MAX_NEW, temperature=0.0)
        twice = policy.generate([PROMPTS[1], PROMPTS[1]], MAX_NEW, temperature=1.0, seed=7)
    assert [g.text for g in a] == [g.text for g in b]
    assert [g.text for g in a] != [g.text for g in c]
    assert [g.text for g in a] != [g.text for g in greedy]   # it did sample
    assert [g.extra["seed"] for g in a] == [row_seed(7, 0), row_seed(7, 1)]
    assert twice[0].text != twice[1].text   # the same prompt in two rows: each row has its own seed
    assert twice[1].text == a[1].text       # row 1 of seed 7 draws the same whatever row 0 holds


def test_concurrency_limit_against_the_server(served_model):
    *_, server = served_model
    served = server.settled_completions()
    with make_policy(server.base_url, server.model, max_concurrency=2) as policy:
        gens = policy.generate(PROMPTS, 4, temperature=0.0)
        stats = policy.stats()
    assert len(gens) == 5 and all(g.text for g in gens)
    assert stats["peak_in_flight"] == 2 and stats["in_flight"] == 0
    assert (stats["requests"], stats["completions"], stats["retries"], stats["failures"]) == (5, 5, 0, 0)
    assert server.wait_completions(served + 5) == served + 5


def test_agenerate_runs_inside_an_event_loop(served_model):
    *_, server = served_model
    with make_policy(server.base_url, server.model) as policy:
        sync = policy.generate(PROMPTS[:2], MAX_NEW, temperature=0.0)

        async def main():
            ticks = 0

            async def tick():   # the caller's loop keeps running while the requests are out
                nonlocal ticks
                while True:
                    ticks += 1
                    await asyncio.sleep(0.001)

            ticker = asyncio.create_task(tick())
            try:
                return await policy.agenerate(PROMPTS[:2], MAX_NEW, temperature=0.0), ticks
            finally:
                ticker.cancel()

        gens, ticks = asyncio.run(main())
    assert [g.text for g in gens] == [g.text for g in sync] and ticks > 1


def test_refusals_fail_at_once_with_the_servers_reason(served_model):
    *_, server = served_model
    with make_policy(server.base_url, "no-such-model") as policy:
        with pytest.raises(EndpointError, match="refused the request: HTTP 400.*pinned") as e:
            policy.generate(PROMPTS[:1], 4)
        assert (e.value.status, e.value.attempts) == (400, 1) and policy.stats()["retries"] == 0
    # transformers serve takes only text prompts on /completions; vLLM and SGLang take token ids
    with make_policy(server.base_url, server.model) as policy:
        with pytest.raises(EndpointError, match="HTTP 400.*prompt must be a string"):
            policy.generate_from_ids([[5, 6, 7]], 4)
        with pytest.raises(NotImplementedError, match="cannot load weights"):
            policy.update_weights({})


def test_an_unreachable_endpoint_fails_after_the_retries():
    from llm_fixtures import free_port
    with make_policy(f"http://127.0.0.1:{free_port()}/v1", "m", max_retries=2) as policy:
        with pytest.raises(EndpointError, match=r"gave no completion after 3 attempt\(s\): ConnectError") as e:
            policy.generate(PROMPTS[:1], 4)
        assert e.value.status is None and policy.stats()["retries"] == 2


# -- retries through a throttling proxy ---------------------------------------------------------------
class ThrottlingProxy:
    """A real HTTP server on loopback: answers the first len(`failures`) POSTs with the given
    (status, headers), forwards every later one to `upstream`, and keeps every body it was sent."""

    def __init__(self, upstream: str, failures: list[tuple[int, dict[str, str]]]):
        self.upstream, self.failures, self.bodies = upstream.rstrip("/"), list(failures), []
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                proxy.bodies.append(json.loads(body))
                if proxy.failures:
                    status, headers = proxy.failures.pop(0)
                    payload = json.dumps({"error": f"scripted {status}"}).encode()
                    self.send_response(status)
                    for k, v in headers.items():
                        self.send_header(k, v)
                else:
                    request = urllib.request.Request(proxy.upstream + self.path.removeprefix("/v1"), data=body,
                                                     headers={"content-type": "application/json"})
                    with urllib.request.urlopen(request, timeout=60) as r:
                        status, payload = r.status, r.read()
                    self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_429_and_503_are_retried_and_the_request_carries_seed_and_logprobs(served_model):
    path, model, tok, server = served_model
    proxy = ThrottlingProxy(server.base_url, [(429, {"Retry-After": "0"}), (503, {})])
    try:
        with make_policy(proxy.base_url, server.model, extra_body={"user": "trainer-eval"}) as policy:
            (g,) = policy.generate(PROMPTS[:1], MAX_NEW, temperature=0.0, seed=3)
            stats = policy.stats()
    finally:
        proxy.close()
    (want,) = HFPolicy(model, tok).generate(PROMPTS[:1], MAX_NEW, temperature=0.0)
    assert g.text == want.text.strip() and g.extra["attempts"] == 3
    assert (stats["requests"], stats["retries"], stats["completions"], stats["failures"]) == (3, 2, 1, 0)
    assert len(proxy.bodies) == 3 and proxy.bodies[0] == proxy.bodies[2]   # the retries resend the request
    assert proxy.bodies[0] == {"model": server.model, "messages": PROMPTS[0], "max_tokens": MAX_NEW,
                               "temperature": 0.0, "top_p": 1.0, "logprobs": True, "seed": row_seed(3, 0),
                               "user": "trainer-eval"}


def test_throttling_past_the_retries_and_long_retry_after_give_up(served_model):
    *_, server = served_model
    proxy = ThrottlingProxy(server.base_url, [(429, {})] * 3 + [(503, {"Retry-After": "3600"})])
    try:
        with make_policy(proxy.base_url, server.model, max_retries=2) as policy:
            with pytest.raises(EndpointError, match=r"after 3 attempt\(s\): HTTP 429") as e:
                policy.generate(PROMPTS[:1], 4)
            assert e.value.status == 429
            with pytest.raises(EndpointError, match="asks to wait 3600 s, more than backoff_max_s") as e:
                policy.generate(PROMPTS[:1], 4)
            assert (e.value.status, e.value.attempts) == (503, 1)
    finally:
        proxy.close()


# -- unit: configuration and the response shapes of servers that report more -------------------------
def test_config_refuses_bad_values():
    with pytest.raises(ValueError, match="base_url must be an http"):
        OpenAIPolicyConfig(base_url="127.0.0.1:8000", model="m")
    with pytest.raises(ValueError, match="model must name"):
        OpenAIPolicyConfig(base_url="http://h/v1")
    with pytest.raises(ValueError, match=r"extra_body may not set \['seed'\]"):
        OpenAIPolicyConfig(base_url="http://h/v1", model="m", extra_body={"seed": 1})
    with pytest.raises(ValueError, match="max_concurrency >= 1"):
        OpenAIPolicyConfig(base_url="http://h/v1", model="m", max_concurrency=0)
    with pytest.raises(ValueError, match="unknown OpenAIPolicyConfig key 'api_key'"):
        OpenAIPolicyConfig.from_mapping({"base_url": "http://h/v1", "model": "m", "api_key": "sk-..."})
    policy = OpenAIPolicy({"base_url": "http://h/v1", "model": "m"})
    with pytest.raises(ValueError, match="max_new_tokens must be a positive integer"):
        policy.generate(PROMPTS[:1], 0)
    with pytest.raises(ValueError, match="top_p"):
        policy.generate(PROMPTS[:1], 4, top_p=1.5)
    policy.close()
    with pytest.raises(RuntimeError, match="closed"):
        policy.generate(PROMPTS[:1], 4)


def test_api_key_comes_from_the_named_environment_variable(monkeypatch):
    monkeypatch.setenv("MY_ENDPOINT_KEY", "secret-1")
    with OpenAIPolicy({"base_url": "http://h/v1", "model": "m", "api_key_env": "MY_ENDPOINT_KEY"}) as p:
        assert p._headers == {"Authorization": "Bearer secret-1"}
    monkeypatch.delenv("MY_ENDPOINT_KEY")
    with OpenAIPolicy({"base_url": "http://h/v1", "model": "m", "api_key_env": "MY_ENDPOINT_KEY"}) as p:
        assert p._headers == {}


def test_vllm_shaped_chat_response_gives_ids_and_logprobs():
    """A chat completion as vLLM answers with logprobs=true and extra_body {"return_token_ids": true}."""
    data = {"choices": [{"index": 0, "finish_reason": "stop", "token_ids": [17, 4, 2],
                         "message": {"role": "assistant", "content": "Up"},
                         "logprobs": {"content": [{"token": "Up", "logprob": -0.5},
                                                  {"token": "!", "logprob": -1.25},
                                                  {"token": "<|im_end|>", "logprob": -0.125}]}}],
            "prompt_token_ids": [1, 9, 3], "usage": {"prompt_tokens": 3, "completion_tokens": 3}}
    p = OpenAIPolicy({"base_url": "http://h/v1", "model": "m"})
    g = p._generation("url", data, [], 42, 1)
    p.close()
    assert (g.text, g.finish_reason) == ("Up", "stop")
    assert g.prompt_token_ids == [1, 9, 3] and g.completion_token_ids == [17, 4, 2]
    assert g.completion_logprobs == [-0.5, -1.25, -0.125]
    assert g.extra == {"seed": 42, "attempts": 1, "endpoint_finish_reason": "stop", "prompt_tokens": 3,
                       "completion_tokens": 3}


def test_logprob_parsing_of_the_token_id_spelling_and_the_legacy_form():
    # vLLM's return_tokens_as_token_ids spells each token "token_id:N"
    assert parse_logprobs({"content": [{"token": "token_id:17", "logprob": -0.5},
                                       {"token": "token_id:2", "logprob": -2.0}]}) == ([-0.5, -2.0], [17, 2])
    # ordinary spellings give the log-probabilities but no ids
    assert parse_logprobs({"content": [{"token": "Up", "logprob": -0.5}]}) == ([-0.5], [])
    # /completions' legacy shape
    assert parse_logprobs({"tokens": ["token_id:5"], "token_logprobs": [-0.25]}) == ([-0.25], [5])
    assert parse_logprobs(None) == ([], []) and parse_logprobs({"content": None}) == ([], [])
    assert finish_reason("length") == "length" and finish_reason("stop") == "stop"
    assert finish_reason("tool_calls") == "tool_calls"


def test_retry_after_reads_seconds_and_http_dates():
    assert retry_after_s({"retry-after": "2.5"}) == 2.5
    assert retry_after_s({}) is None and retry_after_s({"retry-after": "soon"}) is None
    assert retry_after_s({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}) == 0.0   # in the past
