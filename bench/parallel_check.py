"""The paper presets' parallel layouts, shrunk, each measured beside its plan: one torchrun launch per part of
`bench_plan.py run` (N ranks; the process group's backend follows the device: NCCL on GPUs, gloo on CPUs), each rank
recording its memory of every step before the trainer's log line resets the peaks, tokens/s and MFU against the plan,
and the time in collectives over a profiled window (torch.profiler: NCCL kernels' device time on a GPU, the
collective ops' CPU time on a CPU; under expert parallelism the all-to-alls are among them).

Parts (a preset and a layout; `--parts` picks some):
  dense-fsdp   paper-dense-28l, FSDP2 over every rank
  dense-hsdp   paper-dense-28l, HSDP: dp_replicate=2 replicas of FSDP2 over N/2 ranks
  moe-fsdp     paper-moe-15a2b, FSDP2 over every rank
  moe-ep       paper-moe-15a2b, the routed experts sharded over 2 ranks (expert_parallel=2), all-to-all dispatch

Every part keeps its preset's recipe (bf16-params, activation checkpointing, micro-batch 1) on a model shrunk to
--layers layers; `--set KEY=VALUE` shrinks it further (the CPU test: a model of seconds). Output: OUT/<part>/rank<r>.json
(bench_plan's records) and OUT/parallel_check.json, one row per part; a line per part on stdout. Exit 1 if a part
failed (the others still run).

Run: python bench/parallel_check.py --nproc 2 --out runs/parallel_check           (bench/gpu_check.sh on >= 2 GPUs)
     python bench/parallel_check.py --nproc 2 --device cpu --set model.hidden_size=64 ...  (tests/test_bench_plan.py)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PARTS = {  # name: (training preset, the layout's settings)
    "dense-fsdp": ("paper-dense-28l", ["dist=fsdp"]),
    "dense-hsdp": ("paper-dense-28l", ["dist=fsdp", "dp_replicate=2"]),
    "moe-fsdp": ("paper-moe-15a2b", ["dist=fsdp"]),
    "moe-ep": ("paper-moe-15a2b", ["dist=fsdp", "expert_parallel=2"]),
}


def part_command(args, name: str) -> list[str]:
    """The torchrun command line of part `name`."""
    preset, layout = PARTS[name]
    sets = [f"model.num_hidden_layers={args.layers}", f"device={args.device}", "data=synthetic",
            f"seq_len={args.seq}", f"batch_size={args.batch}", f"steps={args.steps}", "warmup_steps=1",
            "eval_batches=1", "eval_batch_size=1", "ckpt_every=0", "stats_every=0", "compile=false",
            "progress=false", "tensorboard=false", f"profile_steps={args.steps - 2}-{args.steps - 1}", *layout,
            *args.sets]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
            str(HERE / "bench_plan.py"), "run", "--preset", preset, "--out", str(Path(args.out) / name),
            *sum((["--set", s] for s in sets), [])]


def part_row(out: Path, nproc: int) -> dict:
    """What a finished part measured, from its ranks' records and rank 0's profile."""
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]
    prof = out / "run" / "profile" / "rank0" / "summary.json"
    r0 = ranks[0]
    return {"dist": r0["dist"], "world_size": r0["world_size"], "device": r0["device"],
            "resolved_precision": r0["resolved_precision"],
            "plan_memory_gb": r0["plan"]["memory_per_gpu_gb"]["total"],
            "peak_allocated_gb": [r["cuda_peak_allocated_gb"] for r in ranks],
            "peak_reserved_gb": [r["cuda_peak_reserved_gb"] for r in ranks],
            "peak_rss_gb": [max(m.get("rss_peak_gb", 0.0) for m in r["steps_memory"]) or None for r in ranks],
            "tokens_per_s": r0["tokens_per_s"], "mfu": r0["mfu"],
            "plan_tokens_per_s": r0["plan"].get("tokens_per_s"),
            "comm_s_per_step": json.loads(prof.read_text())["comm_s_per_step"] if prof.is_file() else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    ap.add_argument("--nproc", type=int, default=2, help="ranks per part (HSDP and EP need an even number)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=None, help="global batch in sequences (default: 2 per rank)")
    ap.add_argument("--steps", type=int, default=6, help="steps per part; the last two are profiled")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per part")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    names = args.parts.split(",")
    unknown = [n for n in names if n not in PARTS]
    problem = (f"unknown part(s) {', '.join(unknown)}; valid: {', '.join(PARTS)}" if unknown else
               f"--nproc {args.nproc}: HSDP and EP need an even number of ranks >= 2" if args.nproc < 2 or args.nproc % 2
               else f"--steps {args.steps}: at least 3 (the last two are profiled)" if args.steps < 3 else None)
    if problem:
        print(f"parallel_check: error: {problem}", file=sys.stderr)
        return 2
    args.batch = args.batch or 2 * args.nproc
    rows, failed = {}, False
    env = {**os.environ, "PYTHONPATH": str(HERE.parent / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for name in names:
        cmd = part_command(args, name)
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
            ok = p.returncode == 0
            log = p.stdout + p.stderr
        except subprocess.TimeoutExpired as exc:
            ok, log = False, f"timed out after {args.timeout:.0f} s\n{exc.stderr or ''}"
        (Path(args.out) / name).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / name / "log.txt").write_text(log if isinstance(log, str) else log.decode())
        if not ok:
            failed = True
            rows[name] = {"failed": True}
            print(f"{name}: FAILED (see {Path(args.out) / name / 'log.txt'})", flush=True)
            continue
        rows[name] = row = part_row(Path(args.out) / name, args.nproc)
        peak = row["peak_allocated_gb"] if args.device == "cuda" else row["peak_rss_gb"]
        print(f"{name}: {row['dist']} x{row['world_size']} plan {row['plan_memory_gb']:.2f} GB/rank, measured "
              f"peak {' / '.join(f'{x:.2f}' for x in peak)} GB; {row['tokens_per_s']:,.0f} tok/s"
              + (f", MFU {row['mfu']:.3f}" if row["mfu"] is not None else "")
              + (f"; collectives {row['comm_s_per_step'] * 1e3:.1f} ms/step" if row["comm_s_per_step"] else ""),
              flush=True)
    (Path(args.out) / "parallel_check.json").write_text(json.dumps({"args": vars(args), "parts": rows}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
