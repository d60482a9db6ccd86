"""Ground-truth judges: what the agent says it sees (<observation>, grounding, turn t) and predicts
(<prediction>, world modelling, turn t+1), scored against the state GetState returns.

This package depends on envserve.core only (and on state dicts in GetState's shape), never on the
env classes: rule-based claims and F1 (rule_judge, relations), VAGEN's repetition penalty
(repetition) and the reasoning reward (reward), configured by JudgeConfig (config).
"""
from .config import JudgeConfig
from .relations import Claim, build_lexicon, parse_claims
from .repetition import RepetitionPenalty, RepetitionTracker, normalize_response
from .reward import ReasoningReward, reasoning_reward
from .rule_judge import (FIELDS, GROUNDING, REASONING_FIELD, WORLD_MODELING, RuleJudge, RuleScore, env_family,
                         reference_claims, truth_turn)

__all__ = [
    "JudgeConfig", "Claim", "build_lexicon", "parse_claims", "RepetitionPenalty", "RepetitionTracker",
    "normalize_response", "ReasoningReward", "reasoning_reward", "FIELDS", "GROUNDING", "WORLD_MODELING",
    "REASONING_FIELD", "RuleJudge", "RuleScore", "env_family", "reference_claims", "truth_turn",
]
