"""`envserve new-env NAME`: writes an environment package that lives outside envserve's tree.

The package registers its env through the `envserve.envs` entry-point group (envserve.core.registry
reads it), so `pip install -e DIR` is all it takes for `envserve serve NAME` to find it. Its example
env is small but complete (seeded reset, legal-action list, ground truth with relation sentences),
and its tests run the env directly and through envserve's conformance suite, which starts two real
`envserve serve` processes; the suite is found in envserve's checkout (tests/conformance) or at
$ENVSERVE_CONFORMANCE_SUITE. Generated as is, the package passes the suite.
"""
from __future__ import annotations

import re
from pathlib import Path

ENTRY_POINT_GROUP = "envserve.envs"   # the group envserve.core.registry reads (not imported: no arrow)
_NAME = re.compile(r"[a-z][a-z0-9_-]{0,62}")


def names(env_id: str) -> dict[str, str]:
    """The env id's spellings: distribution, Python package and class name."""
    if not _NAME.fullmatch(env_id):
        raise ValueError(f"environment name {env_id!r}: use lower-case letters, digits, '-' and '_', "
                         f"starting with a letter (e.g. line-walk)")
    words = [w for w in re.split(r"[-_]", env_id) if w]
    return {"env_id": env_id, "dist": env_id.replace("_", "-"), "package": "_".join(words) + "_env",
            "cls": "".join(w.capitalize() for w in words) + "Env"}


def scaffold(env_id: str, folder: str | Path) -> Path:
    """Writes the package into folder (created; it must be empty or absent) and returns its path."""
    n = names(env_id)
    root = Path(folder).resolve()
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise ValueError(f"{root} exists and is not an empty folder; choose another --dir")
    files = {
        "pyproject.toml": PYPROJECT,
        "README.md": README,
        f"{n['package']}/__init__.py": INIT,
        f"{n['package']}/env.py": ENV,
        "tests/test_env.py": TEST_ENV,
        "tests/test_conformance.py": TEST_CONFORMANCE,
    }
    for rel, template in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(_fill(template, n))
    return root


def _fill(template: str, n: dict[str, str]) -> str:
    out = template
    for key, value in n.items():
        out = out.replace("{{" + key + "}}", value)
    return out.replace("{{group}}", ENTRY_POINT_GROUP).lstrip("\n")


PYPROJECT = '''
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "{{dist}}"
version = "0.1.0"
description = "The {{env_id}} environment, served by envserve"
requires-python = ">=3.10"
# envserve itself: install it first (from its checkout: pip install -e "/path/to/envserve[grid]").
dependencies = []

[project.optional-dependencies]
test = ["pytest>=8"]

# How envserve finds the environment: its id -> "module:Class".
[project.entry-points."{{group}}"]
{{env_id}} = "{{package}}.env:{{cls}}"

[tool.setuptools.packages.find]
include = ["{{package}}*"]

[tool.pytest.ini_options]
testpaths = ["tests"]
'''

README = '''
# {{env_id}}

An environment for envserve. `{{package}}/env.py` holds it: change the game, keep the five methods.

    pip install -e .              # registers "{{env_id}}" with envserve (entry point in pyproject.toml)
    envserve ls                   # lists it
    envserve serve {{env_id}}     # serves it over gRPC on 127.0.0.1:50051
    envserve play {{env_id}}      # plays it in the terminal
    envserve state {{env_id}} --seed 3 --action right   # its ground truth after one move
    pytest                        # its own test, then envserve's conformance suite against two servers

The conformance test runs envserve's suite (tests/conformance in envserve's checkout). It finds the
suite next to an editable envserve install; elsewhere set ENVSERVE_CONFORMANCE_SUITE to its folder.
'''

INIT = '''
from .env import {{cls}}

__all__ = ["{{cls}}"]
'''

ENV = '''
"""{{env_id}}: walk along a row of cells to the goal.

The example shows the parts envserve needs; replace the game with your own:
- `spec`: what clients see (GetSpec): prompt, action space, turn limits, config keys with defaults and
  bounds (a caller chooses within them: numbers need a maximum, strings a maxLength or an enum), splits.
- reset(seed): the same seed gives the same task in any process (draw from random.Random(seed)).
- step(action): one primitive action (the session has already parsed the model's text); an action
  that is not legal returns valid=False with feedback and changes nothing.
- render_text(): the observation. ground_truth(): the true state for judges (GetState), with
  relation sentences. valid_actions(): the legal actions now, when the env can list them.
Snapshots (Fork) copy the instance's fields by default; hold no open handles in them.
"""
from __future__ import annotations

import random

from envserve.core import ActionOutcome, Environment, EnvSpec, GroundTruth, seeded_splits

SYSTEM_PROMPT = (
    "You walk along a row of cells to reach the goal. The row is shown with P for you, G for the goal "
    "and _ for an empty cell. Move one cell per action: left or right.")


class {{cls}}(Environment):
    spec = EnvSpec(
        env_id="{{env_id}}",
        description="walk left or right along a row of cells to the goal",
        system_prompt=SYSTEM_PROMPT,
        action_space="left, right",
        max_turns=20,
        max_actions_per_turn=3,
        config_defaults={"size": 9, "goal_reward": 1.0, "step_reward": 0.0},
        config_docs={"size": "cells in the row", "goal_reward": "reward for reaching the goal",
                     "step_reward": "reward of every other legal move"},
        # A value out of bounds is INVALID_ARGUMENT at Open, naming the key, before the env exists.
        config_bounds={"size": {"minimum": 2, "maximum": 100},
                       "goal_reward": {"minimum": -100.0, "maximum": 100.0},
                       "step_reward": {"minimum": -100.0, "maximum": 100.0}},
        splits=seeded_splits("random rows"),
        default_action_format="no_think",
    )

    def reset(self, seed, options=None):
        size = int(self.config["size"])
        rng = random.Random(seed)
        self.size = size
        self.agent = rng.randrange(size)
        # At least half the row away, so that no episode ends at its first move.
        self.goal = rng.choice([i for i in range(size) if abs(i - self.agent) >= max(1, size // 2)])

    def step(self, action):
        move = {"left": -1, "right": 1}.get(action.strip().lower())
        if move is None:
            return ActionOutcome(valid=False, feedback=f"unknown action {action[:40]!r}; use left or right")
        if not 0 <= self.agent + move < self.size:
            return ActionOutcome(valid=False, feedback=f"you are at the end of the row; {action} goes nowhere")
        self.agent += move
        if self.agent == self.goal:
            reward = float(self.config["goal_reward"])
            return ActionOutcome(reward=reward, done=True, success=True, components={"goal": reward})
        return ActionOutcome(reward=float(self.config["step_reward"]))

    def render_text(self):
        return " ".join("P" if i == self.agent else "G" if i == self.goal else "_" for i in range(self.size))

    def valid_actions(self):
        return [a for a, move in (("left", -1), ("right", 1)) if 0 <= self.agent + move < self.size]

    def ground_truth(self):
        gap = self.goal - self.agent
        side = "right" if gap > 0 else "left"
        relations = ([f"the goal is {abs(gap)} cells to the {side} of the player"] if gap
                     else ["the player is on the goal"])
        return GroundTruth({"player": self.agent, "goal": self.goal, "size": self.size}, relations)
'''

TEST_ENV = '''
"""The environment on its own, without a server."""
from {{package}} import {{cls}}


def make(**overrides):
    return {{cls}}({**{{cls}}.spec.config_defaults, **overrides})


def test_same_seed_same_row_and_walking_to_the_goal_wins():
    a, b = make(), make()
    a.reset(5)
    b.reset(5)
    assert a.render_text() == b.render_text()
    truth = a.ground_truth()
    step = "right" if truth.state["goal"] > truth.state["player"] else "left"
    for _ in range(abs(truth.state["goal"] - truth.state["player"]) - 1):
        assert a.step(step).valid and not a.ground_truth().state["player"] == truth.state["goal"]
    last = a.step(step)
    assert last.done and last.success and last.reward == 1.0


def test_illegal_actions_change_nothing():
    env = make()
    env.reset(1)
    before = env.render_text()
    assert not env.step("jump").valid
    edge = "left" if "left" not in env.valid_actions() else None
    if edge:
        assert not env.step(edge).valid
    assert env.render_text() == before
'''

TEST_CONFORMANCE = '''
"""envserve's conformance suite against this environment, on two real `envserve serve` processes
(the suite's own fixtures start them). The environment must be registered: pip install -e ."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ENV_ID = "{{env_id}}"


def conformance_suite():
    """$ENVSERVE_CONFORMANCE_SUITE, else tests/conformance beside an editable envserve install."""
    given = os.environ.get("ENVSERVE_CONFORMANCE_SUITE")
    if given:
        return Path(given)
    import envserve
    folder = Path(envserve.__file__).resolve().parents[2] / "tests" / "conformance"
    return folder if folder.is_dir() else None


def test_envserve_conformance_suite_passes():
    suite = conformance_suite()
    if suite is None:
        pytest.skip("envserve's conformance suite was not found: set ENVSERVE_CONFORMANCE_SUITE to the "
                    "tests/conformance folder of an envserve checkout")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(suite)],
                         env=dict(os.environ, ENVSERVE_CONFORMANCE_ENVS=ENV_ID), capture_output=True, text=True)
    assert run.returncode == 0 and " passed" in run.stdout, run.stdout[-6000:] + run.stderr[-3000:]
'''
