"""Relation claims in free agent text, parsed into one canonical form per fact.

A claim is an atom (subject, relation, object[, value]). Three families of environments share the
grammar below; the names an agent may use come from the ground-truth state (a `Lexicon`), so the
parser knows that "box 1" is `box1` in a room with two boxes, that "office chair" is the
navigation type `OfficeChair`, or that "the red cube" is PrimitiveSkill's `cubeA`.

grid (Sokoban, FrozenLake): two axes, each relation a pair of atoms at most
    vertical:   above | below | same_row          horizontal: left_of | right_of | same_column
    "box0 is above and on the left side of the player"  -> box0 above player, box0 left_of player
    "the player is below box0"                          -> box0 above player   (the inverse)
    "box0 is to the upper-left of me"                   -> the same two atoms as the first line
    "the box is on the target" / "at the same place as" -> same_row and same_column
    Canonical: the reference entity (player) is the object; otherwise the names are ordered
    alphabetically and an asymmetric relation is inverted when the sides swap.
navigation: directions relative to the agent, optionally a distance
    "the chair is on my left", "the Ball (target) is behind me, 3.3 m away"
        -> officechair left agent; ball back agent, ball distance agent (3.3)
primitive_skill: positions in mm
    "cubeA is at (-79, -105, 20)", "the red cube: [-80, -104, 21]", "goalA x=100, y=100, z=0"
        -> cubea at (-79, -105, 20) ...

Claims whose object is unknown are kept under the name "?word" (a hallucinated object: the judge
counts it wrong). Negated clauses ("the box is not above the player") and action phrases
("after moving left", "push the box up") assert no relation and are skipped.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from envserve.common.naming import indexed_names

GRID, NAVIGATION, PRIMITIVE_SKILL = "grid", "navigation", "primitive_skill"
FAMILIES = (GRID, NAVIGATION, PRIMITIVE_SKILL)

# grid relations and their inverses (symmetric ones map to themselves)
INVERSE = {"above": "below", "below": "above", "left_of": "right_of", "right_of": "left_of",
           "same_row": "same_row", "same_column": "same_column"}
GRID_RELATIONS = tuple(INVERSE)
NAV_DIRECTIONS = ("ahead", "left", "right", "back")
DISTANCE, AT = "distance", "at"


@dataclass(frozen=True, order=True)
class Claim:
    subject: str
    relation: str
    object: str = ""
    value: tuple[float, ...] = ()

    def __str__(self) -> str:
        if self.relation == AT:
            return f"{self.subject} at ({', '.join(_num(v) for v in self.value)})"
        if self.relation == DISTANCE:
            return f"{self.subject} {_num(self.value[0])} m from {self.object}"
        return f"{self.subject} {self.relation} {self.object}"


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else f"{v:g}"


# -- names -----------------------------------------------------------------------------------------
def norm_name(name: str) -> str:
    """'OfficeChair', 'office chair', 'office_chair' -> 'officechair'."""
    return re.sub(r"[^a-z0-9]", "", name.lower())


def _words(name: str) -> list[str]:
    """'OfficeChair' -> ['office', 'chair'], 'red_cube' -> ['red', 'cube'], 'cubeA' -> ['cube', 'a']."""
    spaced = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", " ", name)
    return [w for w in re.split(r"[\s_\-]+", spaced.lower()) if w]


def _plural(word: str) -> str:
    return word + ("es" if word.endswith(("s", "x", "sh", "ch")) else "s")


@dataclass
class Lexicon:
    """The names of one ground-truth state: instances, kinds, aliases and the reference entity."""
    family: str
    reference: str                                   # 'player' or 'agent' ('' for primitive_skill)
    instances: dict[str, str] = field(default_factory=dict)   # instance name -> kind
    # (regex of a surface form, canonical name, indexable kind or '')
    surfaces: list[tuple[str, str, str]] = field(default_factory=list)
    ignored: tuple[str, ...] = ()                    # words naming things that hold no relation

    def kind_of(self, name: str) -> str:
        if name in self.instances:
            return self.instances[name]
        return name if name in set(self.instances.values()) else ""

    def is_generic(self, name: str) -> bool:
        """A kind named without an index where the state has several of it ('box' among box0, box1)."""
        return name not in self.instances and name in set(self.instances.values())

    def members(self, name: str) -> list[str]:
        """The instances a name can denote: itself, or every instance of a generic kind."""
        if name in self.instances:
            return [name]
        return [n for n, k in self.instances.items() if k == name]

    def compatible(self, claimed: str, true: str) -> bool:
        return claimed == true or (self.is_generic(claimed) and self.instances.get(true) == claimed)

    def canonical(self, subject: str, relation: str, obj: str, value: tuple = ()) -> Claim:
        """Grid atoms: reference as the object, else alphabetical, inverting when the sides swap."""
        if self.family == GRID and relation in INVERSE:
            if _order_key(subject, self.reference) > _order_key(obj, self.reference):
                subject, obj, relation = obj, subject, INVERSE[relation]
        return Claim(subject, relation, obj, tuple(float(v) for v in value))


def _order_key(name: str, reference: str) -> tuple[int, str]:
    return (1 if name == reference else 0, name)


_INDEX_TAIL = (r"(?:\s*(?:#|no\.?|number|_|-)?\s*(?P<idx>\d+)"
               r"(?!\s*(?:rows?|columns?|cols?|cells?|steps?|spaces?|squares?|tiles?|moves?|m\b|mm\b|"
               r"meters?|metres?|\.\d|,\s*\d)))?")


def _surface_regex(words: list[str], plural: bool) -> str:
    if not words:
        return ""
    head = r"[\s_\-]*".join(re.escape(w) for w in words[:-1])
    last = re.escape(words[-1])
    if plural:
        last = f"(?:{last}|{re.escape(_plural(words[-1]))})"
    return (head + r"[\s_\-]*" if head else "") + last


def build_lexicon(family: str, state: Mapping[str, Any]) -> Lexicon:
    """The names an agent may use for the objects of `state` (a GetState state map)."""
    if family == GRID:
        return _grid_lexicon(state)
    if family == NAVIGATION:
        return _nav_lexicon(state)
    if family == PRIMITIVE_SKILL:
        return _ps_lexicon(state)
    raise ValueError(f"unknown env family {family!r}; known: {FAMILIES}")


PLAYER_WORDS = ("player", "agent", "character", "avatar", "myself", "me", "i", "you")
NAV_AGENT_WORDS = ("agent", "robot", "camera", "player", "myself", "me", "i", "you")
# grid state keys holding one (row, col) or a list of them, and the kind they name
GRID_SINGLE_KEYS = {"player": "player", "goal": "goal"}
GRID_LIST_KEYS = {"boxes": "box", "targets": "target", "holes": "hole"}


def indexed(kind: str, count: int) -> list[str]:
    """The env's own naming (envserve.common.naming): 'box' or 'box0', 'box1', ..."""
    return indexed_names(kind, count)


def grid_positions(state: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
    """Every named entity of a grid state with its (row, col)."""
    pos: dict[str, tuple[int, int]] = {}
    for key, kind in GRID_SINGLE_KEYS.items():
        if isinstance(state.get(key), (list, tuple)) and len(state[key]) == 2:
            pos[kind] = (int(state[key][0]), int(state[key][1]))
    for key, kind in GRID_LIST_KEYS.items():
        cells = state.get(key) or []
        for name, rc in zip(indexed(kind, len(cells)), cells):
            pos[name] = (int(rc[0]), int(rc[1]))
    return pos


def _grid_lexicon(state: Mapping[str, Any]) -> Lexicon:
    lex = Lexicon(GRID, "player", ignored=("wall", "walls", "floor", "ice", "frozen", "empty", "cell", "cells",
                                           "tile", "tiles", "square", "squares", "row", "column", "edge",
                                           "corner", "border", "grid", "map", "board", "room", "path", "way"))
    positions = grid_positions(state)
    for name in positions:
        kind = re.sub(r"\d+$", "", name)
        lex.instances[name] = kind
    kinds = set(lex.instances.values())
    lex.surfaces.append(("|".join(PLAYER_WORDS), "player", ""))
    aliases = {k: [k] for k in kinds - {"player"}}
    # FrozenLake has a goal and no targets: VAGEN calls it the target; Sokoban's targets are goals too.
    if "goal" in kinds and "target" not in kinds:
        aliases["goal"] += ["target", "destination", "gift", "present"]
    if "target" in kinds and "goal" not in kinds:
        aliases["target"] += ["goal", "storage location", "storage spot", "dock"]
    for kind, words in aliases.items():
        for w in words:
            lex.surfaces.append((_surface_regex(w.split(), plural=True), kind, kind))
    return lex


def nav_objects(state: Mapping[str, Any]) -> list[dict]:
    """Target and visible objects as (type, direction, distance) records; the target first."""
    out = []
    if state.get("target_obj_type"):
        out.append({"type": str(state["target_obj_type"]), "relative_direction": state.get("target_relative_direction"),
                    "distance": state.get("distance_to_target", state.get("target_obj_distance")), "target": True})
    for v in state.get("visible_objects") or []:
        out.append({"type": str(v["type"]), "relative_direction": v.get("relative_direction"),
                    "distance": v.get("distance"), "target": False})
    return out


def _nav_lexicon(state: Mapping[str, Any]) -> Lexicon:
    lex = Lexicon(NAVIGATION, "agent", ignored=("wall", "walls", "floor", "ceiling", "room", "door", "view",
                                                "scene", "image", "way", "path", "direction", "distance"))
    objects = nav_objects(state)
    types = {norm_name(o["type"]): o["type"] for o in objects}
    for key in types:
        lex.instances[key] = key
    lex.surfaces.append(("|".join(NAV_AGENT_WORDS), "agent", ""))
    last_words: dict[str, list[str]] = {}
    for key, raw in types.items():
        words = _words(raw)
        lex.surfaces.append((_surface_regex(words, plural=True), key, ""))
        if len(words) > 1:
            last_words.setdefault(words[-1], []).append(key)
    for word, keys in last_words.items():  # 'chair' for OfficeChair, unless two types end in it
        if len(keys) == 1 and word not in types:
            lex.surfaces.append((_surface_regex([word], plural=True), keys[0], ""))
    target = state.get("target_obj_type")
    if target:
        lex.surfaces.append((r"target(?:\s+object)?|goal(?:\s+object)?", norm_name(str(target)), ""))
    return lex


def ps_positions(state: Mapping[str, Any]) -> dict[str, tuple[float, float, float]]:
    """Object, target and gripper positions (mm) of a PrimitiveSkill state, by normalized name."""
    pos: dict[str, tuple[float, float, float]] = {}
    for group in ("objects", "targets"):
        for name, p in (state.get(group) or {}).items():
            pos[norm_name(name)] = tuple(float(v) for v in p)
    grip = (state.get("gripper") or {}).get("position")
    if grip:
        pos["gripper"] = tuple(float(v) for v in grip)
    return pos


def _ps_lexicon(state: Mapping[str, Any]) -> Lexicon:
    lex = Lexicon(PRIMITIVE_SKILL, "", ignored=("workspace", "limit", "table"))
    names = [*(state.get("objects") or {}), *(state.get("targets") or {})]
    for name in names:
        key = norm_name(name)
        lex.instances[key] = key
        lex.surfaces.append((_surface_regex(_words(name), plural=False), key, ""))
    if (state.get("gripper") or {}).get("position"):
        lex.instances["gripper"] = "gripper"
        lex.surfaces.append((r"gripper|end[\s_\-]*effector|tcp|robot\s+hand", "gripper", ""))
    # "cubeA (the red cube)" in the instruction: the colour name is an alias of the object.
    for name, desc in re.findall(r"\b(\w+)\s*\(\s*the\s+([a-z][a-z ]*?)\s*\)", str(state.get("instruction", ""))):
        if norm_name(name) in lex.instances:
            lex.surfaces.append((_surface_regex(desc.split(), plural=False), norm_name(name), ""))
    return lex


# -- mentions ----------------------------------------------------------------------------------------
@dataclass
class _Mention:
    start: int
    end: int
    name: str


def find_mentions(text: str, lex: Lexicon) -> list[_Mention]:
    """Entity mentions in lowercased `text`, longest first where they overlap."""
    found: list[_Mention] = []
    for surface, name, kind in lex.surfaces:
        tail = _INDEX_TAIL if kind else ""
        for m in re.finditer(rf"(?<![a-z0-9_])(?:{surface}){tail}(?![a-z0-9_])", text):
            resolved = name
            idx = m.groupdict().get("idx") if kind else None
            if kind:
                members = lex.members(kind)
                if idx is not None:
                    # 'box 0' names box0; with one box (named 'box') any index means that box.
                    resolved = members[0] if len(members) == 1 and members[0] == kind else f"{kind}{int(idx)}"
                elif len(members) == 1:
                    resolved = members[0]
            found.append(_Mention(m.start(), m.end(), resolved))
    found.sort(key=lambda x: (x.start, -(x.end - x.start)))
    out: list[_Mention] = []
    for m in found:
        if out and m.start < out[-1].end:
            continue
        out.append(m)
    return out


# -- relation phrases ---------------------------------------------------------------------------------
_ART = r"(?:the\s+|a\s+|an\s+)?"
_SIDE = r"(?:[\s\-]+(?:hand\s+)?side)?"
_POSS = r"(?:my|its|his|her|their|your|the\s+agent'?s|the\s+player'?s)"


def _dir_phrases(word: str, compass: str) -> list[str]:
    return [rf"(?:to|on|at)\s+the\s+{word}{_SIDE}(?:\s+of)?", rf"(?:to|on|at)\s+{_POSS}\s+{word}{_SIDE}",
            rf"{word}{_SIDE}\s+of", rf"{compass}\s+of", rf"to\s+the\s+{compass}(?:\s+of)?", rf"\b{word}\b"]


_DIAG = {("upper", "left"): ("above", "left_of"), ("upper", "right"): ("above", "right_of"),
         ("lower", "left"): ("below", "left_of"), ("lower", "right"): ("below", "right_of")}
_VWORDS = {"upper": r"(?:upper|top|up)", "lower": r"(?:lower|bottom|down)"}
_COMPASS = {("upper", "left"): "north[\\s\\-]?west", ("upper", "right"): "north[\\s\\-]?east",
            ("lower", "left"): "south[\\s\\-]?west", ("lower", "right"): "south[\\s\\-]?east"}


# 'right next to', 'right here': 'right' as an intensifier states no direction.
_NEUTRAL = (r"right\s+(?:next|beside|by|here|there|now|away|after|before|where)\b|all\s+right|"
            r"right(?=\s+(?:in\s+front|behind|above|below|under|beneath|on\s+top|at\s+the\s+same))|"
            r"(?:the\s+)?(?:left|right)\s+(?:action|move|arrow|key|button|turn)s?\b", (), False)


def _grid_phrase_table() -> list[tuple[str, tuple[str, ...], bool]]:
    """(regex, atoms, needs an object right after) in priority order: longer and specific first."""
    t: list[tuple[str, tuple[str, ...], bool]] = [_NEUTRAL]
    place = r"(?:place|position|cell|square|spot|location|tile|coordinates?)"
    t.append((rf"(?:at|in|on|occup(?:y|ies))\s+the\s+same\s+{place}(?:\s+as)?|same\s+{place}(?:\s+as)?|"
              r"overlap(?:s|ping)?(?:\s+with)?|coincides?\s+with", ("same_row", "same_column"), False))
    t.append((r"(?:(?:in|on|at)\s+)?the\s+same\s+(?:row|horizontal\s+line|level|height)(?:\s+as)?|"
              rf"same\s+row(?:\s+as)?|(?:in|on|at)\s+{_POSS}\s+row|horizontally\s+aligned(?:\s+with)?|aligned\s+horizontally(?:\s+with)?",
              ("same_row",), False))
    t.append((r"(?:(?:in|on|at)\s+)?the\s+same\s+(?:column|vertical\s+line)(?:\s+as)?|same\s+column(?:\s+as)?|"
              rf"(?:in|on|at)\s+{_POSS}\s+column|vertically\s+aligned(?:\s+with)?|aligned\s+vertically(?:\s+with)?", ("same_column",), False))
    for (v, h), atoms in _DIAG.items():
        diag = rf"{_VWORDS[v]}[\s\-]*{h}"
        t.append((rf"(?:(?:to|on|at|in)\s+(?:the|{_POSS})\s+)?{diag}(?:\s+(?:side|corner|direction))?(?:\s+of)?"
                  rf"|{_COMPASS[(v, h)]}(?:\s+of)?", atoms, False))
    t.append((r"(?:directly|right|just|straight|immediately)\s+above|above|north\s+of|higher\s+than|"
              r"up\s+from|to\s+the\s+north(?:\s+of)?", ("above",), False))
    t.append((r"(?:directly|right|just|straight|immediately)\s+(?:below|beneath|under)|below|beneath|underneath|"
              r"under|south\s+of|lower\s+than|down\s+from|to\s+the\s+south(?:\s+of)?", ("below",), False))
    t += [(p, ("left_of",), False) for p in _dir_phrases("left", "west")]
    t += [(p, ("right_of",), False) for p in _dir_phrases("right", "east")]
    # "the player is on the goal", "the box is on target0", "I am in a hole": same cell, only when an
    # object follows at once (so 'is on the left' is not read as this).
    t.append((r"(?:is|are|am|be|'s|'m|stands?|standing|sits?|sitting|lies|lying)\s+(?:on\s+top\s+of|on|in|at)"
              r"(?!\s+(?:the\s+)?(?:same|left|right|upper|lower|top|bottom|north|south|east|west|middle|cent)"
              r"|\s+(?:my|its|his|her|their|your)\b)",  # 'is in my row' is a row, not a cell
              ("same_row", "same_column"), True))
    return t


def _nav_phrase_table() -> list[tuple[str, tuple[str, ...], bool]]:
    t: list[tuple[str, tuple[str, ...], bool]] = [_NEUTRAL]
    t.append((rf"(?:straight|directly|right)\s+ahead(?:\s+of)?|ahead(?:\s+of)?|in\s+front(?:\s+of)?|"
              rf"(?:straight\s+)?forward|(?:at|in)\s+the\s+front|in\s+{_POSS}\s+(?:view|sight)", ("ahead",), False))
    t.append((rf"(?:directly\s+|right\s+)?behind|(?:at|in|to)\s+(?:the|{_POSS})\s+(?:back|rear)(?:\s+of)?|"
              r"back\s+of|\bback\b|backwards?|rear", ("back",), False))
    t += [(p, ("left",), False) for p in _dir_phrases("left", "west")[:3] + [r"\bleft\b"]]
    t += [(p, ("right",), False) for p in _dir_phrases("right", "east")[:3] + [r"\bright\b"]]
    return t


_TABLES = {GRID: _grid_phrase_table(), NAVIGATION: _nav_phrase_table()}
_COMPILED = {fam: (re.compile("|".join(f"(?P<p{i}>{p})" for i, (p, _, _) in enumerate(table))), table)
             for fam, table in _TABLES.items()}


@dataclass
class _Phrase:
    start: int
    end: int
    atoms: tuple[str, ...]
    needs_object: bool


def _find_phrases(text: str, family: str) -> list[_Phrase]:
    regex, table = _COMPILED[family]
    out = []
    for m in regex.finditer(text):
        i = int(m.lastgroup[1:])
        out.append(_Phrase(m.start(), m.end(), table[i][1], table[i][2]))
    return out


# -- clauses ------------------------------------------------------------------------------------------
_ACTION = re.compile(
    r"\b(?:move[sd]?|moving|go(?:es|ing)?|went|push(?:es|ed|ing)?|step(?:s|ped|ping)?|walk(?:s|ed|ing)?|"
    r"turn(?:s|ed|ing)?|rotat(?:e|es|ed|ing)|head(?:s|ed|ing)?|look(?:s|ed|ing)?)\s+(?:(?:the|a)\s+\w+\s+)?"
    r"(?:up|down|left|right|ahead|forward|back|backwards?)\b")
_NEGATION = re.compile(r"\bnot\b|n't\b|\bno\s+longer\b|\bnever\b|\bisnt\b|\barent\b")
_SENTENCE = re.compile(r"(?<!\d)\.(?!\d)|[;!?\n]+|\.(?=\s)")
_SPLIT = re.compile(r"\s*,\s*(?:and|but|while|whereas)?\s*|\s+(?:and|but|while|whereas)\s+")
_VERB = r"(?:is|are|am|was|were|'s|'m|sits?|lies|stands?|appears?|seems?|will\s+be|would\s+be|should\s+be|remains?|stays?)"
_UNKNOWN_SUBJECT = re.compile(rf"\b(?:the|a|an)\s+(?:[a-z]+\s+){{0,2}}?([a-z]+)\s+{_VERB}\b")
_NOT_OBJECTS = {"it", "this", "that", "there", "which", "what", "state", "position", "positions", "observation",
                "image", "scene", "answer", "action", "next", "current", "only", "one", "other", "same",
                "distance", "result", "situation", "layout", "view", "agent", "player", "target", "goal"}
_DISTANCE = re.compile(r"(\d+(?:\.\d+)?)\s*(?:m|meters?|metres?)\b")


_RELATIVE = re.compile(r"\s*,?\s*\b(?:which|that|who)\s+(?=(?:is|are|lies|sits|stands|will\s+be|would\s+be)\b)")


def _clauses(text: str, family: str, lex: Lexicon) -> list[tuple[str, str]]:
    """(clause, subject inherited from a relative pronoun or ''): sentences, cut where a new subject
    starts after a relation was stated, and at 'which is' / 'that is' (whose subject is the last
    object named before it)."""
    out: list[tuple[str, str]] = []
    for sentence in _SENTENCE.split(text):
        if not sentence.strip():
            continue
        pieces: list[tuple[str, str]] = []
        pos, inherited = 0, ""
        for m in _RELATIVE.finditer(sentence):
            head = sentence[pos:m.start()]
            pieces.append((head, inherited))
            named = find_mentions(head, lex)
            inherited = named[-1].name if named else ""
            pos = m.end()
        pieces.append((sentence[pos:], inherited))
        for piece, inherited in pieces:
            out += _cut(piece, family, lex, inherited)
    return [(c.strip(), i) for c, i in out if c.strip()]


def _cut(sentence: str, family: str, lex: Lexicon, inherited: str) -> list[tuple[str, str]]:
    start = 0
    cuts = []
    seps = list(_SPLIT.finditer(sentence))
    for n, m in enumerate(seps):
        # the text up to this separator (since the last cut) and the piece up to the next one
        before = sentence[start:m.start()]
        after = sentence[m.end():seps[n + 1].start() if n + 1 < len(seps) else len(sentence)]
        if not _find_phrases(before, family):
            continue
        rel = _find_phrases(after, family)
        ment = find_mentions(after, lex)
        first_rel = rel[0].start if rel else len(after)
        if (ment and ment[0].start < first_rel) or _UNKNOWN_SUBJECT.match(after):
            cuts.append((m.start(), m.end()))
            start = m.end()
    out, pos = [], 0
    for a, b in cuts:
        out.append((sentence[pos:a], inherited))
        inherited, pos = "", b
    out.append((sentence[pos:], inherited))
    return out


def _clause_claims(clause: str, lex: Lexicon, inherited: str = "") -> list[Claim]:
    family = lex.family
    if _NEGATION.search(clause):
        return []
    phrases = _find_phrases(clause, family)
    if not phrases:
        return []
    mentions = [m for m in find_mentions(clause, lex)
                if not any(p.start <= m.start < p.end and not p.needs_object for p in phrases)]
    first = phrases[0].start
    subjects = [m.name for m in mentions if m.end <= first] or ([inherited] if inherited else [])
    if not subjects:
        hit = _UNKNOWN_SUBJECT.search(clause[:first] + " ")
        word = hit.group(1) if hit else ""
        if not word or word in _NOT_OBJECTS or word in lex.ignored or word.rstrip("s") in lex.ignored:
            return []
        subjects = [f"?{word}"]
    later = [m for m in mentions if m.start >= phrases[0].end and m.name not in subjects]
    obj = later[0].name if later else ""
    # Each phrase binds to the first name after it, so "the box is on the target, above me" says
    # box-on-target and box-above-player; a phrase with no name after it keeps the object before it
    # ("directly below the box, in the same column"), or else reads the reference entity.
    bound: list[tuple[str, str]] = []  # (atom, object)
    last_obj = ""
    for p in phrases:
        nxt = [m for m in mentions if m.start >= p.end and m.name not in subjects]
        if p.needs_object:  # 'is on' only counts when an object name follows right away
            gap = re.match(r"\s*(?:the\s+|a\s+|an\s+)?", clause[p.end:])
            if not any(m.start == p.end + gap.end() for m in mentions):
                continue
        p_obj = last_obj = nxt[0].name if nxt else last_obj
        bound += [(a, p_obj) for a in p.atoms if (a, p_obj) not in bound]
    if not bound:
        return []
    claims: list[Claim] = []
    if family == NAVIGATION:
        if obj and obj != "agent":
            return []  # a relation between two objects: VAGEN's navigation truth has none
        atoms = list(dict.fromkeys(a for a, _ in bound))
        distances = [float(d) for d in _DISTANCE.findall(clause)]
        for s in subjects:
            if s == "agent":
                continue
            claims += [lex.canonical(s, a, "agent") for a in atoms]
            if distances:
                claims.append(lex.canonical(s, DISTANCE, "agent", (distances[0],)))
        return claims
    for atom, o in bound:
        if not o and len(subjects) >= 2 and atom in ("same_row", "same_column"):
            # "the player and the box are in the same row": every pair of subjects
            claims += [lex.canonical(s, atom, t) for i, s in enumerate(subjects) for t in subjects[i + 1:]]
            continue
        o = o or lex.reference
        claims += [lex.canonical(s, atom, o) for s in subjects if s != o]
    return list(dict.fromkeys(claims))


_TUPLE = re.compile(r"[\(\[]\s*(-?\d+(?:\.\d+)?)\s*(?:mm)?\s*,\s*(-?\d+(?:\.\d+)?)\s*(?:mm)?\s*,\s*"
                    r"(-?\d+(?:\.\d+)?)\s*(?:mm)?\s*[\)\]]"
                    r"|\bx\s*[=:]\s*(-?\d+(?:\.\d+)?)\s*(?:mm)?\s*,?\s*y\s*[=:]\s*(-?\d+(?:\.\d+)?)\s*(?:mm)?\s*,?\s*"
                    r"z\s*[=:]\s*(-?\d+(?:\.\d+)?)")
_FILLER = {"object", "objects", "is", "are", "at", "located", "position", "positions", "of", "the", "currently", "now", "will", "be",
           "coordinates", "coordinate", "xyz", "in", "sits", "lies", "mm", "its", "new", "and", "to", "moved",
           "placed", "should", "would"}


def _ps_claims(text: str, lex: Lexicon) -> list[Claim]:
    claims = []
    mentions = find_mentions(text, lex)
    prev_end = 0
    for m in _TUPLE.finditer(text):
        values = [v for v in m.groups() if v is not None]
        region = (prev_end, m.start())
        prev_end = m.end()
        if _NEGATION.search(text[region[0]:region[1]]):
            continue
        named = [x for x in mentions if region[0] <= x.start and x.end <= region[1]]
        if named:
            name = named[-1].name
        else:
            words = [w for w in re.findall(r"[a-z][a-z0-9_]*", text[region[0]:region[1]]) if w not in _FILLER]
            if not words or words[-1] in lex.ignored:
                continue
            name = f"?{words[-1]}"
        claims.append(lex.canonical(name, AT, "", tuple(float(v) for v in values)))
    return claims


def parse_claims(text: str, lex: Lexicon) -> list[Claim]:
    """The distinct canonical claims `text` asserts, in the order they first appear."""
    if not text:
        return []
    low = text.lower().replace("\u2019", "'")
    low = _ACTION.sub(" , ", low)
    if lex.family == PRIMITIVE_SKILL:
        claims = _ps_claims(low, lex)
    else:
        claims = [c for clause, inherited in _clauses(low, lex.family, lex)
                  for c in _clause_claims(clause, lex, inherited)]
    seen: set[Claim] = set()
    out = []
    for c in claims:
        if c not in seen:
            seen.add(c)
            out.append(c)
    return out


def parse_relation_sentences(sentences: Iterable[str], lex: Lexicon) -> list[Claim]:
    """The env's own relation sentences (GetState's `relations`) in the same canonical form."""
    return parse_claims(". ".join(sentences), lex)
