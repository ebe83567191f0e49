"""`gattn lab stability`: the paper's stability claim (the gate removes loss spikes and trains at a max LR where the
baseline does not) at small scale, with the proxies of Wortsman et al. 2023 ("Small-scale proxies for large-scale
Transformer training instabilities", arXiv 2309.14322).

A grid of learning rates x variants (baseline, G1 elementwise, G1 headwise) x QK-norm on/off x seeds trains deep,
narrow models on the default corpus, every run on the trainer's own path (`train.trainer.train`) with the same tokens.
Per run: final validation loss, diverged, loss-spike count (the trainer's noise-aware detector), max attention logit
q.k*scale, max |hidden state| and max |output logit| over training. Per (variant, QK-norm), with bootstrap intervals
over seeds (stats.py): Wortsman's LR sensitivity, the largest LR that converges (`max_stable_lr`) and
the spikes per run. `verdict.stability_verdict` turns lab.json into the claims-table verdict (compare's row and the lab's own line).

Layout of OUT:
  OUT/runs/<variant>_qk<on|off>_lr<lr>_s<seed>/  log.jsonl, summary.json, train_config.json, result.json
  OUT/plots/*.png, OUT/lab.json, OUT/report.md, OUT/report.html (self-contained)
A run is finished when its result.json exists; a re-run reuses it (after checking its settings match). Every run is a
trainer run folder (experiment.train_or_reuse, the one resume policy): an interrupted one resumes from its last
checkpoint (every `ckpt_every` steps), its recorder (loss at init, probe records, CPU seconds) restored with it, so a
lab killed anywhere and started again loses at most the steps since that checkpoint and ends with the figures of an
uninterrupted lab. Runs go seed-major (every setting and LR at seed 0 first), so a lab stopped early already holds
whole LR curves. The checkpoints and exported model of a finished run are deleted once its result.json is written.
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from ...experiment import cache
from ...experiment.runs import ensure_corpus, run_units
from ...experiment.study import Budget, Recorder, finish_unit, save_lab
from ...gates import DEFAULT_VARIANTS, canonical_name, check_variants
from . import stats as St
from .stats import clip, lr_sensitivity  # noqa: F401 - the lab's API (tests, report)
from .verdict import CONVERGED_MARGIN, FAILURE_GAP
from ...util.io import locks_output, nonfinite_paths, read_jsonl, renamed, to_strict

QK_SETTINGS = {"on": (True,), "off": (False,), "both": (False, True)}
EDGE_MARGIN = 0.1  # nats above the best final loss that mark a run as past the edge of stability (--seed-lrs edge)
# settings the lab sets per grid point or through its own flags: --set may not change them
_LAB_SETTINGS = {"gate": "--variants", "lr": "--lrs", "min_lr": "the budget's min_lr_frac", "seed": "--seeds",
                 "steps": "--steps", "data": "--data-dir", "data_dir": "--data-dir",
                 "model.use_qk_norm": "--qk-norm", "precision": "--precision"}

TRAIN_FLAGS = ("steps", "data_dir", "precision")  # the TrainConfig fields the lab's own flags set (LabConfig.train)

# the lab's own settings of a budget; every other entry of a budget is a TrainConfig field or model.NAME (the --set
# vocabulary) over the recipe below
AXES = {
    "lrs": None,  # the LR grid (peak LR of each run); every budget names its own
    "seeds": None,  # seeds per setting (at every LR with seed_lrs "all"; at the edge LRs with "edge")
    "seed_lrs": "all",  # "all": every seed at every LR (whole curves: the bootstrap over seeds needs them)
    "min_lr_frac": 0.01,  # min_lr = lr * this
    "margin": CONVERGED_MARGIN.value,  # nats above the best LR's seed-mean loss within which an LR still
    # "converges" (verdict.CONVERGED_MARGIN: the verdict's threshold, with its source)
    "vocab_size": 1024,  # BPE vocabulary the budget's corpus (data_dir) is prepared with
}
# how every run trains, over the `small` preset (a budget changes some of it)
RECIPE = {
    "data": "corpus", "seq_len": 64, "batch_size": 16,
    "warmup_steps": 10,  # short warm-up: a long one hides the instability (Wortsman et al. Fig. 7)
    "schedule": "cosine",  # to min_lr, or "wsd" (hold the peak LR, decay over the last 20 %)
    "weight_decay": 0.0,  # AdamW's (on matrices); the deep budgets use the trainer's 0.1 (norms otherwise grow)
    "beta2": 0.95,
    "stats_every": 10,  # probe forward (max attention logit, max |h|, max |logit|) every N steps
    "ckpt_every": 100,  # a killed lab resumes its run from there (~1/6 of a default run: at most ~20 CPU-s lost); a
    # change keeps finished and interrupted runs reusable (not in their key)
    "spike_window": 50, "spike_delta": 0.1, "spike_noise_k": 6.0,  # the trainer's noise-aware loss-spike detector
    "eval_batches": 4, "eval_batch_size": 16,  # validation batches per domain for the final (and initial) loss
    "data_dir": "data_v1k",  # corpus used when --data-dir is not given (prepared automatically)
    "precision": "auto",  # training numerics; decided once by run_lab (util.precision.decide), keyed per run
    "eval_every": 0, "tensorboard": False,
    "progress": True,  # a line per GATTN_PROGRESS_INTERVAL off a terminal
    # eager unless --set compile=...: compile=auto decides from a timing, and compiled kernels round differently from
    # eager ones, which in bf16 at these LRs changes the trajectory (the same 24-layer run: loss 6.50 vs 6.92 after 12
    # steps) — a grid's numbers would depend on how loaded the machine was
    "compile": "false",
}

_SHALLOW = {"model.hidden_size": 64, "model.intermediate_size": 192, "model.num_hidden_layers": 2,
            "model.num_attention_heads": 2, "model.num_key_value_heads": 2,
            "model.head_dim": 32}  # the first stability grid's 2-layer d=64 model (~0.15M besides the embedding)
_DEEP = {**_SHALLOW, "model.num_hidden_layers": 12}  # deep and narrow: depth is the paper's unstable case (48 layers)
_DEFAULT = {"lrs": (3e-2, 1e-1, 3e-1), "steps": 600, "seeds": 3, "weight_decay": 0.1, **_DEEP}

BUDGETS: dict[str, Budget] = {
    "small": Budget("CI smoke run: 3 LRs, 30 steps of a 1-layer d=32 model per run (seconds per run)", {
        "lrs": (1e-3, 3e-2, 1.0), "steps": 30, "seeds": 1, "seq_len": 32, "batch_size": 8, "warmup_steps": 3,
        "stats_every": 10, "spike_window": 10, "eval_batches": 1, "eval_batch_size": 4, "ckpt_every": 10,
        "model.hidden_size": 32, "model.intermediate_size": 96, "model.num_hidden_layers": 1,
        "model.num_attention_heads": 2, "model.num_key_value_heads": 2, "model.head_dim": 16}),
    "quick": Budget(
        "the default's model and recipe, shorter: 2 LRs (0.1, 1), 3 seeds, 200 steps per run (36 runs, about 25 "
        "core-minutes estimated from the default's measured cost, ~0.155 CPU-s per step + ~10 s of evaluation per "
        "run: ~13 minutes at --jobs 2 on 2 quiet cores)", {**_DEFAULT, "lrs": (0.1, 1.0), "steps": 200,
                                                           "ckpt_every": 50}),
    "default": Budget(
        "12-layer d=64 models (2 heads of 32, FFN 192), 3 LRs around the edge of stability (0.03, 0.1, 0.3) x 3 "
        "seeds at every LR, 600 steps x 16 x 64 tokens, warm-up 10, cosine, weight decay 0.1, no z-loss (54 runs; "
        "measured 94.7 core-minutes in bf16 on an AMD EPYC Zen 4, ~105 CPU-s per run, 100 minutes at --jobs 1 on "
        "one core: ~50 minutes at --jobs 2 on 2 quiet cores)", _DEFAULT),
    "shallow": Budget(
        "the first stability grid (no spike or divergence found there): 7 LRs from 1e-3 to 1, 2 seeds at the edge of "
        "stability, 150 steps of a 2-layer d=64 model (windows of 64, batch 16); ~10 core-minutes",
        {**_DEFAULT, **_SHALLOW, "lrs": (1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0), "steps": 150, "seeds": 2,
         "seed_lrs": "edge", "weight_decay": 0.0, "ckpt_every": 50}),
}


def budget_settings(name: str) -> dict:
    """Every setting of budget `name`: the lab's AXES, the RECIPE and the budget's changes over them."""
    return {**AXES, **RECIPE, **BUDGETS[name].changes}


@dataclass
class LabConfig:
    """Everything `gattn lab stability` was asked for (CLI flags map 1:1)."""

    out: str = "runs/lab/stability"  # where `gattn compare` looks for it (its claims table)
    budget: str = "default"
    variants: tuple[str, ...] = DEFAULT_VARIANTS
    lrs: tuple[float, ...] | None = None  # None = the budget's grid
    qk_norm: str = "both"  # "on", "off" or "both"
    seeds: int | None = None  # None = the budget's
    seed_lrs: str | None = None  # where seeds 1.. run: every LR ("all") or the edge LRs ("edge"); None = the budget's
    sets: tuple[str, ...] = ()  # `key=value` training/model overrides on top of the budget's recipe (--set)
    jobs: int = 1  # runs in parallel, one thread each (the CLI default: experiment.runs.default_jobs())
    # TrainConfig fields by their own names over the budget's recipe, as the lab's own flags give them (steps,
    # data_dir, precision: --steps, --data-dir, --precision); --set may not reach these
    train: dict = field(default_factory=dict)

    def validate(self) -> "LabConfig":
        if self.budget not in BUDGETS:
            raise ValueError(f"unknown --budget {self.budget!r}; valid: {', '.join(BUDGETS)}")
        check_variants(self.variants)
        if self.qk_norm not in QK_SETTINGS:
            raise ValueError(f"--qk-norm {self.qk_norm!r}; use on, off or both")
        if self.seed_lrs not in (None, "edge", "all"):
            raise ValueError(f"--seed-lrs {self.seed_lrs!r}; use edge or all")
        lrs = self.grid()
        if any(not (math.isfinite(x) and x > 0) for x in lrs) or len(set(lrs)) != len(lrs):
            raise ValueError(f"--lrs must be distinct positive numbers, got {list(lrs)}")
        unknown = sorted(set(self.train) - set(TRAIN_FLAGS))
        if unknown:
            raise ValueError(f"unknown stability-lab training setting(s) {unknown}; the lab's flags set "
                             f"{', '.join(TRAIN_FLAGS)} (anything else: --set)")
        for name, v in (("steps", self.train.get("steps")), ("seeds", self.seeds)):
            if v is not None and v < 1:
                raise ValueError(f"--{name} {v} must be >= 1")
        if self.jobs < 1:
            raise ValueError(f"--jobs {self.jobs} must be >= 1")
        for item in self.sets:
            key = item.split("=", 1)[0].strip()
            if key in _LAB_SETTINGS:
                raise ValueError(f"--set {key}: the lab sets it per run; use {_LAB_SETTINGS[key]}")
        from gated_attention.util.precision import check

        check(self.spec["precision"], "--precision")
        return self

    @property
    def spec(self) -> dict:
        """The budget's settings (budget_settings) with the lab's `train` on top."""
        return {**budget_settings(self.budget), **self.train}

    def settings(self) -> dict:
        """The stored form (lab.json's "config"): every field, `train`'s settings under their own names (steps,
        data_dir None where the budget's; precision as asked, "auto" by default)."""
        out = {k: v for k, v in asdict(self).items() if k != "train"}
        return {**out, "steps": self.train.get("steps"), "data_dir": self.train.get("data_dir"),
                "precision": self.spec["precision"]}

    def grid(self) -> tuple[float, ...]:
        return tuple(sorted(float(x) for x in (self.lrs or self.spec["lrs"])))

    def n_steps(self) -> int:
        return self.spec["steps"]

    def n_seeds(self) -> int:
        return self.seeds or self.spec["seeds"]

    def where_seeds(self) -> str:
        return self.seed_lrs or self.spec["seed_lrs"]


# ---------------------------------------------------------------- one run

def train_config(lab: LabConfig, data_dir: str, variant: str, qk_norm: bool, lr: float, seed: int,
                 precision: str | None = None):
    """The TrainConfig of one grid point: the `small` preset with the budget's recipe and the lab's --set items, in
    the resolved precision (a concrete bf16/fp32 in the run's key: a bf16 run is never reused as an fp32 one).
    precision: the lab's decision for its spec["precision"] (run_lab decides once); None: decided here."""
    from gated_attention.presets import model_config
    from gated_attention.train.train_presets import train_preset
    from gated_attention.train.overrides import apply_overrides
    from gated_attention.util.precision import check_resolved, resolve

    precision = resolve(lab.spec["precision"], "cpu") if precision is None else check_resolved(precision)

    b = lab.spec
    steps = lab.n_steps()
    recipe = {k: v for k, v in b.items() if k not in AXES and not k.startswith("model.")}
    cfg = replace(train_preset("small"), **{
        **recipe, "data_dir": str(data_dir), "gate": variant, "seed": seed, "steps": steps, "lr": lr,
        "min_lr": lr * b["min_lr_frac"], "precision": precision, "warmup_steps": min(b["warmup_steps"], steps - 1),
        "spike_window": min(b["spike_window"], steps), "ckpt_every": min(b["ckpt_every"], steps),
        "model_overrides": {**{k[6:]: v for k, v in b.items() if k.startswith("model.")}, "use_qk_norm": qk_norm}})
    if lab.sets:
        cfg = apply_overrides(cfg, list(lab.sets), model_config(cfg.model, gate=variant).to_dict())
    return cfg.validate()


def run_name(variant: str, qk_norm: bool, lr: float, seed: int) -> str:
    return f"{variant}_qk{'on' if qk_norm else 'off'}_lr{lr:g}_s{seed}"


def _mean_val(losses: dict) -> float:
    vals = [float(v) for v in losses.values()]
    return sum(vals) / len(vals) if vals else math.nan


def _sig(v, digits: int = 4):
    """v rounded to `digits` significant digits (lab.json stays small; None and non-finite values unchanged)."""
    return float(f"{v:.{digits}g}") if isinstance(v, float) and math.isfinite(v) else v


def per_layer_series(log: list[dict]) -> dict:
    """The trainer's per-layer probe figures over training, from its log's stats steps: `probe_steps` and, per
    decoder layer, `max_hidden_per_layer` (max |hidden state| at the layer's output, M-Act) and
    `lost_update_share` (the share of the layer's residual-stream updates smaller than half a bf16 ulp of the value
    they are added to: train.monitors.lost_update_counts), each a list over layers of lists over `probe_steps`
    (4 significant digits); `mean_lost_update_share` = their mean over layers and probe steps. A log from before the
    lost-update measure has none (empty lists, None)."""
    stats = [r for r in log if r.get("max_act")]
    n = max((len(r["max_act"]) for r in stats), default=0)
    lost_recs = [r for r in stats if r.get("lost_update_share")]
    hidden = [[_sig(r["max_act"][i]) for r in stats] for i in range(n)]
    lost = [[_sig(r["lost_update_share"][i]) for r in lost_recs] for i in range(n)] if lost_recs else []
    vals = [v for layer in lost for v in layer if v is not None and math.isfinite(v)]
    return {"probe_steps": [int(r["step"]) for r in stats], "max_hidden_per_layer": hidden,
            "lost_update_share": lost,
            "mean_lost_update_share": sum(vals) / len(vals) if vals else None}


def run_metrics(summary: dict, log: list[dict], probes: list[dict], init_loss: float, warmup: int = 0) -> dict:
    """The per-run numbers from the trainer's summary and log and the probe records (pure; see module doc).

    final_loss = mean over domains of the final validation loss; diverged = the trainer stopped on non-finite
    steps, or the final loss is non-finite or no better than the loss at init; peak_train_loss = the largest
    finite training loss after the warm-up (above loss_at_init: the run blew up at some point, recovered or not);
    the per-layer series over the probe steps (per_layer_series); resolved_precision = the trainer's."""
    final = _mean_val(summary.get("val_losses") or {})
    if summary.get("diverged"):
        final = math.nan  # the trainer gave up: its last weights say nothing about the LR
    hidden = [v for r in log for v in (r.get("max_act") or [])]
    attn = [v for p in probes for v in p.get("attn_logit", [])]
    outl = [p["output_logit"] for p in probes if p.get("output_logit") is not None]
    diverged = bool(summary.get("diverged")) or not math.isfinite(final) or final >= init_loss
    late = [r["loss"] for r in log if r["step"] >= warmup and r.get("loss") is not None and math.isfinite(r["loss"])]
    return {
        "final_loss": final,
        "loss_at_init": init_loss,
        "diverged": diverged,
        "spikes": int(summary.get("spikes") or 0),
        "spike_steps": [int(x["step"]) for x in summary.get("spike_list") or []],
        "peak_train_loss": max(late) if late else math.nan,
        "skipped_steps": int(summary.get("skipped_steps") or 0),
        "max_attention_logit": max(attn) if attn else math.nan,
        "max_hidden": max(hidden) if hidden else math.nan,
        "max_output_logit": max(outl) if outl else math.nan,
        "final_train_loss": summary.get("final_loss_avg10"),
        "steps": summary.get("steps"),
        "tokens": summary.get("tokens"),
        "resolved_precision": summary.get("resolved_precision"),
        **per_layer_series(log),
    }


def edge_lrs(runs: list[dict], grid: tuple[float, ...], margin: float = EDGE_MARGIN) -> list[float]:
    """The LRs around the edge of stability of one setting, from its seed-0 runs: the first LR above the best one
    whose clipped loss is `margin` nats worse than the best (or that diverged), and the grid LR just below it (the
    last one on the stable side); when no LR is past the edge, the two largest LRs."""
    loss = {float(r["lr"]): clip(r["final_loss"], r["loss_at_init"]) for r in runs}
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
    """Compact training curves for the report: train loss every `every` steps, the probe series (max attention logit,
    max |output logit|) and the trainer's max |hidden state| over layers at its stats steps."""
    return {"step": [r["step"] for r in log if r["step"] % every == 0],
            "loss": [r["loss"] for r in log if r["step"] % every == 0],
            "probe_step": [i * every for i in range(len(probes))],
            "attention_logit": [max(p["attn_logit"]) if p["attn_logit"] else math.nan for p in probes],
            "output_logit": [p["output_logit"] for p in probes],
            "hidden_step": [r["step"] for r in log if r.get("max_act")],
            "max_hidden": [max(r["max_act"]) for r in log if r.get("max_act")]}


def stored_run(run_dir: str | Path, cfg_dict: dict) -> dict | None:
    """The finished run's result.json when it was made with these trainer settings (the trainer's own comparison:
    a setting added since counts as its default), None when the run is not finished; StaleResult otherwise."""
    from gated_attention.train.resume_rule import setting_differences

    return cache.load(Path(run_dir) / "result.json", cfg_dict, diff=setting_differences)


class RunRecorder(Recorder):
    """What one run records beside the trainer's log, as the study's step hook (its state resumes with the run's
    checkpoints): the validation loss at init (measured by `factory` on the trainer's own fresh model), the
    StabilityProbe records of the trainer's probe forwards, and the run's CPU and wall seconds (no curve: the
    trainer's log holds it)."""

    def __init__(self):
        super().__init__(every=0, steps=0, init_loss=None, probes=[])

    @property
    def init_loss(self) -> float | None:
        return self.state["init_loss"]

    @property
    def records(self) -> list[dict]:
        return self.state["probes"]  # the probe's own list (shared with a bf16-params twin: updated in place)

    def factory(self, c, vocab):
        """The trainer's own model, evaluated once before training (the loss at init), then probed."""
        import torch

        from gated_attention.train.data_source import make_source
        from gated_attention.train.evaluate import domain_losses
        from gated_attention.train.meta_init import init_model

        from .probe import StabilityProbe

        model = init_model(c, vocab, torch.device("cpu"))  # the trainer's one init stream at c.seed
        res = domain_losses(model, make_source(c), seq_len=c.seq_len, max_batches=c.eval_batches,
                            batch_size=c.eval_batch_size, device=torch.device("cpu"), precision=c.precision)
        self.state["init_loss"] = _mean_val(res["losses"])
        probe = StabilityProbe(model)
        probe.records = self.records
        probe.attach()
        return model

    def load_state_dict(self, st: dict) -> None:
        probes = self.records
        st = renamed(st, {"cpu_s": "cpu", "wall_s": "wall"})  # a checkpoint from before the shared recorder
        super().load_state_dict({"curve": [], **st, "probes": probes})
        probes[:] = st["probes"]


def train_run(task: tuple) -> dict:
    """Train one grid point (cfg_dict, run_dir) and write its result.json (the trainer settings are its key), unless
    a finished one is there. The run is a trainer run folder under experiment.train_or_reuse: an interrupted one
    resumes from its last checkpoint (with its recorder's state), and ends with the numbers of an uninterrupted run.
    Picklable, so --jobs can run it in a worker process (experiment.run_units)."""
    cfg_dict, run_dir = task
    out = Path(run_dir)
    done = stored_run(out, cfg_dict)
    if done is not None:
        return done
    from gated_attention.experiment.runs import train_or_reuse
    from gated_attention.train.config import TrainConfig

    cfg = TrainConfig.from_dict(cfg_dict).validate()
    rec = RunRecorder()
    summary = train_or_reuse(cfg, out, lambda m: print(m, file=sys.stderr, flush=True), "[stability]",
                             step_hook=rec, model_factory=rec.factory,
                             resolved_precision=cfg.precision)  # run_lab decided it (train_config)
    log = read_jsonl(out / "log.jsonl")
    result = {**run_metrics(summary, log, rec.records, rec.init_loss, cfg.warmup_steps),
              "wall_s": rec.wall_s(), "cpu_s": rec.cpu_s(), "curve": _curve(log, rec.records, cfg.stats_every)}
    # strict JSON (io): a non-finite metric is null, named in the run's "nonfinite" {metric: "nan" | "inf" | "-inf"}
    result = finish_unit(out, cfg_dict, result)  # the lab needs the numbers, not the weights
    loss = result["final_loss"]
    print(f"[stability] {out.name}: loss {'-' if loss is None else f'{loss:.3f}'} (init {result['loss_at_init']:.3f})"
          f"{' DIVERGED' if result['diverged'] else ''}  spikes {result['spikes']}  max attn logit "
          f"{_g(result['max_attention_logit'])}  max |logit| {_g(result['max_output_logit'])}  "
          f"({result['cpu_s']:.0f} cpu-s)", file=sys.stderr, flush=True)
    return result


# ---------------------------------------------------------------- the grid

def _row(variant: str, qk: bool, lr: float, seed: int, res: dict, run_dir: Path, out: Path) -> dict:
    keep = ("final_loss", "loss_at_init", "diverged", "spikes", "spike_steps", "peak_train_loss", "skipped_steps",
            "max_attention_logit", "max_hidden", "max_output_logit", "final_train_loss", "steps", "tokens", "wall_s",
            "cpu_s", "resolved_precision", "mean_lost_update_share", "probe_steps", "max_hidden_per_layer",
            "lost_update_share")
    return {"variant": variant, "qk_norm": qk, "lr": lr, "seed": seed, **{k: res.get(k) for k in keep},
            "nonfinite": res.get("nonfinite") or {}, "dir": str(run_dir.relative_to(out))}


def _execute(points: list[tuple], lab: LabConfig, data_dir: Path, out: Path, log, precision: str
             ) -> dict[tuple, dict]:
    """Run (or reuse) every (variant, qk, lr, seed) point, `lab.jobs` at a time, in the lab's decided precision.
    Returns point -> result."""
    tasks = [(train_config(lab, data_dir, *p, precision).to_dict(), str(out / "runs" / run_name(*p)))
             for p in points]
    finished = sum(stored_run(d, c) is not None for c, d in tasks)  # also checks settings
    if finished:
        log(f"[stability] reusing {finished} finished run(s)")
    if len(tasks) > finished:
        log(f"[stability] training {len(tasks) - finished} run(s), {lab.jobs} at a time")
    return dict(zip(points, run_units(train_run, tasks, jobs=lab.jobs, log=log)))


def _g(v) -> str:
    return "-" if v is None else f"{v:.3g}"


def _setting(rows: list[dict], variant: str, qk: bool) -> list[dict]:
    return [r for r in rows if r["variant"] == variant and r["qk_norm"] is qk]


def instability_check(rows: list[dict], margin: float = FAILURE_GAP.value) -> dict:
    """Does the grid show the failure the lab is about? Per QK-norm setting of the baseline: its runs' loss spikes and
    divergences, and the gap between its (seed-mean) final loss at the highest LR and its best. `reached`: some
    baseline run spiked or diverged, or a gap is >= `margin` nats (without it no verdict about the gate is possible)."""
    out: dict = {"margin": margin}
    for key, qk in (("off", False), ("on", True)):
        base = [r for r in rows if canonical_name(r["variant"]) == "none" and r["qk_norm"] is qk]
        if not base:
            continue
        mean = St.lr_curve(base)
        top = max(mean)
        out[key] = {"spikes": sum(int(r.get("spikes") or 0) for r in base),
                    "runs_with_spikes": sum(bool(r.get("spikes")) for r in base), "runs": len(base),
                    "diverged": sum(bool(r["diverged"]) for r in base), "highest_lr": top,
                    "gap_at_highest_lr": mean[top] - min(mean.values())}
    found = [out[k] for k in ("off", "on") if k in out]
    out["checked"] = bool(found)
    if not found:
        out["reason"] = "no baseline run in this grid"
        return out
    out["reached"] = any(x["spikes"] or x["diverged"] or x["gap_at_highest_lr"] >= margin for x in found)
    return out


def setting_stats(runs: list[dict], margin: float) -> dict:
    """One (variant, QK-norm) setting's aggregates with bootstrap intervals over seeds (stats.py)."""
    seeds = sorted({r["seed"] for r in runs})
    curve = St.lr_curve(runs)
    best_lr = min(curve, key=curve.get)
    per_seed_msl = {s: St.max_stable_lr([r for r in runs if r["seed"] == s], margin) for s in seeds}
    return {
        "seeds": seeds,
        "best_lr": best_lr, "best_loss": curve[best_lr],
        "lr_sensitivity": lr_sensitivity(runs),
        "lr_sensitivity_interval": St.bootstrap(runs, lr_sensitivity),
        "max_stable_lr": {"lr": St.max_stable_lr(runs, margin),
                          "interval": St.bootstrap(runs, lambda rs: St.max_stable_lr(rs, margin), log_scale=True),
                          "per_seed": [per_seed_msl[s] for s in seeds], "margin": margin},
        "spikes": {"per_run": St.spikes_per_run(runs), "interval": St.bootstrap(runs, St.spikes_per_run),
                   "total": sum(int(r.get("spikes") or 0) for r in runs),
                   "runs_with_spikes": sum(bool(r.get("spikes")) for r in runs), "runs": len(runs),
                   "by_lr": {f"{lr:g}": [int(r.get("spikes") or 0) for r in sorted(runs, key=lambda r: r["seed"])
                                         if r["lr"] == lr] for lr in curve}},
        "diverged": sum(bool(r["diverged"]) for r in runs),
    }


@locks_output("lab.out", "gattn lab stability")  # one writer per lab folder (its worker processes write inside)
def run_lab(lab: LabConfig, log=print) -> dict:
    """Train/reuse the grid, then write lab.json, report.md, report.html and plots into lab.out."""
    from . import stability_report

    from gated_attention.util.precision import decide

    lab.validate()
    t0 = time.perf_counter()
    spec = lab.spec
    precision, line = decide(spec["precision"], "cpu")  # the lab's one decision: every run trains in it
    data_dir = ensure_corpus(spec["data_dir"], spec["vocab_size"], log, tag="[stability]")
    out = Path(lab.out)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    grid, seeds, where = lab.grid(), lab.n_seeds(), lab.where_seeds()
    settings = [(v, qk) for v in lab.variants for qk in QK_SETTINGS[lab.qk_norm]]
    # phase 1, seed-major: seed 0 at every LR of every setting, then seed 1, ... (with --seed-lrs all), so a lab
    # stopped early holds whole LR curves of its first seeds
    first_seeds = range(seeds) if where == "all" else range(1)
    points = [(v, qk, lr, s) for s in first_seeds for v, qk in settings for lr in grid]
    log(f"[stability] {len(settings)} setting(s) x {len(grid)} LRs x {len(first_seeds)} seed(s), {lab.n_steps()} "
        f"steps each, {line} -> {out}")
    results = _execute(points, lab, data_dir, out, log, precision)
    # phase 2 (--seed-lrs edge): more seeds at the LRs around each setting's edge of stability (found from seed 0)
    edges = {}
    if seeds > 1 and where == "edge":
        more = []
        for v, qk in settings:
            seed0 = [{"lr": p[2], **results[p]} for p in points if p[:2] == (v, qk)]
            edges[(v, qk)] = edge_lrs(seed0, grid)
            more += [(v, qk, lr, s) for lr in edges[(v, qk)] for s in range(1, seeds)]
        results.update(_execute(more, lab, data_dir, out, log, precision))
    rows = [_row(*p, results[p], out / "runs" / run_name(*p), out) for p in results]
    rows.sort(key=lambda r: (lab.variants.index(r["variant"]), r["qk_norm"], r["lr"], r["seed"]))
    stats = {v: {key: setting_stats(_setting(rows, v, qk), spec["margin"]) if _setting(rows, v, qk) else None
                 for key, qk in (("on", True), ("off", False))} for v in lab.variants}  # None: not run
    pick = lambda name: {v: {k: (s[name] if s else None) for k, s in d.items()} for v, d in stats.items()}
    first = train_config(lab, data_dir, *settings[0], grid[0], 0, precision)
    lab_json = {
        "budget": lab.budget,
        "config": {**lab.settings(), "lrs": list(grid), "steps": lab.n_steps(), "seeds": seeds, "seed_lrs": where,
                   "data_dir": str(data_dir), "resolved_precision": precision, "margin": spec["margin"],
                   "min_lr_frac": spec["min_lr_frac"], "bootstrap": {"level": St.LEVEL, "resamples": St.N_BOOT}},
        "train_config": {k: v for k, v in first.to_dict().items() if k not in ("gate", "lr", "min_lr", "seed")},
        "edge_lrs": {f"{v}/{'on' if qk else 'off'}": e for (v, qk), e in edges.items()},
        "runs": rows,
        "lr_sensitivity": pick("lr_sensitivity"),
        "lr_sensitivity_interval": pick("lr_sensitivity_interval"),
        "max_stable_lr": pick("max_stable_lr"),
        "spikes": pick("spikes"),
        "settings": stats,
        "instability": instability_check(rows),
        "curves": {run_name(*p): results[p].get("curve") for p in results},
    }
    lab_json["nonfinite"] = [f for f in nonfinite_paths(lab_json) if not f.startswith("curves.")]
    lab_json = to_strict(lab_json)  # strict JSON (io): non-finite values null, each dict naming its own
    lab_json["wall_time_s"] = time.perf_counter() - t0
    lab_json["cpu_s_runs"] = sum(r.get("cpu_s") or 0.0 for r in rows)
    return save_lab(out, lab_json, lambda d: stability_report.make_plots(lab_json, d),
                    lambda: stability_report.write(lab_json, out))
