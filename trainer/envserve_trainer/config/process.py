"""Defaults of the process-reward methods, one frozen dataclass per method.

Numbers the papers give are marked with the paper (or "paper"); the rest are envserve's choices,
marked "ours" with the reason, so that nothing a method depends on is a literal in the code. Each class
builds from a YAML/JSON mapping with `from_mapping`, which refuses unknown keys and wrong types
(as AdvantageConfig does); the trainer config's process section holds one of each.
"""
from __future__ import annotations

from dataclasses import dataclass

from .checks import FromMapping, one_of, positive, unit


@dataclass(frozen=True)
class DPOConfig(FromMapping):
    # DPO's temperature beta on the log-ratio margin; 0.1 is the value of Rafailov et al. 2023,
    # which IPR and RRO train with.
    beta: float = 0.1

    def __post_init__(self) -> None:
        positive("DPOConfig.beta", self.beta)


@dataclass(frozen=True)
class AgentPRMConfig(FromMapping):
    # Q-hat(s, a) is the mean discounted return from (s, a). Ours: 1.0, so that with a 0/1 outcome
    # Q-hat is the success probability from (s, a), the quantity AgentPRM's BCE target stands for.
    gamma: float = 1.0
    # Returns map linearly onto [0, 1], clipped: (Q - low) / (high - low). [0, 1] fits a 0/1
    # outcome; set high to the success reward elsewhere (10 for verl-agent's ALFWorld reward).
    return_low: float = 0.0
    return_high: float = 1.0

    def __post_init__(self) -> None:
        unit("AgentPRMConfig.gamma", self.gamma)
        if self.return_high <= self.return_low:
            raise ValueError("AgentPRMConfig.return_high must exceed return_low")


@dataclass(frozen=True)
class InversePRMConfig(FromMapping):
    # The discount in sigma(Q(s,a) - gamma Q(s',a')). Ours: 0.99, the usual discount of inverse RL's
    # shaped reward (with gamma 1 a constant Q would make every transition's logit 0).
    gamma: float = 0.99

    def __post_init__(self) -> None:
        unit("InversePRMConfig.gamma", self.gamma)


CLUSTER_BY = ("key", "jaccard")


@dataclass(frozen=True)
class ProgRMConfig(FromMapping):
    # How successful trajectories are grouped before their LCS is taken (ours): "key" groups by the
    # task key the caller gives (env id + task type, say); "jaccard" joins a trajectory to the first
    # cluster holding a member whose action set overlaps it by at least the threshold.
    cluster_by: str = "key"
    jaccard_threshold: float = 0.5
    # A cluster with fewer successes gives no recipe: one trajectory's LCS is itself, noise included.
    min_cluster_size: int = 2

    def __post_init__(self) -> None:
        one_of("ProgRMConfig.cluster_by", self.cluster_by, CLUSTER_BY)
        unit("ProgRMConfig.jaccard_threshold", self.jaccard_threshold)
        if self.min_cluster_size < 1:
            raise ValueError("ProgRMConfig.min_cluster_size must be >= 1")


@dataclass(frozen=True)
class IPRConfig(FromMapping):
    # m rollouts after the expert's step and after the alternative, each (ours: 5, a small MC budget).
    rollouts_per_step: int = 5
    # Expert steps compared per trajectory, evenly spaced over it (ours; 0: every step). Long
    # trajectories (ALFWorld's 10-30 turns) cost 2 m rollouts a step.
    max_steps: int = 0
    # A step pair needs mean returns further apart than this (0: any strict difference).
    margin: float = 0.0
    # IPR keeps the pairs where the expert's step wins (the expert is the reference of good play);
    # True also keeps the pairs where the policy's alternative beats the expert's step.
    both_directions: bool = False
    beta: float = 0.1                 # DPO temperature (DPOConfig)
    # loss = w_outcome * outcome-DPO + w_step * step-DPO + w_sft * SFT: IPR's paper sums the three.
    outcome_weight: float = 1.0
    step_weight: float = 1.0
    sft_weight: float = 1.0

    def __post_init__(self) -> None:
        if self.rollouts_per_step < 1:
            raise ValueError("IPRConfig.rollouts_per_step must be >= 1")
        if self.max_steps < 0:
            raise ValueError("IPRConfig.max_steps must be >= 0")
        if self.margin < 0:
            raise ValueError("IPRConfig.margin must be >= 0")
        positive("IPRConfig.beta", self.beta)
        for name in ("outcome_weight", "step_weight", "sft_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"IPRConfig.{name} must be >= 0")


@dataclass(frozen=True)
class RROConfig(FromMapping):
    # Process reward of a prefix = the mean outcome of m rollouts from it (ours: 5).
    rollouts_per_prefix: int = 5
    # Candidates sampled at one step at most before the search gives up on rising (ours: 8; the
    # paper reports about 1.9 explored on average, so the cap rarely binds).
    max_candidates: int = 8
    beta: float = 0.1                 # DPO temperature of the (best, worst) pairs (DPOConfig)

    def __post_init__(self) -> None:
        if self.rollouts_per_prefix < 1 or self.max_candidates < 1:
            raise ValueError("RROConfig.rollouts_per_prefix and max_candidates must be >= 1")
        positive("RROConfig.beta", self.beta)


ENTROPY_SCALES = ("log_vocab", "none")
ARPO_ADVANTAGE_MODES = ("soft", "hard")


@dataclass(frozen=True)
class ARPOConfig(FromMapping):
    # Branch when alpha + beta * dH > threshold (ARPO's paper: 0.5 / 0.2 / 0.5). With alpha equal to the
    # threshold, any rise of entropy branches and any fall does not.
    alpha: float = 0.5
    beta: float = 0.2
    threshold: float = 0.5
    # Entropy is measured over the first k tokens after an environment response (ours: 10).
    entropy_tokens: int = 10
    # dH = (H_t - H_initial) / ln|V| ("log_vocab": entropies as fractions of the uniform's, so the
    # score does not depend on the vocabulary's size; our reading of ARPO's normalisation) or raw nats.
    entropy_scale: str = "log_vocab"
    # Global budget M, the N initial (whole-trajectory) samples, Z branches per branching point
    # (ours: 16 / 8 / 2, half the budget to branching).
    total_rollouts: int = 16
    initial_rollouts: int = 8
    branches: int = 2
    # soft: each trajectory keeps its own advantage on every token (shared tokens then receive the
    # branches' mean through the summed loss); hard: shared tokens are given that mean explicitly.
    advantage_mode: str = "soft"

    def __post_init__(self) -> None:
        if self.entropy_tokens < 1 or self.branches < 1:
            raise ValueError("ARPOConfig.entropy_tokens and branches must be >= 1")
        if not 0 < self.initial_rollouts <= self.total_rollouts:
            raise ValueError("ARPOConfig needs 0 < initial_rollouts <= total_rollouts")
        one_of("ARPOConfig.entropy_scale", self.entropy_scale, ENTROPY_SCALES)
        one_of("ARPOConfig.advantage_mode", self.advantage_mode, ARPO_ADVANTAGE_MODES)
