#!/usr/bin/env bash
# One-step set-up on a fresh machine: a virtual environment in .venv with the package and its test extras, and the
# Debian packages that hold the default corpus sources. Idempotent and quick when everything is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
stamp=.venv/.gated-attention-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    # torch==2.13.0 is the local CPU wheel: the pin keeps pip from pulling a multi-GB CUDA build.
    .venv/bin/python -m pip install -q -e '.[dev]'
    touch "$stamp"
fi
# Corpus sources from Debian (Austen, KJV Bible, Python docs). Not fatal: `gattn data prepare` skips what is missing.
bash scripts/install_debian_deps.sh || echo "setup: Debian corpus packages unavailable; those domains will be skipped" >&2
