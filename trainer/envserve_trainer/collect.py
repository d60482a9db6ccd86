"""`envserve-train collect`: expert demonstrations through the gRPC API, written as JSONL for SFT.

An expert (envserve.client.experts: planners reading GetState, ALFWorld's handcoded expert,
ScienceWorld's gold paths, the embodied envs' scripted solvers) plays the training config's env, in
its action format, on the config's task seeds; every episode becomes one JSON line as soon as it
ends. Its `samples` are the (prompt ids, completion ids) pairs the RL rollout builds for the same
observations: `episode_samples` replays the recorded turns through prompting.ContextBuilder exactly
as rollout.py does (system prompt from Open, template, history window, response prefix and suffix,
GetSpec's action space as the admissible-action text), so SFT trains on the prompts RL will show.
From `turns`, SFT can rebuild the samples for another tokenizer or template.

One line:
  env_id, seed, split, action_format, env_config (as the sessions were opened), expert, success,
  score, turn_limited, guesses, detour (random moves played before the first recorded turn),
  system_prompt, admissible_actions, final_observation,
  turns: [{turn, observation (what the agent saw), images (the observation's PNGs, base64; only
           when the session sends pictures, e.g. render_image), answer (the full text sent), actions
           (parsed), reward, reward_components, anchor (after the step), state_anchor (the state acted
           in), transition, valid, done, truncated, success, feedback, reasoning (the parsed fields),
           move (plan|continue|explore|reflect), guessed}],
  messages: [{role, content}] (system, then user/assistant per turn, as the template words them),
  samples: [{prompt_ids, completion_ids}] (completion = answer minus prefix/suffix, then eos); for a
           vision-language model also image_refs: [[turn, k], ...], the turns' images its prompt holds,
  tokenizer (pretrained.tokenizer_id), tokenizer_source, template, history_turns,
  response_prefix, response_suffix; for a vision-language model also vision (its architecture) and
  max_images.

Images are inline base64, one field per turn, rather than sidecar files: a line stays a whole
episode, so files can be appended to, split, concatenated and moved without losing pictures, and a
grid env's PNG is a few hundred bytes. The samples point at the turns' images instead of repeating
them.
"""
from __future__ import annotations

import argparse
import base64
import binascii
import io
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from .config.train_config import TrainConfig
from .rollout.prompting import ChatLayout, ContextBuilder

RECORD_KEYS = ("env_id", "seed", "split", "action_format", "env_config", "expert", "success", "score",
               "system_prompt", "turns", "messages", "samples", "tokenizer", "template", "history_turns")
TURN_KEYS = ("turn", "observation", "answer", "actions", "reward", "reward_components", "anchor",
             "state_anchor", "valid", "done", "truncated", "success", "reasoning")


@dataclass
class ReplayedTurn:
    """One turn of a recorded episode as the rollout would present it."""
    user_text: str            # the user message the template builds from the observation
    prompt_ids: list[int]     # the whole context, ending with the assistant header (and prefix)
    completion_ids: list[int]  # the answer's tokens the policy would produce, then eos
    images: list[bytes] = field(default_factory=list)   # the PNGs prompt_ids holds, in order (a VLM's)
    image_refs: list[tuple[int, int]] = field(default_factory=list)   # (turn index, image index) of each


def encode_png(data: bytes) -> str:
    return base64.b64encode(bytes(data)).decode("ascii")


def turn_images(turn: Mapping[str, Any]) -> list[bytes]:
    """The PNG bytes of a recorded turn's observation (none when the session sent no picture)."""
    return [base64.b64decode(s, validate=True) for s in turn.get("images") or []]


def check_png(data: bytes) -> None:
    """ValueError unless `data` is a PNG that decodes whole."""
    from PIL import Image
    if not data.startswith(b"\x89PNG\r\n\x1a\n"):
        raise ValueError(f"not a PNG ({len(data)} bytes)")
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()
    except Exception as e:  # noqa: BLE001 - PIL raises several types for damaged data
        raise ValueError(f"a corrupt PNG ({len(data)} bytes): {e}") from None


def completion_text(answer: str, prefix: str = "", suffix: str = "") -> str:
    """The part of an answer the policy generates: the rollout sends prefix + completion + suffix."""
    if (prefix and not answer.startswith(prefix)) or (suffix and not answer.endswith(suffix)):
        raise ValueError(f"the answer {answer[:80]!r} does not start with rollout.response_prefix {prefix!r} and "
                         f"end with rollout.response_suffix {suffix!r}: the prefix/suffix do not fit the action format")
    return answer[len(prefix):len(answer) - len(suffix)]


def replay_episode(layout: ChatLayout, record: Mapping[str, Any], cfg: TrainConfig) -> list[ReplayedTurn]:
    """The recorded turns through a ContextBuilder, step for step as RolloutEngine drives one
    (_act records the answer, _on_result adds the feedback and takes a <planning> text as the plan)."""
    ro = cfg.rollout
    vision = layout.codec is not None
    builder = ContextBuilder(layout, record["system_prompt"], ro.template, ro.history_turns, ro.response_prefix,
                             ro.response_suffix, record.get("admissible_actions", ""),
                             max_images=ro.max_images if vision else 0)
    builder.new_episode("")
    image_only = bool((record.get("env_config") or {}).get("image_only"))
    where: dict[bytes, tuple[int, int]] = {}    # equal PNGs are interchangeable: the first one stands for all
    out = []
    for i, t in enumerate(record["turns"]):
        user_text = builder.user_text(t["observation"], t["turn"])
        # As in the rollout: a vision-language policy reads the pictures, a text policy the text alone.
        pngs = turn_images(t) if vision else []
        if vision and image_only and not pngs:
            raise ValueError(f"turn {i} of an image-only episode has no image")
        for k, png in enumerate(pngs):
            where.setdefault(png, (i, k))
        prompt_ids, user_ids = builder.prompt_ids(t["observation"], t["turn"], pngs)
        completion = layout.text_ids(completion_text(t["answer"], ro.response_prefix, ro.response_suffix))
        completion.append(layout.stop_token_id)
        builder.record(t["observation"], user_ids, completion, t["answer"], images=pngs)
        builder.history[-1].feedback = t.get("feedback", "")
        reasoning = t.get("reasoning") or {}
        if reasoning.get("meta_tag") == "planning":
            builder.plan = reasoning.get("planning", "") or builder.plan
        images = list(builder.context_images) if vision else []
        out.append(ReplayedTurn(user_text, prompt_ids, completion, images, [where[png] for png in images]))
    return out


def episode_samples(layout: ChatLayout, record: Mapping[str, Any],
                    cfg: TrainConfig) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, completion ids) per turn of a recorded episode, under `layout`'s tokenizer and
    `cfg.rollout`'s template, history window and response prefix/suffix."""
    return [(r.prompt_ids, r.completion_ids) for r in replay_episode(layout, record, cfg)]


def episode_samples_with_images(layout: ChatLayout, record: Mapping[str, Any],
                                cfg: TrainConfig) -> list[tuple[list[int], list[int], list[bytes]]]:
    """episode_samples for a vision-language layout: (prompt ids, completion ids, the PNGs the prompt
    holds, in order) per turn."""
    return [(r.prompt_ids, r.completion_ids, r.images) for r in replay_episode(layout, record, cfg)]


def episode_messages(record: Mapping[str, Any], replayed: Sequence[ReplayedTurn]) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": record["system_prompt"]}]
    for t, r in zip(record["turns"], replayed):
        messages += [{"role": "user", "content": r.user_text}, {"role": "assistant", "content": t["answer"]}]
    return messages


def episode_record(episode, admissible_actions: str) -> dict[str, Any]:
    """The tokenizer-free part of a line, from an envserve.client.experts.ExpertEpisode."""
    turns = []
    seen = episode.first      # the result whose observation the next turn answers
    for t in episode.turns:
        r = t.result
        images = [encode_png(im.png) for im in seen.observation.images]
        seen = r
        turns.append({
            "turn": t.turn, "observation": t.observation, **({"images": images} if images else {}),
            "answer": t.answer, "actions": list(r.parsed_actions),
            "reward": float(r.reward), "reward_components": {k: float(v) for k, v in r.reward_components.items()},
            "anchor": r.anchor, "state_anchor": t.state_anchor, "transition": r.transition,
            "valid": bool(r.action_valid), "done": bool(r.done), "truncated": bool(r.truncated),
            "success": bool(r.success), "feedback": r.feedback, "reasoning": dict(r.reasoning),
            "move": t.move.kind, "guessed": t.move.guessed,
        })
    last = episode.turns[-1].result if episode.turns else episode.first
    return {
        "env_id": episode.env_id, "seed": episode.seed, "split": episode.split,
        "action_format": episode.action_format, "env_config": dict(episode.config), "expert": episode.expert,
        "success": episode.success, "score": episode.score, "turn_limited": episode.turn_limited,
        "guesses": episode.guesses, "detour": list(episode.detour), "system_prompt": episode.system_prompt,
        "admissible_actions": admissible_actions, "final_observation": last.observation.text, "turns": turns,
    }


def task_seeds(cfg: TrainConfig, episodes: int | None = None, seed_start: int | None = None) -> list[int]:
    """The training tasks' seeds (env.seed_start, ... env.num_tasks of them), or `episodes` seeds from
    `seed_start`; never the held-out evaluation seeds."""
    env = cfg.env
    start = env.seed_start if seed_start is None else seed_start
    count = env.num_tasks if episodes is None else episodes
    if count < 1:
        raise ValueError(f"--episodes must be >= 1, got {count}")
    held_out = range(env.eval_seed_start, env.eval_seed_start + env.eval_tasks)
    seeds = list(range(start, start + count))
    leaked = [s for s in seeds if s in held_out]
    if leaked:
        raise ValueError(f"seeds {leaked[0]}..{leaked[-1]} are held-out evaluation seeds (env.eval_seed_start "
                         f"{env.eval_seed_start}, env.eval_tasks {env.eval_tasks}); choose --seed-start and "
                         f"--episodes apart from them")
    return seeds


def collect(client, cfg: TrainConfig, tokenizer, out: str | os.PathLike, seeds: Sequence[int], expert: str = "",
            batch_size: int = 32, append: bool = False, tokenizer_source: str = "", codec=None,
            detour: int = 0, detour_actions: Sequence[str] = ()) -> dict[str, Any]:
    """Plays the expert on `seeds` through `client` (EnvClient or RoutedClient) and writes one line per
    episode to `out` as it ends. Returns a summary (episodes, successes, samples, seconds, demos/s).
    `codec` (policies.vision.VisionCodec): the samples are a vision-language model's, images in place.
    detour > 0: each episode starts after up to that many random moves (play_expert's detour)."""
    from envserve.client.experts import EXPERTS, expert_for, play_expert
    from envserve.client.experts.play import check_detour

    from .models.pretrained import tokenizer_id

    env, ro = cfg.env, cfg.rollout
    if expert and expert not in EXPERTS:
        raise ValueError(f"unknown expert {expert!r}; experts: {sorted(EXPERTS)}")
    cls = EXPERTS[expert] if expert else expert_for(env.env_id)
    check_detour(detour, detour_actions)    # before the file is made
    layout = ChatLayout(tokenizer, codec)
    tok_id = tokenizer_id(tokenizer)
    vision = {"vision": codec.arch, "max_images": ro.max_images} if codec is not None else {}
    admissible = client.get_spec(env.env_id).action_space
    path = Path(out)
    try:
        f = open(path, "a" if append else "x", encoding="utf-8")
    except FileExistsError:
        raise FileExistsError(f"{path} exists; give --append to add to it, or another --out") from None
    stats = {"episodes": 0, "successes": 0, "turns": 0, "samples": 0}
    start = time.perf_counter()

    def write(episode) -> None:
        record = episode_record(episode, admissible)
        replayed = replay_episode(layout, record, cfg)
        record.update(
            messages=episode_messages(record, replayed),
            samples=[{"prompt_ids": r.prompt_ids, "completion_ids": r.completion_ids,
                      **({"image_refs": [list(ref) for ref in r.image_refs]} if codec is not None else {})}
                     for r in replayed],
            tokenizer=tok_id, tokenizer_source=tokenizer_source, template=ro.template,
            history_turns=ro.history_turns, response_prefix=ro.response_prefix, response_suffix=ro.response_suffix,
            **vision)
        f.write(json.dumps(record, ensure_ascii=False) + "\n")
        f.flush()
        stats["episodes"] += 1
        stats["successes"] += int(record["success"])
        stats["turns"] += len(record["turns"])
        stats["samples"] += len(replayed)

    with f:
        play_expert(client, env.env_id, seeds, env.action_format, config=env.env_config, split=env.split,
                    expert=cls, batch_size=batch_size, max_turns=ro.max_turns, on_episode=write,
                    detour=detour, detour_actions=detour_actions)
    seconds = time.perf_counter() - start
    return {**stats, "success_rate": stats["successes"] / max(stats["episodes"], 1), "seconds": round(seconds, 3),
            "demos_per_s": round(stats["episodes"] / seconds, 2) if seconds > 0 else 0.0, "out": str(path),
            "env_id": env.env_id, "expert": cls.__name__}


def load_records(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The lines of a demonstrations file, each checked for the keys SFT reads."""
    out = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e})") from None
        missing = [k for k in RECORD_KEYS if k not in record]
        missing += [f"turns[{i}].{k}" for i, t in enumerate(record.get("turns", [])) for k in TURN_KEYS if k not in t]
        if missing:
            raise ValueError(f"{path}:{n}: a demonstration lacks {', '.join(missing[:5])}")
        _check_images(record, f"{path}:{n}")
        out.append(record)
    return out


def _check_images(record: Mapping[str, Any], where: str) -> None:
    """Every recorded picture decodes, and an image-only episode has one on every turn."""
    image_only = bool((record.get("env_config") or {}).get("image_only"))
    for i, t in enumerate(record["turns"]):
        encoded = t.get("images") or []
        if image_only and not encoded:
            raise ValueError(f"{where}: turns[{i}] of an image-only episode has no image")
        for k, text in enumerate(encoded):
            try:
                check_png(base64.b64decode(text, validate=True))
            except (binascii.Error, TypeError, ValueError) as e:
                raise ValueError(f"{where}: turns[{i}].images[{k}] is not a readable PNG: {e}") from None


# -- the CLI ---------------------------------------------------------------------------------------------
def add_collect_arguments(p: argparse.ArgumentParser) -> None:
    """collect's own flags; the CLI adds --config and the service flags every subcommand shares."""
    p.add_argument("--out", required=True, help="the JSONL file to write (refused if it exists, unless --append)")
    p.add_argument("--append", action="store_true", help="add to an existing --out file")
    p.add_argument("--episodes", type=int, default=None, help="how many seeds (default: env.num_tasks)")
    p.add_argument("--seed-start", type=int, default=None, help="first seed (default: env.seed_start)")
    p.add_argument("--expert", default="", help="which expert: a name in envserve.client.experts.EXPERTS, "
                                                "e.g. frozenlake_neighbours (default: the env's own)")
    p.add_argument("--tokenizer", default="", help="model source whose tokenizer builds the samples "
                                                   "(default: model.path of the config)")
    p.add_argument("--batch-size", type=int, default=32, help="sessions played at once")
    p.add_argument("--detour", type=int, default=0, help="up to this many random moves before the expert takes "
                                                         "over: episodes start from varied states")
    p.add_argument("--detour-actions", default="", help="the actions the detour draws from, comma separated "
                                                        "(e.g. Left,Down,Right,Up)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per gRPC call (first ALFWorld resets "
                                                                "generate games)")


def _client(args):
    from envserve.client import EnvClient, RoutedClient
    if bool(args.env_address) == bool(args.directory):
        raise SystemExit("envserve-train collect: give exactly one of --env-address and --directory")
    token = args.token or os.environ.get("ENVSERVE_TOKEN") or None
    if args.directory:
        return RoutedClient(args.directory, token=token, timeout=args.timeout)
    return EnvClient(args.env_address, timeout=args.timeout, token=token)


def run_collect(args) -> int:
    from .config.loading import load_config
    from .models.pretrained import load_tokenizer
    cfg = load_config(args.config)
    model = cfg.model
    if getattr(model, "random_init", "") and not args.tokenizer:
        raise SystemExit("envserve-train collect: model.random_init builds its tokenizer in process; give "
                         "--tokenizer (a pretrained model source) for the demonstrations")
    source = args.tokenizer or model.path
    if args.batch_size < 1:
        raise SystemExit("envserve-train collect: --batch-size must be >= 1")
    codec = None
    try:
        seeds = task_seeds(cfg, args.episodes, args.seed_start)
        if model.vision:
            # A vision-language model's samples need its processor (image placeholders expanded): a
            # saved VLM folder (model.path, or --tokenizer naming one).
            from .policies.vision import vision_codec
            from .models.vision import load_vlm_processor
            codec = vision_codec(cfg, load_vlm_processor(source))
            tokenizer = codec.tokenizer
        else:
            tokenizer = load_tokenizer(source, "" if args.tokenizer else getattr(model, "gguf_file", ""))
    except (ValueError, OSError) as e:
        raise SystemExit(f"envserve-train collect: {e}") from None
    client = _client(args)
    try:
        summary = collect(client, cfg, tokenizer, args.out, seeds, args.expert, args.batch_size, args.append,
                          tokenizer_source=source, codec=codec, detour=args.detour,
                          detour_actions=[a.strip() for a in args.detour_actions.split(",") if a.strip()])
    except (ValueError, FileExistsError) as e:
        raise SystemExit(f"envserve-train collect: {e}") from None
    finally:
        client.close()
    print(json.dumps(summary))
    return 0
