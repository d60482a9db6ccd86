"""Guess the number: the agent guesses a whole number in [0, high] and is told higher or lower.

The secret comes from the reset seed alone, so a seed is a task, the same in every process (what
envserve's conformance suite checks, and what lets a client rebuild a session elsewhere by replay).
"""
from __future__ import annotations

import random

from envserve.core import ActionOutcome, Environment, EnvSpec, GroundTruth, seeded_splits

HIGH = 9   # the action space below lists 0..HIGH; `high` can narrow it per session


class GuessEnv(Environment):
    spec = EnvSpec(
        env_id="guess",
        description="Guess a secret whole number; each wrong guess is answered with higher or lower.",
        system_prompt=("A secret whole number is hidden. Guess it: after each wrong guess you are told "
                       "whether the secret is higher or lower."),
        action_space=", ".join(str(i) for i in range(HIGH + 1)),
        max_turns=8,
        max_actions_per_turn=1,
        config_defaults={"high": HIGH, "reward_right": 1.0, "penalty_wrong": -0.1},
        config_docs={"high": "the secret is in [0, high]",
                     "reward_right": "reward of the right guess",
                     "penalty_wrong": "reward of each wrong guess"},
        # What a caller may choose: out of bounds is INVALID_ARGUMENT at Open, naming the key.
        config_bounds={"high": {"minimum": 1, "maximum": HIGH},
                       "reward_right": {"minimum": -100.0, "maximum": 100.0},
                       "penalty_wrong": {"minimum": -100.0, "maximum": 100.0}},
        splits=seeded_splits("secrets drawn from the seed"),
        default_action_format="no_think",
    )

    def __init__(self, config):
        super().__init__(config)
        self.high = int(self.config["high"])

    def reset(self, seed, options=None):
        self.secret = random.Random(seed).randint(0, self.high)
        self.guesses: list[int] = []
        self.hint = ""

    def step(self, action):
        action = action.strip()
        if not action.isdigit() or int(action) > self.high:
            return ActionOutcome(valid=False, feedback=f"not a whole number from 0 to {self.high}: {action!r}")
        guess = int(action)
        self.guesses.append(guess)
        if guess == self.secret:
            self.hint = "right"
            return ActionOutcome(reward=self.config["reward_right"], done=True, success=True,
                                 components={"right": self.config["reward_right"]}, feedback="Right!")
        self.hint = "higher" if self.secret > guess else "lower"
        return ActionOutcome(reward=self.config["penalty_wrong"], components={"wrong": self.config["penalty_wrong"]},
                             feedback=f"{guess} is wrong; the secret is {self.hint}.")

    def render_text(self):
        tried = ", ".join(map(str, self.guesses)) or "none"
        return f"Secret in [0, {self.high}]. Guesses so far: {tried}."

    def valid_actions(self):
        return [str(i) for i in range(self.high + 1) if i not in self.guesses]

    def ground_truth(self):
        # What a judge compares the agent's account with; the secret included.
        return GroundTruth({"secret": self.secret, "guesses": list(self.guesses), "high": self.high},
                           relations=[f"the secret is {self.secret}"])
