#!/usr/bin/env python
"""Attention-sink emergence curve (results/sink_emergence.md): train `gattn compare --budget long`'s
setting for each variant and analyse the model every --every steps on held-out val windows (the `long` budget's
analysis set: 4 batches of 8 = 32 BOS-started windows per domain), printing one JSON line per point and writing
OUT/<variant>/curve.jsonl.

    python scripts/sink_emergence.py --data-dir DATA --out OUT [--steps 3000] [--every 150]
        [--variants baseline sdpa_elementwise] [--max-minutes M] [--fit-minutes M]

--max-minutes stops a variant early (the curve so far is kept; the schedule is still the one for --steps).
Runs single-threaded (the CPU slot runner's setting); precision is the trainer's auto choice.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch


def point(model, batches, step: int, cfg) -> dict:
    from gated_attention.analysis import AnalysisConfig, analyze_model

    was = model.training
    model.eval()
    r = analyze_model(model, batches, AnalysisConfig(map_len=8), "causal")
    model.train(was)
    f, uni = r["first_token_attention"], r["uniform_first_token_attention"]
    return {"step": step, "tokens": step * cfg.batch_size * cfg.seq_len, "f_attn": f, "uniform": uni,
            "ratio": f / uni if uni else None, "sink_rate": r["sink_rate"], "m_act": r["max_abs_hidden"],
            "ppl": float(torch.tensor(r["loss"]).exp()) if r.get("loss") is not None else None,
            "f_attn_per_layer": [round(l["first_token_attention"], 4) for l in r["layers"]],
            "m_act_per_layer": [round(l["max_abs_hidden"], 1) for l in r["layers"]]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", required=True, help="prepared corpus (e.g. with the large sources, vocab 1024)")
    p.add_argument("--out", required=True, help="output folder (one run folder per variant)")
    p.add_argument("--steps", type=int, default=3000, help="training steps per variant (batch 16 x 256 tokens)")
    p.add_argument("--every", type=int, default=150, help="analyse every this many steps")
    p.add_argument("--variants", nargs="+", default=["baseline", "sdpa_elementwise"])
    p.add_argument("--max-minutes", type=float, default=None, help="stop a variant after this much wall time")
    p.add_argument("--fit-minutes", type=float, default=None,
                   help="choose --steps (at most the given --steps, a multiple of --every) so that all variants fit "
                        "this many minutes, from --step-seconds; each variant is also stopped at its share")
    p.add_argument("--step-seconds", type=float, default=0.36,
                   help="seconds per training step incl. the analysis points, for --fit-minutes (measured: 0.31 s a "
                        "step + ~5 s a point, one thread, AMD EPYC Zen 5 with bf16, load ~2)")
    p.add_argument("--set", nargs="*", default=[], help="TrainConfig overrides, as gattn compare --set")
    args = p.parse_args()
    torch.set_num_threads(1)
    from gated_attention.compare.job import BUDGETS, analysis_batches, budget_config
    from gated_attention.train.trainer import train

    if args.fit_minutes:
        share = 60 * args.fit_minutes / len(args.variants)
        args.steps = max(args.every, min(args.steps, int(share / args.step_seconds) // args.every * args.every))
        args.max_minutes = min(args.max_minutes or share / 60, share / 60)
        print(json.dumps({"fit_minutes": args.fit_minutes, "steps": args.steps, "max_minutes": args.max_minutes}),
              flush=True)
    base = replace(budget_config(BUDGETS["long"], args.data_dir, args.set), steps=args.steps, ckpt_every=args.steps)
    batches = analysis_batches(base, BUDGETS["long"])
    for v in args.variants:
        cfg = replace(base, gate=v).validate()
        out = Path(args.out) / v
        out.mkdir(parents=True, exist_ok=True)
        t0 = time.time()
        curve = open(out / "curve.jsonl", "a", encoding="utf-8")

        def hook(step, model, cfg=cfg, curve=curve, t0=t0, v=v):
            if step % args.every == 0 or step == cfg.steps:
                rec = {"variant": v, **point(model, batches, step, cfg), "wall_s": round(time.time() - t0, 1)}
                curve.write(json.dumps(rec) + "\n")
                curve.flush()
                print(json.dumps(rec), flush=True)
            if args.max_minutes and time.time() - t0 > 60 * args.max_minutes:
                return f"--max-minutes {args.max_minutes} reached at step {step}"
            return None

        summary = train(cfg, out / "run", step_hook=hook)
        curve.close()
        print(json.dumps({"variant": v, "summary_stop": summary.get("stop_reason"),
                          "wall_s": round(time.time() - t0, 1)}), flush=True)


if __name__ == "__main__":
    main()
