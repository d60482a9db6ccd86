"""reasoning-gym datasets as envserve environments.

`reasoning_gym:<dataset>` resolves (core.registry's prefix families) to a class built by
make_env_class for that dataset. A task is one entry of the dataset: the reset seed picks the split
(seeds from TEST_SEED_OFFSET on are the test split) and the entry index within it; each split is
the dataset built with its own dataset seed from the config, so a seed names the same question in
every process. The whole answer text is one action, scored by the dataset's own score_answer.
"""
from __future__ import annotations

import functools
import json
import math
import re
from typing import Any, Mapping

from envserve.core.env import ActionOutcome, Environment, EnvSpec, GroundTruth, Split, integral_numbers

# Datasets `envserve ls` and the conformance suite try: quick to generate, the same entries in
# any process. Those this reasoning-gym version lacks are left out.
EXAMPLE_DATASETS = ("leg_counting", "basic_arithmetic", "chain_sum", "gcd", "lcm", "letter_counting",
                    "word_sorting", "number_sorting", "caesar_cipher", "spell_backward", "base_conversion",
                    "bitwise_arithmetic", "count_bits", "family_relationships", "maze", "mini_sudoku",
                    "n_queens", "rotate_matrix", "simple_equations", "tower_of_hanoi", "calendar_arithmetic",
                    "dice", "products", "word_sequence_reversal", "prime_factorization", "knights_knaves")
# Reset seeds from here on pick test entries; below it, train entries.
TEST_SEED_OFFSET = 10_000_000
# Session config. `size` entries per split: a seed picks entry (seed - split offset) mod size.
# The two dataset seeds must be at least `size` apart, since reasoning-gym seeds entry i of a
# dataset with (dataset seed + i): closer seeds would share entries between the splits.
CONFIG_DEFAULTS = {"dataset_params": {}, "size": 1_000_000, "train_dataset_seed": 0,
                   "test_dataset_seed": 1_000_000_000, "success_threshold": 1.0, "max_attempts": 1}
CONFIG_DOCS = {
    "dataset_params": "keyword arguments of the dataset's config (difficulty ranges...), besides seed and size",
    "size": "entries per split; a reset seed picks entry (seed - split offset) mod size",
    "train_dataset_seed": "reasoning-gym dataset seed of the train split",
    "test_dataset_seed": "reasoning-gym dataset seed of the test split (at least size away from the train one)",
    "success_threshold": "an answer whose score reaches this succeeds and ends the episode",
    "max_attempts": "answers per episode; a wrong one gets feedback while attempts are left",
}
# Turns per episode the session allows: room for max_attempts plus unparseable turns, which use no attempt.
MAX_TURNS = 64
# Longest answer quoted back in feedback.
QUOTE_CHARS = 200


def _rg():
    # Imported on first use so listing environments stays light.
    import reasoning_gym
    return reasoning_gym


def _datasets() -> dict:
    from reasoning_gym.factory import DATASETS
    return DATASETS


def _version() -> str:
    from importlib.metadata import version
    return version("reasoning-gym")


def examples() -> list[str]:
    """The EXAMPLE_DATASETS this reasoning-gym has."""
    known = _datasets()
    return [n for n in EXAMPLE_DATASETS if n in known]


def make_env_class(name: str) -> type:
    """The Environment class serving dataset `name`; KeyError for a name reasoning-gym lacks."""
    known = _datasets()
    if name not in known:
        raise KeyError(f"reasoning-gym {_version()} has no dataset {name!r}; for example "
                       f"{', '.join(examples()[:6])} (all: python -c 'import reasoning_gym.factory as f; "
                       f"print(sorted(f.DATASETS))')")
    dataset_cls, _ = known[name]
    summary = (dataset_cls.__doc__ or "").strip().splitlines()
    spec = EnvSpec(
        env_id=f"reasoning_gym:{name}",
        description=f"reasoning-gym {name}: {summary[0] if summary else 'procedurally generated questions'}",
        system_prompt=(f"You answer questions from reasoning-gym's {name} dataset.\n"
                       "Each episode is one question. Give your final answer, exactly in the form the "
                       "question asks for; it is scored by the dataset's own checker. If your answer is "
                       "wrong and attempts are left, you are told so and may answer again."),
        action_space="free text: your final answer to the question",
        max_turns=MAX_TURNS,
        max_actions_per_turn=1,
        # An answer is free text (lists with commas): no separator splits it.
        config_defaults={**CONFIG_DEFAULTS, "action_separator": ""},
        config_docs=CONFIG_DOCS,
        splits=(Split("train", "reasoning-gym entries of train_dataset_seed, seeds [0, size)", 0, CONFIG_DEFAULTS["size"]),
                Split("test", f"reasoning-gym entries of test_dataset_seed, seeds [{TEST_SEED_OFFSET:.0e}, "
                              f"{TEST_SEED_OFFSET:.0e}+size)", TEST_SEED_OFFSET, CONFIG_DEFAULTS["size"])),
    )
    safe = re.sub(r"\W", "_", name)
    return type(f"ReasoningGym_{safe}", (ReasoningGymEnv,), {"spec": spec, "dataset_name": name, "__module__": __name__})


@functools.lru_cache(maxsize=32)
def _dataset(name: str, seed: int, size: int, params_json: str):
    # Sessions of one config share the dataset: entries are generated by index on demand, and
    # some datasets load word lists or puzzles when built.
    return _rg().create_dataset(name, seed=seed, size=size, **json.loads(params_json))


def _json_safe(value: Any) -> Any:
    """Entry metadata as plain JSON: tuples become lists, keys strings, other objects their str;
    non-finite floats become strings (Struct and sorted JSON both hold them)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_json_safe(v) for v in value]
        return sorted(items, key=repr) if isinstance(value, (set, frozenset)) else items
    return str(value)


class ReasoningGymEnv(Environment):
    """One dataset entry per episode. Subclasses built by make_env_class set spec and dataset_name."""

    spec: EnvSpec
    dataset_name: str

    def __init__(self, config: Mapping[str, Any]):
        super().__init__(config)
        cfg = self.config
        params = cfg["dataset_params"]
        if not isinstance(params, Mapping):
            raise ValueError(f"dataset_params must be an object of {self.dataset_name}'s config fields, got {params!r}")
        if "seed" in params or "size" in params:
            raise ValueError("dataset_params cannot set seed or size: train_dataset_seed, test_dataset_seed "
                             "and size do")
        size = int(cfg["size"])
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        if abs(int(cfg["test_dataset_seed"]) - int(cfg["train_dataset_seed"])) < size:
            raise ValueError("train_dataset_seed and test_dataset_seed must be at least size apart, "
                             "or the splits share entries")
        if int(cfg["max_attempts"]) < 1:
            raise ValueError(f"max_attempts must be >= 1, got {cfg['max_attempts']}")
        self._size, self._max_attempts = size, int(cfg["max_attempts"])
        self._threshold = float(cfg["success_threshold"])
        params_json = json.dumps(integral_numbers(dict(params)), sort_keys=True)
        self._datasets = []
        for seed in (int(cfg["train_dataset_seed"]), int(cfg["test_dataset_seed"])):
            try:
                self._datasets.append(_dataset(self.dataset_name, seed, size, params_json))
            except Exception as e:  # an unknown field or a value the dataset's validate() rejects
                raise ValueError(f"reasoning-gym cannot build {self.dataset_name} with dataset_params "
                                 f"{dict(params)!r}: {type(e).__name__}: {e}") from None
        # The whole state: which entry, and the answers given to it (what snapshot copies).
        self._split, self._index = 0, 0
        self._attempts: list[dict] = []
        self._done = False
        self._entry: dict = {}

    def reset(self, seed: int, options: Mapping[str, Any] | None = None) -> None:
        seed = int(seed) if seed is not None else 0
        self._split = 1 if seed >= TEST_SEED_OFFSET else 0
        self._index = (seed - (TEST_SEED_OFFSET if self._split else 0)) % self._size
        self._attempts, self._done = [], False
        self._load_entry()

    def _load_entry(self) -> None:
        self._entry = self._datasets[self._split][self._index]

    def _score(self, answer: str) -> "tuple[float, str]":
        try:
            score = float(self._datasets[self._split].score_answer(answer, self._entry))
        except Exception as e:  # a checker that cannot read this answer: it is not right
            return 0.0, f"The answer could not be checked ({type(e).__name__}: {str(e)[:QUOTE_CHARS]}), so it scores 0."
        if not math.isfinite(score):
            return 0.0, f"The checker gave {score}, counted as 0."
        return score, ""

    def step(self, action: str) -> ActionOutcome:
        if not isinstance(action, str) or not action.strip():
            return ActionOutcome(valid=False, feedback="Invalid answer: expected non-empty text.")
        if self._done:
            return ActionOutcome(valid=False, feedback="The episode is over; reset the environment.")
        score, why = self._score(action)
        best = max((a["score"] for a in self._attempts), default=0.0)
        self._attempts.append({"answer": action, "score": score})
        success = score >= self._threshold
        left = self._max_attempts - len(self._attempts)
        self._done = success or left <= 0
        if success:
            feedback = f"Correct (score {score:g})."
        else:
            feedback = " ".join(p for p in (f"Not correct (score {score:g}).", why) if p)
            feedback += f" {left} attempt{'s' if left != 1 else ''} left." if left > 0 else " No attempts left."
        # The episode's return is the best score reached: each answer earns what it adds to the best so far.
        gain = max(score - best, 0.0)
        return ActionOutcome(reward=gain, done=self._done, success=success, feedback=feedback,
                             components={"score": gain}, info={"score": score})

    def render_text(self) -> str:
        text = self._entry["question"]
        if self._attempts:
            last = self._attempts[-1]
            answer = last["answer"] if len(last["answer"]) <= QUOTE_CHARS else last["answer"][:QUOTE_CHARS] + "..."
            left = self._max_attempts - len(self._attempts)
            text += f"\n\nYour answer {answer!r} scored {last['score']:g}."
            if not self._done:
                text += f" {left} attempt{'s' if left != 1 else ''} left: answer again."
        return text

    def ground_truth(self) -> GroundTruth:
        return GroundTruth({
            "dataset": self.dataset_name,
            "split": self.spec.splits[self._split].name,
            "index": self._index,
            "question": self._entry["question"],
            "answer": _json_safe(self._entry.get("answer")),
            "metadata": _json_safe(self._entry.get("metadata", {})),
            "attempts": [dict(a) for a in self._attempts],
            "attempts_left": self._max_attempts - len(self._attempts),
            "solved": any(a["score"] >= self._threshold for a in self._attempts),
        })

    def anchor_data(self) -> Any:
        # The question and the answers given so far identify the state; the metadata adds nothing.
        return [self.dataset_name, self._split, self._index, [a["answer"] for a in self._attempts]]

    # -- copies: the entry is regenerated from (split, index), so copying those is exact ----------
    def snapshot(self):
        return (self._split, self._index, [dict(a) for a in self._attempts], self._done)

    def restore(self, snap) -> None:
        self._split, self._index, attempts, self._done = snap
        self._attempts = [dict(a) for a in attempts]
        self._load_entry()
