"""`gattn sweep`: gates x learning rates on one preset, each run in its own folder, tabulated (markdown + JSON).

The small-scale version of the paper's Table 2 stress test (higher LR -> baseline spikes/diverges, gated does not).
A re-run reuses finished runs (their summary.json) and resumes unfinished ones from their checkpoints.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from ..io import json_dumps
from .config import TRAIN_PRESETS


def configure(parser: argparse.ArgumentParser) -> None:
    from gated_attention import errors as E  # argparse types: numbers/paths checked where they enter

    parser.add_argument("--preset", default="small-stress", choices=list(TRAIN_PRESETS), help="training preset")
    parser.add_argument("--gates", nargs="+", default=["baseline", "sdpa_elementwise"], help="gate variants to compare")
    parser.add_argument("--lrs", type=E.positive_float, nargs="+", required=True, help="peak learning rates to try")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="TrainConfig / model.* overrides applied to every run; repeatable")
    parser.add_argument("--out", type=E.out_dir, required=True, help="sweep folder: one sub-folder per run, results.md, results.json")
    parser.add_argument("--data-dir", type=E.existing_dir, default=None, help="prepared corpus folder")


def run_dir_name(gate: str, lr: float) -> str:
    return f"{gate}_lr{lr:g}"


def sweep(preset: str, gates: list[str], lrs: list[float], out: str | Path, sets: list[str] = (),
          data_dir: str | None = None) -> list[dict]:
    from ..io import lock_dir
    from .cli import config_from_args
    from .trainer import train_or_reuse

    out = Path(out)
    rows = []
    with lock_dir(out, "gattn sweep"):  # one writer per sweep folder (each run also locks its own)
        out.mkdir(parents=True, exist_ok=True)
        for gate in gates:
            for lr in lrs:
                rdir = out / run_dir_name(gate, lr)
                cfg = config_from_args(preset, gate, list(sets) + [f"lr={lr!r}", f"min_lr={min(lr / 100, lr)!r}"],
                                       data_dir)
                # finished: reused only if its saved settings equal these (else an error); unfinished: resumed
                summary = train_or_reuse(cfg, rdir)
                rows.append({"gate": gate, "lr": lr, "final_loss": summary.get("final_loss_avg10"),
                             "avg_ppl": summary.get("avg_ppl"), "spikes": summary.get("spikes"),
                             "skipped_steps": summary.get("skipped_steps"), "diverged": summary.get("diverged"),
                             "dir": str(rdir)})
        _write(out / "results.json", json_dumps(rows, indent=1))
        _write(out / "results.md", table(rows))
    return rows


def table(rows: list[dict]) -> str:
    def fmt(v):
        return "-" if v is None else (f"{v:.4f}" if isinstance(v, float) else str(v))

    lines = ["| gate | lr | final loss (avg last 10) | Avg PPL | spikes | skipped | diverged |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        loss = "-" if r["diverged"] else fmt(r["final_loss"])  # the paper's "-" for diverged runs
        lines.append(f"| {r['gate']} | {r['lr']:g} | {loss} | {fmt(r['avg_ppl'])} | {r['spikes']} | "
                     f"{r['skipped_steps']} | {r['diverged']} |")
    return "\n".join(lines) + "\n"


def _write(path: Path, text: str) -> None:
    from ..io import atomic_write_text

    atomic_write_text(path, text)


def run(args) -> int:
    rows = sweep(args.preset, args.gates, args.lrs, args.out, args.sets, args.data_dir)
    print(table(rows), end="")
    return 0
