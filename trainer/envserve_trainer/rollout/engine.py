"""Rollouts over envserve's streaming API: groups of K trials per task, LaMer's multi-episode trials.

EnvPool-style and without a per-turn barrier: every session's reset and step goes out on one
Interact stream (one per replica when routed through the directory); whichever results come back
first are batched to the policy while the rest still step. The policy runs in a worker thread, so
results keep arriving during generation; at most one policy call runs at a time (one model).

Each turn samples with a seed derived from (run seed, iteration, task, sample, episode, turn), so a
rollout's completions do not depend on which sessions happened to share a batch.

Routed through the directory, a session whose replica dies, drains or restarts is rebuilt on a live
one by the client (its reset arguments and actions replayed) and its trial goes on. A session whose
reset or step still fails (not rebuildable, a lease expired, one replica only) ends its trial with
the error recorded in `Trial.info["error"]`; the other sessions go on, and the trainer drops failed
trials.
"""
from __future__ import annotations

import asyncio
import hashlib
import inspect
import logging
import re
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Sequence

from envserve.client import sessions_per_table

from ..config.train_config import TrainConfig
from .prompting import ChatLayout, ContextBuilder, reflection_prompt, trajectory_summary
from .trajectory import Episode, Trial, Turn

log = logging.getLogger(__name__)

_REMARK = re.compile(r"<remark>(.*?)(?:</remark>|$)", re.S | re.I)
ACT, REFLECT = "act", "reflect"


def turn_seed(*parts: Any) -> int:
    digest = hashlib.blake2b(":".join(str(p) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def remark_of(text: str) -> str:
    """The <remark> of a reflection (LaMer); the whole text when the tag is missing."""
    m = _REMARK.search(text)
    return (m.group(1) if m else text).strip()


@dataclass(frozen=True)
class Task:
    seed: int
    split: str = ""

    @property
    def group(self) -> str:
        return f"{self.split or 'default'}/{self.seed}"


@dataclass
class _Run:
    """One session playing one trial."""
    session_id: str
    task: Task
    trial: Trial
    builder: ContextBuilder
    seed_base: tuple
    episode: Episode | None = None
    last_observation: str = ""
    last_turn: int = 0
    last_anchor: str = ""
    pending: tuple[list[int], list[int]] | None = None   # (prompt ids, user block) awaiting the policy
    pending_images: list[bytes] = field(default_factory=list)   # the PNGs the pending prompt holds
    last_images: list[bytes] = field(default_factory=list)      # the last observation's PNGs (a VLM's)
    finished: bool = False
    awaiting: str = ""             # "reset" or "step": what the session's next result answers
    memory: list[str] = field(default_factory=list)


def _status_error(result) -> str | None:
    code = result.status.code if result.HasField("status") else 0
    if code == 0:
        return None
    import grpc
    name = next((c.name for c in grpc.StatusCode if c.value[0] == code), str(code))
    return f"{name}: {result.status.message}"


def _components(result) -> dict[str, float]:
    return {k: float(v) for k, v in result.reward_components.items()}


def record_step(episode: Episode, builder: ContextBuilder, result, max_turns: int = 0) -> Turn:
    """A step's result onto the episode's last turn (the one that drove it) and the builder's last
    history entry; marks the episode turn-limited when `max_turns` (0: none) cut it before the env did."""
    turn = episode.turns[-1]
    turn.observation = result.observation.text
    turn.reward = float(result.reward)
    turn.reward_components = _components(result)
    turn.action_valid = bool(result.action_valid)
    turn.parsed_actions = list(result.parsed_actions)
    turn.reasoning = dict(result.reasoning)
    turn.anchor = result.anchor
    turn.transition = result.transition
    turn.done, turn.truncated, turn.success = bool(result.done), bool(result.truncated), bool(result.success)
    turn.feedback = result.feedback
    builder.history[-1].feedback = result.feedback
    if turn.reasoning.get("meta_tag") == "planning":
        builder.plan = turn.reasoning.get("planning", "") or builder.plan
    if not (turn.done or turn.truncated) and max_turns and len(episode.turns) >= max_turns:
        episode.turn_limited = True
    return turn


class RolloutEngine:
    """Collects trials from an envserve client (AsyncEnvClient or AsyncRoutedClient) with a policy."""

    def __init__(self, client, policy, tokenizer, cfg: TrainConfig, seed: int = 0, progress=None):
        self.client = client
        self.policy = policy
        self.cfg = cfg
        self.seed = seed
        # A vision-language policy (policies.vision.HFVisionPolicy) reads each observation's PNGs; a text
        # policy reads the text alone, whatever images the env sends.
        self.codec = getattr(policy, "codec", None)
        self.layout = ChatLayout(tokenizer, self.codec)
        self.tokenizer = tokenizer
        self.progress = progress
        self.sessions: list[str] = []
        self.system_prompt = ""
        self.admissible = ""

    async def _ensure_sessions(self, count: int) -> list[str]:
        env = self.cfg.env
        if len(self.sessions) < count:
            config = dict(env.env_config or {})
            ro = self.cfg.rollout
            limit = ro.task_sampler != "uniform" and ro.max_turns and "max_turns" not in config
            if not self.admissible or limit:
                spec = await self.client.get_spec(env.env_id)
                self.admissible = spec.action_space
                if limit:
                    # The replica counts an episode when it ends there: the trainer's own turn limit
                    # becomes the session's, so episodes it cuts are counted for the sampler too.
                    config["max_turns"] = min(ro.max_turns, spec.max_turns)
            ids, prompt = await self.client.open_with_prompt(env.env_id, count - len(self.sessions),
                                                             config or None, env.action_format)
            self.sessions += ids
            self.system_prompt = prompt or self.system_prompt
        return self.sessions[:count]

    async def close(self) -> None:
        if self.sessions:
            try:
                await self.client.close_sessions(self.sessions)
            except Exception as e:  # closing is best effort: leases expire on their own
                log.warning("closing rollout sessions failed: %s", e)
            self.sessions = []

    # -- the collection loop ------------------------------------------------------------------------
    async def collect(self, tasks: Sequence[Task], group_size: int, iteration: int = 0,
                      temperature: float | None = None, episodes_per_trial: int | None = None) -> list[Trial]:
        """K = group_size trials of each task; returns them in (task, sample) order."""
        ro = self.cfg.rollout
        temperature = ro.temperature if temperature is None else temperature
        n_episodes = ro.episodes_per_trial if episodes_per_trial is None else episodes_per_trial
        seats = sessions_per_table(self.cfg.env.env_config)
        if group_size % seats:
            # Two-player self-play: the seats of a table are consecutive samples of one task.
            raise ValueError(f"the env config seats players at tables of {seats}: a group of {group_size} "
                             f"samples per task would split a table between tasks; use a multiple of {seats}")
        sids = await self._ensure_sessions(len(tasks) * group_size)
        runs: list[_Run] = []
        for i, task in enumerate(tasks):
            for k in range(group_size):
                trial = Trial(group=task.group, sample=k, info={"task_seed": task.seed, "split": task.split})
                builder = ContextBuilder(self.layout, self.system_prompt, ro.template, ro.history_turns,
                                         ro.response_prefix, ro.response_suffix, self.admissible,
                                         max_images=ro.max_images)
                runs.append(_Run(sids[i * group_size + k], task, trial, builder,
                                 (self.seed, iteration, task.split, task.seed, k)))
        by_tag: dict[int, _Run] = {}
        ready: deque[tuple[_Run, str]] = deque()
        stream_cm = self.client.stream()
        async with stream_cm as stream:
            async def send(coro_or_tag):
                return await coro_or_tag if inspect.isawaitable(coro_or_tag) else coro_or_tag

            async def reset(run: _Run, same_task: bool) -> None:
                run.awaiting = "reset"
                tag = await send(stream.send_reset(run.session_id, seed=None if same_task else run.task.seed,
                                                   split=run.task.split, same_task=same_task))
                by_tag[tag] = run

            for run in runs:
                await reset(run, False)
            recv_task: asyncio.Task | None = None
            policy_task: asyncio.Task | None = None
            try:
                while any(not r.finished for r in runs):
                    # Start the policy on what is ready, unless fewer than min_batch are and more
                    # env results are still on their way (then they join this call).
                    if policy_task is None and ready and (len(ready) >= ro.min_batch or not by_tag):
                        # One kind per call (acting and reflecting differ in length); the rest wait.
                        kind = ready[0][1]
                        batch, rest = [], deque()
                        while ready:
                            run, k = ready.popleft()
                            if k == kind and len(batch) < ro.max_batch:
                                batch.append(run)
                            else:
                                rest.append((run, k))
                        ready = rest
                        policy_task = asyncio.ensure_future(asyncio.to_thread(
                            self._generate, batch, kind, temperature))
                        policy_task.runs = batch  # type: ignore[attr-defined]
                        policy_task.kind = kind   # type: ignore[attr-defined]
                    if recv_task is None and by_tag:
                        recv_task = asyncio.ensure_future(stream.recv())
                    waiting = [t for t in (recv_task, policy_task) if t is not None]
                    if not waiting:
                        raise RuntimeError("rollout stalled: nothing in flight and nothing ready")
                    done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                    if recv_task in done:
                        results, recv_task = recv_task.result(), None
                        for tag, result in results:
                            run = by_tag.pop(tag)
                            follow = self._on_result(run, result, n_episodes)
                            if follow == "reset":
                                await reset(run, True)
                            elif follow is not None:
                                ready.append((run, follow))
                    if policy_task in done:
                        gens, batch, kind = policy_task.result(), policy_task.runs, policy_task.kind
                        policy_task = None
                        for run, gen in zip(batch, gens):
                            if kind == ACT:
                                run.awaiting = "step"
                                # The answer's tokens count into its episode's outcome statistics.
                                by_tag[await send(stream.send_step(run.session_id, self._act(run, gen),
                                                                   len(gen.completion_token_ids)))] = run
                            else:
                                self._on_reflection(run, gen)
                                await reset(run, True)
            finally:
                # A recv still pending would otherwise read from the stream while it closes.
                pending = [t for t in (recv_task, policy_task) if t is not None and not t.done()]
                for t in pending:
                    t.cancel()
                if pending:
                    await asyncio.gather(*pending, return_exceptions=True)
        return [r.trial for r in runs]

    # -- policy side ----------------------------------------------------------------------------------
    def _generate(self, batch: list[_Run], kind: str, temperature: float):
        ro = self.cfg.rollout
        prompts, seeds = [], []
        for run in batch:
            ep = run.episode
            if kind == ACT:
                prompts.append(run.pending[0])
                seeds.append(turn_seed(*run.seed_base, ep.episode, len(ep.turns)))
            else:
                run.pending = (reflection_prompt(self.layout, run.builder, run.last_observation, ep.success), [])
                run.pending_images = list(run.builder.context_images)
                prompts.append(run.pending[0])
                seeds.append(turn_seed(*run.seed_base, ep.episode, "reflect"))
        max_new = ro.max_new_tokens if kind == ACT else ro.reflection_max_new_tokens
        vision = {"images": [run.pending_images for run in batch]} if self.codec is not None else {}
        gens = self.policy.generate_from_ids(prompts, max_new, temperature=temperature, top_p=ro.top_p,
                                             row_seeds=seeds, **vision)
        if self.progress is not None and kind == ACT:
            self.progress(len(batch))
        return gens

    def _act(self, run: _Run, gen) -> str:
        ro = self.cfg.rollout
        action = ro.response_prefix + gen.text + ro.response_suffix
        prompt_ids, user_ids = run.pending
        run.pending = None
        run.episode.turns.append(Turn(
            turn=run.last_turn, prompt_ids=list(prompt_ids), completion_ids=list(gen.completion_token_ids),
            logprobs=list(gen.completion_logprobs), text=gen.text, action=action, observation="", reward=0.0,
            state_anchor=run.last_anchor, prompt_images=list(run.pending_images)))
        run.builder.record(run.last_observation, user_ids, gen.completion_token_ids, action, images=run.last_images)
        return action

    def _on_reflection(self, run: _Run, gen) -> None:
        ep = run.episode
        ep.reflection = remark_of(gen.text)
        prompt, run.pending = run.pending[0], None
        ep.reflection_ids = (prompt, list(gen.completion_token_ids), list(gen.completion_logprobs))
        ep.reflection_images = list(run.pending_images)
        run.memory.append(f"reflection: {ep.reflection}")

    # -- env side -------------------------------------------------------------------------------------
    def _memory_text(self, run: _Run) -> str:
        return "\n".join(run.memory)

    def _on_result(self, run: _Run, result, n_episodes: int) -> str | None:
        """Handle one reset or step result; return what the run needs next: ACT, REFLECT, "reset", None."""
        error = _status_error(result)
        if error is not None:
            run.trial.info["error"] = error
            run.finished = True
            log.warning("session %s: %s (its trial is dropped)", run.session_id, error)
            return None
        ro = self.cfg.rollout
        obs = result.observation.text
        if run.awaiting == "reset":
            # A new episode begins.
            index = 0 if run.episode is None else run.episode.episode + 1
            run.episode = Episode(env_id=self.cfg.env.env_id, split=run.task.split, task_seed=run.task.seed,
                                  group=run.task.group, sample=run.trial.sample, episode=index,
                                  session_id=run.session_id, env_episode=result.episode, env_trial=result.trial)
            run.trial.episodes.append(run.episode)
            run.builder.new_episode(self._memory_text(run))
        else:
            ep = run.episode
            turn = record_step(ep, run.builder, result, ro.max_turns)
            if turn.done or turn.truncated or ep.turn_limited:
                return self._episode_over(run, obs, n_episodes)
        run.last_observation, run.last_turn, run.last_anchor = obs, result.turn, result.anchor
        run.last_images = [im.png for im in result.observation.images] if self.codec is not None else []
        try:
            if not run.last_images and self.codec is not None and (self.cfg.env.env_config or {}).get("image_only"):
                raise ValueError("an image-only observation came without its image")
            run.pending = run.builder.prompt_ids(obs, result.turn, run.last_images)
        except ValueError as e:  # an image the policy cannot read (corrupt, too large, too many)
            run.trial.info["error"] = f"observation: {e}"
            run.finished = True
            log.warning("session %s: %s (its trial is dropped)", run.session_id, e)
            return None
        run.pending_images = list(run.builder.context_images)
        return ACT

    def _episode_over(self, run: _Run, obs: str, n_episodes: int) -> str | None:
        ro = self.cfg.rollout
        ep = run.episode
        run.last_observation = obs
        more = len(run.trial.episodes) < n_episodes and not (ro.stop_on_success and ep.success)
        if not more:
            run.finished = True
            return None
        if ro.memory in ("trajectories", "both"):
            run.memory.append(trajectory_summary(ep.actions, ep.success, ep.score))
        if ro.memory in ("reflections", "both"):
            return REFLECT
        return "reset"
