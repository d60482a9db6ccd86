"""Vision-language policies: tiny random-weight Qwen2-VL and Idefics3 models (vision_model.build_vlm),
the codec that turns PNG observations into what they read, and sampling and scoring over them."""
from __future__ import annotations

import io

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
np = pytest.importorskip("numpy")
from PIL import Image  # noqa: E402

from envserve.core.session import Session  # noqa: E402  (tests may read the envs directly)
from envserve.server.convert import png_bytes  # noqa: E402  (the bytes the server sends)
from envserve_trainer.models.small import build_small_model, build_tokenizer, weights_digest  # noqa: E402
from envserve_trainer.policies import HFVisionPolicy as LazyHFVisionPolicy  # noqa: E402
from envserve_trainer.policies.vision import (HFVisionPolicy, VisionCodec, VisionError, decode_png, keep_last_images,
                                              vision_sequence_logprobs)
from envserve_trainer.rollout.prompting import ChatLayout  # noqa: E402
from envserve_trainer.models.vision import DEFAULT_CORPUS, build_vlm, load_vlm  # noqa: E402

ARCHS = ["qwen2_vl", "idefics3"]


def env_png(env_id: str, seed: int, size: int = 128) -> bytes:
    return png_bytes(env_image(env_id, seed, size))


def env_image(env_id: str, seed: int, size: int = 128):
    s = Session(env_id, {"render_image": True, "image_size": size})
    try:
        return s.reset(seed=seed).image
    finally:
        s.close()


def solid_png(color, size=(128, 128)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def pngs():
    return {"lake0": env_png("frozenlake", 0), "lake1": env_png("frozenlake", 1),
            "soko0": env_png("sokoban", 0), "soko_small": env_png("sokoban", 2, size=96)}


@pytest.fixture(scope="module", params=ARCHS)
def vlm(request):
    model, processor = build_vlm(request.param, seed=0)
    return request.param, model, processor, VisionCodec(processor)


def image_prompt(*blocks) -> list[dict]:
    content = [{"type": "image", "png": b} if isinstance(b, bytes) else {"type": "text", "text": b} for b in blocks]
    return [{"role": "system", "content": "You are playing Frozen Lake."}, {"role": "user", "content": content}]


def batch(codec, pngs):
    """Three rows: one image, two images (of other sizes), no image."""
    prompts = [image_prompt(pngs["lake0"], "Up"), image_prompt("Now", pngs["soko_small"], pngs["lake1"], "Left"),
               [{"role": "user", "content": "Down"}]]
    encoded = [codec.encode_chat(p) for p in prompts]
    return [ids for ids, _ in encoded], [images for _, images in encoded]


def padded(gens) -> torch.Tensor:
    out = torch.zeros((len(gens), max(len(g.completion_logprobs) for g in gens)))
    for i, g in enumerate(gens):
        out[i, :len(g.completion_logprobs)] = torch.tensor(g.completion_logprobs)
    return out


# -- the image the model receives ---------------------------------------------------------------------
def test_decoded_png_is_exactly_the_env_image():
    array = env_image("frozenlake", 3)
    image = decode_png(png_bytes(array), max_side=1024)
    assert image.mode == "RGB" and image.size == (array.shape[1], array.shape[0])
    assert np.array_equal(np.asarray(image), array)


def test_pixel_values_are_the_image_processors_own(vlm, pngs):
    arch, _, processor, codec = vlm

    def reference(png):
        image = Image.open(io.BytesIO(png)).convert("RGB")
        nested = [image] if arch == "qwen2_vl" else [[image]]
        return processor.image_processor(images=nested, return_tensors="pt")

    got, want = codec.model_inputs([[pngs["lake0"]]]), reference(pngs["lake0"])
    assert torch.equal(got["pixel_values"], want["pixel_values"])
    other = reference(pngs["lake1"])["pixel_values"]
    assert other.shape == got["pixel_values"].shape and not torch.equal(other, got["pixel_values"])

    # A batch: each row's images in order, rows with fewer images padded (Idefics3) or concatenated (Qwen2-VL).
    rows = [[pngs["lake0"]], [pngs["soko_small"], pngs["lake1"]], []]
    got = codec.model_inputs(rows)
    parts = [reference(p) for p in (pngs["lake0"], pngs["soko_small"], pngs["lake1"])]
    if arch == "qwen2_vl":
        assert torch.equal(got["pixel_values"], torch.cat([p["pixel_values"] for p in parts]))
        assert torch.equal(got["image_grid_thw"], torch.cat([p["image_grid_thw"] for p in parts]))
    else:
        pv, mask = got["pixel_values"], got["pixel_attention_mask"]
        assert pv.shape[:2] == (3, 2)
        assert torch.equal(pv[0, 0], parts[0]["pixel_values"][0, 0])
        assert torch.equal(pv[1, 0], parts[1]["pixel_values"][0, 0])
        assert torch.equal(pv[1, 1], parts[2]["pixel_values"][0, 0])
        assert not pv[0, 1].any() and not pv[2].any() and not mask[0, 1].any() and mask[1].all()


def test_placeholders_expand_to_the_models_image_tokens(vlm, pngs):
    arch, model, processor, codec = vlm
    text = codec.render(image_prompt(pngs["lake0"], "Up"))
    assert text.count(codec.image_token) == 1
    ids = codec.encode(text, [pngs["lake0"]])
    if arch == "qwen2_vl":
        grid = codec.model_inputs([[pngs["lake0"]]])["image_grid_thw"][0]
        expected = int(grid.prod()) // processor.image_processor.merge_size ** 2
    else:
        expected = model.model.image_seq_len
    assert ids.count(codec.image_token_id) == expected > 0
    assert codec.image_token_id == model.config.image_token_id
    # Text outside the image is tokenized as the text policies tokenize it.
    assert ids[-len(codec.tokenizer("Up<|im_end|>\n<|im_start|>assistant\n")["input_ids"]):] == \
        codec.tokenizer("Up<|im_end|>\n<|im_start|>assistant\n")["input_ids"]


def test_string_content_renders_as_the_text_policies_chat(vlm):
    _, _, processor, codec = vlm
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Up"}]
    text = codec.render(messages)
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nUp<|im_end|>\n<|im_start|>assistant\n"
    assert codec.render([{"role": "user", "content": [{"type": "text", "text": "Up"}]}]) == \
        codec.render([{"role": "user", "content": "Up"}])
    ChatLayout(processor.tokenizer)   # the token-carrying rollout's block layout accepts the template


# -- refusals ------------------------------------------------------------------------------------------
def test_bad_images_raise_vision_error(vlm, pngs):
    _, model, _, codec = vlm
    text = codec.render(image_prompt(pngs["lake0"], "Up"))
    with pytest.raises(VisionError, match="empty"):
        codec.encode(text, [b""])
    with pytest.raises(VisionError, match="not a readable PNG"):
        codec.encode(text, [b"not an image at all"])
    with pytest.raises(VisionError, match="corrupt"):
        codec.encode(text, [pngs["lake0"][:len(pngs["lake0"]) // 2]])
    jpeg = io.BytesIO()
    Image.new("RGB", (32, 32)).save(jpeg, format="JPEG")
    with pytest.raises(VisionError, match="expected a PNG image, got JPEG"):
        codec.encode(text, [jpeg.getvalue()])
    with pytest.raises(VisionError, match="300x200 px is larger than the 256 px"):
        VisionCodec(codec.processor, max_image_side=256).encode(text, [solid_png((1, 2, 3), (300, 200))])
    with pytest.raises(VisionError, match="1 image placeholders .* but 0 images"):
        codec.encode(text, [])
    with pytest.raises(VisionError, match="1 image placeholders .* but 2 images"):
        codec.encode(text, [pngs["lake0"], pngs["lake1"]])
    with pytest.raises(VisionError, match="has no 'png'"):
        codec.encode_chat([{"role": "user", "content": [{"type": "image"}]}])

    # A prompt whose image tokens do not match its images fails before the model runs, naming the row.
    policy = HFVisionPolicy(model, codec)
    ids = codec.encode(text, [pngs["lake0"]])
    with pytest.raises(VisionError, match="row 1: its ids hold 0 image tokens"):
        policy.generate_from_ids([ids, [5, 6]], 2, images=[[pngs["lake0"]], [pngs["lake1"]]])
    with pytest.raises(VisionError, match="image 0 of row 0: empty"):
        vision_sequence_logprobs(model, codec, [ids], [[5]], [[b""]])
    # and the policy still works
    assert len(policy.generate_from_ids([ids], 2, images=[[pngs["lake0"]]], seed=0)[0].completion_token_ids) == 2


def test_max_images_holds(vlm, pngs):
    _, model, processor, _ = vlm
    codec = VisionCodec(processor, max_images=2)
    three = [pngs["lake0"], pngs["lake1"], pngs["soko0"]]
    messages = [{"role": "user", "content": [{"type": "image", "png": p}]} for p in three]
    with pytest.raises(VisionError, match="3 images, more than the 2 allowed"):
        codec.encode_chat(messages)
    with pytest.raises(VisionError, match="row 0 holds 3 images, more than the 2 allowed"):
        codec.model_inputs([three])
    kept = keep_last_images(messages, 2)
    ids, images = codec.encode_chat(kept)
    assert images == three[1:]                    # the oldest image goes first
    assert len(kept) == 3 and kept[0]["content"] == []
    gen = HFVisionPolicy(model, codec).generate([kept], 3, seed=0)[0]
    assert gen.prompt_token_ids == ids and gen.extra["images"] == 2


# -- sampling and scoring ------------------------------------------------------------------------------
def test_scoring_reproduces_the_sampled_logprobs(vlm, pngs):
    _, model, _, codec = vlm
    policy = HFVisionPolicy(model, codec)
    ids, images = batch(codec, pngs)
    gens = policy.generate_from_ids(ids, 10, temperature=0.7, seed=3, images=images)
    completions = [g.completion_token_ids for g in gens]
    with torch.no_grad():
        lp, mask, entropy = vision_sequence_logprobs(model, codec, ids, completions, images, temperature=0.7,
                                                     pad_token_id=policy.pad_token_id, allowed=policy.allowed,
                                                     return_entropy=True)
    assert mask.sum().item() == sum(len(c) for c in completions)
    assert torch.allclose(lp, padded(gens), atol=1e-5)
    assert (entropy[mask] > 0).all()
    # The images matter: other images (same token counts) give other log-probabilities.
    swapped = [[images[0][0]], [images[1][0], images[0][0]], []]
    with torch.no_grad():
        other, _ = vision_sequence_logprobs(model, codec, ids, completions, swapped, temperature=0.7)
    assert (other - lp).abs().max() > 1e-4


def test_same_seed_same_completions_and_rows_independent_of_their_neighbours(vlm, pngs):
    _, model, _, codec = vlm
    policy = HFVisionPolicy(model, codec)
    ids, images = batch(codec, pngs)
    first = policy.generate_from_ids(ids, 8, seed=11, images=images)
    again = policy.generate_from_ids(ids, 8, seed=11, images=images)
    assert [g.completion_token_ids for g in first] == [g.completion_token_ids for g in again]
    assert [g.completion_logprobs for g in first] == [g.completion_logprobs for g in again]
    assert [g.completion_token_ids for g in first] != \
        [g.completion_token_ids for g in policy.generate_from_ids(ids, 8, seed=12, images=images)]
    for row in range(3):
        seed = first[row].extra["seed"]
        alone = policy.generate_from_ids([ids[row]], 8, row_seeds=[seed], images=[images[row]])[0]
        # another neighbour: a different image and prompt length, so other padding and positions
        neighbour = (ids[0], images[0]) if row else (ids[1], images[1])
        paired = policy.generate_from_ids([neighbour[0], ids[row]], 8, row_seeds=[seed + 1, seed],
                                          images=[neighbour[1], images[row]])[1]
        for g in (alone, paired):
            assert g.completion_token_ids == first[row].completion_token_ids
            assert np.allclose(g.completion_logprobs, first[row].completion_logprobs, atol=1e-5)


def test_greedy_is_deterministic_and_reports_the_models_logprobs(vlm, pngs):
    _, model, _, codec = vlm
    policy = HFVisionPolicy(model, codec)
    ids, images = batch(codec, pngs)
    a = policy.generate_from_ids(ids, 6, temperature=0.0, seed=1, images=images)
    b = policy.generate_from_ids(ids, 6, temperature=0.0, seed=2, images=images)
    assert [g.completion_token_ids for g in a] == [g.completion_token_ids for g in b]
    with torch.no_grad():
        lp, mask = vision_sequence_logprobs(model, codec, ids, [g.completion_token_ids for g in a], images,
                                            allowed=policy.allowed)
    assert torch.allclose(lp, padded(a), atol=1e-5)
    # greedy: each token is the most likely one, so no other token has a higher log-probability
    assert (lp[mask] > np.log(1 / model.config.get_text_config().vocab_size)).all()


def test_image_placeholder_is_never_sampled(vlm, pngs):
    _, model, _, codec = vlm
    policy = HFVisionPolicy(model, codec, allowed_token_ids=[codec.image_token_id, codec.tokenizer.eos_token_id])
    ids, images = batch(codec, pngs)
    for g in policy.generate_from_ids(ids, 3, seed=0, images=images):
        assert g.completion_token_ids == [policy.eos_token_id]
    assert not policy.allowed[codec.image_token_id]


def test_chat_prompts_with_image_blocks(vlm, pngs):
    _, model, _, codec = vlm
    policy = HFVisionPolicy(model, codec)
    prompt = image_prompt(pngs["lake0"], "Up")
    gen = policy.generate([prompt], 5, seed=4)[0]
    ids, images = codec.encode_chat(prompt)
    assert gen.prompt_token_ids == ids
    assert gen.completion_token_ids == \
        policy.generate_from_ids([ids], 5, seed=4, images=[images])[0].completion_token_ids


def test_gradients_reach_the_vision_tower(pngs):
    for arch in ARCHS:
        model, processor = build_vlm(arch, seed=5)
        codec = VisionCodec(processor)
        model.train()
        ids, images = batch(codec, pngs)
        lp, mask = vision_sequence_logprobs(model, codec, ids, [[7, 8, 9], [10], [11, 12]], images)
        (-(lp * mask).sum()).backward()
        vision = model.model.visual if arch == "qwen2_vl" else model.model.vision_model
        grads = [p.grad for p in vision.parameters()]
        assert all(g is not None for g in grads), arch
        assert sum(float(g.abs().sum()) for g in grads) > 0, arch


# -- weights -------------------------------------------------------------------------------------------
def test_build_vlm_round_trips_through_save_pretrained(vlm, pngs, tmp_path):
    arch, model, processor, codec = vlm
    assert weights_digest(build_vlm(arch, seed=0)[0]) == weights_digest(model)
    assert weights_digest(build_vlm(arch, seed=1)[0]) != weights_digest(model)
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    loaded, loaded_processor = load_vlm(tmp_path)
    assert type(loaded) is type(model) and weights_digest(loaded) == weights_digest(model)
    assert type(loaded_processor) is type(processor)
    if arch == "idefics3":
        from transformers import AutoProcessor
        assert type(AutoProcessor.from_pretrained(tmp_path, local_files_only=True)) is type(processor)
    ids, images = batch(codec, pngs)
    loaded_codec = VisionCodec(loaded_processor)
    assert batch(loaded_codec, pngs) == (ids, images)
    completions = [[7, 8], [9], [10, 11, 12]]
    with torch.no_grad():
        want = vision_sequence_logprobs(model, codec, ids, completions, images)[0]
        got = vision_sequence_logprobs(loaded, loaded_codec, ids, completions, images)[0]
    assert torch.equal(got, want)


def test_update_weights_and_close(vlm, pngs, tmp_path):
    arch, model, processor, codec = vlm
    ids, images = batch(codec, pngs)
    reference = [g.completion_token_ids
                 for g in HFVisionPolicy(model, codec).generate_from_ids(ids, 6, temperature=0.0, images=images)]
    other = HFVisionPolicy(build_vlm(arch, seed=9)[0], codec)
    assert [g.completion_token_ids for g in other.generate_from_ids(ids, 6, temperature=0.0, images=images)] \
        != reference
    other.update_weights(model.state_dict())
    assert [g.completion_token_ids for g in other.generate_from_ids(ids, 6, temperature=0.0, images=images)] \
        == reference
    model.save_pretrained(tmp_path)
    third = HFVisionPolicy(build_vlm(arch, seed=10)[0], codec)
    third.update_weights(tmp_path)
    assert weights_digest(third.model) == weights_digest(model)
    third.close()
    with pytest.raises(RuntimeError, match="closed"):
        third.generate_from_ids(ids, 2, images=images)
    assert LazyHFVisionPolicy is HFVisionPolicy


def test_idefics3_text_model_starts_from_a_causal_lm():
    from transformers import LlamaConfig, LlamaForCausalLM
    tok = build_tokenizer(DEFAULT_CORPUS)
    ids = torch.tensor([tok("You are playing Sokoban.", add_special_tokens=False)["input_ids"]])
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         tie_word_embeddings=True)).eval()
    for lm in (llama, build_small_model(tok, "tiny", seed=3)):
        model, processor = build_vlm("idefics3", tokenizer=tok, text_model=lm, seed=1)
        assert len(processor.tokenizer) > len(tok)          # the image tokens, added to a copy
        with torch.no_grad():
            want, got = lm(input_ids=ids).logits, model(input_ids=ids).logits
        assert torch.allclose(got[..., :want.shape[-1]], want, atol=1e-5)
    with pytest.raises(ValueError, match="idefics3 only"):
        build_vlm("qwen2_vl", tokenizer=tok, text_model=llama)
