"""bench/learn_vlm.py's board reading: whether an answer names the cells around the player right, and
whether its move is the one the neighbour rule picks from the cells as named, checked against a real
FrozenLake replica."""
from __future__ import annotations

import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from envserve.client import EnvClient
from envserve.client.experts import FrozenLakeNeighbourExpert, neighbour_move, play_expert

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
import learn_vlm  # noqa: E402

CONFIG = {"size": 4}
SEEDS = range(12)


def test_neighbour_move_reads_only_the_cells_it_is_given():
    ice = {"Down": "ice", "Right": "ice", "Left": "the edge", "Up": "the edge"}
    assert neighbour_move(ice)[0] == "Down"
    assert neighbour_move({**ice, "Down": "a hole"})[0] == "Right"
    assert neighbour_move(ice, back="Down")[0] == "Right"            # never back while another is safe
    assert neighbour_move({"Up": "ice", "Down": "a hole"}, back="Up") == ("Up", "only going back is safe")
    assert neighbour_move({})[1] == "nothing around me is safe"        # a cell not named is not safe


@pytest.fixture(scope="module")
def server(grid_server):
    return grid_server


@pytest.fixture(scope="module")
def expert_answers(server):
    """(map seed, [(the expert's reasoning, its moves) per turn]) on maps where its first move is not
    Down: the expert names every cell right and moves by the rule."""
    with EnvClient(server.address) as client:
        episodes = play_expert(client, "frozenlake", SEEDS, config=CONFIG, expert=FrozenLakeNeighbourExpert)
    answers = [(ep.seed, [(t.move.reasoning, list(t.move.actions)) for t in ep.turns]) for ep in episodes]
    assert any(turns[0][1] != ["Down"] for _, turns in answers), "no map starts with a hole below"
    return answers


def _reading(server, answers):
    cfg = SimpleNamespace(env=SimpleNamespace(env_id="frozenlake", env_config=CONFIG, action_format="no_think"))
    return learn_vlm.board_reading(SimpleNamespace(env_address=server.address), cfg, answers)


def test_the_expert_reads_every_cell_right_and_follows_its_reading(server, expert_answers):
    reading = _reading(server, expert_answers)
    assert reading["reading_all_right"] == 1.0
    assert reading["move_follows_reading"] == 1.0


def test_a_move_that_ignores_the_reading_is_counted(server, expert_answers):
    """Right words, the same move every time: the policy the draws that fail SFT end as."""
    always_down = [(seed, [(reason, ["Down"]) for reason, _ in turns[:1]]) for seed, turns in expert_answers]
    reading = _reading(server, always_down)
    not_down = sum(turns[0][1] != ["Down"] for _, turns in expert_answers)
    assert reading["reading_all_right"] == 1.0
    assert reading["move_follows_reading"] == pytest.approx(1 - not_down / len(expert_answers))


def test_a_wrong_reading_followed_by_its_move_counts_as_followed(server, expert_answers):
    """The first answer calls the cell below a hole whatever it is, and moves as that reading says."""
    first = []
    for seed, turns in expert_answers:
        reason = turns[0][0]
        right = re.search(r"right of me is (ice|a hole|the goal|the edge)", reason).group(1)
        stated = {"Down": "a hole", "Right": right, "Left": "the edge", "Up": "the edge"}   # from the corner
        first.append((seed, [("Below me is a hole" + reason[reason.index(","):], [neighbour_move(stated)[0]])]))
    reading = _reading(server, first)
    holes_below = sum(turns[0][1] != ["Down"] for _, turns in expert_answers)
    assert 0 < holes_below < len(expert_answers)
    assert reading["reading_all_right"] == pytest.approx(holes_below / len(expert_answers))
    assert reading["move_follows_reading"] == 1.0


def test_score_evaluates_a_saved_policy_on_the_held_out_maps(tmp_path):
    """--score: a saved policy's figures, as a run's stages report them, one JSON line a policy."""
    import json
    import subprocess

    import yaml

    from envserve_trainer.config.loading import BUNDLED_CONFIGS
    from envserve_trainer.models.vision import build_vlm
    model, processor = build_vlm("qwen2_vl", seed=2)
    folder = tmp_path / "policy"
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    data = yaml.safe_load((BUNDLED_CONFIGS / "learn_vlm_frozenlake.yaml").read_text())
    data["env"].update(eval_tasks=2)
    data["env"]["env_config"]["image_size"] = 48
    data["rollout"].update(max_new_tokens=8, max_turns=2)
    data["model"] = {"random_init": "tiny", "vision": "qwen2_vl", "seed": 0}
    data["bench"]["samples"] = 1
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump(data))
    bench = Path(learn_vlm.__file__)
    out = subprocess.run([sys.executable, str(bench), "--config", str(config), "--score", str(folder)],
                         capture_output=True, text=True, timeout=600, cwd=bench.parents[1])
    assert out.returncode == 0, out.stderr[-2000:]
    line = json.loads(out.stdout.strip().splitlines()[-1])
    assert line["checkpoint"] == str(folder) and line["held_out"]["tasks"] == 2
    # Random weights write no answer in eight tokens: every greedy turn is invalid, nothing is read.
    assert line["greedy_success"] == 0.0 and line["invalid_rate"] == 1.0
    assert line["move_follows_reading"] is None and line["reading_all_right"] is None
