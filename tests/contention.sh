#!/usr/bin/env bash
# Runs a command with CPU-burning processes beside it, as a shared CI machine runs the suite: races
# that an idle machine hides (a starved event loop, gRPC's threads late) show here.
#
#   tests/contention.sh [--burners N] [--limit SECONDS] -- command [args...]
#
# --burners: how many (default: one more than the cores, so the command never has a core alone).
# --limit:   the command is interrupted (SIGINT, so pytest still reports what failed) after this
#            long, killed a minute later, and no burner outlives it even if this script is killed
#            without running its trap (default 3600).
# Exits with the command's status (124 when the limit ended it).
set -euo pipefail

burners=$(( $(nproc) + 1 ))
limit=3600
while [ $# -gt 0 ]; do
  case "$1" in
    --burners) burners="$2"; shift 2 ;;
    --limit) limit="$2"; shift 2 ;;
    --) shift; break ;;
    *) break ;;
  esac
done
if [ $# -eq 0 ]; then
  echo "usage: $0 [--burners N] [--limit SECONDS] -- command [args...]" >&2
  exit 2
fi

pids=()   # the burners
cmd=""    # the command's timeout process
stop() {
  if [ -n "$cmd" ]; then kill "$cmd" 2>/dev/null || true; fi
  for pid in "${pids[@]}"; do
    kill "$pid" 2>/dev/null || true
  done
  for pid in "${pids[@]}"; do
    wait "$pid" 2>/dev/null || true
  done
}
trap stop EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

for _ in $(seq "$burners"); do
  timeout "$(( limit + 90 ))" python3 -c "while True: pass" &
  pids+=("$!")
done
echo "contention: $burners CPU burners beside the command ($(nproc) cores), limit ${limit} s" >&2

start=$(date +%s)
status=0
# In the background, so a signal to this script runs its trap at once instead of after the command.
timeout -s INT -k 60 "$limit" "$@" &
cmd=$!
wait "$cmd" || status=$?
cmd=""
echo "contention: the command took $(( $(date +%s) - start )) s, status $status" >&2
exit "$status"
