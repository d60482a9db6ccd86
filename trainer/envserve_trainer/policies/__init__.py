"""Stage 3, policies: what samples the agent's turns. `hf` (transformers in process) and `vision` (vision-language
models in process) load torch only when asked for. May import: models, config."""
from .base import FINISH_LENGTH, FINISH_STOP, Generation, Policy

__all__ = ["Policy", "Generation", "FINISH_STOP", "FINISH_LENGTH", "HFPolicy", "sequence_logprobs",
           "HFVisionPolicy", "vision_sequence_logprobs"]


def __getattr__(name):
    if name in ("HFPolicy", "sequence_logprobs"):
        from . import hf
        return getattr(hf, name)
    if name in ("HFVisionPolicy", "vision_sequence_logprobs"):
        from . import vision
        return getattr(vision, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
