"""Monte-Carlo values of session states, by Fork or by replay.

The process-reward methods (AgentPRM's Q-hat, RRO's prefix rewards, IPR's step comparisons,
ARPO's branches) need returns of rollouts that start from the exact state of some turn. With
Fork the service copies the state (or, for envs whose state lives in another process, replays it
inside the worker); without it a trainer must open a fresh session, reset it to the task and
replay the recorded prefix before every rollout. Both are here behind one interface, so they can
be compared and checked against each other (a deterministic policy gives the same returns both
ways).

A policy maps the latest StepResults of a batch of rollouts to their next answer texts
(`async def policy(results) -> list[str]`); the rollouts of one state step as one batch per turn.
`chat_policy` wraps any of the trainer's policy backends (HF, vLLM, OpenAI-compatible) that way;
`random_valid_policy` is the cheap one for tests and benches.

Sessions: at most `max_alive` rollout sessions (forks, replay sessions, and the one session a
non-live point is reached in before forking) are open at once; a state whose m exceeds that runs
its rollouts in several Fork calls. Every session an estimate opens is closed before it returns,
also when a step fails, the replica is lost or the caller cancels. A failure (a lost replica, a
refused fork, a step error) fails that state only: its StateValue carries the error and no value.
"""
from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Mapping, Sequence

import grpc

from envserve.client import AsyncEnvClient, EnvServeError, item_error
from envserve.client import messages as pb

from ...config.checks import unit

Policy = Callable[[Sequence[pb.StepResult]], Awaitable[Sequence[str]]]

FORK, REPLAY = "fork", "replay"


@dataclass(frozen=True)
class MCSettings:
    # m = 8 rollouts per state and gamma = 1 (undiscounted success) as in the notes' AgentPRM/RRO runs.
    rollouts_per_state: int = 8      # m: rollouts averaged per state (the budget per state)
    gamma: float = 1.0               # discount of the returns (AgentPRM's Q-hat)
    horizon: int = 0                 # turns per rollout at most; 0: until the episode ends
    max_alive: int = 64              # rollout sessions open at once
    # Replay (and reaching a point without a live session) resets sessions this estimate already
    # opened instead of opening new ones, as a framework without Fork keeps its env pool; False:
    # a fresh session per replayed rollout. Forks are always new sessions (that is what Fork is).
    reuse_sessions: bool = True

    def __post_init__(self) -> None:
        if self.rollouts_per_state < 1:
            raise ValueError(f"rollouts_per_state must be >= 1, got {self.rollouts_per_state}")
        if self.max_alive < 2:
            # 2: a point without a live session needs its own session plus at least one fork.
            raise ValueError(f"max_alive must be >= 2, got {self.max_alive}")
        unit("gamma", self.gamma)
        if self.horizon < 0:
            raise ValueError(f"horizon must be >= 0, got {self.horizon}")


@dataclass(frozen=True)
class StatePoint:
    """A state to estimate: how to reach it again (env, session settings, task seed and split, the
    answers sent since the reset), and a live session in it where there is one.

    session_id "": no live session (a recorded trajectory's earlier turn). Fork then replays the
    prefix once in a session of its own and forks that; replay does what it always does."""
    session_id: str
    env_id: str
    seed: int
    prefix: tuple[str, ...] = ()
    config: Mapping[str, Any] = field(default_factory=dict)
    action_format: str = ""
    # The result that reached this state (what the policy sees first); None: GetState's text.
    last_result: pb.StepResult | None = None
    split: str = ""


@dataclass
class StateValue:
    point: StatePoint
    returns: list[float] = field(default_factory=list)   # one discounted return per finished rollout
    env_steps: int = 0                # steps this estimate cost, prefix replays included
    sessions_opened: int = 0          # sessions newly opened or forked for this state
    error: str = ""                   # why the estimate failed (a lost replica, a refused fork...)

    @property
    def failed(self) -> bool:
        return bool(self.error)

    @property
    def value(self) -> float | None:
        """The mean return: V(s), or Q(s, a) when the rollouts began with a; None if it failed."""
        return sum(self.returns) / len(self.returns) if self.returns and not self.error else None


def discounted(rewards: Sequence[float], gamma: float) -> float:
    total, scale = 0.0, 1.0
    for r in rewards:
        total += scale * r
        scale *= gamma
    return total


def prefix_points(env_id: str, seed: int, actions: Sequence[str], config: Mapping[str, Any] | None = None,
                  action_format: str = "", split: str = "", turns: Sequence[int] | None = None) -> list[StatePoint]:
    """The states of a recorded trajectory (e.g. `[t.action for t in episode.turns]`): the state
    before turn t for each t in `turns` (default: every turn), none of them live."""
    chosen = range(len(actions)) if turns is None else turns
    return [StatePoint("", env_id, seed, tuple(actions[:t]), dict(config or {}), action_format, None, split)
            for t in chosen]


# -- policies --------------------------------------------------------------------------------------
def random_valid_policy(seed: int = 0, fallback: str = "look", wrap: str = "<answer>{}</answer>") -> Policy:
    """Uniform over the env's listed valid actions (the session config's include_valid_actions),
    `fallback` where none are listed. Cheap, so a bench measures the environment."""
    rng = random.Random(seed)

    async def policy(results: Sequence[pb.StepResult]) -> list[str]:
        out = []
        for r in results:
            valid = list(r.info["valid_actions"]) if "valid_actions" in r.info else []
            out.append(wrap.format(rng.choice(valid) if valid else fallback))
        return out
    return policy


def chat_policy(model, system_prompt: str, max_new_tokens: int = 64, temperature: float = 1.0,
                top_p: float = 1.0, seed: int = 0, response_prefix: str = "", response_suffix: str = "") -> Policy:
    """A trainer policy backend (envserve_trainer.policies: generate(chat prompts, ...)) as a rollout
    policy: each rollout's prompt is the system prompt and its current observation (no history:
    the continuation policy of a value estimate, not the training context). Generation runs in a
    thread so the event loop keeps serving other states' steps; each call gets its own seed."""
    calls = [0]

    async def policy(results: Sequence[pb.StepResult]) -> list[str]:
        prompts = [[{"role": "system", "content": system_prompt},
                    {"role": "user", "content": r.observation.text}] for r in results]
        calls[0] += 1
        gens = await asyncio.to_thread(model.generate, prompts, max_new_tokens, temperature, top_p,
                                       seed + calls[0])
        return [response_prefix + g.text + response_suffix for g in gens]
    return policy


# -- the estimate ----------------------------------------------------------------------------------
class _Gate:
    """At most `capacity` sessions open; a state takes all it needs at once (no deadlock between
    states each holding part of what they need)."""

    def __init__(self, capacity: int):
        self.free = capacity
        self._changed = asyncio.Condition()

    async def acquire(self, n: int) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: self.free >= n)
            self.free -= n

    async def release(self, n: int) -> None:
        async with self._changed:
            self.free += n
            self._changed.notify_all()


# What ends one state's estimate instead of the whole call: the service's errors (a lost or
# draining replica, a refused fork, a per-item step error) and a broken channel.
_STATE_FAILURES = (EnvServeError, grpc.RpcError, ConnectionError, EOFError)


def _raise_item_errors(results: Sequence[pb.StepResult], what: str) -> None:
    for r in results:
        err = item_error(r)
        if err is not None:
            raise type(err)(err.code, f"{what} failed for session {r.session_id}: {err.message}", r.session_id)


class _Estimator:
    def __init__(self, client, policy: Policy, settings: MCSettings, by: str):
        self.client, self.policy, self.settings, self.by = client, policy, settings, by
        self.gate = _Gate(settings.max_alive)
        # Sessions to reset and replay in, idle between chunks, by (env, config, format). The gate
        # bounds the sessions in use; idle ones are evicted before anything new opens, so that
        # in use + idle stays within max_alive.
        self.idle: dict[tuple, list[str]] = {}

    @staticmethod
    def _key(point: StatePoint) -> tuple:
        return point.env_id, repr(sorted(dict(point.config).items())), point.action_format

    async def _take(self, point: StatePoint, k: int, out: StateValue) -> list[str]:
        """k sessions for the point's env and settings: idle ones first, then new ones."""
        if not self.settings.reuse_sessions:
            sessions = await self._opening(self.client.open(point.env_id, k, dict(point.config), point.action_format))
            out.sessions_opened += k
            return sessions
        idle = self.idle.setdefault(self._key(point), [])
        sessions = [idle.pop() for _ in range(min(k, len(idle)))]
        need = k - len(sessions)
        if need:
            try:
                await self._make_room()
                sessions += await self._opening(self.client.open(point.env_id, need, dict(point.config),
                                                                 point.action_format))
            except BaseException:
                idle.extend(sessions)
                raise
            out.sessions_opened += need
        return sessions

    async def _make_room(self) -> None:
        """Closes idle sessions until they fit in the gate's free places: in use (at most the
        permits held) + idle then stays within max_alive when new sessions open."""
        evict = []
        for others in self.idle.values():
            while others and sum(map(len, self.idle.values())) > self.gate.free:
                evict.append(others.pop())
        await self._close(evict)

    async def _give_back(self, point: StatePoint, sessions: list[str], healthy: bool) -> None:
        """Idle again after a chunk, or closed: a session that saw an error is not trusted again."""
        if self.settings.reuse_sessions and healthy:
            self.idle.setdefault(self._key(point), []).extend(sessions)
        else:
            await self._close(sessions)

    async def close_idle(self) -> None:
        sessions = [sid for idle in self.idle.values() for sid in idle]
        self.idle.clear()
        await self._close(sessions)

    async def state(self, point: StatePoint, m: int, first_action: str | None) -> StateValue:
        out = StateValue(point)
        reach = self.by == FORK and not point.session_id   # a session of its own to fork from
        # One allotment per state, taken whole: its own session (if any) and up to m rollouts.
        per_call = min(m, self.settings.max_alive - (1 if reach else 0))
        allotment = per_call + (1 if reach else 0)
        await self.gate.acquire(allotment)
        base = ""
        try:
            seen = point.last_result
            if reach:
                [base], [seen] = await self._reach(point, 1, out)
            elif self.by == FORK:
                base = point.session_id
                if seen is None:
                    seen = await self._current(base)
            done = 0
            while done < m:
                k = min(per_call, m - done)
                returns = await (self._fork_chunk(base, seen, k, first_action, out) if self.by == FORK
                                 else self._replay_chunk(point, k, first_action, out))
                out.returns.extend(returns)
                done += k
        except _STATE_FAILURES as e:
            out.error = _describe(e)
        finally:
            if reach and base:
                await self._give_back(point, [base], healthy=not out.error)
            await self.gate.release(allotment)
        return out

    async def _reach(self, point: StatePoint, k: int, out: StateValue) -> tuple[list[str], list[pb.StepResult]]:
        """k sessions in the point's state: reset to its task, its prefix replayed. On failure
        they are closed here (the caller never saw their ids)."""
        sessions = await self._take(point, k, out)
        try:
            latest = await self.client.reset(sessions, seeds=[point.seed] * k, split=point.split)
            _raise_item_errors(latest, "reset")
            for answer in point.prefix:
                latest = await self.client.step([(sid, answer) for sid in sessions])
                out.env_steps += k
                _raise_item_errors(latest, "prefix replay")
        except BaseException:
            await self._give_back(point, sessions, healthy=False)
            raise
        return sessions, latest

    async def _fork_chunk(self, base: str, seen: pb.StepResult, k: int, first_action: str | None,
                          out: StateValue) -> list[float]:
        await self._make_room()
        forks = await self._opening(self.client.fork(base, k))
        out.sessions_opened += len(forks)
        try:
            # A fork's state is its parent's, so the policy first sees what the parent's caller saw.
            first = []
            for sid in forks:
                r = pb.StepResult()
                r.CopyFrom(seen)
                r.session_id = sid
                first.append(r)
            return await self._roll_out(forks, first, first_action, out)
        finally:
            await self._close(forks)

    async def _replay_chunk(self, point: StatePoint, k: int, first_action: str | None, out: StateValue) -> list[float]:
        sessions, latest = await self._reach(point, k, out)
        healthy = False
        try:
            returns = await self._roll_out(sessions, latest, first_action, out)
            healthy = True
            return returns
        finally:
            await self._give_back(point, sessions, healthy)

    async def _roll_out(self, sessions: list[str], first: list[pb.StepResult], first_action: str | None,
                        out: StateValue) -> list[float]:
        """Steps every session to its episode's end (or the horizon) as one batch per turn."""
        horizon = self.settings.horizon
        rewards: list[list[float]] = [[] for _ in sessions]
        latest = list(first)
        live = [i for i, r in enumerate(first) if not (r.done or r.truncated)]
        turn = 0
        while live and (not horizon or turn < horizon):
            if turn == 0 and first_action is not None:
                answers = [first_action] * len(live)
            else:
                answers = list(await self.policy([latest[i] for i in live]))
            results = await self.client.step([(sessions[i], a) for i, a in zip(live, answers)])
            out.env_steps += len(live)
            _raise_item_errors(results, "rollout step")
            still = []
            for i, r in zip(live, results):
                rewards[i].append(r.reward)
                latest[i] = r
                if not (r.done or r.truncated):
                    still.append(i)
            live, turn = still, turn + 1
        return [discounted(rs, self.settings.gamma) for rs in rewards]

    async def _current(self, session_id: str) -> pb.StepResult:
        state = await self.client.get_state(session_id)
        return pb.StepResult(session_id=session_id, turn=state.turn, episode=state.episode,
                             observation=pb.Observation(text=state.observation_text))

    async def _opening(self, call: Awaitable[list[str]]) -> list[str]:
        """An Open or Fork that a cancel does not interrupt: cancelled on our side, the server
        would still create the sessions and we would never learn their ids. On a cancel the call
        finishes in the background and what it opened is closed."""
        opening = _keep(asyncio.ensure_future(call))
        try:
            return await asyncio.shield(opening)
        except asyncio.CancelledError:
            opening.add_done_callback(self._close_when_opened)
            raise

    def _close_when_opened(self, opening: asyncio.Future) -> None:
        if not opening.cancelled() and opening.exception() is None and opening.result():
            _keep(asyncio.ensure_future(self._close(opening.result())))

    async def _close(self, sessions: Sequence[str]) -> None:
        """Closes, even while the caller is being cancelled (shielded), and never raises: a lost
        replica took its sessions with it, and the leases of any others expire."""
        if not sessions:
            return
        closing = _keep(asyncio.ensure_future(self.client.close_sessions(list(sessions))))
        try:
            await asyncio.shield(closing)
        except asyncio.CancelledError:
            raise          # the close goes on in the background; the cancel goes up
        except Exception:  # noqa: BLE001 - see the docstring
            pass


# Background opens and closes that outlive a cancelled caller: held here so they are not
# garbage-collected mid-call (the event loop keeps only weak references to tasks).
_BACKGROUND: set[asyncio.Future] = set()


def _keep(task: asyncio.Future) -> asyncio.Future:
    _BACKGROUND.add(task)

    def done(t: asyncio.Future) -> None:
        _BACKGROUND.discard(t)
        if not t.cancelled():
            t.exception()   # retrieved: a failed background close is not an "unhandled" error
    task.add_done_callback(done)
    return task


def _describe(e: BaseException) -> str:
    if isinstance(e, EnvServeError):
        return str(e)     # "UNAVAILABLE: ...", "DATA_LOSS: session lost: ..."
    if isinstance(e, grpc.RpcError):
        return f"{e.code().name}: {e.details()}"
    return f"{type(e).__name__}: {e}"


async def estimate(client: AsyncEnvClient, points: Sequence[StatePoint], policy: Policy,
                   settings: MCSettings = MCSettings(), *, by: str = FORK,
                   first_actions: Sequence[str | None] | None = None,
                   rollouts: Sequence[int] | None = None) -> list[StateValue]:
    """V(s) of every point (Q(s, a) where first_actions names a: every rollout's first answer),
    from m = settings.rollouts_per_state rollouts each (or rollouts[i] for point i), by Fork or by
    replaying the prefix in fresh sessions. `client`: an AsyncEnvClient or AsyncRoutedClient.

    Returns one StateValue per point, in order; a state that failed has .error set and no value,
    the others are unaffected. Policy exceptions and cancellation propagate, after every session
    this call opened is closed."""
    if by not in (FORK, REPLAY):
        raise ValueError(f"by is {FORK!r} or {REPLAY!r}, got {by!r}")
    firsts = list(first_actions) if first_actions is not None else [None] * len(points)
    ms = list(rollouts) if rollouts is not None else [settings.rollouts_per_state] * len(points)
    if len(firsts) != len(points) or len(ms) != len(points):
        raise ValueError("first_actions and rollouts must have one entry per point")
    if any(m < 1 for m in ms):
        raise ValueError("every point needs at least one rollout")
    est = _Estimator(client, policy, settings, by)
    tasks = [asyncio.ensure_future(est.state(p, m, a)) for p, m, a in zip(points, ms, firsts)]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        # A policy error or a cancel: stop the other states too; each closes its sessions.
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    finally:
        await est.close_idle()
