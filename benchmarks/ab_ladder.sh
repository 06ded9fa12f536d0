#!/usr/bin/env bash
# Two commits of met side by side on the same machine and model: each tree's `met serve`
# (default flags: what a user gets) is swept by this tree's `met bench sweep` in turn,
# ROUNDS times alternating (A B A B ...) so that drift hits both, then `met bench compare`
# prints each rung's ratio of B (this checkout) to A (BASE). Run it on an idle machine.
#
# Settings (environment): BASE (git rev, default HEAD~1) MODEL (default: the embedded GGUF)
# CONCURRENCY (1,4,16,32,64) ISL (110) OSL (128) REPS (1) WARMUP (2) ROUNDS (2)
# OUT (.benchmarks/ab-ladder/<date>-<base>-<head>)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
BASE=${BASE:-HEAD~1}
CONCURRENCY=${CONCURRENCY:-1,4,16,32,64}
ISL=${ISL:-110}
OSL=${OSL:-128}
REPS=${REPS:-1}
WARMUP=${WARMUP:-2}
ROUNDS=${ROUNDS:-2}
PY=${PYTHON:-python}
base_sha=$(git rev-parse --short=10 "$BASE")
head_sha=$(git rev-parse --short=10 HEAD)$(git diff --quiet HEAD -- met || echo "-dirty")
OUT=${OUT:-.benchmarks/ab-ladder/$(date -u +%F)-$base_sha-$head_sha}
mkdir -p "$OUT"
wt=$(mktemp -d)/base
git worktree add -q --detach "$wt" "$base_sha"
server_pid=""
stop_server() {
  if [ -n "$server_pid" ] && kill -0 "$server_pid" 2>/dev/null; then
    kill -TERM "$server_pid" 2>/dev/null || true
    for _ in $(seq 1 60); do kill -0 "$server_pid" 2>/dev/null || break; sleep 0.5; done
    kill -KILL "$server_pid" 2>/dev/null || true
    wait "$server_pid" 2>/dev/null || true
  fi
  server_pid=""
}
cleanup() { stop_server; git worktree remove --force "$wt" 2>/dev/null || true; }
trap cleanup EXIT INT TERM
model=()
[ -n "${MODEL:-}" ] && model=("$MODEL")
run() {  # label tree round
  local port=$((18800 + RANDOM % 1000)) log=$OUT/$1-r$3.server.log
  (cd "$2" && PYTHONPATH="$2" exec "$PY" -m met.cli serve "${model[@]}" --port "$port" \
     --served-model-name ab) > "$log" 2>&1 &
  server_pid=$!
  for _ in $(seq 1 900); do  # the base tree may compile its kernels on first use: warmup
    curl -sf -o /dev/null "http://127.0.0.1:$port/health" && break
    kill -0 "$server_pid" 2>/dev/null || { echo "server $1 exited; see $log" >&2; exit 1; }
    sleep 1
  done
  "$PY" -m met.cli bench sweep --url "http://127.0.0.1:$port" --model ab \
    --concurrency "$CONCURRENCY" --isl "$ISL" --osl "$OSL" --reps "$REPS" --warmup "$WARMUP" \
    --label "$1" --out "$OUT/$1-r$3.json"
  stop_server
}
for r in $(seq 1 "$ROUNDS"); do
  run "base-$base_sha" "$wt" "$r"
  run "head-$head_sha" "$repo" "$r"
done
"$PY" -m met.cli bench compare "$OUT"/base-*.json "$OUT"/head-*.json | tee "$OUT/compare.txt"
