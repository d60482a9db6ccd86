"""The rule-based judge against REAL ground truth: sessions of the real envs, reset with fixed seeds,
hand-written agent texts (correct, wrong, partly right, equivalent phrasings) with their precision,
recall and F1 worked out by hand below; world modelling judged against turn t+1; VAGEN's repetition
penalty and the reasoning reward.

Each fixture first asserts the layout it relies on, so a change in an env's generation fails here
loudly instead of silently changing what the expected scores mean.
"""
from __future__ import annotations

import os
import subprocess
import sys
from fractions import Fraction
from importlib.util import find_spec

import pytest

from envserve.core.session import Session
from envserve.judge import (GROUNDING, WORLD_MODELING, JudgeConfig, RepetitionPenalty, RepetitionTracker,
                            RuleJudge, build_lexicon, normalize_response, parse_claims, reasoning_reward,
                            reference_claims, truth_turn)
from envserve.judge.relations import parse_relation_sentences
from serverproc import sapien_vulkan_problem

JUDGE = RuleJudge()


def f1(p: Fraction, r: Fraction) -> float:
    return float(2 * p * r / (p + r)) if p + r else 0.0


def check(result, precision: Fraction, recall: Fraction, verdict: bool | None = None):
    assert result.precision == pytest.approx(float(precision)), result.reasoning
    assert result.recall == pytest.approx(float(recall)), result.reasoning
    assert result.f1 == pytest.approx(f1(precision, recall)), result.reasoning
    if verdict is not None:
        assert result.verdict is verdict
    assert result.verdict == (result.f1 >= 0.7)


def claims_of(env_family: str, text: str, state: dict) -> set[str]:
    return {str(c) for c in parse_claims(text, build_lexicon(env_family, state))}


def truth_of(session: Session) -> dict:
    """The ground truth as GetState hands it out: the session's record of its latest turn."""
    return session.get_state(-1)


# -- Sokoban ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def soko1():
    s = Session("sokoban", {}, "grounding_worldmodeling")
    s.reset(seed=7)
    t = truth_of(s)
    # ######
    # ##___#
    # ##PX_#      P player (2,2), X box (2,3), O target (3,4)
    # ###_O#
    assert t["state"]["player"] == [2, 2] and t["state"]["boxes"] == [[2, 3]] and t["state"]["targets"] == [[3, 4]]
    assert t["relations"] == ["box is at the same row and to the right of the player",
                              "target is below and on the right side of the player"]
    yield s, t
    s.close()


@pytest.fixture(scope="module")
def soko2():
    s = Session("sokoban", {"num_boxes": 2}, "grounding")
    s.reset(seed=3)
    t = truth_of(s)
    # #_X__#      player (3,1); box0 (2,2), box1 (3,2); target0 (3,3), target1 (3,4)
    # #PXOO#
    assert t["state"]["player"] == [3, 1]
    assert t["state"]["boxes"] == [[2, 2], [3, 2]] and t["state"]["targets"] == [[3, 3], [3, 4]]
    yield s, t
    s.close()


def test_reference_from_state_equals_the_env_relation_sentences(soko1, soko2, frozen):
    for _, t in (soko1, soko2, frozen):
        lex = build_lexicon("grid", t["state"])
        from_state = reference_claims("grid", t["state"], t["relations"], lex)
        assert from_state == parse_relation_sentences(t["relations"], lex)
        assert len(from_state) == 2 * len(t["relations"])  # a vertical and a horizontal atom per object
    _, t = soko1
    assert [str(c) for c in reference_claims("grid", t["state"], [], build_lexicon("grid", t["state"]))] == [
        "box same_row player", "box right_of player", "target below player", "target right_of player"]


def test_sokoban_correct_in_vagen_phrasing(soko1):
    _, t = soko1
    r = JUDGE.score("sokoban", "The box is at the same row and to the right of the player. "
                               "The target is below and on the right side of the player.", t)
    check(r, Fraction(4, 4), Fraction(4, 4), True)


def test_sokoban_equivalent_phrasings_give_the_same_claims(soko1):
    _, t = soko1
    state = t["state"]
    base = claims_of("grid", "The box is at the same row and to the right of the player. "
                             "The target is below and on the right side of the player.", state)
    assert base == {"box same_row player", "box right_of player", "target below player", "target right_of player"}
    for text in [
        # inverses: the player as the subject
        "The player is to the left of the box and in the same row. The player is above and to the left of the target.",
        # the agent speaking of itself, diagonals, compass words
        "The box is right of me, on my row. The target is to my lower-right.",
        "I am in the same row as the box, which is to the east of me; the goal is south-east of me.",
        "The box is directly to the right of the player and they are horizontally aligned, "
        "and the target is at the bottom-right of the player.",
    ]:
        assert claims_of("grid", text, state) == base, text
        check(JUDGE.score("sokoban", text, t), Fraction(1), Fraction(1), True)
    # "box is above player" == "player is below box"
    assert claims_of("grid", "The box is above the player.", state) == \
        claims_of("grid", "The player is below the box.", state) == {"box above player"}
    # relations between two objects canonicalize too: "target is below box" == "box is above target"
    assert claims_of("grid", "The target is below the box.", state) == \
        claims_of("grid", "The box is above the target.", state) == {"box above target"}


def test_each_phrase_binds_to_the_name_after_it():
    # a box pushed onto its target, right above the player: one clause, two objects
    state = {"player": [3, 1], "boxes": [[2, 1]], "targets": [[2, 1]]}
    assert claims_of("grid", "The box will be on the target, above me in my column.", state) == {
        "box same_row target", "box same_column target", "box above player", "box same_column player"}
    # a phrase with no name after it keeps the object before it
    assert claims_of("grid", "The target is directly below the box, in the same column.", state) == {
        "box above target", "box same_column target"}
    # 'is in my row' names a row, not a cell shared with "my"
    assert claims_of("grid", "The box is in my row, to my right.", {"player": [0, 0], "boxes": [[0, 2]]}) == {
        "box same_row player", "box right_of player"}


def test_sokoban_partly_right(soko1):
    _, t = soko1
    # claims: box above player (wrong: same row), target below player (right), target right_of player (right)
    # precision 2/3; of the 4 true relations 2 are stated: recall 2/4; F1 = 2*(2/3)(1/2)/(2/3+1/2) = 4/7
    r = JUDGE.score("sokoban", "The box is above the player, the target is to my lower-right.", t)
    check(r, Fraction(2, 3), Fraction(2, 4), False)
    assert r.f1 == pytest.approx(4 / 7)
    assert "Wrong: box above player" in r.reasoning and "Not stated: box same_row player" in r.reasoning


def test_sokoban_wrong(soko1):
    _, t = soko1
    r = JUDGE.score("sokoban", "The box is below me and on my left. The target is above the player.", t)
    assert {str(c) for c in r.claims} == {"box below player", "box left_of player", "target above player"}
    check(r, Fraction(0), Fraction(0), False)


def test_sokoban_true_claim_outside_the_reference_counts_for_precision_only(soko1):
    _, t = soko1
    # box (2,3) is above and left of target (3,4): both true, neither among the player-relative facts;
    # "box is on the target" (same row and same column) is wrong on both axes.
    r = JUDGE.score("sokoban", "The box is above and to the left of the target. The box is on the target. "
                               "The box is to the right of the player.", t)
    assert {str(c) for c in r.claims} == {"box above target", "box left_of target", "box same_row target",
                                         "box same_column target", "box right_of player"}
    check(r, Fraction(3, 5), Fraction(1, 4))


def test_sokoban_unknown_objects_negation_and_actions(soko1):
    _, t = soko1
    # a key that does not exist is a wrong claim; walls are not judged
    r = JUDGE.score("sokoban", "There is a wall above me. The key is left of the player.", t)
    assert [str(c) for c in r.claims] == ["?key left_of player"]
    check(r, Fraction(0), Fraction(0), False)
    # a negated clause asserts nothing; an action phrase is no relation
    r = JUDGE.score("sokoban", "The box is not above the player. After I move left, the box is to my right.", t)
    assert [str(c) for c in r.claims] == ["box right_of player"]
    check(r, Fraction(1), Fraction(1, 4))
    empty = JUDGE.score("sokoban", "", t)
    assert (empty.precision, empty.recall, empty.f1, empty.verdict) == (0.0, 0.0, 0.0, False)


def test_sokoban_two_boxes_indexed_and_generic_names(soko2):
    _, t = soko2
    # true: box0 above+right, box1 same_row+right, target0 same_row+right, target1 same_row+right (8)
    # 5 claims, all true; "both targets" is one generic claim per relation, each covering one target:
    # matched box0 above, box0 right, box1 right, one target right, one target same_row -> recall 5/8
    r = JUDGE.score("sokoban", "box0 is above and on the right side of the player, box 1 is right of me. "
                               "Both targets are to the right of the player and in the same row.", t)
    assert {str(c) for c in r.claims} == {"box0 above player", "box0 right_of player", "box1 right_of player",
                                         "target right_of player", "target same_row player"}
    check(r, Fraction(1), Fraction(5, 8), True)
    assert r.f1 == pytest.approx(10 / 13)
    # a generic claim about "a box" covers one box only
    r = JUDGE.score("sokoban", "A box is above the player and to the right. "
                               "The targets are at the same row as the player.", t)
    check(r, Fraction(1), Fraction(3, 8), False)
    # box5 does not exist: a wrong claim, not a generic one
    r = JUDGE.score("sokoban", "Box 5 is above the player.", t)
    check(r, Fraction(0), Fraction(0))


def test_sokoban_world_modeling_is_judged_against_turn_t_plus_1(soko1):
    s, before = soko1
    text = ("<think><observation>The box is at the same row and to the right of the player.</observation>"
            "<reasoning>Push the box right so it sits above the target.</reasoning>"
            "<prediction>The box will be right of me in the same row. The target will be directly below the box, "
            "in the same column.</prediction></think><answer>Right</answer>")
    turn = s.turn
    result = s.step(text)
    assert result.valid and result.reasoning["prediction"].startswith("The box will be")
    after = s.get_state(truth_turn(WORLD_MODELING, turn))
    assert after["turn"] == turn + 1
    assert after["state"]["player"] == [2, 3] and after["state"]["boxes"] == [[2, 4]]
    assert s.get_state(truth_turn(GROUNDING, turn))["state"] == before["state"]
    prediction = result.reasoning["prediction"]
    # after the push: box (2,4) right of and in the row of player (2,3); box above target (3,4) in its column.
    # 4 claims, all true; the player-relative box facts are 2 of the 4 true relations -> F1 2/3
    r = JUDGE.score("sokoban", prediction, after, WORLD_MODELING)
    assert {str(c) for c in r.claims} == {"box right_of player", "box same_row player", "box above target",
                                         "box same_column target"}
    check(r, Fraction(4, 4), Fraction(2, 4), False)
    # the same prediction against the state before the move: box (2,3) is not in the target's column
    r = JUDGE.score("sokoban", prediction, before, WORLD_MODELING)
    check(r, Fraction(3, 4), Fraction(2, 4), False)
    # the observation is judged at turn t
    r = JUDGE.score("sokoban", result.reasoning["observation"], before, GROUNDING)
    check(r, Fraction(2, 2), Fraction(2, 4), False)


# -- FrozenLake --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def frozen():
    s = Session("frozenlake", {}, "grounding_worldmodeling")
    s.reset(seed=5)
    t = truth_of(s)
    # PO__      player (0,0), goal (3,3); hole0 (0,1), hole1 (2,1), hole2 (3,1), hole3 (3,2)
    # ____
    # _O__
    # _OOG
    st = t["state"]
    assert st["player"] == [0, 0] and st["goal"] == [3, 3] and st["holes"] == [[0, 1], [2, 1], [3, 1], [3, 2]]
    yield s, t
    s.close()


def test_frozenlake_correct_wrong_partly(frozen):
    _, t = frozen
    # the env's own sentences, joined, are a perfect description: 10 atoms
    check(JUDGE.score("frozenlake", ". ".join(t["relations"]), t), Fraction(1), Fraction(1), True)
    # partly: goal below+right, hole0 right+same row: 4 true claims of the 10 facts -> F1 2*0.4/1.4 = 4/7
    r = JUDGE.score("frozenlake", "The goal is at the lower right. Hole 0 is right next to me, to my right, "
                                  "in the same row.", t)
    assert {str(c) for c in r.claims} == {"goal below player", "goal right_of player", "hole0 right_of player",
                                         "hole0 same_row player"}
    check(r, Fraction(4, 4), Fraction(4, 10), False)
    # wrong on every axis
    r = JUDGE.score("frozenlake", "The goal is above me and to the left. Hole 0 is below me.", t)
    check(r, Fraction(0, 3), Fraction(0, 10), False)


def test_frozenlake_equivalent_phrasings(frozen):
    _, t = frozen
    state = t["state"]
    base = {"goal below player", "goal right_of player"}
    for text in ["The goal is below and on the right side of the player.",
                 "The player is above and to the left of the goal.",
                 "The target is to the lower-right of me.",   # VAGEN calls FrozenLake's goal the target
                 "The gift lies southeast of the agent."]:
        assert claims_of("grid", text, state) == base, text
        # 2 facts of 10 -> F1 = 2*(1)(1/5)/(6/5) = 1/3
        check(JUDGE.score("frozenlake", text, t), Fraction(1), Fraction(2, 10), False)
    # holes: a generic "holes" claim covers one hole; "hole 2" is hole2
    assert claims_of("grid", "Hole 2 is below me and to my right.", state) == {"hole2 below player",
                                                                             "hole2 right_of player"}


def test_frozenlake_world_modeling(frozen):
    s, before = frozen
    turn = s.turn
    result = s.step("<think><observation>The goal is at the lower right.</observation><reasoning>Go down.</reasoning>"
                    "<prediction>I will be below hole 0 and to its left. The goal will be below and to the right "
                    "of me.</prediction></think><answer>Down</answer>")
    assert result.valid and not result.done
    after = s.get_state(truth_turn(WORLD_MODELING, turn))
    assert after["state"]["player"] == [1, 0]
    pred = result.reasoning["prediction"]
    # after: hole0 (0,1) is above and right of the player (1,0); goal below and right: 4 of 4 claims true,
    # 4 of the 10 facts -> F1 4/7
    r = JUDGE.score("frozenlake", pred, after, WORLD_MODELING)
    assert {str(c) for c in r.claims} == {"hole0 above player", "hole0 right_of player", "goal below player",
                                         "goal right_of player"}
    check(r, Fraction(4, 4), Fraction(4, 10), False)
    # before the move hole0 was in the player's row: "hole0 above player" is wrong there
    check(JUDGE.score("frozenlake", pred, before, WORLD_MODELING), Fraction(3, 4), Fraction(3, 10), False)


# -- Navigation --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def nav():
    if find_spec("miniworld") is None:
        pytest.skip("navigation needs the miniworld package")
    s = Session("navigation", {}, "grounding_worldmodeling")
    truths = {}
    for seed in (2, 10):
        s.reset(seed=seed)
        truths[seed] = truth_of(s)
    assert truths[2]["relations"] == ["the Ball (target) is right of the agent, 3.34 m away",
                                      "the OfficeChair is ahead of the agent, 2.91 m away",
                                      "the Medkit is ahead of the agent, 4.16 m away"]
    assert truths[10]["relations"] == ["the Barrel (target) is right of the agent, 4.12 m away",
                                       "the Key is left of the agent, 1.35 m away",
                                       "the Key is ahead of the agent, 1.89 m away"]
    yield s, truths
    s.close()


def test_navigation_reference_from_state(nav):
    _, truths = nav
    t = truths[2]
    lex = build_lexicon("navigation", t["state"])
    ref = reference_claims("navigation", t["state"], t["relations"], lex)
    assert [str(c) for c in ref] == ["ball right agent", "officechair ahead agent", "medkit ahead agent"]
    # the env's sentences parse to the same directions (plus their distances)
    parsed = parse_relation_sentences(t["relations"], lex)
    assert [c for c in parsed if c.relation != "distance"] == ref
    assert sorted(str(c) for c in parsed if c.relation == "distance") == [
        "ball 3.34 m from agent", "medkit 4.16 m from agent", "officechair 2.91 m from agent"]


def test_navigation_correct_partly_wrong(nav):
    _, truths = nav
    t = truths[2]
    # correct: 3 directions and a distance within 0.5 m (3.3 vs 3.34): 4/4 claims, 3/3 facts
    r = JUDGE.score("navigation", "The ball is on my right, about 3.3 m away. The office chair is straight ahead "
                                  "and the medkit is in front of me too.", t)
    check(r, Fraction(4, 4), Fraction(3, 3), True)
    # partly: the chair (OfficeChair) ahead at 2.9 m, the target ball right; the medkit unmentioned
    r = JUDGE.score("navigation", "I see a chair in front of me, 2.9 meters away, and the target ball is to the right.", t)
    assert {str(c) for c in r.claims} == {"officechair ahead agent", "officechair 2.9 m from agent",
                                         "ball right agent"}
    check(r, Fraction(3, 3), Fraction(2, 3), True)
    assert r.f1 == pytest.approx(0.8)
    # wrong: target behind (it is right), a sofa that is not there, the medkit ahead (right) but 9 m
    # (it is 4.16 m): 1 of 4 claims true, 1 of 3 facts -> F1 = 2*(1/4)(1/3)/(7/12) = 2/7
    r = JUDGE.score("navigation", "The target is behind me. The sofa is on my left. The medkit is ahead, 9 m away.", t)
    assert {str(c) for c in r.claims} == {"ball back agent", "?sofa left agent", "medkit ahead agent",
                                         "medkit 9 m from agent"}
    check(r, Fraction(1, 4), Fraction(1, 3), False)
    assert r.f1 == pytest.approx(2 / 7)


def test_navigation_equivalent_phrasings_and_repeated_types(nav):
    _, truths = nav
    state = truths[2]["state"]
    for texts, expected in [
        (["The ball is on my right.", "The ball is to the right of the agent.", "The target is right of me.",
          "The Ball (target) is right of the agent."], {"ball right agent"}),
        (["The office chair is straight ahead.", "The OfficeChair is in front of the agent.", "The chair is ahead.",
          "The office_chair is directly ahead of me."], {"officechair ahead agent"}),
        (["The medkit is behind me.", "The medkit is at my back.", "The Medkit is back of the agent."],
         {"medkit back agent"}),
    ]:
        for text in texts:
            assert claims_of("navigation", text, state) == expected, text
    # two keys of one type, one left and one ahead: both directions are true facts
    t = truths[10]
    r = JUDGE.score("navigation", "The barrel is to my right. A key is on my left and another key is ahead of me.", t)
    check(r, Fraction(3, 3), Fraction(3, 3), True)
    r = JUDGE.score("navigation", "The key is ahead and the barrel is behind the agent.", t)
    check(r, Fraction(1, 2), Fraction(1, 3), False)


def test_navigation_distance_tolerance_is_configurable(nav):
    _, truths = nav
    text = "The ball is on my right, 3.0 m away."  # true distance 3.34
    check(JUDGE.score("navigation", text, truths[2]), Fraction(2, 2), Fraction(1, 3))
    strict = RuleJudge(JudgeConfig(distance_tolerance_m=0.2))
    check(strict.score("navigation", text, truths[2]), Fraction(1, 2), Fraction(1, 3))


# -- PrimitiveSkill ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def skill():
    if find_spec("mani_skill") is None or find_spec("sapien") is None:
        pytest.skip("primitive_skill needs mani-skill and sapien")
    problem = sapien_vulkan_problem()
    if problem:
        pytest.skip(f"SAPIEN cannot create a Vulkan render device (set VK_ICD_FILENAMES, "
                    f"now {os.environ.get('VK_ICD_FILENAMES', 'unset')}): {problem}")
    s = Session("primitive_skill", {"task": "place"}, "grounding_worldmodeling")
    s.reset(seed=3)
    t = truth_of(s)
    assert t["state"]["objects"] == {"cubeA": [-79, -105, 20], "cubeB": [46, -162, 20]}
    assert t["state"]["targets"] == {"goalA": [100, 100, 0], "goalB": [-100, 100, 0]}
    assert "cubeA (the red cube)" in t["state"]["instruction"]
    yield s, t
    s.close()


def test_primitive_skill_correct_partly_wrong(skill):
    _, t = skill
    r = JUDGE.score("primitive_skill", "cubeA is at (-79, -105, 20), cubeB is at (46, -162, 20). "
                                       "goalA is at (100, 100, 0) and goalB at (-100, 100, 0).", t)
    check(r, Fraction(4, 4), Fraction(4, 4), True)
    # the red cube 6/5/5 mm off (within 10), the green cube 12 mm off in y (outside), goal A exact:
    # 2 of 3 claims, 2 of 4 positions -> F1 4/7
    r = JUDGE.score("primitive_skill", "The red cube is at [-85, -100, 25] and the green cube: (40, -150, 20). "
                                       "Goal A: x=100, y=100, z=0.", t)
    assert [str(c) for c in r.claims] == ["cubea at (-85, -100, 25)", "cubeb at (40, -150, 20)",
                                         "goala at (100, 100, 0)"]
    check(r, Fraction(2, 3), Fraction(2, 4), False)
    # wrong: the cubes where the goals are; a blue cube that does not exist
    r = JUDGE.score("primitive_skill", "cubeA is at (100, 100, 0) and cubeB is at (-100, 100, 0). "
                                       "The blue cube is at (0, 0, 20).", t)
    check(r, Fraction(0, 3), Fraction(0, 4), False)


def test_primitive_skill_equivalent_names_and_tolerance(skill):
    _, t = skill
    state = t["state"]
    for text in ["cubeA is at (-79, -105, 20).", "The red cube: [-79,-105,20]", "cube A located at x=-79, y=-105, z=20",
                 "Cube_A is currently at (-79 mm, -105 mm, 20 mm)."]:
        assert claims_of("primitive_skill", text, state) == {"cubea at (-79, -105, 20)"}, text
    # +-10 mm on every axis is inside, 11 mm is not
    check(JUDGE.score("primitive_skill", "cubeA is at (-69, -115, 30).", t), Fraction(1), Fraction(1, 4))
    check(JUDGE.score("primitive_skill", "cubeA is at (-68, -105, 20).", t), Fraction(0), Fraction(0))
    # a tighter tolerance from the config
    tight = RuleJudge(JudgeConfig(coordinate_tolerance_mm=5))
    check(tight.score("primitive_skill", "cubeA is at (-85, -105, 20).", t), Fraction(0), Fraction(0))
    check(tight.score("primitive_skill", "cubeA is at (-84, -105, 20).", t), Fraction(1), Fraction(1, 4))


# -- repetition penalty ------------------------------------------------------------------------------------
def test_normalized_responses():
    assert normalize_response("The box is  ABOVE the player.") == normalize_response("the box is above the player")
    assert normalize_response("box at (1.5, -2)") == "box at 1.5 -2"
    assert normalize_response("box0 is left") != normalize_response("box1 is left")


def test_tracker_top_k_through_the_lazy_heap():
    tr = RepetitionTracker(top_k=2, max_tracked=100, min_count=1)
    for text, n in (("a a", 3), ("b b", 2), ("c c", 1), ("d d", 2)):
        for _ in range(n):
            tr.add(text)
    # every increment pushed an entry: 8 entries for 4 keys, the stale ones skipped when popped
    assert len(tr._heap) == 8 and len(tr) == 4
    assert tr.top() == [("a a", 3), ("b b", 2)]  # b and d tie at 2: the alphabetically first wins
    assert tr.top(4) == [("a a", 3), ("b b", 2), ("d d", 2), ("c c", 1)]
    tr.add("d d")
    tr.add("D d!")
    assert tr.top() == [("d d", 4), ("a a", 3)]
    assert tr.is_frequent("D D") and not tr.is_frequent("b b") and not tr.is_frequent("never seen")


def test_tracker_stays_bounded_and_keeps_the_frequent():
    tr = RepetitionTracker(top_k=1, max_tracked=3, min_count=1)
    for _ in range(5):
        tr.add("stock sentence")
    for i in range(40):
        tr.add(f"unique {i}")
    assert len(tr._heap) <= 4 * 3 + 1 and len(tr) <= 4 * 3 + 1
    assert tr.count("stock sentence") == 5
    assert tr.top() == [("stock sentence", 5)]


def test_repetition_penalty_on_frequent_low_scores(soko1):
    _, t = soko1
    cfg = JudgeConfig(repetition_top_k=1, repetition_min_count=2)
    rep = RepetitionPenalty(cfg)
    stock = "The box is above the player."          # F1 0: wrong
    good = ". ".join(t["relations"])               # F1 1
    once = "The target is below me."                # F1 2*(1)(1/4)/(5/4) = 0.4
    batch = [stock, stock, stock, good, good, once]
    rep.observe(GROUNDING, batch)
    scores = {text: JUDGE.score("sokoban", text, t).f1 for text in set(batch)}
    assert scores[stock] == 0.0 and scores[good] == pytest.approx(1.0) and scores[once] == pytest.approx(0.4)
    # the most frequent and below 0.7: the penalty replaces the F1
    assert rep.apply(GROUNDING, stock, scores[stock]) == (-0.1, True)
    # frequent but good: kept; low but not frequent: kept
    assert rep.apply(GROUNDING, good, scores[good]) == (pytest.approx(1.0), False)
    assert rep.apply(GROUNDING, once, scores[once]) == (pytest.approx(0.4), False)
    # world modelling has its own counts
    assert rep.apply(WORLD_MODELING, stock, 0.0) == (0.0, False)
    # a response seen only once is not "frequent", even while it is in the top k
    fresh = RepetitionPenalty(JudgeConfig(repetition_top_k=5))
    fresh.observe(GROUNDING, [stock])
    assert fresh.apply(GROUNDING, stock, 0.0) == (0.0, False)
    fresh.observe(GROUNDING, [stock.upper()])
    assert fresh.apply(GROUNDING, stock, 0.0) == (-0.1, True)


def test_repetition_counts_per_scope_and_the_least_recently_used_scope_goes_first():
    rep = RepetitionPenalty(JudgeConfig(repetition_top_k=1, repetition_max_scopes=2))
    stock = "The box is above the player."
    rep.observe(GROUNDING, [stock, stock], scope="run-a")
    assert rep.apply(GROUNDING, stock, 0.0, scope="run-a") == (-0.1, True)
    # another scope, and the shared one, have not seen it
    assert rep.apply(GROUNDING, stock, 0.0, scope="run-b") == (0.0, False)
    assert rep.apply(GROUNDING, stock, 0.0) == (0.0, False)
    assert rep.scopes == ["run-b", ""]                    # two kept: run-a, the oldest, went
    rep.observe(GROUNDING, [stock], scope="run-a")        # a forgotten scope starts again from 0
    assert rep.apply(GROUNDING, stock, 0.0, scope="run-a") == (0.0, False)
    with pytest.raises(ValueError, match="repetition_max_scopes"):
        JudgeConfig(repetition_max_scopes=0)


# -- reward assembly and config ----------------------------------------------------------------------------
def test_reasoning_reward():
    r = reasoning_reward(1.0, 0.5)
    assert r.total == pytest.approx(0.75) and r.components == {"grounding": 0.5, "world_modeling": 0.25}
    r = reasoning_reward(0.8, 0.4, JudgeConfig(beta_grounding=0.25, beta_world_modeling=1.0))
    assert r.total == pytest.approx(0.25 * 0.8 + 1.0 * 0.4)
    assert reasoning_reward(0.6, None).total == pytest.approx(0.3)           # grounding format only
    assert reasoning_reward(None, -0.1).total == pytest.approx(-0.05)       # a penalized prediction
    assert reasoning_reward(1.0, 1.0, format_valid=False).total == 0.0


def test_config_defaults_and_validation():
    c = JudgeConfig()
    assert (c.f1_threshold, c.coordinate_tolerance_mm, c.beta_grounding, c.beta_world_modeling,
            c.repetition_penalty) == (0.7, 10.0, 0.5, 0.5, -0.1)
    assert JudgeConfig.from_mapping({"repetition_top_k": 3.0, "f1_threshold": 1}).repetition_top_k == 3
    with pytest.raises(ValueError, match="unknown judge config key"):
        JudgeConfig.from_mapping({"threshold": 0.5})
    with pytest.raises(ValueError, match="integer"):
        JudgeConfig.from_mapping({"repetition_top_k": 2.5})
    with pytest.raises(ValueError):
        JudgeConfig(f1_threshold=1.5)
    # the verdict follows the configured threshold
    t = {"state": {"player": [2, 2], "boxes": [[2, 3]], "targets": [[3, 4]]}, "relations": []}
    text = "The box is to the right of the player and in the same row. The target is below me."
    # 3 of 3 true, 3 of 4 facts: F1 6/7 = 0.857
    assert JUDGE.score("sokoban", text, t).verdict is True
    assert RuleJudge(JudgeConfig(f1_threshold=0.9)).score("sokoban", text, t).verdict is False
    with pytest.raises(ValueError):
        truth_turn("reasoning", 0)


def test_judge_imports_no_env_class():
    code = ("import sys, envserve.judge, envserve.judge.rule_judge; "
            "print(sorted(m for m in sys.modules if m.startswith(('envserve.envs', 'envserve.server'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
