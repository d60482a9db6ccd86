"""The learning run of a vision-language policy: base -> SFT on expert demonstrations -> RL, in
VAGEN's visual setting (image-only FrozenLake 4x4: the policy sees the picture alone), through a real
replica and a real judge, with a small random-weight VLM (model.random_init, model.vision).

Everything comes from the bundled config trainer/envserve_trainer/configs/learn_vlm_frozenlake.yaml
(its `bench` section holds the expert, the RL seeds, the sampled trials per map, the minutes and the
--quick run):

  1. collect   the expert (bench.expert, reading GetState) plays the training maps through the gRPC
               API, each after a detour of up to bench.detour random moves; each turn keeps the
               picture the replica sent; its answers describe the state in <observation>, say why in
               <reasoning>, predict the next state in <prediction>, and move in <answer>
  2. base      the random-weight VLM is evaluated on held-out maps
     perceive  when the config's perception.boards is set (the bundled config sets it): the warm-up
               of envserve_trainer.rollout.perception (the tower learns the cells from GetState, the language
               model the expert's captions); SFT starts from that model, and the summary gets
               perception_* figures
  3. sft       supervised fine-tuning on the demonstrations (the pictures in the prompts) and the
               captions of perception.sft_boards, evaluated
  4. rl        RL from the SFT checkpoint (the config's estimator, the judge's rewards when it uses
               them), once per RL seed, evaluated; bench.rl holds what RL changes in the config
               (its own maps: the SFT ones are already learned by heart)

An evaluation plays the held-out maps greedily (one trial each) and sampled (K trials each at
temperature 1): greedy_success, sampled_success, invalid_rate (greedy), and grounding_accuracy: the
share of greedy turns whose <observation> the judge (its rule judge for FrozenLake: the F1 of the
described relations against the true state, passing at its threshold) finds true; grounding_exact,
the share whose every relation is right; hole_cells_jaccard, neighbours_accuracy and
neighbour_holes_found, how well the reasoning locates what the picture shows (the hole cells the
first answer names; the cells around the player every answer names, and the share of the holes
among them it calls holes); reading_all_right and move_follows_reading, of the turns that name
all four cells around the player, the share that names them all right and the share whose move is
the one the neighbour expert's rule picks from the cells as named (a policy can read the picture
well and still not choose its move from what it read); greedy_distinct_first_answers, how many
different first moves the held-out maps drew. blind_greedy_success is the reference a policy must beat to
have read the picture at all: the demonstrations' most common move sequence played on every
held-out map without looking. With --json the last line is the summary: those figures per stage,
rl_minus_sft_greedy, the spread over RL seeds, the held-out set, targets_met (each of
bench.targets: greedy success after RL, SFT's grounding accuracy, RL's gain above the seed
spread) and the minutes.

    .venv/bin/python bench/learn_vlm.py --output-dir runs/learn-vlm --json       # make learn-vlm
    .venv/bin/python bench/learn_vlm.py --quick --json                           # a few minutes
    .venv/bin/python bench/learn_vlm.py --device cuda --json                     # weights built on the GPU
    .venv/bin/python bench/learn_vlm.py --config my.yaml --skip-base --rl-seeds 0  # an RL setting of your own
    .venv/bin/python bench/learn_vlm.py --config my.yaml --from-run runs/learn-vlm --output-dir runs/rl2 --json
                                                      # RL again from that run's SFT checkpoint
    .venv/bin/python bench/learn_vlm.py --score runs/learn-vlm/sft/checkpoint-352   # a saved policy's figures
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

CONFIG = "learn_vlm_frozenlake.yaml"
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)
HOLES = re.compile(r"holes? (?:are|is) at ((?:\(\d+, \d+\)(?:, )?)+)")
CELL = re.compile(r"\((\d+), (\d+)\)")
NEIGHBOUR = re.compile(r"(below|right of|left of|above) me is (ice|a hole|the goal|the edge)", re.I)


def load_config(quick: bool, path: str | None = None):
    """(TrainConfig, the bench section), with the quick run's overrides applied when asked."""
    import yaml
    from envserve_trainer.api import BENCH_SECTION, BUNDLED_CONFIGS, TrainConfig
    data = yaml.safe_load((Path(path) if path else BUNDLED_CONFIGS / CONFIG).read_text())
    bench = dict(data.pop(BENCH_SECTION))
    quick_overrides = bench.pop("quick", {})
    cfg = TrainConfig.from_mapping(data)
    if quick:
        quick_overrides = dict(quick_overrides)
        bench.update(quick_overrides.pop(BENCH_SECTION, {}))
        cfg = cfg.with_overrides(**quick_overrides)
    return cfg, bench


async def play(cfg, policy, conn, temperature: float, samples: int) -> tuple[dict[str, Any], float]:
    """(summary, grounding accuracy) of `samples` trials per held-out map. The judge scores each turn's
    <observation> while the sessions are open (it reads their states through the replica)."""
    from envserve_trainer.api import RolloutEngine, summarize
    from envserve.client.judge import new_scope
    from envserve_trainer.api import eval_task_sets, judge_trials
    client, judge = conn.env_client(), conn.judge_client()
    engine = RolloutEngine(client, policy, policy.tokenizer, cfg, seed=cfg.run.seed)
    try:
        trials = await engine.collect(eval_task_sets(cfg)["held_out"], samples, iteration=-1, temperature=temperature)
        # Its own scope: an evaluation neither adds to a training run's repetition counts nor reads them.
        await judge_trials(judge, trials, cfg.env.env_id, new_scope("eval"))
    finally:
        await engine.close()
        await client.close()
        await judge.close()
    # A turn without an <observation> (the answer did not parse) counts as not grounded.
    turns = [t for trial in trials for ep in trial.episodes for t in ep.turns]
    grounded = sum(1 for t in turns if t.judge_verdicts.get("grounding"))
    overall = dict(summarize(trials)["overall"])
    # The rule judge passes a description at its F1 threshold; an exact one names every relation right.
    exact = sum(1 for t in turns if t.judge_scores.get("grounding", 0.0) >= 1.0)
    overall["grounding_exact"] = exact / max(len(turns), 1)
    # How many different first moves the maps drew: 1 means the policy answers the same whatever
    # the picture shows.
    overall["distinct_first_answers"] = len({tuple(ep.turns[0].parsed_actions) for trial in trials
                                             for ep in trial.episodes if ep.turns})
    overall["reasoning"] = [(ep.task_seed, [(t.reasoning.get("reasoning", ""), list(t.parsed_actions))
                                            for t in ep.turns]) for trial in trials for ep in trial.episodes]
    return overall, grounded / max(len(turns), 1)


def board_reading(conn, cfg, episodes: list[tuple[int, list[tuple[str, list[str]]]]]) -> dict[str, float | None]:
    """How well the greedy answers' reasoning locates what the picture shows, checked against the
    same maps served as text (episodes: (map seed, [(reasoning, moves made) per turn])):

    hole_cells_jaccard: the mean Jaccard overlap of the hole cells the first answer names ("the holes
      are at (1, 2), (3, 0)", the search expert's words) with the true ones;
    neighbours_accuracy: the share of right facts among those the answers state about the cells
      around the player ("below me is a hole", the neighbour expert's words), over every turn, the
      player's cell followed by replaying the moves;
    neighbour_holes_found: of the holes next to the player that an answer states a fact about, the
      share it calls a hole (most cells are ice, so a policy that never looks scores well on the
      accuracy and 0 here);
    reading_all_right: of the turns whose answer states all four cells around the player, the share
      that states all four right;
    move_follows_reading: of those turns, the share whose move is the one the neighbour expert's
      rule picks from the cells as the answer states them (right or wrong): low means the policy
      reads the picture but does not choose its move from what it read.

    The relation sentences the judge checks barely test this from the corner the player starts in.
    A figure is None when no answer states such facts."""
    from envserve.client import EnvClient
    from envserve.client.experts import neighbour_move, plain_answer
    from envserve.client.experts.grid import AROUND, MOVES
    where_move = {words.removesuffix(" me"): move for move, words in AROUND.items()}
    config = {k: v for k, v in cfg.env.env_config.items() if k not in ("render_image", "image_only")}
    jaccard, named_holes, right, stated, holes_seen, holes_next = 0.0, 0, 0, 0, 0, 0
    read_whole, read_all_right, followed = 0, 0, 0
    with EnvClient(conn.env_address) as client:
        (sid,) = client.open_sessions(cfg.env.env_id, 1, config, cfg.env.action_format).session_ids
        try:
            for seed, turns in episodes:
                text = client.reset([sid], [seed])[0].observation.text
                rows = text.strip().splitlines()
                truth = {(r, c) for r, row in enumerate(rows) for c, ch in enumerate(row) if ch == "O"}
                named = HOLES.search(turns[0][0]) if turns else None
                if named:
                    said = {(int(r), int(c)) for r, c in CELL.findall(named.group(1))}
                    named_holes += 1
                    jaccard += len(said & truth) / len(said | truth) if said | truth else 1.0
                came_from = None
                for reasoning, moves in turns:
                    rows = text.strip().splitlines()
                    facts = {}
                    for where, what in NEIGHBOUR.findall(reasoning):
                        move = where_move[where.lower()]
                        true = neighbour(rows, move)
                        stated += 1
                        right += what.lower() == true
                        holes_next += true == "a hole"
                        holes_seen += true == "a hole" == what.lower()
                        facts[move] = (what.lower(), true)
                    here = player_cell(rows)
                    if len(facts) == 4:
                        read_whole += 1
                        read_all_right += all(said == true for said, true in facts.values())
                        back = next((m for m, (dr, dc) in MOVES.items()
                                     if (here[0] + dr, here[1] + dc) == came_from), None)
                        rule = neighbour_move({m: said for m, (said, _) in facts.items()}, back)[0]
                        followed += moves[:1] == [rule]
                    came_from = here
                    if not moves:
                        break
                    result = client.step([(sid, plain_answer(cfg.env.action_format, moves))])[0]
                    if result.done or result.truncated:
                        break
                    text = result.observation.text
        finally:
            client.close_sessions([sid])
    return {"hole_cells_jaccard": jaccard / named_holes if named_holes else None,
            "neighbours_accuracy": right / stated if stated else None,
            "neighbour_holes_found": holes_seen / holes_next if holes_next else None,
            "reading_all_right": read_all_right / read_whole if read_whole else None,
            "move_follows_reading": followed / read_whole if read_whole else None}


def player_cell(rows: list[str]) -> tuple[int, int]:
    (r, c), = [(r, row.index("P")) for r, row in enumerate(rows) if "P" in row]
    return r, c


def neighbour(rows: list[str], move: str) -> str:
    """What FrozenLake's text board holds one `move` from the player, in the neighbour expert's words."""
    from envserve.client.experts.grid import MOVES
    r, c = player_cell(rows)
    dr, dc = MOVES[move]
    r, c = r + dr, c + dc
    if not (0 <= r < len(rows) and 0 <= c < len(rows[r])):
        return "the edge"
    return {"O": "a hole", "G": "the goal"}.get(rows[r][c], "ice")


def evaluate(cfg, policy, conn, samples: int) -> dict[str, Any]:
    greedy, grounding = asyncio.run(play(cfg, policy, conn, 0.0, 1))
    reading = board_reading(conn, cfg, greedy["reasoning"]) if cfg.env.env_id == "frozenlake" else {}
    sampled, sampled_grounding = asyncio.run(play(cfg, policy, conn, 1.0, samples))
    return {"greedy_success": greedy["success_rate"], "sampled_success": sampled["success_rate"],
            "invalid_rate": greedy["invalid_action_rate"], "format_error_rate": greedy["format_error_rate"],
            "grounding_accuracy": grounding, "sampled_grounding_accuracy": sampled_grounding,
            "greedy_mean_turns": greedy["mean_turns"],
            "grounding_exact": greedy["grounding_exact"], "hole_cells_jaccard": reading.get("hole_cells_jaccard"),
            "neighbours_accuracy": reading.get("neighbours_accuracy"),
            "neighbour_holes_found": reading.get("neighbour_holes_found"),
            "reading_all_right": reading.get("reading_all_right"),
            "move_follows_reading": reading.get("move_follows_reading"),
            "greedy_distinct_first_answers": greedy["distinct_first_answers"]}


def blind_plan(demos: Path) -> list[str]:
    """The move sequence the demonstrations take most often from the start (those after a detour
    start elsewhere), whole episodes (ties: the first met)."""
    counts: dict[tuple[str, ...], int] = {}
    for line in demos.read_text().splitlines():
        record = json.loads(line)
        if record.get("detour"):
            continue
        moves = tuple(m.strip() for turn in record["turns"]
                      for m in ANSWER.search(turn["answer"]).group(1).split(",") if m.strip())
        counts[moves] = counts.get(moves, 0) + 1
    return list(max(counts, key=counts.get)) if counts else []


def blind_success(client, cfg, plan: list[str]) -> float:
    """Held-out success of playing `plan` on every map without looking: what a policy that ignores
    the picture reaches by answering with the demonstrations' most common moves."""
    from envserve.client.experts import plain_answer, session_settings
    from envserve_trainer.api import eval_task_sets
    tasks = eval_task_sets(cfg)["held_out"]
    settings = session_settings(client.get_spec(cfg.env.env_id), cfg.env.env_config)
    per_turn = max(1, int(settings["max_actions_per_turn"]))
    sids = list(client.open_sessions(cfg.env.env_id, len(tasks), cfg.env.env_config, cfg.env.action_format).session_ids)
    try:
        wins = 0
        for sid, task in zip(sids, tasks):
            client.reset([sid], [task.seed], split=task.split)
            for turn in range(cfg.rollout.max_turns):
                chunk = plan[turn * per_turn:(turn + 1) * per_turn]
                if not chunk:
                    break
                result = client.step([(sid, plain_answer(cfg.env.action_format, chunk,
                                                         str(settings["action_separator"])))])[0]
                if result.done or result.truncated:
                    wins += bool(result.success)
                    break
        return wins / max(len(tasks), 1)
    finally:
        client.close_sessions(sids)


def run(args, cfg, bench: dict[str, Any], conn, log, started: float, save) -> dict[str, Any]:
    from envserve.client import EnvClient
    from envserve_trainer.api import (HFVisionPolicy, SFTTrainer, build_vision_policy_model, collect, perceive,
                                      policy_folder, vision_codec)

    out = Path(args.output_dir)
    if args.from_run and Path(args.from_run).resolve() == out.resolve():
        raise SystemExit("--from-run must name another folder than --output-dir (this run clears its own)")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    result: dict[str, Any] = {"env": cfg.env.env_id, "estimator": cfg.algo.estimator, "use_judge": cfg.algo.use_judge,
                              "model": f"{cfg.model.vision} {cfg.model.random_init}", "device": args.device,
                              "cpu": cpu_info(), "stages": {}, "held_out": held_out_set(cfg, bench),
                              "targets": dict(bench.get("targets", {}))}
    samples = int(bench["samples"])
    if args.from_run:
        sft_policy, eval_seconds = reuse_run(Path(args.from_run), result, log)
        if "sft" not in result["stages"]:
            eval_seconds = evaluate_again(cfg, sft_policy, conn, args.device, samples, result, log)
        return rl_stages(args, cfg, bench, conn, log, started, result, sft_policy, eval_seconds, save)

    base, processor = build_vision_policy_model(cfg, args.device, conn)
    codec = vision_codec(cfg, processor)
    demos = out / "demos.jsonl"
    with EnvClient(conn.env_address) as client:
        seeds = list(range(cfg.env.seed_start, cfg.env.seed_start + cfg.env.num_tasks))
        result["collect"] = collect(client, cfg, codec.tokenizer, demos, seeds, expert=str(bench.get("expert", "")),
                                    codec=codec, detour=int(bench.get("detour", 0)),
                                    detour_actions=list(bench.get("detour_actions", ())))
        plan = blind_plan(demos)
        result["blind"] = {"plan": plan, "greedy_success": blind_success(client, cfg, plan)}
    log(f"{result['collect']['episodes']} demonstrations, expert success {result['collect']['success_rate']:.2f}, "
        f"{demos.stat().st_size / 1e6:.1f} MB; their most common moves {plan} solve "
        f"{result['blind']['greedy_success']:.2f} of the held-out maps played blind")

    if not args.skip_base:
        result["stages"]["base"] = evaluate(cfg, HFVisionPolicy(base, codec), conn, samples)
        log(f"base {json.dumps(result['stages']['base'])}")
    del base

    sft_cfg = cfg
    if cfg.perception.boards:
        # The vision tower learns to see from the service's ground truth; SFT starts from that model.
        model, processor = build_vision_policy_model(cfg, args.device, conn)
        with EnvClient(conn.env_address) as client:
            result["perception"] = perceive(model, vision_codec(cfg, processor), cfg, client, log)
        model.save_pretrained(out / "perceived")
        processor.save_pretrained(out / "perceived")
        del model
        sft_cfg = cfg.with_overrides(model={"path": str(out / "perceived"), "random_init": ""})
        vision = result["perception"]["vision"]["accuracy"]
        log(f"perception ({result['perception']['seconds']:.0f} s): held-out tower accuracy {json.dumps(vision)}; "
            f"captions {json.dumps(result['perception'].get('captions', {}).get('after'))}")

    t1 = time.monotonic()
    sft = SFTTrainer(sft_cfg, out / "sft", [demos], conn, device=args.device)
    loss_first = sft.loss()
    records = sft.run()
    result["sft"] = {"steps": sft.step, "samples": len(sft.sequences), "caption_samples": sft.caption_samples,
                     "seconds": round(time.monotonic() - t1, 1),
                     "loss_first": loss_first, "loss_last": sft.loss(),
                     "step_losses": [r["sft"]["loss"] for r in records]}
    t2 = time.monotonic()
    result["stages"]["sft"] = evaluate(cfg, sft.policy(), conn, samples)
    eval_seconds = time.monotonic() - t2
    result["sft"]["eval_seconds"] = round(eval_seconds, 1)
    result["sft"]["ended_minutes"] = round((time.monotonic() - started) / 60, 2)
    log(f"sft ({result['sft']['steps']} steps in {result['sft']['seconds']:.0f} s, loss {loss_first:.3f} -> "
        f"{result['sft']['loss_last']:.3f}) "
        f"{json.dumps(result['stages']['sft'])}")
    sft_policy = policy_folder(sft.save())
    del sft
    save(result)   # a run stopped during RL can still be reused (--from-run)
    return rl_stages(args, cfg, bench, conn, log, started, result, sft_policy, eval_seconds, save)


def score(args, cfg, bench: dict[str, Any], conn) -> None:
    """--score: each saved policy evaluated as a run's stages are, printed as one JSON line."""
    from envserve_trainer.api import HFVisionPolicy, build_vision_policy_model, policy_folder, vision_codec
    for checkpoint in args.score:
        scored_cfg = cfg.with_overrides(model={"path": policy_folder(checkpoint), "random_init": ""})
        model, processor = build_vision_policy_model(scored_cfg, args.device, conn)
        stage = evaluate(scored_cfg, HFVisionPolicy(model, vision_codec(scored_cfg, processor)), conn,
                         int(bench["samples"]))
        print(json.dumps({"checkpoint": checkpoint, "held_out": held_out_set(cfg, bench), **stage}), flush=True)


def cpu_info() -> dict[str, Any]:
    """The CPU the weights were trained on: its float kernels (torch's capability) decide the
    last bits of every update, and a run's scores follow them (docs/learn-vlm.md)."""
    import platform

    import torch
    model = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return {"model": model, "capability": torch.backends.cpu.get_cpu_capability(),
            "threads": torch.get_num_threads(), "torch": torch.__version__}


def held_out_set(cfg, bench: dict[str, Any]) -> dict[str, int]:
    """What an evaluation plays: the held-out maps and the sampled trials on each."""
    return {"seed_start": cfg.env.eval_seed_start, "tasks": cfg.env.eval_tasks, "samples": int(bench["samples"])}


def reuse_run(prior_dir: Path, result: dict[str, Any], log) -> tuple[str, float]:
    """--from-run: take a finished run's collection, perception, SFT checkpoint and SFT evaluation
    into `result`, so that only RL runs again (RL settings compared from one SFT policy). Where
    `result["held_out"]` is not the set that run evaluated on (or that run did not record it), its
    evaluations are left out: the caller scores the SFT policy again (evaluate_again). Returns the
    SFT policy's folder and the time its evaluation took."""
    from envserve_trainer.api import latest_checkpoint, policy_folder
    summary = prior_dir / "summary.json"
    checkpoint = latest_checkpoint(prior_dir / "sft")
    if not summary.is_file() or checkpoint is None:
        raise SystemExit(f"--from-run {prior_dir}: no finished run there (summary.json and sft/checkpoint-*; "
                         "a run writes them when its SFT stage ends)")
    prior_all = json.loads(summary.read_text())
    prior = prior_all["result"]
    for key in ("collect", "blind", "perception", "sft"):
        if key in prior:
            result[key] = prior[key]
    result["stages"].update({k: v for k, v in prior["stages"].items() if not k.startswith("rl-")})
    sft = result["sft"]
    # Runs that did not keep these are read back from their RL stages: each RL stage's time beyond
    # its iterations is its evaluation, which plays the same maps as the SFT one.
    rl = list(prior.get("rl", {}).values())
    if "eval_seconds" not in sft:
        sft["eval_seconds"] = round(statistics.mean(v["seconds"] - sum(v["iteration_seconds"]) for v in rl), 1)
    if "ended_minutes" not in sft:
        sft["ended_minutes"] = round(prior_all["summary"]["minutes"] - sum(v["seconds"] for v in rl) / 60, 2)
    result["from_run"] = str(prior_dir)
    if prior.get("held_out") != result.get("held_out"):
        # Scores on other maps than this run's would not compare with its RL stages.
        log(f"from {prior_dir}: it held out {prior.get('held_out')}, this run {result.get('held_out')}")
        result["stages"] = {}
        result["blind"] = {k: v for k, v in result.get("blind", {}).items() if k != "greedy_success"}
        return policy_folder(checkpoint), float(sft["eval_seconds"])
    log(f"from {prior_dir}: SFT ended at {sft['ended_minutes']:.1f} min, greedy "
        f"{result['stages']['sft']['greedy_success']:.2f}; RL starts from {checkpoint.name}")
    return policy_folder(checkpoint), float(sft["eval_seconds"])


def evaluate_again(cfg, sft_policy: str, conn, device: str, samples: int, result: dict[str, Any], log) -> float:
    """The reused SFT policy and the blind plan scored on this run's held-out maps; returns the seconds
    the SFT evaluation took (each RL seed keeps that much of the budget for its own)."""
    from envserve.client import EnvClient
    from envserve_trainer.api import HFVisionPolicy, build_vision_policy_model, vision_codec
    t = time.monotonic()
    sft_cfg = cfg.with_overrides(model={"path": sft_policy, "random_init": ""})
    model, processor = build_vision_policy_model(sft_cfg, device, conn)
    result["stages"]["sft"] = evaluate(sft_cfg, HFVisionPolicy(model, vision_codec(sft_cfg, processor)), conn, samples)
    seconds = time.monotonic() - t
    with EnvClient(conn.env_address) as client:
        result["blind"]["greedy_success"] = blind_success(client, cfg, result["blind"]["plan"])
    log(f"sft again on {result['held_out']['tasks']} held-out maps ({seconds:.0f} s) {json.dumps(result['stages']['sft'])}")
    return seconds


def rl_stages(args, cfg, bench: dict[str, Any], conn, log, started: float, result: dict[str, Any],
              sft_policy: str, eval_seconds: float, save) -> dict[str, Any]:
    """RL from the SFT policy once per seed, each evaluated; the seeds share what the budget leaves.
    `save(result)` writes the summary so far after each seed."""
    from envserve_trainer.api import Trainer
    out = Path(args.output_dir)
    samples = int(bench["samples"])
    # A reused run's minutes up to its SFT evaluation count against the budget as if they ran here.
    if "from_run" in result:
        started -= 60 * result["sft"]["ended_minutes"]
    budget = 60 * float(args.minutes if args.minutes is not None else bench["minutes"])
    rl_seeds = list(args.rl_seeds if args.rl_seeds is not None else bench["rl_seeds"])
    rl_overrides = dict(bench.get("rl", {}))
    result["rl_overrides"] = rl_overrides
    for i, seed in enumerate(rl_seeds):
        # The seeds share what is left of the budget; each keeps an evaluation's time (the SFT one's) for
        # its own evaluation. At least one iteration always runs.
        share = (budget - (time.monotonic() - started)) / (len(rl_seeds) - i) - eval_seconds
        t3 = time.monotonic()
        rl_cfg = cfg.with_overrides(**{**rl_overrides,
                                       "model": {**rl_overrides.get("model", {}), "path": str(sft_policy),
                                                 "random_init": ""},
                                       "run": {**rl_overrides.get("run", {}), "seed": seed}})
        trainer = Trainer(rl_cfg, out / f"rl-seed{seed}", conn, device=args.device)
        try:
            records = asyncio.run(trainer.run(max_seconds=max(share, 0.0)))
            stage = evaluate(rl_cfg, trainer.policy, conn, samples)
        finally:
            trainer.close()
        result["stages"][f"rl-seed{seed}"] = stage
        result.setdefault("rl", {})[str(seed)] = {
            "iterations": len(records), "seconds": round(time.monotonic() - t3, 1),
            "train_success": [r["train"]["success_rate"] for r in records],
            "iteration_seconds": [round(r["timing"]["iteration_s"], 1) for r in records]}
        log(f"rl seed {seed} ({len(records)} iterations, {result['rl'][str(seed)]['seconds']:.0f} s with its "
            f"evaluation) {json.dumps(stage)}")
        save(result)
    return result


def write_summary(out_dir: Path, result: dict[str, Any], minutes: float) -> dict[str, Any]:
    """summary.json: the summary and the whole result so far. Written after SFT and after each RL
    seed, so that a run stopped part way keeps what it finished and --from-run can start from it."""
    summary = summarize(result, minutes)
    (out_dir / "summary.json").write_text(json.dumps({"summary": summary, "result": result}, indent=1))
    return summary


def summarize(result: dict[str, Any], minutes: float) -> dict[str, Any]:
    st = result["stages"]
    rl = [v for k, v in st.items() if k.startswith("rl-")]
    def mean(key: str):
        values = [v[key] for v in rl if v.get(key) is not None]
        return statistics.mean(values) if values else None
    greedy = [v["greedy_success"] for v in rl]
    summary: dict[str, Any] = {"env": result["env"], "model": result["model"], "estimator": result["estimator"],
                               "device": result["device"], "cpu": result.get("cpu"), "minutes": round(minutes, 1),
                               "demos": result["collect"]["episodes"], "sft_steps": result["sft"]["steps"],
                               "sft_caption_samples": result["sft"]["caption_samples"],
                               "sft_loss_first": round(result["sft"]["loss_first"], 4),
                               "sft_loss_last": round(result["sft"]["loss_last"], 4),
                               "rl_iterations": {s: v["iterations"] for s, v in result.get("rl", {}).items()},
                               "sft_seconds_per_step": round(result["sft"]["seconds"] / max(result["sft"]["steps"], 1), 2),
                               "rl_seconds_per_iteration": round(statistics.mean(
                                   t for v in result.get("rl", {}).values() for t in v["iteration_seconds"]), 1)
                               if result.get("rl") else None}
    summary["blind_greedy_success"] = result["blind"]["greedy_success"]
    if "perception" in result:
        tower = result["perception"]["vision"]
        summary["perception_seconds"] = result["perception"]["seconds"]
        summary["perception_beside_accuracy"] = round(statistics.mean(
            v for k, v in tower["accuracy"].items() if k != "cell"), 4)
        summary["perception_beside_majority"] = round(statistics.mean(
            v for k, v in tower["majority"].items() if k != "cell"), 4)
        captions = result["perception"].get("captions", {}).get("after", {})
        summary["perception_captions_uncommon_right"] = captions.get("uncommon_phrases_right")
    keys = ("greedy_success", "sampled_success", "invalid_rate", "grounding_accuracy", "grounding_exact",
            "hole_cells_jaccard", "neighbours_accuracy", "neighbour_holes_found", "reading_all_right",
            "move_follows_reading", "greedy_distinct_first_answers")
    for stage in [s for s in ("base", "sft") if s in st]:
        for key in keys:
            summary[f"{stage}_{key}"] = st[stage].get(key)   # None where an older run did not report it
    for key in keys:
        summary[f"rl_{key}"] = mean(key)
    summary["rl_greedy_success_by_seed"] = greedy
    # Rounded: a difference of two shares of the same maps is a whole number of maps, not 1e-16.
    gain = round(statistics.mean(greedy) - st["sft"]["greedy_success"], 4) if rl else None
    spread = round(max(greedy) - min(greedy), 4) if rl else None
    summary["rl_minus_sft_greedy"] = gain
    summary["rl_seed_spread"] = spread
    summary["held_out"] = result.get("held_out")
    targets = result.get("targets")
    if targets and rl:
        summary["targets_met"] = {
            "greedy_success_after_rl": statistics.mean(greedy) >= targets["greedy_success_after_rl"],
            "sft_grounding_accuracy": (st["sft"].get("grounding_accuracy") or 0.0) >= targets["sft_grounding_accuracy"],
            "rl_above_seed_spread": gain > spread}
    return summary


def table(result: dict[str, Any]) -> str:
    lines = ["| stage | greedy success | sampled success | invalid rate | grounding accuracy |", "|---|---|---|---|---|"]
    for stage, m in result["stages"].items():
        lines.append(f"| {stage} | {m['greedy_success']:.2f} | {m['sampled_success']:.2f} | {m['invalid_rate']:.2f} "
                     f"| {m['grounding_accuracy']:.2f} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--output-dir", default="runs/learn-vlm")
    ap.add_argument("--quick", action="store_true", help="the config's short run (bench.quick): a few minutes")
    ap.add_argument("--minutes", type=float, default=None, help="the whole run's budget (default: bench.minutes)")
    ap.add_argument("--rl-seeds", type=int, nargs="*", default=None,
                    help="default: bench.rl_seeds; none at all stops after SFT")
    ap.add_argument("--config", help=f"a config of the same shape as the bundled {CONFIG} (its bench section too)")
    ap.add_argument("--skip-base", action="store_true", help="no evaluation of the random-weight model (RL settings sweeps)")
    ap.add_argument("--from-run", metavar="DIR",
                    help="reuse a finished run's demonstrations, perception and SFT; run RL only (RL settings sweeps)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda: where the weights are built and trained")
    ap.add_argument("--score", nargs="+", metavar="CHECKPOINT",
                    help="only evaluate these saved policies (checkpoint-N or policy folders) on the held-out "
                         "maps, one JSON line each")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON on the last line")
    args = ap.parse_args()
    from serverproc import stop_on_sigterm
    stop_on_sigterm()  # a SIGTERM stops the servers this run started, too
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from serverproc import JudgeProcess, ServerProcess
    from envserve_trainer.api import Connection
    cfg, bench = load_config(args.quick, args.config)
    started = time.monotonic()

    def log(msg: str) -> None:
        print(f"[{(time.monotonic() - started) / 60:5.1f} min] {msg}", flush=True)

    def save(result: dict[str, Any]) -> dict[str, Any]:
        # A reused run's minutes up to its SFT evaluation count as if they ran here.
        minutes = (time.monotonic() - started) / 60 + result["sft"]["ended_minutes"] * ("from_run" in result)
        return write_summary(Path(args.output_dir), result, minutes)

    with ServerProcess([cfg.env.env_id], workers=1, metrics=False) as server, JudgeProcess(server.address) as judge:
        conn = Connection(env_address=server.address, judge_address=judge.address)
        if args.score:
            score(args, cfg, bench, conn)
            return 0
        result = run(args, cfg, bench, conn, log, started, save)
    summary = save(result)
    print(table(result))
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
