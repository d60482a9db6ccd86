#!/usr/bin/env bash
# GRPO on Sokoban with verl's own trainer (verl 0.9, `python -m verl.trainer.main_ppo`), each rollout
# one episode served by envserve through EnvServeAgentLoop (agent_loops.yaml beside this script).
#
#   envserve serve sokoban --port 50051 &            # or a directory of replicas: redis://host:6379/0
#   ENVSERVE_ADDRESS=127.0.0.1:50051 MODEL=Qwen/Qwen2.5-0.5B-Instruct examples/verl/run_sokoban.sh
#   FLEET=1 MODEL=Qwen/Qwen2.5-0.5B-Instruct examples/verl/run_sokoban.sh   # envserve as a fleet on verl's Ray
#
# Exports the dataset first when DATA has none: the first TRAIN_TASKS (512) tasks of Sokoban's train split
# and VAL_TASKS (32) of its test split, as verl's rows (`envserve tasks export --format verl`). For
# the tool-calling route write it with write_dataset.py --agent-name tool_agent instead (its prompt
# holds the first observation, which ToolAgentLoop shows before any tool call). Extra arguments are more hydra
# overrides (e.g. trainer.total_training_steps=5). verl's rollout needs vLLM or SGLang on a GPU; the
# tool-calling route (ToolAgentLoop + EnvServeTool from tools.yaml) is the last override block's
# alternative, shown commented out. DRY_RUN=1 prints the command instead of running it.
#
# FLEET=1: no server to start first. The trainer's driver starts envserve as a fleet on verl's Ray
# (main_ppo_fleet.py: FLEET_FAMILIES replicas on each node) and the agent loops, Ray actors, find it
# at ray:// (agent_loops.yaml gives no address); the dataset is exported by an in-process server.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PYTHON=${PYTHON:-python}
if [[ "${FLEET:-0}" == 1 ]]; then
  unset ENVSERVE_ADDRESS
  FROM=()
  TRAIN=("$PYTHON" "$HERE/main_ppo_fleet.py")
else
  export ENVSERVE_ADDRESS=${ENVSERVE_ADDRESS:-127.0.0.1:50051}
  FROM=(--address "$ENVSERVE_ADDRESS")
  TRAIN=("$PYTHON" -m verl.trainer.main_ppo)
fi
MODEL=${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}
DATA=${DATA:-$HOME/data/envserve-sokoban}
GPUS=${GPUS:-1}

if [[ ! -f "$DATA/train.parquet" || ! -f "$DATA/val.parquet" ]]; then
  mkdir -p "$DATA"
  "$PYTHON" -m envserve.cli tasks export sokoban --split train --limit "${TRAIN_TASKS:-512}" --format verl \
    "${FROM[@]}" --out "$DATA/train.parquet" >&2
  "$PYTHON" -m envserve.cli tasks export sokoban --split test --limit "${VAL_TASKS:-32}" --format verl \
    "${FROM[@]}" --out "$DATA/val.parquet" >&2
fi

OVERRIDES=(
  algorithm.adv_estimator=grpo
  data.train_files="$DATA/train.parquet"
  data.val_files="$DATA/val.parquet"
  data.train_batch_size=32
  data.max_prompt_length=1024
  data.max_response_length=2048
  data.return_raw_chat=true
  actor_rollout_ref.model.path="$MODEL"
  actor_rollout_ref.actor.optim.lr=1e-6
  actor_rollout_ref.actor.ppo_mini_batch_size=32
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4
  actor_rollout_ref.rollout.name=vllm
  actor_rollout_ref.rollout.mode=async
  actor_rollout_ref.rollout.n=4
  actor_rollout_ref.rollout.tensor_model_parallel_size=1
  actor_rollout_ref.rollout.gpu_memory_utilization=0.5
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4
  actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4
  # The prompt (rules + first observation) and the whole episode's tokens (every turn's answer and
  # observation): the agent loop ends an episode whose response budget is spent.
  actor_rollout_ref.rollout.prompt_length=1024
  actor_rollout_ref.rollout.response_length=2048
  # envserve's agent loop plays each row; its settings are in agent_loops.yaml.
  actor_rollout_ref.rollout.agent.agent_loop_config_path="$HERE/agent_loops.yaml"
  actor_rollout_ref.rollout.agent.default_agent_loop=envserve_agent
  # The tool-calling route instead (write the dataset with --agent-name tool_agent):
  #   actor_rollout_ref.rollout.multi_turn.enable=true
  #   actor_rollout_ref.rollout.multi_turn.tool_config_path="$HERE/tools.yaml"
  #   actor_rollout_ref.rollout.multi_turn.max_assistant_turns=8
  trainer.n_gpus_per_node="$GPUS"
  trainer.nnodes=1
  trainer.total_epochs=1
  trainer.val_before_train=false
  trainer.test_freq=-1
  trainer.save_freq=-1
  trainer.logger='["console"]'
  trainer.project_name=envserve
  trainer.experiment_name=sokoban-grpo
)

if [[ "${DRY_RUN:-0}" == 1 ]]; then
  printf '%s\n' "${TRAIN[*]}" "${OVERRIDES[@]}" "$@"
  exit 0
fi
exec "${TRAIN[@]}" "${OVERRIDES[@]}" "$@"
