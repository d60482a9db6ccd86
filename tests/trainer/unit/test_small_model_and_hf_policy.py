"""The small random-weight model, its restricted tokenizer, and the transformers policy backend."""
from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from envserve.core.session import Session  # noqa: E402  (tests may read the envs directly)
from envserve.client import EnvClient  # noqa: E402
from envserve_trainer.models.small import (IM_END, IM_START, TAGS, build_small_model, build_tokenizer, corpus_from_envs,
                                           count_parameters, vocabulary_words, weights_digest)
from envserve_trainer.models.pretrained import load_pretrained, save_model  # noqa: E402
from envserve_trainer.policies import Generation, Policy  # noqa: E402
from envserve_trainer.policies.hf import HFPolicy, nucleus, sequence_logprobs  # noqa: E402

SOKOBAN_PROMPT = [{"role": "system", "content": "You are playing Sokoban."},
                  {"role": "user", "content": "######\n#PX_O#\n######"}]
FROZEN_PROMPT = [{"role": "user", "content": "P_O_\n____\n____\n___G\nWhere do you go?"}]
SHORT_PROMPT = [{"role": "user", "content": "Up"}]


@pytest.fixture(scope="module")
def corpus(grid_server):
    with EnvClient(grid_server.address) as c:
        return corpus_from_envs(c)


@pytest.fixture(scope="module")
def tok(corpus):
    return build_tokenizer(corpus)


@pytest.fixture(scope="module")
def model(tok):
    return build_small_model(tok, "tiny", seed=0)


@pytest.fixture(scope="module")
def policy(model, tok):
    return HFPolicy(model, tok)


def _env_texts(env_id: str, seeds=(0, 5, 9)) -> list[str]:
    s = Session(env_id)
    texts = [s.system_prompt()]
    for seed in seeds:
        texts.append(s.reset(seed=seed).text)
    s.close()
    return texts


# -- tokenizer ------------------------------------------------------------------------------------
@pytest.mark.parametrize("env_id", ["sokoban", "frozenlake"])
def test_tokenizer_round_trips_env_texts(tok, env_id):
    # Seeds 5 and 9 are not among the corpus seeds (0-3): new boards must encode the same way.
    prompt, *boards = _env_texts(env_id)
    for text in (prompt, *boards):
        assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    for board in boards:
        # one token per cell and per line break: the model sees the grid cell by cell
        assert len(tok(board, add_special_tokens=False)["input_ids"]) == len(board)


def test_grid_cells_are_one_token_each(tok):
    ids = tok("#PX_O#\nPO√G", add_special_tokens=False)["input_ids"]
    assert [tok.decode([i]) for i in ids] == ["#", "P", "X", "_", "O", "#", "\n", "P", "O", "√", "G"]


def test_env_words_are_single_tokens_with_and_without_a_space(tok, corpus):
    words = vocabulary_words(corpus)
    assert {"Sokoban", "Frozen", "Lake", "hole", "Up", "Down", "Left", "Right", "assistant"} <= set(words)
    for w in words:
        assert len(tok(w, add_special_tokens=False)["input_ids"]) == 1, w
        assert len(tok(" " + w, add_special_tokens=False)["input_ids"]) == 1, w


def test_tags_are_whole_tokens_and_round_trip(tok):
    for tag in TAGS:
        assert len(tok(tag, add_special_tokens=False)["input_ids"]) == 1, tag
    answer = ("<think><observation>P_O_</observation><reasoning>the hole is right of me</reasoning>"
              "<prediction>P</prediction></think><answer>Down, Right</answer>")
    ids = tok(answer, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == answer
    # the tags survive skip_special_tokens: they are ordinary (added) tokens, not specials
    assert tok.decode(ids, skip_special_tokens=True) == answer
    assert [tok.decode([i]) for i in ids[-4:]] == ["Down", ",", " Right", "</answer>"]


def test_words_outside_the_vocabulary_are_spelled_not_lost(tok):
    text = "Up zxqv Down ∂"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    assert len(ids) > 3   # "zxqv" and "∂" are no single tokens: several pieces each


def test_vocabulary_does_not_depend_on_corpus_order(tok, corpus):
    assert build_tokenizer(list(reversed(corpus))).get_vocab() == tok.get_vocab()


def test_chat_template_renders_qwen_style(tok):
    text = tok.apply_chat_template(SOKOBAN_PROMPT, add_generation_prompt=True, tokenize=False)
    assert text == ("<|im_start|>system\nYou are playing Sokoban.<|im_end|>\n"
                    "<|im_start|>user\n######\n#PX_O#\n######<|im_end|>\n<|im_start|>assistant\n")
    tokens = [tok.decode([i]) for i in tok(text, add_special_tokens=False)["input_ids"]]
    assert tokens[:3] == [IM_START, "system", "\n"]
    assert tokens[-3:] == [IM_START, "assistant", "\n"]
    assert tok.eos_token == IM_END and tokens.count(IM_END) == 2 and tok.bos_token is None


def test_corpus_is_the_same_on_every_read(grid_server, corpus):
    # The walks are seeded (env seeds and the walk rng): a second read through the service is identical,
    # so a random-init run rebuilds the same vocabulary in any process.
    with EnvClient(grid_server.address) as c:
        assert corpus_from_envs(c) == corpus


TRAINER_SOURCE = Path(__file__).resolve().parents[3] / "trainer" / "envserve_trainer"


def test_trainer_reaches_envserve_only_through_the_client():
    # Every import of envserve in the trainer, at module level or inside a function, is envserve.client
    # (or below it): environments, server and core stay on the other side of the wire.
    seen = []
    for path in sorted(TRAINER_SOURCE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            for name in names:
                if name == "envserve" or name.startswith("envserve."):
                    seen.append((path.name, name))
    assert seen, "the trainer imports the client somewhere"
    assert [x for x in seen if not (x[1] == "envserve.client" or x[1].startswith("envserve.client."))] == []


# -- model ----------------------------------------------------------------------------------------
def test_model_is_deterministic_in_its_seed_and_leaves_the_global_rng(tok, model):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    again = build_small_model(tok, "tiny", seed=0)
    assert torch.equal(torch.rand(3), expected)  # building did not draw from the global generator
    assert weights_digest(again) == weights_digest(model)
    assert weights_digest(build_small_model(tok, "tiny", seed=1)) != weights_digest(model)


def test_tiny_parameter_count(tok, model):
    # Qwen2 "tiny": hidden h=64, 2 layers, 4 heads of 16 (q width 64), 2 kv heads (k/v width 32),
    # MLP width 192, input and output embeddings untied. Per layer:
    #   q 64*64+64 = 4160, k 64*32+32 = 2080, v 2080, o 64*64 = 4096 (q/k/v have biases, o none),
    #   MLP gate/up/down 3*64*192 = 36864, two RMSNorms 2*64 = 128  -> 49408.
    # Total = 2*V*64 (embedding and lm_head) + 2*49408 + 64 (final norm).
    assert count_parameters(model) == 2 * len(tok) * 64 + 2 * 49408 + 64


def test_unknown_size_is_an_error(tok):
    with pytest.raises(ValueError, match="unknown model size"):
        build_small_model(tok, "huge")


# -- policy ---------------------------------------------------------------------------------------
def test_policy_satisfies_the_protocol(policy):
    assert isinstance(policy, Policy)


def test_same_seed_same_samples_other_seed_other_samples(policy):
    prompts = [SOKOBAN_PROMPT, FROZEN_PROMPT, FROZEN_PROMPT]
    a = policy.generate(prompts, max_new_tokens=12, temperature=1.0, seed=7)
    b = policy.generate(prompts, max_new_tokens=12, temperature=1.0, seed=7)
    c = policy.generate(prompts, max_new_tokens=12, temperature=1.0, seed=8)
    assert [g.completion_token_ids for g in a] == [g.completion_token_ids for g in b]
    assert [g.completion_logprobs for g in a] == [g.completion_logprobs for g in b]
    assert [g.completion_token_ids for g in a] != [g.completion_token_ids for g in c]
    # one base seed, two rows with the same prompt: each row draws from its own stream
    assert a[1].completion_token_ids != a[2].completion_token_ids
    assert all(isinstance(g, Generation) and g.finish_reason == "length" and len(g.completion_token_ids) == 12
               for g in a)


def test_a_rows_samples_do_not_depend_on_its_batch(policy):
    # Row 0 keeps its stream (seed, 0) and its positions whatever else is in the batch.
    alone = policy.generate([FROZEN_PROMPT], max_new_tokens=10, seed=3)[0]
    batched = policy.generate([FROZEN_PROMPT, SOKOBAN_PROMPT, SHORT_PROMPT], max_new_tokens=10, seed=3)[0]
    assert alone.completion_token_ids == batched.completion_token_ids
    assert alone.text == batched.text


def test_greedy_batched_equals_single(policy):
    prompts = [SOKOBAN_PROMPT, FROZEN_PROMPT, SHORT_PROMPT]  # different lengths: left padding at work
    batched = policy.generate(prompts, max_new_tokens=16, temperature=0.0)
    single = [policy.generate([p], max_new_tokens=16, temperature=0.0)[0] for p in prompts]
    assert [g.text for g in batched] == [g.text for g in single]
    assert [g.completion_token_ids for g in batched] == [g.completion_token_ids for g in single]
    for b, s in zip(batched, single):
        assert b.completion_logprobs == pytest.approx(s.completion_logprobs, abs=1e-4)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_generate_logprobs_equal_recomputed_sequence_logprobs(policy, model, temperature):
    gens = policy.generate([SOKOBAN_PROMPT, FROZEN_PROMPT, SHORT_PROMPT], max_new_tokens=14,
                           temperature=temperature, seed=11)
    with torch.no_grad():
        logp, mask = sequence_logprobs(model, [g.prompt_token_ids for g in gens],
                                       [g.completion_token_ids for g in gens], temperature=temperature)
    for i, g in enumerate(gens):
        n = len(g.completion_token_ids)
        assert mask[i].sum().item() == n
        assert logp[i, :n].tolist() == pytest.approx(g.completion_logprobs, abs=1e-4)


def test_stop_at_eos_with_ragged_rows(tok):
    # The tiny random model's logits are nearly equal (all about 0), so adding b to the eos logit gives
    # p(eos) = e^b / (e^b + V - 1); for p(eos) = 0.1, e^b = (V - 1) / 9. A row then runs all 10 tokens
    # with probability 0.9^10 = 0.35, so among 16 rows some stop early and some hit the limit
    # (all 16 stopping has probability 0.65^16 = 0.001, none stopping 0.35^16 < 1e-7).
    m = build_small_model(tok, "tiny", seed=2)
    bias = torch.zeros(len(tok))
    bias[tok.eos_token_id] = math.log((len(tok) - 1) / 9)
    m.lm_head.register_forward_hook(lambda mod, inp, out: out + bias)
    pol = HFPolicy(m, tok)
    gens = pol.generate([FROZEN_PROMPT] * 16, max_new_tokens=10, seed=4)
    reasons = {g.finish_reason for g in gens}
    assert reasons == {"stop", "length"}
    for g in gens:
        ids = g.completion_token_ids
        if g.finish_reason == "stop":
            assert ids[-1] == tok.eos_token_id and tok.eos_token_id not in ids[:-1]
            assert g.text == tok.decode(ids[:-1], skip_special_tokens=True)
            # the sampler's own log-probability of eos: about log 0.1 (the other logits are only nearly equal)
            assert math.exp(g.completion_logprobs[-1]) == pytest.approx(0.1, abs=0.03)
        else:
            assert len(ids) == 10 and tok.eos_token_id not in ids
    # rows that ended early were fed pads afterwards; the others' log-probabilities are untouched by it
    with torch.no_grad():
        logp, mask = sequence_logprobs(m, [g.prompt_token_ids for g in gens], [g.completion_token_ids for g in gens])
    for i, g in enumerate(gens):
        assert logp[i, :len(g.completion_token_ids)].tolist() == pytest.approx(g.completion_logprobs, abs=1e-4)


def test_sequence_logprobs_gradient_and_padding(model, tok):
    prompt = [tok(x, add_special_tokens=False)["input_ids"] for x in ("Up", "P_O_\n____")]
    completion = [[tok.convert_tokens_to_ids("Down")], [tok.convert_tokens_to_ids("Left")] * 3]
    logp, mask = sequence_logprobs(model, prompt, completion)
    assert mask.tolist() == [[True, False, False], [True, True, True]]
    assert logp[0, 1:].tolist() == [0.0, 0.0]
    (-logp.sum()).backward()
    assert model.model.embed_tokens.weight.grad is not None
    model.zero_grad(set_to_none=True)


def test_nucleus_worked_example():
    # p = (0.5, 0.3, 0.15, 0.05), top_p = 0.7: the mass before each token in descending order is
    # 0, 0.5, 0.8, 0.95; tokens whose preceding mass is already >= 0.7 drop, leaving {0.5, 0.3},
    # renormalised to 0.5/0.8 = 0.625 and 0.3/0.8 = 0.375. Order in the vocabulary does not matter.
    p = torch.tensor([[0.15, 0.5, 0.05, 0.3]])
    kept = nucleus(p.log(), 0.7).exp()
    assert kept.tolist()[0] == pytest.approx([0.0, 0.625, 0.0, 0.375], abs=1e-6)
    # top_p below the first token's mass still keeps that token
    assert nucleus(p.log(), 0.1).exp().tolist()[0] == pytest.approx([0.0, 1.0, 0.0, 0.0], abs=1e-6)


def test_top_p_logprobs_are_those_of_the_nucleus(policy, model):
    gens = policy.generate([FROZEN_PROMPT], max_new_tokens=8, temperature=1.0, top_p=0.5, seed=5)
    with torch.no_grad():
        full, _ = sequence_logprobs(model, [gens[0].prompt_token_ids], [gens[0].completion_token_ids])
    # A kept token's nucleus log-probability is log p - log M, M the nucleus mass; the nucleus is the
    # fewest tokens reaching top_p, so 0.5 <= M <= 1 and log p <= log p_nucleus <= log p + log 2.
    for lp_nucleus, lp_full in zip(gens[0].completion_logprobs, full[0].tolist()):
        assert lp_full - 1e-5 <= lp_nucleus <= lp_full + math.log(2) + 1e-5
    # the tiny model's distribution is spread out, so the nucleus is a strict subset: M < 1
    assert any(lp_nucleus > lp_full + 1e-3 for lp_nucleus, lp_full in zip(gens[0].completion_logprobs, full[0].tolist()))


def test_update_weights_from_state_dict_and_directory(tok, model, tmp_path):
    other = HFPolicy(build_small_model(tok, "tiny", seed=9), tok)
    prompts = [SOKOBAN_PROMPT, FROZEN_PROMPT]
    reference = [g.completion_token_ids for g in HFPolicy(model, tok).generate(prompts, 12, temperature=0.0)]
    assert [g.completion_token_ids for g in other.generate(prompts, 12, temperature=0.0)] != reference
    other.update_weights(model.state_dict())
    assert weights_digest(other.model) == weights_digest(model)
    assert [g.completion_token_ids for g in other.generate(prompts, 12, temperature=0.0)] == reference

    third = HFPolicy(build_small_model(tok, "tiny", seed=10), tok)
    third.update_weights(save_model(tmp_path / "m", model, tok))
    assert weights_digest(third.model) == weights_digest(model)
    with pytest.raises(ValueError, match="do not fit"):
        third.update_weights({"not.a.weight": torch.zeros(1)})


def test_save_load_round_trip(tok, model, tmp_path):
    path = save_model(tmp_path / "small", model, tok)
    loaded, tok2 = load_pretrained(str(path))
    # what any other loader gets (vLLM, transformers serve): AutoTokenizer picks Qwen2Tokenizer for qwen2
    from transformers import AutoTokenizer
    auto = AutoTokenizer.from_pretrained(path)
    assert weights_digest(loaded) == weights_digest(model)
    text = tok.apply_chat_template(SOKOBAN_PROMPT, add_generation_prompt=True, tokenize=False)
    assert tok2.apply_chat_template(SOKOBAN_PROMPT, add_generation_prompt=True, tokenize=False) == text
    assert tok2(text, add_special_tokens=False)["input_ids"] == tok(text, add_special_tokens=False)["input_ids"]
    assert auto(text, add_special_tokens=False)["input_ids"] == tok(text, add_special_tokens=False)["input_ids"]
    obs = "#PX_O#\n<answer>Up</answer> zxqv"
    assert tok2.decode(tok2(obs, add_special_tokens=False)["input_ids"]) == obs
    assert auto.decode(auto(obs, add_special_tokens=False)["input_ids"]) == obs
    a = HFPolicy(model, tok).generate([FROZEN_PROMPT], 10, seed=1)[0]
    b = HFPolicy(loaded, tok2).generate([FROZEN_PROMPT], 10, seed=1)[0]
    assert (a.text, a.completion_token_ids) == (b.text, b.completion_token_ids)


def test_closed_policy_refuses_to_generate(tok, model):
    p = HFPolicy(model, tok)
    p.close()
    with pytest.raises(RuntimeError, match="closed"):
        p.generate([SHORT_PROMPT], 4)


def test_generate_restores_training_mode(tok):
    m = build_small_model(tok, "tiny", seed=0).train()
    HFPolicy(m, tok).generate([SHORT_PROMPT], 3, seed=0)
    assert m.training


# -- a shared prefix computed once --------------------------------------------------------------------
def _long_prompts(tok) -> list[list[int]]:
    # One system block (the env's rules, well over MIN_SHARED_PREFIX tokens) before different boards.
    system = _env_texts("sokoban")[0]
    boards = _env_texts("frozenlake", seeds=(1, 2, 3, 4))[1:]
    return [tok.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": b + "x" * i}],
                                    add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
            for i, b in enumerate(boards)]


def test_shared_prefix_length_stops_where_prompts_differ_and_keeps_a_token_each(tok):
    from envserve_trainer.policies.hf import MIN_SHARED_PREFIX, shared_prefix_length
    prompts = _long_prompts(tok)
    n = shared_prefix_length(prompts)
    assert n >= MIN_SHARED_PREFIX
    assert all(p[:n] == prompts[0][:n] for p in prompts) and len({p[n] for p in prompts}) > 1
    assert shared_prefix_length([prompts[0], prompts[0]]) == len(prompts[0]) - 1
    assert shared_prefix_length(prompts[:1]) == 0                       # a single row: nothing to share
    assert shared_prefix_length([[1] * 10 + [2], [1] * 10 + [3]]) == 0    # too short to pay off


def test_shared_prefix_gives_the_same_samples_logprobs_and_gradients(tok, model):
    prompts = _long_prompts(tok)
    shared, plain = HFPolicy(model, tok, share_prefix=True), HFPolicy(model, tok, share_prefix=False)
    for temperature in (0.0, 1.0):
        a = shared.generate_from_ids(prompts, 12, temperature=temperature, seed=5)
        b = plain.generate_from_ids(prompts, 12, temperature=temperature, seed=5)
        assert [g.completion_token_ids for g in a] == [g.completion_token_ids for g in b]
        for x, y in zip(a, b):
            assert x.completion_logprobs == pytest.approx(y.completion_logprobs, abs=1e-4)
    completions = [g.completion_token_ids for g in a]
    grads = []
    for share in (True, False):
        model.zero_grad(set_to_none=True)
        logp, mask = sequence_logprobs(model, prompts, completions, share_prefix=share)
        (-logp.sum()).backward()
        grads.append((logp.detach(), model.model.layers[0].self_attn.q_proj.weight.grad.clone()))
    model.zero_grad(set_to_none=True)
    assert torch.allclose(grads[0][0], grads[1][0], atol=1e-4)
    # the prefix's gradient reaches the first layer once per row, as in the plain layout
    assert torch.allclose(grads[0][1], grads[1][1], atol=1e-4, rtol=1e-3)
    assert grads[0][1].abs().sum() > 0
