#!/usr/bin/env bash
# The GPU check of the fused gated attention kernel (attn_implementation="triton_gated"), in one script that runs in
# under 8 minutes on a single CUDA GPU (H100/H200 class):
#   1. the kernel tests WITHOUT Triton's interpreter (tests/test_triton_attention.py with TRITON_INTERPRET=0: the same
#      forward/gradient checks as on CPU, on the GPU with the compiled kernels, plus bf16 at the GPU's own tiles);
#   2. bench/bench_kernel.py: fused gated kernel vs the ungated kernel vs SDPA (flash) + the separate gate, forward and
#      forward+backward, bf16, D=128, T = 1k..16k -> bench/results/kernel.json;
#   3. a short training run with the kernel (`gattn train --set attn_implementation=triton_gated`, a 4-layer model of
#      the 1.7B shape: d=2048, 16 q / 8 kv heads, head_dim 128, 32k vocabulary, G1 elementwise, synthetic tokens, bf16) next to the
#      same run with sdpa: both loss curves must agree (bf16 noise) and the tokens/s of each is printed.
# Each part has its own time limit; the script goes on after a failed part and exits 1 if any failed.
# Needs: the project's environment with a CUDA build of torch and Triton (PYTHON=path/to/python, default .venv/bin/python;
# `pip install -e '.[kernel]'`). Output: $OUT (default runs/gpu_check): one log per part, summary.txt.
# Run: bash bench/gpu_check.sh            (TRAIN_STEPS=60, SEQS=1024,2048,4096,8192,16384 to change the sizes)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=${OUT:-runs/gpu_check}
SEQS=${SEQS:-1024,2048,4096,8192,16384}
TRAIN_STEPS=${TRAIN_STEPS:-60}
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
failed=0
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"

say() { echo "$*" | tee -a "$SUMMARY"; }
part() {  # part NAME LIMIT_S CMD...: run with a time limit, log to $OUT/NAME.log, record pass/fail and seconds
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  say "== $name (limit ${limit}s): $*"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$OUT/$name.log"
  if [ $rc -eq 0 ]; then say "-- $name: ok ($((SECONDS - t0)) s)"; else say "-- $name: FAILED rc=$rc ($((SECONDS - t0)) s; see $OUT/$name.log)"; failed=1; fi
}

# 0. the machine: refuse clearly when there is no GPU (nothing below could run)
if ! "$PY" - <<'EOF' 2>&1 | tee -a "$SUMMARY"
import sys, torch
if not torch.cuda.is_available():
    sys.exit(f"gpu_check: no CUDA GPU visible to torch {torch.__version__} (a CPU build, or no driver); "
             "the kernel's CPU checks are `pytest tests/test_triton_attention.py` (Triton's interpreter)")
try:
    import triton
except ImportError:
    sys.exit("gpu_check: Triton is not installed: pip install 'triton==3.7.1' (or the project's 'kernel' extra)")
p = torch.cuda.get_device_properties(0)
print(f"GPU {p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}; torch {torch.__version__}, "
      f"triton {triton.__version__}, CUDA {torch.version.cuda}")
EOF
then
  exit 2
fi

# 1. kernel tests on the GPU (TRITON_INTERPRET=0: compiled kernels; the bf16 and GPU-tile tests run only here)
part kernel_tests 300 env TRITON_INTERPRET=0 "$PY" -m pytest -q -p no:cacheprovider -m "not slow" \
  tests/test_triton_attention.py

# 2. kernel timings: fused gated vs ungated kernel vs SDPA flash + separate gate, bf16, D=128
part bench_kernel 180 env TRITON_INTERPRET=0 "$PY" bench/bench_kernel.py --seqs "$SEQS" --head-dim 128 \
  --dtype bf16 --reps 20 --out kernel

# 3. a short training run with the kernel, and the same run with sdpa (same seed, same batches)
train() {  # train IMPL
  TRITON_INTERPRET=0 "$PY" -m gated_attention.cli train --preset small --gate sdpa_elementwise \
    --out "$OUT/train_$1" --set attn_implementation="$1" --set device=cuda --set data=synthetic \
    --set model=1.7b-28l --set model.num_hidden_layers=4 --set model.vocab_size=32768 --set seq_len=2048 --set batch_size=8 \
    --set steps="$TRAIN_STEPS" --set warmup_steps=10 --set eval_every=0 --set eval_batches=2 \
    --set ckpt_every=0 --set stats_every=0 --set compile=false --set tensorboard=false --set progress=false
}
rm -rf "$OUT/train_triton_gated" "$OUT/train_sdpa"
part train_triton_gated 150 train triton_gated
part train_sdpa 150 train sdpa
part train_compare 30 "$PY" - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
runs = {}
for impl in ("triton_gated", "sdpa"):
    log = [json.loads(x) for x in (out / f"train_{impl}" / "log.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in log if "loss" in r and "step" in r]
    tps = sorted(r["tokens_per_s"] for r in steps[3:] if "tokens_per_s" in r)  # steady steps (first ones compile)
    runs[impl] = {"losses": [r["loss"] for r in steps], "tok_s": tps[len(tps) // 2] if tps else float("nan")}
a, b = runs["triton_gated"], runs["sdpa"]
n = min(len(a["losses"]), len(b["losses"]))
last = lambda xs: sum(xs[n - 10:n]) / len(xs[n - 10:n])
diff = max(abs(x - y) for x, y in zip(a["losses"][:n], b["losses"][:n]))
print(f"triton_gated: {a['tok_s']:,.0f} tok/s, final loss (mean of last 10 steps) {last(a['losses']):.4f}")
print(f"sdpa:         {b['tok_s']:,.0f} tok/s, final loss (mean of last 10 steps) {last(b['losses']):.4f}")
print(f"speed ratio triton_gated / sdpa: {a['tok_s'] / b['tok_s']:.3f}; max |loss difference| over {n} steps {diff:.4f}")
json.dump({"triton_gated": a, "sdpa": b, "max_abs_loss_diff": diff}, open(out / "train_compare.json", "w"), indent=1)
# bf16 training is not bitwise reproducible across kernels; the curves must still track each other
sys.exit(0 if abs(last(a["losses"]) - last(b["losses"])) < 0.05 and diff < 0.25 else 1)
EOF

say "== done in ${SECONDS}s; results: $SUMMARY, bench/results/kernel.json, $OUT/train_compare.json"
exit $failed
