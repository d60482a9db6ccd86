"""A vision-language policy trained through envserve: VAGEN's visual setting (image-only FrozenLake and Sokoban,
the grounding_worldmodeling format, the judge's rewards for <observation> and <prediction>, bi-level
GAE) end to end through a real replica and a real judge, with tiny random-weight Qwen2-VL and
Idefics3 models; the images a policy reads are exactly the PNGs the replica sent."""
from __future__ import annotations

import asyncio
import json

import pytest
import torch

from serverproc import JudgeProcess, ServerProcess

from envserve.client import EnvClient
from envserve_trainer.config.train_config import TrainConfig
from envserve_trainer.update.learner import latest_checkpoint
from envserve_trainer.models.small import weights_digest
from envserve_trainer.rollout.engine import RolloutEngine, Task
from envserve_trainer.train import Connection, Trainer

MOVES = ["Left", "Down", "Right", "Up"]
# The answer's frame is the prompt's (the response prefix and suffix); the tiny model picks the move.
# A random model never writes VAGEN's tags itself, and the judge scores only turns that hold them.
PREFIX = ("<think><observation>The player is at the start.</observation><reasoning>go</reasoning>"
          "<prediction>The player moves.</prediction></think><answer>")
VAGEN = {
    "env": {"env_id": "frozenlake", "num_tasks": 2, "action_format": "grounding_worldmodeling",
            "env_config": {"size": 4, "render_image": True, "image_only": True, "image_size": 48}},
    "rollout": {"group_size": 2, "tasks_per_iteration": 2, "history_turns": 1, "max_new_tokens": 1,
                "max_turns": 3, "template": "vagen", "response_prefix": PREFIX, "response_suffix": "</answer>",
                "allowed_words": MOVES, "max_images": 2},
    "algo": {"estimator": "bilevel_gae", "use_judge": True},
    "update": {"lr": 1e-3, "micro_batch_size": 8},
    "model": {"random_init": "tiny", "vision": "qwen2_vl"},
    "run": {"iterations": 1, "checkpoint_every": 1, "progress": False},
}


@pytest.fixture(scope="module")
def server():
    with ServerProcess(["frozenlake", "sokoban"], workers=1, metrics=False) as s:
        yield s


def _cfg(**sections) -> TrainConfig:
    data = json.loads(json.dumps(VAGEN))
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return TrainConfig.from_mapping(data)


def _replayed_images(address: str, env_config: dict, seed: int, actions: list[str]) -> list[bytes]:
    """The PNG of each observation of an episode, from a fresh session replaying its actions."""
    with EnvClient(address) as c:
        [sid] = c.open("frozenlake", 1, env_config, "grounding_worldmodeling")
        try:
            [r] = c.reset([sid], [seed])
            pngs = [r.observation.images[0].png]
            for a in actions:
                [r] = c.step([(sid, a)])
                pngs.append(r.observation.images[0].png)
            return pngs
        finally:
            c.close_sessions([sid])


@pytest.mark.parametrize(("env_id", "arch"), [("frozenlake", "qwen2_vl"), ("frozenlake", "idefics3"),
                                              ("sokoban", "qwen2_vl")])
def test_a_vagen_iteration_trains_a_vlm_on_an_image_only_grid(server, tmp_path, env_id, arch):
    with JudgeProcess(server.address) as judge:
        pictures = {"render_image": True, "image_only": True, "image_size": 48}
        env = {"env_id": env_id, "env_config": VAGEN["env"]["env_config"] if env_id == "frozenlake" else pictures}
        cfg = _cfg(model={"random_init": "tiny", "vision": arch}, env=env)
        trainer = Trainer(cfg, tmp_path, Connection(env_address=server.address, judge_address=judge.address))
        before = weights_digest(trainer.learner.model)
        critic_before = {k: v.clone() for k, v in trainer.learner.critic.state_dict().items()}
        try:
            [record] = asyncio.run(trainer.run())
        finally:
            trainer.close()
    u = record["update"]
    assert u["samples"] > 0 and all(torch.isfinite(torch.tensor(v)) for v in u.values())
    assert weights_digest(trainer.learner.model) != before
    # The critic (the VLM's body with its vision tower, a value head) learned from bi-level GAE's returns.
    assert u["value_loss"] >= 0
    assert any(not torch.equal(v, critic_before[k]) for k, v in trainer.learner.critic.state_dict().items())
    # Every turn's <observation> and <prediction> went to the judge and came back scored.
    assert record["timing"]["judged_items"] > 0
    # The checkpoint is a VLM folder that reloads to the trained weights.
    from envserve_trainer.models.vision import load_vlm
    model, processor = load_vlm(latest_checkpoint(tmp_path) / "policy")
    assert weights_digest(model) == weights_digest(trainer.learner.model)


def test_the_policy_reads_exactly_the_pngs_the_replica_sent(server):
    from envserve.client import AsyncEnvClient
    from envserve_trainer.policies.vision import HFVisionPolicy, VisionCodec
    from envserve_trainer.models.vision import build_vlm

    cfg = _cfg(rollout={**VAGEN["rollout"], "max_turns": 4, "history_turns": 3, "max_images": 2})
    model, processor = build_vlm("qwen2_vl", seed=1)
    policy = HFVisionPolicy(model, VisionCodec(processor, max_images=2))

    async def collect():
        client = AsyncEnvClient(server.address)
        engine = RolloutEngine(client, policy, policy.tokenizer, cfg, seed=3)
        try:
            return await engine.collect([Task(5), Task(6)], 2)
        finally:
            await engine.close()
            await client.close()

    trials = asyncio.run(collect())
    turns = 0
    for trial in trials:
        ep = trial.episodes[0]
        truth = _replayed_images(server.address, cfg.env.env_config, ep.task_seed, [t.action for t in ep.turns])
        for k, turn in enumerate(ep.turns):
            # The context holds this turn's picture last, after the kept turns' pictures, never more
            # than max_images of them: the history window gives way to the bound.
            assert turn.prompt_images[-1] == truth[k]
            assert turn.prompt_images == truth[max(0, k - 1):k + 1]
            image_tokens = sum(1 for t in turn.prompt_ids if t == policy.codec.image_token_id)
            assert image_tokens > 0 and image_tokens % len(turn.prompt_images) == 0
            turns += 1
    assert turns > len(trials)   # some episodes ran several turns, so the history was exercised


def test_an_image_only_observation_without_its_image_ends_the_trial_with_a_clear_error(server):
    """A text-only session under an image-only config (the replica sends no picture): the trial is
    dropped with the reason, the rollout goes on."""
    from envserve.client import AsyncEnvClient
    from envserve_trainer.policies.vision import HFVisionPolicy, VisionCodec
    from envserve_trainer.models.vision import build_vlm

    cfg = _cfg()
    model, processor = build_vlm("qwen2_vl", seed=1)
    policy = HFVisionPolicy(model, VisionCodec(processor, max_images=2))

    class NoPictures(AsyncEnvClient):
        """The real client, opening its sessions without pictures (what a misconfigured replica sends)."""
        async def open_with_prompt(self, env_id, count=1, config=None, action_format=""):
            plain = {k: v for k, v in (config or {}).items() if k not in ("render_image", "image_only")}
            return await super().open_with_prompt(env_id, count, plain, action_format)

    async def collect():
        client = NoPictures(server.address)
        engine = RolloutEngine(client, policy, policy.tokenizer, cfg, seed=3)
        try:
            return await engine.collect([Task(5)], 2)
        finally:
            await engine.close()
            await client.close()

    trials = asyncio.run(collect())
    assert len(trials) == 2
    assert all("image-only observation came without its image" in t.info["error"] for t in trials)
