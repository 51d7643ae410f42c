#!/usr/bin/env bash
# N users at once: quickdraft serve with the default drafter vs --draft none, both servers up at once
# (each idle while the other is measured), measured by `quickdraft bench --concurrency N` twice in
# alternating order (default second, then first), so a drift of the machine shows as a difference
# between the two runs rather than between the servers.
#   benchmarks/concurrency_default_vs_plain.sh [MODEL] [N] [PROMPTS] [TOKENS] [OUT]
set -uo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-$HOME/.cache/quickdraft/models/qwen2.5-coder-1.5b-instruct.gguf}
N=${2:-4}; PROMPTS=${3:-8}; TOKENS=${4:-128}; OUT=${5:-benchmarks/results/concurrency/default-vs-plain}
PY=.venv/bin/python
serve() {  # port extra-args...
  local port=$1; shift
  $PY -m quickdraft serve --model "$MODEL" --served-model-name m --port "$port" --threads 2 --max-context 4096 \
    --max-concurrency "$N" "$@" >"/tmp/quickdraft-$port.log" 2>&1 &
  echo $!
}
wait_up() { for _ in $(seq 300); do curl -sf "$1/health" >/dev/null && return 0; sleep 1; done; return 1; }
bench() {  # name url url
  $PY -m quickdraft bench --model "$MODEL" --endpoint "$2" --endpoint "$3" --served-model m --dataset mtbench \
    --num-prompts "$PROMPTS" --max-tokens "$TOKENS" --ignore-eos --concurrency "$N" --no-progress --out "$OUT/$1" \
    2>&1 | grep '^|'
}
PLAIN=$(serve 8191 --draft none)
DEFAULT=$(serve 8192)
trap 'kill $PLAIN $DEFAULT 2>/dev/null' EXIT
wait_up http://127.0.0.1:8191 && wait_up http://127.0.0.1:8192 || { echo "a server did not start: /tmp/quickdraft-819*.log"; exit 1; }
echo "8191: --draft none; 8192: the default drafter"
bench run1 http://127.0.0.1:8191 http://127.0.0.1:8192
bench run2 http://127.0.0.1:8192 http://127.0.0.1:8191
