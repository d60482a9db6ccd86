"""Perception warm-up: a vision-language policy with a random-weight vision tower learns to see the
board from the service's ground truth before SFT.

SFT on expert answers alone does not teach a random vision tower to see: on image-only FrozenLake the
policy learns the demonstrations' most common path and calls every cell ice (docs/learn-vlm.md). Every
envserve grid env serves the truth behind each picture (GetState: `grid`, one character a cell), so
the policy can learn to see from the service itself (config section `perception`):

1. Views: random moves on boards no other stage plays (perception.seed_start on), each observation's
   PNG with its GetState.
2. The vision tower and its connector, through a linear head dropped afterwards, learn what each
   image token's cell holds and what the four cells beside it hold (the edge past the border). The
   image tokens must line up with the cells: Qwen2-VL's merged 28 px squares (env_config
   image_size = 28 x the board's side), Idefics3's 4 x 4 tokens (a 4 x 4 board).
3. With that tower frozen, the language model learns to answer `perception.question` about a view
   with `perception.captions`' words: an expert whose surroundings(state) says what lies around the
   player (FrozenLake's frozenlake_neighbours), the words its SFT answers use.

Neither training alone gets a small model to name the holes beside the player; both together do, on
boards it never saw. `perceive` runs all three and returns the held-out figures; the caller saves
the model, and SFT starts from that folder. SFT on the demonstrations alone then lets the model
forget the captions; `sft_caption_rows` (perception.sft_boards) keeps them in SFT's data.
"""
from __future__ import annotations

import collections
import random
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

EDGE = "#"                                        # the label past the board's border
BESIDE = ((1, 0), (0, 1), (0, -1), (-1, 0))       # below, right, left, above
SLOTS = ("cell", "below", "right", "left", "above")


@dataclass(frozen=True)
class View:
    png: bytes
    state: Mapping[str, Any]      # GetState's ground truth of the observation


def gather_views(client, cfg, seeds: Sequence[int]) -> list[View]:
    """A view per observation of `perception.moves` random moves (perception.actions) on each board
    of `seeds`, through the service; a board's moves end with its episode. The same seeds and
    perception.seed give the same views."""
    from envserve.client import state_dict

    p, env = cfg.perception, cfg.env
    rng = random.Random(f"{p.seed}:{seeds[0] if seeds else 0}")
    views: list[View] = []
    # no_think: the bare answer tag, whatever format the policy will answer in.
    sids = client.open(env.env_id, len(seeds), config=dict(env.env_config), action_format="no_think")
    try:
        for sid, result in zip(sids, client.reset(sids, list(seeds))):
            for k in range(p.moves + 1):
                if not result.observation.images:
                    raise ValueError(f"{env.env_id} observations carry no image: perception needs "
                                     "env_config render_image")
                views.append(View(result.observation.images[0].png, state_dict(client.get_state(sid))))
                if result.done or result.truncated or k == p.moves:
                    break
                result = client.step_one(sid, f"<answer>{rng.choice(p.actions)}</answer>")
                if not result.action_valid:
                    raise ValueError(f"perception.actions: {env.env_id} refused a random move: {result.feedback}")
    finally:
        client.close_sessions(sids)
    return views


# -- the vision tower ------------------------------------------------------------------------------
def vision_modules(model, arch: str) -> list[torch.nn.Module]:
    """The vision tower and its connector to the language model."""
    inner = model.model
    return [inner.visual] if arch == "qwen2_vl" else [inner.vision_model, inner.connector]


def image_tokens(model, codec, pngs: Sequence[bytes]) -> tuple[torch.Tensor, tuple[int, int]]:
    """What the language model receives for each image, [images, tokens, hidden], and the (rows,
    columns) the tokens form."""
    device = next(model.parameters()).device
    vision = codec.model_inputs([[png] for png in pngs], device=device)
    out = model.get_image_features(**vision)
    feats = getattr(out, "pooler_output", out)
    feats = torch.stack(list(feats)) if isinstance(feats, (list, tuple)) else feats
    if codec.arch == "qwen2_vl":
        merge = codec.image_processor.merge_size
        grids = {(int(g[1]) // merge, int(g[2]) // merge) for g in vision["image_grid_thw"]}
        if len(grids) != 1:
            raise ValueError(f"the views' images differ in size ({sorted(grids)} tokens)")
        shape = grids.pop()
    else:
        side = int(round(feats.shape[1] ** 0.5))
        shape = (side, side)
    return feats.reshape(len(pngs), -1, feats.shape[-1]), shape


def cell_labels(grid: Sequence[str], shape: tuple[int, int], vocab: Mapping[str, int]) -> list[list[int]]:
    """Per image token (row-major): the labels of its cell and of the cells below, right, left and
    above it (EDGE past the border)."""
    rows, cols = len(grid), len(grid[0]) if grid else 0
    if (rows, cols) != tuple(shape):
        raise ValueError(f"the image tokens form a {shape[0]} x {shape[1]} grid but the board is {rows} x {cols}: "
                         "perception needs one token a cell (Qwen2-VL: env_config image_size = 28 x the "
                         "board's side; Idefics3: a 4 x 4 board)")
    out = []
    for r in range(rows):
        for c in range(cols):
            row = [vocab[grid[r][c]]]
            for dr, dc in BESIDE:
                rr, cc = r + dr, c + dc
                row.append(vocab[grid[rr][cc]] if 0 <= rr < rows and 0 <= cc < cols else vocab[EDGE])
            out.append(row)
    return out


def train_vision(model, codec, train: Sequence[View], test: Sequence[View], p,
                 log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Trains the vision tower and connector so that a linear head reads every token's cell and the
    cells beside it; the language model is untouched. Returns the held-out accuracy per slot beside
    the most common label's share (what a tower that does not see scores)."""
    vocab = {ch: i for i, ch in enumerate(sorted({ch for v in [*train, *test] for row in v.state["grid"] for ch in row}
                                                 | {EDGE}))}
    modules = vision_modules(model, codec.arch)
    params = [q for m in modules for q in m.parameters()]
    hidden = model.config.get_text_config().hidden_size
    torch.manual_seed(p.seed)
    head = torch.nn.Linear(hidden, len(SLOTS) * len(vocab)).to(next(model.parameters()).device)
    optimizer = torch.optim.AdamW(params + list(head.parameters()), lr=p.lr)

    def loss_and_hits(views: Sequence[View]) -> tuple[torch.Tensor, torch.Tensor]:
        feats, shape = image_tokens(model, codec, [v.png for v in views])
        labels = torch.tensor([cell_labels(v.state["grid"], shape, vocab) for v in views], device=feats.device)
        logits = head(feats).view(*labels.shape, len(vocab))
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, len(vocab)), labels.reshape(-1))
        return loss, (logits.argmax(-1) == labels).reshape(-1, len(SLOTS)).float()

    def held_out() -> dict[str, float]:
        with torch.no_grad():
            hits = torch.cat([loss_and_hits(test[i:i + p.batch_size])[1] for i in range(0, len(test), p.batch_size)])
        return {s: round(float(a), 4) for s, a in zip(SLOTS, hits.mean(0))}

    start = time.monotonic()
    for m in modules:
        m.requires_grad_(True)
    before = held_out() if test else {}
    losses = []
    order = list(range(len(train)))
    for epoch in range(p.epochs):
        random.Random(f"{p.seed}:{epoch}").shuffle(order)
        for i in range(0, len(order), p.batch_size):
            loss, _ = loss_and_hits([train[j] for j in order[i:i + p.batch_size]])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(round(loss.item(), 4))
        if log:
            log(f"perception: vision epoch {epoch + 1}/{p.epochs}, loss {losses[-1]:.4f}")
    after = held_out() if test else {}
    return {"views": len(train), "held_out_views": len(test), "labels": "".join(vocab), "steps": len(losses),
            "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
            "accuracy_before": before, "accuracy": after, "majority": _majority(test, vocab) if test else {},
            "seconds": round(time.monotonic() - start, 1)}


def _majority(views: Sequence[View], vocab: Mapping[str, int]) -> dict[str, float]:
    rows, cols = len(views[0].state["grid"]), len(views[0].state["grid"][0])
    labels = torch.tensor([cell_labels(v.state["grid"], (rows, cols), vocab) for v in views]).reshape(-1, len(SLOTS))
    return {s: round(float(torch.bincount(labels[:, k]).max() / len(labels)), 4) for k, s in enumerate(SLOTS)}


# -- the language model --------------------------------------------------------------------------------
def captioner(name: str) -> Callable[[Mapping[str, Any]], str]:
    """perception.captions' expert's surroundings(state)."""
    from envserve.client.experts import EXPERTS
    if name not in EXPERTS:
        raise ValueError(f"perception.captions: unknown expert {name!r}; experts: {sorted(EXPERTS)}")
    expert = EXPERTS[name]()
    if not hasattr(expert, "surroundings"):
        raise ValueError(f"perception.captions: the expert {name!r} has no surroundings(state) to caption views with")
    return lambda state: expert.surroundings(state) + "."


def caption_rows(codec, views: Sequence[View], caption: Callable[[Mapping[str, Any]], str],
                 question: str) -> list[tuple[list[int], list[int], bytes]]:
    """(prompt ids, caption ids, the PNG) of each view."""
    tok = codec.tokenizer
    end = tok.convert_tokens_to_ids("<|im_end|>")
    end = end if isinstance(end, int) and end != tok.unk_token_id else tok.eos_token_id
    rows = []
    for v in views:
        prompt, _ = codec.encode_chat([{"role": "user", "content": [{"type": "image", "png": v.png},
                                                                    {"type": "text", "text": question}]}])
        answer = list(tok(caption(v.state), add_special_tokens=False)["input_ids"]) + ([end] if end is not None else [])
        rows.append((prompt, answer, v.png))
    return rows


def sft_caption_rows(codec, cfg, client) -> list[tuple[list[int], list[int], bytes]]:
    """caption_rows of the views of perception.sft_boards boards from perception.seed_start (the
    warm-up's own training boards), to be trained beside SFT's demonstrations."""
    p = cfg.perception
    caption = captioner(p.captions)
    views = gather_views(client, cfg, range(p.seed_start, p.seed_start + p.sft_boards))
    return caption_rows(codec, views, caption, p.question)


def train_captions(model, codec, train: Sequence[View], test: Sequence[View], p,
                   log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """With the vision tower frozen, trains the language model to answer perception.question with
    the captions' words. Returns read_captions on the held-out views before and after."""
    from ..policies.vision import vision_sequence_logprobs
    caption = captioner(p.captions)
    train_rows = caption_rows(codec, train, caption, p.question)

    def held_out() -> dict[str, float]:
        return read_captions(model, codec, test, caption, p)

    start = time.monotonic()
    modules = vision_modules(model, codec.arch)
    for m in modules:
        m.requires_grad_(False)
    trainable = [q for q in model.parameters() if q.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=p.caption_lr)
    before = held_out() if test else {}
    losses = []
    order = list(range(len(train_rows)))
    rng = random.Random(f"{p.seed}:captions")
    at = len(order)
    for step in range(p.caption_steps):
        if at + p.caption_batch_size > len(order):
            rng.shuffle(order)
            at = 0
        batch = [train_rows[j] for j in order[at:at + p.caption_batch_size]]
        at += p.caption_batch_size
        # SFT's loss: the mean negative log-probability of the answer tokens.
        logp, mask = vision_sequence_logprobs(model, codec, [r[0] for r in batch], [r[1] for r in batch],
                                              [[r[2]] for r in batch])
        loss = -logp[mask].mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(round(loss.item(), 4))
        if log and (step + 1) % 100 == 0:
            log(f"perception: caption step {step + 1}/{p.caption_steps}, loss {losses[-1]:.4f}")
    for m in modules:
        m.requires_grad_(True)
    return {"captions": p.captions, "examples": len(train_rows), "steps": len(losses),
            "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
            "before": before, "after": held_out() if test else {},
            "seconds": round(time.monotonic() - start, 1)}


def phrases(text: str) -> list[str]:
    return [x.strip().lower() for x in text.strip().rstrip(".").split(",")]


def read_captions(model, codec, views: Sequence[View], caption: Callable[[Mapping[str, Any]], str],
                  p) -> dict[str, float]:
    """Greedy captions of `views`, phrase by phrase against the truth's: the share right, and the
    share right among the phrases that are not the most common at their place in the caption (what
    a model that does not look at the picture gets wrong: the holes, the goal)."""
    from ..policies.vision import HFVisionPolicy
    policy = HFVisionPolicy(model, codec)
    truth = [phrases(caption(v.state)) for v in views]
    said = []
    for i in range(0, len(views), p.caption_batch_size):
        prompts = [[{"role": "user", "content": [{"type": "image", "png": v.png}, {"type": "text", "text": p.question}]}]
                   for v in views[i:i + p.caption_batch_size]]
        width = max(len(codec.tokenizer(caption(v.state))["input_ids"]) for v in views[i:i + p.caption_batch_size])
        said += [phrases(g.text) for g in policy.generate(prompts, max_new_tokens=width + 4, temperature=0.0)]
    common = [collections.Counter(t[k] for t in truth if len(t) > k).most_common(1)[0][0]
              for k in range(max(map(len, truth)))]
    right = total = rare_right = rare = 0
    for t, s in zip(truth, said):
        for k, phrase in enumerate(t):
            hit = k < len(s) and s[k] == phrase
            right += hit
            total += 1
            if phrase != common[k]:
                rare_right += hit
                rare += 1
    return {"phrases_right": round(right / max(total, 1), 4),
            "uncommon_phrases_right": round(rare_right / rare, 4) if rare else None,
            "uncommon_phrases": rare}


def perceive(model, codec, cfg, client, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The whole warm-up (config section perception) on `model` in place, through `client` (a
    blocking EnvClient); returns what each step measured."""
    p = cfg.perception
    if not p.boards:
        raise ValueError("perception.boards is 0: nothing to perceive")
    if p.captions:
        captioner(p.captions)    # a wrong name fails before any training
    start = time.monotonic()
    train = gather_views(client, cfg, range(p.seed_start, p.seed_start + p.boards))
    test = gather_views(client, cfg, range(p.seed_start + p.boards, p.seed_start + p.boards + p.held_out)) \
        if p.held_out else []
    if log:
        log(f"perception: {len(train)} views of {p.boards} boards, {len(test)} held out")
    was_training = model.training
    model.train()
    try:
        out: dict[str, Any] = {"vision": train_vision(model, codec, train, test, p, log)}
        if p.captions and p.caption_steps:
            out["captions"] = train_captions(model, codec, train, test, p, log)
    finally:
        model.train(was_training)
    out["seconds"] = round(time.monotonic() - start, 1)
    return out
