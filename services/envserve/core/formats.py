"""Action formats: how a model's raw text becomes actions and reasoning fields.

A format never raises on model text: anything it cannot parse is a ParsedTurn with
valid=False and feedback that tells the agent what was expected.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable

META_TAGS = ("planning", "explore", "reflection", "monitor")
# From the first "{" to the last "}": a JSON object an answer holds, with text around it.
_JSON_OBJECT = re.compile(r"\{.*\}", re.DOTALL)


def json_object_in(text: str) -> "dict[str, Any] | None":
    """The JSON object an action's text holds (envs whose actions are structured: tool calls,
    typed Action models), or None where it holds none."""
    match = _JSON_OBJECT.search(text)
    if not match:
        return None
    try:
        data = json.loads(match.group(0))
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


@dataclass
class ParsedTurn:
    valid: bool
    actions: list[str] = field(default_factory=list)
    fields: dict[str, str] = field(default_factory=dict)
    feedback: str = ""


@dataclass(frozen=True)
class ActionFormat:
    name: str
    description: str
    # Instruction appended to the system prompt, telling the model how to answer; "{sep}"
    # stands for the session's action separator.
    instruction: str
    parse_fn: Callable[[str, str], ParsedTurn]

    def parse(self, text: str, separator: str = ",") -> ParsedTurn:
        return self.parse_fn(text, separator)

    def instruction_for(self, separator: str, max_actions: int) -> str:
        if max_actions == 1:
            return self.instruction.replace("action1{sep} action2", "action")
        text = self.instruction.replace("{sep}", separator)
        if max_actions > 1:
            text += f" You may give up to {max_actions} actions, separated by '{separator}'."
        return text


def _tag_re(tag: str) -> re.Pattern:
    return re.compile(rf"<{tag}>(.*?)</{tag}>", re.DOTALL | re.IGNORECASE)


_TAG_RES = {t: _tag_re(t) for t in ("think", "answer", "observation", "reasoning", "prediction",
                                     "action", "remark", *META_TAGS)}
_ANY_TAG = re.compile(r"</?\s*([a-zA-Z_]+)\s*>")


def _only(text: str, tag: str, lowered: str | None = None) -> tuple[str | None, str]:
    """The content of exactly one <tag>..</tag>, or (None, reason)."""
    low = text.lower() if lowered is None else lowered
    opens = low.count(f"<{tag}>")
    closes = low.count(f"</{tag}>")
    if opens == 0 and closes == 0:
        return None, f"missing <{tag}>...</{tag}>"
    if opens != 1 or closes != 1:
        return None, f"expected exactly one <{tag}>...</{tag}>, found {opens} opening and {closes} closing"
    m = _TAG_RES[tag].search(text)
    if m is None:
        return None, f"<{tag}> is not closed in order"
    return m.group(1), ""


def split_actions(answer: str, separator: str) -> list[str]:
    parts = [p.strip() for p in answer.split(separator)] if separator else [answer.strip()]
    return [p for p in parts if p]


def _invalid(reason: str, expected: str, fields: dict | None = None) -> ParsedTurn:
    return ParsedTurn(False, [], fields or {}, f"Invalid format: {reason}. Expected: {expected}")


def _think_answer_parser(think_fields: tuple[str, ...], require_think: bool, expected: str):
    """VAGEN-style formats: an optional or required <think> holding `think_fields`, then <answer>."""

    def parse(text: str, sep: str) -> ParsedTurn:
        fields: dict[str, str] = {}
        low = text.lower()
        if require_think:
            think, why = _only(text, "think", low)
            if think is None:
                return _invalid(why, expected)
            fields["think"] = think.strip()
            for f in think_fields:
                value, why = _only(think, f)
                if value is None:
                    return _invalid(why + " inside <think>", expected, fields)
                fields[f] = value.strip()
        elif "<think>" in low or "</think>" in low:
            return _invalid("this format takes no <think>", expected)
        answer, why = _only(text, "answer", low)
        if answer is None:
            return _invalid(why, expected, fields)
        if require_think and low.find("<answer>") < low.find("</think>"):
            return _invalid("<answer> must follow </think>", expected, fields)
        actions = split_actions(answer, sep)
        if not actions:
            return _invalid("<answer> holds no action", expected, fields)
        return ParsedTurn(True, actions, fields)

    return parse


def _meta_reasoning_parse(text: str, sep: str) -> ParsedTurn:
    expected = ("exactly one of <planning>, <explore>, <reflection>, <monitor> with its reasoning, "
                "then <action>...</action>")
    present = [t for t in META_TAGS if re.search(rf"</?{t}>", text, re.IGNORECASE)]
    if len(present) != 1:
        why = "no meta-reasoning tag" if not present else f"several meta-reasoning tags ({', '.join(present)})"
        return _invalid(why, expected)
    tag = present[0]
    body, why = _only(text, tag)
    if body is None:
        return _invalid(why, expected)
    action, why = _only(text, "action")
    if action is None:
        return _invalid(why, expected, {"meta_tag": tag})
    fields = {"meta_tag": tag, tag: body.strip()}
    if text.lower().find("<action>") < text.lower().find(f"</{tag}>"):
        return _invalid(f"<action> must follow </{tag}>", expected, fields)
    actions = split_actions(action, sep)
    if not actions:
        return _invalid("<action> holds no action", expected, fields)
    return ParsedTurn(True, actions, fields)


_FORMATS: dict[str, ActionFormat] = {}


def register_format(fmt: ActionFormat) -> None:
    _FORMATS[fmt.name] = fmt


def get_format(name: str) -> ActionFormat:
    try:
        return _FORMATS[name]
    except KeyError:
        raise KeyError(f"unknown action format {name!r}; known: {sorted(_FORMATS)}") from None


def format_names() -> tuple[str, ...]:
    return tuple(_FORMATS)


def _register_builtin() -> None:
    specs = [
        ("no_think", "answer only", (), False,
         "<answer>action1{sep} action2</answer>"),
        ("free_think", "free reasoning, then the answer", (), True,
         "<think>your reasoning</think><answer>action1{sep} action2</answer>"),
        ("grounding", "describe the observation, reason, answer", ("observation", "reasoning"), True,
         "<think><observation>what you see</observation><reasoning>...</reasoning></think>"
         "<answer>action1{sep} action2</answer>"),
        ("worldmodeling", "reason, predict the next state, answer", ("reasoning", "prediction"), True,
         "<think><reasoning>...</reasoning><prediction>the state after your actions</prediction></think>"
         "<answer>action1{sep} action2</answer>"),
        ("grounding_worldmodeling", "describe, reason, predict, answer",
         ("observation", "reasoning", "prediction"), True,
         "<think><observation>what you see</observation><reasoning>...</reasoning>"
         "<prediction>the state after your actions</prediction></think><answer>action1{sep} action2</answer>"),
    ]
    for name, desc, think_fields, require_think, template in specs:
        expected = template.format(sep=",")
        register_format(ActionFormat(
            name, desc, f"Answer in the form {template}",
            _think_answer_parser(think_fields, require_think, expected)))
    register_format(ActionFormat(
        "meta_reasoning", "RLVMR: one meta-reasoning tag, then the action",
        "Begin with exactly one of <planning>, <explore>, <reflection> or <monitor> holding your "
        "reasoning, then give the action in <action>...</action>.",
        _meta_reasoning_parse))


_register_builtin()
