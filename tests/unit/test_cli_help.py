"""`envserve -h` and every subcommand's -h: each argument says what it is, and each option with a
default worth knowing shows it, without "default: None" noise for options that have none. The
parser is built as `main` builds it, and building it starts and imports no server."""
from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from envserve.cli import build_parser

NOISE = ("default: None", "default: []", "default: False", "default: True", "(default: )")


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def arguments(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))]


def option_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The help text of one argument as -h prints it (wrapping undone)."""
    formatter = parser._get_formatter()
    return " ".join(formatter._expand_help(action).split()) if action.help else ""


def test_every_subcommand_is_walked():
    names = set(subcommands(build_parser()))
    assert {"serve", "up", "web", "judge", "ls", "replicas", "play", "state", "new-env", "health", "demo"} <= names


@pytest.mark.parametrize("name", sorted(subcommands(build_parser())))
def test_every_argument_has_help_and_shows_a_meaningful_default(name):
    parser = subcommands(build_parser())[name]
    missing, unshown, noisy = [], [], []
    for action in arguments(parser):
        label = action.option_strings[-1] if action.option_strings else action.dest
        text = option_help(parser, action)
        if not text or action.help == argparse.SUPPRESS:
            missing.append(label)
            continue
        meaningful = action.nargs != 0 and action.default not in (None, "", [], argparse.SUPPRESS)
        if meaningful and action.option_strings and "default" not in text:
            unshown.append(label)
        noisy += [f"{label}: {n}" for n in NOISE if n in text]
    assert (missing, unshown, noisy) == ([], [], []), f"envserve {name}"


def test_help_prints_for_every_subcommand():
    parser = build_parser()
    for name, sub in subcommands(parser).items():
        text = sub.format_help()
        assert text.startswith(f"usage: envserve {name}") and not any(n in text for n in NOISE), name
    assert "(default: 50051)" in " ".join(subcommands(parser)["serve"].format_help().split())


def test_building_the_parser_starts_nothing():
    code = ("import sys, threading, envserve.cli as c; c.build_parser(); "
            "print(threading.active_count(), sorted(m for m in sys.modules if m.startswith(('envserve.', 'grpc'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split(" ", 1)
    assert out[0] == "1" and "grpc" not in out[1] and "envserve.server" not in out[1], out
