"""Defaults of the advantage estimators and of the RLVMR rewards, each with where it comes from.

Every number a paper fixes lives here, so that code never carries one as a literal; a trainer builds
these from its YAML/CLI with `from_mapping`, which refuses unknown keys and wrong types.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from .checks import from_mapping, unit


@dataclass(frozen=True)
class AdvantageConfig:
    # -- group normalisation (GRPO, GiGPO, GRPO-MR, LaMer) -------------------------------------
    # A = (R - mean) / (std + eps). eps 1e-6 as in verl's GRPO, which GiGPO and RLVMR build on.
    eps: float = 1e-6
    # Divide by the group std (GRPO, DeepSeekMath). False gives Dr.GRPO's mean-only form
    # (Liu et al. 2025), the "mean_norm" mode of verl-agent.
    scale_by_std: bool = True
    # 1: sample std (Bessel), what torch.std computes in verl/verl-agent/RLVMR; 0: population std.
    std_ddof: int = 1

    # -- GiGPO (Feng et al. 2025) ----------------------------------------------------------------
    # A = A_episode + omega * A_step; the step return is discounted by gamma. Paper defaults.
    gigpo_omega: float = 1.0
    gigpo_gamma: float = 0.95

    # -- GRPO-MR (RLVMR, Zhang et al. 2025) -------------------------------------------------------
    # A = A_outcome + alpha * A_meta. 0.5 is `step_advantage_w` in RLVMR's released trainer config
    # (its ALFWorld script overrides it to 1.0); it weights the meta term only, not a convex mix.
    rlvmr_alpha: float = 0.5

    # -- LaMer (Jiang et al. 2025) -----------------------------------------------------------------
    # G_t^(n) = g_t^(n) + sum_{m>n} gamma_traj^(m-n) g_0^(m). gamma_traj = 0.6 is the paper's value;
    # the in-episode gamma_step 0.95 is the released LaMer scripts' `step_gamma`.
    lamer_gamma_traj: float = 0.6
    lamer_gamma_step: float = 0.95

    # -- REINFORCE++ (Hu 2025) over per-step rewards ---------------------------------------------
    # The step return's discount. 0.95 like GiGPO's and LaMer's in-episode step discount (ours:
    # REINFORCE++'s own runs are single-turn, where it does not arise).
    reinforce_gamma: float = 0.95

    # -- token-level GAE over action tokens (PPO) --------------------------------------------------
    # gamma 1.0 because a token is not a time step worth discounting; lam 0.95 (Schulman et al. 2016).
    gae_gamma: float = 1.0
    gae_lam: float = 0.95

    # -- VAGEN bi-level GAE (Wang et al. 2025) -----------------------------------------------------
    # Turn level discounts across turns; token level stays undiscounted inside a turn. VAGEN's code
    # uses a `high_level_gamma` of 0.95 with one lambda for both levels; the per-level lambdas here
    # (turn 0.95, token 1.0) are this project's reading, not a number the paper pins down.
    gamma_turn: float = 0.95
    lambda_turn: float = 0.95
    gamma_token: float = 1.0
    lambda_token: float = 1.0
    # Both GAE estimators: whiten the advantages over the iteration's action tokens (mean 0, std 1)
    # before the update, as verl's GAE does, and VAGEN's bi-level GAE with it. Without it a critic
    # that starts at zero makes every token of a successful episode a large positive advantage and a
    # failed one's almost none. The critic's targets (the returns) stay in reward units.
    whiten: bool = True

    def __post_init__(self) -> None:
        if self.eps < 0:
            raise ValueError(f"eps must not be negative, got {self.eps}")
        if self.std_ddof not in (0, 1):
            raise ValueError(f"std_ddof must be 0 (population) or 1 (sample), got {self.std_ddof}")
        for name in ("gigpo_gamma", "reinforce_gamma", "lamer_gamma_traj", "lamer_gamma_step", "gae_gamma", "gae_lam",
                     "gamma_turn", "lambda_turn", "gamma_token", "lambda_token"):
            unit(name, getattr(self, name))

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any] | None) -> "AdvantageConfig":
        return from_mapping(cls, data)


@dataclass(frozen=True)
class RewardConfig:
    # -- RLVMR meta-reasoning rewards (Zhang et al. 2025) ------------------------------------------
    # Outcome reward on success: 10, the ALFWorld success reward of verl-agent, which RLVMR trains on.
    r_success: float = 10.0
    # Per-tag rewards: 1.0 each in RLVMR's released config (planning/exploration/reflection_reward).
    r_plan: float = 1.0
    r_explore: float = 1.0
    r_reflect: float = 1.0
    # RLVMR gives <monitor> no verifiable rule of its own (its code rewards only the other three).
    r_monitor: float = 0.0
    # A step whose output did not parse: RLVMR's format penalty.
    r_format: float = -0.1
    # Planning reward r_plan * plan_decay**k, k = later planning steps in the trajectory, so the
    # plan that was followed to success earns most. RLVMR's code does not decay (1.0); 0.95 is this
    # project's choice, matching the step discount used elsewhere.
    plan_decay: float = 0.95

    # -- judged reasoning reward (VAGEN) -------------------------------------------------------------
    # r_reason = beta_g * grounding + beta_w * world_modeling, the same weights as envserve's judge.
    beta_grounding: float = 0.5
    beta_world_modeling: float = 0.5

    def __post_init__(self) -> None:
        unit("plan_decay", self.plan_decay)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any] | None) -> "RewardConfig":
        return from_mapping(cls, data)
