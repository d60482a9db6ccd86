"""The DPO family (IPR, RRO): sigmoid DPO on masked token log-probabilities, its outcome- and
step-level uses, and the SFT term.

Inputs are per-token log-probabilities as `policy.hf.sequence_logprobs` returns them ([B, T], 0
past a row's end) with a mask of the tokens that count (the action tokens: observations inside a
multi-turn completion are masked out by the caller). `score_pairs` produces them for the policy and
the reference in the learner's own layout.

    s(y)  = sum over masked tokens of log pi(y_j | x, y_<j)                      (sequence log-prob)
    m     = (s_pi(y_w) - s_ref(y_w)) - (s_pi(y_l) - s_ref(y_l))                  (the log-ratio margin)
    L_DPO = mean over pairs of -log sigma(beta * m)                               (Rafailov et al. 2023)
    L_SFT = - sum of masked log-probs / number of masked tokens                   (token-mean NLL)
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
import torch.nn.functional as F

from ..policy.hf import sequence_logprobs
from .config import DPOConfig


class ScoredTokens(NamedTuple):
    """One side of a batch of pairs: the policy's and the reference's token log-probs, [B, T] each,
    and the mask of the tokens that count."""
    policy: torch.Tensor
    reference: torch.Tensor
    mask: torch.Tensor


def sequence_logprob(token_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """s(y) = sum_j mask_j * log p_j, per row: [B, T] -> [B]."""
    return (token_logprobs * mask.to(token_logprobs.dtype)).sum(-1)


def dpo_margins(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
                ref_rejected: torch.Tensor, beta: float = DPOConfig.beta) -> torch.Tensor:
    """beta * ((pi_w - ref_w) - (pi_l - ref_l)) per pair, from sequence log-probs: DPO's implicit
    reward difference (positive when the policy prefers the chosen more than the reference does)."""
    return beta * ((policy_chosen - ref_chosen) - (policy_rejected - ref_rejected))


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float = DPOConfig.beta) -> torch.Tensor:
    """mean over pairs of -log sigma(dpo_margins(...)); 0 (still on the graph) for no pairs."""
    if policy_chosen.numel() == 0:
        return policy_chosen.sum() + policy_rejected.sum()
    return -F.logsigmoid(dpo_margins(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta)).mean()


def _masked_dpo(chosen: ScoredTokens, rejected: ScoredTokens, beta: float) -> torch.Tensor:
    return dpo_loss(sequence_logprob(chosen.policy, chosen.mask), sequence_logprob(rejected.policy, rejected.mask),
                    sequence_logprob(chosen.reference, chosen.mask),
                    sequence_logprob(rejected.reference, rejected.mask), beta)


def outcome_dpo_loss(chosen: ScoredTokens, rejected: ScoredTokens, beta: float = DPOConfig.beta) -> torch.Tensor:
    """Outcome-level DPO: whole trajectories from the task's prompt, the successful (or better) one
    chosen, every action token of each scored."""
    return _masked_dpo(chosen, rejected, beta)


def _from(mask: torch.Tensor, start: Sequence[int] | torch.Tensor) -> torch.Tensor:
    start = torch.as_tensor(start, device=mask.device).reshape(-1, 1)
    return mask.bool() & (torch.arange(mask.shape[1], device=mask.device).unsqueeze(0) >= start)


def step_dpo_loss(chosen: ScoredTokens, rejected: ScoredTokens, chosen_start: Sequence[int] | torch.Tensor,
                  rejected_start: Sequence[int] | torch.Tensor, beta: float = DPOConfig.beta) -> torch.Tensor:
    """Step-level DPO: continuations from a step t, scored only from token start[i] on (the first
    token of step t in each row); the prefix before it is context, not a choice being compared.
    Where both rows hold the same prefix token for token, its terms cancel in the margin, so this
    equals outcome_dpo_loss on the full rows; the starts matter where prefixes differ."""
    return _masked_dpo(chosen._replace(mask=_from(chosen.mask, chosen_start)),
                       rejected._replace(mask=_from(rejected.mask, rejected_start)), beta)


def sft_loss(token_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token-mean negative log-likelihood over masked tokens; 0 (on the graph) when none is masked in."""
    m = mask.to(token_logprobs.dtype)
    return -(token_logprobs * m).sum() / m.sum().clamp(min=1.0)


def _action_mask(keep: torch.Tensor, action_masks: Sequence[Sequence[int]] | None) -> torch.Tensor:
    if action_masks is None:
        return keep
    extra = torch.zeros_like(keep)
    for i, row in enumerate(action_masks):
        if len(row) != int(keep[i].sum()):
            raise ValueError(f"action mask {i} has {len(row)} entries for {int(keep[i].sum())} completion tokens")
        extra[i, :len(row)] = torch.as_tensor(list(row), dtype=torch.bool, device=keep.device)
    return keep & extra


def score_pairs(model, reference, prompt_ids: Sequence[Sequence[int]], chosen_ids: Sequence[Sequence[int]],
                rejected_ids: Sequence[Sequence[int]], chosen_action_masks: Sequence[Sequence[int]] | None = None,
                rejected_action_masks: Sequence[Sequence[int]] | None = None,
                **scoring) -> tuple[ScoredTokens, ScoredTokens]:
    """Token log-probs of the chosen and rejected completions of each prompt under the policy (with
    gradients) and the reference (without), through the learner's `sequence_logprobs` (one forward
    of 2B rows per model). Action masks (1 = an action token) leave observation tokens of multi-turn
    completions out; `scoring` goes to sequence_logprobs (temperature, pad_token_id, allowed...)."""
    n = len(prompt_ids)
    if not (len(chosen_ids) == len(rejected_ids) == n):
        raise ValueError(f"{n} prompts, {len(chosen_ids)} chosen and {len(rejected_ids)} rejected completions")
    prompts = list(prompt_ids) * 2
    completions = list(chosen_ids) + list(rejected_ids)
    logp, keep = sequence_logprobs(model, prompts, completions, **scoring)
    with torch.no_grad():
        ref, _ = sequence_logprobs(reference, prompts, completions, **scoring)
    chosen_mask = _action_mask(keep[:n], chosen_action_masks)
    rejected_mask = _action_mask(keep[n:], rejected_action_masks)
    return (ScoredTokens(logp[:n], ref[:n], chosen_mask), ScoredTokens(logp[n:], ref[n:], rejected_mask))


# -- pairs of multi-turn sides (the learner's preference update) -------------------------------------
class PreferencePair(NamedTuple):
    """One preference: each side is a list of (prompt ids, completion ids) rows, one per policy call
    (a step pair has one row a side, an outcome pair a whole trajectory's turns); a side's sequence
    log-prob is the sum over its rows, so a multi-turn trajectory is scored in the layout it was
    sampled in, each turn's context given."""
    kind: str                                         # "outcome" or "step"
    chosen: Sequence[tuple[Sequence[int], Sequence[int]]]
    rejected: Sequence[tuple[Sequence[int], Sequence[int]]]


def side_logprobs(model, reference, pairs: Sequence[PreferencePair], **scoring) -> tuple[torch.Tensor, ...]:
    """(policy chosen, policy rejected, reference chosen, reference rejected) sequence log-probs, [P]
    each: every row of every side in one sequence_logprobs call per model, summed per side."""
    rows, side = [], []
    for i, p in enumerate(pairs):
        for s, rows_of in ((2 * i, p.chosen), (2 * i + 1, p.rejected)):
            if not rows_of:
                raise ValueError(f"pair {i} has an empty side")
            rows += list(rows_of)
            side += [s] * len(rows_of)
    prompts, completions = [r[0] for r in rows], [r[1] for r in rows]
    logp, keep = sequence_logprobs(model, prompts, completions, **scoring)
    with torch.no_grad():
        ref, _ = sequence_logprobs(reference, prompts, completions, **scoring)
    index = torch.as_tensor(side, device=logp.device)
    per_row = sequence_logprob(logp, keep)
    per_row_ref = sequence_logprob(ref, keep)
    sums = torch.zeros(2 * len(pairs), dtype=per_row.dtype, device=logp.device).index_add(0, index, per_row)
    sums_ref = torch.zeros_like(sums).index_add(0, index, per_row_ref.to(sums.dtype))
    return sums[0::2], sums[1::2], sums_ref[0::2], sums_ref[1::2]


def rows_sft_loss(model, rows: Sequence[tuple[Sequence[int], Sequence[int]]], **scoring) -> torch.Tensor:
    """Token-mean NLL of the completions of (prompt, completion) rows (IPR's SFT term on the expert)."""
    logp, keep = sequence_logprobs(model, [r[0] for r in rows], [r[1] for r in rows], **scoring)
    return sft_loss(logp, keep)
