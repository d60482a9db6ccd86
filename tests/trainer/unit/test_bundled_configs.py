"""Every bundled config loads as the trainer reads it; a learning bench's own section sits beside the
trainer's sections without reaching them."""
from __future__ import annotations

import pytest
import yaml

from envserve_trainer.config.loading import BUNDLED_CONFIGS
from envserve_trainer.config.train_config import TrainConfig


@pytest.mark.parametrize("path", sorted(BUNDLED_CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_bundled_config_loads(path):
    TrainConfig.load(path)


def test_the_vlm_bench_config_is_vagens_visual_setting_with_its_own_section():
    path = BUNDLED_CONFIGS / "learn_vlm_frozenlake.yaml"
    cfg = TrainConfig.load(path)
    assert cfg.model.vision == "qwen2_vl" and cfg.model.random_init in ("tiny", "small")
    assert cfg.env.env_config["image_only"] and cfg.env.env_config["render_image"]
    assert (cfg.env.action_format, cfg.rollout.template) == ("grounding_worldmodeling", "vagen")
    bench = yaml.safe_load(path.read_text())["bench"]
    assert len(bench["rl_seeds"]) == 2 and bench["minutes"] == 60 and bench["quick"]
    # The demonstrations' expert is one registered for this env.
    from envserve.client.experts import EXPERTS
    assert EXPERTS[bench["expert"]].env_id == cfg.env.env_id
    # RL plays maps of its own: neither the demonstrated ones nor the held-out ones.
    rl = cfg.with_overrides(**bench["rl"]).env
    rl_maps = set(range(rl.seed_start, rl.seed_start + rl.num_tasks))
    assert not rl_maps & set(range(cfg.env.seed_start, cfg.env.seed_start + cfg.env.num_tasks))
    assert not rl_maps & set(range(cfg.env.eval_seed_start, cfg.env.eval_seed_start + cfg.env.eval_tasks))
    # The perception warm-up's boards (and its held-out ones) are apart from every other stage's too.
    p = cfg.perception
    assert p.boards and p.captions == bench["expert"] and p.sft_boards <= p.boards
    seen = set(range(p.seed_start, p.seed_start + p.boards + p.held_out))
    assert not seen & (rl_maps | set(range(cfg.env.seed_start, cfg.env.seed_start + cfg.env.num_tasks))
                       | set(range(cfg.env.eval_seed_start, cfg.env.eval_seed_start + cfg.env.eval_tasks)))
    # The neighbour expert moves once a turn; its detour draws from moves the env takes.
    assert cfg.env.env_config["max_actions_per_turn"] == 1 and bench["detour"] > 0
    assert set(bench["detour_actions"]) <= set(cfg.perception.actions)
    # The section is the bench's: the trainer's own mapping refuses it.
    with pytest.raises(ValueError, match="unknown config section"):
        TrainConfig.from_mapping(yaml.safe_load(path.read_text()))
