"""Expert demonstrations with pictures, and SFT of a vision-language model on them, through a real
server: image-only FrozenLake in VAGEN's grounding_worldmodeling format, a tiny random-weight Qwen2-VL.
Each recorded turn keeps the PNGs the replica sent; the samples put them where the rollout does; SFT
lowers the loss on them and resumes exactly; a damaged picture is a clear error naming its line."""
from __future__ import annotations

import base64
import json

import pytest
import torch

from envserve.client import EnvClient
from envserve_trainer.collect import collect, episode_samples_with_images, load_records, turn_images
from envserve_trainer.config.train_config import TrainConfig
from envserve_trainer.models.small import weights_digest
from envserve_trainer.rollout.prompting import ChatLayout
from envserve_trainer.sft import SFTTrainer, read_demos
from envserve_trainer.train import Connection, build_vision_policy_model
from envserve_trainer.policies.vision import vision_codec

ENV_CONFIG = {"size": 4, "render_image": True, "image_only": True, "image_size": 48}
CONFIG = {
    "env": {"env_id": "frozenlake", "env_config": ENV_CONFIG, "action_format": "grounding_worldmodeling",
            "num_tasks": 6},
    "rollout": {"template": "vagen", "history_turns": 1, "max_images": 2, "max_turns": 6},
    "model": {"random_init": "tiny", "vision": "qwen2_vl", "seed": 0},
    "sft": {"epochs": 6, "lr": 1e-2, "batch_size": 4, "warmup_steps": 0, "micro_batch_rows": 4,
            "eval_each_epoch": False, "keep_checkpoints": 10},
    "run": {"progress": False},
}


def _cfg(**sections) -> TrainConfig:
    data = json.loads(json.dumps(CONFIG))
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return TrainConfig.from_mapping(data)


@pytest.fixture(scope="module")
def vlm_demos(grid_server, tmp_path_factory):
    """Expert episodes on image-only FrozenLake, tokenized for the tiny VLM SFTTrainer builds (its
    tokenizer comes from the env's texts, so the processor here is the one SFT will have)."""
    cfg = _cfg()
    _, processor = build_vision_policy_model(cfg, "cpu", Connection(env_address=grid_server.address))
    codec = vision_codec(cfg, processor)
    path = tmp_path_factory.mktemp("vlm-demos") / "demos.jsonl"
    with EnvClient(grid_server.address) as client:
        summary = collect(client, cfg, codec.tokenizer, path, list(range(6)), codec=codec)
    assert summary["episodes"] == 6 and summary["successes"] == 6
    return path, codec


def _replayed_images(address: str, seed: int, answers: list[str]) -> list[bytes]:
    """The PNG of each observation an episode's answers meet, from a fresh session of the replica."""
    with EnvClient(address) as c:
        [sid] = c.open("frozenlake", 1, ENV_CONFIG, "grounding_worldmodeling")
        try:
            [r] = c.reset([sid], [seed])
            pngs = [r.observation.images[0].png]
            for a in answers:
                [r] = c.step([(sid, a)])
                pngs.append(r.observation.images[0].png)
            return pngs
        finally:
            c.close_sessions([sid])


def test_demonstrations_carry_the_exact_pngs_the_replica_sent(grid_server, vlm_demos):
    path, codec = vlm_demos
    cfg = _cfg()
    records = load_records(path)
    assert records and all(r["vision"] == "qwen2_vl" and r["max_images"] == 2 for r in records)
    multi_turn = 0
    for rec in records:
        turns = rec["turns"]
        truth = _replayed_images(grid_server.address, rec["seed"], [t["answer"] for t in turns])
        assert [turn_images(t) for t in turns] == [[png] for png in truth[:len(turns)]]
        assert all(t["observation"] == "The observation is the image." for t in turns)
        # The samples hold the turn's picture last, after the history window's, as the rollout builds them.
        rebuilt = episode_samples_with_images(ChatLayout(codec.tokenizer, codec),
                                              {k: v for k, v in rec.items() if k != "samples"}, cfg)
        for k, (sample, (prompt, completion, images)) in enumerate(zip(rec["samples"], rebuilt)):
            assert images == truth[max(0, k - 1):k + 1]
            assert [truth[i] for i, _ in sample["image_refs"]] == images
            assert (sample["prompt_ids"], sample["completion_ids"]) == (prompt, completion)
            image_tokens = sum(1 for t in prompt if t == codec.image_token_id)
            assert image_tokens > 0 and image_tokens % len(images) == 0
        multi_turn += len(turns) > 1
    assert multi_turn   # some episodes ran several turns, so the history's pictures were exercised


def test_sft_on_image_demonstrations_lowers_the_loss(grid_server, vlm_demos, tmp_path):
    path, _ = vlm_demos
    trainer = SFTTrainer(_cfg(), tmp_path, [path], Connection(env_address=grid_server.address))
    assert all(s.images for s in trainer.sequences)
    before = trainer.loss()
    records = trainer.run()
    after = trainer.loss()
    assert len(records) == trainer.total_steps
    assert after < 0.6 * before, (before, after)
    # The checkpoint is a VLM folder (weights and processor) that reloads to the trained weights.
    from envserve_trainer.models.vision import load_vlm
    model, processor = load_vlm(tmp_path / f"checkpoint-{trainer.total_steps}" / "policy")
    assert weights_digest(model) == weights_digest(trainer.model)
    assert processor.tokenizer.get_vocab() == trainer.tokenizer.get_vocab()
    # `envserve-train eval --checkpoint` plays it through the service, pictures in its prompts.
    import asyncio
    from envserve_trainer.train import evaluate_checkpoint
    cfg = _cfg(env={"eval_tasks": 2}, rollout={"max_turns": 2, "max_new_tokens": 8})
    summary = asyncio.run(evaluate_checkpoint(cfg, tmp_path / f"checkpoint-{trainer.total_steps}",
                                              Connection(env_address=grid_server.address)))
    assert summary["held_out"]["overall"]["episodes"] == 2


def test_sft_on_image_demonstrations_resumes_exactly(grid_server, vlm_demos, tmp_path):
    path, _ = vlm_demos
    conn = Connection(env_address=grid_server.address)
    straight = SFTTrainer(_cfg(sft={"epochs": 2}), tmp_path / "a", [path], conn)
    straight.run()
    first = SFTTrainer(_cfg(sft={"epochs": 2, "checkpoint_every": 1}), tmp_path / "b", [path], conn)
    half = first.total_steps // 2
    assert half >= 1
    first.run(max_steps=half)
    assert weights_digest(first.model) != weights_digest(straight.model)
    resumed = SFTTrainer(_cfg(sft={"epochs": 2, "checkpoint_every": 1}), tmp_path / "b", [path], conn, resume=True)
    assert resumed.step == half
    resumed.run()
    assert resumed.step == straight.step
    for (name, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), name


def test_perception_captions_train_beside_the_demonstrations(grid_server, vlm_demos, tmp_path):
    from envserve_trainer.rollout.perception import captioner, gather_views
    path, codec = vlm_demos
    conn = Connection(env_address=grid_server.address)
    perception = {"captions": "frozenlake_neighbours", "sft_boards": 3, "moves": 3}
    plain = SFTTrainer(_cfg(), tmp_path / "plain", [path], conn)
    mixed = SFTTrainer(_cfg(perception=perception), tmp_path / "mixed", [path], conn)
    demos = len(plain.sequences)
    captions = mixed.sequences[demos:]
    # The demonstrations as before, then one (view, caption) pair per view of the boards.
    assert [(s.prompt_ids, s.completion_ids, s.images) for s in mixed.sequences[:demos]] == \
        [(s.prompt_ids, s.completion_ids, s.images) for s in plain.sequences]
    with EnvClient(grid_server.address) as client:
        views = gather_views(client, mixed.cfg, range(50_000, 50_003))
    assert mixed.caption_samples == len(captions) == len(views) > 3
    caption = captioner("frozenlake_neighbours")
    for sample, view in zip(captions, views):
        assert sample.images == [view.png]
        said = codec.tokenizer.decode(sample.completion_ids, skip_special_tokens=True)
        assert said == caption(view.state)
    assert any("hole" in caption(v.state) for v in views)
    assert mixed.steps_per_epoch > plain.steps_per_epoch
    # The captions are learned with the rest: their loss falls as SFT runs.
    before = mixed.loss(captions)
    mixed.run(max_steps=6)
    assert mixed.loss(captions) < before
    # No service to gather views through, no captioning expert: clear errors before training.
    from envserve_trainer.train import policy_folder
    saved = {"path": str(policy_folder(plain.save())), "random_init": ""}
    with pytest.raises(ValueError, match="gathers its views through the service"):
        SFTTrainer(_cfg(perception=perception, model=saved), tmp_path / "none", [path], None)
    with pytest.raises(ValueError, match="perception.sft_boards mixes captions into SFT: name perception.captions"):
        _cfg(perception={"sft_boards": 3})


def _rewrite(path, out, change):
    lines = path.read_text().splitlines()
    rec = json.loads(lines[1])
    change(rec)
    lines[1] = json.dumps(rec)
    out.write_text("\n".join(lines) + "\n")
    return out


def test_a_missing_or_corrupt_picture_is_an_error_naming_its_line(vlm_demos, tmp_path):
    path, _ = vlm_demos
    missing = _rewrite(path, tmp_path / "missing.jsonl", lambda r: r["turns"][0].pop("images"))
    with pytest.raises(ValueError, match=r"missing.jsonl:2: turns\[0\] of an image-only episode has no image"):
        read_demos([missing])
    png = base64.b64decode(json.loads(path.read_text().splitlines()[1])["turns"][0]["images"][0])
    cut = base64.b64encode(png[:len(png) // 2]).decode()
    corrupt = _rewrite(path, tmp_path / "corrupt.jsonl", lambda r: r["turns"][0].update(images=[cut]))
    with pytest.raises(ValueError, match=r"corrupt.jsonl:2: turns\[0\].images\[0\] is not a readable PNG"):
        read_demos([corrupt])
    text = _rewrite(path, tmp_path / "text.jsonl", lambda r: r["turns"][0].update(images=["not base64!"]))
    with pytest.raises(ValueError, match=r"text.jsonl:2: turns\[0\].images\[0\] is not a readable PNG"):
        read_demos([text])


def test_cli_collects_pictured_demonstrations_for_a_saved_vlm(grid_server, tmp_path, capsys):
    from envserve_trainer.cli import main
    from envserve_trainer.models.vision import build_vlm
    model, processor = build_vlm("qwen2_vl", seed=2)
    folder = tmp_path / "vlm"
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    data = json.loads(json.dumps(CONFIG))
    data["model"] = {"path": str(folder), "vision": "qwen2_vl"}
    cfg_file = tmp_path / "cfg.json"
    cfg_file.write_text(json.dumps(data))
    out = tmp_path / "demos.jsonl"
    assert main(["collect", "--config", str(cfg_file), "--env-address", grid_server.address, "--out", str(out),
                 "--episodes", "2"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["episodes"] == 2
    for rec in load_records(out):
        assert rec["vision"] == "qwen2_vl" and all(turn_images(t) for t in rec["turns"])
        assert all(s["image_refs"] and processor.image_token_id in s["prompt_ids"] for s in rec["samples"])
