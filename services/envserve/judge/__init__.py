"""Ground-truth judges: what the agent says it sees (<observation>, grounding, turn t) and predicts
(<prediction>, world modelling, turn t+1), scored against the state GetState returns.

The judges read state dicts in GetState's shape and import no env class: rule-based claims and F1
(rule_judge, relations), the LLM judge over an OpenAI-compatible endpoint (llm_judge, prompts; import
it from envserve.judge.llm_judge, it needs the `judge` extra), all behind one protocol (base). VAGEN's
repetition penalty (repetition) and the reasoning reward (reward) are configured by JudgeConfig
(config). The JudgeService (service, app) reads the truth through StateService with the client.
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
