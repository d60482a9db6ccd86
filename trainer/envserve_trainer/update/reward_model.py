"""The learned step scorer AgentPRM, InversePRM and ProgRM share: a copy of the policy's transformer
body with a scalar head (learner.ValueHead), read at the last token of (context, answer).

    z(s, a) = head(body(prompt_ids + completion_ids))[last completion token]      (a logit)

The input is exactly what the policy saw and wrote at that turn (Turn.prompt_ids, completion_ids),
so the model scores a step in the policy's own layout, and expert turns replayed through
collect.replay_episode land in the same layout. Training keeps a bounded buffer of the newest
examples (older iterations keep counting until pushed out) and minimises the method's loss over
shuffled mini-batches; the loss is the caller's (BCE against Q-hat or progress labels, or
InversePRM's transition classifier), given the logits of a batch.
"""
from __future__ import annotations

import random
from collections import deque
from typing import Any, Callable, Sequence

import torch

from ..policies.hf import positions, scoring_layout
from .learner import ValueHead


class StepScorer:
    """z(s, a) over (prompt ids, completion ids); `fit` trains it with a loss over batches."""

    def __init__(self, policy_model, pad_token_id: int, lr: float, buffer: int, batch_size: int, seed: int = 0):
        device = next(policy_model.parameters()).device
        self.net = ValueHead(policy_model).to(device)
        # The copied body starts as the policy's (frozen layers included): all of it trains here.
        self.net.requires_grad_(True)
        self.optimizer = torch.optim.AdamW(self.net.parameters(), lr=lr)
        self.pad = int(pad_token_id)
        self.batch_size = batch_size
        self.buffer: deque[Any] = deque(maxlen=buffer)
        self.rng = random.Random(seed)

    @property
    def device(self) -> torch.device:
        return next(self.net.parameters()).device

    def logits(self, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]]) -> torch.Tensor:
        """[B] logits, each read at its row's last completion token (the last prompt token when the
        completion is empty)."""
        if not prompt_ids:
            return torch.zeros(0, device=self.device)
        ids, mask, completion_mask = scoring_layout(prompt_ids, completion_ids, self.pad, self.device)
        values = self.net(ids, mask, positions(mask))
        prompt_width = ids.shape[1] - completion_mask.shape[1]
        last = prompt_width + completion_mask.sum(-1) - 1
        return values.gather(1, last.unsqueeze(1)).squeeze(1)

    @torch.no_grad()
    def score(self, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]],
              batch_size: int | None = None) -> list[float]:
        self.net.eval()
        out: list[float] = []
        step = batch_size or self.batch_size
        for s in range(0, len(prompt_ids), step):
            out += self.logits(prompt_ids[s:s + step], completion_ids[s:s + step]).float().cpu().tolist()
        return out

    def fit(self, examples: Sequence[Any], loss_fn: Callable[["StepScorer", Sequence[Any]], torch.Tensor],
            epochs: int, fixed: Sequence[Any] = ()) -> dict[str, float]:
        """Adds `examples` to the buffer, then `epochs` passes over `fixed` (examples that always
        count, e.g. InversePRM's expert transitions) and the buffer, in shuffled batches of
        loss_fn(self, batch) (which calls self.logits). Returns the mean loss of the first and of the
        last pass, and how many examples they covered."""
        self.buffer.extend(examples)
        data = list(fixed) + list(self.buffer)
        if not data:
            return {"prm_examples": 0.0}
        self.net.train()
        firsts, lasts = [], []
        for epoch in range(epochs):
            self.rng.shuffle(data)
            losses = []
            for s in range(0, len(data), self.batch_size):
                loss = loss_fn(self, data[s:s + self.batch_size])
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(self.net.parameters(), 1.0)
                self.optimizer.step()
                losses.append(float(loss.detach()))
            if epoch == 0:
                firsts = losses
            lasts = losses
        self.net.eval()
        return {"prm_loss_first": sum(firsts) / len(firsts), "prm_loss_last": sum(lasts) / len(lasts),
                "prm_examples": float(len(data))}
