"""The learner's DPO losses over the policy: scoring preference pairs with the policy and the
reference (score_pairs, side_logprobs) and the SFT term over rows, on the formulas of methods.process.dpo."""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from ..methods.process.dpo import ScoredTokens, sequence_logprob, sft_loss
from ..policies.hf import sequence_logprobs


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
