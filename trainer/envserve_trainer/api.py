"""The trainer's public names, one import away: `from envserve_trainer.api import TrainConfig, Trainer`.

Each name is looked up in its module on first use, so importing this module loads nothing heavy (torch,
transformers) until a name that needs it is asked for.
"""
from __future__ import annotations

import importlib

# name -> the module (under envserve_trainer) that defines it
EXPORTS: dict[str, str] = {
    # config
    "TrainConfig": "config.train_config", "BENCH_SECTION": "config.train_config",
    "AdvantageConfig": "config.algo", "RewardConfig": "config.algo",
    "load_config": "config.loading", "BUNDLED_CONFIGS": "config.loading",
    # models
    "build_small_model": "models.small", "build_tokenizer": "models.small", "corpus_from_envs": "models.small",
    "weights_digest": "models.small",
    "build_vlm": "models.vision", "load_vlm": "models.vision", "load_vlm_processor": "models.vision",
    "load_pretrained": "models.pretrained", "load_tokenizer": "models.pretrained", "save_model": "models.pretrained",
    # policies
    "Policy": "policies.base", "Generation": "policies.base",
    "HFPolicy": "policies.hf", "sequence_logprobs": "policies.hf", "shared_prefix_length": "policies.hf",
    "HFVisionPolicy": "policies.vision", "VisionCodec": "policies.vision", "vision_codec": "policies.vision",
    "OpenAIPolicy": "policies.openai", "OpenAIPolicyConfig": "policies.openai",
    "VLLMPolicy": "policies.vllm", "VLLMPolicyConfig": "policies.vllm",
    # methods
    "group_normalize": "methods.common", "discounted_returns": "methods.common",
    "grpo_advantages": "methods.grpo", "gigpo_advantages": "methods.gigpo", "grpo_mr_advantages": "methods.grpo_mr",
    "lamer_advantages": "methods.lamer", "reinforce_pp_advantages": "methods.reinforce_pp",
    "masked_gae": "methods.gae", "bilevel_gae": "methods.gae",
    "MCSettings": "methods.process.montecarlo", "StatePoint": "methods.process.montecarlo",
    "estimate": "methods.process.montecarlo", "random_valid_policy": "methods.process.montecarlo",
    # rollout
    "Episode": "rollout.trajectory", "Trial": "rollout.trajectory", "Turn": "rollout.trajectory",
    "ChatLayout": "rollout.prompting", "ContextBuilder": "rollout.prompting",
    "RolloutEngine": "rollout.engine", "Task": "rollout.engine",
    "perceive": "rollout.perception",
    # samples, update
    "Sample": "samples.build", "build_samples": "samples.build",
    "Learner": "update.learner", "latest_checkpoint": "update.learner", "checkpoints": "update.learner",
    # entry points
    "Connection": "train", "Trainer": "train", "build_policy_model": "train", "build_vision_policy_model": "train",
    "evaluate_policy": "train", "evaluate_checkpoint": "train", "eval_task_sets": "train", "judge_trials": "train",
    "policy_folder": "train",
    "SFTTrainer": "sft", "collect": "collect", "load_records": "collect",
    "MetricsLog": "evaluation", "summarize": "evaluation", "read_metrics": "evaluation", "plot_curves": "curves",
    "main": "cli",
}

__all__ = sorted(EXPORTS)


def __getattr__(name: str):
    module = EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__package__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
