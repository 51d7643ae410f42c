#!/usr/bin/env bash
# Create .venv and install quickdraft into it. Usage: scripts/setup.sh [--test]
# torch is pinned to 2.13.0 and installed first: on these machines pip takes that CPU wheel from
# local disk; any other version (or a bare "torch") would download a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${QUICKDRAFT_TORCH:-torch==2.13.0}
extras=""
[ "${1:-}" = "--test" ] && extras="[test]"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -c 'import torch' 2>/dev/null || .venv/bin/python -m pip install -q --disable-pip-version-check $TORCH_SPEC
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".${extras}"
