"""envserve.integrations.verl against verl 0.9's own classes: verl's hydra ppo_trainer config with an
agent-loop file and a tool file as a user writes them, verl's AgentLoopWorker running
EnvServeAgentLoop (and its stock ToolAgentLoop with EnvServeTool) on DataProto batches, over a real
grid server on loopback.

The model server: verl's LLMServerClient (unchanged) routes each `generate` through verl's own
GlobalRequestLoadBalancer (a Ray actor, as in training) to a rollout replica. verl's replicas are vLLM,
SGLang or TensorRT-LLM servers, which need a GPU; here the replica is `HFReplica`, a Ray actor that
holds a real Hugging Face Qwen2 model (random weights, the trainer's tiny test model and tokenizer,
saved and loaded from disk) behind the same `generate(prompt_ids, sampling_params, request_id, ...)
-> TokenOutput` interface vLLM's async server has; for the vision-language tests `HFVLReplica` holds a
tiny random-weight Qwen2-VL (tests/vlm_support.py) the same way and takes the request's images. These
replicas are the only stand-in.

Opt-in (verl needs its own venv, deploy/trainer/verl-venv.sh): `make test-verl`, or
ENVSERVE_TEST_VERL=1 .verl-venv/bin/python -m pytest -q tests/integrations/test_verl.py
"""
from __future__ import annotations

import asyncio
import io
import json
import os
import sys
import time
from types import SimpleNamespace
from typing import Any
from uuid import uuid4

import grpc
import pytest

if os.environ.get("ENVSERVE_TEST_VERL") != "1":
    pytest.skip("verl tests are opt-in: `make test-verl` (verl needs its own venv, deploy/trainer/verl-venv.sh)",
                allow_module_level=True)
pytest.importorskip("verl")
ray = pytest.importorskip("ray")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from envserve.client import EnvClient  # noqa: E402
from envserve.client.experts import FrozenLakeExpert, SokobanExpert, plain_answer  # noqa: E402
from envserve.client.experts.base import Truth, session_settings  # noqa: E402
from envserve.integrations._common import feedback_and_observation as observation_text  # noqa: E402
from envserve.integrations.verl import AGENT_NAME, EnvServeTool  # noqa: E402
from envserve.v1 import envserve_pb2 as pb  # noqa: E402
from envserve.v1 import envserve_pb2_grpc as pb_grpc  # noqa: E402
from PIL import Image  # noqa: E402
from vlm_support import image_token_count  # noqa: E402

from verl.experimental.agent_loop.agent_loop import _agent_loop_registry  # noqa: E402
from verl.protocol import DataProto  # noqa: E402
from verl.workers.rollout.llm_server import LLMServerClient  # noqa: E402
from verl.workers.rollout.replica import TokenOutput  # noqa: E402
from verl.workers.rollout.router import GlobalRequestLoadBalancer  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

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
    log probability; sampling is seeded by the prompt. `grammar` restricts sampling as a constrained decoder would: the i-th token is
    drawn from grammar[i] (the last set for the rest). Every call is recorded for the tests."""

    def __init__(self, path: str):
        torch.set_num_threads(1)
        self.model = self.load(path)
        self.eos = self.model.generation_config.eos_token_id
        self.configure(RESPONSE_LENGTH)

    def load(self, path: str):
        from transformers import AutoModelForCausalLM
        return AutoModelForCausalLM.from_pretrained(path).eval()

    def prefill(self, prompt_ids: list[int], image_data) -> Any:
        """The model's forward over the whole prompt (its cache carries the generation on)."""
        if image_data:
            raise ValueError("this replica's model takes no images")
        return self.model(torch.tensor([prompt_ids]), use_cache=True)

    def configure(self, response_length: int, grammar: list[list[int]] | None = None, fail_after: int | None = None,
                  seed: int = 0) -> None:
        """A test's settings (one replica serves the module's tests); fail_after: calls before it fails."""
        self.response_length = response_length
        self.grammar = [torch.tensor(sorted(set(ids))) for ids in grammar or []]
        self.seed = seed
        self.calls: list[dict] = []
        self.fail_after = fail_after

    @torch.no_grad()
    def generate(self, prompt_ids: list[int], sampling_params: dict, request_id: str, image_data=None,
                 video_data=None, audio_data=None, mm_processor_kwargs=None, priority: int = 0, **kwargs) -> TokenOutput:
        if self.fail_after is not None and len(self.calls) >= self.fail_after:
            raise RuntimeError("replica failed")
        max_tokens = max(1, int(sampling_params.get("max_tokens") or self.response_length))
        temperature = float(sampling_params.get("temperature", 1.0))
        stop = {self.eos, *(sampling_params.get("stop_token_ids") or [])}
        # Sampling is a function of the prompt alone, whatever order the concurrent rollouts' calls come in.
        generator = torch.Generator().manual_seed(hash((self.seed, *prompt_ids)) % 2**63)
        out = self.prefill(list(prompt_ids), image_data)
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
            tok = int(logp.argmax()) if temperature <= 0 else int(torch.multinomial(logp.exp(), 1, generator=generator))
            tokens.append(tok)
            logprobs.append(float(logp[tok]))
            if tok in stop:
                reason = "completed"
                break
            out = self.model(torch.tensor([[tok]]), past_key_values=out.past_key_values, use_cache=True)
        self.calls.append(dict(request_id=request_id, prompt_ids=list(prompt_ids), token_ids=tokens,
                               max_tokens=max_tokens, images=[pixels(im) for im in image_data or []]))
        return TokenOutput(token_ids=tokens, log_probs=logprobs if sampling_params.get("logprobs") else None,
                           stop_reason=reason, num_preempted=0, extra_fields={"global_steps": 0})

    def history(self) -> list[dict]:
        calls, self.calls = self.calls, []
        return calls


class HFVLReplica(HFReplica):
    """HFReplica over a Qwen2-VL checkpoint (Qwen2VLForConditionalGeneration): the images verl's
    server client passes with a request (as vLLM receives them) go through the checkpoint's own
    image processor into the model's vision tower, and their features take the places of the
    prompt's image pad tokens, as in vLLM. The model refuses a prompt whose image tokens do not
    match the images' features."""

    def load(self, path: str):
        from transformers import AutoModelForImageTextToText, Qwen2VLImageProcessor
        self.image_processor = Qwen2VLImageProcessor.from_pretrained(path)
        model = AutoModelForImageTextToText.from_pretrained(path).eval()
        self.image_token_id = model.config.image_token_id
        return model

    def prefill(self, prompt_ids: list[int], image_data) -> Any:
        ids = torch.tensor([prompt_ids])
        if not image_data:
            return self.model(ids, use_cache=True)
        pixels = self.image_processor(images=list(image_data), return_tensors="pt")
        # mm_token_type_ids marks the image tokens, from which the model builds M-RoPE positions.
        return self.model(ids, pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"],
                          mm_token_type_ids=(ids == self.image_token_id).long(), use_cache=True)


def pixels(image) -> tuple:
    """An image as (width, height, RGB bytes), to compare what the replica received with PNGs."""
    from PIL import Image
    if isinstance(image, bytes):
        image = Image.open(io.BytesIO(image))
    return (*image.size, image.convert("RGB").tobytes())


# -- fixtures --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(grid_server, tmp_path_factory):
    """The trainer's tiny random-weight Qwen2 model and its grid tokenizer, with one added token per
    complete no_think answer (`<answer>Left</answer>`...) and per complete Hermes `move` call, saved
    as a Hugging Face checkpoint."""
    from envserve_trainer.models.small import build_small_model
    tok = grid_tokenizer(grid_server.address)
    model = build_small_model(tok, "tiny", seed=0)
    path = tmp_path_factory.mktemp("tiny-qwen2")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def grid_tokenizer(address: str):
    from tokenizers import AddedToken

    from envserve_trainer.models.small import build_tokenizer, corpus_from_envs
    with EnvClient(address) as c:
        tok = build_tokenizer(corpus_from_envs(c, ["frozenlake", "sokoban"], seeds=range(2), steps=3))
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for d in DIRECTIONS for t in (f"<answer>{d}</answer>", tool_call(d))])
    return tok


@pytest.fixture(scope="module")
def vl_model_dir(grid_server, tmp_path_factory):
    """A tiny random-weight Qwen2-VL (tests/vlm_support.py) over the same grid tokenizer with
    Qwen2-VL's vision tokens, saved with its Qwen2VLProcessor as a Hugging Face checkpoint."""
    from vlm_support import build_tiny_qwen2_vl
    model, processor = build_tiny_qwen2_vl(grid_tokenizer(grid_server.address), seed=0)
    path = tmp_path_factory.mktemp("tiny-qwen2-vl")
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def ray_cluster():
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    # The replica class lives in this test module, which Ray's workers cannot import by name.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    ray.shutdown()


RESPONSE_LENGTH = 160


EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "verl")


def write_configs(directory, address: str | None, tool_options: dict | None = None,
                  loop_options: dict | None = None) -> tuple[str, str]:
    """The two YAML files a verl user writes, as examples/verl/ has them, pointed at this test's
    replica (address None: no address, as the examples have it) and FrozenLake (the test's grammars
    know its moves); the options are entries of their own."""
    import yaml
    with open(os.path.join(EXAMPLE, "agent_loops.yaml")) as f:
        (loop,) = yaml.safe_load(f)
    where = {"address": address} if address is not None else {}
    assert "address" not in loop
    loop.update({**where, "env_id": "frozenlake", "action_format": "no_think", "max_turns": 6,
                 "env_config": {"max_turns": 50}, **(loop_options or {})})
    with open(os.path.join(EXAMPLE, "tools.yaml")) as f:
        tool_file = yaml.safe_load(f)
    (tool,) = tool_file["tools"]
    assert tool["class_name"] == "envserve.integrations.verl.EnvServeTool"
    assert "address" not in tool["config"]
    tool["config"].update({**where, "env_id": "frozenlake", "per_trajectory": False, **(tool_options or {})})
    loops, tools = os.path.join(directory, "agent_loops.yaml"), os.path.join(directory, "tools.yaml")
    with open(loops, "w") as f:
        yaml.safe_dump([loop], f)
    with open(tools, "w") as f:
        yaml.safe_dump(tool_file, f)
    return loops, tools


def trainer_config(model_dir: str, loops: str, tools: str, response_length: int = RESPONSE_LENGTH,
                   overrides: tuple = ()):
    """verl's own ppo_trainer config (hydra), with the lines that point it at envserve."""
    from hydra import compose, initialize_config_dir

    import verl
    with initialize_config_dir(config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer", "config"),
                               version_base=None):
        return compose("ppo_trainer", overrides=[
            f"actor_rollout_ref.model.path={model_dir}",
            "actor_rollout_ref.rollout.name=vllm",
            "actor_rollout_ref.rollout.prompt_length=1024",
            f"actor_rollout_ref.rollout.response_length={response_length}",
            f"actor_rollout_ref.rollout.agent.agent_loop_config_path={loops}",
            "actor_rollout_ref.rollout.agent.default_agent_loop=envserve_agent",
            f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}",
            *overrides,
        ])


class Rollouts:
    """verl's AgentLoopWorker with verl's LLMServerClient over its GlobalRequestLoadBalancer and one
    HFReplica: made in this process, or with `as_actor` a Ray actor, as verl's AgentLoopManager
    makes its workers in training."""

    def __init__(self, model_dir: str, address: str | None, directory, serving, grammar=None,
                 response_length: int = RESPONSE_LENGTH, fail_after: int | None = None,
                 tool_options: dict | None = None, overrides: tuple = (), loop_options: dict | None = None,
                 as_actor: bool = False, actor_env: dict | None = None):
        from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
        self.config = trainer_config(model_dir, *write_configs(directory, address, tool_options, loop_options),
                                     response_length=response_length, overrides=overrides)
        self.replica, balancer = serving
        ray.get(self.replica.configure.remote(response_length, grammar, fail_after))
        llm_client = LLMServerClient(self.config, load_balancer_handle=balancer)
        if as_actor:
            # verl's AgentLoopManager._init_agent_loop_workers, for one worker on this node.
            self.worker = ray.remote(AgentLoopWorker).options(
                name=f"agent_loop_worker_0_{uuid4().hex[:8]}", runtime_env={"env_vars": actor_env or {}},
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(),
                                                                   soft=True),
            ).remote(self.config, llm_client, None, None)
            self.tokenizer = _tokenizer(model_dir)
        else:
            self.worker = AgentLoopWorker(self.config, llm_client)
            self.tokenizer = self.worker.tokenizer

    def run(self, rows: list[dict]) -> DataProto:
        """One batch through AgentLoopWorker.generate_sequences: the rows' columns are what a verl
        dataset would give (raw_prompt, plus a seed and optionally env_id)."""
        columns = {"index": np.arange(len(rows))}
        for key in sorted({"raw_prompt", *(k for row in rows for k in row)}):
            columns[key] = np.empty(len(rows), dtype=object)
            for i, row in enumerate(rows):
                columns[key][i] = row.get(key, [] if key == "raw_prompt" else None)
        batch = DataProto(non_tensor_batch=columns, meta_info={})
        if isinstance(self.worker, ray.actor.ActorHandle):
            return ray.get(self.worker.generate_sequences.remote(batch))
        return asyncio.run(self.worker.generate_sequences(batch))

    def history(self) -> list[dict]:
        return ray.get(self.replica.history.remote())


@pytest.fixture(scope="module")
def serving(model_dir, ray_cluster):
    """One HFReplica behind verl's GlobalRequestLoadBalancer, both Ray actors, for the module."""
    # num_cpus=0: scheduled whatever else the small test cluster holds.
    replica = ray.remote(num_cpus=0)(HFReplica).remote(model_dir)
    balancer = ray.remote(num_cpus=0)(GlobalRequestLoadBalancer).remote({"replica-0": replica})
    yield replica, balancer
    ray.kill(balancer)
    ray.kill(replica)


@pytest.fixture
def rollouts(grid_server, model_dir, serving, tmp_path):
    """make(**kw) -> Rollouts on the grid server and the module's replica, configured for the test."""
    return lambda **kw: Rollouts(model_dir, grid_server.address, tmp_path, serving, **kw)


@pytest.fixture(scope="module")
def vl_serving(vl_model_dir, ray_cluster):
    """One HFVLReplica behind verl's GlobalRequestLoadBalancer, for the module's VLM tests."""
    replica = ray.remote(num_cpus=0)(HFVLReplica).remote(vl_model_dir)
    balancer = ray.remote(num_cpus=0)(GlobalRequestLoadBalancer).remote({"replica-0": replica})
    yield replica, balancer
    ray.kill(balancer)
    ray.kill(replica)


@pytest.fixture
def vl_rollouts(grid_server, vl_model_dir, vl_serving, tmp_path):
    """make(**kw) -> Rollouts whose model is the tiny Qwen2-VL: verl loads its processor from the
    checkpoint, so the agent loops render images through it."""
    return lambda **kw: Rollouts(vl_model_dir, grid_server.address, tmp_path, vl_serving, **kw)


def unpad(data: DataProto) -> list[SimpleNamespace]:
    """Each row of generate_sequences' padded batch as the agent loop returned it."""
    plen = data.batch["prompts"].shape[1]
    rows = []
    for i in range(len(data)):
        att = data.batch["attention_mask"][i]
        n = int(att[plen:].sum())
        assert att[plen:plen + n].all() and not att[plen + n:].any()   # right-padded responses
        rm = data.batch["rm_scores"][i] if "rm_scores" in data.batch.keys() else None
        if rm is not None:
            assert not rm[:n - 1].any() and not rm[n:].any()           # the score sits on the last token
        rows.append(SimpleNamespace(
            prompt_ids=data.batch["prompts"][i][att[:plen].bool()].tolist(),
            response_ids=data.batch["responses"][i, :n].tolist(),
            response_mask=data.batch["response_mask"][i, :n].tolist(),
            response_logprobs=data.batch["rollout_log_probs"][i, :n].tolist(),
            reward_score=None if rm is None else float(rm[n - 1]),
            num_turns=int(data.non_tensor_batch["__num_turns__"][i]),
            extra_fields={k: v[i] for k, v in data.non_tensor_batch.items()},
        ))
        assert not data.batch["response_mask"][i, n:].any()
    return rows


def tool_call(direction: str) -> str:
    return "<tool_call>\n" + json.dumps({"name": "move", "arguments": {"direction": direction}}) + "\n</tool_call>"


def one_call(model_dir: str) -> list[list[int]]:
    """A grammar for HFReplica: one whole `move` tool call, then end of turn."""
    tokenizer = _tokenizer(model_dir)
    return [[tokenizer.convert_tokens_to_ids(tool_call(d)) for d in DIRECTIONS], [tokenizer.eos_token_id]]


def _tokenizer(model_dir: str):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir)


def _answers(tokenizer) -> list[int]:
    return [tokenizer.convert_tokens_to_ids(f"<answer>{d}</answer>") for d in DIRECTIONS]


def one_answer(model_dir: str) -> list[list[int]]:
    """A grammar for HFReplica: one whole answer token (`<answer>Down</answer>`), then end of turn."""
    tokenizer = _tokenizer(model_dir)
    return [_answers(tokenizer), [tokenizer.eos_token_id]]


def garbled(model_dir: str, length: int | None = 6) -> list[list[int]]:
    """A grammar for HFReplica: `length` tokens of anything but an answer or a chat token, then end
    of turn (with length None: never an end of turn)."""
    tokenizer = _tokenizer(model_dir)
    banned = set(_answers(tokenizer)) | set(tokenizer.all_special_ids)
    banned |= {tokenizer.convert_tokens_to_ids(t) for t in ("<answer>", "</answer>")}
    words = [i for i in range(len(tokenizer)) if i not in banned]
    return [words] if length is None else [words] * length + [[tokenizer.eos_token_id]]


def segments(mask: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) runs of the mask."""
    runs, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            runs.append((mask[start], start, i))
            start = i
    return runs


def next_turn_length(tokenizer, result) -> int:
    """Tokens of the observation turn that would follow `result` (after an answer that ended in eos)."""
    text = f"\n<|im_start|>user\n{observation_text(result)}<|im_end|>\n<|im_start|>assistant\n"
    return len(tokenizer.encode(text, add_special_tokens=False))


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
def test_agent_loop_plays_frozenlake_and_sokoban_through_verls_worker(grid_server, model_dir, rollouts):
    """Constrained to whole answers, the random model plays real moves: verl's worker runs the loop
    named in the YAML for each row (the row's env_id overriding the YAML's), and each episode's
    return, masks and turns line up with the replica's tokens and with a replay in a fresh session."""
    rollouts = rollouts(grammar=one_answer(model_dir))
    assert _agent_loop_registry[AGENT_NAME]["_target_"] == "envserve.integrations.verl.EnvServeAgentLoop"
    rows = [{"seed": s} for s in range(4)] + [{"seed": s, "env_id": "sokoban"} for s in (1, 2)]
    outs = unpad(rollouts.run(rows))
    pool = rollouts.history()
    tok = rollouts.tokenizer
    rewards, finished = [], 0
    for out, row in zip(outs, rows):
        env_id = row.get("env_id", "frozenlake")
        results = check_episode(out, calls_for(out, pool), tok, grid_server.address, env_id, row["seed"],
                                {"max_turns": 50})   # the YAML's env_config
        assert all(r.action_valid for r in results)           # whole answers only: every move is valid
        assert 1 <= len(results) <= 6
        if results[-1].done:
            finished += 1
        else:
            # max_turns (the YAML's) ended it, or the next observation turn would not fit the budget.
            assert len(results) == 6 or len(out.response_ids) + next_turn_length(tok, results[-1]) >= RESPONSE_LENGTH
        assert out.extra_fields["env_success"] == float(results[-1].success)
        assert out.extra_fields["env_invalid_actions"] == 0
        rewards.append(out.reward_score)
    assert not pool                                            # every replica call belongs to a rollout
    assert finished >= 1 and len(set(rewards)) > 1
    # Every episode's session was closed on the server.
    for env_id in ("frozenlake", "sokoban"):
        assert not {o.extra_fields["envserve_session"] for o in outs} & live_session_ids(grid_server.address, env_id)


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


def test_garbled_answers_are_invalid_actions_with_the_envs_feedback(grid_server, model_dir, rollouts):
    """Text without an answer is an invalid action: the env's penalty is the reward, and its feedback
    opens the next observation turn (mask 0), which the model reads. A row's env_config reaches Open:
    the Sokoban session's own turn limit (3) truncates its episode."""
    rollouts = rollouts(grammar=garbled(model_dir))
    rows = [{"seed": 4}, {"seed": 5, "env_id": "sokoban", "env_config": {"max_turns": 3}}]
    outs = unpad(rollouts.run(rows))
    pool = rollouts.history()
    for out, row in zip(outs, rows):
        results = check_episode(out, calls_for(out, pool), rollouts.tokenizer, grid_server.address,
                                row.get("env_id", "frozenlake"), row["seed"], row.get("env_config", {"max_turns": 50}))
        assert results and not any(r.action_valid for r in results)
        if "env_config" in row:
            assert len(results) == 3 and results[-1].truncated
        assert all(r.feedback for r in results)
        assert out.reward_score < 0 and out.extra_fields["env_invalid_actions"] == len(results)
        tok = rollouts.tokenizer
        observed = tok.decode([t for t, m in zip(out.response_ids, out.response_mask) if m == 0])
        assert results[0].feedback in observed


def test_the_response_budget_bounds_each_generation(grid_server, model_dir, rollouts):
    """A model that never ends its turn is cut at the response budget (max_tokens = what is left):
    one turn, all tokens generated (mask 1), one step, its reward the score."""
    rollouts = rollouts(grammar=garbled(model_dir, None), response_length=48)
    out, = unpad(rollouts.run([{"seed": 0}]))
    call, = rollouts.history()
    assert call["max_tokens"] == 48 and len(call["token_ids"]) == 48
    assert out.response_ids == call["token_ids"] and out.response_mask == [1] * 48
    assert out.num_turns == 2 and len(out.extra_fields["turn_scores"]) == 1
    assert out.reward_score == pytest.approx(out.extra_fields["turn_scores"][0]) and out.reward_score < 0


def test_sessions_are_closed_when_a_rollout_fails(grid_server, model_dir, rollouts):
    """A replica that fails mid-episode, and an env that renders images for a text-only model, fail
    the batch loudly; their sessions are closed all the same."""
    before = live_session_ids(grid_server.address, "frozenlake")
    failing = rollouts(grammar=garbled(model_dir), fail_after=1)   # invalid answers: the episode goes on
    with pytest.raises(Exception, match="replica failed"):
        failing.run([{"seed": 0}])
    assert len(failing.history()) == 1
    with pytest.raises(ValueError, match="Multimodal inputs require"):
        rollouts(grammar=one_answer(model_dir)).run([{"seed": 0, "env_config": {"render_image": True}}])
    assert live_session_ids(grid_server.address, "frozenlake") == before


class DropsSessions:
    """verl's LLMServerClient, and after its first answer every live session of the env is closed on
    the server, as an expired lease or a lost worker would."""

    def __init__(self, inner, address: str, env_id: str):
        self.inner, self.address, self.env_id = inner, address, env_id

    async def generate(self, **kwargs):
        out = await self.inner.generate(**kwargs)
        with EnvClient(self.address) as c:
            c.close_sessions(sorted(live_session_ids(self.address, self.env_id)))
        return out


def test_a_lost_session_is_rebuilt_or_without_recovery_ends_its_rollout(grid_server, model_dir, rollouts):
    # Recovery (the default): the session closed under the rollout is rebuilt and the episode goes on.
    r = rollouts(grammar=one_answer(model_dir))
    r.worker.llm_client = DropsSessions(r.worker.llm_client, grid_server.address, "minesweeper")
    data = r.run([{"seed": 0, "env_id": "minesweeper"}])
    out, = unpad(data)
    assert "envserve_error" not in data.non_tensor_batch     # no rollout of the batch failed
    assert len(out.extra_fields["turn_scores"]) == 1          # the step after the drop was answered
    # recovery: false in the agent loop's entry: the rollout ends with the error, the batch goes on.
    r = rollouts(grammar=one_answer(model_dir), loop_options={"recovery": False})
    r.worker.llm_client = DropsSessions(r.worker.llm_client, grid_server.address, "minesweeper")
    data = r.run([{"seed": 0, "env_id": "minesweeper"}])
    out, = unpad(data)
    assert data.non_tensor_batch["envserve_error"][0].startswith("NOT_FOUND")
    assert out.num_turns == 2 and out.response_mask == [1] * len(out.response_ids)
    assert out.reward_score == 0.0 and out.extra_fields["turn_scores"] == []


# -- on a Ray cluster: verl's worker as a Ray actor, envserve as a fleet ----------------------------
def test_verls_worker_as_a_ray_actor_plays_on_a_fleet_found_with_no_address(model_dir, serving, tmp_path):
    """verl's AgentLoopWorker made a Ray actor as verl's trainer makes it, from agent-loop and tool
    entries with no address (and no ENVSERVE_ADDRESS): its episodes go through ray:// to an
    envserve.ray Fleet of two grid replicas started here, as a trainer's driver starts one after
    ray.init(). Each episode ran on a fleet replica and lines up with the model's calls and a replay
    on a replica; every session is closed there."""
    from envserve.directory import open_directory, replica_of
    from envserve.ray import Fleet, FleetConfig
    # Half a CPU per replica: the module's Ray has 2 CPUs, and the worker actor takes one.
    fleet = Fleet(FleetConfig(families=["grid"], replicas=2, replica_cpus=0.5,
                              serve_args=["--workers", "1", "--heartbeat-seconds", "0.5"]))
    try:
        replicas = {i["replica_id"]: i["address"] for i in fleet.start()}
        directory = open_directory("ray://")
        deadline = time.monotonic() + 60
        while sorted(r.replica_id for r in directory.replicas("frozenlake")) != sorted(replicas):
            assert time.monotonic() < deadline, "the fleet's replicas never listed in ray://"
            time.sleep(0.2)
        # The tool entry (loaded when the worker is made: GetSpec) has no address either.
        r = Rollouts(model_dir, None, tmp_path, serving, grammar=one_answer(model_dir), as_actor=True,
                     actor_env={"ENVSERVE_ADDRESS": ""})
        rows = [{"seed": s} for s in range(4)] + [{"seed": s, "env_id": "sokoban"} for s in (1, 2)]
        outs = unpad(r.run(rows))
        pool = r.history()
        sessions = {o.extra_fields["envserve_session"] for o in outs}
        assert len(sessions) == len(rows) and {replica_of(sid) for sid in sessions} <= set(replicas)
        replay_at = next(iter(replicas.values()))    # any replica: same seed, same episode
        finished = 0
        for out, row in zip(outs, rows):
            results = check_episode(out, calls_for(out, pool), r.tokenizer, replay_at, row.get("env_id", "frozenlake"),
                                    row["seed"], {"max_turns": 50})
            assert all(x.action_valid for x in results) and 1 <= len(results) <= 6
            finished += results[-1].done
        assert not pool and finished >= 1
        for address in replicas.values():
            for env_id in ("frozenlake", "sokoban"):
                assert not sessions & live_session_ids(address, env_id)
        ray.kill(r.worker)
    finally:
        fleet.shutdown()


# -- a vision-language model ---------------------------------------------------------------------
# FrozenLake rendering a 128 px picture of the lake into every observation. (Sessions have no switch
# that drops the text grid: observations carry both.)
IMAGE_CONFIG = {"render_image": True, "image_size": 128, "max_turns": 50}


def vl_processor(model_dir: str):
    from transformers import AutoProcessor
    return AutoProcessor.from_pretrained(model_dir)


def test_agent_loop_gives_a_qwen2_vl_model_each_turns_image(grid_server, vl_model_dir, vl_rollouts):
    """The tiny Qwen2-VL plays FrozenLake from pictures through verl's worker: verl's Qwen-VL token
    builder renders each observation's image with the checkpoint's processor (image pad tokens where
    the processor puts them), every generate call carries all the conversation's images, pixel for
    pixel the env's PNGs, the response mask is 1 exactly on the model's tokens and 0 on each
    observation turn (its image tokens included), and the episode's env rewards are its score."""
    r = vl_rollouts(grammar=one_answer(vl_model_dir))
    processor = vl_processor(vl_model_dir)
    tok = processor.tokenizer
    pad = processor.image_token_id
    rows = [{"seed": s, "env_config": IMAGE_CONFIG} for s in range(3)]
    data = r.run(rows)
    outs = unpad(data)
    pool = r.history()
    finished, turns = 0, []
    with EnvClient(grid_server.address) as c:
        for i, (out, row) in enumerate(zip(outs, rows)):
            calls = calls_for(out, pool)
            assert calls and len(out.response_ids) == len(out.response_mask) <= RESPONSE_LENGTH
            opened = c.open_sessions("frozenlake", 1, IMAGE_CONFIG, "no_think")
            sid = opened.session_ids[0]
            try:
                first = c.reset_one(sid, row["seed"])
                assert len(first.observation.images) == 1
                pngs = [first.observation.images[0].png]
                # The prompt: the processor's own rendering of (rules, first picture and text).
                image = Image.open(io.BytesIO(pngs[0]))
                text = processor.apply_chat_template(
                    [{"role": "system", "content": opened.system_prompt},
                     {"role": "user", "content": [{"type": "image", "image": image},
                                                  {"type": "text", "text": first.observation.text}]}],
                    add_generation_prompt=True, tokenize=False)
                expected = processor(text=[text], images=[image], return_tensors="pt")["input_ids"][0].tolist()
                assert out.prompt_ids == expected
                per_image = image_token_count(processor, image)
                assert per_image > 0 and out.prompt_ids.count(pad) == per_image
                runs = segments(out.response_mask)
                generated = [run for run in runs if run[0] == 1]
                assert [v for v, _, _ in runs] == [1, 0] * (len(runs) // 2) + [1] * (len(runs) % 2)
                assert len(generated) == len(calls)
                results = []
                for k, ((_, a, b), call) in enumerate(zip(generated, calls)):
                    # The model saw the conversation so far and every picture in it, as the env drew it.
                    assert call["prompt_ids"] == out.prompt_ids + out.response_ids[:a]
                    assert call["images"] == [pixels(png) for png in pngs]
                    assert call["prompt_ids"].count(pad) == per_image * len(pngs)
                    assert out.response_ids[a:b] == call["token_ids"]
                    results.append(c.step_one(sid, tok.decode(call["token_ids"], skip_special_tokens=True)))
                    if k + 1 < len(generated):
                        _, oa, ob = runs[2 * k + 1]
                        head = "\n" if call["token_ids"][-1] == tok.eos_token_id else ""
                        # The observation turn: the new picture's pad tokens, then the env's text; mask 0.
                        assert tok.decode(out.response_ids[oa:ob]) == (
                            f"{head}<|im_start|>user\n<|vision_start|>{'<|image_pad|>' * per_image}<|vision_end|>"
                            f"{observation_text(results[-1])}<|im_end|>\n<|im_start|>assistant\n")
                        pngs.append(results[-1].observation.images[0].png)
                # Every image token of the response is an observation's, under mask 0.
                image_positions = [j for j, t in enumerate(out.response_ids) if t == pad]
                assert len(image_positions) == per_image * (len(generated) - 1)
                assert all(out.response_mask[j] == 0 for j in image_positions)
                assert all(t != pad for t, m in zip(out.response_ids, out.response_mask) if m == 1)
            finally:
                c.close_sessions([sid])
            assert out.reward_score == pytest.approx(sum(x.reward for x in results), abs=1e-6)
            assert out.extra_fields["turn_scores"] == pytest.approx([x.reward for x in results])
            finished += bool(results[-1].done)
            turns.append(len(results))
            # The batch carries the images for the trainer: verl's processor features of this rollout's pictures.
            mm = data.non_tensor_batch["multi_modal_inputs"][i]
            assert mm["image_grid_thw"].shape[0] == len(pngs)
    assert not pool
    assert finished >= 1 and max(turns) >= 2   # an episode ended; pictures came with observation turns


def test_tool_pictures_reach_a_qwen2_vl_model_through_verls_tool_agent_loop(grid_server, vl_model_dir, vl_rollouts):
    """verl's stock ToolAgentLoop with EnvServeTool on picture-rendering sessions: each tool
    response's image becomes an image block of the tool turn, rendered by the processor into pad
    tokens under mask 0, and every later generate call carries the pictures so far, equal to the
    replayed episode's PNGs."""
    r = vl_rollouts(grammar=one_call(vl_model_dir), tool_options={"per_trajectory": True, "env_config": IMAGE_CONFIG},
                    overrides=("actor_rollout_ref.rollout.multi_turn.max_assistant_turns=4",))
    processor = vl_processor(vl_model_dir)
    tok, pad = processor.tokenizer, processor.image_token_id
    rows = [{"agent_name": "tool_agent", "seed": seed,
             "raw_prompt": [{"role": "user", "content": "Reach the goal. Each move shows the lake."}],
             "tools_kwargs": {"move": {"create_kwargs": {"seed": seed}}}} for seed in (0, 1)]
    outs = unpad(r.run(rows))
    pool = r.history()
    pictured = 0
    with EnvClient(grid_server.address) as c:
        for out, row in zip(outs, rows):
            calls = calls_for(out, pool)
            runs = segments(out.response_mask)
            generated = [(a, b) for v, a, b in runs if v == 1]
            assert len(calls) == len(generated) >= 2
            directions = [json.loads(tok.decode(out.response_ids[a:b], skip_special_tokens=True)
                                     .split("<tool_call>")[1].split("</tool_call>")[0])["arguments"]["direction"]
                          for a, b in generated]
            executed = len(out.extra_fields["tool_rewards"])
            sid = c.open(env_id="frozenlake", count=1, config=IMAGE_CONFIG, action_format="no_think")[0]
            c.reset_one(sid, row["seed"])
            replay = []
            for d in directions[:executed]:
                replay.append(c.step_one(sid, plain_answer("no_think", [d])))
                if replay[-1].done or replay[-1].truncated:
                    break
            c.close_sessions([sid])
            pngs = [x.observation.images[0].png for x in replay]
            per_image = image_token_count(processor, Image.open(io.BytesIO(pngs[0])))
            for k, ((a, b), call) in enumerate(zip(generated, calls)):
                assert call["prompt_ids"] == out.prompt_ids + out.response_ids[:a]
                assert out.response_ids[a:b] == call["token_ids"]
                assert call["images"] == [pixels(png) for png in pngs[:k]]
                assert call["prompt_ids"].count(pad) == per_image * min(k, len(pngs))
            image_positions = [j for j, t in enumerate(out.response_ids) if t == pad]
            shown = min(len(pngs), len(generated) - 1)
            assert len(image_positions) == per_image * shown
            assert all(out.response_mask[j] == 0 for j in image_positions)
            pictured += shown
            assert list(out.extra_fields["tool_rewards"]) == pytest.approx(
                [x.reward for x in replay] + [0.0] * (executed - len(replay)))
    assert not pool and pictured >= 2
    with EnvClient(grid_server.address) as c:   # the episodes that did not end
        c.close_sessions(sorted({o.extra_fields["envserve_session"] for o in outs}
                                & live_session_ids(grid_server.address, "frozenlake")))


# -- the tool --------------------------------------------------------------------------------------
def expert_plays(tool, instance_id: str, expert, client: EnvClient) -> list[tuple]:
    """The env's expert plays the tool's episode to its end: (response, reward, metrics) per call."""
    calls = []
    while not (calls and calls[-1][2].get("done")):
        truth = Truth.from_response(client.get_state(tool.session_id(instance_id), -1))
        action = expert.act(truth, 1).actions[0]
        calls.append(asyncio.run(tool.execute(instance_id, {"direction": action})))
        assert len(calls) < 50
    return calls


def test_tool_lifecycle_with_an_expert_playing_to_success(grid_server, model_dir, rollouts):
    """verl loads EnvServeTool from the tool YAML; create/execute/calc_reward/release over real
    sessions, the env's expert choosing each call's argument."""
    tool, = rollouts(grammar=one_answer(model_dir)).worker.tools    # loaded by verl from tools.yaml
    assert isinstance(tool, EnvServeTool) and tool.name == "move"
    schema = tool.tool_schema.model_dump(exclude_unset=True, exclude_none=True)
    assert schema["function"]["parameters"]["properties"]["direction"]["enum"] == DIRECTIONS
    address = grid_server.address
    with EnvClient(address) as c:
        for env_id, expert_cls, seed in (("frozenlake", FrozenLakeExpert, 3), ("sokoban", SokobanExpert, 2)):
            t = tool if env_id == "frozenlake" else EnvServeTool({"type": "native", "address": address, "env_id": env_id})
            iid, first = asyncio.run(t.create(create_kwargs={"seed": seed}))
            sid = t.session_id(iid)
            assert sid in live_session_ids(address, env_id)
            assert first.text.startswith(c.get_spec(env_id).system_prompt)
            assert first.text.endswith(c.get_state(sid, -1).observation_text)
            # A wrong argument is the env's invalid action, with its feedback and penalty.
            bad, penalty, metrics = asyncio.run(t.execute(iid, {"direction": "Sideways"}))
            assert metrics["action_valid"] is False and penalty < 0 and "Invalid" in bad.text
            calls = expert_plays(t, iid, expert_cls(session_settings(c.get_spec(env_id))), c)
            last = calls[-1][2]
            assert last["success"] is True and all(m["action_valid"] for _, _, m in calls)
            assert "success" in calls[-1][0].text
            total = penalty + sum(r for _, r, _ in calls)
            assert asyncio.run(t.calc_reward(iid)) == pytest.approx(total) == pytest.approx(last["episode_return"])
            assert total > 0
            over, reward, _ = asyncio.run(t.execute(iid, {"direction": "Up"}))
            assert "episode is over" in over.text and reward == 0.0
            asyncio.run(t.release(iid))
            assert sid not in live_session_ids(address, env_id)
        # The same seed gives the same start; other envs get their own tool: reveal(row, col).
        a, b = (asyncio.run(tool.create(create_kwargs={"seed": 7})) for _ in range(2))
        assert a[1].text == b[1].text and a[0] != b[0]
        for iid, _ in (a, b):
            asyncio.run(tool.release(iid))
        mines = EnvServeTool({"type": "native", "address": address, "env_id": "minesweeper"})
        assert mines.name == "reveal"
        iid, _ = asyncio.run(mines.create(seed=1))
        text, _, metrics = asyncio.run(mines.execute(iid, {"row": 2, "col": 3}))
        assert metrics["action_valid"] and "Revealed (2, 3)" in text.text
        asyncio.run(mines.release(iid))


def test_verls_tool_agent_loop_plays_one_episode_per_trajectory(grid_server, model_dir, rollouts):
    """verl's stock ToolAgentLoop (Hermes tool calls) with EnvServeTool, per_trajectory: each call's
    move continues the row's episode, as a replay of the calls in one fresh session shows; the
    calls' own sessions are closed, the episode's when it ends."""
    address = grid_server.address
    r = rollouts(grammar=one_call(model_dir), tool_options={"per_trajectory": True},
                 overrides=("actor_rollout_ref.rollout.multi_turn.max_assistant_turns=5",))
    tok = r.tokenizer
    before = live_session_ids(address, "frozenlake")
    rows = []
    with EnvClient(address) as c:
        for seed in (0, 1, 2):
            sid = c.open(env_id="frozenlake", count=1, action_format="no_think")[0]
            first = c.reset_one(sid, seed).observation.text
            c.close_sessions([sid])
            rows.append({"agent_name": "tool_agent", "seed": seed,
                         "raw_prompt": [{"role": "user", "content": f"Reach the goal.\n{first}"}],
                         "tools_kwargs": {"move": {"create_kwargs": {"seed": seed}}}})
    outs = unpad(r.run(rows))
    kept = set()
    with EnvClient(address) as c:
        for out, row in zip(outs, rows):
            runs = segments(out.response_mask)
            directions = [json.loads(tok.decode(out.response_ids[a:b], skip_special_tokens=True)
                                     .split("<tool_call>")[1].split("</tool_call>")[0])["arguments"]["direction"]
                          for v, a, b in runs if v == 1]
            # The last call is not run when it comes with the last turn ToolAgentLoop allows.
            executed = len(out.extra_fields["tool_rewards"])
            assert executed in (len(directions), len(directions) - 1)
            sid = c.open(env_id="frozenlake", count=1, action_format="no_think")[0]
            c.reset_one(sid, row["seed"])
            replay = []
            for d in directions[:executed]:
                replay.append(c.step_one(sid, plain_answer("no_think", [d])))
                if replay[-1].done or replay[-1].truncated:
                    break
            c.close_sessions([sid])
            # Every call stepped the same episode (rewards and observations match the replay's); calls
            # after its end are told so, for no reward.
            after = executed - len(replay)
            assert list(out.extra_fields["tool_rewards"]) == pytest.approx([x.reward for x in replay] + [0.0] * after)
            tool_turns = [tok.decode(out.response_ids[a:b]) for v, a, b in runs if v == 0]
            assert all(text.startswith("\n<|im_start|>tool\n") for text in tool_turns)
            for text, step in zip(tool_turns, replay):
                assert observation_text(step) in text
            assert all("The episode is over; no more actions" in text for text in tool_turns[len(replay):])
            assert out.extra_fields["envserve_session"]
            if not replay[-1].done:
                kept.add(out.extra_fields["envserve_session"])
            assert len(directions) >= 2 or replay[-1].done
    # Only the kept episodes that did not end are open (the server's lease would drop them).
    assert live_session_ids(address, "frozenlake") - before == kept
    with EnvClient(address) as c:
        c.close_sessions(sorted(kept))


def test_the_tool_spreads_its_sessions_over_several_addresses_and_steps_them(grid_server):
    from serverproc import ServerProcess
    with ServerProcess(["frozenlake"], workers=1, metrics=False) as other:
        addresses = [grid_server.address, other.address]
        tool = EnvServeTool({"type": "native", "address": ",".join(addresses), "env_id": "frozenlake"})
        before = {a: live_session_ids(a, "frozenlake") for a in addresses}

        async def main():
            ids = [(await tool.create(create_kwargs={"seed": i}))[0] for i in range(6)]
            calls = [await tool.execute(i, {"direction": "Left"}) for i in ids]
            return ids, calls
        ids, calls = asyncio.run(main())
        new = {a: live_session_ids(a, "frozenlake") - before[a] for a in addresses}
        assert sum(len(s) for s in new.values()) == 6 and all(len(s) >= 2 for s in new.values()), new
        assert all(m["action_valid"] for _, _, m in calls)
        for iid in ids:
            asyncio.run(tool.release(iid))
        assert all(not (live_session_ids(a, "frozenlake") - before[a]) for a in addresses)
