"""Playing experts through the gRPC API, many sessions in lockstep.

Each round reads every live session's ground truth, asks its expert for the turn's actions, writes
the answer in the session's format (forking a session first where the format predicts the next
state), and steps all sessions in one batch. A finished session is reset to the next seed.
"""
from __future__ import annotations

import random
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

from envserve.v1 import envserve_pb2 as pb

from ..errors import check
from .answers import answer_text, meta_tag, needs_prediction, plain_answer
from .base import Expert, Move, Truth, session_settings


@dataclass
class ExpertTurn:
    """One turn: what the agent saw, the truth the expert read, its move, the answer sent, the result."""
    turn: int
    observation: str
    truth: Truth
    move: Move
    answer: str
    result: pb.StepResult
    state_anchor: str          # the anchor of the state acted in
    truth_next: Truth | None = None   # the forked look ahead, where the format predicts


@dataclass
class ExpertEpisode:
    env_id: str
    seed: int
    split: str
    action_format: str
    config: dict[str, Any]
    expert: str
    system_prompt: str
    first: pb.StepResult               # the reset's result: the first observation
    session_id: str = ""               # closed when play_expert returns; open during on_episode
    turns: list[ExpertTurn] = field(default_factory=list)
    turn_limited: bool = False         # max_turns ended it before the env did
    detour: list[str] = field(default_factory=list)   # random moves played before `first`, unrecorded

    @property
    def success(self) -> bool:
        return bool(self.turns) and self.turns[-1].result.success

    @property
    def score(self) -> float:
        return float(sum(t.result.reward for t in self.turns))

    @property
    def guesses(self) -> int:
        return sum(1 for t in self.turns if t.move.guessed)

    @property
    def invalid_turns(self) -> int:
        return sum(1 for t in self.turns if not t.result.action_valid)


@dataclass
class _Live:
    session_id: str
    expert: Expert
    episode: ExpertEpisode
    last: pb.StepResult


def expert_for(env_id: str) -> type[Expert]:
    from . import EXPERTS
    try:
        return EXPERTS[env_id]
    except KeyError:
        raise ValueError(f"no expert for env {env_id!r}; experts exist for {sorted(EXPERTS)}") from None


def _each(fn: Callable, items: Sequence, threads: int) -> list:
    """fn over items, concurrently: Fork and GetState are one RPC per session, and a round trip
    each in turn would dominate a batch's time."""
    if threads <= 1 or len(items) <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(min(threads, len(items))) as pool:
        return list(pool.map(fn, items))


def look_ahead(client, moves: Sequence[tuple[str, Sequence[str]]], action_format: str, separator: str,
               threads: int = 8) -> list[Truth]:
    """The true state after each session's actions, without stepping the sessions: fork each, step
    the forks in one batch, read their truth, close them. Works for every env (snapshot or replay
    forks); `moves` are (session id, actions)."""
    forks = _each(lambda m: client.fork(m[0], 1)[0], moves, threads)
    try:
        for r in client.step([(f, plain_answer(action_format, acts, separator)) for f, (_, acts) in zip(forks, moves)]):
            check(r)
        return _each(lambda f: Truth.from_response(client.get_state(f, -1)), forks, threads)
    finally:
        client.close_sessions(forks)


def check_detour(detour: int, detour_actions: Sequence[str]) -> None:
    if detour < 0 or (detour and not detour_actions):
        raise ValueError("detour must be >= 0, and a detour needs detour_actions to draw its moves from")


def play_expert(client, env_id: str, seeds: Iterable[int], action_format: str = "",
                config: Mapping[str, Any] | None = None, split: str = "",
                expert: "type[Expert] | None" = None, batch_size: int = 16, max_turns: int = 0,
                on_episode: Callable[[ExpertEpisode], None] | None = None, threads: int = 8,
                detour: int = 0, detour_actions: Sequence[str] = ()) -> list[ExpertEpisode]:
    """Plays `expert` (default: the env's) on each seed and returns the episodes in seed order.

    client: an EnvClient or RoutedClient. config: the session config (the expert's required keys,
    e.g. ALFWorld's `expert: true`, are added). max_turns > 0 ends an episode after that many turns
    (a trainer's own limit), else the env's limit does. on_episode sees each episode as it ends, so a
    caller can write it out before the rest finish. A failed item raises its EnvServeError.

    detour > 0: before the expert takes over, each episode plays up to that many random moves from
    `detour_actions` (how many and which drawn from its seed), and is recorded from there. An
    expert's path from the reset repeats itself; a policy imitating it can follow the path without
    reading the observation. Starting from varied states, the answers differ where the states do. A
    detour move that would end the episode is cut, with the moves after it: the episode starts where
    the moves before it lead (`ExpertEpisode.detour` lists the moves played)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    check_detour(detour, detour_actions)
    cls = expert or expert_for(env_id)
    spec = client.get_spec(env_id)
    action_format = action_format or spec.default_action_format
    opened_config = {**dict(config or {}), **dict(cls.session_config)}
    settings = session_settings(spec, opened_config)
    separator, limit = str(settings["action_separator"]), int(settings["max_actions_per_turn"])
    predict = needs_prediction(action_format)
    todo = deque(enumerate(int(s) for s in seeds))
    if not todo:
        return []
    opened = client.open_sessions(env_id, min(batch_size, len(todo)), opened_config, action_format)
    sessions, prompt = list(opened.session_ids), opened.system_prompt
    done: dict[int, ExpertEpisode] = {}
    live: dict[str, tuple[int, _Live]] = {}

    def reset(pairs: list[tuple[str, tuple[int, int]]]) -> list[pb.StepResult]:
        results = client.reset([sid for sid, _ in pairs], [seed for _, (_, seed) in pairs], split=split)
        for r in results:
            check(r)
        return results

    def wander(pairs: list[tuple[str, tuple[int, int]]], firsts: list[pb.StepResult]) -> list[list[str]]:
        """Each session's detour, played in batches. A move that ends the episode is cut from it: the
        session is reset and the moves before it are played again (same seed, same states)."""
        plans = []
        for _, (_, seed) in pairs:
            rng = random.Random(f"detour:{seed}")
            plans.append([rng.choice(list(detour_actions)) for _ in range(rng.randint(0, detour))])

        def move(i: int, k: int) -> tuple[str, str]:
            return pairs[i][0], plain_answer(action_format, [plans[i][k]], separator)

        for k in range(detour):
            moving = [i for i, plan in enumerate(plans) if len(plan) > k]
            if not moving:
                break
            ended = []
            for i, r in zip(moving, client.step([move(i, k) for i in moving])):
                firsts[i] = check(r)
                if r.done or r.truncated:
                    ended.append(i)
            if ended:
                for i, r in zip(ended, reset([pairs[i] for i in ended])):
                    firsts[i], plans[i] = r, plans[i][:k]
                for j in range(k):
                    again = [i for i in ended if len(plans[i]) > j]
                    for i, r in zip(again, client.step([move(i, j) for i in again])):
                        firsts[i] = check(r)
        return plans

    def start(pairs: list[tuple[str, tuple[int, int]]]) -> None:
        results = reset(pairs)
        plans = wander(pairs, results) if detour else [[] for _ in pairs]
        for (sid, (index, seed)), r, plan in zip(pairs, results, plans):
            ep = ExpertEpisode(env_id, seed, split, action_format, opened_config, cls.__name__, prompt, r, sid,
                               detour=plan)
            live[sid] = (index, _Live(sid, cls(settings), ep, r))

    try:
        start([(sid, todo.popleft()) for sid in sessions])
        while live:
            runs = [run for _, run in live.values()]
            truths = _each(lambda run: Truth.from_response(client.get_state(run.session_id, -1)), runs, threads)
            moves = [(run, truth, run.expert.act(truth, limit)) for run, truth in zip(runs, truths)]
            ahead = look_ahead(client, [(run.session_id, move.actions) for run, _, move in moves], action_format,
                               separator, threads) if predict else [None] * len(moves)
            batch, pending = [], []
            for (run, truth, move), nxt in zip(moves, ahead):
                text = answer_text(action_format, move.actions, truth, nxt, reasoning=move.reasoning,
                                   tag=meta_tag(move, truth.turn == 0), separator=separator,
                                   describe=run.expert.describe)
                batch.append((run.session_id, text))
                pending.append((run, truth, move, text, nxt))
            results = client.step(batch)
            restart = []
            for (run, truth, move, text, nxt), r in zip(pending, results):
                check(r)
                ep = run.episode
                ep.turns.append(ExpertTurn(run.last.turn, run.last.observation.text, truth, move, text, r,
                                           run.last.anchor, nxt))
                run.last = r
                ep.turn_limited = bool(max_turns and len(ep.turns) >= max_turns and not (r.done or r.truncated))
                if r.done or r.truncated or ep.turn_limited:
                    index, _ = live.pop(run.session_id)
                    done[index] = ep
                    if on_episode is not None:
                        on_episode(ep)
                    if todo:
                        restart.append((run.session_id, todo.popleft()))
            if restart:
                start(restart)
    except BaseException:
        try:
            client.close_sessions(sessions)
        except Exception:  # noqa: BLE001 - best effort (leases expire): the first error is the one to see
            pass
        raise
    client.close_sessions(sessions)
    return [done[i] for i in sorted(done)]
