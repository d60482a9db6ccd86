"""The rule-based judge: an agent's relation claims scored against the ground truth by F1.

What is compared (VAGEN's structured evaluation, in claim form):
- the reference set R: the relations a perfect description states. Grid envs: each object's
  vertical and horizontal relation to the player (exactly what the env's relation sentences say);
  navigation: the direction of the target and of every visible object from the agent; PrimitiveSkill:
  the position of every listed object and target. R comes from the GetState state map; where the
  map lacks what is needed (an env of the family with other keys), from the relation sentences.
- the claims C parsed from the agent's text (relations.parse_claims), each a canonical atom.

precision = claims that are true in the state / |C|  (a true claim outside R, e.g. "box0 is left of
            target0", counts as right; a claim about an object that does not exist counts as wrong)
recall    = facts of R covered by a claim / |R|, through a maximum one-to-one matching, so a claim
            about "a box" covers one box, and two claims about one object cover it once
F1        = 2PR / (P + R); the verdict is F1 >= f1_threshold (0.7).

Grounding compares the text with the state at turn t, world modelling with the state at turn t+1
(`truth_turn`). The judge reads only state dicts as GetState returns them; it imports no env class.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from .base import JudgeError, JudgeInput, Judgment
from .config import JudgeConfig
from .relations import (AT, DISTANCE, GRID, INVERSE, NAVIGATION, PRIMITIVE_SKILL, Claim, Lexicon,
                        build_lexicon, grid_positions, nav_objects, norm_name, parse_claims,
                        parse_relation_sentences, ps_positions)

GROUNDING, WORLD_MODELING = "grounding", "world_modeling"
FIELDS = (GROUNDING, WORLD_MODELING)
# The reasoning field of a turn result each judged field reads (core/formats.py).
REASONING_FIELD = {GROUNDING: "observation", WORLD_MODELING: "prediction"}

_FAMILY_BY_ENV = {"sokoban": GRID, "frozenlake": GRID, "navigation": NAVIGATION, "primitive_skill": PRIMITIVE_SKILL}


def truth_turn(field_name: str, turn: int) -> int:
    """The turn whose ground truth judges a text written at `turn`: t for grounding, t+1 for world
    modelling (the prediction is about the state after the turn's actions)."""
    if field_name == GROUNDING:
        return turn
    if field_name == WORLD_MODELING:
        return turn + 1
    raise ValueError(f"field must be one of {FIELDS}, got {field_name!r}")


def env_family(env_id: str, state: Mapping[str, Any] | None = None) -> str:
    """The claim family of an env: by id (a prefix, so 'sokoban-lamer' works), else by the state's keys."""
    for prefix, fam in _FAMILY_BY_ENV.items():
        if env_id == prefix or env_id.startswith(prefix + "-") or env_id.startswith(prefix + "_"):
            return fam
    state = state or {}
    if "target_obj_type" in state:
        return NAVIGATION
    if "objects" in state and "gripper" in state:
        return PRIMITIVE_SKILL
    if "player" in state:
        return GRID
    raise ValueError(f"no rule-based judge for env {env_id!r}")


@dataclass
class RuleScore:
    precision: float
    recall: float
    f1: float
    verdict: bool
    claims: list[Claim] = field(default_factory=list)
    correct: list[Claim] = field(default_factory=list)
    reference: list[Claim] = field(default_factory=list)
    matched: list[tuple[Claim, Claim]] = field(default_factory=list)
    reasoning: str = ""

    @property
    def score(self) -> float:
        return self.f1


def _truth_parts(truth: Any) -> tuple[Mapping[str, Any], list[str]]:
    """(state, relations) of a GetState record dict, a GroundTruth, or a bare state map."""
    if hasattr(truth, "state"):
        return truth.state, list(getattr(truth, "relations", []) or [])
    if isinstance(truth, Mapping) and "state" in truth and isinstance(truth["state"], Mapping):
        return truth["state"], list(truth.get("relations") or [])
    return truth, []


# -- the reference set ---------------------------------------------------------------------------------
def _grid_atoms(name: str, pos: tuple[int, int], ref: tuple[int, int]) -> list[str]:
    (r, c), (rr, rc) = pos, ref
    vertical = "above" if r < rr else "below" if r > rr else "same_row"
    horizontal = "left_of" if c < rc else "right_of" if c > rc else "same_column"
    return [vertical, horizontal]


def reference_claims(family: str, state: Mapping[str, Any], relations: list[str], lex: Lexicon) -> list[Claim]:
    """The facts a complete description of `state` states, canonical and distinct."""
    out: list[Claim] = []
    if family == GRID:
        pos = grid_positions(state)
        if "player" in pos:
            for name, p in pos.items():
                if name != "player":
                    out += [lex.canonical(name, a, "player") for a in _grid_atoms(name, p, pos["player"])]
        else:
            out = parse_relation_sentences(relations, lex)
    elif family == NAVIGATION:
        objs = nav_objects(state)
        if objs:
            out = [lex.canonical(norm_name(o["type"]), str(o["relative_direction"]), "agent") for o in objs]
        else:
            out = [c for c in parse_relation_sentences(relations, lex) if c.relation != DISTANCE]
    elif family == PRIMITIVE_SKILL:
        order = state.get("position_order") or [*(state.get("objects") or {}), *(state.get("targets") or {})]
        pos = ps_positions(state)
        out = [lex.canonical(norm_name(n), AT, "", pos[norm_name(n)]) for n in order if norm_name(n) in pos]
    seen: set[Claim] = set()
    return [c for c in out if not (c in seen or seen.add(c))]


# -- truth of one claim ----------------------------------------------------------------------------------
_GRID_TEST = {
    "above": lambda a, b: a[0] < b[0], "below": lambda a, b: a[0] > b[0], "same_row": lambda a, b: a[0] == b[0],
    "left_of": lambda a, b: a[1] < b[1], "right_of": lambda a, b: a[1] > b[1],
    "same_column": lambda a, b: a[1] == b[1],
}


def _within(claimed: tuple[float, ...], true: tuple[float, ...], tol: float) -> bool:
    return len(claimed) == len(true) and all(abs(a - b) <= tol + 1e-9 for a, b in zip(claimed, true))


class _Truth:
    """Answers whether a claim holds in one state."""

    def __init__(self, family: str, state: Mapping[str, Any], lex: Lexicon, config: JudgeConfig):
        self.family, self.lex, self.config = family, lex, config
        if family == GRID:
            self.grid = grid_positions(state)
        elif family == NAVIGATION:
            self.nav: dict[str, list[dict]] = {}
            for o in nav_objects(state):
                self.nav.setdefault(norm_name(o["type"]), []).append(o)
        else:
            self.ps = ps_positions(state)

    def holds(self, c: Claim) -> bool:
        lex = self.lex
        if self.family == GRID:
            test = _GRID_TEST.get(c.relation)
            if test is None:
                return False
            return any(self.grid[a] is not None and test(self.grid[a], self.grid[b])
                       for a in lex.members(c.subject) if a in self.grid
                       for b in lex.members(c.object) if b in self.grid and b != a)
        if self.family == NAVIGATION:
            objs = self.nav.get(c.subject, [])
            if c.relation == DISTANCE:
                tol = self.config.distance_tolerance_m
                return any(o["distance"] is not None and abs(float(o["distance"]) - c.value[0]) <= tol + 1e-9
                           for o in objs)
            return any(o["relative_direction"] == c.relation for o in objs)
        true = self.ps.get(c.subject)
        return c.relation == AT and true is not None and _within(c.value, true, self.config.coordinate_tolerance_mm)

    def covers(self, c: Claim, r: Claim) -> bool:
        """Whether claim `c` states the reference fact `r` (either orientation, generic names allowed)."""
        lex = self.lex
        if c.relation == AT or r.relation == AT:
            return (c.relation == r.relation and lex.compatible(c.subject, r.subject)
                    and _within(c.value, r.value, self.config.coordinate_tolerance_mm))
        if c.relation == r.relation and lex.compatible(c.subject, r.subject) and lex.compatible(c.object, r.object):
            return True
        return (self.family == GRID and INVERSE.get(c.relation) == r.relation
                and lex.compatible(c.subject, r.object) and lex.compatible(c.object, r.subject))


def _max_matching(claims: list[Claim], reference: list[Claim], covers) -> list[tuple[int, int]]:
    """Maximum bipartite matching (augmenting paths): pairs (claim index, reference index)."""
    adj = [[j for j, r in enumerate(reference) if covers(c, r)] for c in claims]
    owner: dict[int, int] = {}

    def augment(i: int, seen: set[int]) -> bool:
        for j in adj[i]:
            if j in seen:
                continue
            seen.add(j)
            if j not in owner or augment(owner[j], seen):
                owner[j] = i
                return True
        return False

    for i in range(len(claims)):
        augment(i, set())
    return sorted((i, j) for j, i in owner.items())


def f1_score(precision: float, recall: float) -> float:
    return 0.0 if precision + recall == 0 else 2 * precision * recall / (precision + recall)


class RuleJudge:
    """Scores grounding and world-modelling texts of any supported env family."""

    def __init__(self, config: JudgeConfig | None = None):
        self.config = config or JudgeConfig()

    name = "rule"

    def score(self, env_id: str, text: str, truth: Any, field_name: str = GROUNDING) -> RuleScore:
        """F1 of `text` against `truth`: the GetState record of turn `truth_turn(field_name, t)`
        (a dict with 'state' and 'relations', a GroundTruth, or a bare state map)."""
        return self.score_claims(env_id, lambda lex: parse_claims(text or "", lex), truth, field_name)

    def score_claims(self, env_id: str, claims_of, truth: Any, field_name: str = GROUNDING) -> RuleScore:
        """F1 of the claims `claims_of(lexicon)` returns (parsed from text, or built from an LLM's
        structured reading of it) against `truth`."""
        if field_name not in FIELDS:
            raise ValueError(f"field must be one of {FIELDS}, got {field_name!r}")
        state, relations = _truth_parts(truth)
        family = env_family(env_id, state)
        lex = build_lexicon(family, state)
        reference = reference_claims(family, state, relations, lex)
        claims = list(claims_of(lex))
        truth_of = _Truth(family, state, lex, self.config)
        correct = [c for c in claims if truth_of.holds(c)]
        pairs = _max_matching(claims, reference, truth_of.covers)
        if not claims and not reference:
            precision = recall = 1.0
        else:
            precision = len(correct) / len(claims) if claims else 0.0
            recall = len(pairs) / len(reference) if reference else 1.0
        f1 = f1_score(precision, recall)
        matched = [(claims[i], reference[j]) for i, j in pairs]
        verdict = f1 >= self.config.f1_threshold
        return RuleScore(precision, recall, f1, verdict, claims, correct, reference, matched,
                         _explain(field_name, claims, correct, reference, matched, precision, recall, f1,
                                  verdict, self.config.f1_threshold))


    # -- the Judge protocol (base.py): the service's embedded default judge --
    def supports(self, env_id: str, state: Mapping[str, Any] | None = None) -> bool:
        try:
            env_family(env_id, state)
        except ValueError:
            return False
        return True

    async def judge(self, item: "JudgeInput") -> "Judgment":
        try:
            r = self.score(item.env_id, item.text, item.truth, item.field)
        except ValueError as e:
            raise JudgeError("INVALID_ARGUMENT", str(e)) from None
        return Judgment(score=r.f1, verdict=r.verdict, reasoning=r.reasoning, judge=self.name,
                        precision=r.precision, recall=r.recall, f1=r.f1,
                        details={"claims": [str(c) for c in r.claims],
                                 "wrong": [str(c) for c in r.claims if c not in r.correct],
                                 "reference": [str(c) for c in r.reference]})

    async def aclose(self) -> None:
        return None


def _explain(field_name, claims, correct, reference, matched, p, r, f1, verdict, threshold) -> str:
    wrong = [c for c in claims if c not in correct]
    missed = [ref for ref in reference if ref not in {m[1] for m in matched}]
    lines = [f"{field_name}: {len(correct)}/{len(claims)} claims true (precision {p:.3f}), "
             f"{len(matched)}/{len(reference)} true relations stated (recall {r:.3f}), F1 {f1:.3f} "
             f"{'>=' if verdict else '<'} {threshold:g}: {'pass' if verdict else 'fail'}."]
    if wrong:
        lines.append("Wrong: " + "; ".join(map(str, wrong)) + ".")
    if missed:
        lines.append("Not stated: " + "; ".join(map(str, missed)) + ".")
    if not claims:
        lines.append("No relation claim found in the text.")
    return " ".join(lines)
