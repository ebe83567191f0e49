"""FSDP2's gather policies (train/fsdp_policy.py) at 2 ranks on CPU: tokens/s of `gattn train` per policy, beside the
all-gathers per step and the bytes `gattn plan` counts for it (tests/test_fsdp_policy.py checks the trainer makes
exactly those all-gathers).

Every repetition launches one 2-rank `gattn train` (torchrun, gloo, one thread per rank) per variant, in turn (A B C
..., the next repetition in the reverse order), and takes the median tokens/s of its steady steps from log.jsonl
(step 0 builds FSDP2's state and warms up: left out). The JSON holds each variant's per-repetition figures, their
median and its ratio to the first variant, the plan's all-gathers, the CPU, the precision and /proc/loadavg before
and after each launch. `--baseline-src DIR` adds a variant "before": the same run from another checkout's src (the
trainer before this policy), launched in the same rotation.

Run: python bench/bench_fsdp_policy.py [--layers 8 --hidden 512 --ffn 1536 --vocab 8192 --seq 128 --grad-accum 4
     --steps 6 --reps 3 --variants default,always,never,keep,prefetch2 --baseline-src /path/to/other/src]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import common  # (also puts src/ on the path)

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = {  # name -> the policy's settings
    "default": [], "always": ["reshard_after_forward=always"], "never": ["reshard_after_forward=never"],
    "keep": ["keep_gathered=true"], "prefetch2": ["fsdp_prefetch=2"],
}


def load1() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def base_sets(args) -> list[str]:
    heads = args.hidden // 64
    return [f"{k}={v}" for k, v in {
        "data": "synthetic", "model.vocab_size": args.vocab, "model.num_hidden_layers": args.layers,
        "model.hidden_size": args.hidden, "model.intermediate_size": args.ffn, "model.num_attention_heads": heads,
        "model.num_key_value_heads": heads, "model.head_dim": 64, "seq_len": args.seq,
        "batch_size": 2 * args.grad_accum, "grad_accum": args.grad_accum, "steps": args.steps, "warmup_steps": 1,
        "dist": "fsdp", "precision": "fp32", "compile": "false", "stats_every": 0, "eval_every": 0, "ckpt_every": 0,
        "keep_checkpoints": 1, "eval_batches": 1, "eval_batch_size": 1, "progress": "false",
        "tensorboard": "false"}.items()]


def launch(args, sets: list[str], src: Path, out: Path) -> list[float]:
    """One 2-rank `gattn train` of `sets` with `src` on the path; its steady steps' tokens/s."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "gated_attention.cli", "train", "--preset", "tiny", "--out", str(out), *sum((["--set", s] for s in sets), [])]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(src)}
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode:
        sys.exit(f"bench_fsdp_policy: {' '.join(cmd)} failed:\n{p.stderr[-3000:]}")
    log = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines() if x.strip()]
    return [r["tokens_per_s"] for r in log[1:]]


def planned(args, sets: list[str]) -> dict:
    from gated_attention.train.overrides import config_from_args
    from gated_attention.train.plan import plan

    p = plan(config_from_args("tiny", None, sets, None), gpus=2, device="cpu", precision="fp32", gpu_memory_gb=1e3)
    c, s = p["comm_per_step"], p["settings"]
    return {"all_gathers": c["all_gathers"], "all_gather_gb": c["all_gather_gb"], "keep_gathered": s["keep_gathered"],
            "gathered_layers": s["gathered_layers"], "buffers_gb": p["memory_per_gpu_gb"]["buffers"],
            "params_total": p["params_total"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in (("layers", 8), ("hidden", 512), ("ffn", 1536), ("vocab", 8192), ("seq", 128),
                          ("grad-accum", 4), ("steps", 6), ("reps", 3)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"of {', '.join(VARIANTS)}")
    ap.add_argument("--baseline-src", type=Path, default=None,
                    help="another checkout's src/ run as variant 'before' (no policy settings)")
    ap.add_argument("--out", default="fsdp_policy")
    args = ap.parse_args()
    base = base_sets(args)
    runs = {name: (base + VARIANTS[name], ROOT / "src") for name in args.variants.split(",")}
    if args.baseline_src is not None:
        runs = {"before": (base, args.baseline_src.resolve()), **runs}
    rows = {name: {"tokens_per_s": [], "loads": [], "plan": planned(args, sets) if name != "before" else None}
            for name, (sets, _) in runs.items()}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for name in (list(runs) if rep % 2 == 0 else list(reversed(runs))):
                sets, src = runs[name]
                before = load1()
                steady = launch(args, sets, src, Path(tmp) / f"{name}_{rep}")
                rows[name]["tokens_per_s"].append(statistics.median(steady))
                rows[name]["loads"].append([before, load1()])
                print(f"  rep {rep + 1}/{args.reps} {name}: {statistics.median(steady):,.0f} tokens/s "
                      f"(steps {', '.join(f'{t:.0f}' for t in steady)}; load {before:.2f})", flush=True)
    first = statistics.median(next(iter(rows.values()))["tokens_per_s"])
    for row in rows.values():
        row["median_tokens_per_s"] = statistics.median(row["tokens_per_s"])
        row["vs_first"] = row["median_tokens_per_s"] / first
    result = {"machine": common.machine(), "resolved_precision": "fp32", "args": {k: str(v) for k, v in vars(args).items()},
              "rows": rows}
    path = common.write_json(args.out, result)
    print(f"{'variant':<10} {'tokens/s (median)':>18} {'vs first':>8} {'all-gathers':>11} {'GB gathered':>11}  per rep")
    for name, row in rows.items():
        plan = row["plan"] or {}
        print(f"{name:<10} {row['median_tokens_per_s']:18,.0f} {row['vs_first']:8.3f} "
              f"{plan.get('all_gathers', '-'):>11} {plan.get('all_gather_gb', float('nan')):11.3f}  "
              + ", ".join(f"{t:.0f}" for t in row["tokens_per_s"]))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
