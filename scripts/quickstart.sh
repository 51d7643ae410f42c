#!/usr/bin/env bash
# Set up quickdraft and stream a speculative answer from the default model, with its speed.
# The model (Qwen2.5-Coder-1.5B-Instruct, 1.1 GB) is fetched into ~/.cache/quickdraft on first use.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/quickdraft generate "${@:-Write a Python function that merges two sorted lists into one sorted list, with a docstring and a short example.}"
