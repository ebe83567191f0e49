"""A run's logs: log.jsonl (cut back on resume), TensorBoard when installed, the progress bar, and summary.json's
figures read back from the log. Used by train/trainer.py (rank 0 writes; other ranks hold nothing open). Each line
gets its memory / TFLOP/s / MFU figures and the profiler its step boundaries from train/metrics.py's StepMeter."""
from __future__ import annotations

import json
import math
from pathlib import Path

from .config import TrainConfig
from .metrics import StepMeter
from .monitors import SpikeDetector
from ..util.io import atomic_write_text, jsonl_line
from ..util.progress import Progress


def truncate_log(path: Path, next_step: int) -> None:
    """Keep the log lines of steps before `next_step` (a killed run may have logged past its last checkpoint); a
    line that is not a step's record (cut by the kill, or damaged) goes."""
    if not path.exists():
        return
    keep = []
    for line in path.read_bytes().decode("utf-8", errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] < next_step:
            keep.append(line)
    atomic_write_text(path, "".join(l + "\n" for l in keep))


class TensorBoard:
    """TensorBoard writer if tensorboard is installed, else nothing (it is an optional extra)."""

    def __init__(self, out: Path, enabled: bool):
        self.writer = None
        if enabled:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(str(out / "tb"))
            except Exception:  # tensorboard not installed: JSONL logs remain
                self.writer = None

    def log(self, step: int, values: dict) -> None:
        if self.writer is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self.writer.add_scalar(k, v, step)

    def close(self):
        if self.writer is not None:
            self.writer.close()


def open_logs(run) -> None:
    """log.jsonl (appended: a resumed run continues it), TensorBoard and the progress bar, on rank 0."""
    main = run.info.is_main
    run.tb = TensorBoard(run.out, run.cfg.tensorboard and main)
    # a bar on a terminal, a line every GATTN_PROGRESS_INTERVAL seconds otherwise (nohup, CI, schedulers)
    run.bar = Progress(run.cfg.steps, f"train {run.out.name}", "step", initial=run.st["step"],
                       enabled=run.cfg.progress and main)
    run.log_fh = open(run.log_path, "a") if main else None
    run.meter = StepMeter.for_run(run)  # every rank: memory is a max over ranks, each rank profiles itself
    run.meter.start(run.st["step"])


def log_step(run, rec: dict) -> None:
    rec.update(run.meter.record(rec))  # every rank (a collective), before rank 0 writes the line
    if not run.info.is_main:
        return
    run.log_fh.write(jsonl_line(rec))  # strict JSON: a NaN loss is null + "nonfinite"
    run.log_fh.flush()
    run.tb.log(rec["step"], {k: v for k, v in rec.items() if k not in ("step", "max_act", "val", "moe")})
    if run.bar is not None:
        run.bar.update(1, tokens=run.tokens_per_step, loss=round(rec["loss"], 4))


def close_logs(run) -> None:
    run.meter.close()
    if run.bar is not None:
        run.bar.close()
    if run.log_fh is not None:
        run.log_fh.close()
    run.tb.close()


def summary(cfg: TrainConfig, st: dict, spikes: SpikeDetector, log_path: Path) -> dict:
    losses = []
    for line in log_path.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("loss") is not None and math.isfinite(rec["loss"]):
            losses.append(rec["loss"])
    tail = losses[-10:]
    return {
        "final_loss": st["last_loss"],
        "final_loss_avg10": sum(tail) / len(tail) if tail else None,  # the last step alone is noisy
        "val_losses": st["val"],
        "val_ppl": {d: math.exp(min(v, 700.0)) for d, v in st["val"].items()},
        "avg_ppl": (sum(math.exp(min(v, 700.0)) for v in st["val"].values()) / len(st["val"])) if st["val"] else None,
        "spikes": len(spikes.spikes),
        "spike_list": spikes.spikes,
        "spike_rule": {"window": cfg.spike_window, "delta": cfg.spike_delta},
        "skipped_steps": st["skipped_steps"],
        "diverged": st["diverged"] or (st["last_loss"] is not None and not math.isfinite(st["last_loss"])),
        "stop_reason": st["stop_reason"],
        "steps": st["step"],
        "tokens": st["tokens"],
        "wall_time_s": st["wall_time"],
        "model": cfg.model,
        "gate": cfg.gate,
        "lr": cfg.lr,
    }
