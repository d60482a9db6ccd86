"""Vision-language policies: batched sampling and scoring for transformers VLMs whose prompts hold
images (the PNG observations envserve sends with render_image), as HFPolicy does for text.

A prompt is token ids in which each image already occupies its expanded placeholder (VisionCodec.encode
puts it there, exactly as the architecture's processor does), plus the PNG bytes of its images in
order. The tensors the vision tower reads (VisionCodec.model_inputs) are the architecture's own image
processor's output for the decoded PNGs, so the model sees each image as it would through the
processor. Supported: Qwen2-VL and Idefics3 (SmolVLM) processors (vision_model.build_vlm builds both).

Sampling and scoring keep HFPolicy's semantics: left padding, per-row torch.Generators seeded by
hf.row_seed, temperature and nucleus applied to the behaviour log-probabilities, greedy decoding at
temperature <= 0, and vision_sequence_logprobs laying tokens out as generation does, so scores at the
sampling temperature reproduce the sampler's log-probabilities.

Positions: Idefics3's text model is a plain decoder and gets positions that count real tokens
(hf.positions). Qwen2-VL's multimodal rope gives image tokens 3-D (time, height, width) positions;
the model computes them itself from the ids, the image grids and the attention mask, and the prompt's
next text position is then the row's real length plus the offset the model keeps in
model.model.rope_deltas, which decoding continues from. A batch without images gets hf.positions,
which is what the model would compute for text.

The image placeholder token is never sampled (it is masked like a token outside the allowed
vocabulary, in sampling and scoring alike): a completion holding one could not be scored, since the
model takes every placeholder for an image's slot.

There is no shared-prefix cache here (HFPolicy has one): image tokens make prompts differ early, and
Qwen2-VL's positions for a shared prefix would depend on the images after it.
"""
from __future__ import annotations

import io
import os
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch

if TYPE_CHECKING:
    from PIL import Image

    from ..config.train_config import TrainConfig

from .base import Generation, Weights, check_ids_request
from .hf import (HFPolicy, batch_seeds, completion_logprobs, decode, generations, left_pad, positions, scoring_layout,
                 vocabulary_mask)

ChatMessage = Mapping[str, Any]     # {"role": ..., "content": str | list of blocks}


class VisionError(ValueError):
    """An image, or the images of a prompt, that the policy cannot take."""


def decode_png(data: bytes, max_side: int) -> "Image.Image":
    """The RGB image of PNG bytes. VisionError for empty or corrupt data, another format, or an image
    with a side longer than `max_side` (checked from the header, before the pixels are decoded)."""
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise VisionError("empty image data (0 bytes); expected a PNG")
    try:
        image = Image.open(io.BytesIO(bytes(data)))
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise VisionError(f"image data ({len(data)} bytes) is not a readable PNG: {e}") from None
    if image.format != "PNG":
        raise VisionError(f"expected a PNG image, got {image.format}")
    width, height = image.size
    if max(width, height) > max_side:
        raise VisionError(f"image of {width}x{height} px is larger than the {max_side} px allowed per side")
    if width < 1 or height < 1:
        raise VisionError(f"image of {width}x{height} px is empty")
    try:
        image.load()
    except (OSError, ValueError, SyntaxError) as e:
        raise VisionError(f"PNG data ({len(data)} bytes, {width}x{height} px) is corrupt: {e}") from None
    return image.convert("RGB")


def image_count(messages: Sequence[ChatMessage]) -> int:
    return sum(1 for m in messages if not isinstance(m["content"], str)
               for block in m["content"] if block.get("type") == "image")


def keep_last_images(messages: Sequence[ChatMessage], max_images: int) -> list[dict]:
    """`messages` with only the last `max_images` image blocks kept: the oldest turns' images are
    dropped (their text blocks stay). Multi-turn prompts use this to stay within VisionCodec.max_images."""
    drop = max(0, image_count(messages) - max_images)
    kept = []
    for m in messages:
        if isinstance(m["content"], str):
            kept.append(dict(m))
            continue
        blocks = []
        for block in m["content"]:
            if block.get("type") == "image" and drop:
                drop -= 1
                continue
            blocks.append(block)
        kept.append({**m, "content": blocks})
    return kept


class VisionCodec:
    """Prompt text and PNG images into what a vision-language model reads, through its processor
    (a Qwen2VLProcessor or Idefics3Processor, as vision_model.build_vlm returns).

    A prompt holds at most `max_images` images (VisionError beyond; keep_last_images drops the oldest)
    and an image at most `max_image_side` pixels per side.
    """

    def __init__(self, processor, max_images: int = 4, max_image_side: int = 1024):
        from transformers import Idefics3Processor, Qwen2VLProcessor

        if isinstance(processor, Qwen2VLProcessor):
            self.arch = "qwen2_vl"
        elif isinstance(processor, Idefics3Processor):
            self.arch = "idefics3"
        else:
            raise ValueError(f"unsupported processor {type(processor).__name__}: "
                             "expected a Qwen2VLProcessor or an Idefics3Processor")
        if max_images < 0 or max_image_side < 1:
            raise ValueError(f"max_images must be >= 0 and max_image_side >= 1, got {max_images}, {max_image_side}")
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.image_processor = processor.image_processor
        self.max_images = int(max_images)
        self.max_image_side = int(max_image_side)
        # The placeholder as the chat template writes it, once per image, before expansion.
        self.image_token = processor.image_token
        self.image_token_id = int(processor.image_token_id)

    # -- text ----------------------------------------------------------------------------------------
    def render(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True) -> str:
        """The chat template's text of `messages` (content a string or a list of image/text blocks),
        one placeholder per image block; image payloads are not part of the text."""
        plain = [m if isinstance(m["content"], str) else
                 {**m, "content": [{"type": "image"} if b.get("type") == "image" else dict(b) for b in m["content"]]}
                 for m in messages]
        return self.processor.apply_chat_template(plain, add_generation_prompt=add_generation_prompt, tokenize=False)

    def _check_count(self, n: int, where: str = "a prompt") -> None:
        if n > self.max_images:
            raise VisionError(f"{where} holds {n} images, more than the {self.max_images} allowed "
                              "(drop the oldest turns' images first: keep_last_images)")

    def decode(self, pngs: Sequence[bytes], where: str = "a prompt") -> list:
        self._check_count(len(pngs), where)
        images = []
        for k, data in enumerate(pngs):
            try:
                images.append(decode_png(data, self.max_image_side))
            except VisionError as e:
                raise VisionError(f"image {k} of {where}: {e}") from None
        return images

    def encode(self, text: str, pngs: Sequence[bytes]) -> list[int]:
        """Token ids of `text` with each image placeholder expanded as the model expects for the
        corresponding image of `pngs` (the placeholder count must equal len(pngs))."""
        placeholders = text.count(self.image_token)
        if placeholders != len(pngs):
            raise VisionError(f"the text holds {placeholders} image placeholders ({self.image_token}) "
                              f"but {len(pngs)} images were given")
        images = self.decode(pngs)
        if not images:
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        out = self.processor(text=[text], images=[images], add_special_tokens=False)
        return list(out["input_ids"][0])

    def encode_chat(self, messages: Sequence[ChatMessage]) -> tuple[list[int], list[bytes]]:
        """(ids, pngs) of a chat prompt with the generation prompt appended; image blocks carry their
        PNG bytes under "png"."""
        pngs = []
        for m in messages:
            if isinstance(m["content"], str):
                continue
            for block in m["content"]:
                if block.get("type") == "image":
                    if "png" not in block:
                        raise VisionError(f"an image block of a {m.get('role')} message has no 'png' bytes")
                    pngs.append(block["png"])
        return self.encode(self.render(messages), pngs), pngs

    # -- vision tensors --------------------------------------------------------------------------------
    def _tokens_per_image(self, vision: Mapping[str, torch.Tensor], n_images: int) -> list[int]:
        if self.arch == "qwen2_vl":
            merge = self.image_processor.merge_size ** 2
            return [int(g.prod()) // merge for g in vision["image_grid_thw"]]
        # Without image splitting each image is one global view of image_seq_len tokens.
        return [self.processor.image_seq_len] * n_images

    def model_inputs(self, rows: Sequence[Sequence[bytes]], device=None,
                     prompt_ids: Sequence[Sequence[int]] | None = None) -> dict[str, torch.Tensor]:
        """The vision tensors of a batch whose row i holds the images `rows[i]` of row i's ids, in order:
        pixel_values and image_grid_thw (Qwen2-VL: all images' patches concatenated), or pixel_values
        [B, max images, 3, H, W] and pixel_attention_mask (Idefics3: rows with fewer images padded with
        all-zero images, which the model skips). Empty when no row has an image. With `prompt_ids`,
        each row's image-token count is checked against its images (VisionError naming the row)."""
        if prompt_ids is not None and len(prompt_ids) != len(rows):
            raise VisionError(f"{len(prompt_ids)} prompts but image lists for {len(rows)}")
        decoded = [self.decode(r, f"row {i}") for i, r in enumerate(rows)]
        if self.arch == "qwen2_vl":
            flat = [im for row in decoded for im in row]
            vision = dict(self.image_processor(images=flat, return_tensors="pt")) if flat else {}
            counts = self._tokens_per_image(vision, len(flat)) if flat else []
        else:
            vision, counts = self._idefics3_inputs(decoded), [self.processor.image_seq_len] * sum(map(len, decoded))
        if prompt_ids is not None:
            start = 0
            for i, (ids, row) in enumerate(zip(prompt_ids, decoded)):
                expected = sum(counts[start:start + len(row)])
                start += len(row)
                found = sum(1 for t in ids if t == self.image_token_id)
                if found != expected:
                    raise VisionError(f"row {i}: its ids hold {found} image tokens but its {len(row)} images "
                                      f"need {expected} (ids made with VisionCodec.encode for these images?)")
        return {k: v.to(device) if device is not None else v for k, v in vision.items()}

    def _idefics3_inputs(self, decoded: list[list]) -> dict[str, torch.Tensor]:
        if not any(decoded):
            return {}
        per_row = [self.image_processor(images=[row], return_tensors="pt") if row else None for row in decoded]
        done = [p for p in per_row if p is not None]
        n = max(p["pixel_values"].shape[1] for p in done)
        height = max(p["pixel_values"].shape[-2] for p in done)
        width = max(p["pixel_values"].shape[-1] for p in done)
        channels = done[0]["pixel_values"].shape[2]
        pixels = torch.zeros((len(decoded), n, channels, height, width), dtype=done[0]["pixel_values"].dtype)
        mask = torch.zeros((len(decoded), n, height, width), dtype=torch.bool)
        for i, p in enumerate(per_row):
            if p is None:
                continue
            pv = p["pixel_values"][0]
            pixels[i, :pv.shape[0], :, :pv.shape[-2], :pv.shape[-1]] = pv
            pm = p.get("pixel_attention_mask")
            if pm is None:
                mask[i, :pv.shape[0], :pv.shape[-2], :pv.shape[-1]] = True
            else:
                mask[i, :pv.shape[0], :pm.shape[-2], :pm.shape[-1]] = pm[0].bool()
        return {"pixel_values": pixels, "pixel_attention_mask": mask}

    def token_types(self, ids: torch.Tensor) -> torch.Tensor:
        """Qwen2-VL's mm_token_type_ids: 1 where an image token sits, 0 elsewhere."""
        return (ids == self.image_token_id).to(torch.int)

    def sampling_mask(self, allowed: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
        """The vocabulary a completion may use: `allowed` (None: all) without the image placeholder."""
        mask = torch.ones(vocab_size, dtype=torch.bool) if allowed is None else allowed.clone().bool()
        mask[self.image_token_id] = False
        return mask


def vision_codec(cfg: "TrainConfig", processor) -> VisionCodec:
    return VisionCodec(processor, max_images=cfg.rollout.max_images)


# -- forward passes shared by sampling and scoring ----------------------------------------------------
def _text_vocab_size(model) -> int:
    return int(model.config.get_text_config().vocab_size)


def _pad_id(codec: VisionCodec, pad_token_id: int | None) -> int:
    if pad_token_id is not None:
        return int(pad_token_id)
    pad = codec.tokenizer.pad_token_id
    return int(pad if pad is not None else codec.tokenizer.eos_token_id)


def forward_kwargs(codec: VisionCodec, ids: torch.Tensor, mask: torch.Tensor,
                         vision: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """Keyword arguments of a forward pass over whole sequences (no cache) with their images."""
    kwargs: dict[str, Any] = dict(input_ids=ids, attention_mask=mask, **vision)
    if codec.arch == "qwen2_vl" and vision:
        # The model derives its 3-D positions from these, the grids and the attention mask.
        kwargs["mm_token_type_ids"] = codec.token_types(ids)
    else:
        kwargs["position_ids"] = positions(mask)
    return kwargs


def vision_sequence_logprobs(model, codec: VisionCodec, prompt_ids: Sequence[Sequence[int]],
                             completion_ids: Sequence[Sequence[int]], images: Sequence[Sequence[bytes]] | None,
                             temperature: float = 1.0, pad_token_id: int | None = None,
                             allowed: torch.Tensor | None = None, return_entropy: bool = False):
    """hf.sequence_logprobs for a vision-language model: per-token log-probabilities of each
    completion given its prompt and the prompt's images (`images[i]`: PNG bytes of row i's images).

    Returns (logprobs, mask) (and the per-token entropy with return_entropy), [B, C]; `allowed`
    restricts the vocabulary as generation did (the image placeholder is always excluded, as in
    sampling). Gradients flow, into the vision tower too. Same layout as generation: prompts
    left-padded, completions right-padded after them.
    """
    if len(prompt_ids) != len(completion_ids):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(completion_ids)} completions")
    if any(len(p) == 0 for p in prompt_ids):
        raise ValueError("every prompt needs at least one token (the first completion token is scored from it)")
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    images = [[] for _ in prompt_ids] if images is None else images
    device = next(model.parameters()).device
    batch, width = len(prompt_ids), max((len(c) for c in completion_ids), default=0)
    if width == 0:
        empty = (torch.zeros((batch, 0), device=device), torch.zeros((batch, 0), dtype=torch.bool, device=device))
        return empty + (torch.zeros((batch, 0), device=device),) if return_entropy else empty
    ids, mask, completion_mask = scoring_layout(prompt_ids, completion_ids, _pad_id(codec, pad_token_id), device)
    vision = codec.model_inputs(images, device, prompt_ids=prompt_ids)
    out = model(**forward_kwargs(codec, ids, mask, vision), use_cache=False, logits_to_keep=width + 1)
    return completion_logprobs(out.logits, ids, completion_mask, temperature,
                               codec.sampling_mask(allowed, out.logits.shape[-1]), return_entropy)


class HFVisionPolicy:
    """Policy backend over a transformers vision-language model in this process (CPU or one GPU).

    As HFPolicy: the model object may be the one the trainer updates (generation switches it to eval
    mode and back). `allowed` is the vocabulary mask sampling uses (the image placeholder excluded);
    the trainer scores with the same mask through vision_sequence_logprobs.
    """

    def __init__(self, model, codec: VisionCodec, device: str | torch.device | None = None,
                 allowed_token_ids: Sequence[int] | None = None):
        self.model = model.to(device) if device is not None else model
        self.codec = codec
        self.tokenizer = codec.tokenizer
        self.device = next(self.model.parameters()).device
        vocab = _text_vocab_size(self.model)
        self.allowed = codec.sampling_mask(vocabulary_mask(allowed_token_ids, vocab), vocab)
        self.eos_token_id = int(self.tokenizer.eos_token_id)
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = int(pad if pad is not None else self.eos_token_id)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, device: str | torch.device = "cpu",
                        **codec_options) -> "HFVisionPolicy":
        from ..models.vision import load_vlm
        model, processor = load_vlm(path)
        return cls(model, VisionCodec(processor, **codec_options), device)

    def _live_model(self):
        if self.model is None:
            raise RuntimeError("this policy is closed")
        return self.model

    def generate(self, prompts: Sequence[Sequence[ChatMessage]], max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, seed: int | None = None) -> list[Generation]:
        """One completion per chat prompt; image blocks are {"type": "image", "png": <PNG bytes>}."""
        encoded = [self.codec.encode_chat(messages) for messages in prompts]
        return self.generate_from_ids([ids for ids, _ in encoded], max_new_tokens, temperature, top_p, seed,
                                      images=[pngs for _, pngs in encoded])

    @torch.no_grad()
    def generate_from_ids(self, prompt_ids: Sequence[Sequence[int]], max_new_tokens: int, temperature: float = 1.0,
                          top_p: float = 1.0, seed: int | None = None, row_seeds: Sequence[int] | None = None,
                          images: Sequence[Sequence[bytes]] | None = None) -> list[Generation]:
        """HFPolicy.generate_from_ids with images: `images[i]` holds the PNG bytes of the images whose
        expanded placeholders row i's ids hold, in order (VisionCodec.encode makes such ids)."""
        model = self._live_model()
        check_ids_request(prompt_ids, max_new_tokens, top_p)
        batch = len(prompt_ids)
        if batch == 0:
            return []
        if images is None:
            images = [[] for _ in range(batch)]
        if len(images) != batch:
            raise ValueError(f"{batch} prompts but image lists for {len(images)}")
        seeds = batch_seeds(batch, seed, row_seeds)
        generators = [torch.Generator().manual_seed(s) for s in seeds]

        # Checked (and decoded) before the model runs: a bad image fails the call, not a forward pass.
        vision = self.codec.model_inputs(images, self.device, prompt_ids=prompt_ids)
        ids, mask = left_pad(prompt_ids, self.pad_token_id)
        ids, mask = ids.to(self.device), mask.to(self.device)
        was_training = model.training
        model.eval()
        try:
            prefill = forward_kwargs(self.codec, ids, mask, vision)
            out = model(**prefill, use_cache=True, logits_to_keep=1)
            # Text positions only after the prefill (explicit: Qwen2-VL's own continuation from a
            # cache spans the whole mask, not the new token).
            tokens, logps, finish = decode(model, out, mask, self._next_positions(model, mask, prefill),
                                           max_new_tokens, temperature, top_p, generators, self.allowed,
                                           self.eos_token_id, self.pad_token_id)
        finally:
            model.train(was_training)
        return generations(self.tokenizer, prompt_ids, tokens, logps, finish,
                           [{"seed": seed, "images": len(row)} for seed, row in zip(seeds, images)])

    def _next_positions(self, model, mask: torch.Tensor, prefill: Mapping[str, Any]) -> torch.Tensor:
        """[B, 1] position of each row's first completion token."""
        if "position_ids" in prefill:
            return prefill["position_ids"][:, -1:] + 1
        # Qwen2-VL with images: the text position after the prompt is its real length plus the
        # offset the model recorded while computing the prompt's 3-D positions.
        deltas = model.model.rope_deltas.to(mask.device).reshape(-1, 1)
        return mask.sum(-1, keepdim=True) + deltas

    def update_weights(self, weights: Weights) -> None:
        """Copy in a state dict, a model's weights, or the weights saved at a path (a save_pretrained
        folder of a vision-language model, or a weights file)."""
        HFPolicy.update_weights(self, weights)   # hf._load_state reads a VLM's folder too

    def close(self) -> None:
        self.model = None
