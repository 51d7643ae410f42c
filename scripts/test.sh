#!/usr/bin/env bash
# Set up quickdraft with its test dependencies, then lint, type-check and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --test
.venv/bin/ruff check quickdraft tests benchmarks
.venv/bin/mypy quickdraft
.venv/bin/python -m pytest -q "$@"
