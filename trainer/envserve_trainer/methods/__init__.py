"""Stage 4, methods: advantage and credit estimators, a module each (GRPO, GiGPO, GRPO-MR with RLVMR's meta rewards,
LaMer, REINFORCE++, masked and bi-level GAE) and the process-reward family (methods.process). May import: config."""
from .common import StepAdvantages, discounted_returns, group_normalize
from .gae import bilevel_gae, masked_gae, turn_spans
from .gigpo import gigpo_advantages
from .grpo import grpo_advantages
from .grpo_mr import grpo_mr_advantages
from .lamer import lamer_advantages, lamer_returns
from .reinforce_pp import reinforce_pp_advantages

__all__ = ["StepAdvantages", "bilevel_gae", "discounted_returns", "gigpo_advantages", "group_normalize",
           "grpo_advantages", "grpo_mr_advantages", "lamer_advantages", "lamer_returns", "masked_gae",
           "reinforce_pp_advantages", "turn_spans"]
