"""The JudgeService: batches of agent texts in, scores streamed out as each one finishes.

For every item the service reads the ground truth itself through StateService (turn t for
grounding; t and t+1 for world modelling), picks the environment's judge (JudgeSelection), scores,
applies VAGEN's repetition penalty, and streams the result by key. Truth fetches of a batch are done
first and together (GetState takes a millisecond), so the repetition counts see the whole batch
before any item is scored, as in VAGEN; scoring then runs concurrently, bounded service-wide, and a
slow LLM item never holds back a rule item. One item's failure is that item's status only.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, AsyncIterator, Mapping, Protocol

import grpc
from google.protobuf import json_format
from prometheus_client import Counter, Histogram

from envserve.client import state_dict
from envserve.rpc.auth import Authenticator, Denied, owner_of
from envserve.rpc.metrics import MetricsEndpoint
from envserve.rpc.values import code_number, json_text, to_struct
from envserve.v1 import envserve_pb2 as pb
from envserve.v1 import envserve_pb2_grpc as pb_grpc

from .base import Judge, JudgeError, JudgeInput, Judgment
from .config import JudgeConfig
from .repetition import RepetitionPenalty
from .rule_judge import FIELDS, WORLD_MODELING, RuleJudge, truth_turn

log = logging.getLogger("envserve.judge")


class TruthSource(Protocol):
    """Where ground truth comes from: an AsyncEnvClient (one replica) or an AsyncRoutedClient."""

    async def get_state(self, session_id: str, turn: int = -1, episode: int | None = None,
                        trial: int | None = None, on_behalf_of: str | None = None) -> pb.GetStateResponse:
        ...


def record_of(response: pb.GetStateResponse) -> dict[str, Any]:
    """A GetState response as the record dict the judges read."""
    return {"state": state_dict(response), "relations": list(response.relations),
            "anchor": response.anchor, "observation_text": response.observation_text,
            "turn": response.turn, "episode": response.episode, "trial": response.trial,
            "env_id": response.env_id}


class TruthCache:
    """Recent GetState records by (session, trial, episode, turn). The grounding of turn t+1 and the
    world modelling of turn t read the same record; a record never changes once written.

    Bounded by count and by age: the reads that share a record come within seconds of each other,
    so a record unused for `max_age_seconds` is dropped, and a judge's memory levels off within
    minutes at its rate of new turns instead of filling to `size` over hours."""

    def __init__(self, source: TruthSource, size: int = 4096, max_age_seconds: float = 600.0,
                 clock=time.monotonic):
        if size < 1 or max_age_seconds <= 0:
            raise ValueError(f"truth cache needs size >= 1 and max_age_seconds > 0, got {size}, {max_age_seconds}")
        self.source, self.size, self.max_age_seconds, self.clock = source, size, max_age_seconds, clock
        # Least recently used first; each entry is (last use, record).
        self._records: OrderedDict[tuple, tuple[float, dict]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._records)

    async def get(self, session_id: str, turn: int, episode: int | None, trial: int | None,
                  on_behalf_of: str | None = None) -> dict:
        """on_behalf_of: the judge's caller (its token's digest), whose own sessions alone are read
        for it; records are kept per caller, so one caller never reads what another's read cached."""
        now = self.clock()
        self._expire(now)
        key = (session_id, trial, episode, turn, on_behalf_of)
        if trial is not None and trial >= 0 and episode is not None and episode >= 0:
            hit = self._records.get(key)
            if hit is not None:
                self._records[key] = (now, hit[1])
                self._records.move_to_end(key)
                return hit[1]
        state = (await self.source.get_state(session_id, turn, episode, trial, on_behalf_of) if on_behalf_of
                 else await self.source.get_state(session_id, turn, episode, trial))
        record = record_of(state)
        self._records[(session_id, record["trial"], record["episode"], record["turn"], on_behalf_of)] = \
            (self.clock(), record)
        while len(self._records) > self.size:
            self._records.popitem(last=False)
        return record

    def _expire(self, now: float) -> None:
        oldest = now - self.max_age_seconds
        while self._records:
            used, _ = next(iter(self._records.values()))
            if used >= oldest:
                break
            self._records.popitem(last=False)


class JudgeSelection:
    """Which judge scores an environment: an explicit choice (`judge_by_env`, matched on the env id or
    its prefix before '-'/'_'), else the rule judge where it knows the env, else `fallback`."""

    def __init__(self, judges: Mapping[str, Judge], judge_by_env: Mapping[str, str] | None = None,
                 fallback: str = ""):
        self.judges = dict(judges)
        self.judge_by_env = dict(judge_by_env or {})
        self.fallback = fallback
        for env, name in [*self.judge_by_env.items(), ("(fallback)", fallback)]:
            if name and name not in self.judges:
                raise ValueError(f"judge {name!r} for {env} is not configured; configured: {sorted(self.judges)}")

    def choose(self, env_id: str, state: Mapping[str, Any] | None = None) -> Judge:
        name = self.judge_by_env.get(env_id)
        if name is None:
            for prefix, chosen in self.judge_by_env.items():
                if env_id.startswith((prefix + "-", prefix + "_")):
                    name = chosen
                    break
        if name is None:
            rule = self.judges.get("rule")
            if rule is not None and rule.supports(env_id, state):
                name = "rule"
            elif self.fallback:
                name = self.fallback
        if name is None or not self.judges[name].supports(env_id, state):
            raise JudgeError("UNIMPLEMENTED", f"no judge for env {env_id!r}: the rule judge scores sokoban, "
                             "frozenlake, navigation and primitive_skill; configure an LLM judge for others")
        return self.judges[name]


class JudgeMetrics(MetricsEndpoint):
    def __init__(self) -> None:
        super().__init__()
        self.items = Counter("envserve_judge_items_total", "Judged items by judge, field and status code",
                             ["judge", "field", "code"], registry=self.registry)
        self.seconds = Histogram("envserve_judge_seconds", "Time to score one item, truth fetch excluded",
                                 ["judge"], registry=self.registry,
                                 buckets=(0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30))
        self.penalized = Counter("envserve_judge_repetition_penalties_total", "Scores replaced by the penalty",
                                 ["field"], registry=self.registry)


@dataclass
class _Prepared:
    item: pb.JudgeItem
    env_id: str = ""
    judged: JudgeInput | None = None
    truth_turn: int = 0
    anchor: str = ""
    error: pb.JudgeResult | None = None


class JudgeCore:
    """The service's logic without gRPC: prepare (fetch truth), count repetitions, score."""

    def __init__(self, source: TruthSource, selection: JudgeSelection, config: JudgeConfig | None = None,
                 max_concurrent_items: int = 64, metrics: JudgeMetrics | None = None,
                 truth_cache_records: int = 4096, truth_cache_seconds: float = 600.0):
        self.config = config or JudgeConfig()
        self.selection = selection
        self.truth = TruthCache(source, truth_cache_records, truth_cache_seconds)
        self.repetition = RepetitionPenalty(self.config)
        self.limit = asyncio.Semaphore(max_concurrent_items)
        self.metrics = metrics or JudgeMetrics()

    async def prepare(self, item: pb.JudgeItem, on_behalf_of: str | None = None) -> _Prepared:
        p = _Prepared(item)
        if item.field not in FIELDS:
            p.error = _failed(item, "INVALID_ARGUMENT", f"field must be one of {list(FIELDS)}, got {item.field!r}")
            return p
        if not item.session_id:
            p.error = _failed(item, "INVALID_ARGUMENT", "session_id is empty")
            return p
        if item.turn < 0:
            p.error = _failed(item, "INVALID_ARGUMENT", f"turn must be >= 0, got {item.turn}")
            return p
        p.truth_turn = truth_turn(item.field, item.turn)
        episode = item.episode if item.HasField("episode") else None
        trial = item.trial if item.HasField("trial") else None
        try:
            if item.field == WORLD_MODELING:
                previous = await self.truth.get(item.session_id, item.turn, episode, trial, on_behalf_of)
                truth = await self.truth.get(item.session_id, p.truth_turn, previous["episode"], previous["trial"],
                                             on_behalf_of)
            else:
                previous, truth = None, await self.truth.get(item.session_id, p.truth_turn, episode, trial,
                                                             on_behalf_of)
        except Exception as e:  # an EnvServeError carries the replica's status; anything else is UNAVAILABLE
            code = getattr(getattr(e, "code", None), "name", "UNAVAILABLE")
            p.error = _failed(item, code, f"ground truth of turn {p.truth_turn}: {getattr(e, 'message', e)}")
            return p
        p.env_id = truth["env_id"] or item.env_id
        if item.env_id and truth["env_id"] and item.env_id != truth["env_id"]:
            p.error = _failed(item, "INVALID_ARGUMENT",
                              f"item names env {item.env_id!r} but session {item.session_id} is {truth['env_id']!r}")
            return p
        p.anchor = truth["anchor"]
        p.judged = JudgeInput(p.env_id, item.field, item.text, truth, previous)
        return p

    def observe(self, prepared: list[_Prepared]) -> None:
        for p in prepared:
            if p.judged is not None:
                self.repetition.observe(_tracker_key(p), [p.item.text], p.item.scope)

    async def score(self, p: _Prepared) -> pb.JudgeResult:
        if p.error is not None:
            self.metrics.items.labels("", p.item.field, _code_name(p.error)).inc()
            return p.error
        item = p.item
        try:
            judge = self.selection.choose(p.env_id, p.judged.truth.get("state"))
            async with self.limit:
                started = time.perf_counter()
                j: Judgment = await judge.judge(p.judged)
                self.metrics.seconds.labels(judge.name).observe(time.perf_counter() - started)
        except JudgeError as e:
            self.metrics.items.labels("", item.field, e.code).inc()
            return _failed(item, e.code, e.message, p)
        except Exception as e:  # a judge bug fails this item, not the batch
            log.exception("judge failed on %s", item.key)
            self.metrics.items.labels("", item.field, "INTERNAL").inc()
            return _failed(item, "INTERNAL", f"judge failed: {type(e).__name__}: {e}", p)
        if "parse_error" in j.details:  # the judge model misbehaved, not the agent: no penalty on top
            score, penalized = j.score, False
        else:
            score, penalized = self.repetition.apply(_tracker_key(p), item.text, j.score, item.scope)
        if penalized:
            self.metrics.penalized.labels(item.field).inc()
        self.metrics.items.labels(j.judge, item.field, "OK").inc()
        result = pb.JudgeResult(key=item.key, status=pb.ItemStatus(code=0), score=score, verdict=j.verdict,
                                reasoning=j.reasoning, raw_score=j.score, repetition_penalized=penalized,
                                judge=j.judge, cached=j.cached, truth_turn=p.truth_turn, truth_anchor=p.anchor,
                                env_id=p.env_id, field=item.field)
        for name in ("precision", "recall", "f1"):
            value = getattr(j, name)
            if value is not None:
                setattr(result, name, value)
        if penalized:
            result.reasoning += (f" Repetition penalty: this text is among the {self.config.repetition_top_k} "
                                 f"most frequent {item.field} texts and scores below {self.config.f1_threshold:g}, "
                                 f"so it earns {self.config.repetition_penalty:g}.")
        return result

    async def judge_batch(self, items, on_behalf_of: str | None = None) -> AsyncIterator[pb.JudgeResult]:
        """Scores a batch, yielding each result as it finishes. Closing the iterator early (the
        caller went away) cancels what is still being scored. on_behalf_of: the caller's token
        digest, so that only its own sessions' truth is read (see TruthCache.get)."""
        prepared = await asyncio.gather(*(self.prepare(it, on_behalf_of) for it in items))
        self.observe(prepared)
        pending = [asyncio.ensure_future(self.score(p)) for p in prepared]
        try:
            for done in asyncio.as_completed(pending):
                yield await done
        finally:
            for task in pending:
                task.cancel()


def _tracker_key(p: _Prepared) -> str:
    # Counted per env and field: a stock Sokoban sentence says nothing about FrozenLake's.
    return f"{p.env_id}/{p.item.field}"


def _code_name(result: pb.JudgeResult) -> str:
    return next((c.name for c in grpc.StatusCode if c.value[0] == result.status.code), "UNKNOWN")


def _failed(item: pb.JudgeItem, code: str, message: str, p: _Prepared | None = None) -> pb.JudgeResult:
    return pb.JudgeResult(key=item.key, status=pb.ItemStatus(code=code_number(code), message=message),
                          field=item.field, env_id=(p.env_id if p else item.env_id),
                          truth_turn=p.truth_turn if p else 0, truth_anchor=p.anchor if p else "")


class JudgeServicer(pb_grpc.JudgeServiceServicer):
    def __init__(self, core: JudgeCore, auth: Authenticator | None = None):
        self.core = core
        self.auth = auth or Authenticator()

    async def _check(self, context) -> None:
        try:
            self.auth.env_owner(context)
        except Denied as e:
            await context.abort(e.code, e.message)

    async def Judge(self, request, context):
        await self._check(context)
        # A caller that presented a token is judged only on its own sessions: the replica checks
        # that token's ownership as well as the judge's grant (a judge is shared by many teams).
        token = self.auth.bearer(context) if self.auth.enabled else None
        async for result in self.core.judge_batch(request.items, owner_of(token) if token else None):
            yield result

    async def GetJudgeInfo(self, request, context):
        await self._check(context)
        sel = self.core.selection
        return pb.JudgeInfo(judge_by_env=sel.judge_by_env, fallback_judge=sel.fallback,
                            config=to_struct(self.core.config.to_dict()),
                            config_json=json_text(self.core.config.to_dict()),
                            judges=sorted(sel.judges))
