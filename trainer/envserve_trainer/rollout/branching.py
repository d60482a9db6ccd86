"""ARPO's rollout: entropy-guided branching over Fork (the formulas are in arpo.py).

Per task, N whole trajectories are played turn by turn. At every turn the policy samples its
response; the entropy of the response's first k tokens (H_t) is compared with the trajectory's
initial entropy (that of its first response, before any feedback from the env), and where
alpha + beta * dH_t exceeds the threshold the branching point takes min(Z, what is left of M - N)
branches (arpo.branch_plan, decisions in the order they are made). A branch is a Fork of the
session in the state the response was sampled in, i.e. after the env's response and before this
turn's answer is stepped; the branch re-samples that turn's answer and plays on to its own end, and
may branch again later. What branching leaves unspent is played as independent whole trajectories.

Every trajectory comes back as a Trial of its task's group (M per task), a branch holding copies of
its parent's turns before the branching turn, so the estimators see the shared prefix in each
trajectory through it: GRPO's advantage of the whole trajectory on each of its tokens is ARPO's
soft estimator. Trial.info records how each was made ("arpo": initial | branch | independent, and
for a branch "branch_of" and "branch_turn").

The trajectories of all tasks step in lockstep (one policy batch and one Step call per turn); tasks
are taken in chunks so that at most `max_alive` sessions (forks included) are open, and every
session a chunk opened or forked is closed before the next chunk starts, also on failure.
"""
from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Sequence

import torch

from envserve.client import item_error

from ..config.train_config import TrainConfig
from ..methods.process import arpo
from .engine import Task, record_step, turn_seed
from .prompting import ChatLayout, ContextBuilder
from .trajectory import Episode, Trial, Turn

log = logging.getLogger(__name__)

INITIAL, BRANCH, INDEPENDENT = "initial", "branch", "independent"

# (prompt ids, completion ids) of a batch -> the window entropy of each completion, in nats.
EntropyFn = Callable[[Sequence[Sequence[int]], Sequence[Sequence[int]]], list[float]]
# Called with (parent path, fork session ids) right after a Fork and before anything steps: tests
# read the forks' ground truth there.
ForkHook = Callable[["Path", list[str]], Awaitable[None]]


def policy_entropy(policy, temperature: float, k: int, max_batch: int = 64) -> EntropyFn:
    """The window entropy of completions under an in-process HF policy (HFPolicy): one scoring pass
    over each prompt and the completion's first k tokens, the distribution sampled from (temperature
    and the restricted vocabulary applied; greedy decoding is scored at temperature 1)."""
    from ..policies.hf import sequence_logprobs
    model = getattr(policy, "model", None)
    if model is None:
        raise ValueError("ARPO measures the policy's token entropy: it needs the in-process hf backend")
    scale = temperature if temperature > 0 else 1.0

    @torch.no_grad()
    def entropies(prompts, completions):
        out: list[float] = []
        was_training = model.training
        model.eval()
        try:
            for s in range(0, len(prompts), max_batch):
                heads = [list(c[:k]) for c in completions[s:s + max_batch]]
                _, mask, ent = sequence_logprobs(model, prompts[s:s + max_batch], heads, scale,
                                                 pad_token_id=policy.pad_token_id, allowed=policy.allowed,
                                                 return_entropy=True)
                out += [float(h) for h in arpo.window_entropy(ent.cpu(), mask.cpu(), k)]
        finally:
            model.train(was_training)
        return out
    return entropies


def support_size(policy) -> int:
    """|V| of the sampled distribution: the restricted vocabulary's size, else the model's."""
    allowed = getattr(policy, "allowed", None)
    if allowed is not None:
        return int(allowed.sum())
    return int(policy.model.config.vocab_size)


def fork_builder(builder: ContextBuilder) -> ContextBuilder:
    """A copy of a context builder whose history a branch can extend without touching the parent's
    (the history entries are mutated when a step's feedback arrives)."""
    return dataclasses.replace(builder, history=[dataclasses.replace(h) for h in builder.history])


@dataclass
class Path:
    """One trajectory being played."""
    index: int                           # its task's place in the iteration's task list
    task: Task
    trial: Trial
    episode: Episode
    builder: ContextBuilder
    session_id: str
    result: Any                          # the latest StepResult: what the next answer responds to
    kind: str
    initial_entropy: float | None = None
    created_at: int = -1                 # a branch: the turn index it was forked at (decided there already)
    pending: tuple[list[int], list[int]] | None = None   # (prompt ids, user block) of the next answer
    finished: bool = False


@dataclass
class TaskBudget:
    """One task's branching decisions and what branch_plan makes of them."""
    total: int
    initial: int
    branches: int
    decisions: list[bool] = field(default_factory=list)
    changes: list[float] = field(default_factory=list)
    next_sample: int = 0

    def decide(self, branch: bool, dh: float) -> int:
        """Records a decision; the branches it gets (0 when the budget is spent or it did not branch)."""
        self.decisions.append(branch)
        self.changes.append(dh)
        return self.plan.branches[-1]

    @property
    def plan(self) -> arpo.BranchPlan:
        return arpo.branch_plan(self.decisions, self.total, self.initial, self.branches)

    def take_sample(self) -> int:
        self.next_sample += 1
        return self.next_sample - 1


class BranchingRollout:
    """Plays one iteration's tasks the ARPO way; `collect` returns (trials, metrics)."""

    def __init__(self, client, policy, tokenizer, cfg: TrainConfig, iteration: int,
                 entropy: EntropyFn | None = None, vocab_size: int | None = None, on_fork: ForkHook | None = None):
        self.client, self.policy, self.cfg, self.iteration = client, policy, cfg, iteration
        self.settings = cfg.process.arpo
        ro = cfg.rollout
        self.layout = ChatLayout(tokenizer)
        self.entropy = entropy or policy_entropy(policy, ro.temperature, self.settings.entropy_tokens, ro.max_batch)
        self.vocab_size = vocab_size if vocab_size is not None else support_size(policy)
        self.on_fork = on_fork
        self.system_prompt = ""
        self.admissible = ""
        self.fork_failures = 0
        self.entropies: list[float] = []

    # -- the iteration ---------------------------------------------------------------------------------
    async def collect(self, tasks: Sequence[Task]) -> tuple[list[Trial], dict[str, float]]:
        a = self.settings
        per_chunk = max(1, self.cfg.process.mc_max_alive // a.total_rollouts)
        budgets = {i: TaskBudget(a.total_rollouts, a.initial_rollouts, a.branches) for i in range(len(tasks))}
        trials: dict[int, list[Trial]] = {i: [] for i in range(len(tasks))}
        if self.cfg.rollout.template == "rlvmr" and not self.admissible:
            self.admissible = (await self.client.get_spec(self.cfg.env.env_id)).action_space
        for start in range(0, len(tasks), per_chunk):
            chunk = list(range(start, min(start + per_chunk, len(tasks))))
            await self._phase(tasks, {i: a.initial_rollouts for i in chunk}, INITIAL, budgets, trials)
            leftover = {i: budgets[i].plan.independent for i in chunk}
            if any(leftover.values()):
                await self._phase(tasks, leftover, INDEPENDENT, budgets, trials)
        out = [t for i in range(len(tasks)) for t in sorted(trials[i], key=lambda t: t.sample)]
        return out, self._metrics(budgets, trials)

    def _metrics(self, budgets: dict[int, TaskBudget], trials: dict[int, list[Trial]]) -> dict[str, float]:
        plans = [b.plan for b in budgets.values()]
        changes = [dh for b in budgets.values() for dh in b.changes]
        made = [t for ts in trials.values() for t in ts]

        def success(kind: str) -> float:
            eps = [t.episodes[0] for t in made if t.info.get("arpo") == kind and t.episodes and "error" not in t.info]
            return sum(e.success for e in eps) / len(eps) if eps else 0.0
        n = max(len(budgets), 1)
        return {"decisions": float(len(changes)),
                "branch_points": float(sum(sum(b.decisions) for b in budgets.values())),
                "branch_points_used": float(sum(sum(1 for z in p.branches if z) for p in plans)),
                "branches": float(sum(sum(p.branches) for p in plans)),
                "independent": float(sum(p.independent for p in plans)),
                "rollouts_per_task": sum(len(ts) for ts in trials.values()) / n,
                "mean_dh": sum(changes) / len(changes) if changes else 0.0,
                "mean_entropy": sum(self.entropies) / len(self.entropies) if self.entropies else 0.0,
                "fork_failed": float(self.fork_failures),
                "success_initial": success(INITIAL), "success_branch": success(BRANCH),
                "success_independent": success(INDEPENDENT)}

    async def _phase(self, tasks: Sequence[Task], counts: dict[int, int], kind: str,
                     budgets: dict[int, TaskBudget], trials: dict[int, list[Trial]]) -> None:
        """Opens counts[i] sessions for task i, plays them (branching in the initial phase), and
        closes every session it opened or forked."""
        opened: list[str] = []
        try:
            paths = await self._start(tasks, counts, kind, budgets, opened)
            for i, p in paths:
                trials[i].append(p.trial)
            await self._play([p for _, p in paths], kind == INITIAL, budgets, trials, opened)
        finally:
            if opened:
                with contextlib.suppress(Exception):   # a lost replica took its sessions; leases expire
                    await self.client.close_sessions(opened)

    async def _start(self, tasks, counts, kind, budgets, opened) -> list[tuple[int, Path]]:
        env, ro = self.cfg.env, self.cfg.rollout
        total = sum(counts.values())
        sids, prompt = await self.client.open_with_prompt(env.env_id, total, env.env_config or None, env.action_format)
        opened += sids
        self.system_prompt = prompt or self.system_prompt
        paths: list[tuple[int, Path]] = []
        it = iter(sids)
        for i, n in counts.items():
            task = tasks[i]
            for _ in range(n):
                sample = budgets[i].take_sample()
                trial = Trial(group=task.group, sample=sample,
                              info={"task_seed": task.seed, "split": task.split, "arpo": kind})
                builder = ContextBuilder(self.layout, self.system_prompt, ro.template, ro.history_turns,
                                         ro.response_prefix, ro.response_suffix, self.admissible)
                builder.new_episode("")
                sid = next(it)
                episode = Episode(env_id=env.env_id, split=task.split, task_seed=task.seed, group=task.group,
                                  sample=sample, episode=0, session_id=sid)
                trial.episodes.append(episode)
                paths.append((i, Path(i, task, trial, episode, builder, sid, None, kind)))
        for split in dict.fromkeys(p.task.split for _, p in paths):
            batch = [p for _, p in paths if p.task.split == split]
            results = await self.client.reset([p.session_id for p in batch], seeds=[p.task.seed for p in batch],
                                              split=split)
            for p, r in zip(batch, results):
                if self._failed(p, r, "reset"):
                    continue
                p.result = r
                p.episode.env_episode, p.episode.env_trial = r.episode, r.trial
        return paths

    def _failed(self, path: Path, result, what: str) -> bool:
        err = item_error(result)
        if err is None:
            return False
        path.trial.info["error"] = f"{what}: {err}"
        path.finished = True
        log.warning("arpo: session %s: %s (its trajectory is dropped)", path.session_id, err)
        return True

    async def _play(self, paths: list[Path], branching: bool, budgets, trials, opened) -> None:
        a, ro = self.settings, self.cfg.rollout
        while True:
            live = [p for p in paths if not p.finished]
            if not live:
                return
            for p in live:
                if p.pending is None:
                    p.pending = p.builder.prompt_ids(p.result.observation.text, p.result.turn)
            gens = await asyncio.to_thread(self._generate, live)
            ents = await asyncio.to_thread(self.entropy, [p.pending[0] for p in live],
                                           [g.completion_token_ids for g in gens]) if branching else [None] * len(live)
            # Decisions in path order (deterministic), and every fork before any answer is stepped:
            # a branch starts from the state this turn's answer was sampled in.
            forks: list[tuple[Path, int]] = []
            for p, h in zip(live, ents):
                if h is None:
                    continue
                self.entropies.append(h)
                t = len(p.episode.turns)
                if p.initial_entropy is None:       # the first response: the reference, not a decision
                    p.initial_entropy = h
                    continue
                if t == p.created_at:               # a branch re-sampling the turn it was forked at
                    continue
                dh = arpo.entropy_change(h, p.initial_entropy, self.vocab_size, a.entropy_scale)
                z = budgets[p.index].decide(arpo.should_branch(dh, a.alpha, a.beta, a.threshold), dh)
                if z:
                    forks.append((p, z))
            made = await asyncio.gather(*(self._branch(p, z, budgets[p.index], opened) for p, z in forks))
            for branches in made:
                for b in branches:
                    trials[b.index].append(b.trial)
                    if not b.finished:
                        paths.append(b)
            actions = [self._act(p, g) for p, g in zip(live, gens)]
            results = await self.client.step([(p.session_id, act) for p, act in zip(live, actions)])
            for p, r in zip(live, results):
                if self._failed(p, r, "step"):
                    continue
                turn = record_step(p.episode, p.builder, r, ro.max_turns)
                p.pending = None
                if turn.done or turn.truncated or p.episode.turn_limited:
                    p.finished = True
                else:
                    p.result = r

    def _generate(self, live: list[Path]):
        ro = self.cfg.rollout
        gens = []
        for s in range(0, len(live), ro.max_batch):
            batch = live[s:s + ro.max_batch]
            seeds = [turn_seed(self.cfg.run.seed, self.iteration, "arpo", p.task.split, p.task.seed, p.trial.sample,
                               len(p.episode.turns)) for p in batch]
            gens += self.policy.generate_from_ids([p.pending[0] for p in batch], ro.max_new_tokens,
                                                  temperature=ro.temperature, top_p=ro.top_p, row_seeds=seeds)
        return gens

    def _act(self, p: Path, gen) -> str:
        ro = self.cfg.rollout
        action = ro.response_prefix + gen.text + ro.response_suffix
        prompt_ids, user_ids = p.pending
        p.episode.turns.append(Turn(
            turn=p.result.turn, prompt_ids=list(prompt_ids), completion_ids=list(gen.completion_token_ids),
            logprobs=list(gen.completion_logprobs), text=gen.text, action=action, observation="", reward=0.0,
            state_anchor=p.result.anchor))
        p.builder.record(p.result.observation.text, user_ids, gen.completion_token_ids, action)
        return action

    async def _branch(self, parent: Path, z: int, budget: TaskBudget, opened: list[str]) -> list[Path]:
        """z branches of `parent` at its current turn: Forks of its session (not yet stepped this
        turn) with copies of its context and turns so far. A refused Fork still spends its budget
        (the plan is made): its branches come back as failed trials, which the update drops."""
        t = len(parent.episode.turns)
        samples = [budget.take_sample() for _ in range(z)]
        try:
            sids = await self.client.fork(parent.session_id, z)
            opened += sids
            if self.on_fork is not None:
                await self.on_fork(parent, list(sids))
        except Exception as e:  # noqa: BLE001 - a refused fork or a lost replica fails these branches only
            self.fork_failures += 1
            log.warning("arpo: fork of %s failed: %s (its %d branches are dropped)", parent.session_id, e, z)
            sids, error = [""] * z, f"fork: {e}"
        else:
            error = ""
        out = []
        for sample, sid in zip(samples, sids):
            task = parent.task
            info = {"task_seed": task.seed, "split": task.split, "arpo": BRANCH, "branch_of": parent.trial.sample,
                    "branch_turn": t}
            if error:
                info["error"] = error
            trial = Trial(group=task.group, sample=sample, info=info)
            episode = Episode(env_id=parent.episode.env_id, split=task.split, task_seed=task.seed, group=task.group,
                              sample=sample, episode=0, session_id=sid, env_episode=parent.episode.env_episode,
                              env_trial=parent.episode.env_trial, turns=copy.deepcopy(parent.episode.turns))
            trial.episodes.append(episode)
            result = copy.deepcopy(parent.result)
            result.session_id = sid
            out.append(Path(parent.index, task, trial, episode, fork_builder(parent.builder), sid, result, BRANCH,
                            parent.initial_entropy, created_at=t,
                            pending=(list(parent.pending[0]), list(parent.pending[1])), finished=bool(error)))
        return out
