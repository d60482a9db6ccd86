"""The update: a clipped policy loss on action tokens, KL to a frozen reference, an optional critic.

    ratio_j = exp(log pi(a_j) - log pi_old(a_j))
    L_pg    = -min(ratio_j A_j, clip(ratio_j, 1 - eps, 1 + eps_high) A_j)          (PPO / GRPO)
    L_kl    = exp(ref_j - logp_j) - (ref_j - logp_j) - 1                          (the k3 estimator,
              unbiased and non-negative, as GRPO uses it)
    L       = sum over action tokens of (L_pg + kl_coef L_kl) / action tokens in the mini-batch
              (+ value_coef * the critic's squared error, for the GAE estimators)

pi_old is the policy that sampled: its log-probabilities are recomputed once per iteration before
the first step (with the same temperature and vocabulary restriction as sampling), so the ratio
starts at exactly 1 and numerical differences between cached generation and a full forward pass
never look like policy change; the sampler's own values are kept to report that difference. With
update.rescore_old off, the sampler's own values are pi_old (a forward pass saved per iteration).

Gradient accumulation: micro-batches of `micro_batch_size` samples add up to a mini-batch of
`mini_batch_size` (all samples when 0), one optimizer step each. Under torchrun the model is wrapped
in DDP or FSDP (see distributed.py) and gradients sync on the last micro-batch of each mini-batch.
"""
from __future__ import annotations

import json
import math
import random
import shutil
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from ..config.train_config import TrainConfig
from ..policies.hf import positions, scoring_layout, sequence_logprobs
from ..samples.build import Sample
from .distributed import Dist

STATE_FILE = "trainer_state.json"


class ValueHead(torch.nn.Module):
    """A critic: the policy's transformer body (a copy; a VLM's with its vision tower, so the critic
    sees the images too) and a scalar head on each position."""

    def __init__(self, policy_model):
        super().__init__()
        import copy
        body = copy.deepcopy(policy_model.model if hasattr(policy_model, "model") else policy_model)
        self.body = body
        self.head = torch.nn.Linear(policy_model.config.get_text_config().hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, input_ids, attention_mask, position_ids=None, **vision):
        kwargs = dict(vision) if vision else {"position_ids": position_ids}
        hidden = self.body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                           **kwargs).last_hidden_state
        return self.head(hidden).squeeze(-1)


def critic_values(critic: torch.nn.Module, prompt_ids: Sequence[Sequence[int]],
                  completion_ids: Sequence[Sequence[int]], pad_token_id: int, codec=None,
                  images: Sequence[Sequence[bytes]] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, C] values of the states each completion token was chosen in (the position before it).
    With a vision codec, `images[i]` are the PNGs row i's prompt holds."""
    device = next(critic.parameters()).device
    ids, mask, completion_mask = scoring_layout(prompt_ids, completion_ids, pad_token_id, device)
    width = completion_mask.shape[1]
    if codec is not None and images is not None and any(images):
        from ..policies.vision import forward_kwargs
        kwargs = forward_kwargs(codec, ids, mask, codec.model_inputs(images, device, prompt_ids=prompt_ids))
        v = critic(**kwargs)
    else:
        v = critic(ids, mask, positions(mask))
    return v[:, -width - 1:-1], completion_mask.bool()


class Learner:
    def __init__(self, model, tokenizer, cfg: TrainConfig, dist: Dist, allowed: torch.Tensor | None = None,
                 reference=None, codec=None):
        self.cfg = cfg
        self.codec = codec                       # a VLM's (policies.vision.VisionCodec): samples carry images
        self.dist = dist
        self.tokenizer = tokenizer
        self.pad_token_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)
        self.allowed = allowed
        self.model = model                       # the module being trained (unwrapped)
        self.reference = reference
        if reference is not None:
            reference.eval().requires_grad_(False)
        # FSDP shards `model` in place, so rollouts need a full copy (see distributed.py).
        import copy
        self.rollout_model = copy.deepcopy(model) if dist.active and cfg.update.strategy == "fsdp" else model
        self.train_model = dist.wrap(model, cfg.update.strategy)
        up = cfg.update
        self.optimizer = torch.optim.AdamW([p for p in self.train_model.parameters() if p.requires_grad], lr=up.lr,
                                           weight_decay=up.weight_decay)
        self.critic = None
        self.critic_optimizer = None
        if cfg.algo.needs_critic:
            self.critic = ValueHead(model).to(next(model.parameters()).device)
            self.train_critic = dist.wrap(self.critic, cfg.update.strategy)
            self.critic_optimizer = torch.optim.AdamW(self.train_critic.parameters(), lr=up.critic_lr)
        self.iteration = 0

    # -- critic values for the GAE estimators ---------------------------------------------------------
    @torch.no_grad()
    def values(self, prompt_ids, completion_ids, images=None) -> list[np.ndarray]:
        if self.critic is None:
            raise RuntimeError("no critic: the estimator does not use one")
        out: list[np.ndarray] = []
        mb = self.cfg.update.micro_batch_size
        for s in range(0, len(prompt_ids), mb):
            p, c = prompt_ids[s:s + mb], completion_ids[s:s + mb]
            v, m = critic_values(self.critic, p, c, self.pad_token_id, self.codec,
                                 images[s:s + mb] if images is not None else None)
            out += [v[i, :len(c[i])].double().cpu().numpy() for i in range(len(c))]
        return out

    # -- one iteration's update ------------------------------------------------------------------------
    def _logprobs(self, model, batch: Sequence[Sample], entropy: bool = False):
        # A wrapped (DDP/FSDP) module must see one forward per backward: no separate prefix pass.
        wrapped = model is self.train_model and self.train_model is not self.model
        if self.codec is not None:
            from ..policies.vision import vision_sequence_logprobs
            return vision_sequence_logprobs(model, self.codec, [s.prompt_ids for s in batch],
                                            [s.completion_ids for s in batch], [s.images for s in batch],
                                            temperature=self.cfg.rollout.temperature or 1.0,
                                            pad_token_id=self.pad_token_id, allowed=self.allowed,
                                            return_entropy=entropy)
        return sequence_logprobs(model, [s.prompt_ids for s in batch], [s.completion_ids for s in batch],
                                 temperature=self.cfg.rollout.temperature or 1.0, pad_token_id=self.pad_token_id,
                                 allowed=self.allowed, return_entropy=entropy, share_prefix=not wrapped)

    @staticmethod
    def _padded(rows: Sequence[Sequence[float]], width: int, device) -> torch.Tensor:
        out = torch.zeros((len(rows), width), dtype=torch.float32)
        for i, r in enumerate(rows):
            out[i, :len(r)] = torch.as_tensor(np.asarray(r, dtype=np.float32))
        return out.to(device)

    def _schedule(self, n_samples: int, seed: int) -> list[list[list[int]]]:
        """Mini-batches of micro-batches of sample indices, over all epochs. Under torchrun every
        rank must run as many forward/backward passes as the others (FSDP gathers weights on each
        forward, DDP reduces on each synced backward), so shorter schedules are padded with empty
        micro-batches, which run a zero-weighted pass."""
        up = self.cfg.update
        order = list(range(n_samples))
        random.Random(seed).shuffle(order)
        mini = up.mini_batch_size or max(n_samples, 1)
        mb = up.micro_batch_size
        plan = []
        for _epoch in range(up.epochs):
            for m0 in range(0, len(order), mini):
                idx = order[m0:m0 + mini]
                plan.append([idx[c:c + mb] for c in range(0, len(idx), mb)])
        if self.dist.active:
            shapes = self.dist.gather([len(m) for m in plan])
            n_mini = max(len(sh) for sh in shapes)
            plan += [[] for _ in range(n_mini - len(plan))]
            for i in range(n_mini):
                want = max(sh[i] if i < len(sh) else 0 for sh in shapes)
                plan[i] += [[] for _ in range(want - len(plan[i]))]
        return plan

    def update(self, samples: Sequence[Sample], seed: int = 0) -> dict[str, float]:
        up = self.cfg.update
        if up.reference == "previous" and self.reference is not None:
            # KL to the policy as it was before this update (the one that sampled these samples).
            self.reference.load_state_dict(self.model.state_dict())
        device = next(self.model.parameters()).device
        mb = up.micro_batch_size
        # pi_old and the reference, once per iteration, on unwrapped modules (no collectives).
        old: list[torch.Tensor] = []
        ref: list[torch.Tensor] = []
        mismatch, mismatch_n = 0.0, 0
        with torch.no_grad():
            for s in range(0, len(samples), mb):
                batch = samples[s:s + mb]
                if not up.rescore_old:
                    width = max(len(x.completion_ids) for x in batch)
                    lp = self._padded([x.behaviour_logprobs for x in batch], width, device)
                    old += [lp[i] for i in range(len(batch))]
                else:
                    lp, m = self._logprobs(self.rollout_model, batch)
                    behaviour = self._padded([x.behaviour_logprobs for x in batch], lp.shape[1], device)
                    has = torch.tensor([len(x.behaviour_logprobs) == len(x.completion_ids) for x in batch],
                                       device=device).unsqueeze(1) & m
                    mismatch += float((lp - behaviour).abs()[has].sum())
                    mismatch_n += int(has.sum())
                    old += [lp[i] for i in range(len(batch))]
                if self.reference is not None and up.kl_coef > 0:
                    rl, _ = self._logprobs(self.reference, batch)
                    ref += [rl[i] for i in range(len(batch))]
        plan = self._schedule(len(samples), seed)
        if not plan:
            return {"samples": 0.0}
        stats: dict[str, list[float]] = {k: [] for k in ("loss", "pg_loss", "kl", "entropy", "clip_frac",
                                                          "value_loss", "grad_norm")}
        self.train_model.train()
        for chunks in plan:
            tokens = sum(len(samples[i].completion_ids) for chunk in chunks for i in chunk)
            self.optimizer.zero_grad(set_to_none=True)
            if self.critic_optimizer is not None:
                self.critic_optimizer.zero_grad(set_to_none=True)
            for ci, chunk in enumerate(chunks):
                sync = ci == len(chunks) - 1
                with self.dist.no_sync(self.train_model, enabled=not sync):
                    if chunk:
                        self._micro_step(samples, chunk, old, ref, tokens, stats, device)
                    else:
                        self._idle_step(device)
            params = [p for p in self.train_model.parameters() if p.grad is not None]
            norm = torch.nn.utils.clip_grad_norm_(params, up.max_grad_norm) if params else torch.tensor(0.0)
            if tokens:
                stats["grad_norm"].append(float(norm))
            self.optimizer.step()
            if self.critic_optimizer is not None:
                torch.nn.utils.clip_grad_norm_(list(self.train_critic.parameters()), up.max_grad_norm)
                self.critic_optimizer.step()
        self.model.eval()
        self.sync_rollout_model()
        self.iteration += 1
        out = {k: float(np.mean(v)) for k, v in stats.items() if v}
        out["samples"] = float(len(samples))
        out["action_tokens"] = float(sum(len(s.completion_ids) for s in samples))
        if up.rescore_old:
            out["sampler_logprob_gap"] = mismatch / max(mismatch_n, 1)
        return out

    def preference_update(self, pairs: Sequence[Any], sft_rows: Sequence[tuple[Sequence[int], Sequence[int]]] = (),
                          beta: float = 0.1, weights: dict[str, float] | None = None, seed: int = 0) -> dict[str, float]:
        """The DPO family's step (IPR, RRO): sigmoid DPO on each kind of pair ("outcome", "step")
        against the reference, plus an SFT term on `sft_rows`, weighted by `weights` (kind -> w, and
        "sft"); pairs in mini-batches of update.micro_batch_size, one optimizer step each, for
        update.epochs passes. A single process only (no DDP alignment of uneven pair counts)."""
        from ..methods.process.dpo import dpo_loss, dpo_margins
        from .losses import rows_sft_loss, side_logprobs
        if self.reference is None:
            raise RuntimeError("a preference update needs a reference policy")
        if self.dist.active:
            raise RuntimeError("the preference update runs in one process; torchrun is not supported for it")
        w = {"outcome": 1.0, "step": 1.0, "sft": 1.0, **(weights or {})}
        up = self.cfg.update
        scoring = dict(temperature=self.cfg.rollout.temperature or 1.0, pad_token_id=self.pad_token_id,
                       allowed=self.allowed)
        rng = random.Random(seed)
        stats: dict[str, list[float]] = {k: [] for k in ("loss", "outcome_loss", "step_loss", "sft_loss",
                                                          "margin", "accuracy", "grad_norm")}
        order = list(range(len(pairs)))
        sft_rows = list(sft_rows)
        mb = up.micro_batch_size
        self.model.train()
        for _ in range(up.epochs):
            rng.shuffle(order)
            batches = [order[s:s + mb] for s in range(0, len(order), mb)] or [[]]
            for b, chunk in enumerate(batches):
                batch = [pairs[i] for i in chunk]
                self.optimizer.zero_grad(set_to_none=True)
                loss = None
                for kind in ("outcome", "step"):
                    these = [p for p in batch if p.kind == kind]
                    if not these:
                        continue
                    pc, pr, rc, rr = side_logprobs(self.model, self.reference, these, **scoring)
                    part = dpo_loss(pc, pr, rc, rr, beta)
                    margins = dpo_margins(pc.detach(), pr.detach(), rc, rr, beta)
                    stats[f"{kind}_loss"].append(float(part.detach()))
                    stats["margin"].append(float(margins.mean()))
                    stats["accuracy"].append(float((margins > 0).float().mean()))
                    loss = w[kind] * part if loss is None else loss + w[kind] * part
                if sft_rows and w["sft"] > 0:
                    # The SFT rows spread over the pass's batches, a share each.
                    share = sft_rows[b::len(batches)]
                    if share:
                        part = rows_sft_loss(self.model, share, **scoring)
                        stats["sft_loss"].append(float(part.detach()))
                        loss = w["sft"] * part if loss is None else loss + w["sft"] * part
                if loss is None:
                    continue
                loss.backward()
                params = [p for p in self.model.parameters() if p.grad is not None]
                stats["grad_norm"].append(float(torch.nn.utils.clip_grad_norm_(params, up.max_grad_norm)))
                self.optimizer.step()
                stats["loss"].append(float(loss.detach()))
        self.model.eval()
        self.sync_rollout_model()
        self.iteration += 1
        out = {k: float(np.mean(v)) for k, v in stats.items() if v}
        out["pairs"] = float(len(pairs))
        out["sft_rows"] = float(len(sft_rows))
        return out

    def _idle_step(self, device) -> None:
        """A zero-weighted forward/backward: keeps this rank in step with ranks that have more samples."""
        ids = torch.tensor([[self.pad_token_id]], device=device)
        mask = torch.ones_like(ids)
        out = self.train_model(input_ids=ids, attention_mask=mask, position_ids=torch.zeros_like(ids), use_cache=False)
        loss = out.logits.sum() * 0.0
        if self.critic is not None:
            loss = loss + self.train_critic(ids, mask, torch.zeros_like(ids)).sum() * 0.0
        loss.backward()

    def _micro_step(self, samples, chunk, old, ref, tokens, stats, device) -> None:
        up = self.cfg.update
        batch = [samples[i] for i in chunk]
        logp, mask, entropy = self._logprobs(self.train_model, batch, entropy=True)
        width = logp.shape[1]
        old_lp = torch.stack([torch.nn.functional.pad(old[i], (0, width - old[i].shape[0])) for i in chunk])
        advantages = self._padded([s.advantages for s in batch], width, device)
        ratio = torch.exp(logp - old_lp)
        high = up.clip_eps_high or up.clip_eps
        clipped = torch.clamp(ratio, 1 - up.clip_eps, 1 + high)
        pg = -torch.minimum(ratio * advantages, clipped * advantages)
        loss_tokens = pg
        kl = torch.zeros_like(pg)
        if ref:
            ref_lp = torch.stack([torch.nn.functional.pad(ref[i], (0, width - ref[i].shape[0])) for i in chunk])
            d = ref_lp - logp
            kl = torch.exp(d) - d - 1
            loss_tokens = pg + up.kl_coef * kl
        maskf = mask.float()
        loss = (loss_tokens * maskf).sum() / max(tokens, 1)
        value_loss = None
        if self.critic is not None:
            values, vmask = critic_values(self.train_critic, [s.prompt_ids for s in batch],
                                          [s.completion_ids for s in batch], self.pad_token_id, self.codec,
                                          [s.images for s in batch])
            returns = self._padded([s.returns if s.returns is not None else np.zeros(len(s.completion_ids))
                                    for s in batch], values.shape[1], device)
            value_loss = (((values - returns) ** 2) * vmask.float()).sum() / max(tokens, 1)
            loss = loss + up.value_coef * value_loss
        loss.backward()
        pg, kl, entropy, ratio, clipped = (x.detach() for x in (pg, kl, entropy, ratio, clipped))
        n = float(maskf.sum())
        if n:
            stats["loss"].append(float(loss.detach()) * tokens / n)
            stats["pg_loss"].append(float((pg * maskf).sum()) / n)
            stats["kl"].append(float((kl * maskf).sum()) / n)
            stats["entropy"].append(float((entropy * maskf).sum()) / n)
            stats["clip_frac"].append(float((((ratio - clipped).abs() > 1e-6).float() * maskf).sum()) / n)
        if value_loss is not None:
            stats["value_loss"].append(float(value_loss.detach()))

    def sync_rollout_model(self) -> None:
        """Bring the rollout copy up to the trained weights (a no-op when they are one module)."""
        if self.rollout_model is not self.model:
            self.rollout_model.load_state_dict(self.dist.full_state_dict(self.train_model))

    # -- checkpoints ---------------------------------------------------------------------------------
    def save(self, out_dir: str | Path, extra: dict[str, Any] | None = None, keep: int = 2) -> Path | None:
        """checkpoint-<iteration>/: the policy (save_pretrained + tokenizer), optimizer, critic, state.
        Written to a temporary name first, so a crash never leaves a half checkpoint as the newest."""
        state_dict = self.dist.full_state_dict(self.train_model)   # collective under FSDP
        optimizer_state = self.dist.full_optimizer_state(self.train_model, self.optimizer)
        if not self.dist.is_main:
            self.dist.barrier()
            return None
        out = Path(out_dir)
        final = out / f"checkpoint-{self.iteration}"
        tmp = out / f".tmp-checkpoint-{self.iteration}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        self.rollout_model.save_pretrained(tmp / "policy", state_dict=state_dict)
        # A VLM's processor holds its tokenizer, image processor and chat template.
        (self.codec.processor if self.codec is not None else self.tokenizer).save_pretrained(tmp / "policy")
        torch.save(optimizer_state, tmp / "optimizer.pt")
        if self.critic is not None:
            torch.save({"critic": self.critic.state_dict(), "optimizer": self.critic_optimizer.state_dict()},
                       tmp / "critic.pt")
        state = {"iteration": self.iteration, **(extra or {})}
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=1))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for old in checkpoints(out)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
        self.dist.barrier()
        return final

    def load(self, checkpoint: str | Path) -> dict[str, Any]:
        path = Path(checkpoint)
        from ..policies.hf import _load_state
        state_dict = dict(_load_state(path / "policy"))
        if self.dist.strategy == "fsdp":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
            set_model_state_dict(self.train_model, state_dict, options=StateDictOptions(full_state_dict=True))
        else:
            self.model.load_state_dict(state_dict, strict=True)
        self.sync_rollout_model()
        try:
            self.dist.load_optimizer_state(self.train_model, self.optimizer,
                                           torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True))
        except ValueError as e:
            raise ValueError(f"{path}: the optimizer state does not fit this model/strategy: {e}") from None
        if self.critic is not None and (path / "critic.pt").exists():
            blob = torch.load(path / "critic.pt", map_location="cpu", weights_only=True)
            self.critic.load_state_dict(blob["critic"])
            self.critic_optimizer.load_state_dict(blob["optimizer"])
        state = json.loads((path / STATE_FILE).read_text())
        self.iteration = int(state["iteration"])
        return state


def checkpoints(out_dir: str | Path) -> list[Path]:
    """Finished checkpoints in iteration order (temporary ones are not listed)."""
    found = []
    for p in Path(out_dir).glob("checkpoint-*"):
        suffix = p.name.split("-", 1)[1]
        if suffix.isdigit() and (p / STATE_FILE).exists():
            found.append((int(suffix), p))
    return [p for _, p in sorted(found)]


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    found = checkpoints(out_dir)
    return found[-1] if found else None


def finite(metrics: dict[str, float]) -> bool:
    return all(math.isfinite(v) for v in metrics.values())

