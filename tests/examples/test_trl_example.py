"""examples/trl_grpo_sokoban.py as a user runs it: against a real `envserve serve sokoban`, with the tiny
model the framework tests use (its chat template renders no tool calls, so the example must swap in
one TRL parses), SFT on the expert's games, then 2 GRPO steps."""
from __future__ import annotations

import re

import pytest

pytest.importorskip("trl")

from exampleproc import live_session_ids, run_example  # noqa: E402
from serverproc import ServerProcess  # noqa: E402


@pytest.mark.cpu_bound
def test_sft_then_grpo_on_sokoban(tiny_model_dir, tmp_path):
    with ServerProcess(["sokoban"], workers=1, metrics=False) as server:
        out = run_example(["trl_grpo_sokoban.py", "--address", server.address, "--model", tiny_model_dir,
                           "--steps", "2", "--sft-steps", "8", "--sft-levels", "4", "--sft-learning-rate", "5e-3",
                           "--max-completion-length", "48", "--max-tool-calls", "4",
                           "--output-dir", str(tmp_path / "run"), "--cpu"], timeout=600).stdout
        left = live_session_ids(server.address, "sokoban")
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
