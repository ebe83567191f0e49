#!/usr/bin/env bash
# The GPU check, in one command that ends within TOTAL_LIMIT seconds (default 470: under 8 minutes) on a single CUDA GPU
# (H100/H200 class):
#   1. the kernel tests WITHOUT Triton's interpreter (tests/test_triton_attention.py with TRITON_INTERPRET=0: the same
#      forward/gradient checks as on CPU, on the GPU with the compiled kernels, plus bf16 at the GPU's own tiles);
#   2. the paper's 28-layer recipe on this machine's GPUs beside its plan: `bench/bench_plan.py run --preset
#      paper-dense-28l` under torchrun, one rank per GPU (NGPUS, default every visible GPU; NCCL, chosen by the
#      device), so the recipe's FSDP2 setting runs as FSDP2 even on one GPU (G1 elementwise, bf16-params, activation
#      checkpointing, seq 4096, micro-batch 1; the triton_gated kernel if part 1 passed, else sdpa; a global batch of
#      PAPER_BATCH sequences for PAPER_STEPS steps, synthetic tokens): tokens/s, MFU (over the GPU's nominal dense
#      bf16 peak) and each rank's peak memory of every step (torch.cuda.max_memory_allocated / reserved, read before
#      the trainer's log line resets them) next to `gattn plan`'s prediction for the same setting ->
#      $OUT/paper_28l/rank<r>.json;
#   3. bench/bench_kernel.py: fused gated kernel vs the ungated kernel vs SDPA (flash) + the separate gate, forward and
#      forward+backward, bf16, D=128, T = 1k..16k -> bench/results/kernel.json;
#   4. a short training run with the kernel (`gattn train --set attn_implementation=triton_gated`, a 4-layer model of
#      the 1.7B shape: d=2048, 16 q / 8 kv heads, head_dim 128, 32k vocabulary, G1 elementwise, synthetic tokens, bf16) next to the
#      same run with sdpa: both loss curves must agree (bf16 noise) and the tokens/s of each is printed;
#   5. the paper presets' parallel setting on this GPU: `torchrun --nproc_per_node=1 gattn train --set dist=fsdp` runs
#      FSDP2 over a one-rank group (train/dist.py) with bf16-params, grad_accum 4 (reduce-scatter per micro-batch),
#      compile=true and activation checkpointing, a DCP checkpoint mid-run and a `--resume auto` restart from it that
#      must log the uninterrupted run's losses; the restarted run also keeps the layers gathered across the
#      micro-batches (keep_gathered=true), prefetches two layers and checkpoints selectively, which change no loss.
#      What one GPU cannot show: NCCL between ranks (two processes cannot share one GPU under NCCL), the
#      reduce-scatter's real traffic, memory at N > 1 shards; the CPU tests (tests/test_distributed.py, gloo, 2 ranks)
#      cover the multi-rank logic, docs/scale.md says what is validated;
#   6. with >= 2 GPUs: bench/parallel_check.py, both paper presets shrunk to 2 layers as FSDP2, HSDP and EP under
#      torchrun with NCCL, each beside its plan (per-step peak memory of every rank, tokens/s, MFU, collective time).
# Each part has its own time limit, cut to what is left of TOTAL_LIMIT; the script goes on after a failed part and
# exits 1 if any failed.
# Needs: a python with a CUDA build of torch, Triton and the project's dependencies: the GPU machine's own `python3`
# by default (PYTHON=path/to/python to choose another; the package runs from src/ via PYTHONPATH, no install needed).
# Output: $OUT (default runs/gpu_check): one log per part, summary.txt and the small result files. Training runs and
# their checkpoints (GBs) go to $WORK (default /tmp/gattn_gpu_check, outside $OUT; removed at the end unless KEEP_WORK=1).
# Run: bash bench/gpu_check.sh            (TRAIN_STEPS=60, SEQS=1024,2048,4096,8192,16384, PAPER_STEPS=8,
#                                          PAPER_BATCH=8 to change the sizes)
#      bash bench/gpu_check.sh --dry-run  (any machine, no GPU needed: prints every part's command and limit, checks
#                                          the paper part's settings and prints `gattn plan`'s prediction for them)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-runs/gpu_check}
WORK=${WORK:-/tmp/gattn_gpu_check}  # run folders and checkpoints: never inside $OUT (what comes back stays small)
SEQS=${SEQS:-1024,2048,4096,8192,16384}
TRAIN_STEPS=${TRAIN_STEPS:-60}
PAPER_STEPS=${PAPER_STEPS:-8}
PAPER_BATCH=${PAPER_BATCH:-8}
TOTAL_LIMIT=${TOTAL_LIMIT:-470}
DRY=0
for arg in "$@"; do
  case $arg in
    --dry-run) DRY=1 ;;
    *) echo "gpu_check: unknown argument $arg (use --dry-run or none)" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT" "$WORK"
case "$(cd "$WORK" && pwd)/" in "$(cd "$OUT" && pwd)/"*) echo "gpu_check: WORK=$WORK is inside OUT=$OUT; choose a folder outside it" >&2; exit 2 ;; esac
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
failed=0
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"

say() { echo "$*" | tee -a "$SUMMARY"; }
part() {  # part NAME LIMIT_S CMD...: run with a time limit, log to $OUT/NAME.log, record pass/fail and seconds
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS left=$((TOTAL_LIMIT - SECONDS))
  [ "$limit" -gt "$left" ] && limit=$left  # the whole script stays within TOTAL_LIMIT
  if [ "$DRY" = 1 ]; then say "== $name (limit ${limit}s) would run: $*"; return 0; fi
  if [ "$limit" -le 0 ]; then say "-- $name: SKIPPED (no time left of TOTAL_LIMIT=${TOTAL_LIMIT}s)"; failed=1; return 0; fi
  say "== $name (limit ${limit}s): $*"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$OUT/$name.log"
  if [ $rc -eq 0 ]; then say "-- $name: ok ($((SECONDS - t0)) s)"; else say "-- $name: FAILED rc=$rc ($((SECONDS - t0)) s; see $OUT/$name.log)"; failed=1; fi
}

# 0. the machine: refuse clearly when there is no GPU (nothing below could run); a dry run only reports it
if [ "$DRY" = 1 ]; then
  say "gpu_check --dry-run: nothing is trained or timed; $("$PY" -c 'import torch; print(f"torch {torch.__version__}, CUDA visible: {torch.cuda.is_available()}")')"
elif ! "$PY" - <<'EOF' 2>&1 | tee -a "$SUMMARY"
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
part kernel_tests 100 env TRITON_INTERPRET=0 "$PY" -m pytest -q -p no:cacheprovider -m "not slow" \
  tests/test_triton_attention.py
IMPL=triton_gated
if [ "$DRY" = 0 ] && ! grep -q "kernel_tests: ok" "$SUMMARY"; then IMPL=sdpa; say "(kernel tests failed: part 2 uses sdpa)"; fi

# 2. the paper's 28-layer recipe on this machine's GPUs (one torchrun rank each), measured beside gattn plan's
# prediction for the same setting
NGPUS=${NGPUS:-$("$PY" -c 'import torch; print(max(torch.cuda.device_count(), 1))')}
PAPER_SETS=(--set gate=sdpa_elementwise --set device=cuda --set data=synthetic --set attn_implementation=$IMPL
  --set batch_size="$PAPER_BATCH" --set steps="$PAPER_STEPS" --set warmup_steps=2 --set eval_batches=1
  --set eval_batch_size=1 --set ckpt_every=0 --set stats_every=0 --set compile=false --set progress=false
  --set tensorboard=false)
if [ "$DRY" = 1 ]; then  # the settings parse, and the plan of them (CPU, meta device: seconds)
  "$PY" -m gated_attention.cli plan --preset paper-dense-28l --gpus "$NGPUS" --gpu-memory 141 --gpu-tflops 989 \
    "${PAPER_SETS[@]}" | tee -a "$SUMMARY" || { say "-- plan of the paper part: FAILED"; failed=1; }
fi
rm -rf "$WORK/paper_28l" "$OUT/paper_28l"
part paper_28l 120 env TRITON_INTERPRET=0 "$PY" -m torch.distributed.run --standalone --nproc_per_node="$NGPUS" \
  bench/bench_plan.py run --preset paper-dense-28l --out "$WORK/paper_28l" "${PAPER_SETS[@]}"
if [ "$DRY" = 0 ]; then mkdir -p "$OUT/paper_28l"; cp "$WORK"/paper_28l/rank*.json "$OUT/paper_28l/" 2>/dev/null; fi

# 3. kernel timings: fused gated vs ungated kernel vs SDPA flash + separate gate, bf16, D=128
part bench_kernel 50 env TRITON_INTERPRET=0 "$PY" bench/bench_kernel.py --seqs "$SEQS" --head-dim 128 \
  --dtype bf16 --reps 20 --out kernel

# 4. a short training run with the kernel, and the same run with sdpa (same seed, same batches)
train() {  # train IMPL
  TRITON_INTERPRET=0 "$PY" -m gated_attention.cli train --preset small --gate sdpa_elementwise \
    --out "$WORK/train_$1" --set attn_implementation="$1" --set device=cuda --set data=synthetic \
    --set model=1.7b-28l --set model.num_hidden_layers=4 --set model.vocab_size=32768 --set seq_len=2048 --set batch_size=8 \
    --set steps="$TRAIN_STEPS" --set warmup_steps=10 --set eval_every=0 --set eval_batches=2 \
    --set ckpt_every=0 --set stats_every=0 --set compile=false --set tensorboard=false --set progress=false
}
rm -rf "$WORK/train_triton_gated" "$WORK/train_sdpa"
part train_triton_gated 35 train triton_gated
part train_sdpa 35 train sdpa
part train_compare 10 "$PY" - "$WORK" "$OUT" <<'EOF'
import json, sys
from pathlib import Path
out, dest = Path(sys.argv[1]), Path(sys.argv[2])
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
json.dump({"triton_gated": a, "sdpa": b, "max_abs_loss_diff": diff}, open(dest / "train_compare.json", "w"), indent=1)
# bf16 training is not bitwise reproducible across kernels; the curves must still track each other
sys.exit(0 if abs(last(a["losses"]) - last(b["losses"])) < 0.05 and diff < 0.25 else 1)
EOF

# 5. FSDP2 (one rank) + accumulation + compile + activation checkpointing, and a torchrun restart with --resume auto:
# the same run uninterrupted, then SIGKILLed after step 5 (checkpoint at 4; tests/probes/kill_hooks.py) and restarted by
# torchrun --max-restarts=1 with the same command line; both must log the same losses (bf16 on a GPU: within 2e-2)
FSDP_SETS=(--set gate=sdpa_elementwise --set device=cuda --set data=synthetic --set model=1.7b-28l
  --set model.num_hidden_layers=2 --set model.vocab_size=32768 --set seq_len=1024 --set batch_size=8
  --set grad_accum=4 --set dist=fsdp --set precision=bf16-params --set activation_checkpointing=full
  --set compile=true --set steps=8 --set ckpt_every=4 --set warmup_steps=2 --set eval_batches=1
  --set eval_batch_size=1 --set stats_every=0 --set progress=false --set tensorboard=false --set seed=3)
FSDP_CMD=(env TRITON_INTERPRET=0 "$PY" -m torch.distributed.run --standalone --nproc_per_node=1 --max-restarts=1
  tests/probes/kill_hooks.py train --preset small "${FSDP_SETS[@]}" --resume auto)  # first launch and restart alike
rm -rf "$WORK/fsdp_full" "$WORK/fsdp_restart"
part fsdp_full 50 "${FSDP_CMD[@]}" --out "$WORK/fsdp_full"
# the restarted run also runs the gather policy and selective checkpointing (issue 38): the layers' parameters kept
# gathered across the micro-batches, two layers prefetched, only the non-GEMM work recomputed; none changes the math
part fsdp_restart 55 env GATTN_TEST_KILL_AT_STEP=5 "${FSDP_CMD[@]}" --set activation_checkpointing=selective \
  --set keep_gathered=true --set fsdp_prefetch=2 --out "$WORK/fsdp_restart"
part fsdp_compare 10 "$PY" - "$WORK" "$OUT" <<'EOF'
import json, math, sys
from pathlib import Path
work, dest = Path(sys.argv[1]), Path(sys.argv[2])
def losses(run):
    return [json.loads(x)["loss"] for x in (work / run / "log.jsonl").read_text().splitlines() if x.strip()]
full, restarted = losses("fsdp_full"), losses("fsdp_restart")
s = json.loads((work / "fsdp_full" / "summary.json").read_text())
r = json.loads((work / "fsdp_restart" / "summary.json").read_text())
rec = {"uninterrupted": full, "restarted": restarted, "parallel": s.get("parallel"), "speed": s.get("speed"),
       "restarted_parallel": r.get("parallel"), "restarted_speed": r.get("speed")}
json.dump(rec, open(dest / "fsdp_compare.json", "w"), indent=1)
print(f"FSDP2 over one rank: {rec['parallel']}; compiled: {rec['speed']['compiled']}")
print(f"restarted run (keep_gathered, fsdp_prefetch=2, selective): {rec['restarted_parallel']}, {rec['restarted_speed']}")
print(f"losses uninterrupted {[round(x, 4) for x in full]}\nlosses restarted     {[round(x, 4) for x in restarted]}")
ok = (len(full) == len(restarted) == 8 and all(math.isfinite(x) for x in full) and rec["speed"]["compiled"]
      and rec["parallel"]["wrapper"] == "fsdp" and max(abs(a - b) for a, b in zip(full, restarted)) < 2e-2
      and rec["restarted_parallel"].get("keep_gathered") is True)
sys.exit(0 if ok else 1)
EOF

# 6. on >= 2 GPUs: both paper presets shrunk to 2 layers in their parallel layouts (FSDP2, HSDP, EP), each under
# torchrun with NCCL beside its plan: every rank's peak memory of every step, tokens/s, MFU, time in collectives
# (bench/parallel_check.py; its CPU/gloo runs are tests/test_bench_plan.py)
if [ "$NGPUS" -ge 2 ]; then
  PAR_N=$((NGPUS / 2 * 2))
  rm -rf "$WORK/parallel"
  part parallel 240 env TRITON_INTERPRET=0 "$PY" bench/parallel_check.py --nproc "$PAR_N" --device cuda \
    --set attn_implementation=$IMPL --out "$WORK/parallel"
  if [ "$DRY" = 0 ]; then
    mkdir -p "$OUT/parallel"; cp "$WORK/parallel/parallel_check.json" "$OUT/parallel/" 2>/dev/null
    for d in "$WORK"/parallel/*/; do mkdir -p "$OUT/parallel/$(basename "$d")"; cp "$d"rank*.json "$d"log.txt \
      "$OUT/parallel/$(basename "$d")/" 2>/dev/null; done
  fi
else
  say "-- parallel: skipped (one GPU: FSDP2/HSDP/EP across ranks need >= 2; NGPUS=$NGPUS)"
fi

[ "$DRY" = 0 ] && [ "${KEEP_WORK:-0}" != 1 ] && rm -rf "$WORK"
say "== done in ${SECONDS}s; results: $SUMMARY, $OUT/paper_28l/rank0.json, bench/results/kernel.json, $OUT/train_compare.json, $OUT/fsdp_compare.json"
exit $failed
