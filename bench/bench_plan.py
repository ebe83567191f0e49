"""`gattn plan` against a measured run: per-rank peak memory and tokens/s of a real `gattn train` run next to the plan's
prediction for the same setting, and the plan's FLOPs per token next to bench_train.py's count.

  run       ONE rank (alone, or under torchrun): train a preset with --set overrides through the trainer and write
            OUT/rank<r>.json: the plan of this exact setting (world size, precision as resolved here), the RSS after
            the imports (the runtime's own share), the peak RSS when the last training step ends (ru_maxrss, a
            high-water mark: build + training, before the final checkpoint and export), this rank's memory of
            every step (`steps_memory`: on CUDA torch.cuda.max_memory_allocated / reserved since the step before,
            read where the trainer's log line reads them, before it resets them; their maxima `cuda_peak_*`), the
            median tokens/s of the steady steps, and
            MFU (model FLOPs/s over --gpu-tflops; on CUDA the nominal dense bf16 peak of the GPU by name)
  validate  the CPU validation table (docs/scale.md): a >= 200M-parameter model trained a few steps in one process,
            DDP x2 and FSDP x2 (gloo), each rank under GNU `/usr/bin/time -v` (its whole-process peak RSS, final
            checkpoint and export included); /proc/loadavg before and after every run -> bench/results/<--out>.json
  table     validate's result files as the markdown table of docs/scale.md (plan total / measured peak RSS per row)

Run: python bench/bench_plan.py validate [--layers 12 --hidden 1024 --ffn 4096 --seq 1024 --steps 3
                                          --precision fp32 --modes 1proc,ddp,fsdp --ac none --out plan_check]
     python bench/bench_plan.py run --preset paper-dense-28l --set device=cuda ... --out DIR   (bench/gpu_check.sh)
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import common  # (also puts src/ on the path)

ROOT = Path(__file__).resolve().parent.parent
GPU_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0, "L40S": 362.0,
              "B200": 2250.0}  # nominal dense bf16 TFLOP/s (SXM parts)


def maxrss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux: KiB


def load1() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def gpu_tflops(device) -> float | None:
    import torch

    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in GPU_TFLOPS.items() if k in name), None)


def run_rank(args) -> int:
    import torch

    from gated_attention.train import dist as D
    from gated_attention.train.overrides import config_from_args
    from gated_attention.train.plan import plan
    from gated_attention.train.trainer import train
    from gated_attention.util.precision import resolve

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    baseline = maxrss_gb()  # torch, transformers and the package imported, nothing built
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    cfg = config_from_args(args.preset, None, args.sets, args.data_dir)
    device = D.pick_device(cfg.device, int(os.environ.get("LOCAL_RANK", "0")))
    # the wrapper the trainer applies (dist.setup): torchrun's one rank under dist=fsdp is FSDP2 over a one-rank group
    mode = cfg.dist if world > 1 or (cfg.dist == "fsdp" and "TORCHELASTIC_RUN_ID" in os.environ) else "none"
    precision = resolve(cfg.precision, device, mode)
    tflops = args.gpu_tflops or gpu_tflops(device)
    predicted = plan(cfg, gpus=world, precision=precision, device=device.type, mfu=0.5,
                     gpu_tflops=tflops or 1.0, gpu_memory_gb=1e6)
    marks: dict = {}

    def hook(step, model):
        marks["rss_gb"] = maxrss_gb()
        return None

    from gated_attention.train import metrics, trainer

    # this rank's memory of every step, as the trainer's log line reads it: on CUDA the peaks allocated and reserved
    # since the previous line, read there BEFORE the line resets them (a reader after it, e.g. a step hook, would see
    # neither the step's activations nor its loss)
    steps_memory: list[dict] = []
    read_memory = metrics.memory_record

    def memory_record(dev):
        rec = read_memory(dev)
        steps_memory.append(rec)
        return rec

    metrics.memory_record = memory_record
    timings: dict = {"save_s": [], "restore_s": None}
    save, restore = trainer._save_checkpoint, trainer._restore

    def timed_save(run, step, background=False):  # every checkpoint write, collective included (the final one at least)
        t = time.perf_counter()
        save(run, step, background)
        timings["save_s"].append(time.perf_counter() - t)

    def timed_restore(run, latest):
        t = time.perf_counter()
        restore(run, latest)
        if latest is not None:
            timings["restore_s"] = time.perf_counter() - t

    trainer._save_checkpoint, trainer._restore = timed_save, timed_restore
    out = Path(args.out)
    t0 = time.perf_counter()
    train(cfg, out / "run", step_hook=hook, resume=args.resume)
    wall = time.perf_counter() - t0
    if args.resume:  # a finished run resumed: what it measures is reading the last checkpoint back
        common.write_text(out / f"resume_rank{rank}.json", json.dumps({"rank": rank, **timings}))
        return 0
    log = [json.loads(x) for x in (out / "run" / "log.jsonl").read_text().splitlines() if x.strip()]
    steady = [r["tokens_per_s"] for r in log[1:] if "tokens_per_s" in r] or [log[-1]["tokens_per_s"]]
    tok_s = statistics.median(steady)  # cluster-wide tokens/s (the trainer logs the global batch's tokens)
    rec = {"rank": rank, "world_size": world, "dist": mode, "resolved_precision": precision,
           "activation_checkpointing": cfg.activation_checkpointing, "seq_len": cfg.seq_len,
           "micro_batch": predicted["settings"]["micro_batch"], "device": str(device),
           "baseline_rss_gb": baseline, "peak_rss_train_gb": marks.get("rss_gb"), "peak_rss_end_gb": maxrss_gb(),
           "cuda_peak_allocated_gb": max((m["mem_peak_gb"] for m in steps_memory if "mem_peak_gb" in m), default=None),
           "cuda_peak_reserved_gb": max((m["mem_peak_reserved_gb"] for m in steps_memory if "mem_peak_gb" in m),
                                        default=None),
           "steps_memory": steps_memory,
           "tokens_per_s": tok_s, "gpu_tflops": tflops,
           "mfu": tok_s * predicted["flops_per_token"] / (world * tflops * 1e12) if tflops else None,
           "wall_s": wall, "load_end": load1(), "plan": predicted, "save_s": timings["save_s"],
           "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
           "checkpoint_format": "dcp" if cfg.dist == "fsdp" else "full state dict",
           "checkpoint_mb": sum(f.stat().st_size for f in (out / "run" / "checkpoints").rglob("*") if f.is_file()) / 1e6}
    if rank == 0 and device.type == "cuda":  # the plan's own prediction of this speed at the measured MFU
        rec["plan_tokens_per_s_at_measured_mfu"] = rec["mfu"] * tflops * 1e12 * world / predicted["flops_per_token"]
    common.write_text(out / f"rank{rank}.json", json.dumps(rec, indent=1))
    if rank == 0:
        m = predicted["memory_per_gpu_gb"]
        got = rec["cuda_peak_allocated_gb"] if device.type == "cuda" else rec["peak_rss_train_gb"]
        print(f"bench_plan: {args.preset} world {world} {mode} {precision} ac={cfg.activation_checkpointing}: "
              f"plan {m['total']:.2f} GB/rank (params {m['params']:.2f}, grads {m['grads']:.2f}, optimizer "
              f"{m['optimizer']:.2f}, activations {m['activations']:.2f}, buffers {m['buffers']:.2f}, overhead "
              f"{m['overhead']:.2f}); measured peak {got:.2f} GB; {tok_s:,.0f} tokens/s"
              + (f", MFU {rec['mfu']:.3f}" if rec["mfu"] is not None else ""), flush=True)
    return 0


# ---------------------------------------------------------------- validate (CPU, the docs/scale.md table)

def validate_sets(args, mode: str, ac: str) -> list[str]:
    heads = args.hidden // 64
    sets = {"data": "synthetic", "model.vocab_size": args.vocab, "model.num_hidden_layers": args.layers,
            "model.hidden_size": args.hidden, "model.intermediate_size": args.ffn, "model.num_attention_heads": heads,
            "model.num_key_value_heads": heads, "model.head_dim": 64, "model.max_position_embeddings": max(4096, args.seq),
            "seq_len": args.seq, "batch_size": args.batch, "micro_batch": 1, "steps": args.steps, "warmup_steps": 1,
            "ckpt_every": 0, "keep_checkpoints": 1, "stats_every": 0, "eval_batches": 1, "eval_batch_size": 1,
            "precision": args.precision, "compile": "false", "progress": "false", "tensorboard": "false",
            "activation_checkpointing": ac, "dist": "fsdp" if mode == "fsdp" else "ddp"}
    sets.update(dict(kv.split("=", 1) for kv in args.sets))
    return sum((["--set", f"{k}={v}"] for k, v in sets.items()), [])


def validate(args) -> int:
    from gated_attention.train.overrides import config_from_args

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_train import train_flops

    out_root = Path(args.scratch)
    rows = []
    for mode in args.modes.split(","):
        for ac in args.ac.split(","):
            out = out_root / f"{mode}_{ac}"
            subprocess.run(["rm", "-rf", str(out)], check=True)
            out.mkdir(parents=True)
            me = [sys.executable, str(Path(__file__).resolve()), "run", "--preset", "small", "--out", str(out),
                  *validate_sets(args, mode, ac)]
            timed = f"/usr/bin/time -v -o {shlex.quote(str(out))}/time_rank$RANK.txt {shlex.join(me)}"
            if mode == "1proc":
                cmd = ["sh", "-c", f"RANK=0; {timed}"]
            else:
                cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--no-python",
                       "sh", "-c", timed]
            before = load1()
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
            if args.mmap_threshold is not None:  # glibc reads it at start-up: fixed, no longer dynamic
                env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
            print(f"== {mode} ac={ac}: {' '.join(cmd)}", flush=True)
            p = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if p.returncode:
                print(p.stdout[-2000:], p.stderr[-4000:], file=sys.stderr)
                return 1
            print("\n".join(x for x in p.stdout.splitlines() if x.startswith("bench_plan:")), flush=True)
            if not args.restore:
                again = None
            else:
                again = subprocess.run([c.replace(f"{timed}", f"{shlex.join(me)} --resume") for c in cmd], env=env,
                                       capture_output=True, text=True)  # the finished run resumed: the restore's time
            if again is not None and again.returncode:
                print(again.stdout[-2000:], again.stderr[-4000:], file=sys.stderr)
                return 1
            ranks = sorted(out.glob("rank*.json"))
            for r in ranks:
                rec = json.loads(r.read_text())
                text = (out / f"time_rank{rec['rank']}.txt").read_text()
                rec["peak_rss_time_gb"] = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)",
                                                        text).group(1)) * 1024 / 1e9
                rec["load_before"], rec["mode"] = before, mode
                rec["restore_s"] = (json.loads((out / f"resume_rank{rec['rank']}.json").read_text())["restore_s"]
                                    if args.restore else None)
                rows.append(rec)
    # the model's size and FLOPs from the first row's plan (a layout like expert_parallel=2 has no one-process plan)
    cfg = config_from_args("small", None, validate_sets(args, "fsdp", "none")[1::2], None)
    from gated_attention.train.plan import meta_model

    config = meta_model(cfg).config
    flops = {"plan_flops_per_token": rows[0]["plan"]["flops_per_token"],
             "bench_train_flops_per_token": train_flops(config, 1, args.seq) / args.seq}
    result = {"machine": common.machine(), "args": vars(args), "flops": flops,
              "params_total": rows[0]["plan"]["params_total"], "rows": rows}
    path = common.write_json(args.out, result)
    print(f"{'mode':<6} {'ac':<5} rank  plan GB  (+runtime)  peak@last step  peak (time -v)  baseline  tok/s  "
          f"save s  restore s  ckpt MB  load")
    for r in rows:
        m = r["plan"]["memory_per_gpu_gb"]
        print(f"{r['mode']:<6} {r['activation_checkpointing']:<5} {r['rank']:>4}  {m['total']:7.2f}  "
              f"{m['total'] - m['overhead'] + r['baseline_rss_gb']:9.2f}  {r['peak_rss_train_gb']:14.2f}  "
              f"{r['peak_rss_time_gb']:14.2f}  {r['baseline_rss_gb']:8.2f}  {r['tokens_per_s']:5.0f}  "
              f"{r['save_s'][-1]:6.2f}  {r['restore_s'] or float('nan'):9.2f}  {r['checkpoint_mb']:7.0f}  "
              f"{r['load_before']:.2f}->{r['load_end']:.2f}")
    print(f"FLOPs/token: plan {flops['plan_flops_per_token']:.4g}, bench_train {flops['bench_train_flops_per_token']:.4g}"
          f"; wrote {path}")
    return 0


# ---------------------------------------------------------------- table (docs/scale.md)

TABLE_SETS = ("compile", "expert_parallel", "dp_replicate", "keep_gathered", "reshard_after_forward", "fsdp_prefetch",
              "stats_every")  # the --set values a row names (the model.* ones name the model instead)


def replan(saved_args: dict, mode: str, ac: str, row: dict) -> dict:
    """The plan of a measured row by this checkout's planner (run_rank's call, from the row's own settings)."""
    from gated_attention.train.overrides import config_from_args
    from gated_attention.train.plan import plan

    args = argparse.Namespace(**saved_args)
    cfg = config_from_args("small", None, validate_sets(args, mode, ac)[1::2], None)
    return plan(cfg, gpus=row["world_size"], precision=row["resolved_precision"], device="cpu", mfu=0.5,
                gpu_tflops=1.0, gpu_memory_gb=1e6)


def table(args) -> int:
    """validate's JSON files as one markdown table: a row per (file, mode, AC), the ranks side by side, the plan's
    total over the measured peak RSS at the last training step."""
    print("| model | precision | ranks | settings | AC | plan total (GB) | peak RSS, last step (GB) | plan / measured "
          "| tokens/s | load |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    worst = []
    for name in args.files:
        d = json.loads(Path(name).read_text())
        a = d["args"]
        sets = dict(kv.split("=", 1) for kv in a["sets"])
        model = (f"MoE {sets['model.num_experts']}e top-{sets['model.num_experts_per_tok']}"
                 if "model.num_experts" in sets else "dense") + f", {d['params_total'] / 1e6:.1f}M"
        named = ", ".join(f"{k}={v}" for k, v in sets.items() if k in TABLE_SETS) or "-"
        if a.get("mmap_threshold") is None:
            named += " (glibc's default malloc)"
        groups: dict = {}
        for r in d["rows"]:
            groups.setdefault((r["mode"], r["activation_checkpointing"]), []).append(r)
        for (mode, ac), rs in groups.items():
            rs.sort(key=lambda r: r["rank"])
            plan_gb = (replan(a, mode, ac, rs[0]) if args.replan else rs[0]["plan"])["memory_per_gpu_gb"]["total"]
            got = [r["peak_rss_train_gb"] for r in rs]
            ratios = [plan_gb / g for g in got]
            if a.get("mmap_threshold") is not None:
                worst += ratios
            ranks = {"1proc": "1", "ddp": "DDP x2", "fsdp": "FSDP x2"}[mode]
            print(f"| {model} | {a['precision']} | {ranks} | {named} | {ac} | {plan_gb:.2f} | "
                  f"{' / '.join(f'{g:.2f}' for g in got)} | {' / '.join(f'{x:.2f}' for x in ratios)} | "
                  f"{rs[0]['tokens_per_s']:.0f} | {rs[0]['load_before']:.1f}-{rs[0]['load_end']:.1f} |")
    if worst:
        print(f"\nplan / measured over the rows with a fixed mmap threshold: {min(worst):.3f} .. {max(worst):.3f}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="one rank: train and measure beside the plan")
    r.add_argument("--preset", required=True)
    r.add_argument("--set", dest="sets", action="append", default=[])
    r.add_argument("--data-dir", default=None)
    r.add_argument("--gpu-tflops", type=float, default=None, help="peak TFLOP/s for MFU (CUDA default: by GPU name)")
    r.add_argument("--out", required=True)
    r.add_argument("--resume", action="store_true", help="resume the finished run in --out (times the restore)")
    v = sub.add_parser("validate", help="1 process, DDP x2, FSDP x2 on CPU under /usr/bin/time -v")
    v.add_argument("--layers", type=int, default=12)
    v.add_argument("--hidden", type=int, default=1024)
    v.add_argument("--ffn", type=int, default=4096)
    v.add_argument("--vocab", type=int, default=1024)
    v.add_argument("--seq", type=int, default=1024)
    v.add_argument("--steps", type=int, default=3)
    v.add_argument("--batch", type=int, default=2, help="global batch; micro-batch 1, so grad_accum = batch / ranks")
    v.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="more training settings for every row (e.g. compile=true, stats_every=1)")
    from gated_attention.util.precision import add_argument as precision_argument
    precision_argument(v, default="fp32", what="numerics of the validated runs",
                       choices=("fp32", "bf16", "bf16-params"))
    v.add_argument("--mmap-threshold", type=int, default=None, metavar="BYTES",
                   help="glibc's mmap threshold for every rank (MALLOC_MMAP_THRESHOLD_): fixed, every block of at "
                        "least BYTES is its own mapping, returned to the system when freed, so the peak RSS is what "
                        "the process held at once; by default glibc raises the threshold to the largest block freed "
                        "(up to 32 MiB) and keeps smaller freed blocks in its heaps")
    v.add_argument("--no-restore", dest="restore", action="store_false",
                   help="skip resuming each finished run to time the restore (one launch less per row)")
    v.add_argument("--modes", default="1proc,ddp,fsdp")
    v.add_argument("--ac", default="none")
    v.add_argument("--scratch", default=str(ROOT / "runs" / "bench_plan"))
    v.add_argument("--out", default="plan_check")
    t = sub.add_parser("table", help="validate's results as the markdown table of docs/scale.md")
    t.add_argument("files", nargs="+", help="bench/results/*.json written by validate")
    t.add_argument("--replan", action="store_true",
                   help="each row's plan by this checkout's planner (default: the plan the run recorded)")
    args = ap.parse_args()
    return {"run": run_rank, "validate": validate, "table": table}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
