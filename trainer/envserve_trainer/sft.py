"""Supervised fine-tuning on expert demonstrations (the JSONL `envserve-train collect` writes), before RL.

    envserve-train sft --config FILE --data demos.jsonl [--data more.jsonl] --output-dir DIR
                       [--env-address HOST:PORT | --directory redis://...] [--resume]

What it trains on: each turn's (prompt, completion) exactly as the RL rollout will show it to the
policy (the samples collect wrote with this tokenizer and prompt template, or rebuilt from the
recorded turns for another). The loss is the cross-entropy of the assistant's tokens only; the
prompt (the env's rules, observations, earlier turns) is context.

Sequences: the turns of an episode whose prompts extend one another (a chat history window that
covers the episode) become one sequence with a loss span per answer, so their common history is
computed once instead of once per turn.

Packing: sequences that begin with the same system block share it as a prefix computed once per
micro-batch (policy/hf.py's prefix cache). The rest of each sequence is packed with others into rows
of `pack_length` tokens (first fit, longest first) under a block-diagonal causal mask: a token sees
the prefix and the earlier tokens of its own sequence, never a neighbour's, and each sequence's
positions continue from the prefix, so a packed sequence is computed exactly as it would be alone.

A vision-language policy (model.vision) trains on the same samples with the images each prompt
holds (the recorded observations' PNGs, placed as the rollout places them), one (prompt, completion)
per row scored through policies.vision.vision_sequence_logprobs, `micro_batch_rows` samples per forward:
neither turn merging nor packing applies, since the image tokens' positions depend on the whole
prompt (Qwen2-VL's 3-D rope). Its checkpoints hold the processor, and vision_model.load_vlm reads them.

Checkpoints are the RL trainer's (checkpoint-<step>/: policy/ as save_pretrained with its tokenizer,
optimizer.pt, trainer_state.json), so `model.path: DIR/checkpoint-N/policy` starts RL from one and
`envserve-train eval --checkpoint` evaluates one. The data order is a function of (seed, epoch) and
the learning rate of the step, so --resume continues from the newest checkpoint exactly.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from .config.train_config import TrainConfig
from .evaluation import MetricsLog, Progress, summarize
from .policies.hf import prefix_cache, shared_prefix_length
from .rollout.prompting import ChatLayout
from .update.learner import STATE_FILE, checkpoints, latest_checkpoint

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"


# -- data ------------------------------------------------------------------------------------------
def read_demos(paths: Iterable[str | Path]) -> list[dict[str, Any]]:
    """Episode records from collect's JSONL files (each line checked; an error names file and line)."""
    from .collect import load_records
    return [record for path in paths for record in load_records(path)]


@dataclass
class SFTSequence:
    ids: list[int]
    loss: list[bool]                # loss[i]: ids[i] is an assistant token, predicted from ids[:i]
    group: str = ""                 # sequences of one group share their system block

    @property
    def first_loss(self) -> int:
        return self.loss.index(True)


def merge_turns(samples: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[tuple[list[int], list[bool]]]:
    """An episode's (prompt, completion) pairs as sequences: a turn whose prompt starts with the
    previous sequence (its prompt and answer) extends it; any other starts a new one."""
    out: list[tuple[list[int], list[bool]]] = []
    for prompt, completion in samples:
        prompt, completion = list(prompt), list(completion)
        if not completion:
            continue
        if out and len(prompt) >= len(out[-1][0]) and prompt[:len(out[-1][0])] == out[-1][0]:
            ids, loss = out[-1]
            extra = prompt[len(ids):]
            ids += extra + completion
            loss += [False] * len(extra) + [True] * len(completion)
        else:
            out.append((prompt + completion, [False] * len(prompt) + [True] * len(completion)))
    return out


def record_samples(record: dict[str, Any], tokenizer, layout: ChatLayout, cfg: TrainConfig,
                   tokenizer_key: str) -> list[tuple[list[int], list[int]]]:
    """The record's training pairs for this tokenizer and prompt template: the stored ones when they
    were made for both, else rebuilt from its turns."""
    ro = cfg.rollout
    stored = record.get("samples")
    made_for = (record.get("tokenizer"), record.get("template"), record.get("history_turns"),
                record.get("response_prefix", ""), record.get("response_suffix", ""))
    if stored and made_for == (tokenizer_key, ro.template, ro.history_turns, ro.response_prefix, ro.response_suffix):
        return [(list(s["prompt_ids"]), list(s["completion_ids"])) for s in stored]
    from .collect import episode_samples
    return [(list(p), list(c)) for p, c in episode_samples(layout, record, cfg)]


@dataclass
class VisionSample:
    """One turn of a demonstration for a vision-language model: its prompt holds `images`, in order."""
    prompt_ids: list[int]
    completion_ids: list[int]
    images: list[bytes]
    group: str = ""


def vision_record_samples(record: dict[str, Any], codec, cfg: TrainConfig,
                          tokenizer_key: str) -> list[tuple[list[int], list[int], list[bytes]]]:
    """The record's (prompt, completion, images) for this VLM and prompt template: the stored samples
    (their image_refs resolved into the turns' PNGs) when they were made for both, else rebuilt."""
    from .collect import episode_samples_with_images, turn_images
    ro = cfg.rollout
    stored = record.get("samples")
    made_for = (record.get("tokenizer"), record.get("template"), record.get("history_turns"),
                record.get("response_prefix", ""), record.get("response_suffix", ""), record.get("vision"),
                record.get("max_images"))
    if stored and all("image_refs" in s for s in stored) and made_for == (
            tokenizer_key, ro.template, ro.history_turns, ro.response_prefix, ro.response_suffix, codec.arch,
            ro.max_images):
        pngs = [turn_images(t) for t in record["turns"]]
        return [(list(s["prompt_ids"]), list(s["completion_ids"]), [pngs[i][k] for i, k in s["image_refs"]])
                for s in stored]
    return episode_samples_with_images(ChatLayout(codec.tokenizer, codec), record, cfg)


def build_vision_samples(records: Sequence[dict[str, Any]], codec, cfg: TrainConfig) -> list[VisionSample]:
    from .models.pretrained import tokenizer_id
    key = tokenizer_id(codec.tokenizer)
    out = []
    for n, rec in enumerate(records):
        if cfg.sft.only_success and not rec.get("success"):
            continue
        group = f"{rec.get('env_id', '')}\x1f{rec.get('system_prompt', '')}"
        try:
            samples = vision_record_samples(rec, codec, cfg, key)
        except ValueError as e:   # an image the model cannot take (VisionError is one)
            raise ValueError(f"demonstration {n + 1} ({rec.get('env_id')} seed {rec.get('seed')}): {e}") from None
        out += [VisionSample(p, c, imgs, group) for p, c, imgs in samples if c]
    return out


def build_sequences(records: Sequence[dict[str, Any]], tokenizer, cfg: TrainConfig) -> list[SFTSequence]:
    from .models.pretrained import tokenizer_id
    layout = ChatLayout(tokenizer)
    key = tokenizer_id(tokenizer)
    out = []
    for rec in records:
        if cfg.sft.only_success and not rec.get("success"):
            continue
        group = f"{rec.get('env_id', '')}\x1f{rec.get('system_prompt', '')}"
        for ids, loss in merge_turns(record_samples(rec, tokenizer, layout, cfg, key)):
            out.append(SFTSequence(ids, loss, group))
    return out


def group_prefixes(seqs: Sequence[SFTSequence]) -> dict[str, list[int]]:
    """Per group, the tokens all its sequences begin with, stopping before any sequence's first
    answer token's predecessor (that token must be in the row to predict it)."""
    by_group: dict[str, list[SFTSequence]] = {}
    for s in seqs:
        by_group.setdefault(s.group, []).append(s)
    out = {}
    for g, members in by_group.items():
        n = shared_prefix_length([m.ids for m in members]) if len(members) > 1 else 0
        n = min([n] + [m.first_loss - 1 for m in members])
        out[g] = members[0].ids[:max(n, 0)]
    return out


@dataclass
class PackedRow:
    pieces: list[SFTSequence] = field(default_factory=list)
    length: int = 0


def pack(seqs: Sequence[SFTSequence], prefix_len: int, capacity: int) -> list[PackedRow]:
    """First-fit-decreasing packing of the sequences' tokens after the prefix into rows of at most
    `capacity` tokens; a longer sequence gets a row of its own."""
    rows: list[PackedRow] = []
    for s in sorted(seqs, key=lambda x: -len(x.ids)):
        n = len(s.ids) - prefix_len
        row = next((r for r in rows if r.length + n <= capacity), None)
        if row is None:
            row = PackedRow()
            rows.append(row)
        row.pieces.append(s)
        row.length += n
    return rows


def packed_inputs(rows: Sequence[PackedRow], prefix_len: int, pad_id: int, device):
    """(ids [R, L], 4-D boolean attention mask [R, 1, L, P+L], position ids [R, L], targets): the
    block-diagonal layout described at the top; targets are (row, position, token) of each loss token,
    the position being the one whose output predicts it."""
    width = max(r.length for r in rows)
    n_rows = len(rows)
    ids = torch.full((n_rows, width), pad_id, dtype=torch.long)
    segment = torch.full((n_rows, width), -1, dtype=torch.long)
    pos = torch.zeros((n_rows, width), dtype=torch.long)
    rows_t, cols_t, tokens_t = [], [], []
    for r, row in enumerate(rows):
        at = 0
        for k, seq in enumerate(row.pieces):
            part = seq.ids[prefix_len:]
            n = len(part)
            ids[r, at:at + n] = torch.as_tensor(part, dtype=torch.long)
            segment[r, at:at + n] = k
            pos[r, at:at + n] = torch.arange(prefix_len, prefix_len + n)
            for j in range(prefix_len, len(seq.ids)):
                if seq.loss[j]:
                    rows_t.append(r)
                    cols_t.append(at + j - prefix_len - 1)
                    tokens_t.append(seq.ids[j])
            at += n
    causal = torch.ones((width, width), dtype=torch.bool).tril()
    local = (segment[:, :, None] == segment[:, None, :]) & (segment[:, None, :] >= 0) & causal
    # Every query sees the prefix, pad queries included (a row of nothing but -inf would be NaN).
    mask = torch.cat([torch.ones((n_rows, width, prefix_len), dtype=torch.bool), local], -1).unsqueeze(1)
    targets = (torch.as_tensor(rows_t, dtype=torch.long), torch.as_tensor(cols_t, dtype=torch.long),
               torch.as_tensor(tokens_t, dtype=torch.long))
    return ids.to(device), mask.to(device), pos.to(device), tuple(t.to(device) for t in targets)


def packed_loss_sum(model, rows: Sequence[PackedRow], prefix: Sequence[int], pad_id: int) -> tuple[torch.Tensor, int]:
    """Summed cross-entropy of the rows' answer tokens (and how many there are), in one forward."""
    device = next(model.parameters()).device
    ids, mask, pos, (r, c, tok) = packed_inputs(rows, len(prefix), pad_id, device)
    cache = prefix_cache(model, prefix, len(rows))
    hidden = model.get_decoder()(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                                 use_cache=cache is not None).last_hidden_state
    # The vocabulary projection only where an answer token is predicted (most positions are prompt).
    logits = model.get_output_embeddings()(hidden[r, c]).float()
    return torch.nn.functional.cross_entropy(logits, tok, reduction="sum"), int(tok.numel())


# -- the loop --------------------------------------------------------------------------------------
def learning_rate(step: int, total: int, cfg: TrainConfig) -> float:
    s = cfg.sft
    if step < s.warmup_steps:
        return s.lr * (step + 1) / (s.warmup_steps + 1)
    if s.schedule == "constant" or total <= s.warmup_steps:
        return s.lr
    progress = (step - s.warmup_steps) / max(total - s.warmup_steps, 1)
    return s.lr * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


class SFTTrainer:
    def __init__(self, cfg: TrainConfig, out_dir: str | Path, data: Sequence[str | Path], connection=None,
                 device: str = "cpu", resume: bool = False):
        from .train import build_policy_model, build_vision_policy_model
        from .policies.vision import vision_codec
        if cfg.model.backend != "hf":
            raise ValueError("sft trains in process: model.backend must be hf")
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ValueError("sft runs in one process (one GPU or the CPU), not under torchrun")
        self.cfg = cfg
        self.out = Path(out_dir)
        self.connection = connection
        self.codec = None
        if cfg.model.vision:
            self.model, processor = build_vision_policy_model(cfg, device, connection)
            self.codec = vision_codec(cfg, processor)
            self.tokenizer = processor.tokenizer
        else:
            self.model, self.tokenizer = build_policy_model(cfg, device, connection)
        self.pad_id = int(self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None
                          else self.tokenizer.eos_token_id)
        records = read_demos(data)
        if self.codec is not None:
            self.sequences = build_vision_samples(records, self.codec, cfg)
        else:
            self.sequences = build_sequences(records, self.tokenizer, cfg)
        if not self.sequences:
            raise ValueError(f"no training sequences in {[str(d) for d in data]} "
                             f"({len(records)} episodes; sft.only_success={cfg.sft.only_success})")
        self.caption_samples = 0
        if cfg.perception.sft_boards:
            self.sequences += self._caption_samples(cfg, connection)
        self.prefixes = group_prefixes(self.sequences) if self.codec is None else {}
        self.optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=cfg.sft.lr,
                                           weight_decay=cfg.sft.weight_decay)
        self.steps_per_epoch = math.ceil(len(self.sequences) / cfg.sft.batch_size)
        self.total_steps = self.steps_per_epoch * cfg.sft.epochs
        self.step = 0
        if resume:
            ckpt = latest_checkpoint(self.out)
            if ckpt is not None:
                self._load(ckpt)
                log.info("resumed from %s (step %d)", ckpt, self.step)
        self.metrics = MetricsLog(self.out / METRICS_FILE)
        log.info("sft: %d sequences (%d answer tokens) from %d episodes and %d captions, %d steps",
                 len(self.sequences), sum(self._answer_tokens(s) for s in self.sequences), len(records),
                 self.caption_samples, self.total_steps)

    def _caption_samples(self, cfg: TrainConfig, connection) -> list[VisionSample]:
        """perception.sft_boards' (view, caption) pairs, gathered through the service."""
        from .rollout.perception import sft_caption_rows
        if self.codec is None:
            raise ValueError("perception.sft_boards needs a vision-language policy (model.vision)")
        if connection is None:
            raise ValueError("perception.sft_boards gathers its views through the service: give an env address "
                             "(--env-address) or a directory")
        client = connection.sync_client()
        try:
            rows = sft_caption_rows(self.codec, cfg, client)
        finally:
            client.close()
        self.caption_samples = len(rows)
        return [VisionSample(prompt, answer, [png], "perception") for prompt, answer, png in rows]

    @staticmethod
    def _answer_tokens(seq) -> int:
        return len(seq.completion_ids) if isinstance(seq, VisionSample) else sum(seq.loss)

    def _batch(self, step: int) -> list[SFTSequence]:
        epoch, index = divmod(step, self.steps_per_epoch)
        order = list(range(len(self.sequences)))
        random.Random(self.cfg.sft.seed * 1_000_003 + epoch).shuffle(order)
        b = self.cfg.sft.batch_size
        return [self.sequences[i] for i in order[index * b:(index + 1) * b]]

    def train_step(self, step: int) -> dict[str, float]:
        s = self.cfg.sft
        lr = learning_rate(step, self.total_steps, self.cfg)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        batch = self._batch(step)
        total_tokens = sum(self._answer_tokens(seq) for seq in batch)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        backward = self._vision_backward if self.codec is not None else self._packed_backward
        loss_sum, rows_n = backward(batch, total_tokens)
        norm = torch.nn.utils.clip_grad_norm_([p for p in self.model.parameters() if p.grad is not None],
                                              s.max_grad_norm)
        self.optimizer.step()
        self.model.eval()
        return {"loss": loss_sum / max(total_tokens, 1), "lr": lr, "grad_norm": float(norm),
                "answer_tokens": float(total_tokens), "sequences": float(len(batch)), "rows": float(rows_n)}

    def _packed_backward(self, batch: Sequence[SFTSequence], total_tokens: int) -> tuple[float, int]:
        """Backward of the summed answer-token cross-entropy over `batch` (divided by `total_tokens`),
        each group's sequences packed after its shared prefix; returns (the summed loss, packed rows)."""
        s = self.cfg.sft
        groups: dict[str, list[SFTSequence]] = {}
        for seq in batch:
            groups.setdefault(seq.group, []).append(seq)
        loss_sum, rows_n = 0.0, 0
        for g, members in groups.items():
            prefix = self.prefixes[g]
            rows = pack(members, len(prefix), s.pack_length)
            rows_n += len(rows)
            for i in range(0, len(rows), s.micro_batch_rows):
                part, n = packed_loss_sum(self.model, rows[i:i + s.micro_batch_rows], prefix, self.pad_id)
                (part / max(total_tokens, 1)).backward()
                loss_sum += float(part.detach())
        return loss_sum, rows_n

    def _vision_backward(self, batch: Sequence[VisionSample], total_tokens: int) -> tuple[float, int]:
        """Backward of the summed answer-token cross-entropy over `batch` (divided by `total_tokens`),
        `micro_batch_rows` samples per forward; returns (the summed loss, forwards run)."""
        from .policies.vision import vision_sequence_logprobs
        loss_sum, forwards = 0.0, 0
        mb = self.cfg.sft.micro_batch_rows
        for i in range(0, len(batch), mb):
            part = batch[i:i + mb]
            logp, mask = vision_sequence_logprobs(self.model, self.codec, [s.prompt_ids for s in part],
                                                  [s.completion_ids for s in part], [s.images for s in part],
                                                  pad_token_id=self.pad_id)
            nll = -(logp * mask).sum()
            (nll / max(total_tokens, 1)).backward()
            loss_sum += float(nll.detach())
            forwards += 1
        return loss_sum, forwards

    def loss(self, samples: Sequence[VisionSample] | None = None) -> float:
        """Mean answer-token cross-entropy over `samples` (all of the data by default), no gradient
        (a VLM's; what its training steps lower)."""
        from .policies.vision import vision_sequence_logprobs
        samples = self.sequences if samples is None else samples
        total, n = 0.0, 0
        was_training = self.model.training
        self.model.eval()
        with torch.no_grad():
            for i in range(0, len(samples), self.cfg.sft.micro_batch_rows):
                part = samples[i:i + self.cfg.sft.micro_batch_rows]
                logp, mask = vision_sequence_logprobs(self.model, self.codec, [s.prompt_ids for s in part],
                                                      [s.completion_ids for s in part], [s.images for s in part],
                                                      pad_token_id=self.pad_id)
                total -= float((logp * mask).sum())
                n += int(mask.sum())
        self.model.train(was_training)
        return total / max(n, 1)

    def run(self, max_steps: int | None = None) -> list[dict[str, Any]]:
        s = self.cfg.sft
        end = self.total_steps if max_steps is None else min(self.total_steps, self.step + max_steps)
        records = []
        progress = Progress(total=end - self.step, desc="sft", enabled=self.cfg.run.progress)
        try:
            while self.step < end:
                t0 = time.monotonic()
                stats = self.train_step(self.step)
                self.step += 1
                epoch_end = self.step % self.steps_per_epoch == 0
                record: dict[str, Any] = {"epoch": (self.step - 1) // self.steps_per_epoch + 1, "sft": stats}
                if epoch_end and s.eval_each_epoch and self.connection is not None:
                    record["eval"] = self.evaluate()
                if (s.checkpoint_every and self.step % s.checkpoint_every == 0) or epoch_end or self.step == end:
                    self.save()
                record["step_s"] = time.monotonic() - t0
                records.append(self.metrics.log(self.step, **record))
                progress.update(1, loss=stats["loss"])
        finally:
            progress.close()
        return records

    # -- evaluation through the service ------------------------------------------------------------
    def evaluate(self) -> dict[str, Any]:
        from .train import evaluate_policy
        # The held-out tasks when the config has them (what SFT should generalise to), else the training ones.
        sets = ("held_out",) if self.cfg.env.eval_tasks else ("train_tasks",)
        return asyncio.run(evaluate_policy(self.cfg, self.policy(), self.tokenizer, self.connection, task_sets=sets))

    def policy(self):
        """The model being trained as a policy (it samples with the current weights)."""
        from .policies.hf import HFPolicy
        if self.codec is not None:
            from .policies.vision import HFVisionPolicy
            return HFVisionPolicy(self.model, self.codec)
        return HFPolicy(self.model, self.tokenizer)

    # -- checkpoints ---------------------------------------------------------------------------------
    def save(self) -> Path:
        import shutil
        final = self.out / f"checkpoint-{self.step}"
        tmp = self.out / f".tmp-checkpoint-{self.step}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        self.model.save_pretrained(tmp / "policy")
        # A VLM's processor holds its tokenizer, image processor and chat template (load_vlm reads it).
        (self.codec.processor if self.codec is not None else self.tokenizer).save_pretrained(tmp / "policy")
        torch.save(self.optimizer.state_dict(), tmp / "optimizer.pt")
        state = {"iteration": self.step, "stage": "sft", "steps_per_epoch": self.steps_per_epoch,
                 "sequences": len(self.sequences), "config": self.cfg.to_dict()}
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=1))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        keep = self.cfg.sft.keep_checkpoints
        for old in checkpoints(self.out)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def _load(self, path: Path) -> None:
        from .policies.hf import _load_state
        state = json.loads((path / STATE_FILE).read_text())
        if state.get("sequences") != len(self.sequences):
            raise ValueError(f"{path} was trained on {state.get('sequences')} sequences, this data has "
                             f"{len(self.sequences)}: resume with the same --data")
        self.model.load_state_dict(dict(_load_state(path / "policy")))
        self.optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True))
        self.step = int(state["iteration"])
