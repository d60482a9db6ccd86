"""`envserve-train --help`: every option of every subcommand says what it is, and a default worth
showing is shown."""
from __future__ import annotations

import argparse

import pytest

from envserve_trainer.cli import build_parser


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


SUBCOMMANDS = _subparsers(build_parser())


def test_the_walk_sees_every_subcommand():
    assert set(SUBCOMMANDS) == {"train", "eval", "sft", "perceive", "collect"}


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_every_option_has_help_and_shows_its_default(name):
    sub = SUBCOMMANDS[name]
    missing = [a.option_strings for a in sub._actions if not (a.help or "").strip()]
    assert not missing, f"{name}: options without help: {missing}"
    text = sub.format_help()
    for action in sub._actions:
        if isinstance(action.default, (int, float, str)) and not isinstance(action.default, bool) \
                and action.default not in ("", argparse.SUPPRESS):
            assert f"(default: {action.default})" in " ".join(text.split()) or "default" in action.help, \
                f"{name} {action.option_strings}: default {action.default!r} not shown"
