"""SFT on expert demonstrations collected through a real server: sequences, packing, learning, resume."""
from __future__ import annotations

import json

import pytest
import torch

from envserve.client import EnvClient
from envserve_trainer.collect import collect
from envserve_trainer.config.train_config import TrainConfig
from envserve_trainer.models.small import build_small_model, weights_digest
from envserve_trainer.policies.hf import sequence_logprobs
from envserve_trainer.sft import (SFTTrainer, build_sequences, group_prefixes, merge_turns, pack,
                                  packed_loss_sum, read_demos)
from envserve_trainer.train import Connection

CONFIG = {
    "env": {"env_id": "frozenlake", "env_config": {"size": 4}, "action_format": "no_think", "num_tasks": 12},
    "rollout": {"history_turns": 0},
    "model": {"random_init": "tiny", "seed": 0},
    "sft": {"epochs": 10, "lr": 1e-2, "batch_size": 8, "warmup_steps": 0, "pack_length": 96,
            "eval_each_epoch": False, "keep_checkpoints": 10},
    "run": {"progress": False},
}


def _cfg(**sections) -> TrainConfig:
    data = json.loads(json.dumps(CONFIG))
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return TrainConfig.from_mapping(data)


@pytest.fixture(scope="module")
def demos(grid_server, grid_tokenizer, tmp_path_factory):
    """Expert FrozenLake episodes through the server, tokenized for the tiny model: the no-history file
    and one whose chat keeps every earlier turn (history_turns 10)."""
    out = {}
    with EnvClient(grid_server.address) as client:
        for name, history in (("flat", 0), ("chat", 10)):
            path = tmp_path_factory.mktemp("demos") / f"{name}.jsonl"
            collect(client, _cfg(rollout={"history_turns": history}), grid_tokenizer, path, list(range(12)))
            out[name] = path
    return out


def test_turns_whose_prompts_extend_each_other_become_one_sequence():
    # turn 2's prompt holds turn 1's prompt and answer (a chat history): one sequence, two loss spans;
    # turn 3 starts over (a history window that dropped turn 1): a sequence of its own.
    p1, c1 = [1, 2, 3], [4, 5]
    p2, c2 = [1, 2, 3, 4, 5, 6, 7], [8]
    p3, c3 = [1, 2, 9], [10, 11]
    assert merge_turns([(p1, c1), (p2, c2), (p3, c3)]) == [
        ([1, 2, 3, 4, 5, 6, 7, 8], [False, False, False, True, True, False, False, True]),
        ([1, 2, 9, 10, 11], [False, False, False, True, True])]
    assert merge_turns([(p1, [])]) == []


def test_sequences_from_chat_demos_carry_every_answer_once(demos, grid_tokenizer):
    records = read_demos([demos["chat"]])
    cfg = _cfg(rollout={"history_turns": 10})
    seqs = build_sequences(records, grid_tokenizer, cfg)
    # one sequence per successful episode, its loss tokens the answers (each closed by eos)
    assert len(seqs) == sum(r["success"] for r in records) == len(records)
    for seq, rec in zip(seqs, records):
        answers = [grid_tokenizer.decode([t for t, keep in zip(seq.ids, seq.loss) if keep])]
        assert answers[0].count("<|im_end|>") == len(rec["turns"])
        for t in rec["turns"]:
            assert t["answer"] in answers[0]


def test_packing_computes_every_sequence_as_if_alone(demos, grid_tokenizer):
    cfg = _cfg()
    model = build_small_model(grid_tokenizer, "tiny", seed=3)
    seqs = build_sequences(read_demos([demos["flat"]]), grid_tokenizer, cfg)[:10]
    prefix = group_prefixes(seqs)[seqs[0].group]
    assert len(prefix) > 32            # the system block is shared, computed once per micro-batch
    with torch.no_grad():
        alone = 0.0
        for s in seqs:
            logp, _ = sequence_logprobs(model, [s.ids[:s.first_loss]], [s.ids[s.first_loss:]], share_prefix=False)
            alone -= float(logp.sum())
        for capacity in (10_000, 64):  # one row holding all, or many rows
            rows = pack(seqs, len(prefix), capacity)
            assert (len(rows) == 1) == (capacity == 10_000)
            total, n = 0.0, 0
            for i in range(0, len(rows), 2):
                part, k = packed_loss_sum(model, rows[i:i + 2], prefix, grid_tokenizer.pad_token_id)
                total, n = total + float(part), n + k
            assert n == sum(sum(s.loss) for s in seqs)
            assert total == pytest.approx(alone, rel=1e-4)


def test_sft_fits_the_demonstrations(grid_server, demos, tmp_path):
    trainer = SFTTrainer(_cfg(), tmp_path, [demos["flat"]], Connection(env_address=grid_server.address))
    records = trainer.run()
    losses = [r["sft"]["loss"] for r in records]
    assert len(records) == trainer.total_steps == 10 * trainer.steps_per_epoch
    # the answers are a handful of words in a fixed format: the loss falls far below its start
    assert losses[-1] < 0.35 * losses[0]
    assert [r["epoch"] for r in records][-1] == 10
    assert (tmp_path / f"checkpoint-{trainer.total_steps}" / "policy" / "config.json").exists()


def test_resume_continues_exactly(grid_server, demos, tmp_path):
    conn = Connection(env_address=grid_server.address)
    straight = SFTTrainer(_cfg(sft={"epochs": 2}), tmp_path / "a", [demos["flat"]], conn)
    straight.run()
    first = SFTTrainer(_cfg(sft={"epochs": 2, "checkpoint_every": 1}), tmp_path / "b", [demos["flat"]], conn)
    half = first.total_steps // 2
    first.run(max_steps=half)
    assert weights_digest(first.model) != weights_digest(straight.model)
    resumed = SFTTrainer(_cfg(sft={"epochs": 2, "checkpoint_every": 1}), tmp_path / "b", [demos["flat"]], conn,
                         resume=True)
    assert resumed.step == half
    resumed.run()
    assert resumed.step == straight.step
    for (name, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), name


def test_bad_demonstration_files_are_clear_errors(grid_server, demos, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(demos["flat"].read_text().splitlines()[0] + "\n{not json\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        read_demos([bad])
    failed = tmp_path / "failed.jsonl"
    failed.write_text("".join(json.dumps({**json.loads(line), "success": False}) + "\n"
                              for line in demos["flat"].read_text().splitlines()))
    with pytest.raises(ValueError, match="no training sequences"):
        SFTTrainer(_cfg(), tmp_path / "out", [failed], Connection(env_address=grid_server.address))
