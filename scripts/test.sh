#!/usr/bin/env bash
# Set up quickdraft with its test dependencies, then lint, type-check and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --test
.venv/bin/ruff check quickdraft tests benchmarks
.venv/bin/mypy quickdraft
# Two worker processes (pytest-xdist), each test file on one of them (its module fixtures, the
# models it loads, built once): servers listen on port 0, the user cache is written by atomic
# renames (quickdraft.kept) and downloads under a lock, torch threads are per process. "-n 0"
# after it runs the suite in this process.
.venv/bin/python -m pytest -q -n 2 --dist loadfile "$@"
