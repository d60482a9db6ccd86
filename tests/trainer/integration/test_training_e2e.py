"""The trainer against a real envserve server on loopback: GRPO iterations with the small model,
checkpoints that reload and resume, every estimator for one iteration, and the CLI."""
from __future__ import annotations

import asyncio
import json
import time
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from serverproc import ServerProcess

from envserve_trainer.config.train_config import TrainConfig
from envserve_trainer.update.learner import checkpoints, latest_checkpoint
from envserve_trainer.models.small import weights_digest
from envserve_trainer.models.pretrained import load_pretrained
from envserve_trainer.train import Connection, Trainer

pytestmark = pytest.mark.slow


ROOT = Path(__file__).resolve().parents[3]

FROZENLAKE_GRPO = {
    "env": {"env_id": "frozenlake", "env_config": {"size": 4}, "num_tasks": 2},
    "rollout": {"group_size": 4, "tasks_per_iteration": 2, "history_turns": 0, "max_new_tokens": 1,
                "response_prefix": "<answer>", "response_suffix": "</answer>",
                "allowed_words": ["Left", "Down", "Right", "Up"]},
    "algo": {"estimator": "grpo"},
    "update": {"lr": 1e-3, "micro_batch_size": 16},
    "model": {"random_init": "tiny"},
    "run": {"iterations": 2, "checkpoint_every": 1, "keep_checkpoints": 2, "progress": False},
}


@pytest.fixture(scope="module")
def server():
    with ServerProcess(["frozenlake"], workers=1, metrics=False) as s:
        yield s


def _cfg(**sections) -> TrainConfig:
    data = json.loads(json.dumps(FROZENLAKE_GRPO))
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return TrainConfig.from_mapping(data)


def run_training(cfg: TrainConfig, address: str, out_dir) -> tuple[Trainer, str, list[dict]]:
    """One Trainer.run() against the replica at address: (the closed trainer, the digest of its
    weights before, the iteration records)."""
    trainer = Trainer(cfg, out_dir, Connection(env_address=address))
    start = weights_digest(trainer.learner.model)
    try:
        records = asyncio.run(trainer.run())
    finally:
        trainer.close()
    return trainer, start, records


def test_two_grpo_iterations_learn_save_reload_and_resume(server, tmp_path):
    cfg = _cfg()
    trainer, start, records = run_training(cfg, server.address, tmp_path)
    assert [r["iteration"] for r in records] == [1, 2]
    for r in records:
        assert r["update"]["samples"] > 0
        assert all(torch.isfinite(torch.tensor(v)) for v in r["update"].values())
        # 2 tasks x 4 samples, each an episode of FrozenLake that ended (hole, goal or the env's 10 turns).
        assert r["train"]["trials"] == 8 and r["dropped_trials"] == 0
        assert 1 <= r["train"]["mean_turns"] <= 10
    trained = weights_digest(trainer.learner.model)
    assert trained != start, "the update did not change the weights"

    # The newest checkpoint holds exactly the trained weights; the reference is the starting model.
    ckpt = latest_checkpoint(tmp_path)
    assert ckpt.name == "checkpoint-2" and [p.name for p in checkpoints(tmp_path)] == ["checkpoint-1", "checkpoint-2"]
    model, _ = load_pretrained(str(ckpt / "policy"))
    assert weights_digest(model) == trained
    reference, _ = load_pretrained(str(tmp_path / "reference"))
    assert weights_digest(reference) == start
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # Resume: starts at iteration 2 with the saved weights and optimizer state, runs the third.
    resumed = Trainer(_cfg(run={"iterations": 3, "checkpoint_every": 1, "keep_checkpoints": 2, "progress": False}),
                      tmp_path, Connection(env_address=server.address), resume=True)
    try:
        assert resumed.start_iteration == 2
        assert weights_digest(resumed.learner.model) == trained
        steps = {int(s["step"]) for s in resumed.learner.optimizer.state_dict()["state"].values()}
        assert steps == {2}, "the optimizer state (Adam's step count) was not restored"
        more = asyncio.run(resumed.run())
    finally:
        resumed.close()
    assert [r["iteration"] for r in more] == [3]
    assert weights_digest(resumed.learner.model) != trained
    logged = [json.loads(line)["iteration"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert logged == [1, 2, 3]
    # keep_checkpoints 2: the oldest was removed.
    assert [p.name for p in checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-3"]


def test_the_learnability_sampler_draws_training_tasks_whose_episodes_the_replica_counts(server, tmp_path):
    from envserve.client import EnvClient
    cfg = _cfg(env={"num_tasks": 6, "seed_start": 40}, rollout={"task_sampler": "learnability", "sampler_floor": 0.1, "max_turns": 2,
                                                           "sampler_cost": "tokens", "sampler_cost_power": 1.0},
               run={"iterations": 3, "checkpoint_every": 0, "eval_every": 0, "progress": False})
    trainer, _, records = run_training(cfg, server.address, tmp_path)
    scope = trainer.stats_scope
    assert scope and all(r["train"]["signal_free_groups"] is not None for r in records)
    played = 3 * cfg.rollout.tasks_per_iteration * cfg.rollout.group_size
    with EnvClient(server.address) as c:
        deadline = time.monotonic() + 60
        while True:
            stats = c.task_stats("frozenlake", scope)
            if sum(t.episodes for t in stats) >= played:
                break
            assert time.monotonic() < deadline, f"{sum(t.episodes for t in stats)} of {played} episodes counted"
            time.sleep(0.25)
    assert sum(t.episodes for t in stats) == played
    assert {int(t.task_id) for t in stats} <= set(range(40, 46))
    assert all(t.episodes % cfg.rollout.group_size == 0 for t in stats)   # whole groups per task
    # Every episode was counted, those the trainer's own turn limit (2) cut as well: that limit
    # became the sessions' own.
    assert all(t.turns_sum <= 2 * t.episodes for t in stats)
    # Each answer's tokens came with its step: the scope counts every token the rollouts generated.
    assert sum(t.tokens_sum for t in stats) == sum(r["train"]["generated_tokens"] for r in records) > 0


FREE_TEXT = {"max_new_tokens": 12, "allowed_words": [], "response_prefix": "", "response_suffix": "",
             "history_turns": 1, "max_turns": 3}


@pytest.mark.parametrize("estimator,extra_rollout,env", [
    ("gigpo", {}, {}),
    ("grpo_mr", {"template": "rlvmr"}, {"action_format": "meta_reasoning"}),
    ("lamer", {"episodes_per_trial": 2, "memory": "both", "stop_on_success": False,
               "reflection_max_new_tokens": 8}, {}),
    ("gae", {}, {}),
    ("bilevel_gae", {"template": "vagen"}, {"action_format": "grounding_worldmodeling"}),
])
def test_each_estimator_runs_an_iteration_against_the_server(server, tmp_path, estimator, extra_rollout, env):
    cfg = _cfg(algo={"estimator": estimator}, rollout={**FREE_TEXT, **extra_rollout, "group_size": 2},
               env=env, run={"iterations": 1, "checkpoint_every": 0, "progress": False})
    trainer = Trainer(cfg, tmp_path, Connection(env_address=server.address))
    before = weights_digest(trainer.learner.model)
    try:
        [record] = asyncio.run(trainer.run())
    finally:
        trainer.close()
    u = record["update"]
    assert u["samples"] > 0 and all(torch.isfinite(torch.tensor(v)) for v in u.values())
    if estimator == "grpo_mr" and record["train"]["invalid_action_rate"] == 1.0:
        # A random model never writes a parsable meta-reasoning answer: every trajectory has the same
        # outcome return and no tagged step, so every advantage is 0 and so is the gradient.
        assert u["grad_norm"] == 0.0 and weights_digest(trainer.learner.model) == before
    else:
        assert weights_digest(trainer.learner.model) != before
    assert record["train"]["mean_turns"] <= 3            # the trainer's turn limit
    if estimator in ("gae", "bilevel_gae"):
        assert u["value_loss"] >= 0 and trainer.learner.critic is not None
    if estimator == "lamer":
        assert record["train"]["episodes"] == 2 * record["train"]["trials"]


def test_cli_trains_then_evaluates_a_checkpoint(server, tmp_path):
    cfg_path = tmp_path / "cfg.json"
    cfg_path.write_text(json.dumps(FROZENLAKE_GRPO))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "services"), str(ROOT / "trainer")])}
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "envserve_trainer", "train", "--config", str(cfg_path),
                        "--env-address", server.address, "--output-dir", str(out), "--iterations", "1"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    last = json.loads(r.stdout.strip().splitlines()[-1])
    assert last["iteration"] == 1 and last["train"]["trials"] == 8
    r = subprocess.run([sys.executable, "-m", "envserve_trainer", "eval", "--config", str(cfg_path),
                        "--env-address", server.address, "--checkpoint", str(out / "checkpoint-1"),
                        "--json", str(tmp_path / "eval.json")], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads((tmp_path / "eval.json").read_text())
    assert summary["train_tasks"]["overall"]["trials"] == 2       # one greedy trial per training map
    # Refusals are clear and exit non-zero.
    r = subprocess.run([sys.executable, "-m", "envserve_trainer", "train", "--config", str(cfg_path)],
                       capture_output=True, text=True, env={**env, "ENVSERVE_ADDRESS": "", "ENVSERVE_DIRECTORY": ""},
                       timeout=120)
    assert r.returncode != 0 and "--env-address" in r.stderr
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rollout": {"group_sise": 4}}))
    r = subprocess.run([sys.executable, "-m", "envserve_trainer", "train", "--config", str(bad),
                        "--env-address", server.address], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode != 0 and "group_sise" in r.stderr


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_torchrun_two_cpu_processes_train_and_resume(server, tmp_path, strategy):
    """torchrun with the gloo backend: each rank takes half the task groups; rank 0 logs the
    summary of both ranks' trials and writes the checkpoint, which a second run resumes."""
    cfg = json.loads(json.dumps(FROZENLAKE_GRPO))
    cfg["env"]["num_tasks"] = 4
    cfg["rollout"].update(group_size=2, tasks_per_iteration=4)
    cfg["update"]["strategy"] = strategy
    cfg["run"].update(iterations=1, checkpoint_every=1)
    cfg_path = tmp_path / "cfg.json"
    cfg_path.write_text(json.dumps(cfg))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "services"), str(ROOT / "trainer")]),
           "OMP_NUM_THREADS": "1"}
    out = tmp_path / "run"
    with socket.socket() as sock:     # a free port for the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    base = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
            "--master-port", str(port),
            "-m", "envserve_trainer", "train", "--config", str(cfg_path), "--env-address", server.address,
            "--output-dir", str(out)]
    r = subprocess.run(base, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    [record] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert record["train"]["trials"] == 8 and record["train"]["groups"] == 4   # both ranks' halves
    first = weights_digest(load_pretrained(str(out / "checkpoint-1" / "policy"))[0])
    r = subprocess.run(base + ["--resume", "--iterations", "2"], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stderr and (out / "checkpoint-2").exists()
    assert weights_digest(load_pretrained(str(out / "checkpoint-2" / "policy"))[0]) != first
