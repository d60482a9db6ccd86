"""A real OpenAI-compatible model server on loopback for the LLM judge's integration tests.

The model is built here, offline: a word-level tokenizer trained with `tokenizers` on generated
judge-like text, wrapped in PreTrainedTokenizerFast with a chat template, and a tiny Llama with
random weights from a fixed seed (about 0.35 M parameters), saved with save_pretrained. It is served
by `transformers serve` in a subprocess, with the hub switched offline and the proxies pointed at a
closed port, so nothing can be fetched from the network.

The vocabulary holds the answer tags and YES/NO (a random model can happen to answer) but no
brackets or braces, so its replies can never be JSON: a structured reading from it is malformed.
"""
from __future__ import annotations

import os
import random
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from importlib.util import find_spec
from pathlib import Path

import pytest

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
SPECIAL = ["<unk>", "<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]


def judge_corpus(n: int = 400, seed: int = 0) -> list[str]:
    """Judge-like sentences: relations of grid, navigation and robot objects, verdicts."""
    rng = random.Random(seed)
    objects = ["box", "target", "player", "goal", "hole", "ball", "chair", "medkit", "cube", "gripper"]
    relations = ["above", "below", "left of", "right of", "in the same row as", "in the same column as",
                 "ahead of", "behind", "at"]
    lines = []
    for _ in range(n):
        a, b = rng.sample(objects, 2)
        claim = f"the {a} is {rng.choice(relations)} the {b}"
        verdict = rng.choice(["YES", "NO"])
        lines.append(f"{claim} , which is {'correct' if verdict == 'YES' else 'wrong'} . <answer> {verdict} </answer>")
    # the words of the judge's own instructions, so its prompts are mostly known tokens
    from envserve.judge import JudgeConfig
    from envserve.judge.prompts import PROMPT_FAMILIES, conventions, yesno_prompt
    lines += [conventions(f, f, JudgeConfig()) for f in PROMPT_FAMILIES]
    lines += [m["content"] for m in yesno_prompt("sokoban", "grounding", "x", {"player": [0, 0]}).messages]
    return [re.sub(r"[\[\]{}]", " ", line) for line in lines]


def build_tiny_model(path: Path, seed: int = 0) -> int:
    """Writes tokenizer and model to `path`; returns the parameter count."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    corpus = judge_corpus(seed=seed)
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")   # joins words with spaces
    tok.train_from_iterator(corpus, trainers.WordLevelTrainer(special_tokens=SPECIAL))
    tok.add_tokens(["<answer>", "</answer>"])       # whole, so a reply can hold a readable tag
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", additional_special_tokens=SPECIAL[4:])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(fast), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
                         pad_token_id=fast.pad_token_id, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    # Greedy decoding of random weights tends to pick a special token, which the server drops from
    # the reply; silencing them (all but </s>) keeps the random reply visible as words.
    with torch.no_grad():
        silent = [i for t, i in zip(fast.all_special_tokens, fast.all_special_ids) if t != fast.eos_token]
        model.lm_head.weight[silent] = 0.0
    model.generation_config.do_sample = False
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_REQUEST_LINE = re.compile(r'"POST /v1/chat/completions HTTP/1\.1" 200')


class ModelServer:
    """`transformers serve MODEL` on a loopback port, its output collected for request counts."""

    def __init__(self, model_dir: Path, work: Path, timeout: float = 120.0):
        self.model = str(model_dir)
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.command = [sys.executable, "-m", "transformers.cli.transformers", "serve", self.model,
                        "--host", "127.0.0.1", "--port", str(self.port), "--device", "cpu", "--log-level", "info"]
        (work / "hub").mkdir(parents=True, exist_ok=True)
        closed = f"http://127.0.0.1:{free_port()}"   # any attempt to go online fails here
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1",
                   HF_HOME=str(work), HF_HUB_CACHE=str(work / "hub"), HTTP_PROXY=closed, HTTPS_PROXY=closed,
                   http_proxy=closed, https_proxy=closed, NO_PROXY="127.0.0.1,localhost",
                   no_proxy="127.0.0.1,localhost", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=env)
        self.output: list[str] = []
        self._changed = threading.Condition()
        threading.Thread(target=self._drain, daemon=True).start()
        self._wait_ready(timeout)

    def _drain(self) -> None:
        for line in self.proc.stdout:
            with self._changed:
                self.output.append(line)
                self._changed.notify_all()

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError("transformers serve did not start:\n" + "".join(self.output[-40:]))

    def completions_served(self) -> int:
        with self._changed:
            return sum(1 for line in self.output if _REQUEST_LINE.search(line))

    def settled_completions(self, quiet_s: float = 1.0, timeout: float = 30.0) -> int:
        """The completions served once the log has been quiet for quiet_s: the server logs a request
        after its response, so a count read right after an earlier test's calls can still grow."""
        deadline = time.time() + timeout
        with self._changed:
            while time.time() < deadline:
                seen = len(self.output)
                self._changed.wait(quiet_s)
                if len(self.output) == seen:
                    break
        return self.completions_served()

    def wait_completions(self, n: int, timeout: float = 30.0) -> int:
        """Waits until the server has logged `n` completions (its log line follows the response)."""
        deadline = time.time() + timeout
        with self._changed:
            while sum(1 for line in self.output if _REQUEST_LINE.search(line)) < n and time.time() < deadline:
                self._changed.wait(0.2)
        return self.completions_served()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="session")
def tiny_judge_model(tmp_path_factory):
    """(model dir, tokenizer) of the random-weight judge model, built once a session."""
    missing = [m for m in ("torch", "transformers", "tokenizers", "fastapi", "uvicorn") if find_spec(m) is None]
    if missing:
        pytest.skip(f"the LLM judge integration tests need transformers[serving] and torch; missing {missing}")
    from transformers import AutoTokenizer
    path = tmp_path_factory.mktemp("tiny-judge-model")
    build_tiny_model(path)
    return path, AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="session")
def judge_model_server(tiny_judge_model, tmp_path_factory):
    """`transformers serve` running the tiny model on loopback, shared by the session."""
    server = ModelServer(tiny_judge_model[0], tmp_path_factory.mktemp("hf-home"))
    yield server
    server.stop()


def sokoban_push_right() -> tuple[dict, dict]:
    """Real GetState records of turns 0 and 1 of Sokoban seed 7: the player at (2,2) pushes the box
    right (player (2,3), box (2,4))."""
    from envserve.core.session import Session
    s = Session("sokoban", {}, "grounding_worldmodeling")
    try:
        s.reset(seed=7)
        before = s.get_state(-1)
        s.step("<think><observation>x</observation><reasoning>y</reasoning>"
               "<prediction>The box will be right of me.</prediction></think><answer>Right</answer>")
        return before, s.get_state(-1)
    finally:
        s.close()
