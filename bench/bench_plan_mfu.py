"""The plan's MFU per paper preset at 8 / 64 / 512 H100s, the shipped defaults against `gattn plan --recommend`'s
layout (docs/scale.md's table): a planning result, no run - every figure is the plan's model (plan_comm.py's
default H100 machine: 8 GPUs per node, NVLink 450 GB/s, network 50 GB/s per GPU; MFU 0.4 of the FLOPs the GPUs run).

Writes bench/results/<--out>.json (each row: preset, GPUs, both plans' step time, tokens/s, MFU, days, fits, the
recommended --set settings) with the git commit it was planned at, and prints the markdown table.

Run: python bench/bench_plan_mfu.py [--gpus 8,64,512] [--presets paper-dense-28l,paper-dense-48l,paper-moe-15a2b]
                                     [--out plan_mfu]
"""
from __future__ import annotations

import argparse
import subprocess
import time
from pathlib import Path

import common  # (also puts src/ on the path)

ROOT = Path(__file__).resolve().parent.parent


def commit() -> str:
    """The commit planned at, "+dirty" where the work tree differs from it."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    return head + ("+dirty" if dirty else "")


def row(preset: str, gpus: int) -> dict:
    from gated_attention.train.plan import model_shapes, plan
    from gated_attention.train.recommend import recommend
    from gated_attention.train.train_presets import train_preset

    cfg = train_preset(preset)
    shapes = model_shapes(cfg)
    t0 = time.perf_counter()
    p = plan(cfg, gpus=gpus, shapes=shapes)
    rec = recommend(cfg, gpus=gpus, shapes=shapes)
    c = p["comm_per_step"]
    return {"preset": preset, "gpus": gpus,
            "default_step_s": c["step_seconds"], "default_tokens_per_s": p["tokens_per_s"], "default_mfu": p["mfu"],
            "default_days": p["days"], "default_fits": p["fits"],
            "default_memory_gb": p["memory_per_gpu_gb"]["total"],
            "recommended_step_s": rec["step_seconds"], "recommended_tokens_per_s": rec["tokens_per_s"],
            "recommended_mfu": rec["mfu"], "recommended_days": rec["days"],
            "recommended_memory_gb": rec.get("memory_per_gpu_gb"), "recommended_set": rec["set"],
            "layouts_searched": rec["layouts_searched"], "layouts_fit": rec["layouts_fit"],
            "search_seconds": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", default="8,64,512")
    ap.add_argument("--presets", default="paper-dense-28l,paper-dense-48l,paper-moe-15a2b")
    ap.add_argument("--out", default="plan_mfu")
    args = ap.parse_args()
    rows = [row(preset, int(g)) for preset in args.presets.split(",") for g in args.gpus.split(",")]
    from gated_attention.train.plan import DEFAULTS
    from gated_attention.train.plan_comm import DEFAULT_TOPOLOGY

    out = {"commit": commit(), "utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
           "assumed": {**DEFAULTS, **DEFAULT_TOPOLOGY.as_dict()}, "rows": rows}
    path = common.write_json(args.out, out)
    table = [{"preset": r["preset"], "GPUs": r["gpus"],
              "default MFU": f"{r['default_mfu']:.1%}" + ("" if r["default_fits"] else " (does not fit)"),
              "default tok/s": f"{r['default_tokens_per_s']:,.0f}",
              "recommended MFU": f"{r['recommended_mfu']:.1%}" if r["recommended_mfu"] else "none fits",
              "recommended tok/s": f"{r['recommended_tokens_per_s']:,.0f}" if r["recommended_tokens_per_s"] else "",
              "recommended": " ".join(s for s in (r["recommended_set"] or [])
                                      if not s.startswith(("accum_grads=sharded", "keep_gathered=false")))}
             for r in rows]
    print(common.md_table(table, list(table[0])))
    print(f"-> {path}")


if __name__ == "__main__":
    main()
