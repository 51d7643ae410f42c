#!/usr/bin/env bash
# The prepared GPU check (benchmarks/gpu_check.py) for a session that is lent a GPU machine.
#
# Once, on the development machine (the GPU machine has torch, transformers, tokenizers,
# safetensors and jinja2, but not gguf; it cannot reach a package index):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: -d .whl "gguf==$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("gguf"))')"
# Then with the device tool: run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=540)
# Results: $OUT/gpu_check.json (or ./gpu_check.json without $OUT). Under 8 minutes on one H200.
set -euo pipefail
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
timeout 460 python3 benchmarks/gpu_check.py --out "${OUT:-.}/gpu_check.json" "$@"
