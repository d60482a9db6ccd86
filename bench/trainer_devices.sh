#!/bin/bash
# The trainer on each device, side by side: FrozenLake GRPO (trainer/envserve_trainer/configs/
# frozenlake_grpo.yaml, and the vision-language policy's frozenlake_vlm_grpo.yaml on image-only
# FrozenLake, with checkpoints and evaluation moved past the run) for ITERS iterations, with the
# tiny and the small random-weight policies, on cuda and on the CPU, against one
# `envserve serve frozenlake` started here. Prints one JSON line per run: the median seconds per
# iteration (rollout, update; the first two iterations left out) and each iteration's success rate
# and loss, to compare devices. Needs envserve and envserve-trainer installed.
#
#     ITERS=12 PYTHON=.venv/bin/python [CONFIGS=frozenlake_vlm_grpo.yaml] [SIZES=small] bash bench/trainer_devices.sh [cuda cpu]
set -u
ITERS=${ITERS:-12}
DEVICES=${*:-cuda cpu}
CONFIGS=${CONFIGS:-frozenlake_grpo.yaml frozenlake_vlm_grpo.yaml}
SIZES=${SIZES:-tiny small}
PORT=${PORT:-50071}
PY=${PYTHON:-python3}
work=$(mktemp -d)
trap 'kill $server 2>/dev/null; rm -rf "$work"' EXIT
"$PY" -m envserve.cli serve frozenlake --port "$PORT" --workers 4 > "$work/server.log" 2>&1 &
server=$!
for _ in $(seq 60); do grep -q "serving" "$work/server.log" && break; sleep 0.5; done
configs=$(dirname "$0")/../trainer/envserve_trainer/configs
for config in $CONFIGS; do
for size in $SIZES; do
  name="${config%.yaml}_$size"
  sed "s/random_init: tiny .*/random_init: $size/; s/checkpoint_every: .*/checkpoint_every: 100000/; s/eval_every: .*/eval_every: 100000/" \
    "$configs/$config" > "$work/$name.yaml"
  for dev in $DEVICES; do
    "$PY" -m envserve_trainer train --config "$work/$name.yaml" --env-address "127.0.0.1:$PORT" \
      --device "$dev" --iterations "$ITERS" --output-dir "$work/run_${name}_$dev" > "$work/train_${name}_$dev.log" 2>&1 \
      || { echo "$name $dev failed:"; tail -5 "$work/train_${name}_$dev.log"; continue; }
    "$PY" - "$work/run_${name}_$dev/metrics.jsonl" "$config" "$size" "$dev" <<'PY'
import json, statistics, sys
recs = [json.loads(line) for line in open(sys.argv[1])]
timing = [r["timing"] for r in recs[2:] or recs]  # the first two warm up (allocation, kernels)
med = {k: round(statistics.median(t[k] for t in timing), 3) for k in ("iteration_s", "rollout_s", "update_s")}
print(json.dumps({"config": sys.argv[2], "policy": sys.argv[3], "device": sys.argv[4], "iterations": len(recs), **med,
                  "success_by_iteration": [r["train"]["success_rate"] for r in recs],
                  "loss_by_iteration": [r["update"]["loss"] for r in recs]}))
PY
  done
done
done
