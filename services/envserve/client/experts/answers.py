"""Expert answers written in a session's action format, from the true state, so that SFT on them
teaches the formats as well as the task.

The tag rules are the server's (core/formats.py), restated here because the client must not import
the server: `<think>` holds the format's fields in order, `<answer>` follows `</think>`; RLVMR's
format takes exactly one meta-reasoning tag, then `<action>`.
"""
from __future__ import annotations

from typing import Callable, Mapping, Sequence

from .base import CONTINUE, EXPLORE, PLAN, REFLECT, Move, Truth, relation_text

# The fields inside <think> of each think/answer format, in the order the format requires them.
THINK_FIELDS: dict[str, tuple[str, ...] | None] = {
    "no_think": None,
    "free_think": (),
    "grounding": ("observation", "reasoning"),
    "worldmodeling": ("reasoning", "prediction"),
    "grounding_worldmodeling": ("observation", "reasoning", "prediction"),
}
META_REASONING = "meta_reasoning"
FORMATS = (*THINK_FIELDS, META_REASONING)
# RLVMR's tags by how a move relates to the plan.
META_TAG_OF_KIND = {PLAN: "planning", CONTINUE: "monitor", EXPLORE: "explore", REFLECT: "reflection"}


def needs_observation(action_format: str) -> bool:
    return "observation" in (THINK_FIELDS.get(_known(action_format)) or ())


def needs_prediction(action_format: str) -> bool:
    return "prediction" in (THINK_FIELDS.get(_known(action_format)) or ())


def _known(action_format: str) -> str:
    if action_format not in FORMATS:
        raise ValueError(f"unknown action format {action_format!r}; known: {list(FORMATS)}")
    return action_format


def join_actions(actions: Sequence[str], separator: str) -> str:
    if not actions:
        raise ValueError("an answer needs at least one action")
    return f"{separator} ".join(a.strip() for a in actions)


def _clean(text: str) -> str:
    # A field's text must not open or close a tag: the format counts tags in the whole answer.
    return " ".join(text.replace("<", "(").replace(">", ")").split())


def meta_tag(move: Move, first_turn: bool) -> str:
    """RLVMR's tag of a move: <planning> on the first turn, then by the move's kind."""
    return "planning" if first_turn else META_TAG_OF_KIND[move.kind]


def answer_text(action_format: str, actions: Sequence[str], truth_now: Truth | None = None,
                truth_next: Truth | None = None, *, reasoning: str = "", tag: str = "monitor",
                separator: str = ",", describe: Callable[[Truth], str] | None = None) -> str:
    """The full answer to send: `actions` joined with the session's separator, in `action_format`.

    grounding formats put describe(truth_now) in <observation> (the state the agent acts in, turn t);
    world-modelling formats put describe(truth_next) in <prediction> (the state after the actions,
    t+1); describe defaults to the relation sentences, which the judges compare against. `tag` is the
    meta-reasoning tag of RLVMR's format (meta_tag() picks it from a Move)."""
    fields = THINK_FIELDS.get(_known(action_format))
    acts = join_actions(actions, separator)
    describe = describe or (lambda t: relation_text(t.relations) or t.observation)
    if action_format == META_REASONING:
        if tag not in META_TAG_OF_KIND.values():
            raise ValueError(f"meta-reasoning tag must be one of {sorted(META_TAG_OF_KIND.values())}, got {tag!r}")
        return f"<{tag}>{_clean(reasoning) or '-'}</{tag}><action>{acts}</action>"
    if fields is None:
        return f"<answer>{acts}</answer>"
    parts = []
    for name in fields:
        if name == "observation":
            if truth_now is None:
                raise ValueError(f"{action_format} needs the true state of this turn (truth_now)")
            text = describe(truth_now)
        elif name == "prediction":
            if truth_next is None:
                raise ValueError(f"{action_format} needs the true state after the actions (truth_next)")
            text = describe(truth_next)
        else:
            text = reasoning
        parts.append(f"<{name}>{_clean(text) or '-'}</{name}>")
    think = "".join(parts) if fields else _clean(reasoning) or "-"
    return f"<think>{think}</think><answer>{acts}</answer>"


def plain_answer(action_format: str, actions: Sequence[str], separator: str = ",") -> str:
    """A minimal valid answer carrying only the actions (a fork stepped to see where they lead)."""
    return fields_answer(action_format, actions, {}, separator)


def fields_answer(action_format: str, actions: Sequence[str], texts: Mapping[str, str],
                  separator: str = ",") -> str:
    """A valid answer carrying the actions and, in the format's fields, the given texts (`texts`
    maps a field name, e.g. "observation" or "prediction", to its text); a field without a text, or
    with an empty one, holds the placeholder `-`. Texts for fields the format lacks are ignored."""
    fields = THINK_FIELDS.get(_known(action_format))
    acts = join_actions(actions, separator)
    if action_format == META_REASONING:
        return f"<monitor>-</monitor><action>{acts}</action>"
    if fields is None:
        return f"<answer>{acts}</answer>"
    inner = "".join(f"<{name}>{_clean(texts.get(name) or '') or '-'}</{name}>" for name in fields) if fields else "-"
    return f"<think>{inner}</think><answer>{acts}</answer>"
