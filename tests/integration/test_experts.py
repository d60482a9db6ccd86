"""The experts of envserve.client.experts through real servers on loopback: each solves its env on
20 seeds (the success rate and the seconds go to the run's summary: `reported figures`), answers
parse in every action format with observations and predictions that a real JudgeService scores as
correct, and Minesweeper's expert decides from the visible board alone."""
from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
from importlib.util import find_spec

import pytest

from envserve.client import EnvClient, JudgeClient, JudgeTask
from envserve.client.experts import (EXPERTS, FORMATS, FrozenLakeNeighbourExpert, MinesweeperExpert, Truth,
                                     answer_text, deduce_minesweeper, mine_probabilities, play_expert,
                                     relation_text)
from serverproc import JudgeProcess, ServerProcess, sapien_vulkan_problem

pytestmark = pytest.mark.slow


SEEDS = range(20)


def summary(env_id: str, episodes, seconds: float, extra: str = "") -> str:
    won = sum(e.success for e in episodes)
    return f"expert success {env_id} {won}/{len(episodes)} ({seconds:.1f} s for {len(episodes)} episodes{extra})"


def play_timed(client, env_id, seeds, **kw):
    start = time.perf_counter()
    episodes = play_expert(client, env_id, seeds, **kw)
    return episodes, time.perf_counter() - start


# -- grid envs ---------------------------------------------------------------------------------------
# All of them solve: search on Sokoban and FrozenLake; Minesweeper's deduction wins about 98% of
# LaMer's boards (492 of 500 seeds measured), so 12 of 20 leaves room for bad luck, not for no logic.
GRID_MIN_WINS = {"sokoban": 20, "frozenlake": 20, "minesweeper": 12}


@pytest.mark.parametrize("env_id", sorted(GRID_MIN_WINS))
def test_grid_expert_solves_its_env_through_grpc(client, report, env_id):
    episodes, seconds = play_timed(client, env_id, SEEDS, action_format="free_think")
    extra = ""
    if env_id == "minesweeper":
        reveals = sum(len(e.turns) for e in episodes)
        guesses = sum(e.guesses for e in episodes)
        extra = (f"; {guesses} guesses in {reveals} reveals, "
                 f"{sum(1 for e in episodes if not e.guesses)} games without one")
    report(summary(env_id, episodes, seconds, extra))
    assert [e.seed for e in episodes] == list(SEEDS)
    assert sum(e.success for e in episodes) >= GRID_MIN_WINS[env_id]
    for e in episodes:
        assert all(t.result.action_valid for t in e.turns), (e.seed, [t.result.feedback for t in e.turns])
        # Every episode ends by the env (won, lost or truncated), never mid-way.
        assert e.turns[-1].result.done or e.turns[-1].result.truncated


def test_minesweeper_expert_reads_only_the_visible_board(client):
    episodes = play_expert(client, "minesweeper", range(8), "no_think")
    hidden_keys = ("mines", "board")
    for e in episodes:
        blind = MinesweeperExpert()
        for t in e.turns:
            assert all(k in t.truth.state for k in hidden_keys)
            seen = dataclasses.replace(t.truth, state={k: v for k, v in t.truth.state.items() if k not in hidden_keys})
            assert blind.act(seen, 1) == t.move


NEIGHBOUR_WORDS = {"O": "a hole", "G": "the goal", "_": "ice"}


def test_a_detour_starts_episodes_from_varied_states_the_same_for_a_seed(client):
    """detour: random moves before the expert takes over, drawn from the seed, never one that ends
    the episode; the episode is recorded from where they lead."""
    kw = dict(config={"max_actions_per_turn": 1}, expert=EXPERTS["frozenlake_neighbours"])

    def player(text: str) -> tuple[int, int]:
        rows = text.strip().splitlines()
        (r, c), = [(i, row.index("P")) for i, row in enumerate(rows) if "P" in row]
        return r, c

    plain = play_expert(client, "frozenlake", SEEDS, "free_think", **kw)
    wandered = play_expert(client, "frozenlake", SEEDS, "free_think", detour=5, detour_actions=["Down", "Right"], **kw)
    again = play_expert(client, "frozenlake", SEEDS, "free_think", detour=5, detour_actions=["Down", "Right"], **kw)
    assert {player(e.first.observation.text) for e in plain} == {(0, 0)} and not any(e.detour for e in plain)
    assert sum(bool(e.detour) for e in wandered) >= 8
    assert len({player(e.first.observation.text) for e in wandered}) >= 5
    for e in wandered:
        assert set(e.detour) <= {"Down", "Right"} and len(e.detour) <= 5
        # The first recorded observation is where the detour's moves lead from the start, alive.
        down = min(3, e.detour.count("Down"))
        assert player(e.first.observation.text) == (down, min(3, e.detour.count("Right"))), (e.seed, e.detour)
        assert not e.first.done and e.turns and e.turns[0].observation == e.first.observation.text
    assert [(e.detour, e.first.observation.text, [t.answer for t in e.turns]) for e in wandered] == \
        [(e.detour, e.first.observation.text, [t.answer for t in e.turns]) for e in again]
    assert sum(e.success for e in wandered) >= 15
    with pytest.raises(ValueError, match="a detour needs detour_actions"):
        play_expert(client, "frozenlake", SEEDS, "free_think", detour=3, **kw)


def test_frozenlake_neighbour_expert_moves_once_a_turn_from_the_cells_around_it(client):
    """Its facts are the four cells around the player on the text board, its move the first safe
    one of Down, Right, Left, Up that does not go back, and it never falls in a hole."""
    episodes = play_expert(client, "frozenlake", SEEDS, "free_think", config={"max_actions_per_turn": 1},
                           expert=EXPERTS["frozenlake_neighbours"])
    assert EXPERTS["frozenlake_neighbours"] is FrozenLakeNeighbourExpert
    # 0.96 of random 4x4 maps within the env's 10 turns (measured over 1,000 seeds); a looping or
    # blind rule solves far fewer (the search expert's most common path: 0.39).
    assert sum(e.success for e in episodes) >= 17
    steps = {"Down": (1, 0), "Right": (0, 1), "Left": (0, -1), "Up": (-1, 0)}
    for e in episodes:
        came_from = None
        assert not any(t.result.done and not t.result.success for t in e.turns), e.seed
        for t in e.turns:
            rows = t.observation.strip().splitlines()
            (r, c), = [(i, row.index("P")) for i, row in enumerate(rows) if "P" in row]

            def seen(move):
                rr, cc = r + steps[move][0], c + steps[move][1]
                inside = 0 <= rr < len(rows) and 0 <= cc < len(rows[0])
                return NEIGHBOUR_WORDS[rows[rr][cc]] if inside else "the edge"
            words = {"Down": "below me", "Right": "right of me", "Left": "left of me", "Up": "above me"}
            for move, where in words.items():
                assert f"{where} is {seen(move)}" in t.move.reasoning.lower(), (e.seed, t.turn, t.move.reasoning)
            safe = [m for m in ("Down", "Right", "Left", "Up") if seen(m) in ("ice", "the goal")]
            onward = [m for m in safe if (r + steps[m][0], c + steps[m][1]) != came_from]
            assert t.move.actions == [(onward or safe)[0]], (e.seed, t.turn, rows)
            assert t.move.reasoning.endswith(f"so I move {t.move.actions[0]}.")
            came_from = (r, c)


def test_minesweeper_deduction_rules_and_guess():
    # One number next to one hidden cell: a mine; with every mine found, the rest is safe.
    known = deduce_minesweeper(["1??"], num_mines=1)
    assert set(known.mines) == {(0, 1)} and set(known.safe) == {(0, 2)}
    # 1-2-1 under three hidden cells: no single number decides, the pairs do (subset reasoning).
    known = deduce_minesweeper(["???", "121"], num_mines=2)
    assert set(known.mines) == {(0, 0), (0, 2)} and set(known.safe) == {(0, 1)}
    assert "more mine(s) than" in known.mines[(0, 0)] + known.mines[(0, 2)]
    # A 1 amid eight hidden cells, one mine: nothing is certain, each cell is 1 in 8.
    board = ["???", "?1?", "???"]
    known = deduce_minesweeper(board, num_mines=1)
    assert not known.safe and not known.mines
    probs = mine_probabilities(board, 1, known)
    assert len(probs) == 8 and all(p == pytest.approx(1 / 8) for p in probs.values())
    # Two mines on a 4x4 board with a 1 in the corner: its 3 neighbours share one mine (1/3 each);
    # the other 12 hidden cells share the other (1/12 each), so the expert guesses among those.
    board = ["1???", "????", "????", "????"]
    probs = mine_probabilities(board, 2, deduce_minesweeper(board, 2))
    assert probs[(0, 1)] == pytest.approx(1 / 3) and probs[(3, 3)] == pytest.approx(1 / 12)
    truth = Truth({"visible": board, "num_mines": 2, "rows": 4, "cols": 4}, [], 3, "")
    move = MinesweeperExpert().act(truth, 1)
    assert move.guessed and move.kind == "explore" and move.actions[0] not in ("(0, 1)", "(1, 0)", "(1, 1)")


# -- action formats and the judge --------------------------------------------------------------------
@pytest.mark.parametrize("action_format", FORMATS)
def test_answers_parse_in_every_format(client, action_format):
    for env_id in ("sokoban", "frozenlake", "minesweeper"):
        episodes = play_expert(client, env_id, range(3), action_format)
        assert sum(e.success for e in episodes) >= (2 if env_id == "minesweeper" else 3)
        for e in episodes:
            for i, t in enumerate(e.turns):
                r = t.result
                assert r.action_valid and list(r.parsed_actions) == t.move.actions, (t.answer, r.feedback)
                fields = dict(r.reasoning)
                if action_format in ("grounding", "grounding_worldmodeling"):
                    assert fields["observation"] == EXPERTS[env_id]().describe(t.truth)
                if action_format in ("worldmodeling", "grounding_worldmodeling"):
                    # The fork's state after the actions is the state the session reached.
                    assert t.truth_next is not None and t.truth_next.anchor == r.anchor
                    assert fields["prediction"] == EXPERTS[env_id]().describe(t.truth_next)
                if action_format == "meta_reasoning":
                    assert fields["meta_tag"] == ("planning" if i == 0 else
                                                  {"continue": "monitor", "explore": "explore"}[t.move.kind])
                if action_format != "no_think":
                    assert t.move.reasoning.split(".")[0] in t.answer


def test_answer_text_refuses_what_it_cannot_write():
    truth = Truth({}, ["box is above the player"], 0, "")
    with pytest.raises(ValueError, match="unknown action format"):
        answer_text("telepathy", ["Up"])
    with pytest.raises(ValueError, match="truth_next"):
        answer_text("worldmodeling", ["Up"], truth)
    with pytest.raises(ValueError, match="at least one action"):
        answer_text("no_think", [])
    assert answer_text("grounding", ["Up", "Left"], truth, reasoning="x <b> y") == (
        "<think><observation>box is above the player.</observation><reasoning>x (b) y</reasoning></think>"
        "<answer>Up, Left</answer>")


@pytest.fixture(scope="module")
def judge(grid_server):
    with JudgeProcess(grid_server.address) as j:
        yield j


@pytest.mark.parametrize("env_id", ["sokoban", "frozenlake"])
def test_rule_judge_scores_expert_observations_and_predictions_as_correct(client, judge, env_id):
    judged = []
    with JudgeClient(judge.address) as jc:
        def on_episode(ep):
            # While the session still holds the episode (play_expert resets it to the next seed after).
            tasks = []
            for t in ep.turns:
                r = t.result
                for field, name in (("grounding", "observation"), ("world_modeling", "prediction")):
                    tasks.append(JudgeTask(f"{ep.seed}/{t.turn}/{field}", ep.session_id, t.turn, field,
                                           r.reasoning[name], episode=r.episode, trial=r.trial))
            judged.extend(jc.judge(tasks))
        episodes = play_expert(client, env_id, range(5), "grounding_worldmodeling", on_episode=on_episode)
    assert all(e.success for e in episodes)
    assert len(judged) == 2 * sum(len(e.turns) for e in episodes)
    for res in judged:
        assert res.status.code == 0, res.status.message
        assert res.judge == "rule" and res.verdict and res.score == pytest.approx(1.0), (res.key, res.reasoning)


def test_experts_need_only_the_client():
    """Any trainer can play them against a remote replica: no server, env or core module is imported."""
    probe = ("import sys, envserve.client.experts; print(sorted(m for m in sys.modules if m.startswith("
             "('envserve.core', 'envserve.envs', 'envserve.server', 'envserve.judge'))))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_relation_text_is_what_the_judge_joins():
    assert relation_text(["a is above b", "c is left of b."]) == "a is above b. c is left of b."
    assert relation_text([]) == ""


# -- text envs ---------------------------------------------------------------------------------------
def alfworld_seeds() -> list[int]:
    """ALFWorld games are generated on first use (1-30 s each, once per machine): 17 of these 20 are
    games the conformance suite (train 0-11, and 123456 = train game 2654) and test_alfworld.py
    (valid_seen 2, 4, 5, valid_unseen 0) generate anyway; train 12-14 are new."""
    from envserve.envs.alfworld.env import AlfWorldEnv
    seen, unseen = (AlfWorldEnv.spec.split(name).seed_offset for name in ("valid_seen", "valid_unseen"))
    return [*range(15), 123456, seen + 2, seen + 4, seen + 5, unseen]


def test_alfworld_expert_solves_generated_games_through_grpc(report):
    pytest.importorskip("alfworld")
    with ServerProcess(["alfworld"], workers=2, metrics=False) as server, EnvClient(server.address, timeout=600) as c:
        # Generated games are kept when the expert needs at most 50 steps (RLVMR plays 30 turns).
        episodes, seconds = play_timed(c, "alfworld", alfworld_seeds(), action_format="free_think",
                                       config={"max_turns": 50}, batch_size=4)
    report(summary("alfworld", episodes, seconds))
    assert sum(e.success for e in episodes) >= 19
    assert {e.turns[0].truth.state["task_type"] for e in episodes} == {
        "pick_and_place_simple", "look_at_obj_in_light", "pick_clean_then_place_in_recep",
        "pick_heat_then_place_in_recep", "pick_cool_then_place_in_recep", "pick_two_obj_and_place"}


# ScienceWorld: the first variation of 20 task types, 7 seen types in L0, 7 in L1, 6 held-out in L2
# (task lists in the package's order; every third type, so each split shows other ones).
# mendelian-genetics-known-plant (L1 index 19) is left to the full check: generating its gold path
# takes 10 s and following it 135 steps.
SCIENCEWORLD_TYPES = {"L0": (0, 3, 6, 9, 12, 15, 18), "L1": (1, 4, 7, 10, 13, 16, 17), "L2": (0, 1, 2, 3, 4, 5)}


def scienceworld_seeds() -> list[int]:
    from envserve.envs.scienceworld.env import ScienceWorldEnv, _tasks_by_split
    spec = ScienceWorldEnv.spec
    pairs = _tasks_by_split(frozenset(spec.config_defaults["heldout_tasks"].split(",")),
                            {"L0": "train", "L1": "test", "L2": "test"})
    seeds = []
    for split, picks in SCIENCEWORLD_TYPES.items():
        first: dict[str, int] = {}
        for k, (name, _) in enumerate(pairs[split]):
            first.setdefault(name, spec.split(split).seed_offset + k)
        names = list(first)
        seeds += [first[names[i]] for i in picks]
    return seeds


def test_scienceworld_gold_paths_score_100_in_each_split(report):
    pytest.importorskip("scienceworld")
    seeds = scienceworld_seeds()
    with ServerProcess(["scienceworld"], workers=2, metrics=False) as server, EnvClient(server.address) as c:
        # Gold paths are longer than RLVMR's 30 turns (up to 95 steps here).
        episodes, seconds = play_timed(c, "scienceworld", seeds, action_format="free_think",
                                       config={"max_turns": 200}, batch_size=4)
    report(summary("scienceworld", episodes, seconds))
    tasks = {e.turns[0].truth.state["task"] for e in episodes}
    assert len(tasks) == len(seeds) == 20
    for e in episodes:
        assert e.success and not e.turn_limited
        # Every step valid: the numbers in grow-fruit's path answer its ambiguous actions, not act.
        assert e.invalid_turns == 0, [t.answer for t in e.turns if not t.result.action_valid]
        assert int(e.turns[-1].result.info["score"]) == 100, e.seed
    # Every split's tasks were followed to the end.
    assert {e.seed // 1_000_000 for e in episodes} == {0, 1, 2}


# -- embodied envs -----------------------------------------------------------------------------------
def test_navigation_expert_reaches_targets(report):
    if find_spec("miniworld") is None:
        pytest.skip("needs the miniworld package")
    with ServerProcess(["navigation"], workers=2, metrics=False,
                       env_vars={"AI2THOR_LOCAL_EXECUTABLE_PATH": ""}) as server, EnvClient(server.address) as c:
        episodes, seconds = play_timed(c, "navigation", SEEDS, action_format="no_think",
                                       config={"render_image": False})
    report(summary("navigation", episodes, seconds))
    # The scripted walk (turn to the target, walk at it, sidestep when blocked) knows no obstacle map:
    # 14 of these 20 rooms measured; test_navigation.py's seeds 1, 2, 6, 9 always.
    assert sum(e.success for e in episodes) >= 12
    assert all(e.success for e in episodes if e.seed in (1, 2, 6, 9))


def test_primitive_skill_expert_completes_every_task(report):
    pytest.importorskip("mani_skill")
    problem = sapien_vulkan_problem()
    if problem:
        pytest.skip(f"SAPIEN cannot create a Vulkan render device (set VK_ICD_FILENAMES): {problem}")
    episodes, start = [], time.perf_counter()
    with ServerProcess(["primitive_skill"], workers=2, metrics=False) as server, EnvClient(server.address) as c:
        for task in ("place", "stack", "align", "drawer"):
            episodes += play_expert(c, "primitive_skill", range(5), "no_think",
                                    config={"task": task, "render_image": False})
    report(summary("primitive_skill", episodes, time.perf_counter() - start))
    failed = [(e.turns[0].truth.state["task"], e.seed) for e in episodes if not e.success]
    assert not failed
