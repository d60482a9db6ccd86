#!/bin/bash
# The trainer on each device, side by side: FrozenLake GRPO (trainer/envserve_trainer/configs/
# frozenlake_grpo.yaml with checkpoints and evaluation moved past the run) for ITERS iterations,
# with the tiny and the small random-weight policies, on cuda and on the CPU, against one
# `envserve serve frozenlake` started here. Prints one JSON line per run: the median seconds per
# iteration (rollout, update; the first two iterations left out) and each iteration's success rate
# and loss, to compare devices. Needs envserve and envserve-trainer installed.
#
#     ITERS=12 PYTHON=.venv/bin/python bash bench/trainer_devices.sh [cuda cpu]
set -u
ITERS=${ITERS:-12}
DEVICES=${*:-cuda cpu}
PORT=${PORT:-50071}
PY=${PYTHON:-python3}
work=$(mktemp -d)
trap 'kill $server 2>/dev/null; rm -rf "$work"' EXIT
"$PY" -m envserve.cli serve frozenlake --port "$PORT" --workers 4 > "$work/server.log" 2>&1 &
server=$!
for _ in $(seq 60); do grep -q "serving" "$work/server.log" && break; sleep 0.5; done
base=$(dirname "$0")/../trainer/envserve_trainer/configs/frozenlake_grpo.yaml
for size in tiny small; do
  sed "s/random_init: tiny .*/random_init: $size/; s/checkpoint_every: .*/checkpoint_every: 100000/; s/eval_every: .*/eval_every: 100000/" \
    "$base" > "$work/fl_$size.yaml"
  for dev in $DEVICES; do
    "$PY" -m envserve_trainer train --config "$work/fl_$size.yaml" --env-address "127.0.0.1:$PORT" \
      --device "$dev" --iterations "$ITERS" --output-dir "$work/run_${size}_$dev" > "$work/train_${size}_$dev.log" 2>&1 \
      || { echo "$size $dev failed:"; tail -5 "$work/train_${size}_$dev.log"; continue; }
    "$PY" - "$work/run_${size}_$dev/metrics.jsonl" "$size" "$dev" <<'PY'
import json, statistics, sys
recs = [json.loads(line) for line in open(sys.argv[1])]
timing = [r["timing"] for r in recs[2:] or recs]  # the first two warm up (allocation, kernels)
med = {k: round(statistics.median(t[k] for t in timing), 3) for k in ("iteration_s", "rollout_s", "update_s")}
print(json.dumps({"policy": sys.argv[2], "device": sys.argv[3], "iterations": len(recs), **med,
                  "success_by_iteration": [r["train"]["success_rate"] for r in recs],
                  "loss_by_iteration": [r["update"]["loss"] for r in recs]}))
PY
  done
done
