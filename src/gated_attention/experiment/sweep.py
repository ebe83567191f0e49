"""Sweeps (`gattn sweep`): gates x learning rates on one preset, each run in its own folder, tabulated (markdown + JSON).

The small-scale version of the paper's Table 2 stress test (higher LR -> baseline spikes/diverges, gated does not).
A re-run reuses finished runs (their summary.json) and resumes unfinished ones from their checkpoints.
"""
from __future__ import annotations

from pathlib import Path

from ..util.io import atomic_write_text, json_dumps
from ..util.progress import Progress


def run_dir_name(gate: str, lr: float) -> str:
    return f"{gate}_lr{lr:g}"


def sweep(preset: str, gates: list[str], lrs: list[float], out: str | Path, sets: list[str] = (),
          data_dir: str | None = None) -> list[dict]:
    from ..util.errors import UserError
    from ..util.io import lock_dir, read_json_object
    from ..train.checkpoint import latest_checkpoint
    from ..train.config import config_from_args, describe_changes
    from ..train.trainer import train

    out = Path(out)
    rows = []
    with lock_dir(out, "gattn sweep"):  # one writer per sweep folder (each run also locks its own)
        out.mkdir(parents=True, exist_ok=True)
        prog = Progress(len(gates) * len(lrs), "sweep", "run")  # each run also reports its own steps
        for gate in gates:
            for lr in lrs:
                rdir = out / run_dir_name(gate, lr)
                cfg = config_from_args(preset, gate, list(sets) + [f"lr={lr!r}", f"min_lr={min(lr / 100, lr)!r}"],
                                       data_dir)
                saved = rdir / "train_config.json"
                if saved.exists():  # a finished or started run is reused/resumed only with the same settings
                    diff = describe_changes(read_json_object(saved, "saved run settings", "delete that run folder"),
                                            cfg.to_dict())
                    if diff:
                        raise UserError(f"{rdir} holds a run with other settings ({diff}); use a new --out or "
                                        "delete that folder")
                summary_path = rdir / "summary.json"
                if summary_path.exists():
                    summary = read_json_object(summary_path, "run summary", "delete that run folder to retrain it")
                else:
                    summary = train(cfg, rdir, resume=latest_checkpoint(rdir) is not None)
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
