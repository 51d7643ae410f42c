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
if [ -n "$extras" ]; then
    # Reference implementations for the EAGLE-3 parity tests (tests/test_eagle3_parity.py): their
    # own code only. --no-deps: they pin other torch / transformers versions, and a second torch
    # must never be installed. loguru and hs-connectors are small pure-Python imports of theirs.
    .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps \
        speculators==0.9.0 loguru==0.7.3 hs-connectors==0.9.0
    # SpecForge's own model code, kept in a folder of its own (tests/eagle3_specforge.py puts it
    # on sys.path): its wheel pins torch 2.11 and sglang, none of which it needs for a head's forward.
    [ -d .venv/reference/specforge/specforge ] || .venv/bin/python -m pip install -q --disable-pip-version-check \
        --no-deps --target .venv/reference/specforge specforge==0.2.0
    # tests/test_webui.py drives the chat page in a real browser: Debian's chromium and its
    # chromedriver (selenium comes with the test extras). Where apt-get cannot run as root the
    # test is skipped and says why.
    if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
        sudo=""
        [ "$(id -u)" = 0 ] || sudo="sudo -n"
        if command -v apt-get >/dev/null && { [ -z "$sudo" ] || sudo -n true 2>/dev/null; }; then
            { $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq \
                --no-install-recommends chromium chromium-driver; } >/dev/null \
                || echo "setup: could not install chromium and chromium-driver; the browser test will be skipped" >&2
        else
            echo "setup: chromium and chromium-driver are missing and apt-get cannot run as root here;" \
                "the browser test will be skipped (install them: apt-get install chromium chromium-driver)" >&2
        fi
    fi
fi
