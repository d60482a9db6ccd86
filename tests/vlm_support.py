"""A tiny vision-language model for the adapter tests: a real Qwen2-VL architecture
(Qwen2VLForConditionalGeneration: vision tower, patch merger, M-RoPE text model) with random
weights, and its Qwen2VLProcessor, built from configs in code (no weights are downloaded).

The tokenizer is the trainer's grid tokenizer (envserve_trainer.models.small) with Qwen2-VL's vision
tokens added and a chat template that renders image content blocks the way Qwen2-VL's does
(`<|vision_start|><|image_pad|><|vision_end|>`, which the processor expands to one pad token per
merged patch). Images are resized into a small pixel budget so a 128 px observation becomes a
handful of image tokens.

Qwen2-VL's processor also holds a video processor, and Qwen2-VL's needs torchvision, which has no
build on PyPI for the CPU torch of these venvs. Observations are images, so without torchvision the
processor gets an empty video processor that refuses videos (transformers 5.10, verl's venv: it is
registered so that `AutoProcessor.from_pretrained` loads the saved processor, as verl does) or none
at all (later transformers, which cannot check one without torchvision; the processor is then used
in memory, as GRPOTrainer takes it). With torchvision installed, Qwen2-VL's own is used.
"""
from __future__ import annotations

import torch

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")

# Qwen2-VL's chat markup over content that is a string or a list of blocks; image blocks become the
# placeholder the processor expands, text blocks their text.
CHAT_TEMPLATE = (
    "{%- macro render(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- else -%}{%- for block in content -%}"
    "{%- if block['type'] == 'image' or 'image' in block or 'image_url' in block -%}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif block['type'] == 'text' -%}{{ block['text'] }}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- for message in messages -%}"
    "<|im_start|>{{ message['role'] }}{{ '\\n' }}{{ render(message['content']) }}<|im_end|>{{ '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant{{ '\\n' }}{%- endif -%}")

# Pixel budget of the image processor: a 128 px square observation becomes 112 x 112 pixels, 8 x 8
# patches of 14 px, merged 2 x 2 into 16 image tokens.
MIN_PIXELS, MAX_PIXELS = 28 * 28 * 4, 28 * 28 * 16


def build_tiny_qwen2_vl(tokenizer, seed: int = 0, chat_template: str = CHAT_TEMPLATE):
    """(model, processor): a random-weight Qwen2VLForConditionalGeneration sized like the trainer's
    tiny text model, and a Qwen2VLProcessor over `tokenizer` (which gains the vision tokens and
    `chat_template`)."""
    from tokenizers import AddedToken
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessor

    tokenizer.add_special_tokens({"additional_special_tokens": [AddedToken(t, special=True, normalized=False)
                                                                for t in VISION_TOKENS]})
    tokenizer.chat_template = chat_template
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    hidden = 64
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=192, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         # M-RoPE splits a head's 8 rotary frequencies (head_dim 16) over time, height, width.
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [4, 2, 2]},
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
                         tie_word_embeddings=False),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=hidden, num_heads=2, mlp_ratio=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2VLForConditionalGeneration(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    image_processor = Qwen2VLImageProcessor(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS,
                                            size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS})
    processor = _processor(image_processor, tokenizer, chat_template)
    return model.eval(), processor


def _processor(image_processor, tokenizer, chat_template):
    from transformers import Qwen2VLProcessor
    from transformers.processing_utils import MODALITY_TO_BASE_CLASS_MAPPING
    from transformers.utils import is_torchvision_available
    if is_torchvision_available():
        from transformers import Qwen2VLVideoProcessor
        return Qwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                video_processor=Qwen2VLVideoProcessor(), chat_template=chat_template)
    if MODALITY_TO_BASE_CLASS_MAPPING.get("video_processor") == "BaseVideoProcessor":
        # transformers up to 5.1x: Qwen2VLProcessor itself, loadable from disk by AutoProcessor (verl).
        return Qwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                video_processor=no_video_processor_class()(), chat_template=chat_template)
    # Later transformers cannot check a video processor without torchvision: Qwen2-VL's processor
    # without one (in memory only; GRPOTrainer takes the object).
    return ImageOnlyQwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template)


def _image_only_class():
    from transformers import Qwen2VLProcessor

    class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
        """Qwen2VLProcessor with its image processor and tokenizer only: the sub-processors are
        read from __init__'s parameters, so none is a video processor."""

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)
    return ImageOnlyQwen2VLProcessor


def ImageOnlyQwen2VLProcessor(**kwargs):
    return _image_only_class()(**kwargs)


def image_token_count(processor, image) -> int:
    """How many image pad tokens the processor puts in the prompt for one image."""
    grid = processor.image_processor(images=[image], return_tensors="pt")["image_grid_thw"][0]
    return int(grid.prod()) // processor.image_processor.merge_size ** 2



class _Plain(type):
    """Without torchvision, transformers' BaseVideoProcessor is a placeholder whose every class
    attribute raises; this metaclass lets a subclass of it define its own."""

    def __getattribute__(cls, key):
        return type.__getattribute__(cls, key)


def _video_base():
    import transformers
    base = transformers.BaseVideoProcessor
    return base, type(base)


def no_video_processor_class():
    """The empty video processor (see the module's doc), registered with AutoVideoProcessor for
    Qwen2-VL in this process."""
    global _NO_VIDEO
    if _NO_VIDEO is not None:
        return _NO_VIDEO
    from transformers import Qwen2VLConfig
    # The auto class itself, not the top-level name (a placeholder without torchvision).
    from transformers.models.auto.video_processing_auto import AutoVideoProcessor
    from transformers.utils import PushToHubMixin
    base, meta = _video_base()

    class NoVideoMeta(_Plain, meta):
        pass

    # PushToHubMixin: the processor saves its sub-processors' own configs, not them inline.
    class NoVideoProcessor(base, PushToHubMixin, metaclass=NoVideoMeta):
        merge_size = 2
        _auto_class = None

        def __init__(self, **kwargs):
            self.merge_size = int(kwargs.get("merge_size", 2))

        def __call__(self, *args, **kwargs):
            raise ValueError("this processor takes no videos (torchvision is not installed)")

        @classmethod
        def from_pretrained(cls, *args, **kwargs):
            return cls()

        def to_dict(self):
            return {"video_processor_type": type(self).__name__, "merge_size": self.merge_size}

        def save_pretrained(self, directory, **kwargs):
            import json
            import os
            with open(os.path.join(directory, "video_preprocessor_config.json"), "w") as f:
                json.dump(self.to_dict(), f)
            return [os.path.join(directory, "video_preprocessor_config.json")]

    AutoVideoProcessor.register(Qwen2VLConfig, NoVideoProcessor, exist_ok=True)
    _NO_VIDEO = NoVideoProcessor
    return NoVideoProcessor


_NO_VIDEO = None
