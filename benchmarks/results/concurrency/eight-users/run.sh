#!/usr/bin/env bash
# 4 vs 8 users through one quickdraft server (--max-concurrency 8), then llama-server -np 8 plain.
cd /work/main
MODEL=$HOME/.cache/quickdraft/models/qwen2.5-coder-1.5b-instruct.gguf
BIN=$HOME/.cache/quickdraft/llamacpp-native/bin
OUT=benchmarks/results/concurrency/eight-users
mkdir -p $OUT
wait_up() { for _ in $(seq 300); do curl -sf "$1/health" >/dev/null && return 0; sleep 1; done; return 1; }
bench() { .venv/bin/python -m quickdraft bench --model "$MODEL" --endpoint "$2" --served-model m --dataset mtbench --num-prompts 8 \
    --max-tokens 64 --ignore-eos --concurrency "$3" --no-progress --out "$OUT/$1" 2>&1 | grep '^|'; }
.venv/bin/python -m quickdraft serve --model "$MODEL" --served-model-name m --port 8182 --threads 2 --max-context 4096 --max-concurrency 8 $QD_ARGS > /tmp/qd8.log 2>&1 &
pid=$!
wait_up http://127.0.0.1:8182
bench quickdraft${QD_TAG}-4users http://127.0.0.1:8182 4
bench quickdraft${QD_TAG}-8users http://127.0.0.1:8182 8
echo "quickdraft server RSS: $(ps -o rss= -p $pid) KB"
kill $pid; wait $pid 2>/dev/null
LD_LIBRARY_PATH=$BIN $BIN/llama-server -m "$MODEL" -t 2 -np 8 -c 32768 --port 8181 -a m > /tmp/ls8.log 2>&1 &
pid=$!
wait_up http://127.0.0.1:8181 && bench llama-server-plain-8users http://127.0.0.1:8181 8
echo "llama-server RSS: $(ps -o rss= -p $pid) KB"
kill $pid; wait $pid 2>/dev/null
