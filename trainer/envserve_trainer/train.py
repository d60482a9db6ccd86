"""The training loop: collect over gRPC, score, estimate advantages, update, evaluate, checkpoint.

    for each iteration:
        tasks   = the next tasks_per_iteration task seeds (cycled), this rank's share of them
        trials  = K trials per task from the env service (rollout.RolloutEngine)
        judged  = the judge service's scores on the trials' reasoning (when configured)
        process = a process-reward method's reward for every turn (process/training.py), if configured;
                  ARPO instead plays the trials itself, branching over Fork (process/branching.py)
        samples = per-token advantages from the configured estimator (samples.build_samples)
        update  = clipped policy loss + KL to the reference (learner.Learner)
        log     = metrics.jsonl (training summary, loss, timings), curves.png, a checkpoint

Everything reaches the environments through envserve.client: one replica by address, or every
replica of a Redis directory.
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from .config.train_config import TrainConfig
from .evaluation import MetricsLog, Progress, summarize
from .policies.vision import vision_codec
from .rollout.engine import RolloutEngine, Task
from .rollout.trajectory import Trial
from .samples.build import build_samples, usable
from .update.distributed import Dist
from .update.learner import Learner, finite, latest_checkpoint

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
CURVES_FILE = "curves.png"
REFERENCE_DIR = "reference"
PREFERENCE_METHODS = ("ipr", "rro")


@dataclass
class Connection:
    env_address: str = ""
    directory: str = ""
    judge_address: str = ""
    token: str | None = None
    # State tokens (a judge's) that may read the ground truth of the sessions this run opens.
    state_readers: tuple = ()
    # The name the replicas record this run's finished episodes under (rollout.task_sampler
    # learnability sets it); empty: nothing recorded.
    stats_scope: str = ""

    def env_client(self):
        from envserve.client import AsyncEnvClient, AsyncRoutedClient
        return self._client(AsyncRoutedClient, AsyncEnvClient)

    def sync_client(self):
        """A blocking client (EnvClient or RoutedClient), for the few calls made outside the rollout
        loop (the random-init tokenizer's corpus)."""
        from envserve.client import EnvClient, RoutedClient
        return self._client(RoutedClient, EnvClient)

    def _client(self, routed, direct):
        """`routed` over the directory when one is given, else `direct` to the one env address."""
        kw = dict(token=self.token, state_readers=self.state_readers, stats_scope=self.stats_scope)
        if self.directory:
            return routed(self.directory, **kw)
        if not self.env_address:
            raise ValueError("give an env address (--env-address) or a directory (--directory)")
        return direct(self.env_address, **kw)

    def judge_client(self):
        if not self.judge_address:
            return None
        from envserve.client.judge import AsyncJudgeClient
        return AsyncJudgeClient(self.judge_address, token=self.token)


def allowed_token_ids(tokenizer, words: Sequence[str], max_new_tokens: int = 2) -> list[int] | None:
    """The token ids a restricted vocabulary allows: each word's tokens, and the stop token unless an
    answer is a single token (then stopping first would only give an empty answer)."""
    if not words:
        return None
    ids = {int(tokenizer.eos_token_id)} if max_new_tokens != 1 else set()
    for w in words:
        ids.update(tokenizer(w, add_special_tokens=False)["input_ids"])
    return sorted(ids)


def env_tokenizer(cfg: TrainConfig, connection: "Connection | None"):
    """A random-init policy's tokenizer, built from the training env's texts read through `connection`."""
    from .models.small import build_tokenizer, corpus_from_envs
    if connection is None:
        raise ValueError("model.random_init builds its tokenizer from the env's texts: it needs a connection")
    client = connection.sync_client()
    try:
        return build_tokenizer(corpus_from_envs(client, (cfg.env.env_id,)))
    finally:
        client.close()


def build_policy_model(cfg: TrainConfig, device: str, connection: "Connection | None" = None):
    """(model, tokenizer): the configured pretrained model, or with model.random_init a random-weight
    one whose tokenizer is built from the training env's texts, read through `connection`."""
    from .models.pretrained import load_pretrained, train_top_layers
    m = cfg.model
    if not m.random_init:
        model, tok = load_pretrained(m.path, device, m.dtype, m.gguf_file)
    else:
        from .models.small import build_small_model
        tok = env_tokenizer(cfg, connection)
        model = build_small_model(tok, m.random_init, seed=m.seed).to(device)
    train_top_layers(model, m.trainable_layers)
    return model, tok


def build_vision_policy_model(cfg: TrainConfig, device: str, connection: "Connection | None" = None):
    """(model, processor) of model.vision's architecture: random weights (model.random_init, the
    tokenizer built from the env's texts as build_policy_model does) or a local folder (model.path)."""
    from .models.pretrained import train_top_layers
    from .models.vision import build_vlm, load_vlm
    m = cfg.model
    if not m.random_init:
        model, processor = load_vlm(m.path, device)
    else:
        model, processor = build_vlm(m.vision, env_tokenizer(cfg, connection), m.random_init, seed=m.seed)
        model = model.to(device)
    train_top_layers(model, m.trainable_layers)
    return model, processor


def task_schedule(cfg: TrainConfig, iteration: int, sampler=None) -> list[Task]:
    """The iteration's tasks: the training seeds in order, cycling, or drawn by `sampler`
    (envserve.client.sampling, over the training seeds as task ids)."""
    env, n = cfg.env, cfg.rollout.tasks_per_iteration
    if sampler is not None:
        # Different tasks, so each is one group (fewer tasks than n: some twice).
        drawn = sampler.sample_distinct(n)
        while len(drawn) < n:
            drawn += sampler.sample_distinct(n - len(drawn))
        return [Task(int(task_id), env.split) for task_id in drawn]
    start = (iteration * n) % env.num_tasks
    return [Task(env.seed_start + (start + i) % env.num_tasks, env.split) for i in range(n)]


def task_sampler(cfg: TrainConfig):
    """The learnability sampler over the training seeds, or None for the in-order cycle."""
    r = cfg.rollout
    if r.task_sampler == "uniform":
        return None
    from envserve.client.sampling import make_sampler
    seeds = [str(cfg.env.seed_start + i) for i in range(cfg.env.num_tasks)]
    return make_sampler(r.task_sampler, seeds, seed=cfg.run.seed, floor=r.sampler_floor,
                        cost_power=r.sampler_cost_power, cost=r.sampler_cost)


def eval_task_sets(cfg: TrainConfig) -> dict[str, list[Task]]:
    """What evaluation plays: every training task, and the held-out seeds when configured."""
    env = cfg.env
    split = env.eval_split or env.split
    sets = {"train_tasks": [Task(env.seed_start + i, split) for i in range(env.num_tasks)]}
    if env.eval_tasks:
        sets["held_out"] = [Task(env.eval_seed_start + i, split) for i in range(env.eval_tasks)]
    return sets


async def judge_trials(judge, trials: Sequence[Trial], env_id: str, scope: str) -> int:
    """Asks the judge service for grounding and world-modelling scores of every turn that gave them;
    returns how many items came back scored. A failed item leaves its turn unscored. `scope` names
    the repetition counts the texts join (one per training run: envserve.client.judge.new_scope), so
    what else the judge scored, another run or an evaluation, does not change these scores."""
    from envserve.client.judge import JudgeTask
    fields = {"observation": "grounding", "prediction": "world_modeling"}
    items, where = [], {}
    for trial in trials:
        for ep in trial.episodes:
            for t in ep.turns:
                for reasoning_key, field in fields.items():
                    text = t.reasoning.get(reasoning_key)
                    if text:
                        key = f"{ep.session_id}:{ep.env_trial}:{ep.env_episode}:{t.turn}:{field}"
                        items.append(JudgeTask(key=key, session_id=ep.session_id, turn=t.turn, field=field,
                                               text=text, episode=ep.env_episode, env_id=env_id,
                                               trial=ep.env_trial, scope=scope))
                        where[key] = (t, field)
    scored = 0
    if items:
        async for r in judge.judge(items):
            if r.status.code == 0 and r.key in where:
                turn, field = where[r.key]
                turn.judge_scores[field] = float(r.score)
                turn.judge_verdicts[field] = bool(r.verdict)
                scored += 1
    return scored


class Trainer:
    def __init__(self, cfg: TrainConfig, out_dir: str | Path, connection: Connection, device: str = "cpu",
                 resume: bool = False):
        self.cfg = cfg
        self.out = Path(out_dir)
        self.connection = connection
        self.dist = Dist.from_env(device)
        self.device = self.dist.device(device)
        # The run's repetition counts on the judge, one scope for all ranks (rank 0's name); a judge
        # serving other runs and evaluations keeps theirs apart.
        from envserve.client.judge import new_scope
        self.judge_scope = self.dist.gather(new_scope("train"))[0]
        # The replicas record the training episodes (not the tokenizer corpus's) under one scope
        # for all ranks, where the learnability sampler reads them.
        self.stats_scope = self.dist.gather(new_scope("stats"))[0] if cfg.rollout.task_sampler != "uniform" else ""
        seed = cfg.run.seed + self.dist.rank
        random.seed(seed)
        np.random.seed(seed % (2 ** 32))
        torch.manual_seed(seed)
        if cfg.model.backend != "hf":
            raise ValueError(f"training needs a trainable backend: model.backend {cfg.model.backend!r} only "
                             f"serves rollouts and evaluation (use hf; vllm rollouts: see README)")
        self.codec = None
        if cfg.model.vision:
            model, processor = build_vision_policy_model(cfg, self.device, connection)
            self.codec = vision_codec(cfg, processor)
            self.tokenizer = processor.tokenizer
        else:
            model, self.tokenizer = build_policy_model(cfg, self.device, connection)
        self.allowed_ids = allowed_token_ids(self.tokenizer, cfg.rollout.allowed_words, cfg.rollout.max_new_tokens)
        from .models.pretrained import load_pretrained, save_model
        reference = None
        # The DPO family (process.method ipr, rro) compares against a reference even without a KL term.
        if cfg.update.kl_coef > 0 or cfg.process.method in PREFERENCE_METHODS:
            ref_dir = self.out / REFERENCE_DIR
            # The reference is the starting policy; a resumed run must keep the original one.
            if resume and ref_dir.exists():
                if self.codec is not None:
                    from .models.vision import load_vlm
                    reference, _ = load_vlm(ref_dir, self.device)
                else:
                    reference, _ = load_pretrained(str(ref_dir), self.device, cfg.model.dtype)
            else:
                import copy
                reference = copy.deepcopy(model)
                if self.dist.is_main:
                    save_model(ref_dir, reference, self.codec.processor if self.codec else self.tokenizer)
        from .policies.hf import HFPolicy
        from .policies.hf import vocabulary_mask
        allowed = vocabulary_mask(self.allowed_ids, int(model.config.get_text_config().vocab_size))
        if self.codec is not None:
            from .policies.vision import HFVisionPolicy
            self.learner = Learner(model, self.tokenizer, cfg, self.dist, reference=reference, codec=self.codec,
                                   allowed=allowed)
            self.policy = HFVisionPolicy(self.learner.rollout_model, self.codec, allowed_token_ids=self.allowed_ids)
            # Sampling never draws the image placeholder; scoring masks the same vocabulary.
            self.learner.allowed = self.policy.allowed
        else:
            self.learner = Learner(model, self.tokenizer, cfg, self.dist, reference=reference, allowed=allowed)
            self.policy = HFPolicy(self.learner.rollout_model, self.tokenizer, allowed_token_ids=self.allowed_ids)
        self.start_iteration = 0
        if resume:
            ckpt = latest_checkpoint(self.out)
            if ckpt is not None:
                state = self.learner.load(ckpt)
                self.start_iteration = int(state["iteration"])
                log.info("resumed from %s (iteration %d)", ckpt, self.start_iteration)
        self.metrics = MetricsLog(self.out / METRICS_FILE)
        self.process = self._process_method(model)

    def _process_method(self, model):
        """The configured process-reward method (process/training.py), or None."""
        if not self.cfg.process.method:
            return None
        from .process_training import build_method
        needs_client = self.cfg.process.method in ("inverse_prm", "ipr") and not self.cfg.process.demos
        client = self.connection.sync_client() if needs_client else None
        try:
            return build_method(self.cfg, model, self.tokenizer, client, self.allowed_ids)
        finally:
            if client is not None:
                client.close()

    # -- one iteration -------------------------------------------------------------------------------
    async def _collect(self, engine: RolloutEngine, judge, tasks: list[Task], group_size: int, iteration: int,
                       temperature: float | None = None, method_ctx=None
                       ) -> tuple[list[Trial], dict[str, float], dict[str, float]]:
        """(trials, timings, the process method's metrics): K trials per task from the rollout engine,
        or, given a method that plays them itself (ARPO) and its Context, that method's trials."""
        t0 = time.monotonic()
        process: dict[str, float] = {}
        if method_ctx is not None:
            trials, process = await self.process.collect(tasks, method_ctx)
        else:
            trials = await engine.collect(tasks, group_size, iteration, temperature)
        timing = {"rollout_s": time.monotonic() - t0}
        if judge is not None and self.cfg.algo.use_judge:
            t1 = time.monotonic()
            timing["judged_items"] = float(await judge_trials(judge, trials, self.cfg.env.env_id, self.judge_scope))
            timing["judge_s"] = time.monotonic() - t1
        return trials, timing, process

    def evaluate_trials(self, trials: list[Trial]) -> dict[str, Any]:
        everything = [t for part in self.dist.gather(trials) for t in part]
        return summarize(everything)

    async def run(self, iterations: int | None = None, max_seconds: float | None = None) -> list[dict[str, Any]]:
        """Train up to `iterations` (run.iterations by default); with max_seconds, stop after the
        first iteration that ends past that budget (it is evaluated and checkpointed as the last)."""
        cfg = self.cfg
        started = time.monotonic()
        total = cfg.run.iterations if iterations is None else iterations
        records: list[dict[str, Any]] = []
        client = dataclasses.replace(self.connection, stats_scope=self.stats_scope).env_client()
        judge = self.connection.judge_client() if cfg.algo.use_judge else None
        if cfg.algo.use_judge and judge is None:
            raise ValueError("algo.use_judge is set but no judge address was given (--judge-address)")
        engine = RolloutEngine(client, self.policy, self.tokenizer, cfg, seed=cfg.run.seed)
        sampler = task_sampler(cfg)
        progress = Progress(total=total - self.start_iteration, desc="train",
                            enabled=cfg.run.progress and self.dist.is_main)
        try:
            for it in range(self.start_iteration, total):
                t0 = time.monotonic()
                if sampler is not None:
                    sampler.update(await client.task_stats(cfg.env.env_id))
                # Every rank plays its share of rank 0's list (their stats may be read apart).
                tasks = self.dist.shard(self.dist.gather(task_schedule(cfg, it, sampler))[0])
                method_ctx = None
                if self.process is not None and self.process.collects:
                    from .process_training import Context
                    method_ctx = Context(client, self.policy, engine.system_prompt, it, engine.admissible)
                trials, timing, process = await self._collect(engine, judge, tasks, cfg.rollout.group_size, it,
                                                              method_ctx=method_ctx)
                pairs = None
                if self.process is not None and method_ctx is None:
                    from .process_training import Context
                    t_process = time.monotonic()
                    ctx = Context(client, self.policy, engine.system_prompt, it, engine.admissible)
                    if self.process.preference:
                        pairs, sft_rows, process = await self.process.pairs(trials, ctx)
                    else:
                        process = await self.process.annotate(trials, ctx)
                    timing["process_s"] = time.monotonic() - t_process
                t1 = time.monotonic()
                if pairs is not None:
                    update = await asyncio.to_thread(self._preference_update, pairs, sft_rows, cfg.run.seed * 100_003 + it)
                else:
                    samples = build_samples(trials, cfg, self.learner.values if cfg.algo.needs_critic else None)
                    update = await asyncio.to_thread(self.learner.update, samples, cfg.run.seed * 100_003 + it)
                timing["update_s"] = time.monotonic() - t1
                train_summary = self.evaluate_trials(trials)["overall"]
                dropped = len(trials) - len(usable(trials))
                record: dict[str, Any] = {"train": train_summary, "update": update, "timing": timing,
                                          "dropped_trials": dropped}
                if process:
                    record["process"] = process
                if not finite(update):
                    raise FloatingPointError(f"iteration {it}: non-finite update metrics {update}")
                done = it + 1
                out_of_time = max_seconds is not None and time.monotonic() - started > max_seconds
                last = done == total or out_of_time
                if cfg.run.eval_every and (done % cfg.run.eval_every == 0 or last):
                    record["eval"] = await self.evaluate(engine, done)
                if cfg.run.checkpoint_every and (done % cfg.run.checkpoint_every == 0 or last):
                    self.learner.save(self.out, {"config": cfg.to_dict()}, keep=cfg.run.keep_checkpoints)
                record["timing"]["iteration_s"] = time.monotonic() - t0
                if self.dist.is_main:
                    records.append(self.metrics.log(done, **record))
                progress.update(1, success=train_summary.get("success_rate"), loss=update.get("loss"))
                if out_of_time:
                    break
        finally:
            progress.close()
            await engine.close()
            await client.close()
            if judge is not None:
                await judge.close()
        if self.dist.is_main and records:
            self.plot()
        return records

    def _preference_update(self, pairs, sft_rows, seed: int) -> dict[str, float]:
        """The DPO family's update: the reference is the policy before it (as update.reference
        previous gives the PG methods), so each iteration's pairs move the policy from where it is."""
        p = self.cfg.process
        if self.learner.reference is not None:
            self.learner.reference.load_state_dict(self.learner.model.state_dict())
        if p.method == "ipr":
            beta, weights = p.ipr.beta, {"outcome": p.ipr.outcome_weight, "step": p.ipr.step_weight,
                                         "sft": p.ipr.sft_weight}
        else:
            beta, weights = p.rro.beta, {}
        if not pairs and not sft_rows:
            return {"pairs": 0.0}
        return self.learner.preference_update(pairs, sft_rows, beta, weights, seed)

    async def evaluate(self, engine: RolloutEngine, iteration: int) -> dict[str, Any]:
        """Success and the rest on the training tasks and, if configured, held-out ones."""
        cfg = self.cfg
        out = {}
        for name, tasks in eval_task_sets(cfg).items():
            # Every rank collects (possibly nothing) so the gather below lines up.
            trials = await engine.collect(self.dist.shard(tasks), cfg.run.eval_samples,
                                          iteration=10_000_000 + iteration, temperature=cfg.run.eval_temperature)
            out[name] = self.evaluate_trials(trials)
        return out

    def plot(self) -> Path | None:
        try:
            from .curves import plot_curves
            return plot_curves(self.out / METRICS_FILE, self.out / CURVES_FILE)
        except (ImportError, RuntimeError) as e:   # matplotlib is the optional `plot` extra
            log.warning("no training curves PNG: %s", e)
            return None

    def close(self) -> None:
        self.policy.close()
        self.dist.close()


def policy_folder(checkpoint: str | Path) -> str:
    """The model folder of a checkpoint-N directory (its policy/), or the folder itself."""
    inner = Path(checkpoint) / "policy"
    return str(inner if inner.exists() else checkpoint)


async def evaluate_policy(cfg: TrainConfig, policy, tokenizer, connection: Connection,
                          temperature: float | None = None, samples: int | None = None,
                          task_sets: Sequence[str] | None = None) -> dict[str, Any]:
    """Plays the config's evaluation task sets (all, or those named) with `policy` through the service:
    a summary per set. Temperature and samples per task default to run.eval_temperature/eval_samples."""
    client = connection.env_client()
    engine = RolloutEngine(client, policy, tokenizer, cfg, seed=cfg.run.seed)
    out: dict[str, Any] = {}
    try:
        for name, tasks in eval_task_sets(cfg).items():
            if task_sets is not None and name not in task_sets:
                continue
            trials = await engine.collect(tasks, cfg.run.eval_samples if samples is None else samples, iteration=-1,
                                          temperature=cfg.run.eval_temperature if temperature is None else temperature)
            out[name] = summarize(trials)
    finally:
        await engine.close()
        await client.close()
    return out


async def evaluate_checkpoint(cfg: TrainConfig, checkpoint: str | Path | None, connection: Connection,
                              device: str = "cpu", policy=None, tokenizer=None) -> dict[str, Any]:
    """Evaluate a saved policy, the config's model (no checkpoint), or a given policy (e.g. the
    openai backend) on the configured tasks."""
    if policy is None and cfg.model.vision:
        from .policies.vision import HFVisionPolicy
        from .models.vision import load_vlm
        model, processor = load_vlm(policy_folder(checkpoint) if checkpoint else cfg.model.path, device)
        policy = HFVisionPolicy(model, vision_codec(cfg, processor), allowed_token_ids=allowed_token_ids(
            processor.tokenizer, cfg.rollout.allowed_words, cfg.rollout.max_new_tokens))
        tokenizer = processor.tokenizer
    if policy is None:
        from .models.pretrained import load_pretrained
        from .policies.hf import HFPolicy
        model, tokenizer = load_pretrained(policy_folder(checkpoint) if checkpoint else cfg.model.path, device,
                                           cfg.model.dtype, "" if checkpoint else cfg.model.gguf_file)
        policy = HFPolicy(model, tokenizer, allowed_token_ids=allowed_token_ids(tokenizer, cfg.rollout.allowed_words,
                                                                             cfg.rollout.max_new_tokens))
    return await evaluate_policy(cfg, policy, tokenizer, connection)
