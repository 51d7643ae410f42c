#!/usr/bin/env bash
# N users at once: quickdraft serve --max-concurrency N vs llama.cpp's llama-server -np N, the same GGUF
# and threads, one server at a time (each gets the machine), measured by `quickdraft bench --concurrency N`.
#   benchmarks/concurrency_vs_llamaserver.sh [MODEL.gguf] [N] [PROMPTS] [TOKENS] [OUT]
# llama-server from ../shared/tools/build_llamacpp.sh (~/.cache/quickdraft/llamacpp-native/bin).
set -uo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-$HOME/.cache/quickdraft/models/qwen2.5-coder-1.5b-instruct.gguf}
N=${2:-4}; PROMPTS=${3:-8}; TOKENS=${4:-128}; OUT=${5:-benchmarks/results/concurrency/vs-llamaserver}
BIN=${LLAMA_BIN:-$HOME/.cache/quickdraft/llamacpp-native/bin}
CTX=4096
PY=.venv/bin/python
wait_up() { for _ in $(seq 300); do curl -sf "$1/health" >/dev/null && return 0; sleep 1; done; return 1; }
bench() {  # name url
  $PY -m quickdraft bench --model "$MODEL" --endpoint "$2" --served-model m --dataset mtbench --num-prompts "$PROMPTS" \
    --max-tokens "$TOKENS" --ignore-eos --concurrency "$N" --no-progress --out "$OUT/$1" 2>&1 | grep '^|'
}
run_llama() {  # name extra-args...
  local name=$1; shift
  LD_LIBRARY_PATH=$BIN "$BIN/llama-server" -m "$MODEL" -t 2 -np "$N" -c $((CTX * N)) --port 8181 -a m "$@" \
    >"/tmp/$name.log" 2>&1 &
  local pid=$!
  wait_up http://127.0.0.1:8181 && bench "$name" http://127.0.0.1:8181
  kill $pid; wait $pid 2>/dev/null
}
run_quickdraft() {  # name extra-args...
  local name=$1; shift
  $PY -m quickdraft serve --model "$MODEL" --served-model-name m --port 8182 --threads 2 --max-context $CTX \
    --max-concurrency "$N" "$@" >"/tmp/$name.log" 2>&1 &
  local pid=$!
  wait_up http://127.0.0.1:8182 && bench "$name" http://127.0.0.1:8182
  kill $pid; wait $pid 2>/dev/null
}
mkdir -p "$OUT"
run_llama llama-server-plain
run_llama llama-server-ngram-mod --spec-type ngram-mod
run_quickdraft quickdraft-none --draft none
run_quickdraft quickdraft-auto
