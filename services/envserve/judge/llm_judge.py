"""The LLM judge: asks a judge model behind an OpenAI-compatible endpoint (vLLM, SGLang, TGI,
`transformers serve`, a hosted API) whether an agent's text agrees with the true state.

Modes (LLMJudgeConfig.mode):
- "yesno": the env's yes/no prompt (prompts.yesno_prompt); the verdict is the last
  <answer>YES|NO</answer> of the reply, the score 1.0 or 0.0.
- "structured": the model transcribes the text into relation atoms (prompts.structured_prompt),
  which the rule judge scores by F1 against the truth (RuleJudge.score_claims). Envs without a
  claim vocabulary (ALFWorld, ScienceWorld, SVG...) are asked the generic yes/no question instead.

A reply the judge cannot read (no answer tag, malformed JSON) is a Judgment with score 0 and the
reason, not an exception: the agent's reward must not depend on whether the judge model behaved,
and `stats()["parse_failures"]` shows how often it did not. Only an endpoint that cannot be used
(unreachable or throttling after the retries, a 4xx such as a wrong model name) raises JudgeError.

Traffic control, in order for each HTTP attempt: at most `max_concurrency` requests in flight; a
token bucket holding one token that refills at `requests_per_second` (so attempts start at least
1/rps apart, retries included); `timeout_s` per attempt. Retried, up to `max_retries` times: connect
errors, timeouts, 408, 409, 429 and 5xx, after Retry-After when the endpoint sends one, else after
an exponential backoff with jitter (base * 2^n, capped, drawn from [d/2, d]). Other 4xx are not
retried: asking again will not fix a bad request or a wrong key. The retry loop is
envserve.client.http_retry (tenacity underneath), the one the trainer's OpenAI-compatible backend
uses too.

No client-side micro-batching. The chat-completions API takes one conversation per request, and the
servers a judge model runs on batch concurrent requests on the accelerator themselves (continuous
batching), so holding items back for a batch window would add latency and no throughput; the
throughput knob is `max_concurrency`. (/v1/completions with a list of prompts is not portable:
`transformers serve` refuses it, and it would bypass the model's chat template.)

Results are cached (LRU) by judge mode, model, prompt family, field, the truth's anchor (or the
canonical JSON of its state and relations where it has none), the previous turn's for world
modelling, and the exact text; concurrent identical requests share one call (single-flight). Both a
cache hit and a shared call come back with `cached=True`.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
import random
import re
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Mapping

import httpx

from envserve.client.http_retry import Counters, RetryPolicy, post_with_retries

from .base import JudgeError, JudgeInput, Judgment

from .config import JudgeConfig, Settings
from .prompts import Prompt, claim_family, claims_from_atoms, judge_prompt, prompt_family
from .rule_judge import FIELDS, WORLD_MODELING, RuleJudge, _truth_parts

YESNO, STRUCTURED = "yesno", "structured"
MODES = (YESNO, STRUCTURED)
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Kept in a Judgment's details and reasoning: enough to see what the model said, bounded.
_REPLY_CHARS = 2000


@dataclass(frozen=True)
class LLMJudgeConfig(Settings):
    WHAT = "LLM judge config"
    base_url: str = "http://127.0.0.1:8000/v1"   # OpenAI-compatible root; /chat/completions is appended
    model: str = ""
    # Name of the environment variable holding the API key ('' = send no Authorization header). The
    # key itself never goes into a config, where it would be logged and committed.
    api_key_env: str = ""
    mode: str = YESNO
    temperature: float = 0.0
    max_tokens: int = 512
    timeout_s: float = 60.0                      # per HTTP attempt
    max_concurrency: int = 8                     # HTTP requests in flight
    requests_per_second: float = 0.0             # 0 = unlimited
    max_retries: int = 4
    backoff_base_s: float = 0.5
    # Longest wait between attempts. A Retry-After longer than this ends the retries at once
    # (asking sooner than the endpoint allows only burns an attempt).
    backoff_max_s: float = 30.0
    cache_size: int = 4096                       # judgments kept; 0 = no cache

    def __post_init__(self) -> None:
        if not re.match(r"https?://[^/\s]+", self.base_url):
            raise ValueError(f"base_url must be an http(s) URL, got {self.base_url!r}")
        if not self.model:
            raise ValueError("model must name the judge model")
        if self.api_key_env and not _ENV_NAME.fullmatch(self.api_key_env):
            raise ValueError("api_key_env must be the NAME of an environment variable holding the key")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.temperature < 0 or self.max_tokens < 1 or self.timeout_s <= 0:
            raise ValueError("temperature >= 0, max_tokens >= 1 and timeout_s > 0")
        if self.max_concurrency < 1 or self.requests_per_second < 0 or self.max_retries < 0:
            raise ValueError("max_concurrency >= 1, requests_per_second >= 0 and max_retries >= 0")
        if self.backoff_base_s < 0 or self.backoff_max_s < self.backoff_base_s or self.cache_size < 0:
            raise ValueError("0 <= backoff_base_s <= backoff_max_s and cache_size >= 0")


# -- replies ------------------------------------------------------------------------------------------
_ANSWER = re.compile(r"<\s*answer\s*>(.*?)<\s*/\s*answer\s*>", re.IGNORECASE | re.DOTALL)


def parse_answer(reply: str | None) -> tuple[bool | None, str]:
    """(True for YES, False for NO, None when unreadable; why) from the LAST <answer> tag. Case,
    whitespace and wrapping punctuation ('**Yes.**') are tolerated; anything else is unreadable."""
    found = _ANSWER.findall(reply or "")
    if not found:
        return None, "the reply has no <answer>...</answer>"
    word = found[-1].strip().strip("*_`'\".!: \t\r\n").lower()
    if word in ("yes", "no"):
        return word == "yes", f"the last of {len(found)} answer tag(s) says {word.upper()}"
    return None, f"the last answer tag holds {found[-1].strip()[:80]!r}, not YES or NO"


_FENCE = re.compile(r"```[a-zA-Z0-9_-]*\s*(.*?)```", re.DOTALL)


def extract_atoms(reply: str | None) -> list[Any]:
    """The JSON list of atoms in a reply: bare, in a code fence, or amid prose; an object holding the
    list under one key ({"atoms": [...]}) or a single atom is accepted too. ValueError when none."""
    text = reply or ""
    candidates = [m.strip() for m in _FENCE.findall(text)] + [text.strip()]
    start, end = text.find("["), text.rfind("]")
    if 0 <= start < end:
        candidates.append(text[start:end + 1])
    start, end = text.find("{"), text.rfind("}")
    if 0 <= start < end:
        candidates.append(text[start:end + 1])
    for cand in candidates:
        try:
            data = json.loads(cand)
        except ValueError:
            continue
        if isinstance(data, list):
            return data
        if isinstance(data, dict):
            lists = [v for v in data.values() if isinstance(v, list)]
            if len(lists) == 1 and "subject" not in data:
                return lists[0]
            if "subject" in data:
                return [data]
    raise ValueError("the reply holds no JSON list of atoms")


# -- cache keys ---------------------------------------------------------------------------------------
def truth_id(record: Any) -> str:
    """What identifies a GetState record: its anchor (the env's state key), else the canonical JSON
    of its state and relations."""
    if record is None:
        return ""
    anchor = record.get("anchor") if isinstance(record, Mapping) else getattr(record, "anchor", "")
    if anchor:
        return f"anchor:{anchor}"
    state, relations = _truth_parts(record)
    blob = json.dumps([state, relations], sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return "json:" + hashlib.sha256(blob.encode()).hexdigest()


def cache_key(mode: str, model: str, family: str, item: JudgeInput) -> str:
    previous = truth_id(item.previous) if item.field == WORLD_MODELING else ""
    parts = [mode, model, family, item.field, truth_id(item.truth), previous, item.text]
    return hashlib.sha256(json.dumps(parts, ensure_ascii=False).encode()).hexdigest()


# -- traffic control ------------------------------------------------------------------------------------
class _TokenBucket:
    """One token, refilled at `rate` per second: starts are at least 1/rate apart."""

    def __init__(self, rate: float):
        self.rate = rate
        self.tokens = 1.0
        self.stamp = time.monotonic()
        self.lock = asyncio.Lock()

    async def take(self) -> float:
        """Waits for the token; returns the seconds waited."""
        async with self.lock:
            now = time.monotonic()
            self.tokens = min(1.0, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now
            wait = 0.0 if self.tokens >= 1.0 else (1.0 - self.tokens) / self.rate
            if wait:
                await asyncio.sleep(wait)
                self.stamp = time.monotonic()
            self.tokens = 0.0
            return wait


_STATUS_CODE = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "NOT_FOUND",
                413: "INVALID_ARGUMENT", 422: "INVALID_ARGUMENT"}


def request_body(config: LLMJudgeConfig, prompt: Prompt) -> dict[str, Any]:
    """The chat-completions request the judge posts for one prompt."""
    return {"model": config.model, "messages": list(prompt.messages), "temperature": config.temperature,
            "max_tokens": config.max_tokens}


class LLMJudge:
    """The Judge protocol (base.py) over an OpenAI-compatible chat-completions endpoint."""

    def __init__(self, config: LLMJudgeConfig, judge_config: JudgeConfig | None = None, *,
                 rng: random.Random | None = None):
        self.config = config
        self.judge_config = judge_config or JudgeConfig()
        self.name = f"llm:{config.model}"
        self._rule = RuleJudge(self.judge_config)
        self._headers = {"Content-Type": "application/json"}
        if config.api_key_env:
            key = os.environ.get(config.api_key_env)
            if not key:
                raise ValueError(f"environment variable {config.api_key_env} (the judge's API key) is not set")
            self._headers["Authorization"] = f"Bearer {key}"
        self._url = config.base_url.rstrip("/") + "/chat/completions"
        self._rng = rng or random.Random()
        self._client: httpx.AsyncClient | None = None
        # Created on first use, inside the event loop that will use them.
        self._slots: asyncio.Semaphore | None = None
        self._bucket: _TokenBucket | None = None
        self._cache: OrderedDict[str, Judgment] = OrderedDict()
        self._inflight: dict[str, asyncio.Task] = {}
        self._requests = Counters()
        self._stats = {"judged": 0, "completions": 0, "cache_hits": 0, "shared": 0,
                       "parse_failures": 0, "failures": 0, "rate_limit_wait_s": 0.0}

    # -- Judge protocol ---------------------------------------------------------------------------------
    def supports(self, env_id: str, state: Mapping[str, Any] | None = None) -> bool:
        return True   # a prompt exists for every env: its family's, or the generic one

    async def judge(self, item: JudgeInput) -> Judgment:
        if item.field not in FIELDS:
            raise JudgeError("INVALID_ARGUMENT", f"field must be one of {FIELDS}, got {item.field!r}")
        state, _ = _truth_parts(item.truth)
        if not isinstance(state, Mapping):
            raise JudgeError("INVALID_ARGUMENT", "truth must be a GetState record with a state map")
        self._stats["judged"] += 1
        family = prompt_family(item.env_id, state)
        mode = self.config.mode if claim_family(family) else YESNO
        if not (item.text or "").strip():
            return Judgment(0.0, False, f"{item.field}: the agent wrote no text to judge.", self.name,
                            details={"mode": mode, "prompt_family": family})
        key = cache_key(mode, self.config.model, family, item)
        hit = self._cache_get(key)
        if hit is not None:
            self._stats["cache_hits"] += 1
            return dataclasses.replace(hit, cached=True, details=dict(hit.details))
        task = self._inflight.get(key)
        if task is not None:
            self._stats["shared"] += 1
            j = await asyncio.shield(task)
            return dataclasses.replace(j, cached=True, details=dict(j.details))
        task = asyncio.ensure_future(self._evaluate(item, mode))
        self._inflight[key] = task
        task.add_done_callback(lambda t: self._settle(key, t))
        # shield: a caller that gives up does not cancel the call others may be waiting on
        j = await asyncio.shield(task)
        return dataclasses.replace(j, details=dict(j.details))   # the cached one stays as it was

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
        # asyncio primitives belong to one event loop: a judge used again after aclose (another
        # asyncio.run) makes new ones. The cache and stats carry over.
        self._slots = self._bucket = None

    def stats(self) -> dict[str, Any]:
        r = self._requests
        return {**self._stats, "requests": r.requests, "retries": r.retries, "peak_in_flight": r.peak_in_flight,
                "in_flight": r.in_flight, "cache_entries": len(self._cache)}

    # -- cache ------------------------------------------------------------------------------------------
    def _cache_get(self, key: str) -> Judgment | None:
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
        return hit

    def _settle(self, key: str, task: asyncio.Task) -> None:
        self._inflight.pop(key, None)
        if task.cancelled():
            return
        if task.exception() is not None:   # retrieved here, so an unawaited failure logs nothing
            self._stats["failures"] += 1
            return
        if self.config.cache_size:
            self._cache[key] = task.result()
            self._cache.move_to_end(key)
            while len(self._cache) > self.config.cache_size:
                self._cache.popitem(last=False)

    # -- judging ----------------------------------------------------------------------------------------
    async def _evaluate(self, item: JudgeInput, mode: str) -> Judgment:
        try:
            prompt = judge_prompt(mode, item.env_id, item.field, item.text, item.truth, item.previous,
                                  self.judge_config)
        except ValueError as e:
            raise JudgeError("INVALID_ARGUMENT", str(e)) from None
        reply, meta = await self._complete(prompt)
        details = {"mode": mode, "prompt_family": prompt.family, "reply": reply[:_REPLY_CHARS], **meta}
        if mode == STRUCTURED:
            return self._score_structured(item, reply, details)
        verdict, why = parse_answer(reply)
        if verdict is None:
            self._stats["parse_failures"] += 1
            details["parse_error"] = why
            return Judgment(0.0, False, f"{item.field}: the judge's reply could not be read ({why}); scored 0. "
                                        f"Reply: {reply[:300]!r}", self.name, details=details)
        details["answer"] = "YES" if verdict else "NO"
        return Judgment(1.0 if verdict else 0.0, verdict,
                        f"{item.field}: {self.config.model} answered {details['answer']} ({why}). "
                        f"{_ANSWER.sub('', reply).strip()[:_REPLY_CHARS]}", self.name, details=details)

    def _score_structured(self, item: JudgeInput, reply: str, details: dict[str, Any]) -> Judgment:
        try:
            atoms = extract_atoms(reply)
        except ValueError as e:
            self._stats["parse_failures"] += 1
            details["parse_error"] = str(e)
            return Judgment(0.0, False, f"{item.field}: the judge's reading is not valid JSON atoms ({e}); "
                                        f"scored 0. Reply: {reply[:300]!r}", self.name,
                            precision=0.0, recall=0.0, f1=0.0, details=details)
        try:
            r = self._rule.score_claims(item.env_id, lambda lex: claims_from_atoms(atoms, lex), item.truth,
                                        item.field)
        except ValueError as e:
            raise JudgeError("INVALID_ARGUMENT", str(e)) from None
        details.update(atoms=atoms, claims=[str(c) for c in r.claims],
                       wrong=[str(c) for c in r.claims if c not in r.correct],
                       reference=[str(c) for c in r.reference])
        return Judgment(r.f1, r.verdict, f"{self.config.model} read {len(atoms)} atom(s). {r.reasoning}", self.name,
                        precision=r.precision, recall=r.recall, f1=r.f1, details=details)

    # -- HTTP ---------------------------------------------------------------------------------------------
    def _controls(self) -> tuple[asyncio.Semaphore, _TokenBucket | None, httpx.AsyncClient]:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.config.max_concurrency)
            if self.config.requests_per_second > 0:
                self._bucket = _TokenBucket(self.config.requests_per_second)
        if self._client is None:
            self._client = httpx.AsyncClient(
                timeout=self.config.timeout_s, headers=self._headers,
                limits=httpx.Limits(max_connections=self.config.max_concurrency))
        return self._slots, self._bucket, self._client

    async def _complete(self, prompt: Prompt) -> tuple[str, dict[str, Any]]:
        """The reply text of one chat completion, with retries; JudgeError when none comes."""
        body = request_body(self.config, prompt)
        slots, bucket, client = self._controls()

        async def rate_limit() -> None:
            if bucket is not None:
                waited = await bucket.take()   # awaited first: `+= await` would lose concurrent sums
                self._stats["rate_limit_wait_s"] += waited

        c = self.config
        outcome = await post_with_retries(client, self._url, body, RetryPolicy(c.max_retries, c.backoff_base_s,
                                                                               c.backoff_max_s),
                                          slots=slots, counters=self._requests, rng=self._rng, before_send=rate_limit)
        if outcome.response is not None:
            return self._reply(outcome.response, outcome.attempts - 1)
        if outcome.refused:
            raise JudgeError(_STATUS_CODE.get(outcome.status, "FAILED_PRECONDITION"),
                             f"judge endpoint {self._url} refused the request: {outcome.last}")
        code = "RESOURCE_EXHAUSTED" if outcome.status == 429 else "UNAVAILABLE"
        raise JudgeError(code, f"judge endpoint {self._url} failed after {outcome.attempts} attempt(s): {outcome.last}")

    def _reply(self, response: httpx.Response, attempt: int) -> tuple[str, dict[str, Any]]:
        try:
            data = response.json()
            message = data["choices"][0]["message"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise JudgeError("INTERNAL", f"judge endpoint {self._url} answered 200 without a chat completion: "
                                         f"{response.text[:200]!r}") from None
        self._stats["completions"] += 1
        usage = data.get("usage") or {}
        meta = {"attempts": attempt + 1, "finish_reason": data["choices"][0].get("finish_reason")}
        if isinstance(usage, Mapping) and usage.get("prompt_tokens") is not None:
            meta.update(prompt_tokens=usage.get("prompt_tokens"), completion_tokens=usage.get("completion_tokens"))
        # content is null for a refusal or a tool call: an empty reply, which then fails to parse
        return str(message.get("content") or ""), meta
