"""The LLM judge's prompts, reply parsing, structured readings and cache keys, on REAL ground truth:
the same env sessions (fixed seeds, asserted layouts) as test_rule_judge.py.

No model is asked here: a prompt is checked for what the judge model must see (conventions,
tolerances, the true state, the agent's text), a reply for what the judge makes of it, and a
structured reading for the precision, recall and F1 it scores (worked out by hand below).
"""
from __future__ import annotations

import json
from fractions import Fraction

import pytest

from envserve.core.session import Session
from envserve.judge import GROUNDING, WORLD_MODELING, JudgeConfig, RuleJudge, build_lexicon
from envserve.judge.base import JudgeInput
from envserve.judge.llm_judge import LLMJudgeConfig, cache_key, extract_atoms, parse_answer, truth_id
from envserve.judge.prompts import (FROZENLAKE_LEGEND, GENERIC, MAX_STATE_CHARS, SOKOBAN_LEGEND, claims_from_atoms,
                                    prompt_family, resolve_name, structured_prompt, yesno_prompt)
# The real sessions and the layouts they assert (module-scoped: this module gets its own sessions).
from llm_fixtures import sokoban_push_right
from test_rule_judge import check, frozen, nav, skill, soko1, soko2  # noqa: F401

RULE = RuleJudge()
SOKO_TRUTH_TEXT = ("The box is at the same row and to the right of the player. "
                   "The target is below and on the right side of the player.")


def user(prompt) -> str:
    assert [m["role"] for m in prompt.messages] == ["system", "user"]
    return prompt.messages[1]["content"]


def agent_block(content: str) -> str:
    return content.split("<<<\n", 1)[1].split("\n>>>", 1)[0]


def score_atoms(env_id: str, atoms, truth, field=GROUNDING):
    return RULE.score_claims(env_id, lambda lex: claims_from_atoms(atoms, lex), truth, field)


# -- families ----------------------------------------------------------------------------------------------
def test_prompt_family_by_env_id_and_state(soko1, frozen):
    assert prompt_family("sokoban", soko1[1]["state"]) == "sokoban"
    assert prompt_family("sokoban-lamer", soko1[1]["state"]) == "sokoban"
    assert prompt_family("frozenlake", frozen[1]["state"]) == "frozenlake"
    # an unknown id with a grid state is a grid env; with no known keys it is generic
    assert prompt_family("mygrid", {"player": [0, 0]}) == "grid"
    assert prompt_family("navigation", {}) == "navigation"
    assert prompt_family("primitive_skill", {}) == "primitive_skill"
    for env_id in ("alfworld", "scienceworld", "svg", "minesweeper"):
        assert prompt_family(env_id, {"rows": 6}) == GENERIC


def test_grid_legends_match_the_env_symbols():
    from envserve.envs.frozenlake import env as fl
    from envserve.envs.sokoban import env as sk
    assert SOKOBAN_LEGEND == {sk.WALL: "wall", sk.FLOOR: "floor", sk.TARGET: "target", sk.BOX: "box",
                              sk.BOX_ON_TARGET: "box on a target", sk.PLAYER: "player",
                              sk.PLAYER_ON_TARGET: "player on a target"}
    assert FROZENLAKE_LEGEND == {fl.FROZEN: "frozen ice", fl.HOLE: "hole", fl.GOAL: "goal", fl.PLAYER: "player",
                                 fl.PLAYER_IN_HOLE: "player in a hole", fl.PLAYER_ON_GOAL: "player on the goal"}


# -- yes/no prompts ------------------------------------------------------------------------------------------
def test_sokoban_grounding_prompt(soko1):
    _, t = soko1
    p = yesno_prompt("sokoban", GROUNDING, "The box is right of me.", t)
    assert p.family == "sokoban" and p.kind == "yesno"
    system, content = p.messages[0]["content"], user(p)
    assert "<answer>YES</answer>" in system and "<answer>NO</answer>" in system and "last <answer>" in system
    assert "row 0 is the top row" in content and "relative to the player" in content
    # the map, row by row, then the positions from the state map, then the env's relation sentences
    grid_at = content.index("  " + "\n  ".join(t["state"]["grid"]))
    pos_at = content.index("Positions (row, column): player (2, 2); box (2, 3); target (3, 4)")
    rel_at = [content.index(f"- {r}") for r in t["relations"]]
    assert grid_at < pos_at < min(rel_at) and len(rel_at) == 2
    assert "X box" in content and "O target" in content   # the legend for this env's symbols
    assert agent_block(content) == "The box is right of me."
    assert "State before" not in content and "observes now" in content
    assert content.rstrip().endswith("<answer>YES</answer> or <answer>NO</answer>.")


def test_sokoban_world_modeling_prompt_shows_before_and_after():
    before, after = sokoban_push_right()
    assert after["state"]["player"] == [2, 3] and after["state"]["boxes"] == [[2, 4]]
    content = user(yesno_prompt("sokoban", WORLD_MODELING, "The box will be right of me.", after, before))
    b, a = content.index("State before the action(s):"), content.index("True state after the action(s):")
    assert b < a
    assert content.index("player (2, 2); box (2, 3)") < a < content.index("player (2, 3); box (2, 4)")
    assert "predicted" in content and agent_block(content) == "The box will be right of me."
    # without the previous record only the state after is shown
    alone = user(yesno_prompt("sokoban", WORLD_MODELING, "x", after))
    assert "State before" not in alone and "player (2, 3); box (2, 4)" in alone
    with pytest.raises(ValueError, match="field"):
        yesno_prompt("sokoban", "reasoning", "x", after)


def test_frozenlake_prompt(frozen):
    _, t = frozen
    content = user(yesno_prompt("frozenlake", GROUNDING, "The goal is at the lower right.", t))
    assert "FrozenLake" in content and "also be called the target" in content
    assert "O hole" in content and "G goal" in content
    assert ("player (0, 0); goal (3, 3); hole0 (0, 1); hole1 (2, 1); hole2 (3, 1); hole3 (3, 2)") in content
    assert "status=playing" in content
    assert all(f"- {r}" in content for r in t["relations"]) and len(t["relations"]) == 5


def test_navigation_prompt_with_the_configured_tolerance(nav):
    _, truths = nav
    t = truths[2]
    content = user(yesno_prompt("navigation", GROUNDING, "The ball is on my right.", t))
    assert "'ahead' (in front), 'left', 'right' and 'back' (behind)" in content
    assert "within 0.5 m" in content
    assert "Target object: Ball (right, 3.34 m)" in content
    assert "Other visible objects: OfficeChair (ahead, 2.91 m); Medkit (ahead, 4.16 m)" in content
    assert "Task: Navigate to the ball" in content
    strict = user(yesno_prompt("navigation", GROUNDING, "x", t, config=JudgeConfig(distance_tolerance_m=0.25)))
    assert "within 0.25 m" in strict and "within 0.5 m" not in strict


def test_primitive_skill_prompt_with_the_configured_tolerance(skill):
    _, t = skill
    content = user(yesno_prompt("primitive_skill", GROUNDING, "cubeA is at (-79, -105, 20).", t))
    assert "(x, y, z) in millimetres" in content and "within 10 mm" in content
    assert "Objects (x, y, z in mm): cubeA (-79, -105, 20); cubeB (46, -162, 20)" in content
    assert "Targets (x, y, z in mm): goalA (100, 100, 0); goalB (-100, 100, 0)" in content
    grip = t["state"]["gripper"]
    assert f"Gripper: at ({', '.join(str(v) for v in grip['position'])}), open, holding nothing" in content
    assert "Workspace limits (mm): x -100..150, y -200..200, z 10..200" in content
    assert "cubeA (the red cube)" in content   # the instruction, where the colour names come from
    tight = user(yesno_prompt("primitive_skill", GROUNDING, "x", t, config=JudgeConfig(coordinate_tolerance_mm=5)))
    assert "within 5 mm" in tight


def test_generic_prompt_shows_the_state_as_json():
    s = Session("minesweeper", {}, "grounding")
    try:
        s.reset(seed=1)
        t = s.get_state(-1)
    finally:
        s.close()
    p = yesno_prompt("minesweeper", GROUNDING, "All cells are hidden.", t)
    content = user(p)
    assert p.family == GENERIC and "Environment: minesweeper." in content
    line = next(x for x in content.splitlines() if x.startswith("State (JSON): "))
    assert json.loads(line[len("State (JSON): "):]) == t["state"]
    assert t["observation_text"] in content
    with pytest.raises(ValueError, match="no structured prompt"):
        structured_prompt("minesweeper", GROUNDING, "x", t)
    # a large state is cut, and says so
    big = {"state": {"facts": [f"(at obj{i} loc{i})" for i in range(2000)], "goal": "put a mug in the sink",
                     "admissible_commands": [f"go to loc{i}" for i in range(100)], "location": "sinkbasin 1"},
           "relations": ["obj0 is at loc0"]}
    content = user(yesno_prompt("alfworld", GROUNDING, "x", big))
    line = next(x for x in content.splitlines() if x.startswith("State (JSON): "))
    assert "(cut: " in line and len(line) < MAX_STATE_CHARS + 100
    assert "- obj0 is at loc0" in content
    # The cut takes the long lists: the short fields come first and stay whole.
    assert '"location": "sinkbasin 1"' in line and '"goal": "put a mug in the sink"' in line
    assert line.index('"admissible_commands"') < line.index('"facts"')


# -- answers ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("reply, expected", [
    ("The box is right of the player, as stated. <answer>YES</answer>", True),
    ("wrong side <answer>no</answer>", False),
    ("<answer>\n  Yes \n</answer>", True),
    ("< ANSWER >**No.**</ answer >", False),
    # the last answer counts, whatever came before
    ("First I thought <answer>YES</answer>, but the target is above. <answer>NO</answer>", False),
    ("<answer>NO</answer> ... on reflection <answer>YES</answer>", True),
    # unreadable: no tag, an unclosed tag (cut by max_tokens), not YES/NO, garbage, nothing
    ("YES", None),
    ("reasoning... <answer>YES", None),
    ("<answer>maybe</answer>", None),
    ("<answer>YES</answer> and <answer>yes and no</answer>", None),
    ("\x00\x07 ~~ <ans wer>", None),
    ("", None),
    (None, None),
])
def test_parse_answer(reply, expected):
    verdict, why = parse_answer(reply)
    assert verdict is expected, why
    if expected is None:
        assert "answer" in why


# -- structured readings -----------------------------------------------------------------------------------
def test_structured_prompt_names_and_vocabulary(soko2, nav):
    _, t = soko2
    p = structured_prompt("sokoban", GROUNDING, "Box 1 is right of me.", t)
    content = user(p)
    assert p.kind == "structured" and "JSON list" in p.messages[0]["content"]
    assert "Object names to use: player, box0, box1, target0, target1." in content
    assert "above, below, left_of, right_of, same_row, same_column" in content
    assert agent_block(content) == "Box 1 is right of me."
    # the reader is not shown the truth: no positions, no relation sentences
    assert "Positions" not in content and "Map" not in content
    assert t["relations"] and not any(r in content for r in t["relations"])
    _, truths = nav
    content = user(structured_prompt("navigation", WORLD_MODELING, "The ball will be ahead.", truths[2]))
    assert "Object names to use: Ball, OfficeChair, Medkit." in content
    assert "ahead, left, right, back" in content and '"distance"' in content
    assert "box0" not in content and "predicts the state after" in content


@pytest.mark.parametrize("reply", [
    '[{"subject": "box", "relation": "above", "object": "player"}]',
    'Here are the atoms:\n```json\n[{"subject": "box", "relation": "above", "object": "player"}]\n```\nDone.',
    'The text says [{"subject": "box", "relation": "above", "object": "player"}] and nothing else.',
    '{"atoms": [{"subject": "box", "relation": "above", "object": "player"}]}',
    '{"subject": "box", "relation": "above", "object": "player"}',
])
def test_extract_atoms_tolerates_fences_and_prose(reply):
    assert extract_atoms(reply) == [{"subject": "box", "relation": "above", "object": "player"}]


@pytest.mark.parametrize("reply", ["", "no atoms here", "[{'subject': 'box'}]", '```json\n[{"subject": \n```',
                                   '{"a": [1], "b": [2]}', "null"])
def test_extract_atoms_rejects_malformed(reply):
    with pytest.raises(ValueError):
        extract_atoms(reply)


def test_structured_sokoban_correct_wrong_partly(soko1):
    _, t = soko1
    # correct, in the reader's own spelling: names through the lexicon ('the box', 'me'), 'right of'
    # for right_of, a missing object meaning the player, the player as subject (inverted)
    correct = [{"subject": "box", "relation": "same_row", "object": "player"},
               {"subject": "the box", "relation": "right of", "object": "me"},
               {"subject": "target", "relation": "below"},
               {"subject": "player", "relation": "left_of", "object": "target"}]
    r = score_atoms("sokoban", correct, t)
    assert [str(c) for c in r.claims] == ["box same_row player", "box right_of player", "target below player",
                                         "target right_of player"]
    check(r, Fraction(1), Fraction(1), True)
    # the same claims as the text parser reads from the env's own sentences
    assert set(r.claims) == set(RULE.score("sokoban", SOKO_TRUTH_TEXT, t).claims)
    # wrong on every atom
    wrong = [{"subject": "box", "relation": "below", "object": "player"},
             {"subject": "box", "relation": "left_of", "object": "player"},
             {"subject": "goal", "relation": "above", "object": "I"}]
    check(score_atoms("sokoban", wrong, t), Fraction(0), Fraction(0), False)
    # partly: box above player (wrong), target below and right (right): P 2/3, R 2/4, F1 4/7
    partly = [{"subject": "box", "relation": "above", "object": "player"},
              {"subject": "target", "relation": "below", "object": "player"},
              {"subject": "target", "relation": "right_of", "object": "player"}]
    r = score_atoms("sokoban", partly, t)
    check(r, Fraction(2, 3), Fraction(2, 4), False)
    assert r.f1 == pytest.approx(4 / 7)
    # a hallucinated key, an unknown relation and a malformed atom each cost precision:
    # 2 true of 5 claims, 2 of 4 facts -> F1 2*(2/5)(1/2)/(9/10) = 4/9
    r = score_atoms("sokoban", partly[1:] + [{"subject": "key", "relation": "left_of", "object": "player"},
                                             {"subject": "box", "relation": "near", "object": "player"},
                                             "box above player"], t)
    assert [str(c) for c in r.claims][2:] == ["?key left_of player", "box ?near player", "?invalid ?invalid "]
    check(r, Fraction(2, 5), Fraction(2, 4), False)
    assert r.f1 == pytest.approx(4 / 9)
    # an empty reading of a non-empty state: nothing stated, nothing right
    check(score_atoms("sokoban", [], t), Fraction(0), Fraction(0), False)


def test_structured_two_boxes_indexed_and_generic_names(soko2):
    _, t = soko2
    lex = build_lexicon("grid", t["state"])
    assert [resolve_name(n, lex) for n in ("box0", "Box 1", "box", "the targets", "me", "box5", "key", "")] == [
        "box0", "box1", "box", "target", "player", "box5", "?key", "?unnamed"]
    # box1 right (true), a generic box above (box0 is above: true), box5 does not exist (wrong):
    # 2 of 3 true; covered: box1 right_of, box0 above -> recall 2/8
    r = score_atoms("sokoban", [{"subject": "Box 1", "relation": "right_of", "object": "player"},
                                {"subject": "box", "relation": "above", "object": "player"},
                                {"subject": "box5", "relation": "above", "object": "player"}], t)
    check(r, Fraction(2, 3), Fraction(2, 8), False)


def test_structured_frozenlake_goal_alias(frozen):
    _, t = frozen
    # VAGEN's 'target' for FrozenLake's goal; hole 0 in the player's row, to the right: 4 of 10 facts
    r = score_atoms("frozenlake", [{"subject": "target", "relation": "below", "object": "player"},
                                   {"subject": "the target", "relation": "right", "object": "player"},
                                   {"subject": "hole 0", "relation": "same row", "object": "player"},
                                   {"subject": "hole0", "relation": "right_of", "object": "me"}], t)
    assert {str(c) for c in r.claims} == {"goal below player", "goal right_of player", "hole0 same_row player",
                                         "hole0 right_of player"}
    check(r, Fraction(4, 4), Fraction(4, 10), False)


def test_structured_navigation_directions_and_distances(nav):
    _, truths = nav
    t = truths[2]
    # ball right (true) at 3.3 m (true within 0.5), chair ahead (true), medkit behind (wrong: ahead);
    # a relation between two objects has no truth in navigation and is dropped
    atoms = [{"subject": "Ball", "relation": "right", "object": "agent"},
             {"subject": "ball", "relation": "distance", "object": "agent", "value": [3.3]},
             {"subject": "office chair", "relation": "in front", "object": "me"},
             {"subject": "Medkit", "relation": "behind", "object": ""},
             {"subject": "Medkit", "relation": "left", "object": "OfficeChair"}]
    r = score_atoms("navigation", atoms, t)
    assert [str(c) for c in r.claims] == ["ball right agent", "ball 3.3 m from agent", "officechair ahead agent",
                                         "medkit back agent"]
    # 3 of 4 true, 2 of 3 facts -> F1 2*(3/4)(2/3)/(17/12) = 12/17
    check(r, Fraction(3, 4), Fraction(2, 3), True)
    assert r.f1 == pytest.approx(12 / 17)
    # a distance without a usable value is a wrong claim; a sofa that is not there too
    r = score_atoms("navigation", [{"subject": "ball", "relation": "distance", "value": "far"},
                                   {"subject": "sofa", "relation": "left"}], t)
    assert [str(c) for c in r.claims] == ["ball ?invalid agent", "?sofa left agent"]
    check(r, Fraction(0), Fraction(0), False)


def test_structured_primitive_skill_positions(skill):
    _, t = skill
    # the red cube 6/5/5 mm off (inside 10), cubeB 12 mm off in y (outside), goalA exact, a blue cube
    # that does not exist, a position with two coordinates: 2 of 5 true, 2 of 4 facts -> F1 4/9
    atoms = [{"subject": "the red cube", "relation": "at", "value": [-85, -100, 25]},
             {"subject": "cubeB", "relation": "at", "value": [40, -150, 20]},
             {"subject": "goal A", "value": [100, 100, 0]},
             {"subject": "blue cube", "relation": "at", "value": [0, 0, 20]},
             {"subject": "goalB", "relation": "at", "value": [-100, 100]}]
    r = score_atoms("primitive_skill", atoms, t)
    assert [str(c) for c in r.claims] == ["cubea at (-85, -100, 25)", "cubeb at (40, -150, 20)",
                                         "goala at (100, 100, 0)", "?bluecube at (0, 0, 20)", "goalb at (-100, 100)"]
    check(r, Fraction(2, 5), Fraction(2, 4), False)
    assert r.f1 == pytest.approx(4 / 9)


# -- cache keys --------------------------------------------------------------------------------------------
def test_cache_key_parts(soko1, frozen):
    _, t = soko1
    _, other = frozen
    item = JudgeInput("sokoban", GROUNDING, "The box is right of me.", t)
    key = cache_key("yesno", "m", "sokoban", item)
    assert key == cache_key("yesno", "m", "sokoban", JudgeInput("sokoban", GROUNDING, "The box is right of me.",
                                                                dict(t)))
    different = [
        cache_key("structured", "m", "sokoban", item),
        cache_key("yesno", "m2", "sokoban", item),
        cache_key("yesno", "m", "grid", item),
        cache_key("yesno", "m", "sokoban", JudgeInput("sokoban", WORLD_MODELING, item.text, t)),
        cache_key("yesno", "m", "sokoban", JudgeInput("sokoban", GROUNDING, item.text + " ", t)),
        cache_key("yesno", "m", "sokoban", JudgeInput("sokoban", GROUNDING, item.text, other)),
    ]
    assert len({key, *different}) == 7
    # grounding never shows the previous turn: it is not part of the key; world modelling's is
    assert cache_key("yesno", "m", "sokoban", JudgeInput("sokoban", GROUNDING, item.text, t, other)) == key
    wm = JudgeInput("sokoban", WORLD_MODELING, item.text, t, other)
    assert cache_key("yesno", "m", "sokoban", wm) != cache_key(
        "yesno", "m", "sokoban", JudgeInput("sokoban", WORLD_MODELING, item.text, t, t))


def test_truth_id_anchor_or_canonical_json(soko1):
    _, t = soko1
    assert truth_id(t) == f"anchor:{t['anchor']}" and t["anchor"]
    # without an anchor: the state and relations, whatever the key order
    a = {"state": {"player": [1, 1], "boxes": [[0, 1]]}, "relations": ["r"]}
    b = {"relations": ["r"], "state": {"boxes": [[0, 1]], "player": [1, 1]}, "anchor": ""}
    assert truth_id(a) == truth_id(b) and truth_id(a).startswith("json:")
    assert truth_id(a) != truth_id({"state": {"player": [1, 2], "boxes": [[0, 1]]}, "relations": ["r"]})
    assert truth_id(a) != truth_id({"state": a["state"], "relations": ["r", "s"]})
    assert truth_id(None) == ""


# -- config -------------------------------------------------------------------------------------------------
def test_llm_judge_config_validation():
    c = LLMJudgeConfig.from_mapping({"model": "judge", "max_concurrency": 3.0, "requests_per_second": 2,
                                     "api_key_env": "JUDGE_API_KEY", "mode": "structured"})
    assert (c.model, c.max_concurrency, c.requests_per_second, c.mode, c.temperature) == (
        "judge", 3, 2.0, "structured", 0.0)
    assert isinstance(c.max_concurrency, int) and isinstance(c.requests_per_second, float)
    assert LLMJudgeConfig.from_mapping(c.to_dict()) == c
    for bad, match in [({"model": "j", "temperatur": 0}, "unknown"), ({"model": "j", "max_retries": 1.5}, "integer"),
                       ({"model": "j", "timeout_s": "10"}, "number"), ({"model": 3}, "string"),
                       ({"model": "j", "max_tokens": True}, "number"), ({}, "model"),
                       ({"model": "j", "mode": "score"}, "mode"), ({"model": "j", "base_url": "localhost:8000"}, "URL"),
                       # a key pasted where the variable's name belongs
                       ({"model": "j", "api_key_env": "sk-abc123"}, "NAME"),
                       ({"model": "j", "max_concurrency": 0}, "max_concurrency"),
                       ({"model": "j", "backoff_base_s": 5, "backoff_max_s": 1}, "backoff")]:
        with pytest.raises(ValueError, match=match):
            LLMJudgeConfig.from_mapping(bad)
