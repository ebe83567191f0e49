"""`gattn lab stability`: the paper's Table 2 claim (the gate removes loss spikes and tolerates larger learning rates)
at small scale, with the proxies of Wortsman et al. 2023 ("Small-scale proxies for large-scale Transformer training
instabilities", arXiv 2309.14322).

A grid of learning rates x variants (baseline, G1 elementwise, G1 headwise) x QK-norm on/off trains tiny models on
the default corpus, every run on the trainer's own path (`train.trainer.train`) with the same tokens. Per run:
final validation loss, diverged, loss-spike count (the trainer's noise-aware detector), max attention logit q.k*scale,
max |hidden state| and max |output logit| over training. Per (variant, QK-norm): Wortsman's LR sensitivity,
    mean over the LR grid of min(final loss, loss at init) - min over the grid of the final loss,
so a variant that trains well over a wider range of LRs scores lower; a diverged run counts as the loss at init.

Layout of OUT:
  OUT/runs/<variant>_qk<on|off>_lr<lr>_s<seed>/  log.jsonl, summary.json, train_config.json, result.json
  OUT/plots/*.png, OUT/lab.json, OUT/report.md, OUT/report.html (self-contained)
A run is finished when its result.json exists; a re-run reuses it (after checking its settings match) and retrains
any run that was interrupted (runs are seconds long, so they restart rather than resume). The checkpoints and the
exported model of a finished run are deleted: the lab needs only its numbers.
"""
from __future__ import annotations

import math
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from ...experiment import cache
from ...experiment.runs import ensure_corpus, run_units
from ...gates import canonical_name
from ...util.io import atomic_write_json, locks_output, nonfinite_paths, read_jsonl, to_strict

DEFAULT_VARIANTS = ("baseline", "sdpa_elementwise", "sdpa_headwise")
QK_SETTINGS = {"on": (True,), "off": (False,), "both": (False, True)}
EDGE_MARGIN = 0.1  # nats above the best final loss that mark a run as past the edge of stability


@dataclass
class StabilityBudget:
    """One named size of the lab: the LR grid, the model shape and the training recipe shared by every run."""

    help: str
    lrs: tuple[float, ...]  # the LR grid (peak LR of each run)
    steps: int  # optimizer steps per run (same tokens for every run)
    seeds: int  # seeds at the LRs around the edge of stability (seed 0 runs at every LR)
    seq_len: int = 64
    batch_size: int = 16
    warmup_steps: int = 10  # short warm-up: a long one hides the instability (Wortsman et al. Fig. 7)
    weight_decay: float = 0.0  # off, so only the LR changes between runs
    stats_every: int = 10  # probe forward (max attention logit, max |h|, max |logit|) every N steps
    spike_window: int = 50  # trailing window of the trainer's loss-spike detector
    eval_batches: int = 4  # validation batches per domain for the final (and the initial) loss
    eval_batch_size: int = 16
    model: dict = field(default_factory=dict)  # model-config fields over the `small` preset
    data_dir: str = "data_v1k"  # corpus used when --data-dir is not given (prepared automatically)
    vocab_size: int = 1024  # BPE vocabulary that corpus is prepared with


_TINY = dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=2, head_dim=32)  # ~0.15M parameters besides the 1k-token embedding

BUDGETS: dict[str, StabilityBudget] = {
    "small": StabilityBudget(
        help="CI smoke run: 3 LRs, 30 steps of a 1-layer d=32 model per run (seconds per run)",
        lrs=(1e-3, 3e-2, 1.0), steps=30, seeds=1, seq_len=32, batch_size=8, warmup_steps=3, stats_every=10,
        spike_window=10, eval_batches=1, eval_batch_size=4,
        model=dict(hidden_size=32, intermediate_size=96, num_hidden_layers=1, num_attention_heads=2,
                   num_key_value_heads=2, head_dim=16)),
    "default": StabilityBudget(
        help="7 LRs from 1e-3 to 1 (3 decades), 2 seeds at the edge of stability, 150 steps of a 2-layer d=64 model "
             "on the 1024-token-vocabulary corpus (windows of 64, batch 16): about 10 core-minutes for the three "
             "variants with QK-norm on and off (~60 runs)",
        lrs=(1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0), steps=150, seeds=2, model=dict(_TINY)),
}


@dataclass
class LabConfig:
    """Everything `gattn lab stability` was asked for (CLI flags map 1:1)."""

    out: str = "runs/lab/stability"  # where `gattn compare` looks for it (its claims table)
    budget: str = "default"
    variants: tuple[str, ...] = DEFAULT_VARIANTS
    lrs: tuple[float, ...] | None = None  # None = the budget's grid
    qk_norm: str = "both"  # "on", "off" or "both"
    steps: int | None = None  # None = the budget's
    seeds: int | None = None  # None = the budget's
    seed_lrs: str = "edge"  # extra seeds at the LRs around the edge of stability ("edge") or at every LR ("all")
    data_dir: str | None = None  # None = the budget's corpus, prepared automatically if missing
    jobs: int = 1  # runs in parallel, one thread each (the CLI default: common.default_jobs())
    precision: str = "auto"  # training numerics; resolved once (gated_attention.util.precision) and keyed per run

    def validate(self) -> "LabConfig":
        from gated_attention.gates import GATES, canonical_name

        if self.budget not in BUDGETS:
            raise ValueError(f"unknown --budget {self.budget!r}; valid: {', '.join(BUDGETS)}")
        bad = []
        for v in self.variants:
            try:
                canonical_name(v)
            except ValueError:
                bad.append(v)
        if bad:
            raise ValueError(f"unknown variant(s) {bad}; valid: {', '.join(GATES)} (see `gattn gates`)")
        if len(set(self.variants)) != len(self.variants) or not self.variants:
            raise ValueError(f"--variants must list distinct gate names, got {list(self.variants)}")
        if self.qk_norm not in QK_SETTINGS:
            raise ValueError(f"--qk-norm {self.qk_norm!r}; use on, off or both")
        if self.seed_lrs not in ("edge", "all"):
            raise ValueError(f"--seed-lrs {self.seed_lrs!r}; use edge or all")
        lrs = self.grid()
        if any(not (math.isfinite(x) and x > 0) for x in lrs) or len(set(lrs)) != len(lrs):
            raise ValueError(f"--lrs must be distinct positive numbers, got {list(lrs)}")
        for name in ("steps", "seeds"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"--{name} {v} must be >= 1")
        if self.jobs < 1:
            raise ValueError(f"--jobs {self.jobs} must be >= 1")
        from gated_attention.util.precision import check

        check(self.precision, "--precision")
        return self

    def resolved_precision(self) -> str:
        from gated_attention.util.precision import resolve

        return resolve(self.precision, "cpu")

    @property
    def spec(self) -> StabilityBudget:
        return BUDGETS[self.budget]

    def grid(self) -> tuple[float, ...]:
        return tuple(sorted(float(x) for x in (self.lrs or self.spec.lrs)))

    def n_steps(self) -> int:
        return self.steps or self.spec.steps

    def n_seeds(self) -> int:
        return self.seeds or self.spec.seeds


# ---------------------------------------------------------------- one run

def train_config(lab: LabConfig, data_dir: str, variant: str, qk_norm: bool, lr: float, seed: int):
    """The TrainConfig of one grid point: the `small` preset with the budget's recipe (cosine to lr/100), in the
    resolved precision (a concrete bf16/fp32 in the run's key: a bf16 run is never reused as an fp32 one)."""
    from gated_attention.train.config import train_preset

    b = lab.spec
    steps = lab.n_steps()
    return replace(
        train_preset("small"), data="corpus", data_dir=str(data_dir), gate=variant, seed=seed, steps=steps,
        lr=lr, min_lr=lr / 100, warmup_steps=min(b.warmup_steps, steps - 1), weight_decay=b.weight_decay,
        seq_len=b.seq_len, batch_size=b.batch_size, eval_every=0, eval_batches=b.eval_batches,
        eval_batch_size=b.eval_batch_size, stats_every=b.stats_every, spike_window=min(b.spike_window, steps),
        ckpt_every=0, progress=True, tensorboard=False,  # progress: a line per GATTN_PROGRESS_INTERVAL off a terminal
        precision=lab.resolved_precision(), model_overrides={**b.model, "use_qk_norm": qk_norm}).validate()


def run_name(variant: str, qk_norm: bool, lr: float, seed: int) -> str:
    return f"{variant}_qk{'on' if qk_norm else 'off'}_lr{lr:g}_s{seed}"


def _mean_val(losses: dict) -> float:
    vals = [float(v) for v in losses.values()]
    return sum(vals) / len(vals) if vals else math.nan


def run_metrics(summary: dict, log: list[dict], probes: list[dict], init_loss: float) -> dict:
    """The per-run numbers from the trainer's summary and log and the probe records (pure; see module doc).

    final_loss = mean over domains of the final validation loss; diverged = the trainer stopped on non-finite
    steps, or the final loss is non-finite or no better than the loss at init."""
    final = _mean_val(summary.get("val_losses") or {})
    if summary.get("diverged"):
        final = math.nan  # the trainer gave up: its last weights say nothing about the LR
    hidden = [v for r in log for v in (r.get("max_act") or [])]
    attn = [v for p in probes for v in p.get("attn_logit", [])]
    outl = [p["output_logit"] for p in probes if p.get("output_logit") is not None]
    diverged = bool(summary.get("diverged")) or not math.isfinite(final) or final >= init_loss
    return {
        "final_loss": final,
        "loss_at_init": init_loss,
        "diverged": diverged,
        "spikes": int(summary.get("spikes") or 0),
        "skipped_steps": int(summary.get("skipped_steps") or 0),
        "max_attention_logit": max(attn) if attn else math.nan,
        "max_hidden": max(hidden) if hidden else math.nan,
        "max_output_logit": max(outl) if outl else math.nan,
        "final_train_loss": summary.get("final_loss_avg10"),
        "steps": summary.get("steps"),
        "tokens": summary.get("tokens"),
    }


def _clip(loss, init_loss: float) -> float:
    """min(loss, loss at init), with a missing or non-finite loss (a diverged run) counted as the loss at init."""
    if loss is None or not math.isfinite(loss):
        return init_loss
    return min(loss, init_loss)


def lr_sensitivity(runs: list[dict]) -> float:
    """Wortsman et al.'s LR sensitivity of one (variant, QK-norm) setting from its runs (dicts with lr, final_loss,
    loss_at_init): E_lr[min(loss(lr), loss at init)] - min_lr loss(lr), where loss(lr) averages the clipped final
    loss over the seeds run at that LR. Non-finite when no run has a finite loss."""
    by_lr: dict[float, list[float]] = {}
    for r in runs:
        by_lr.setdefault(float(r["lr"]), []).append(_clip(r["final_loss"], r["loss_at_init"]))
    if not by_lr:
        return math.nan
    per_lr = [sum(v) / len(v) for v in by_lr.values()]
    return sum(per_lr) / len(per_lr) - min(per_lr)


def edge_lrs(runs: list[dict], grid: tuple[float, ...], margin: float = EDGE_MARGIN) -> list[float]:
    """The LRs around the edge of stability of one setting, from its seed-0 runs: the first LR above the best one
    whose clipped loss is `margin` nats worse than the best (or that diverged), and the grid LR just below it (the
    last one on the stable side); when no LR is past the edge, the two largest LRs."""
    loss = {float(r["lr"]): _clip(r["final_loss"], r["loss_at_init"]) for r in runs}
    lrs = [x for x in grid if x in loss]
    if not lrs:
        return []
    best_i = min(range(len(lrs)), key=lambda i: loss[lrs[i]])
    past = [i for i in range(best_i + 1, len(lrs)) if loss[lrs[i]] >= loss[lrs[best_i]] + margin]
    if not past:
        return lrs[-2:]
    i = past[0]
    return lrs[max(0, i - 1): i + 1]


def _curve(log: list[dict], probes: list[dict], every: int) -> dict:
    """Compact training curves for the report: train loss every `every` steps, and the probe series."""
    return {"step": [r["step"] for r in log if r["step"] % every == 0],
            "loss": [r["loss"] for r in log if r["step"] % every == 0],
            "probe_step": [i * every for i in range(len(probes))],
            "attention_logit": [max(p["attn_logit"]) if p["attn_logit"] else math.nan for p in probes],
            "output_logit": [p["output_logit"] for p in probes]}


def stored_run(run_dir: str | Path, cfg_dict: dict) -> dict | None:
    """The finished run's result.json when it was made with these trainer settings (the trainer's own comparison:
    a setting added since counts as its default), None when the run is not finished; StaleResult otherwise."""
    from gated_attention.train.config import setting_differences

    return cache.load(Path(run_dir) / "result.json", cfg_dict, diff=setting_differences)


def train_run(task: tuple) -> dict:
    """Train one grid point (cfg_dict, run_dir) and write its result.json (the trainer settings are its key), unless
    a finished one is there. A run without result.json (interrupted) is wiped and restarts: runs are seconds long.
    Picklable, so --jobs can run it in a worker process (experiment.run_units)."""
    cfg_dict, run_dir = task
    out = Path(run_dir)
    done = stored_run(out, cfg_dict)
    if done is not None:
        return done
    import torch

    from gated_attention.train.config import TrainConfig
    from gated_attention.train.data_source import make_source
    from gated_attention.train.evaluate import domain_losses
    from gated_attention.train.model_setup import build_model
    from gated_attention.train.trainer import train

    from .probe import StabilityProbe

    cfg = TrainConfig.from_dict(cfg_dict).validate()
    shutil.rmtree(out, ignore_errors=True)
    holder: dict = {}

    def factory(c, vocab):
        """The trainer's own model, evaluated once before training (the loss at init), then probed."""
        model = build_model(c, vocab)
        res = domain_losses(model, make_source(c), seq_len=c.seq_len, max_batches=c.eval_batches,
                            batch_size=c.eval_batch_size, device=torch.device("cpu"), precision=c.precision)
        holder["init"] = _mean_val(res["losses"])
        holder["probe"] = StabilityProbe(model).attach()
        return model

    t0, c0 = time.perf_counter(), time.process_time()
    summary = train(cfg, out, model_factory=factory)
    log = read_jsonl(out / "log.jsonl")
    probes = holder["probe"].records
    result = {**run_metrics(summary, log, probes, holder["init"]),
              "wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0,
              "curve": _curve(log, probes, cfg.stats_every)}
    shutil.rmtree(out / "checkpoints", ignore_errors=True)  # the lab needs the numbers, not the weights
    shutil.rmtree(out / "final", ignore_errors=True)
    # strict JSON (io): a non-finite metric is null, named in the run's "nonfinite" {metric: "nan" | "inf" | "-inf"}
    result = cache.save(out / "result.json", cfg_dict, result)
    loss = result["final_loss"]
    print(f"[stability] {out.name}: loss {'-' if loss is None else f'{loss:.3f}'} (init {result['loss_at_init']:.3f})"
          f"{' DIVERGED' if result['diverged'] else ''}  spikes {result['spikes']}  max attn logit "
          f"{_g(result['max_attention_logit'])}  max |logit| {_g(result['max_output_logit'])}  "
          f"({result['cpu_s']:.0f} cpu-s)", file=sys.stderr, flush=True)
    return result


# ---------------------------------------------------------------- the grid

def _row(variant: str, qk: bool, lr: float, seed: int, res: dict, run_dir: Path, out: Path) -> dict:
    keep = ("final_loss", "loss_at_init", "diverged", "spikes", "skipped_steps", "max_attention_logit", "max_hidden",
            "max_output_logit", "final_train_loss", "steps", "tokens", "wall_s", "cpu_s")
    return {"variant": variant, "qk_norm": qk, "lr": lr, "seed": seed, **{k: res.get(k) for k in keep},
            "nonfinite": res.get("nonfinite") or {}, "dir": str(run_dir.relative_to(out))}


def _execute(points: list[tuple], lab: LabConfig, data_dir: Path, out: Path, log) -> dict[tuple, dict]:
    """Run (or reuse) every (variant, qk, lr, seed) point, `lab.jobs` at a time. Returns point -> result."""
    tasks = [(train_config(lab, data_dir, *p).to_dict(), str(out / "runs" / run_name(*p))) for p in points]
    finished = sum(stored_run(d, c) is not None for c, d in tasks)  # also checks settings
    if finished:
        log(f"[stability] reusing {finished} finished run(s)")
    if len(tasks) > finished:
        log(f"[stability] training {len(tasks) - finished} run(s), {lab.jobs} at a time")
    return dict(zip(points, run_units(train_run, tasks, jobs=lab.jobs, log=log)))


def _g(v) -> str:
    return "-" if v is None else f"{v:.3g}"


def instability_check(rows: list[dict], margin: float = 0.5) -> dict:
    """The issue's bar for the grid: the baseline without QK-norm diverges somewhere, or its (seed-mean) final loss
    at the highest LR is >= `margin` nats above its best."""
    base = [r for r in rows if canonical_name(r["variant"]) == "none" and r["qk_norm"] is False]
    if not base:
        return {"checked": False, "reason": "no baseline run without QK-norm in this grid"}
    by_lr: dict[float, list[float]] = {}
    for r in base:
        by_lr.setdefault(r["lr"], []).append(_clip(r["final_loss"], r["loss_at_init"]))
    mean = {lr: sum(v) / len(v) for lr, v in by_lr.items()}
    top = max(mean)
    gap = mean[top] - min(mean.values())
    diverged = any(r["diverged"] for r in base)
    return {"checked": True, "baseline_off_diverged": diverged, "highest_lr": top, "gap_at_highest_lr": gap,
            "margin": margin, "reached": bool(diverged or gap >= margin)}


@locks_output("lab.out", "gattn lab stability")  # one writer per lab folder (its worker processes write inside)
def run_lab(lab: LabConfig, log=print) -> dict:
    """Train/reuse the grid, then write lab.json, report.md, report.html and plots into lab.out."""
    from . import report as R

    lab.validate()
    t0 = time.perf_counter()
    spec = lab.spec
    data_dir = ensure_corpus(lab.data_dir or spec.data_dir, spec.vocab_size, log, tag="[stability]")
    out = Path(lab.out)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    grid, seeds = lab.grid(), lab.n_seeds()
    settings = [(v, qk) for v in lab.variants for qk in QK_SETTINGS[lab.qk_norm]]
    # phase 1: seed 0 at every LR (and every seed at every LR with --seed-lrs all)
    first_seeds = range(seeds) if lab.seed_lrs == "all" else range(1)
    points = [(v, qk, lr, s) for v, qk in settings for lr in grid for s in first_seeds]
    log(f"[stability] {len(settings)} setting(s) x {len(grid)} LRs, {lab.n_steps()} steps each -> {out}")
    results = _execute(points, lab, data_dir, out, log)
    # phase 2: more seeds at the LRs around each setting's edge of stability (found from seed 0)
    edges = {}
    if seeds > 1 and lab.seed_lrs == "edge":
        more = []
        for v, qk in settings:
            seed0 = [{"lr": p[2], **results[p]} for p in points if p[:2] == (v, qk)]
            edges[(v, qk)] = edge_lrs(seed0, grid)
            more += [(v, qk, lr, s) for lr in edges[(v, qk)] for s in range(1, seeds)]
        results.update(_execute(more, lab, data_dir, out, log))
    rows = [_row(*p, results[p], out / "runs" / run_name(*p), out) for p in results]
    rows.sort(key=lambda r: (lab.variants.index(r["variant"]), r["qk_norm"], r["lr"], r["seed"]))
    sens: dict[str, dict] = {}
    for v in lab.variants:
        sens[v] = {}
        for key, qk in (("on", True), ("off", False)):
            mine = [r for r in rows if r["variant"] == v and r["qk_norm"] is qk]
            sens[v][key] = lr_sensitivity(mine) if mine else None  # None: that setting was not run
    first = train_config(lab, data_dir, *settings[0], grid[0], 0)
    lab_json = {
        "budget": lab.budget,
        "config": {**asdict(lab), "lrs": list(grid), "steps": lab.n_steps(), "seeds": seeds,
                   "data_dir": str(data_dir), "resolved_precision": lab.resolved_precision()},
        "train_config": {k: v for k, v in first.to_dict().items() if k not in ("gate", "lr", "min_lr", "seed")},
        "edge_lrs": {f"{v}/{'on' if qk else 'off'}": e for (v, qk), e in edges.items()},
        "runs": rows,
        "lr_sensitivity": sens,
        "instability": instability_check(rows),
        "curves": {run_name(*p): results[p].get("curve") for p in results},
    }
    lab_json["nonfinite"] = [f for f in nonfinite_paths(lab_json) if not f.startswith("curves.")]
    lab_json = to_strict(lab_json)  # strict JSON (io): non-finite values null, each dict naming its own
    lab_json["plots"] = {k: str(p.relative_to(out)) for k, p in R.make_plots(lab_json, out / "plots").items()}
    lab_json["wall_time_s"] = time.perf_counter() - t0
    lab_json["cpu_s_runs"] = sum(r.get("cpu_s") or 0.0 for r in rows)
    atomic_write_json(out / "lab.json", lab_json, indent=1)
    R.write(lab_json, out)
    return lab_json
