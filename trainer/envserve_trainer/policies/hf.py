"""The Hugging Face transformers backend: batched sampling from an in-process causal LM.

Prompts are left-padded with explicit position ids, so a prompt's completion does not depend on the
other prompts of its batch. Each row samples with its own torch.Generator, seeded from (seed, row),
so the same seed gives the same completions and a row's draws do not depend on how long the other
rows run. The update recomputes log-probabilities with sequence_logprobs, which lays the tokens out
exactly as generation does (same padding, same positions), so at the same temperature it reproduces
the sampler's log-probabilities.

Shared prefix: the prompts of a batch usually begin with the same system block (the env's rules,
hundreds of tokens, against tens for an observation). Generation and scoring compute that prefix
once, as a batch of one, and give every row its keys and values; each row's own tokens follow,
left-padded after the prefix. The result is the same distribution as the plain layout (attention
sees the same tokens at the same positions) at a fraction of the cost. Under autograd the prefix's
gradients add up over the rows through the repeat, so training on it is exact too.
"""
from __future__ import annotations

import hashlib
import os
import secrets
from pathlib import Path
from typing import Mapping, Sequence

import torch

from .base import FINISH_LENGTH, FINISH_STOP, Generation, Message, Weights, check_ids_request


# -- token layout shared by generation and scoring --------------------------------------------------
def encode_chat(tokenizer, messages: Sequence[Message]) -> list[int]:
    """Token ids of a chat prompt with the generation prompt (the assistant header) appended."""
    text = tokenizer.apply_chat_template([dict(m) for m in messages], add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def left_pad(seqs: Sequence[Sequence[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask), each [B, max len], sequences flush right."""
    width = max((len(s) for s in seqs), default=0)
    ids = torch.full((len(seqs), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if len(s):
            ids[i, width - len(s):] = torch.as_tensor(list(s), dtype=torch.long)
            mask[i, width - len(s):] = 1
    return ids, mask


def positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids that count real tokens only, so left padding does not shift a row's positions
    (rotary models would not notice a shift, being relative, but learned absolute positions would)."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


def _device(model) -> torch.device:
    return next(model.parameters()).device


def _pad_id(model, pad_token_id: int | None) -> int:
    if pad_token_id is not None:
        return int(pad_token_id)
    cfg = model.config
    return int(cfg.pad_token_id if cfg.pad_token_id is not None else 0)


def restrict(logits: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """Logits with every token outside `allowed` (a bool mask over the vocabulary) at -inf: a
    restricted vocabulary, applied identically when sampling and when scoring so the ratio is exact."""
    if allowed is None:
        return logits
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))


def vocabulary_mask(allowed_token_ids: Sequence[int] | None, vocab_size: int) -> torch.Tensor | None:
    if not allowed_token_ids:
        return None
    ids = sorted({int(t) for t in allowed_token_ids})
    if ids[0] < 0 or ids[-1] >= vocab_size:
        raise ValueError(f"allowed token ids must be in [0, {vocab_size}), got {ids[0]}..{ids[-1]}")
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    mask[ids] = True
    return mask


# A common prefix shorter than this is not worth a forward pass of its own.
MIN_SHARED_PREFIX = 32


def shared_prefix_length(prompt_ids: Sequence[Sequence[int]], minimum: int = MIN_SHARED_PREFIX) -> int:
    """How many leading tokens all prompts share, leaving every prompt at least its last token (whose
    logits start the completion); 0 for a single row or a prefix shorter than `minimum`."""
    if len(prompt_ids) < 2:
        return 0
    first, limit = prompt_ids[0], min(len(p) for p in prompt_ids) - 1
    n = 0
    while n < limit and all(p[n] == first[n] for p in prompt_ids):
        n += 1
    return n if n >= minimum else 0


def prefix_cache(model, prefix: Sequence[int], batch: int):
    """The key/value cache of `prefix` computed once and repeated for `batch` rows (None when empty)."""
    if not prefix:
        return None
    device = _device(model)
    ids = torch.as_tensor([list(prefix)], dtype=torch.long, device=device)
    out = model(input_ids=ids, position_ids=torch.arange(len(prefix), device=device).unsqueeze(0),
                use_cache=True, logits_to_keep=1)
    cache = out.past_key_values
    cache.batch_repeat_interleave(batch)
    return cache


def with_prefix(mask: torch.Tensor, prefix_len: int) -> torch.Tensor:
    """The attention mask over the shared prefix and the rows' own tokens."""
    if not prefix_len:
        return mask
    return torch.cat([torch.ones((mask.shape[0], prefix_len), dtype=mask.dtype, device=mask.device), mask], 1)


def scoring_layout(prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]], pad: int,
                   device, prefix_len: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, attention mask, completion mask) on `device`: prompts left-padded, completions
    right-padded after them, as generation lays them out; the completion mask is [B, C]. With
    `prefix_len`, the ids leave out the shared prefix and the mask covers it (ones in front)."""
    width = max((len(c) for c in completion_ids), default=0)
    prompt, prompt_mask = left_pad([p[prefix_len:] for p in prompt_ids], pad)
    completion = torch.full((len(prompt_ids), width), pad, dtype=torch.long)
    completion_mask = torch.zeros((len(prompt_ids), width), dtype=torch.long)
    for i, c in enumerate(completion_ids):
        if len(c):
            completion[i, :len(c)] = torch.as_tensor(list(c), dtype=torch.long)
            completion_mask[i, :len(c)] = 1
    ids = torch.cat([prompt, completion], 1).to(device)
    mask = with_prefix(torch.cat([prompt_mask, completion_mask], 1), prefix_len).to(device)
    return ids, mask, completion_mask.to(device)


def sequence_logprobs(model, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]],
                      temperature: float = 1.0, pad_token_id: int | None = None,
                      allowed: torch.Tensor | None = None, return_entropy: bool = False,
                      share_prefix: bool = True):
    """Per-token log-probabilities of each completion given its prompt, in one padded forward pass.

    Returns (logprobs, mask) (and the per-token entropy with return_entropy), [B, C] with C the
    longest completion; `allowed` restricts the vocabulary as generation did. logprobs[i, j] is
    log p(completion_ids[i][j] | prompt, earlier completion tokens) under softmax(logits / temperature),
    0 where mask is False (past the end of row i). Gradients flow (call under torch.no_grad() for
    reference or old-policy scores). Prompts are left-padded and completions right-padded after them,
    the layout generation uses, with positions counting real tokens only; a prefix all prompts share
    is computed once (`share_prefix`, as generation does).
    """
    if len(prompt_ids) != len(completion_ids):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(completion_ids)} completions")
    if any(len(p) == 0 for p in prompt_ids):
        raise ValueError("every prompt needs at least one token (the first completion token is scored from it)")
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    device = _device(model)
    batch, width = len(prompt_ids), max(len(c) for c in completion_ids) if completion_ids else 0
    if width == 0:
        empty = (torch.zeros((batch, 0), device=device), torch.zeros((batch, 0), dtype=torch.bool, device=device))
        return empty + (torch.zeros((batch, 0), device=device),) if return_entropy else empty
    shared = shared_prefix_length(prompt_ids) if share_prefix else 0
    ids, mask, completion_mask = scoring_layout(prompt_ids, completion_ids, _pad_id(model, pad_token_id), device,
                                                shared)
    cache = prefix_cache(model, prompt_ids[0][:shared], batch)
    # Only the last width + 1 positions need logits: the last prompt token predicts the first
    # completion token, and the last completion token predicts nothing we score.
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask)[:, shared:],
                past_key_values=cache, use_cache=cache is not None, logits_to_keep=width + 1)
    return completion_logprobs(out.logits, ids, completion_mask, temperature, allowed, return_entropy)


def completion_logprobs(logits: torch.Tensor, ids: torch.Tensor, completion_mask: torch.Tensor, temperature: float,
                        allowed: torch.Tensor | None, return_entropy: bool):
    """(logprobs, mask[, entropy]) of the last C tokens of `ids` from the logits of the C + 1
    positions before them (C = completion_mask's width), under softmax(logits / temperature) over
    the `allowed` vocabulary; 0 past each row's end."""
    width = completion_mask.shape[1]
    logits = logits[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    logits = restrict(logits, allowed)
    targets = ids[:, -width:]
    all_logp = torch.log_softmax(logits, -1)
    logp = all_logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    keep = completion_mask.bool()
    if not return_entropy:
        return logp.masked_fill(~keep, 0.0), keep
    p = all_logp.exp()
    entropy = -(p * all_logp.masked_fill(p == 0, 0.0)).sum(-1)
    return logp.masked_fill(~keep, 0.0), keep, entropy.masked_fill(~keep, 0.0)


# -- sampling -----------------------------------------------------------------------------------------
def row_seed(seed: int, row: int) -> int:
    """An independent 63-bit seed per row of a batch, so rows with one base seed still differ."""
    digest = hashlib.blake2b(f"{int(seed)}:{int(row)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def batch_seeds(batch: int, seed: int | None, row_seeds: Sequence[int] | None) -> list[int]:
    """Each row's seed: its own given one, else one derived from `seed` (random when None) and the row."""
    if row_seeds is not None:
        if len(row_seeds) != batch:
            raise ValueError(f"{batch} prompts but {len(row_seeds)} row seeds")
        return [int(s) for s in row_seeds]
    base_seed = secrets.randbits(63) if seed is None else int(seed)
    return [row_seed(base_seed, i) for i in range(batch)]


def nucleus(logp: torch.Tensor, top_p: float) -> torch.Tensor:
    """Log-probabilities restricted to the top-p nucleus (the fewest most likely tokens whose mass
    reaches top_p; the most likely token always stays) and renormalised; -inf outside."""
    sorted_logp, order = logp.sort(-1, descending=True)
    mass_before = sorted_logp.exp().cumsum(-1) - sorted_logp.exp()
    drop_sorted = mass_before >= top_p
    drop_sorted[..., 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    kept = logp.masked_fill(drop, float("-inf"))
    return kept - torch.logsumexp(kept, -1, keepdim=True)


def _inverse_cdf(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One draw from a categorical distribution with the row's own generator."""
    cdf = probs.double().cumsum(-1)
    u = torch.rand((), generator=generator, dtype=torch.float64) * cdf[-1]
    # The first index whose cumulative mass exceeds u has positive probability.
    idx = int(torch.searchsorted(cdf, u.reshape(1), right=True))
    if idx >= probs.numel():   # u rounded onto the total: take the last token with any mass
        idx = int((probs > 0).nonzero().max())
    return idx


class ChatFromIds:
    """Policy.generate for a backend that samples from token ids (generate_from_ids) with a local
    tokenizer: chat prompts rendered by encode_chat (HFPolicy, VLLMPolicy)."""

    def generate(self, prompts: Sequence[Sequence[Message]], max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, seed: int | None = None) -> list[Generation]:
        ids = [encode_chat(self.tokenizer, messages) for messages in prompts]
        return self.generate_from_ids(ids, max_new_tokens, temperature, top_p, seed)


class HFPolicy(ChatFromIds):
    """Policy backend over a transformers causal LM in this process (CPU or one GPU).

    The model object may be the one the trainer updates: generation switches it to eval mode and
    back, and needs no weight reload then.
    """

    def __init__(self, model, tokenizer, device: str | torch.device | None = None,
                 allowed_token_ids: Sequence[int] | None = None, share_prefix: bool = True):
        self.model = model.to(device) if device is not None else model
        self.share_prefix = share_prefix
        self.tokenizer = tokenizer
        self.device = _device(self.model)
        # A restricted vocabulary (None: all tokens); the trainer scores with the same mask.
        self.allowed = vocabulary_mask(allowed_token_ids, int(self.model.config.vocab_size))
        self.eos_token_id = int(tokenizer.eos_token_id)
        self.pad_token_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_token_id)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, device: str | torch.device = "cpu") -> "HFPolicy":
        from transformers import AutoModelForCausalLM, AutoTokenizer
        return cls(AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path), device)

    def _live_model(self):
        if self.model is None:
            raise RuntimeError("this policy is closed")
        return self.model

    @torch.no_grad()
    def generate_from_ids(self, prompt_ids: Sequence[Sequence[int]], max_new_tokens: int, temperature: float = 1.0,
                          top_p: float = 1.0, seed: int | None = None,
                          row_seeds: Sequence[int] | None = None) -> list[Generation]:
        """Like generate, from token ids (a multi-turn rollout keeps its exact ids this way).

        `row_seeds` gives each row its own seed, so a row's completion does not depend on which
        other rows share its batch (a rollout batches whichever sessions are ready).

        temperature <= 0 decodes greedily; the log-probabilities returned then are the model's own
        (temperature 1), since those of the greedy policy itself would all be 0.
        """
        model = self._live_model()
        check_ids_request(prompt_ids, max_new_tokens, top_p)
        batch = len(prompt_ids)
        if batch == 0:
            return []
        seeds = batch_seeds(batch, seed, row_seeds)
        generators = [torch.Generator().manual_seed(s) for s in seeds]

        shared = shared_prefix_length(prompt_ids) if self.share_prefix else 0
        ids, mask = left_pad([p[shared:] for p in prompt_ids], self.pad_token_id)
        ids, mask = ids.to(self.device), with_prefix(mask, shared).to(self.device)
        pos = positions(mask)[:, shared:]
        was_training = model.training
        model.eval()
        try:
            cache = prefix_cache(model, prompt_ids[0][:shared], batch)
            out = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True,
                        logits_to_keep=1)
            tokens, logps, finish = decode(model, out, mask, pos[:, -1:] + 1, max_new_tokens, temperature, top_p,
                                           generators, self.allowed, self.eos_token_id, self.pad_token_id)
        finally:
            model.train(was_training)
        return generations(self.tokenizer, prompt_ids, tokens, logps, finish, [{"seed": s} for s in seeds])

    @staticmethod
    def _choose(logits: torch.Tensor, temperature: float, top_p: float, generators: list[torch.Generator],
                active: list[int]) -> dict[int, tuple[int, float]]:
        """Row -> (token, its log-probability under the distribution it was drawn from)."""
        logits = logits.cpu()
        if temperature <= 0:
            logp = torch.log_softmax(logits, -1)
            best = logits.argmax(-1)
            return {i: (int(best[i]), float(logp[i, best[i]])) for i in active}
        logp = torch.log_softmax(logits / temperature, -1)
        if top_p < 1.0:
            logp = nucleus(logp, top_p)
        probs = logp.exp()
        chosen = {}
        for i in active:
            token = _inverse_cdf(probs[i], generators[i])
            chosen[i] = (token, float(logp[i, token]))
        return chosen

    def update_weights(self, weights: Weights) -> None:
        """Copy in a state dict, a model's weights, or the weights saved at a path."""
        model = self._live_model()
        if isinstance(weights, torch.nn.Module):
            state: Mapping[str, torch.Tensor] = weights.state_dict()
        elif isinstance(weights, (str, os.PathLike)):
            state = _load_state(Path(weights))
        else:
            state = weights
        missing, unexpected = model.load_state_dict(dict(state), strict=False)
        # A saved model with tied embeddings stores the shared matrix once.
        tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
        missing = [k for k in missing if k not in tied]
        if missing or unexpected:
            raise ValueError(f"weights do not fit the model: missing {missing[:5]}, unexpected {list(unexpected)[:5]}")
        if tied:
            model.tie_weights()

    def close(self) -> None:
        self.model = None


def decode(model, out, mask: torch.Tensor, next_pos: torch.Tensor, max_new_tokens: int, temperature: float,
           top_p: float, generators: list[torch.Generator], allowed: torch.Tensor | None, eos_token_id: int,
           pad_token_id: int) -> tuple[list[list[int]], list[list[float]], list[str | None]]:
    """(tokens, log-probabilities, finish reasons) per row, sampled from the prefill's output `out`
    onward with its cache; `next_pos` [B, 1] is each row's first completion position (text positions
    only from there on)."""
    batch, device = mask.shape[0], mask.device
    tokens: list[list[int]] = [[] for _ in range(batch)]
    logps: list[list[float]] = [[] for _ in range(batch)]
    finish: list[str | None] = [None] * batch
    for step in range(max_new_tokens):
        active = [i for i in range(batch) if finish[i] is None]
        chosen = HFPolicy._choose(restrict(out.logits[:, -1].float(), allowed), temperature, top_p, generators, active)
        for i, (token, lp) in chosen.items():
            tokens[i].append(token)
            logps[i].append(lp)
            if token == eos_token_id:
                finish[i] = FINISH_STOP
        if all(f is not None for f in finish) or step == max_new_tokens - 1:
            break
        # Finished rows are fed a pad; their outputs are never read again.
        feed = torch.tensor([[tokens[i][-1] if finish[i] is None else pad_token_id] for i in range(batch)],
                            dtype=torch.long, device=device)
        mask = torch.cat([mask, torch.ones((batch, 1), dtype=mask.dtype, device=device)], 1)
        out = model(input_ids=feed, attention_mask=mask, position_ids=next_pos,
                    past_key_values=out.past_key_values, use_cache=True)
        next_pos = next_pos + 1
    return tokens, logps, finish


def generations(tokenizer, prompt_ids: Sequence[Sequence[int]], tokens: list[list[int]], logps: list[list[float]],
                finish: list[str | None], extras: Sequence[dict]) -> list[Generation]:
    """The Generation of each row: the text decoded without its stop token."""
    results = []
    for i in range(len(tokens)):
        reason = finish[i] or FINISH_LENGTH
        shown = tokens[i][:-1] if reason == FINISH_STOP else tokens[i]
        results.append(Generation(
            text=tokenizer.decode(shown, skip_special_tokens=True), prompt_token_ids=list(prompt_ids[i]),
            completion_token_ids=tokens[i], completion_logprobs=logps[i], finish_reason=reason, extra=dict(extras[i])))
    return results


def _is_vision_folder(path: Path) -> bool:
    """Whether a save_pretrained folder holds a vision-language model (its config has a vision part)."""
    import json
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return "vision_config" in config


def _load_state(path: Path) -> Mapping[str, torch.Tensor]:
    if path.is_dir() and _is_vision_folder(path):
        from transformers import AutoModelForImageTextToText
        return AutoModelForImageTextToText.from_pretrained(path, local_files_only=True).state_dict()
    if path.is_dir():
        from transformers import AutoModelForCausalLM
        return AutoModelForCausalLM.from_pretrained(path).state_dict()
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file
        return load_file(str(path))
    return torch.load(path, map_location="cpu", weights_only=True)
