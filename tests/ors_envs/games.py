"""Two small games on ors-sdk's Environment: Guess (one tool, `guess(number)`: higher or lower until
the secret; reward 1 when found, 0 when out of guesses) and GuessWithHint (the same plus a `hint()`
tool without input, so an answer must name its tool)."""
from pydantic import BaseModel, Field

from ors import Environment, Split, TextBlock, ToolOutput, tool

# Task i of a split hides (i * 7 + offset) % HIGH + 1; the test split is disjoint from train's.
HIGH = 20
MAX_GUESSES = 6
SPLITS = {"train": (40, 0), "test": (10, 3)}


class GuessInput(BaseModel):
    number: int = Field(description="your guess, 1 to 20")


class Guess(Environment):
    """Find the hidden number: after each guess the env says higher or lower."""

    def __init__(self, task_spec={}, secrets={}):
        super().__init__(task_spec, secrets)
        self.guesses = 0

    @classmethod
    def list_splits(cls):
        return [Split(name="train", type="train"), Split(name="test", type="test")]

    @classmethod
    def list_tasks(cls, split):
        if split not in SPLITS:
            raise ValueError(f"no split {split!r}")
        n, offset = SPLITS[split]
        return [{"secret": (i * 7 + offset) % HIGH + 1, "high": HIGH, "task_type": "guess",
                 "goal": f"Find the hidden number between 1 and {HIGH}."} for i in range(n)]

    def get_prompt(self):
        return [TextBlock(text=f"{self.task_spec['goal']} You have {MAX_GUESSES} guesses.")]

    @tool
    def guess(self, params: GuessInput) -> ToolOutput:
        """Guess the hidden number."""
        self.guesses += 1
        secret = self.task_spec["secret"]
        if params.number == secret:
            return ToolOutput(blocks=[TextBlock(text=f"{params.number} is right.")], reward=1.0, finished=True,
                              metadata={"success": True, "guesses": self.guesses})
        word = "higher" if params.number < secret else "lower"
        out_of_guesses = self.guesses >= MAX_GUESSES
        return ToolOutput(blocks=[TextBlock(text=f"{params.number}: {word}." + (" No guesses left." if out_of_guesses else ""))],
                          reward=0.0, finished=out_of_guesses, metadata={"success": False, "guesses": self.guesses})


class GuessWithHint(Guess):
    """Guess, with a hint tool that tells whether the hidden number is even."""

    @tool
    def hint(self) -> ToolOutput:
        """Whether the hidden number is even."""
        even = self.task_spec["secret"] % 2 == 0
        return ToolOutput(blocks=[TextBlock(text="even" if even else "odd")], reward=0.0, finished=False)


ENVIRONMENTS = [Guess, GuessWithHint]
