"""The OpenAI-compatible backend: a policy behind an HTTP endpoint (vLLM, SGLang, TGI,
`transformers serve`, a hosted API), for evaluation.

One chat completion per prompt (POST {base_url}/chat/completions), at most `max_concurrency` in
flight. Each request asks for `logprobs` (when `logprobs` is set) and carries its row's seed, derived
from the call's seed exactly as the hf backend derives it (hf.row_seed), so a seeded evaluation asks
the endpoint for the same draws every time. Servers differ in what they return:

- text and finish_reason: every server.
- per-token log-probabilities: servers that implement `logprobs` (vLLM, SGLang, OpenAI);
  `transformers serve` ignores the field, and the list stays empty.
- token ids: only where the server reports them, as vLLM does when asked through `extra_body`
  ({"return_token_ids": true} gives `token_ids` and `prompt_token_ids`; {"return_tokens_as_token_ids":
  true} spells each logprob token "token_id:N"). Otherwise the lists stay empty: the text is what an
  evaluation scores, and a training update needs the hf or vllm backend's exact ids anyway.

Retried, up to `max_retries` times: connect errors, timeouts, 408, 409, 429 and 5xx, after the
server's Retry-After when it sends one (and it is within `backoff_max_s`), else after an exponential
backoff with jitter (base * 2^n capped at backoff_max_s, drawn from [d/2, d]). Other 4xx fail at
once with the server's message: asking again will not fix a wrong model name or key. The retry loop
is envserve.client.http_retry, shared with the LLM judge.

The HTTP client lives on a private event loop in a background thread, so `generate` works from plain
code and from inside someone else's event loop alike (`agenerate` awaits the same work without
blocking that loop).
"""
from __future__ import annotations

import asyncio
import os
import random
import re
import secrets
import threading
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

# retry_after_s: re-exported, part of this module's tested surface before the loop moved to common.
from envserve.client.http_retry import Counters, RetryPolicy, post_with_retries, retry_after_s  # noqa: F401

from ..config.checks import FromMapping
from .base import FINISH_LENGTH, FINISH_STOP, Generation, Message, Weights
from .hf import row_seed

_TOKEN_ID = re.compile(r"^token_id:(-?\d+)$")
# finish_reason values that mean the model ended its turn, and those that mean the budget ran out.
_STOP_REASONS = frozenset({"stop", "eos", "end_turn", "stop_sequence"})
_LENGTH_REASONS = frozenset({"length", "max_tokens"})


class EndpointError(RuntimeError):
    """The endpoint could not give a completion: `status` is the last HTTP status (None for a
    transport error), `attempts` how many requests were made."""

    def __init__(self, message: str, status: int | None = None, attempts: int = 1):
        super().__init__(message)
        self.status = status
        self.attempts = attempts


@dataclass(frozen=True)
class OpenAIPolicyConfig(FromMapping):
    # The API root, the part before /chat/completions (e.g. http://127.0.0.1:8000/v1).
    base_url: str = ""
    # The model name the endpoint serves.
    model: str = ""
    # Name of the environment variable holding the API key (the key itself stays out of configs);
    # no Authorization header when the variable is unset or empty.
    api_key_env: str = "OPENAI_API_KEY"
    # Seconds per HTTP attempt.
    timeout_s: float = 120.0
    # Requests in flight at once; servers batch concurrent requests themselves.
    max_concurrency: int = 8
    max_retries: int = 4
    backoff_base_s: float = 0.5
    backoff_max_s: float = 30.0
    # Ask for per-token log-probabilities of the sampled tokens.
    logprobs: bool = True
    # Send each row's seed (off for endpoints that refuse the field).
    send_seed: bool = True
    # Extra request fields, merged into every body (server-specific switches such as vLLM's
    # return_token_ids); they may not override the fields this backend sets.
    extra_body: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be an http(s) URL such as http://127.0.0.1:8000/v1, got {self.base_url!r}")
        if not self.model:
            raise ValueError("model must name the model the endpoint serves")
        if self.timeout_s <= 0 or self.max_concurrency < 1 or self.max_retries < 0:
            raise ValueError("timeout_s must be > 0, max_concurrency >= 1 and max_retries >= 0")
        if self.backoff_base_s < 0 or self.backoff_max_s < self.backoff_base_s:
            raise ValueError("need 0 <= backoff_base_s <= backoff_max_s")
        if not isinstance(self.extra_body, Mapping):
            raise ValueError(f"extra_body must be a mapping, got {type(self.extra_body).__name__}")
        clash = sorted(set(self.extra_body) & _OWN_FIELDS)
        if clash:
            raise ValueError(f"extra_body may not set {clash}: the policy sets them from each call")


_OWN_FIELDS = frozenset({"model", "messages", "prompt", "max_tokens", "temperature", "top_p", "seed", "logprobs",
                         "stream", "n"})


def finish_reason(value: Any) -> str:
    """The endpoint's finish_reason in this package's terms ("stop", "length"); others as given."""
    if value in _STOP_REASONS:
        return FINISH_STOP
    if value in _LENGTH_REASONS:
        return FINISH_LENGTH
    return str(value) if value is not None else FINISH_STOP


def parse_logprobs(logprobs: Any) -> tuple[list[float], list[int]]:
    """(log-probabilities, token ids) from a choice's `logprobs`, chat form ({"content": [{"token",
    "logprob"}...]}) or legacy completions form ({"tokens": [...], "token_logprobs": [...]}). The ids
    are read only where every token is spelled "token_id:N" (vLLM's return_tokens_as_token_ids), else
    they are empty."""
    if not isinstance(logprobs, Mapping):
        return [], []
    if isinstance(logprobs.get("content"), list):
        entries = logprobs["content"]
        tokens = [e.get("token") for e in entries]
        values = [e.get("logprob") for e in entries]
    elif isinstance(logprobs.get("token_logprobs"), list):
        tokens = list(logprobs.get("tokens") or [])
        values = logprobs["token_logprobs"]
    else:
        return [], []
    if any(v is None for v in values):
        return [], []
    matches = [_TOKEN_ID.match(t) if isinstance(t, str) else None for t in tokens]
    ids = [int(m.group(1)) for m in matches] if matches and all(matches) and len(matches) == len(values) else []
    return [float(v) for v in values], ids


def _int_list(value: Any) -> list[int] | None:
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return list(value)
    return None


class OpenAIPolicy:
    """Policy over an OpenAI-compatible endpoint. Not for training: it cannot load new weights."""

    def __init__(self, config: OpenAIPolicyConfig | Mapping[str, Any], *, rng: random.Random | None = None):
        import httpx   # the envserve `judge` extra; imported here so the module loads without it
        self._httpx = httpx
        self.config = config if isinstance(config, OpenAIPolicyConfig) else OpenAIPolicyConfig.from_mapping(config)
        root = self.config.base_url.rstrip("/")
        self.chat_url, self.completions_url = f"{root}/chat/completions", f"{root}/completions"
        key = os.environ.get(self.config.api_key_env, "") if self.config.api_key_env else ""
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._rng = rng or random.Random()   # backoff jitter only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._client = None
        self._slots: asyncio.Semaphore | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._requests = Counters()
        self._stats = {"completions": 0, "failures": 0}

    # -- the private loop ----------------------------------------------------------------------------
    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._closed:
                raise RuntimeError("this policy is closed")
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name="openai-policy", daemon=True)
                thread.start()
                self._loop, self._thread = loop, thread
            return self._loop

    def _submit(self, url: str, bodies: list[dict[str, Any]], prompt_ids: list[list[int]]):
        loop = self._ensure_loop()   # first: a closed policy raises before any coroutine exists
        return asyncio.run_coroutine_threadsafe(self._run(url, bodies, prompt_ids), loop)

    def stats(self) -> dict[str, int]:
        r = self._requests
        return dict(self._stats, requests=r.requests, retries=r.retries, peak_in_flight=r.peak_in_flight,
                    in_flight=r.in_flight)

    # -- Policy ----------------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[Message]], max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, seed: int | None = None) -> list[Generation]:
        """One chat completion per prompt, in order; temperature <= 0 asks for greedy decoding."""
        bodies = self._bodies(prompts, None, max_new_tokens, temperature, top_p, seed)
        return self._submit(self.chat_url, bodies, [[] for _ in bodies]).result()

    async def agenerate(self, prompts: Sequence[Sequence[Message]], max_new_tokens: int, temperature: float = 1.0,
                        top_p: float = 1.0, seed: int | None = None) -> list[Generation]:
        """generate for async callers: the caller's loop keeps running while the requests are out."""
        bodies = self._bodies(prompts, None, max_new_tokens, temperature, top_p, seed)
        return await asyncio.wrap_future(self._submit(self.chat_url, bodies, [[] for _ in bodies]))

    def generate_from_ids(self, prompt_ids: Sequence[Sequence[int]], max_new_tokens: int, temperature: float = 1.0,
                          top_p: float = 1.0, seed: int | None = None,
                          row_seeds: Sequence[int] | None = None) -> list[Generation]:
        """Completions of token-id prompts through /completions, which takes a list of ids as the
        prompt on servers that accept that (vLLM, SGLang); others refuse it with a 4xx, raised.
        `row_seeds` seeds each row (the rollout's per-turn seeds)."""
        if any(len(p) == 0 for p in prompt_ids):
            raise ValueError("every prompt needs at least one token")
        if row_seeds is not None and len(row_seeds) != len(prompt_ids):
            raise ValueError(f"{len(prompt_ids)} prompts but {len(row_seeds)} row seeds")
        bodies = self._bodies(None, prompt_ids, max_new_tokens, temperature, top_p, seed)
        for body, s in zip(bodies, row_seeds or ()):
            body["_row_seed"] = int(s)
            if self.config.send_seed:
                body["seed"] = int(s)
        known = [[int(t) for t in p] for p in prompt_ids]
        return self._submit(self.completions_url, bodies, known).result()

    def update_weights(self, weights: Weights) -> None:
        raise NotImplementedError(
            "the openai backend samples from a model an endpoint serves and cannot load weights into it; "
            "serve the trained checkpoint (e.g. `vllm serve PATH`) and point base_url at it, or train "
            "with the hf or vllm backend")

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            loop, thread = self._loop, self._thread
        if loop is not None:
            if self._client is not None:
                asyncio.run_coroutine_threadsafe(self._client.aclose(), loop).result()
            loop.call_soon_threadsafe(loop.stop)
            thread.join()
            loop.close()

    def __enter__(self) -> "OpenAIPolicy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- requests --------------------------------------------------------------------------------------
    def _bodies(self, prompts, prompt_ids, max_new_tokens: int, temperature: float, top_p: float,
                seed: int | None) -> list[dict[str, Any]]:
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        items = prompts if prompts is not None else prompt_ids
        base_seed = secrets.randbits(63) if seed is None else int(seed)
        bodies = []
        for i, item in enumerate(items):
            body: dict[str, Any] = dict(self.config.extra_body)
            body.update(model=self.config.model, max_tokens=max_new_tokens,
                        temperature=max(0.0, float(temperature)), top_p=float(top_p))
            if prompts is not None:
                body["messages"] = [dict(m) for m in item]
                if self.config.logprobs:
                    body["logprobs"] = True
            else:
                body["prompt"] = [int(t) for t in item]
                if self.config.logprobs:
                    body["logprobs"] = 1   # the legacy API counts alternatives; 0 or 1 gives the sampled token's
            body["_row_seed"] = row_seed(base_seed, i)
            if self.config.send_seed:
                body["seed"] = body["_row_seed"]
            bodies.append(body)
        return bodies

    def _controls(self):
        if self._client is None:
            httpx = self._httpx
            self._slots = asyncio.Semaphore(self.config.max_concurrency)
            self._client = httpx.AsyncClient(timeout=self.config.timeout_s, headers=self._headers,
                                             limits=httpx.Limits(max_connections=self.config.max_concurrency))
        return self._slots, self._client

    async def _run(self, url: str, bodies: list[dict[str, Any]], prompt_ids: list[list[int]]) -> list[Generation]:
        tasks = [asyncio.ensure_future(self._one(url, body, ids)) for body, ids in zip(bodies, prompt_ids)]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for t in tasks:      # one row failed: the others' requests are not worth waiting for
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def _one(self, url: str, body: dict[str, Any], prompt_ids: list[int]) -> Generation:
        seed = body.pop("_row_seed")
        data, attempts = await self._post(url, body)
        return self._generation(url, data, prompt_ids, seed, attempts)

    async def _post(self, url: str, body: Mapping[str, Any]) -> tuple[Any, int]:
        """The decoded JSON of a 200 answer, with the number of attempts it took."""
        slots, client = self._controls()
        c = self.config
        outcome = await post_with_retries(client, url, body, RetryPolicy(c.max_retries, c.backoff_base_s, c.backoff_max_s),
                                          slots=slots, counters=self._requests, rng=self._rng, detail_chars=300)
        if outcome.response is not None:
            try:
                return outcome.response.json(), outcome.attempts
            except ValueError:
                self._stats["failures"] += 1
                raise EndpointError(f"{url} answered 200 with a body that is not JSON: "
                                    f"{outcome.response.text[:200]!r}", outcome.status, outcome.attempts) from None
        self._stats["failures"] += 1
        if outcome.refused:
            raise EndpointError(f"{url} refused the request: {outcome.last}", outcome.status, outcome.attempts)
        raise EndpointError(f"{url} gave no completion after {outcome.attempts} attempt(s): {outcome.last}",
                            outcome.status, outcome.attempts)

    def _generation(self, url: str, data: Any, prompt_ids: list[int], seed: int, attempts: int) -> Generation:
        try:
            choice = data["choices"][0]
            text = choice["message"].get("content") if "message" in choice else choice["text"]
        except (KeyError, IndexError, TypeError, AttributeError):
            self._stats["failures"] += 1
            raise EndpointError(f"{url} answered 200 without a completion: {str(data)[:200]!r}", 200,
                                attempts) from None
        self._stats["completions"] += 1
        logprobs, ids = parse_logprobs(choice.get("logprobs"))
        # vLLM's return_token_ids puts the ids on the choice and the prompt's beside the choices.
        ids = _int_list(choice.get("token_ids")) or ids
        prompt = (prompt_ids or _int_list(data.get("prompt_token_ids")) or _int_list(choice.get("prompt_token_ids"))
                  or [])
        usage = data.get("usage") if isinstance(data.get("usage"), Mapping) else {}
        extra: dict[str, Any] = {"seed": seed, "attempts": attempts,
                                 "endpoint_finish_reason": choice.get("finish_reason")}
        for key in ("prompt_tokens", "completion_tokens"):
            if usage.get(key) is not None:
                extra[key] = usage[key]
        return Generation(text=str(text or ""), prompt_token_ids=list(prompt), completion_token_ids=ids,
                          completion_logprobs=logprobs, finish_reason=finish_reason(choice.get("finish_reason")),
                          extra=extra)
