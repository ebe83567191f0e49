"""Sweeps (`gattn sweep`): gates x learning rates on one preset, each run in its own folder, tabulated (markdown + JSON).

The small-scale version of the paper's Table 2 stress test (higher LR -> baseline spikes/diverges, gated does not).
Every run goes through runs.train_or_reuse, the reuse rule of every job: a re-run reuses finished runs, resumes
unfinished ones from their checkpoints, and stops at a run folder holding other settings.
"""
from __future__ import annotations

from pathlib import Path

from ..util.io import atomic_write_text, json_dumps, locks_output
from ..util.progress import Progress


def run_dir_name(gate: str, lr: float) -> str:
    return f"{gate}_lr{lr:g}"


@locks_output("out", "gattn sweep")  # one writer per sweep folder (each run also locks its own)
def sweep(preset: str, gates: list[str], lrs: list[float], out: str | Path, sets: list[str] = (),
          data_dir: str | None = None) -> list[dict]:
    """Train (or reuse) every gate x LR run into out/<gate>_lr<lr>/ and write results.json and results.md."""
    from ..train.config import config_from_args
    from .runs import train_or_reuse

    out = Path(out)
    rows = []
    out.mkdir(parents=True, exist_ok=True)
    prog = Progress(len(gates) * len(lrs), "sweep", "run")  # each run also reports its own steps
    for gate in gates:
        for lr in lrs:
            rdir = out / run_dir_name(gate, lr)
            cfg = config_from_args(preset, gate, list(sets) + [f"lr={lr!r}", f"min_lr={min(lr / 100, lr)!r}"],
                                   data_dir)
            summary = train_or_reuse(cfg, rdir, lambda m: None, "[sweep]")
            rows.append({"gate": gate, "lr": lr, "final_loss": summary.get("final_loss_avg10"),
                         "avg_ppl": summary.get("avg_ppl"), "spikes": summary.get("spikes"),
                         "skipped_steps": summary.get("skipped_steps"), "diverged": summary.get("diverged"),
                         "dir": str(rdir)})
            prog.update(1, gate=gate, lr=lr, final_loss=rows[-1]["final_loss"])
    prog.close()
    atomic_write_text(out / "results.json", json_dumps(rows, indent=1))
    atomic_write_text(out / "results.md", table(rows))
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
