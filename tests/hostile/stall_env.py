"""Test environments whose resets and steps take as long as the caller asks: how the hostile tests
make a slow env, a stuck worker and an Open held while its workers build sessions. Installed for
a replica subprocess as an out-of-tree package (tests/outoftree.py), the way a user's env is.

- `stall`: the action `wait S` sleeps S seconds in Python (a time limit interrupts it); `go` moves.
  The config's reset_seconds makes every reset that slow.
- `stall_hard`: the same, but its spec says it cannot be interrupted (as an env talking to a JVM
  would), so only the replacement of its worker ends a stuck step.
- With a file `hold` in $STALL_HOLD_DIR holding a number N and a word naming the hold, the Nth
  session a process builds while that hold stands waits there (writing `entered-<pid>` first) until the file is removed:
  a test holds each worker inside an Open with N - 1 sessions built, and lets it go.
"""
from __future__ import annotations

import dataclasses
import os
import time

from envserve.core import ActionOutcome, Environment, EnvSpec, GroundTruth

# Sessions built in this process during each hold, by the hold file's text.
_BUILT: dict = {}

SPEC = EnvSpec(
    env_id="stall", description="a one-row world whose resets and steps take as long as asked",
    system_prompt="Answer go to move on, or wait S to wait S seconds.", action_space="go, wait S",
    max_turns=100, max_actions_per_turn=1,
    config_defaults={"reset_seconds": 0.0, "ballast_bytes": 8192},
    config_bounds={"reset_seconds": {"minimum": 0, "maximum": 60}, "ballast_bytes": {"minimum": 0, "maximum": 1 << 20}})


class Stall(Environment):
    spec = SPEC

    def __init__(self, config):
        super().__init__(config)
        self._hold(os.environ.get("STALL_HOLD_DIR", ""))
        # What a real session holds, so that sessions left behind show in a worker's memory.
        self.ballast = bytearray(int(self.config["ballast_bytes"]))
        self.position = 0

    @staticmethod
    def _hold(hold_dir: str) -> None:
        path = os.path.join(hold_dir, "hold")
        try:
            with open(path) as f:
                key = f.read().strip()         # "N" and a word naming this hold
            at = int(key.split()[0])
        except (OSError, ValueError, IndexError):
            return
        _BUILT[key] = _BUILT.get(key, 0) + 1
        if _BUILT[key] != at:
            return
        open(os.path.join(hold_dir, f"entered-{os.getpid()}"), "w").close()
        while os.path.exists(path):
            time.sleep(0.01)

    def reset(self, seed, options=None):
        time.sleep(float(self.config["reset_seconds"]))
        self.position = int(seed) % 7

    def step(self, action):
        if action.startswith("wait"):
            try:
                seconds = float(action.split()[1])
            except (IndexError, ValueError):
                return ActionOutcome(valid=False, feedback="wait takes seconds: wait 1.5")
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:   # Python code all along: a signal interrupts it
                time.sleep(0.01)
            return ActionOutcome()
        if action == "go":
            self.position += 1
            return ActionOutcome(reward=1.0)
        return ActionOutcome(valid=False, feedback=f"unknown action {action!r}")

    def render_text(self):
        return f"position {self.position}"

    def ground_truth(self):
        return GroundTruth({"position": self.position}, [f"the player is at {self.position}"])


class StallHard(Stall):
    spec = dataclasses.replace(SPEC, env_id="stall_hard", interruptible=False)
