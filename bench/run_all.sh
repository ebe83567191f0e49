#!/usr/bin/env bash
# Run every benchmark; results in bench/results/*.json and bench/results/SUMMARY.md. Args go to run_all.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
exec "$PY" bench/run_all.py "$@"
