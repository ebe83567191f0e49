"""The main job's training speed: `gattn compare --budget default`'s model and shape, fast path vs plain reference.

Each default variant (baseline, G1 elementwise, G1 headwise) is trained for a few steps in three ways, timed
round-robin in ONE process: `plain` (`--set fast=false compile=false`: plain layers, full-logits loss, eager), `fast`
(the fast path, eager) and `fast_compiled` (the fast path with the compiled decoder-layer graph, what `compile=auto`
picks for the budget's step count). The step is the trainer's: the forward in --precision (bf16 autocast or fp32, as
the trainer resolves it) with the trainer's arguments, backward, gradient clipping, AdamW. Reported: median step times, tokens/s, speed-up over plain, the one-off compile
time (first compiled step minus a steady one), and the step count the fast path fits into the plain path's wall time
for the budget (compile included).
Run: python bench/bench_mainjob.py --threads 1 [--reps 7] [--budget default] [--precision auto|bf16|fp32]

`--whole`: the main job's wall time instead — `gattn compare --budget B` end to end into a fresh folder (the corpus
prepared first and not counted), with the CPU kind, the precision its runs resolved to and the load average before
and after. `--emulate-avx2` runs it with the instruction set limited to AVX2 (ATEN_CPU_CAPABILITY=avx2,
ONEDNN_MAX_CPU_ISA=AVX2, MKL_ENABLE_INSTRUCTIONS=AVX2): on an AVX-512 machine, the kernels an AVX2-only CPU runs
(bf16 GEMMs ~30x slower than fp32 there, fp32 ~2x slower than AVX-512); clock and caches stay this machine's.
Run: python bench/bench_mainjob.py --whole [--emulate-avx2] [--budget default] [--jobs 2]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import time

import common  # (also puts src/ on the path)
import torch

from gated_attention.compare import BUDGETS, DEFAULT_VARIANTS, budget_config
from gated_attention.train import fastpath
from gated_attention.train.monitors import decoder_layers
from gated_attention.train.meta_init import init_model
from gated_attention.train.model_setup import param_groups

MODES = {"plain": (False, "false"), "fast": (True, "false"), "fast_compiled": (True, "true")}


def make_step(cfg, vocab: int, x, y, precision: str = "bf16"):
    """The trainer's step for cfg (fast / compile as set) in `precision`, on a fresh model with the same seed."""
    model = init_model(cfg, vocab, torch.device("cpu")).train()  # the trainer's own init stream at cfg.seed
    layers = decoder_layers(model)
    plan = fastpath.prepare(cfg, model, layers, torch.device("cpu"))
    opt = torch.optim.AdamW(param_groups(model, cfg), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)

    def step():
        with common.autocast(precision), plan.training_forward():
            if plan.fused_loss:
                loss = model(input_ids=x, shift_labels=y, fused_loss=True, use_cache=False).loss
            else:
                logits = model(input_ids=x, use_cache=False).logits  # (b, T, V)
                loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, plan


AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def whole_job(budget: str, jobs: int | None, emulate_avx2: bool, out: str) -> dict:
    """`gattn compare --budget budget` end to end in a subprocess into a fresh folder; its wall time, the machine and
    load before and after, and the job's own timings (compare.json)."""
    import json
    import subprocess
    import sys

    from gated_attention import experiment

    b = BUDGETS[budget]
    experiment.ensure_corpus(b.data_dir, b.vocab_size, print, "[bench]")  # not counted
    env = {**os.environ, **(AVX2_ENV if emulate_avx2 else {})}
    env.pop("GATTN_BF16_SPEEDUP", None)
    folder = tempfile.mkdtemp(prefix="gattn_mainjob_")
    argv = [sys.executable, "-m", "gated_attention.cli", "compare", "--budget", budget, "--data-dir", b.data_dir,
            "--out", folder, *(["--jobs", str(jobs)] if jobs else [])]
    load0 = os.getloadavg()
    t = time.perf_counter()
    p = subprocess.run(argv, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if p.returncode not in (0, 1):
        raise SystemExit(f"gattn compare failed ({p.returncode}):\n{p.stderr[-3000:]}")
    res = json.loads(open(os.path.join(folder, "compare.json")).read())
    result = {"bench": "mainjob_whole", "machine": common.machine(), "budget": budget, "emulated_avx2": emulate_avx2,
              "wall_s": wall, "load_avg_before": load0, "load_avg_after": os.getloadavg(),
              "resolved_precision": res["resolved_precision"], "seeds": res.get("seeds"),
              "timings_s": res["timings_s"], "layout": res["layout"], "out": folder}
    path = common.write_json(out, result)
    print(f"gattn compare --budget {budget}: {wall / 60:.1f} min wall ({wall:.0f} s), precision "
          f"{res['resolved_precision']}, {'AVX2 emulated' if emulate_avx2 else 'native ISA'} on "
          f"{result['machine']['cpu']} ({result['machine']['cpu_kind']}), load {load0[0]:.1f} -> "
          f"{result['load_avg_after'][0]:.1f}; parts {', '.join(f'{k} {v:.0f}s' for k, v in res['timings_s'].items())}"
          f"; wrote {path}")
    return result


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget", default="default", choices=list(BUDGETS), help="compare budget whose model/shape to time")
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help="comma list of gates (compare's variants)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma list from {list(MODES)}")
    ap.add_argument("--reps", type=int, default=7, help="timed round-robin rounds (median taken)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default; 1 on a busy machine)")
    ap.add_argument("--out", default="mainjob", help="results/<out>.json")
    ap.add_argument("--warm-cache", action="store_true", help="reuse inductor's on-disk cache (default: a fresh one, "
                    "so the compile time measured is the cold cost a first run pays)")
    ap.add_argument("--whole", action="store_true", help="time the whole `gattn compare --budget B` instead")
    ap.add_argument("--emulate-avx2", action="store_true", help="with --whole: limit the kernels to AVX2")
    ap.add_argument("--jobs", type=int, default=None, help="with --whole: compare's --jobs (default: its own)")
    common.precision_arg(ap)
    args = ap.parse_args(argv)
    if args.whole:
        return whole_job(args.budget, args.jobs, args.emulate_avx2, args.out + "_whole")
    prec = common.resolve_precision(args.precision)
    if not args.warm_cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="gattn_inductor_")
    if args.threads:
        torch.set_num_threads(args.threads)
    budget = BUDGETS[args.budget]
    base = budget_config(budget, budget.data_dir)  # data is not read: random tokens have the same cost
    vocab = budget.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (base.batch_size, base.seq_len + 1), generator=g)
    x, y = ids[:, :-1], ids[:, 1:]  # (B, T) each
    fns, first = {}, {}
    for gate in args.variants.split(","):
        for mode in args.modes.split(","):
            fast, comp = MODES[mode]
            cfg = dataclasses.replace(base, gate=gate, fast=fast, compile=comp).validate()
            step, _ = make_step(cfg, vocab, x, y, prec)
            name = f"{gate}|{mode}"
            t = time.perf_counter()
            step()  # compiles here for fast_compiled
            first[name] = time.perf_counter() - t
            fns[name] = step
    times = common.interleaved(fns, args.reps, warmup=1)
    tokens = base.batch_size * base.seq_len
    rows = []
    for name, ts in times.items():
        gate, mode = name.split("|")
        med = common.median(ts)
        plain = times.get(f"{gate}|plain")
        rows.append({"variant": gate, "mode": mode, "median_s": med, "times_s": ts, "rel_iqr": common.rel_spread(ts),
                     "tokens_per_s": tokens / med,
                     "speedup_vs_plain": common.median(plain) / med if plain else None,
                     "first_step_s": first[name], "one_off_s": max(0.0, first[name] - med)})
    by = {(r["variant"], r["mode"]): r for r in rows}
    summary = {}
    variants = args.variants.split(",")
    if all((v, "plain") in by for v in variants):
        wall_plain = sum(base.steps * by[(v, "plain")]["median_s"] for v in variants)
        for mode in args.modes.split(","):
            if mode == "plain" or not all((v, mode) in by for v in variants):
                continue
            per_step = sum(by[(v, mode)]["median_s"] for v in variants)
            one_off = sum(by[(v, mode)]["one_off_s"] for v in variants) if mode == "fast_compiled" else 0.0
            summary[mode] = {
                "speedup_vs_plain": sum(by[(v, "plain")]["median_s"] for v in variants) / per_step,
                "one_off_s_all_variants": one_off,
                "steps_in_plain_wall_time": int((wall_plain - one_off) / per_step),
                "wall_speedup_at_budget_steps": wall_plain / (base.steps * per_step + one_off)}
    result = {"bench": "mainjob", "machine": common.machine(), "budget": args.budget, "steps": base.steps,
              "batch": base.batch_size, "seq": base.seq_len, "vocab": vocab,
              "model_overrides": base.model_overrides, "reps": args.reps, "resolved_precision": prec, "rows": rows,
              "summary": summary}
    path = common.write_json(args.out, result)
    print(common.md_table(rows, ["variant", "mode", "median_s", "tokens_per_s", "speedup_vs_plain", "one_off_s"]))
    for mode, s in summary.items():
        print(f"{mode}: {s['speedup_vs_plain']:.2f}x plain per step; {args.budget} budget ({base.steps} steps) "
              f"wall {s['wall_speedup_at_budget_steps']:.2f}x; same wall time fits {s['steps_in_plain_wall_time']} "
              f"steps")
    print(f"load average {result['machine']['load_avg']}; wrote {path}")
    return result


if __name__ == "__main__":
    main()
