"""Guess a number in 1..100 drawn from the reset seed; each guess is told higher or lower."""
import random
from typing import Any, Optional

from pydantic import Field

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

LOW, HIGH, MAX_GUESSES = 1, 100, 8


class GuessAction(Action):
    guess: int = Field(ge=LOW, le=HIGH, description="your guess")


class GuessObservation(Observation):
    hint: str
    guesses_left: int


class GuessState(State):
    target: int = 0
    guesses: list[int] = []


class GuessEnvironment(Environment[GuessAction, GuessObservation, GuessState]):
    """Guess the hidden number from 1 to 100 in eight tries; each wrong guess says higher or lower."""

    def __init__(self):
        super().__init__()
        self._state = GuessState()

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs: Any):
        rng = random.Random(seed)
        self._state = GuessState(episode_id=episode_id, target=rng.randint(LOW, HIGH))
        return GuessObservation(hint=f"I picked a number from {LOW} to {HIGH}.", guesses_left=MAX_GUESSES,
                                reward=0.0)

    def step(self, action, timeout_s=None, **kwargs):
        s = self._state
        s.step_count += 1
        s.guesses = [*s.guesses, action.guess]
        left = MAX_GUESSES - len(s.guesses)
        if action.guess == s.target:
            return GuessObservation(hint="Correct!", guesses_left=left, reward=1.0, done=True,
                                    metadata={"success": True})
        hint = "Higher." if action.guess < s.target else "Lower."
        return GuessObservation(hint=hint, guesses_left=left, reward=0.0, done=left == 0)

    def web_actions(self, observation):
        lo, hi = LOW, HIGH
        for g in self._state.guesses:  # the range the hints leave open
            if g < self._state.target:
                lo = max(lo, g + 1)
            elif g > self._state.target:
                hi = min(hi, g - 1)
        return [(str(g), {"guess": g}) for g in sorted({lo, (lo + hi) // 2, hi})]

    @property
    def state(self) -> GuessState:
        return self._state
