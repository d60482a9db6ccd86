"""envserve.integrations.verl against verl 0.9's own classes: EnvServeAgentLoop run through verl's
agent-loop registry and its LLMServerClient, and EnvServeTool loaded from a verl tool config.

The model server: verl's LLMServerClient (unchanged) routes each `generate` through verl's own
GlobalRequestLoadBalancer (a Ray actor, as in training) to a rollout replica. verl's replicas are vLLM,
SGLang or TensorRT-LLM servers, which need a GPU; here the replica is `HFReplica`, a Ray actor that
holds a real Hugging Face Qwen2 model (random weights, the trainer's tiny test model and tokenizer,
saved and loaded from disk) behind the same `generate(prompt_ids, sampling_params, request_id, ...)
-> TokenOutput` interface vLLM's async server has. That replica is the only stand-in.

Opt-in (verl needs its own venv, deploy/trainer/verl-venv.sh): `make test-verl`, or
ENVSERVE_TEST_VERL=1 .verl-venv/bin/python -m pytest -q tests/integrations/test_verl.py
"""
from __future__ import annotations

import asyncio
import os
import sys

import grpc
import pytest

if os.environ.get("ENVSERVE_TEST_VERL") != "1":
    pytest.skip("verl tests are opt-in: `make test-verl` (verl needs its own venv, deploy/trainer/verl-venv.sh)",
                allow_module_level=True)
pytest.importorskip("verl")
ray = pytest.importorskip("ray")

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from envserve.client import EnvClient  # noqa: E402
from envserve.client.experts import FrozenLakeExpert, SokobanExpert, plain_answer  # noqa: E402
from envserve.client.experts.base import Truth, session_settings  # noqa: E402
from envserve.integrations.verl import AGENT_NAME, EnvServeAgentLoop, EnvServeTool, observation_text  # noqa: E402
from envserve.v1 import envserve_pb2 as pb  # noqa: E402
from envserve.v1 import envserve_pb2_grpc as pb_grpc  # noqa: E402

from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap, _agent_loop_registry  # noqa: E402
from verl.tools.tool_registry import initialize_tools_from_config  # noqa: E402
from verl.utils.dataset.rl_dataset import RLHFDataset  # noqa: E402
from verl.workers.rollout.llm_server import LLMServerClient  # noqa: E402
from verl.workers.rollout.replica import TokenOutput  # noqa: E402
from verl.workers.rollout.router import GlobalRequestLoadBalancer  # noqa: E402

DIRECTIONS = ["Left", "Down", "Right", "Up"]


def live_session_ids(address: str, env_id: str) -> set[str]:
    with grpc.insecure_channel(address) as ch:
        reply = pb_grpc.MonitorServiceStub(ch).ListSessions(pb.ListSessionsRequest(env_id=env_id, limit=10000))
    return {s.session_id for s in reply.sessions}


class HFReplica:
    """A rollout replica serving a real Hugging Face causal LM with the interface verl's LLMServerClient
    calls on vLLM's async server: token ids in, TokenOutput out. `max_tokens` (else the configured
    response length) bounds the new tokens; generation stops after eos or a stop_token_id, which is
    included in the output, as vLLM does; temperature 0 is greedy; `logprobs` asks for each token's
    log probability. `grammar` restricts sampling as a constrained decoder would: the i-th token is
    drawn from grammar[i] (the last set for the rest). Every call is recorded for the tests."""

    def __init__(self, path: str, response_length: int, grammar: list[list[int]] | None = None, seed: int = 0):
        from transformers import AutoModelForCausalLM
        torch.set_num_threads(1)
        self.model = AutoModelForCausalLM.from_pretrained(path).eval()
        self.eos = self.model.generation_config.eos_token_id
        self.response_length = response_length
        self.grammar = [torch.tensor(sorted(set(ids))) for ids in grammar or []]
        self.generator = torch.Generator().manual_seed(seed)
        self.calls: list[dict] = []

    @torch.no_grad()
    def generate(self, prompt_ids: list[int], sampling_params: dict, request_id: str, image_data=None,
                 video_data=None, audio_data=None, mm_processor_kwargs=None, priority: int = 0, **kwargs) -> TokenOutput:
        max_tokens = max(1, int(sampling_params.get("max_tokens") or self.response_length))
        temperature = float(sampling_params.get("temperature", 1.0))
        stop = {self.eos, *(sampling_params.get("stop_token_ids") or [])}
        out = self.model(torch.tensor([list(prompt_ids)]), use_cache=True)
        tokens, logprobs, reason = [], [], "length"
        for _ in range(max_tokens):
            logits = out.logits[0, -1].float()
            if self.grammar:
                keep = torch.full_like(logits, float("-inf"))
                keep[self.grammar[min(len(tokens), len(self.grammar) - 1)]] = 0.0
                logits = logits + keep
            if temperature > 0:
                logits = logits / temperature
            logp = torch.log_softmax(logits, -1)
            tok = int(logp.argmax()) if temperature <= 0 else int(torch.multinomial(logp.exp(), 1, generator=self.generator))
            tokens.append(tok)
            logprobs.append(float(logp[tok]))
            if tok in stop:
                reason = "completed"
                break
            out = self.model(torch.tensor([[tok]]), past_key_values=out.past_key_values, use_cache=True)
        self.calls.append(dict(request_id=request_id, prompt_ids=list(prompt_ids), token_ids=tokens,
                               max_tokens=max_tokens))
        return TokenOutput(token_ids=tokens, log_probs=logprobs if sampling_params.get("logprobs") else None,
                           stop_reason=reason, num_preempted=0, extra_fields={"global_steps": 0})

    def history(self) -> list[dict]:
        calls, self.calls = self.calls, []
        return calls


# -- fixtures --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(grid_server, tmp_path_factory):
    """The trainer's tiny random-weight Qwen2 model and its grid tokenizer, with one added token per
    complete no_think answer (`<answer>Left</answer>`...), saved as a Hugging Face checkpoint."""
    from tokenizers import AddedToken

    from envserve_trainer.model import build_small_model, build_tokenizer, corpus_from_envs
    with EnvClient(grid_server.address) as c:
        tok = build_tokenizer(corpus_from_envs(c, ["frozenlake", "sokoban"], seeds=range(2), steps=3))
    tok.add_tokens([AddedToken(f"<answer>{d}</answer>", special=False, normalized=False) for d in DIRECTIONS])
    model = build_small_model(tok, "tiny", seed=0)
    path = tmp_path_factory.mktemp("tiny-qwen2")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def ray_cluster():
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    # The replica class lives in this test module, which Ray's workers cannot import by name.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    ray.shutdown()


RESPONSE_LENGTH = 160


def trainer_config(**rollout):
    """The parts of verl's trainer config an agent loop and LLMServerClient read."""
    r = dict(prompt_length=1024, response_length=RESPONSE_LENGTH, full_determinism=False, name="vllm")
    r.update(rollout)
    return OmegaConf.create({"actor_rollout_ref": {"rollout": r}, "data": {"apply_chat_template_kwargs": {}}})


class Rollouts:
    """verl's LLMServerClient over its GlobalRequestLoadBalancer and one HFReplica, and agent loops
    made the way verl's AgentLoopWorker makes them: hydra-instantiated from the registry entry."""

    def __init__(self, model_dir: str, tokenizer, grammar=None, **rollout):
        self.config = trainer_config(**rollout)
        self.replica = ray.remote(HFReplica).remote(model_dir, self.config.actor_rollout_ref.rollout.response_length,
                                                    grammar)
        balancer = ray.remote(GlobalRequestLoadBalancer).remote({"replica-0": self.replica})
        self.client = LLMServerClient(self.config, load_balancer_handle=balancer)
        self.tokenizer = tokenizer

    def loop(self, entry: dict) -> EnvServeAgentLoop:
        import hydra
        return hydra.utils.instantiate(
            config=OmegaConf.create(entry), trainer_config=DictConfigWrap(self.config), server_manager=self.client,
            tokenizer=self.tokenizer, processor=None, hf_model_type="qwen2", dataset_cls=RLHFDataset,
            data_config=DictConfigWrap(self.config.data), tools=ToolListWrap([]))

    def run(self, entry: dict, rows: list[dict], temperature: float = 1.0):
        """Runs one agent loop per row concurrently, as AgentLoopWorker.generate_sequences does."""
        params = dict(temperature=temperature, top_p=1.0, top_k=-1, repetition_penalty=1.0, logprobs=True)

        async def main():
            return await asyncio.gather(*(self.loop(entry).run(dict(params), raw_prompt=[], **row) for row in rows))
        return asyncio.run(main())

    def history(self) -> list[dict]:
        return ray.get(self.replica.history.remote())


def one_answer(tokenizer) -> list[list[int]]:
    """A grammar for HFReplica: one whole answer token (`<answer>Down</answer>`), then end of turn."""
    return [[tokenizer.convert_tokens_to_ids(f"<answer>{d}</answer>") for d in DIRECTIONS], [tokenizer.eos_token_id]]


def entry(address: str, env_id: str, **kw) -> dict:
    """An agent_loop_config_path entry, as a user writes it."""
    return {"name": AGENT_NAME, "_target_": "envserve.integrations.verl.EnvServeAgentLoop",
            "address": address, "env_id": env_id, "action_format": "no_think", **kw}


def segments(mask: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) runs of the mask."""
    runs, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            runs.append((mask[start], start, i))
            start = i
    return runs


def check_episode(out, calls, tokenizer, address, env_id, seed, config=None):
    """The rollout against the model's calls and a replay of its answers in a fresh session: prompt =
    the chat template of (Open's system prompt, the first observation); mask 1 exactly on the tokens
    the replica generated, in order; mask 0 exactly on the chat template's rendering of each
    observation turn; reward_score = the replayed episode's summed reward. Returns the replay's results."""
    assert len(out.response_ids) == len(out.response_mask) == len(out.response_logprobs)
    assert len(out.response_ids) <= RESPONSE_LENGTH
    with EnvClient(address) as c:
        opened = c.open_sessions(env_id, 1, dict(config or {}), "no_think")
        sid = opened.session_ids[0]
        try:
            first = c.reset_one(sid, seed)
            expected_prompt = tokenizer.apply_chat_template(
                [{"role": "system", "content": opened.system_prompt}, {"role": "user", "content": first.observation.text}],
                add_generation_prompt=True, tokenize=True, return_dict=False)
            assert out.prompt_ids == list(expected_prompt)
            runs = segments(out.response_mask)
            assert runs[0][0] == 1 and [v for v, _, _ in runs] == [1, 0] * (len(runs) // 2) + [1] * (len(runs) % 2)
            generated = [r for r in runs if r[0] == 1]
            assert len(generated) == len(calls)
            results = []
            for i, ((_, a, b), call) in enumerate(zip(generated, calls)):
                # The replica saw the whole conversation so far and produced exactly these tokens.
                assert out.response_ids[a:b] == call["token_ids"]
                assert call["prompt_ids"] == out.prompt_ids + out.response_ids[:a]
                text = tokenizer.decode(call["token_ids"], skip_special_tokens=True)
                results.append(c.step_one(sid, text))
                if i + 1 < len(generated):
                    _, oa, ob = runs[2 * i + 1]
                    # An observation turn: the user turn of the chat template, its text the env's own.
                    head = "\n" if call["token_ids"][-1] == tokenizer.eos_token_id else ""
                    assert tokenizer.decode(out.response_ids[oa:ob]) == (
                        f"{head}<|im_start|>user\n{observation_text(results[-1])}<|im_end|>\n<|im_start|>assistant\n")
                    assert results[-1].observation.text in tokenizer.decode(out.response_ids[oa:ob])
            # Each answer's logprob is the replica's own, on mask-1 tokens; 0 on observation tokens.
            assert all(lp == 0.0 for lp, m in zip(out.response_logprobs, out.response_mask) if m == 0)
        finally:
            c.close_sessions([sid])
    assert out.reward_score == pytest.approx(sum(r.reward for r in results), abs=1e-6)
    assert out.extra_fields["turn_scores"] == pytest.approx([r.reward for r in results])
    assert out.num_turns == 2 * len(generated)     # the prompt, each answer and each observation turn in between
    return results


# -- the agent loop --------------------------------------------------------------------------------
def test_agent_loop_plays_frozenlake_through_verls_server_client(grid_server, model_dir, tokenizer, ray_cluster):
    """Constrained to whole answers, the random model plays real moves: each episode's return,
    masks and turns line up with the tokens and with a replay in a fresh session."""
    assert _agent_loop_registry[AGENT_NAME] == {"_target_": "envserve.integrations.verl.EnvServeAgentLoop"}
    rollouts = Rollouts(model_dir, tokenizer, grammar=one_answer(tokenizer))
    seeds = [0, 1, 2, 3]
    outs = rollouts.run(entry(grid_server.address, "frozenlake", max_turns=6), [{"seed": s} for s in seeds])
    pool = rollouts.history()
    rewards, finished = [], 0
    for out, seed in zip(outs, seeds):
        calls_of = calls_for(out, pool)
        results = check_episode(out, calls_of, tokenizer, grid_server.address, "frozenlake", seed)
        assert all(r.action_valid for r in results)           # whole answers only: every move is valid
        assert 1 <= len(results) <= 6
        if results[-1].done:
            finished += 1
            assert out.extra_fields["reward_extra_info"]["env_success"] == float(results[-1].success)
        else:
            assert len(results) == 6                           # max_turns ended it
        rewards.append(out.reward_score)
        assert out.multi_modal_data == {}
        assert out.metrics.generate_sequences > 0
    assert finished >= 1 and len(set(rewards)) > 1
    # Every episode's session was closed on the server.
    live = live_session_ids(grid_server.address, "frozenlake")
    assert not {o.extra_fields["envserve_session"] for o in outs} & live


def calls_for(out, pool: list[dict]) -> list[dict]:
    """The replica's calls that made this rollout (taken out of `pool`), in turn order: those whose
    prompt and output are a prefix of the rollout's tokens past its prompt. (LLMServerClient sends
    each turn under a fresh request id, so the ids do not group them.)"""
    full = out.prompt_ids + out.response_ids
    mine = [c for c in pool if len(c["prompt_ids"]) >= len(out.prompt_ids)
            and full[:len(c["prompt_ids"]) + len(c["token_ids"])] == c["prompt_ids"] + c["token_ids"]]
    mine.sort(key=lambda c: len(c["prompt_ids"]))
    picked, seen = [], set()
    for c in mine:  # identical rollouts (same seed, same samples) each take their own copy
        if len(c["prompt_ids"]) not in seen:
            seen.add(len(c["prompt_ids"]))
            picked.append(c)
    for c in picked:
        pool.remove(c)
    return picked
