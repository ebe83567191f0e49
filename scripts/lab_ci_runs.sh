#!/usr/bin/env bash
# Every lab's CI budget (and `gattn compare --budget small`, the scaling lab's quick ladder as its tests run it), run
# into OUT/<lab>/ (fp32, one job: figures that depend only on the code), so two versions of the code can be compared
# lab by lab with scripts/compare_lab_json.py (compare: OUT/compare/compare.json). Usage:
#   PYTHONPATH=SRC bash scripts/lab_ci_runs.sh OUT [TESTS_DIR] [lab ...]
# TESTS_DIR (default tests/) provides the tiny corpus builder the stability lab's CI run trains on.
set -euo pipefail
out=$1; tests=${2:-tests}; shift $(( $# >= 2 ? 2 : 1 ))
labs=${*:-"sinks stability retrofit streaming quant compare scaling"}
py=${PYTHON:-python}
gattn() { "$py" -m gated_attention.cli "$@"; }
mkdir -p "$out"
for lab in $labs; do
  case $lab in
    sinks) gattn lab sinks --budget small --precision fp32 --jobs 1 --out "$out/sinks" >/dev/null ;;
    stability)
      [ -f "$out/corpus/manifest.json" ] || "$py" -c "
import random, sys; sys.path[:0] = ['$tests/support', '$tests']; import harness, conftest
rng = random.Random(0)
harness.prepare_text_corpus('$out/corpus', {'prose': {f'book{i}.txt': conftest._prose(rng, 60) for i in range(4)},
    'code': {f'mod{i}.py': conftest._code(rng, 80) for i in range(3)}}, vocab_size=300, val_fraction=0.2, chunk_chars=600)"
      gattn lab stability --budget small --data-dir "$out/corpus" --variants baseline sdpa_elementwise --qk-norm off \
        --precision fp32 --jobs 1 --out "$out/stability" >/dev/null ;;
    retrofit) gattn lab retrofit --from "$out/sinks/runs/baseline/seed0" --recipes identity-gates --steps 6 --seeds 1 \
        --eval-size 4 --stream-window 8 --batch-size 2 --precision fp32 --jobs 1 --no-keep-models \
        --out "$out/retrofit" >/dev/null ;;
    streaming) gattn lab streaming --models "$out/sinks" --window 10 --sink-tokens 0 4 --sequences 4 \
        --out "$out/streaming" >/dev/null ;;
    quant) gattn lab quant --models "$out/sinks/runs/baseline/seed0" "$out/sinks/runs/sdpa_elementwise/seed0" \
        --schemes int8-weight --eval-windows 4 --out "$out/quant" >/dev/null ;;
    compare) [ -f "$out/corpus/manifest.json" ] || { echo "compare: run stability first (it builds the corpus)" >&2; exit 2; }
      (cd "$out" && gattn compare --budget small --data-dir "$out/corpus" --set precision=fp32 --jobs 1 \
        --out "$out/compare" >/dev/null) ;;
    scaling) [ -f "$out/corpus/manifest.json" ] || { echo "scaling: run stability first (it builds the corpus)" >&2; exit 2; }
      gattn lab scaling --budget quick --variants baseline sdpa_elementwise --lrs 0.01 0.02 --max-pairs 2 \
        --data-dir "$out/corpus" --precision fp32 --jobs 1 --out "$out/scaling" >/dev/null ;;
    *) echo "unknown lab $lab" >&2; exit 2 ;;
  esac
  echo "$lab done -> $out/$lab"
done
