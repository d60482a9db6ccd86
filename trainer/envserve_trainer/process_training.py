"""The process-reward methods as steps of the RL loop (train.py calls them between collection and
the update): each gives every collected turn a process reward (Turn.process_reward), which the
estimator adds to the env's reward times process.reward_coef (samples.turn_reward).

    agentprm     Q-hat(s, a) from the iteration's returns (every visit) plus m forked rollouts from
                 the least-visited (s, a); the step scorer trained with BCE against Q-hat in [0, 1];
                 r_t = sigma(Q_phi(s_t, a_t)) (less the iteration's mean: process.center_reward).
    inverse_prm  the step scorer trained as InversePRM's transition classifier: the expert's
                 transitions (demonstrations) against the policy's; r_t = sigma(Q_phi(s_t, a_t)).
    progrm       recipes (the LCS of a cluster's successful action sequences, kept across
                 iterations), k/|L| progress labels on every trajectory with a recipe, the step
                 scorer trained with BCE on them; r_t = Prog(s_t) - Prog(s_{t-1}).
    ipr, rro     preference pairs from forked rollouts, trained by DPO (pairs() instead of annotate()).
    arpo         no process reward: the training trials themselves are played with entropy-guided
                 branching over Fork (collect() instead of the rollout engine; branching.py).

The KL to the previous iteration's policy that AgentPRM and InversePRM use is update.reference:
previous (update/learner.py). A state is keyed by the env's anchor of the state acted in and the parsed
actions, within its task group, so equal (s, a) pairs pool their returns.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Any, Hashable, Sequence

import torch

from .config.train_config import TrainConfig
from .methods.process import agentprm, inverse_prm, progrm
from .methods.process.montecarlo import MCSettings, StatePoint, chat_policy, estimate, prefix_points
from .rollout.engine import Task, turn_seed
from .rollout.prompting import ChatLayout
from .rollout.trajectory import Episode, Trial, Turn
from .samples.build import usable
from .update.losses import PreferencePair
from .update.reward_model import StepScorer

log = logging.getLogger(__name__)


def action_key(turn: Turn) -> str:
    """What a turn did, as the env parsed it (case and spacing as the env normalises them), or the
    text sent when nothing parsed: equal keys are the same action."""
    return ",".join(turn.parsed_actions) if turn.parsed_actions else turn.action


def step_keys(episode: Episode) -> list[Hashable | None]:
    """(group, state anchor, action) per turn; None where the env gave no anchor (no pooling)."""
    return [(episode.group, t.state_anchor, action_key(t)) if t.state_anchor else None for t in episode.turns]


def _episodes(trials: Sequence[Trial]) -> list[Episode]:
    return [ep for tr in usable(trials) for ep in tr.episodes if ep.turns]


@dataclass
class Context:
    """What a method may use in one iteration besides the trials."""
    client: Any                 # the rollout's AsyncEnvClient or AsyncRoutedClient
    policy: Any                 # the rollout policy (HFPolicy over the live weights)
    system_prompt: str
    iteration: int
    admissible: str = ""        # GetSpec's action space, as the rollout's contexts show it


class ProcessMethod:
    """Base: a step scorer and the iteration's annotate()."""
    name = ""

    def __init__(self, cfg: TrainConfig, policy_model, tokenizer, seed: int = 0):
        p = cfg.process
        self.cfg = cfg
        self.tokenizer = tokenizer
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.scorer = StepScorer(policy_model, int(pad), p.prm_lr, p.prm_buffer, p.prm_batch_size, seed)

    # A method that trains on preference pairs (the DPO family) sets this; the trainer then calls
    # pairs() and the learner's preference_update instead of annotate() and the PG update.
    preference = False
    # A method that plays the training trials itself (ARPO's branching) sets this; the trainer then
    # calls collect() instead of the rollout engine, and neither annotate() nor pairs().
    collects = False

    async def collect(self, tasks: Sequence[Task], ctx: Context) -> tuple[list[Trial], dict[str, float]]:
        raise NotImplementedError

    async def annotate(self, trials: Sequence[Trial], ctx: Context) -> dict[str, float]:
        raise NotImplementedError

    def _rollout_policy(self, ctx: Context, salt: int = 0):
        """The continuation policy of the Monte-Carlo estimates: the live policy on each rollout's
        current observation (montecarlo.chat_policy), sampling at process.mc_temperature."""
        ro, p = self.cfg.rollout, self.cfg.process
        return chat_policy(ctx.policy, ctx.system_prompt, ro.max_new_tokens, p.mc_temperature, ro.top_p,
                           seed=self.cfg.run.seed * 7919 + ctx.iteration * 104_729 + salt,
                           response_prefix=ro.response_prefix, response_suffix=ro.response_suffix)

    def _mc(self, rollouts: int, gamma: float = 1.0) -> MCSettings:
        p = self.cfg.process
        return MCSettings(rollouts_per_state=rollouts, gamma=gamma, horizon=p.mc_horizon, max_alive=p.mc_max_alive)

    def _set_rewards(self, turns: Sequence[Turn], rewards: Sequence[float]) -> float:
        """Process rewards onto the turns, less their mean when process.center_reward is set;
        returns the mean before centring (the scorer's average opinion, for the log)."""
        mean = _mean(rewards)
        shift = mean if self.cfg.process.center_reward else 0.0
        for t, r in zip(turns, rewards):
            t.process_reward = r - shift
        return mean

    def _score_turns(self, turns: Sequence[Turn]) -> list[float]:
        return self.scorer.score([t.prompt_ids for t in turns], [t.completion_ids for t in turns])


def _bce(scorer: StepScorer, batch) -> torch.Tensor:
    logits = scorer.logits([b[0] for b in batch], [b[1] for b in batch])
    targets = torch.tensor([b[2] for b in batch], dtype=torch.float32, device=logits.device)
    return agentprm.prm_bce_loss(logits, targets)


def _sigmoid(z: float) -> float:
    return 1.0 / (1.0 + math.exp(-z)) if z >= 0 else math.exp(z) / (1.0 + math.exp(z))


def _mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values)) if values else 0.0


class AgentPRM(ProcessMethod):
    name = "agentprm"

    async def _forked_visits(self, episodes: list[Episode], keys: list[list], visits: dict, ctx: Context):
        """m rollouts from each of the mc_states least-visited (s, a) of the iteration, each starting
        with a (Q(s, a) by Fork); returns their (return, key) pairs and the estimate's cost."""
        p, env = self.cfg.process, self.cfg.env
        if p.mc_rollouts == 0 or p.mc_states == 0:
            return [], {}
        chosen, seen = [], set()
        for ep, ks in zip(episodes, keys):
            for t, k in enumerate(ks):
                if k is not None and k not in seen:
                    seen.add(k)
                    chosen.append((visits[k], len(chosen), ep, t, k))
        chosen = sorted(chosen, key=lambda c: (c[0], c[1]))[:p.mc_states]
        if not chosen:
            return [], {}
        points, firsts = [], []
        for _, _, ep, t, _ in chosen:
            actions = [x.action for x in ep.turns]
            points += prefix_points(env.env_id, ep.task_seed, actions, env.env_config, env.action_format, ep.split,
                                    turns=[t])
            firsts.append(actions[t])
        values = await estimate(ctx.client, points, self._rollout_policy(ctx),
                                self._mc(p.mc_rollouts, self.cfg.process.agentprm.gamma), by="fork",
                                first_actions=firsts)
        pairs = [(ret, c[4]) for c, v in zip(chosen, values) if not v.failed for ret in v.returns]
        failed = sum(1 for v in values if v.failed)
        if failed:
            log.warning("agentprm: %d of %d forked estimates failed (%s)", failed, len(values),
                        next(v.error for v in values if v.failed))
        return pairs, {"mc_states": float(len(values) - failed), "mc_failed": float(failed),
                       "mc_env_steps": float(sum(v.env_steps for v in values))}

    async def annotate(self, trials, ctx):
        a = self.cfg.process.agentprm
        episodes = _episodes(trials)
        if not episodes:
            return {}
        rewards = [[t.reward for t in ep.turns] for ep in episodes]
        keys = [step_keys(ep) for ep in episodes]
        visits: dict[Hashable, int] = defaultdict(int)
        for ks in keys:
            for k in ks:
                if k is not None:
                    visits[k] += 1
        forked, mc = await self._forked_visits(episodes, keys, visits, ctx)
        # A forked rollout's return is one more visit of its (s, a): a one-step "trajectory" whose
        # reward is that return pools with the rest in the every-visit mean.
        q = agentprm.q_hat_targets(rewards + [[r] for r, _ in forked], keys + [[k] for _, k in forked], a.gamma)
        examples = [(t.prompt_ids, t.completion_ids, agentprm.bce_target(q[k].value, a.return_low, a.return_high))
                    for ep, ks in zip(episodes, keys) for t, k in zip(ep.turns, ks) if k is not None]
        fit = await asyncio.to_thread(self.scorer.fit, examples, _bce, self.cfg.process.prm_epochs)
        turns = [t for ep in episodes for t in ep.turns]
        logits = await asyncio.to_thread(self._score_turns, turns)
        score_mean = self._set_rewards(turns, [_sigmoid(z) for z in logits])
        return {**fit, **mc, "prm_score_mean": score_mean, "q_hat_states": float(len(q)), "q_hat_mean": _mean([v.value for v in q.values()]),
                "process_reward_mean": _mean([t.process_reward for t in turns])}


# -- InversePRM --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Transition:
    """(s, a) and (s', a') in the policy's layout; next None after a terminal step."""
    prompt_ids: list[int]
    completion_ids: list[int]
    next_prompt_ids: list[int] | None
    next_completion_ids: list[int] | None
    expert: bool


def transitions(steps: Sequence[tuple[list[int], list[int]]], ended: bool, expert: bool) -> list[Transition]:
    """The transitions of one trajectory's (prompt ids, completion ids) steps. `ended`: its last step
    was terminal (the env's done); a trajectory cut by a time limit has no successor for its last
    step and leaves that step out (its Q(s', a') is unknown, and 0 would call it terminal)."""
    out = []
    for i, (p, c) in enumerate(steps):
        if i + 1 < len(steps):
            out.append(Transition(list(p), list(c), list(steps[i + 1][0]), list(steps[i + 1][1]), expert))
        elif ended:
            out.append(Transition(list(p), list(c), None, None, expert))
    return out


def _classifier_loss(gamma: float):
    def loss(scorer: StepScorer, batch: Sequence[Transition]) -> torch.Tensor:
        has_next = [b.next_prompt_ids is not None for b in batch]
        nexts = [b for b, h in zip(batch, has_next) if h]
        z = scorer.logits([b.prompt_ids for b in batch] + [b.next_prompt_ids for b in nexts],
                          [b.completion_ids for b in batch] + [b.next_completion_ids for b in nexts])
        q_sa, q_rest = z[:len(batch)], z[len(batch):]
        q_next = torch.zeros_like(q_sa)
        idx = torch.tensor([i for i, h in enumerate(has_next) if h], dtype=torch.long, device=z.device)
        if len(idx):
            q_next = q_next.index_copy(0, idx, q_rest)
        terminal = torch.tensor([not h for h in has_next], dtype=torch.float32, device=z.device)
        expert = torch.tensor([b.expert for b in batch], device=z.device)
        return inverse_prm.inverse_prm_loss(q_sa, q_next, expert, terminal, gamma)
    return loss


def demonstration_steps(records: Sequence[dict], cfg: TrainConfig, tokenizer) -> list[tuple[list, bool]]:
    """Each demonstration's (prompt ids, completion ids) steps in the policy's layout (replayed as
    the rollout builds contexts: collect.replay_episode), with whether it ended by the env's done."""
    from .collect import replay_episode
    layout = ChatLayout(tokenizer)
    out = []
    for r in records:
        replayed = replay_episode(layout, r, cfg)
        steps = [(x.prompt_ids, x.completion_ids) for x in replayed]
        ended = bool(r["turns"]) and bool(r["turns"][-1]["done"]) and not r.get("turn_limited", False)
        out.append((steps, ended))
    return out


def play_demonstrations(sync_client, cfg: TrainConfig, episodes: int) -> list[dict]:
    """`episodes` demonstrations by the env's expert on the training seeds (cycled), as collect's records."""
    from envserve.client.experts import play_expert
    from .collect import episode_record
    env = cfg.env
    seeds = [env.seed_start + i % env.num_tasks for i in range(episodes)]
    admissible = sync_client.get_spec(env.env_id).action_space
    # The env's own turn limit, not the rollout's: a demonstration shows the task solved.
    played = play_expert(sync_client, env.env_id, seeds, env.action_format, config=env.env_config, split=env.split)
    return [episode_record(e, admissible) for e in played]


class InversePRM(ProcessMethod):
    name = "inverse_prm"

    def __init__(self, cfg, policy_model, tokenizer, demonstrations: Sequence[dict], seed: int = 0):
        super().__init__(cfg, policy_model, tokenizer, seed)
        self.expert = [tr for steps, ended in demonstration_steps(demonstrations, cfg, tokenizer)
                       for tr in transitions(steps, ended, expert=True)]
        if not self.expert:
            raise ValueError("inverse_prm: the demonstrations hold no transition")
        self.loss = _classifier_loss(cfg.process.inverse_prm.gamma)

    def _fit(self, policy_transitions: list[Transition]) -> dict[str, float]:
        # The expert's transitions are the fixed positives; the policy's go through the buffer, so
        # recent iterations' negatives keep counting. The loss averages each class on its own.
        return self.scorer.fit(policy_transitions, self.loss, self.cfg.process.prm_epochs, fixed=self.expert)

    @torch.no_grad()
    def separation(self, batch: Sequence[Transition]) -> float:
        """Mean sigma(z) of the given transitions (how expert-like the classifier finds them)."""
        if not batch:
            return 0.0
        g = self.cfg.process.inverse_prm.gamma
        z_sa = self.scorer.score([b.prompt_ids for b in batch], [b.completion_ids for b in batch])
        nxt = [b for b in batch if b.next_prompt_ids is not None]
        z_next = iter(self.scorer.score([b.next_prompt_ids for b in nxt], [b.next_completion_ids for b in nxt]))
        zs = [z - g * (next(z_next) if b.next_prompt_ids is not None else 0.0) for z, b in zip(z_sa, batch)]
        return _mean([_sigmoid(z) for z in zs])

    async def annotate(self, trials, ctx):
        episodes = _episodes(trials)
        if not episodes:
            return {}
        policy_tr = [tr for ep in episodes
                     for tr in transitions([(t.prompt_ids, t.completion_ids) for t in ep.turns],
                                           ep.turns[-1].done and not ep.turn_limited, expert=False)]
        fit = await asyncio.to_thread(self._fit, policy_tr)
        turns = [t for ep in episodes for t in ep.turns]
        logits = await asyncio.to_thread(self._score_turns, turns)
        score_mean = self._set_rewards(turns, [_sigmoid(z) for z in logits])
        return {**fit, "prm_score_mean": score_mean, "expert_transitions": float(len(self.expert)), "policy_transitions": float(len(policy_tr)),
                "expert_prob_expert": await asyncio.to_thread(self.separation, self.expert[:256]),
                "expert_prob_policy": await asyncio.to_thread(self.separation, policy_tr[:256]),
                "process_reward_mean": _mean([t.process_reward for t in turns])}


# -- ProgRM --------------------------------------------------------------------------------------------
class ProgRM(ProcessMethod):
    name = "progrm"
    # Successful action sequences kept per cluster key (ours: the newest 16), so a recipe reflects
    # recent successes and the LCS stays cheap.
    KEEP_SUCCESSES = 16

    def __init__(self, cfg, policy_model, tokenizer, seed: int = 0):
        super().__init__(cfg, policy_model, tokenizer, seed)
        self.successes: dict[Hashable, deque] = defaultdict(lambda: deque(maxlen=self.KEEP_SUCCESSES))

    def recipes_for(self, episode: Episode) -> list[list[Hashable]]:
        """The recipes a trajectory is matched against: its own cluster's (cluster_by key: its task
        group), or every cluster's (jaccard: clusters of all kept successes by action-set overlap)."""
        pc = self.cfg.process.progrm
        if pc.cluster_by == "key":
            seqs = list(self.successes.get(episode.group, ()))
            return progrm.cluster_recipes(seqs, [list(range(len(seqs)))], pc.min_cluster_size)
        seqs = [s for kept in self.successes.values() for s in kept]
        return progrm.cluster_recipes(seqs, progrm.cluster_by_jaccard(seqs, pc.jaccard_threshold),
                                      pc.min_cluster_size)

    def labels(self, episode: Episode) -> list[float] | None:
        actions = [action_key(t) for t in episode.turns]
        recipes = self.recipes_for(episode)
        best = progrm.best_recipe(actions, recipes)
        return None if best is None else progrm.progress_labels(actions, recipes[best])

    async def annotate(self, trials, ctx):
        episodes = _episodes(trials)
        if not episodes:
            return {}
        for ep in episodes:
            if ep.success:
                self.successes[ep.group].append([action_key(t) for t in ep.turns])
        examples, labelled = [], 0
        for ep in episodes:
            labels = self.labels(ep)
            if labels is None:
                continue
            labelled += 1
            examples += [(t.prompt_ids, t.completion_ids, y) for t, y in zip(ep.turns, labels)]
        fit = await asyncio.to_thread(self.scorer.fit, examples, _bce, self.cfg.process.prm_epochs)
        turns = [t for ep in episodes for t in ep.turns]
        logits = iter(await asyncio.to_thread(self._score_turns, turns))
        for ep in episodes:
            progress = [_sigmoid(next(logits)) for _ in ep.turns]
            for t, r in zip(ep.turns, progrm.progress_rewards(progress)):
                t.process_reward = r
        return {**fit, "labelled_trajectories": float(labelled), "clusters_with_successes": float(len(self.successes)),
                "process_reward_mean": _mean([t.process_reward for t in turns])}


# -- the DPO family: IPR and RRO -------------------------------------------------------------------------
def _completion_text(ids: Sequence[int], tokenizer) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=True)


class _PreferenceMethod(ProcessMethod):
    preference = True

    def __init__(self, cfg, policy_model, tokenizer, allowed_ids: Sequence[int] | None = None, seed: int = 0):
        # No step scorer: the DPO family scores with the policy and the reference themselves.
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.allowed = None if allowed_ids is None else set(int(i) for i in allowed_ids)
        self.generating = asyncio.Lock()     # one policy call at a time (one model), as the rollout does

    def fits(self, completion_ids: Sequence[int]) -> bool:
        """Whether the policy can produce these tokens at all: with a restricted vocabulary
        (rollout.allowed_words) a demonstration's other tokens would score log 0 = -inf."""
        return self.allowed is None or all(int(t) in self.allowed for t in completion_ids)

    def _as_sampled(self, completion_ids: Sequence[int], stop: int) -> list[int]:
        """A demonstration's completion as the policy would sample it: without the stop token where
        the restricted vocabulary leaves it out (a one-token answer ends by the token limit)."""
        ids = list(completion_ids)
        if self.allowed is not None and ids and ids[-1] == stop and stop not in self.allowed:
            ids = ids[:-1]
        return ids

    async def _generate(self, ctx: Context, prompt_ids: list[list[int]], seeds: list[int]):
        ro = self.cfg.rollout
        async with self.generating:
            return await asyncio.to_thread(ctx.policy.generate_from_ids, prompt_ids, ro.max_new_tokens,
                                           ro.temperature, ro.top_p, row_seeds=seeds)

    def _answer(self, gen) -> str:
        ro = self.cfg.rollout
        return ro.response_prefix + gen.text + ro.response_suffix

    async def pairs(self, trials: Sequence[Trial], ctx: Context) -> tuple[list, list, dict[str, float]]:
        """(preference pairs, SFT rows, metrics) for this iteration."""
        raise NotImplementedError


def spaced(n: int, k: int) -> list[int]:
    """k indices of range(n) evenly spaced, first and last included (all of them for k 0 or >= n)."""
    if k <= 0 or k >= n:
        return list(range(n))
    if k == 1:
        return [n - 1]
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})


class IPR(_PreferenceMethod):
    """IPR: along each task's expert trajectory, the policy proposes an alternative at every step;
    m forked rollouts after the expert's step and m after the alternative compare them; a clear
    winner gives a step pair (the winning step's tokens chosen, the loser's rejected, in the
    expert prefix's context). The expert trajectory against a failed policy trajectory of the same
    task gives an outcome pair; the expert's turns are the SFT term."""
    name = "ipr"
    # Failed policy trajectories paired with each task's expert trajectory per iteration (ours).
    OUTCOME_PAIRS_PER_TASK = 2

    def __init__(self, cfg, policy_model, tokenizer, demonstrations: Sequence[dict], allowed_ids=None, seed=0):
        super().__init__(cfg, policy_model, tokenizer, allowed_ids, seed)
        from .collect import replay_episode
        layout = ChatLayout(tokenizer)
        self.expert: dict[int, tuple[list[str], list[tuple[list[int], list[int]]]]] = {}
        failed = unfit = 0
        for r in demonstrations:
            if int(r["seed"]) in self.expert:
                continue
            if not r["success"]:
                failed += 1
                continue
            rows = [(x.prompt_ids, self._as_sampled(x.completion_ids, layout.stop_token_id))
                    for x in replay_episode(layout, r, cfg)]
            if not rows or not all(self.fits(c) for _, c in rows):
                unfit += 1
                continue
            self.expert[int(r["seed"])] = ([t["answer"] for t in r["turns"]], rows)
        if not self.expert:
            raise ValueError(f"ipr: no usable demonstration among {len(demonstrations)} ({failed} unsuccessful, "
                             f"{unfit} with tokens outside rollout.allowed_words: with a restricted vocabulary "
                             f"set env_config max_actions_per_turn to 1 so the expert answers one word a turn)")

    async def pairs(self, trials, ctx):
        from .methods.process.ipr import ipr_step_pairs
        env, ic = self.cfg.env, self.cfg.process.ipr
        by_task: dict[int, list[Episode]] = defaultdict(list)
        for ep in _episodes(trials):
            by_task[ep.task_seed].append(ep)
        tasks = [seed for seed in dict.fromkeys(ep.task_seed for tr in trials for ep in tr.episodes)
                 if seed in self.expert]
        out, sft = [], []
        for seed in tasks:
            _, rows = self.expert[seed]
            sft += rows
            failed = [ep for ep in by_task.get(seed, []) if not ep.success][:self.OUTCOME_PAIRS_PER_TASK]
            out += [PreferencePair("outcome", rows, [(t.prompt_ids, t.completion_ids) for t in ep.turns])
                    for ep in failed]
        # The policy's alternative at every expert step (one batch), then Q of both by Fork.
        steps = [(seed, t) for seed in tasks for t in spaced(len(self.expert[seed][1]), ic.max_steps)]
        gens = await self._generate(ctx, [self.expert[s][1][t][0] for s, t in steps],
                                    [turn_seed(self.cfg.run.seed, ctx.iteration, "ipr", s, t) for s, t in steps])
        points, firsts, which = [], [], []
        for (seed, t), gen in zip(steps, gens):
            answers, rows = self.expert[seed]
            if list(gen.completion_token_ids) == list(rows[t][1]):
                continue        # the policy already takes the expert's step: nothing to compare
            point = prefix_points(env.env_id, seed, answers, env.env_config, env.action_format, env.split, turns=[t])[0]
            points += [point, point]
            firsts += [answers[t], self._answer(gen)]
            which.append((seed, t, list(gen.completion_token_ids)))
        values = await estimate(ctx.client, points, self._rollout_policy(ctx, 1), self._mc(ic.rollouts_per_step),
                                by="fork", first_actions=firsts) if points else []
        expert_returns = [values[2 * i].returns if not values[2 * i].failed else [] for i in range(len(which))]
        alt_returns = [values[2 * i + 1].returns if not values[2 * i + 1].failed else [] for i in range(len(which))]
        step_pairs = ipr_step_pairs(expert_returns, alt_returns, ic.margin, ic.both_directions)
        for sp in step_pairs:
            seed, t, alt_ids = which[sp.step]
            prompt, expert_ids = self.expert[seed][1][t]
            win, lose = (expert_ids, alt_ids) if sp.chosen == "expert" else (alt_ids, expert_ids)
            out.append(PreferencePair("step", [(prompt, win)], [(prompt, lose)]))
        metrics = {"expert_tasks": float(len(tasks)), "alternatives": float(len(which)),
                   "step_pairs": float(len(step_pairs)), "outcome_pairs": float(sum(p.kind == "outcome" for p in out)),
                   "expert_wins": float(sum(sp.chosen == "expert" for sp in step_pairs)),
                   "mc_failed": float(sum(v.failed for v in values)),
                   "mc_env_steps": float(sum(v.env_steps for v in values))}
        return out, sft, metrics


class RRO(_PreferenceMethod):
    """RRO: one walk per task in a live session; at each step candidates are sampled one at a time
    and scored by the mean outcome of m forked rollouts after each, until one's reward reaches the
    previous step's (V(s_0) at the first step); the best and worst seen form a step pair; the
    accepted candidate (or the best) is stepped and the walk goes on."""
    name = "rro"

    async def _walk(self, ctx: Context, seed: int, split: str, searches: list, out: list) -> bool:
        from .rollout.prompting import ContextBuilder
        from .methods.process.rro import reward_rising_search
        env, ro, rc = self.cfg.env, self.cfg.rollout, self.cfg.process.rro
        (sid,) = await ctx.client.open(env.env_id, 1, env.env_config or None, env.action_format)
        try:
            (result,) = await ctx.client.reset([sid], [seed], split=split)
            builder = ContextBuilder(ChatLayout(self.tokenizer), ctx.system_prompt, ro.template, ro.history_turns,
                                     ro.response_prefix, ro.response_suffix, ctx.admissible)
            builder.new_episode("")
            answers: list[str] = []
            policy = self._rollout_policy(ctx, 2 + seed)
            settings = self._mc(rc.rollouts_per_prefix)

            def point():
                return StatePoint(sid, env.env_id, seed, tuple(answers), dict(env.env_config), env.action_format,
                                  result, split)

            (v0,) = await estimate(ctx.client, [point()], policy, settings, by="fork")
            if v0.failed:
                raise RuntimeError(v0.error)
            previous = v0.value
            limit = ro.max_turns or 10_000
            while not (result.done or result.truncated) and len(answers) < limit:
                prompt_ids, user_ids = builder.prompt_ids(result.observation.text, result.turn)
                candidates, rewards = [], []
                while True:
                    k = len(candidates)
                    (gen,) = await self._generate(ctx, [prompt_ids], [turn_seed(self.cfg.run.seed, ctx.iteration,
                                                                                "rro", seed, len(answers), k)])
                    (v,) = await estimate(ctx.client, [point()], policy, settings, by="fork",
                                          first_actions=[self._answer(gen)])
                    if v.failed:
                        raise RuntimeError(v.error)
                    candidates.append(gen)
                    rewards.append(v.value)
                    if v.value >= previous or len(rewards) == rc.max_candidates:
                        break
                search = reward_rising_search(rewards, previous, rc.max_candidates)
                searches.append(search)
                if search.pair is not None:
                    best, worst = search.pair
                    out.append(PreferencePair("step", [(prompt_ids, list(candidates[best].completion_token_ids))],
                                              [(prompt_ids, list(candidates[worst].completion_token_ids))]))
                gen = candidates[search.chosen]
                answer = self._answer(gen)
                builder.record(result.observation.text, user_ids, list(gen.completion_token_ids), answer)
                (result,) = await ctx.client.step([(sid, answer)])
                if result.status.code:
                    raise RuntimeError(result.status.message)
                answers.append(answer)
                previous = search.rewards[search.chosen]
            return bool(result.success)
        finally:
            with contextlib.suppress(Exception):
                await ctx.client.close_sessions([sid])

    async def pairs(self, trials, ctx):
        from .methods.process.rro import mean_explored
        tasks = list(dict.fromkeys((ep.task_seed, ep.split) for tr in trials for ep in tr.episodes))
        searches: list = []
        out: list = []
        walks = await asyncio.gather(*(self._walk(ctx, seed, split, searches, out) for seed, split in tasks),
                                     return_exceptions=True)
        errors = [w for w in walks if isinstance(w, BaseException)]
        if errors:
            log.warning("rro: %d of %d walks failed (%s)", len(errors), len(walks), errors[0])
        return out, [], {"walks": float(len(walks) - len(errors)), "walks_failed": float(len(errors)),
                         "walk_success": _mean([float(w) for w in walks if not isinstance(w, BaseException)]),
                         "steps_searched": float(len(searches)), "step_pairs": float(len(out)),
                         "candidates_per_step": mean_explored(searches)}


# -- ARPO -------------------------------------------------------------------------------------------------
class ARPO(ProcessMethod):
    """ARPO: the training trials are played with entropy-guided branching over Fork
    (rollout/branching.py): N whole trajectories per task, Z branches from each turn whose window
    entropy rose enough over the trajectory's first, the rest of M as independent trajectories.
    The update is the configured estimator's on the M trajectories of each task; with GRPO that is
    ARPO's soft advantage (each trajectory's normalised return on all its tokens, shared prefix
    turns included in every trajectory through them)."""
    name = "arpo"
    collects = True

    def __init__(self, cfg, policy_model, tokenizer, seed: int = 0):
        # No step scorer: ARPO needs no learned reward.
        self.cfg = cfg
        self.tokenizer = tokenizer
        a = cfg.process.arpo
        if cfg.rollout.episodes_per_trial != 1:
            raise ValueError("process.method arpo branches within single episodes: rollout.episodes_per_trial must be 1")
        if a.advantage_mode != "soft":
            # A shared prefix turn is one sample in each trajectory through it, so giving each copy
            # the branches' mean advantage (hard) sums to what soft gives; hard only differs once shared
            # tokens are trained once, which needs samples deduplicated across trajectories.
            raise ValueError(f"process.arpo.advantage_mode {a.advantage_mode!r} is not wired into training "
                             f"(shared prefix turns are a sample in every trajectory through them): use soft")
        if cfg.process.mc_max_alive < a.total_rollouts:
            raise ValueError(f"process.mc_max_alive ({cfg.process.mc_max_alive}) must hold one task's "
                             f"M = {a.total_rollouts} sessions (process.arpo.total_rollouts)")

    async def collect(self, tasks, ctx):
        from .rollout.branching import BranchingRollout
        rollout = BranchingRollout(ctx.client, ctx.policy, self.tokenizer, self.cfg, ctx.iteration)
        rollout.admissible = ctx.admissible
        return await rollout.collect(tasks)


def build_method(cfg: TrainConfig, policy_model, tokenizer, sync_client=None,
                 allowed_ids: Sequence[int] | None = None) -> ProcessMethod | None:
    """The configured method (None for process.method ""); InversePRM's demonstrations come from
    process.demos, or are played live through `sync_client` (a blocking EnvClient/RoutedClient)."""
    method, seed = cfg.process.method, cfg.run.seed
    if not method:
        return None
    if method == "agentprm":
        return AgentPRM(cfg, policy_model, tokenizer, seed)
    if method == "progrm":
        return ProgRM(cfg, policy_model, tokenizer, seed)
    if method == "rro":
        return RRO(cfg, policy_model, tokenizer, allowed_ids, seed)
    if method == "arpo":
        return ARPO(cfg, policy_model, tokenizer, seed)
    if method in ("inverse_prm", "ipr"):
        if cfg.process.demos:
            from .collect import load_records
            records = load_records(cfg.process.demos)
        else:
            if sync_client is None:
                raise ValueError(f"{method} needs demonstrations: process.demos, or a client to play the expert")
            count = cfg.process.expert_episodes if method == "inverse_prm" else cfg.env.num_tasks
            records = play_demonstrations(sync_client, cfg, count)
        if method == "ipr":
            return IPR(cfg, policy_model, tokenizer, records, allowed_ids, seed)
        return InversePRM(cfg, policy_model, tokenizer, records, seed)
    raise ValueError(f"process.method {method!r} has no training step in this module")
