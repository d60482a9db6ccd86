"""examples/trl_grpo_sokoban.py as a user runs it: against a real `envserve serve sokoban`, with the tiny
model the framework tests use (its chat template renders no tool calls, so the example must swap in
one TRL parses), SFT on the expert's games, then 2 GRPO steps on tasks `envserve tasks export` wrote."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

pytest.importorskip("trl")

from exampleproc import live_session_ids, run_example  # noqa: E402
from serverproc import ServerProcess  # noqa: E402


@pytest.mark.cpu_bound
def test_sft_then_grpo_on_sokoban_from_an_exported_split(tiny_model_dir, tmp_path):
    tasks = tmp_path / "test-tasks.jsonl"
    with ServerProcess(["sokoban"], workers=1, metrics=False) as server:
        exported = subprocess.run([sys.executable, "-m", "envserve.cli", "tasks", "export", "sokoban", "--split", "test",
                                   "--limit", "4", "--format", "trl", "--out", str(tasks), "--address", server.address],
                                  capture_output=True, text=True, timeout=120)
        assert exported.returncode == 0, exported.stderr
        out = run_example(["trl_grpo_sokoban.py", "--address", server.address, "--model", tiny_model_dir,
                           "--tasks", str(tasks),
                           "--steps", "2", "--sft-steps", "8", "--sft-levels", "4", "--sft-learning-rate", "5e-3",
                           "--max-completion-length", "48", "--max-tool-calls", "4",
                           "--output-dir", str(tmp_path / "run"), "--cpu"], timeout=600).stdout
        left = live_session_ids(server.address, "sokoban")
    assert "dataset: 4 tasks of split test" in out        # GRPO played the exported tasks
    assert "using Qwen2.5's" in out                       # the template was swapped
    games = re.search(r"sft data: (\d+) expert games, mean return (-?[\d.]+)", out)
    assert games and int(games[1]) == 4 and float(games[2]) > 0   # the expert solved every level
    sft = re.search(r"sft: 8 steps, loss ([\d.]+) -> ([\d.]+)", out)
    assert sft and float(sft[2]) < float(sft[1])
    steps = re.findall(r"step (\d+): reward (-?[\d.]+), tool calls per rollout ([\d.]+)", out)
    assert [int(s) for s, _, _ in steps] == [1, 2]
    # After SFT the tiny model makes tool calls, and envserve's rewards (the step penalty at least)
    # reach TRL's reward column.
    assert any(float(calls) > 0 for _, _, calls in steps)
    assert any(float(reward) != 0 for _, reward, _ in steps)
    assert (tmp_path / "run" / "final" / "config.json").exists()
    assert not left                                        # the pool's sessions were all closed
