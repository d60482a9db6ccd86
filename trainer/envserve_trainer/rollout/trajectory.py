"""What a rollout records: turns, episodes, and trials (LaMer's N episodes of one task).

Plain dataclasses, so estimators, rewards and evaluation read them without knowing about gRPC. A
Turn keeps the exact token ids the policy saw and produced (multi-turn contexts are carried as ids,
never re-tokenized) and everything the env said about the step.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Turn:
    """One policy call and the env step it drove."""
    turn: int                      # the env's turn index of the observation this turn answered
    prompt_ids: list[int]          # the context the policy saw
    completion_ids: list[int]      # what it produced (ends with the stop token when it stopped)
    logprobs: list[float]          # behaviour log-probabilities of completion_ids
    text: str                      # the completion as decoded
    action: str                    # the text sent to the env (response prefix + completion)
    observation: str               # the observation after the step
    reward: float
    reward_components: dict[str, float] = field(default_factory=dict)
    action_valid: bool = False
    parsed_actions: list[str] = field(default_factory=list)
    reasoning: dict[str, str] = field(default_factory=dict)
    state_anchor: str = ""         # anchor of the state acted in (the previous result's anchor)
    anchor: str = ""               # anchor of the state after the step
    transition: str = ""           # the env's (s, a, s') key
    done: bool = False
    truncated: bool = False
    success: bool = False
    feedback: str = ""
    judge_scores: dict[str, float] = field(default_factory=dict)   # field -> judge score
    judge_verdicts: dict[str, bool] = field(default_factory=dict)  # field -> the judge's pass/fail
    process_reward: float | None = None   # a process reward model's reward for this step (methods/process/)
    prompt_images: list[bytes] = field(default_factory=list)   # PNGs whose tokens prompt_ids holds, in order

    @property
    def parsed(self) -> bool:
        return bool(self.parsed_actions)


@dataclass
class Episode:
    """One episode of one session, from reset to done, truncation or the trainer's turn limit."""
    env_id: str
    split: str
    task_seed: int
    group: str                     # tasks that share a group are compared by the estimators
    sample: int                    # which of the group's K samples (trials) this episode belongs to
    episode: int                   # index within its trial (0 for single-episode training)
    session_id: str = ""
    env_episode: int = 0           # the session's own episode and trial counters (StepResult), which
    env_trial: int = 0             # with turn address the judge's and GetState's reads
    turns: list[Turn] = field(default_factory=list)
    reflection: str = ""           # LaMer: the remark written after this episode, if any
    reflection_ids: tuple[list[int], list[int], list[float]] | None = None  # its (prompt, completion, logprobs)
    reflection_images: list[bytes] = field(default_factory=list)   # the PNGs its prompt holds
    turn_limited: bool = False     # the trainer's max_turns ended it before the env did

    @property
    def success(self) -> bool:
        return bool(self.turns) and self.turns[-1].success

    @property
    def score(self) -> float:
        return float(sum(t.reward for t in self.turns))

    @property
    def done(self) -> bool:
        return bool(self.turns) and (self.turns[-1].done or self.turns[-1].truncated)

    @property
    def actions(self) -> list[str]:
        return [",".join(t.parsed_actions) if t.parsed_actions else t.action for t in self.turns]


@dataclass
class Trial:
    """K-th sample of a group: one episode, or N for LaMer's multi-episode trials."""
    group: str
    sample: int
    episodes: list[Episode] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def env_id(self) -> str:
        return self.episodes[0].env_id if self.episodes else ""

    @property
    def split(self) -> str:
        return self.episodes[0].split if self.episodes else ""
