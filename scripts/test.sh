#!/usr/bin/env bash
# Set up quickdraft with its test dependencies, then lint, type-check and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --test
.venv/bin/ruff check quickdraft tests benchmarks
.venv/bin/mypy quickdraft
# Two worker processes (pytest-xdist): each takes a run of consecutive tests (a file's module
# fixtures, the models it loads, mostly built once) and takes over the other's queue when its own
# is done. Tests can run side by side: servers listen on port 0, the user cache is written by
# atomic renames (quickdraft.kept) and downloads under a lock, torch threads are per process.
# "-n 0" after it runs the suite in this process. One compute thread each (OMP_NUM_THREADS, which
# quickdraft and torch read): two workers of two threads on two cores spin at every parallel
# region's barrier while the other holds a core (a bench run took 53 s instead of 7.5 s).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
.venv/bin/python -m pytest -q -n 2 --dist worksteal "$@"
