"""What every policy backend offers the rollout loop: chat prompts in, sampled completions out."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, Sequence, Union, runtime_checkable

Message = Mapping[str, str]          # {"role": ..., "content": ...}
Weights = Union[Mapping[str, Any], str, "os.PathLike[str]"]

FINISH_STOP = "stop"        # the model ended its turn (eos)
FINISH_LENGTH = "length"    # max_new_tokens ran out first


def check_ids_request(prompt_ids: Sequence[Sequence[int]], max_new_tokens: int, top_p: float) -> None:
    """The arguments of an in-process backend's generate_from_ids (hf, vllm), refused alike. (The
    openai backend asks an endpoint, which needs max_new_tokens >= 1, and says so in its own words.)"""
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if any(len(p) == 0 for p in prompt_ids):
        raise ValueError("every prompt needs at least one token")


@dataclass
class Generation:
    """One sampled completion.

    `completion_logprobs[i]` is the log-probability of `completion_token_ids[i]` under the distribution
    it was sampled from (temperature and top_p applied), which is the behaviour policy an off-policy
    correction needs. `completion_token_ids` ends with the eos token when finish_reason is "stop";
    `text` is the completion decoded without it.
    """
    text: str
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    completion_logprobs: list[float]
    finish_reason: str
    extra: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Policy(Protocol):
    def generate(self, prompts: Sequence[Sequence[Message]], max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, seed: int | None = None) -> list[Generation]:
        """One completion per chat prompt (rendered with the backend's chat template, generation prompt
        added). The same seed gives the same completions."""
        ...

    def update_weights(self, weights: Weights) -> None:
        """Load new weights: a state dict, or a path (a save_pretrained directory or a weights file).
        Backends that share the trainer's model object may treat this as a no-op."""
        ...

    def close(self) -> None:
        ...
