"""`gattn lab scaling`: does the gate lower loss at equal compute, and does the gain change with scale? A ladder of
model sizes, decided on seeds that never chose anything.

The protocol, per size (smallest first, so a lab stopped early holds whole rungs):
  1. tuning: an LR sweep on the tuning seeds (--tuning-seeds, default 0; the budget's grid spaced x2, extended past an
     edge while the best LR sits on it, at most `max_extensions` times). Under --protocol shared-lr (the default, the
     paper's: both arms at one recipe and LR) only the baseline is swept and every arm trains at the baseline's best
     LR; under --protocol tuned every variant is swept and trains at its own best (the LR-tolerance question).
  2. pilot: the first --pilot-pairs confirm seeds (fresh seeds, 100, 101, ... unless --confirm-seeds names them;
     never a tuning seed), every arm at its protocol LR.
  3. design, registered before any further confirm run: from the pilot's pooled within-arm variance (blind to Δ) the
     pairs each size needs for 80 % power at the multiplier rule's threshold there (design.py), capped by --max-pairs;
     written to lab.json `design` (and OUT/design.json, reused on a rerun).
  4. confirmation: the remaining planned pairs. Every verdict figure (Δ, ln k, the trend) comes from confirm seeds.
Paired by seed: the batch at step s is a function of (seed, s), so every arm sees the same data in the same order.
Every size trains for `tokens_per_param` tokens per non-embedding parameter of the ungated model (gated models shrink
their FFN to the same count, as the paper's dense runs do), with one recipe: AdamW, weight decay 0.1, QK-norm, linear
warm-up over `warmup_frac` of the steps, cosine decay to `min_lr_frac` of the peak.

Measured per run: the validation loss in nats per domain on `eval_batches * eval_batch_size` BOS-started windows
(the mean over domains is the lab's loss; bits per byte beside it from the corpus's bytes per token), the loss on the
user's held-out text (--heldout), and the training-loss curve against tokens seen (measure.py). verdict.py holds the
rules, design.py the estimators, summary.py lab.json's figures.

Layout of OUT:
  OUT/runs/<variant>_<size>_lr<lr>_s<seed>/   the trainer's run folder (final/ kept: `model_dir`), result.json
  OUT/design.json, OUT/lab.json, OUT/report.md, OUT/report.html, OUT/plots/*.png
A unit is finished when its result.json exists (keyed on its trainer settings, the held-out files and the training
code's version: experiment/provenance.py); an interrupted one resumes from its last checkpoint
(experiment.train_or_reuse: the one resume policy), so a lab killed anywhere and started again loses at most the steps
since a checkpoint and ends with an uninterrupted lab's numbers.
"""
from __future__ import annotations

import hashlib
import json
import math
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from ...experiment import cache
from ...experiment.provenance import code_version, provenance
from ...experiment.runs import ensure_corpus, run_units
from ...experiment.study import Recorder, save_lab, stored_settings, with_stored
from ...gates import DEFAULT_VARIANTS, canonical_name, check_variants
from ...util.io import atomic_write_json, locks_output, read_jsonl, renamed, to_strict
from . import design as D
from . import measure as M
from . import verdict as V
from .recipe_pilot import RECIPES, lr_scale, recipe_changes
from .summary import tuned_losses, unit_name


@dataclass(frozen=True)
class Size:
    """One rung of the ladder: the model's width, depth and heads (head size = hidden / heads)."""

    name: str
    hidden: int
    layers: int
    heads: int

    def overrides(self, ffn_mult: int) -> dict:
        return dict(hidden_size=self.hidden, intermediate_size=ffn_mult * self.hidden,
                    num_hidden_layers=self.layers, num_attention_heads=self.heads, num_key_value_heads=self.heads,
                    head_dim=self.hidden // self.heads, use_qk_norm=True)


def ladder(widths: tuple[int, ...], head_dim: int, layers=lambda d: 2) -> tuple[Size, ...]:
    """The shape rule of a budget: head size fixed, heads = width / head size, depth a function of the width."""
    return tuple(Size(f"d{d}l{layers(d)}", d, layers(d), d // head_dim) for d in widths)


@dataclass(frozen=True)
class ScalingBudget:
    """One named ladder: sizes, the LR grid, seeds and the recipe every size shares (frozen; derived budgets are
    dataclasses.replace of another)."""

    help: str
    sizes: tuple[Size, ...]
    lrs: tuple[float, ...]  # the tuning seeds' sweep, spaced x2 (extended past an edge when the best LR sits on it)
    pilot_pairs: int = 4  # confirm pairs every size runs first; their within-arm spread plans the rest
    max_pairs: int = 10  # the plan's cap per size: what the CPU budget affords (results/scaling.md)
    tokens_per_param: float = 20.0  # per NON-embedding parameter of the ungated model (Kaplan et al. 2020's count:
    # at these widths the tied embedding is half the total and its cost per token is a lookup)
    max_extensions: int = 2  # LRs added beyond an edge at most, per (variant, size)
    seq_len: int = 128
    batch_size: int = 8  # sequences per step: small, so the smallest rung still takes ~100 steps
    warmup_frac: float = 0.05  # share of the steps in linear warm-up (>= 5 steps)
    min_lr_frac: float = 0.01  # cosine decay to this share of the peak LR (the paper: 2e-3 -> 3e-5, the paper's training setup; a 10 %
    # floor left the seed-0 sweeps' final losses 0.1-0.2 nats apart at neighbouring LRs, more than the LR effect)
    weight_decay: float = 0.1
    ffn_mult: int = 3  # FFN width of the ungated model = ffn_mult x hidden (gated models shrink it to equal params)
    eval_batches: int = 8  # x eval_batch_size = BOS-started validation windows per domain (>= 256)
    eval_batch_size: int = 32
    curve_points: int = 16  # points of the training-loss curve kept per run
    data_dir: str = "data_v1k"  # the corpus when --data-dir is not given (prepared automatically)
    vocab_size: int = 1024
    recipe: str = "current"  # a change of the recipe above (recipe_pilot.RECIPES), adopted by a recipe pilot


_DEFAULT = ScalingBudget(
    help="4 widths (24, 32, 48, 72; 2 layers, heads of 8, FFN 3d) = 15k-135k non-embedding parameters (8.9x), "
         "20 tokens per non-embedding parameter (0.3M-2.7M tokens), weights initialised with std 1/sqrt(width) "
         "(the recipe pilot's choice), the baseline's LR tuned on seed 0 over 4e-3..3.2e-2 (extended past an edge), "
         "then 4 pilot pairs and up to 10 planned confirm pairs per size at that shared LR, fp32, eager "
         "(results/scaling.md gives its measured cost)",
    sizes=ladder((24, 32, 48, 72), head_dim=8), lrs=(4e-3, 8e-3, 1.6e-2, 3.2e-2),
    # adopted by the recipe pilot at d32l2 (within-arm sd 0.020 vs 0.112 nats under N(0, 0.02): 0.18x, the bar 0.5x)
    recipe="init-fan-in")

BUDGETS: dict[str, ScalingBudget] = {
    "quick": replace(
        _DEFAULT,
        help="CI: the default's structure on tiny models — 4 widths (8, 12, 16, 24; 1 layer, heads of 4) "
             "spanning 8.8x, 4 LRs, 2 pilot pairs and at most 3, 2 tokens per parameter, windows of 32 (seconds "
             "per run)",
        sizes=ladder((8, 12, 16, 24), head_dim=4, layers=lambda d: 1), lrs=(5e-3, 1e-2, 2e-2, 4e-2),
        pilot_pairs=2, max_pairs=3, recipe="current",  # CI's figures stay those of the base recipe
        tokens_per_param=2.0, max_extensions=1, seq_len=32, batch_size=4, eval_batches=2, eval_batch_size=4,
        curve_points=8),
    "default": _DEFAULT,
    "gpu": replace(
        _DEFAULT,
        help="a GPU ladder: widths 448-1024 with depth = width / 64 (heads of 64, FFN 3d): 18M-218M non-embedding "
             "parameters (12x), 20 tokens per parameter (0.37B-4.4B tokens), LRs 5e-4..4e-3, 4-10 pairs, windows of "
             "1024, batch 64: 1.4e20 FLOPs for 3 variants (`gattn lab scaling --budget gpu --plan`; ~96 GPU-hours at "
             "40 %% MFU of an H100); give it a corpus with a real vocabulary (--data-dir)",
        sizes=ladder((448, 576, 768, 1024), head_dim=64, layers=lambda d: d // 64), lrs=(5e-4, 1e-3, 2e-3, 4e-3),
        seq_len=1024, batch_size=64, eval_batches=8, eval_batch_size=32),
}

# settings the lab sets per unit or through its own flags: --set may not change them
_LAB_SETTINGS = {"gate": "--variants", "lr": "the sweep", "min_lr": "the budget", "seed": "--confirm-seeds",
                 "steps": "--tokens-per-param", "data": "--data-dir", "data_dir": "--data-dir",
                 "precision": "--precision"}


CONFIRM_FROM = 100  # the first fresh confirm seed: far from the tuning seeds' usual 0, 1, 2
PROTOCOLS = ("shared-lr", "tuned")


def _base_train():
    """How every unit trains besides what its rung, recipe, gate, LR and seed decide (train_config): the `small`
    preset on a prepared corpus, the lab's measurements in place of the trainer's eval and probes, eager (compile=auto
    decides from a timing: a unit's numbers would depend on the machine's load)."""
    from gated_attention.train.train_presets import train_preset

    return replace(train_preset("small"), data="corpus", eval_every=0, stats_every=0, tensorboard=False,
                   progress=True, compile="false",
                   precision="fp32",  # the same numbers on either CPU kind (bf16 ~60x slower on AVX2)
                   data_dir=None)  # None: the budget's corpus (prepared automatically)


@dataclass
class LabConfig:
    """Everything `gattn lab scaling` was asked for: its own axes here, how each unit trains besides them as `train`
    (a TrainConfig). Its stored form (lab.json's "config", the options) is `settings()`."""

    out: str = "runs/lab/scaling"  # where `gattn compare --scaling-lab` looks by default
    budget: str = "default"
    variants: tuple[str, ...] = DEFAULT_VARIANTS
    seeds: int | None = None  # a fixed number of confirm pairs per size (None: planned from the pilot)
    tuning_seeds: tuple[int, ...] = (0,)  # the seeds that pick LRs; never counted in a verdict
    confirm_seeds: tuple[int, ...] | None = None  # the seeds that measure Δ (None: fresh ones from CONFIRM_FROM)
    protocol: str = "shared-lr"  # shared-lr: every arm at the baseline's tuned LR (the paper's); tuned: each its own
    pilot_pairs: int | None = None  # None = the budget's
    max_pairs: int | None = None  # None = the budget's
    accept_code_change: bool = False  # reuse units trained by another version of the training code (recorded)
    tokens_per_param: float | None = None  # None = the budget's (20 for default and gpu)
    lrs: tuple[float, ...] | None = None  # None = the budget's grid
    heldout: tuple[str, ...] = ()  # plain-text files: out-of-domain loss of every run
    sizes: tuple[str, ...] | None = None  # a subset of the budget's rungs by name (None = all; the fit needs 3)
    sets: tuple[str, ...] = ()  # `key=value` training overrides on top of the recipe (--set)
    jobs: int = 1
    recipe: str | None = None  # None = the budget's (recipe_pilot.RECIPES names them)
    train: object = field(default_factory=_base_train)  # TrainConfig; shape, recipe, gate, LR and seed per unit

    def settings(self) -> dict:
        """The stored form: every setting under its stored name (STORED), as lab.json's "config" holds them."""
        return stored_settings(self, STORED)

    def changed(self, **stored) -> "LabConfig":
        """A copy with settings changed by their stored names (the options' names); not validated."""
        return with_stored(self, stored, STORED, "scaling-lab")

    def validate(self) -> "LabConfig":
        from gated_attention.util.precision import check

        if self.budget not in BUDGETS:
            raise ValueError(f"unknown --budget {self.budget!r}; valid: {', '.join(BUDGETS)}")
        if "none" not in check_variants(self.variants):
            raise ValueError("--variants must include baseline: every gain is measured against it")
        if self.seeds is not None and self.seeds < 2:
            raise ValueError(f"--seeds {self.seeds} must be >= 2 (a confirm interval needs two pairs)")
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"unknown --protocol {self.protocol!r}; valid: {', '.join(PROTOCOLS)}")
        if not self.tuning_seeds or len(set(self.tuning_seeds)) != len(self.tuning_seeds):
            raise ValueError(f"--tuning-seeds must be distinct seeds, got {list(self.tuning_seeds)}")
        if self.confirm_seeds is not None and (len(set(self.confirm_seeds)) != len(self.confirm_seeds)
                                               or len(self.confirm_seeds) < 2):
            raise ValueError(f"--confirm-seeds must be >= 2 distinct seeds, got {list(self.confirm_seeds)}")
        both = sorted(set(self.tuning_seeds) & set(self.confirm_pool()))
        if both:
            raise ValueError(f"seed(s) {both} are both tuning and confirm seeds: a seed that chose an LR never counts "
                             f"in the comparison; give disjoint --tuning-seeds and --confirm-seeds")
        if self.n_pilot() < 2 or self.n_cap() < self.n_pilot():
            raise ValueError(f"--pilot-pairs {self.n_pilot()} must be >= 2 and <= --max-pairs {self.n_cap()}")
        if self.tokens_per_param is not None and not (self.tokens_per_param > 0):
            raise ValueError(f"--tokens-per-param {self.tokens_per_param} must be > 0")
        lrs = self.grid()
        if len(lrs) < 2 or any(not (math.isfinite(x) and x > 0) for x in lrs) or len(set(lrs)) != len(lrs):
            raise ValueError(f"--lrs must be >= 2 distinct positive numbers, got {list(lrs)}")
        for p in self.heldout:
            if not Path(p).is_file():
                raise ValueError(f"--heldout {p}: no such file (give plain-text files)")
        if self.jobs < 1:
            raise ValueError(f"--jobs {self.jobs} must be >= 1")
        names = [s.name for s in self.spec.sizes]
        bad = [s for s in self.sizes or () if s not in names]
        if bad or (self.sizes is not None and not self.sizes):
            raise ValueError(f"--sizes {' '.join(bad) or '(none)'}: the {self.budget} ladder's sizes are "
                             f"{', '.join(names)}")
        for item in self.sets:
            key = item.split("=", 1)[0].strip()
            if key in _LAB_SETTINGS or key.startswith("model."):
                raise ValueError(f"--set {key}: the lab sets it per unit (use {_LAB_SETTINGS.get(key, 'the budget')})")
        check(self.train.precision, "--precision")
        if self.recipe_name() not in RECIPES:
            raise ValueError(f"unknown --recipe {self.recipe!r}; valid: {', '.join(RECIPES)}")
        return self

    def recipe_name(self) -> str:
        return self.recipe or self.spec.recipe

    @property
    def spec(self) -> ScalingBudget:
        return BUDGETS[self.budget]

    def grid(self) -> tuple[float, ...]:
        return tuple(sorted(float(x) for x in (self.lrs or self.spec.lrs)))

    def rungs(self) -> tuple[Size, ...]:
        return tuple(s for s in self.spec.sizes if self.sizes is None or s.name in self.sizes)

    def n_pilot(self) -> int:
        n = self.pilot_pairs or self.spec.pilot_pairs
        return min(n, self.seeds) if self.seeds else n

    def n_cap(self) -> int:
        """The most confirm pairs a size may plan: --seeds fixes it, else --max-pairs or the budget's cap, never more
        than --confirm-seeds names."""
        cap = self.seeds or self.max_pairs or self.spec.max_pairs
        return min(cap, len(self.confirm_seeds)) if self.confirm_seeds else cap

    def confirm_pool(self) -> tuple[int, ...]:
        """The confirm seeds in the order they run (the pilot first)."""
        if self.confirm_seeds is not None:
            return tuple(self.confirm_seeds)
        return tuple(range(CONFIRM_FROM, CONFIRM_FROM + self.n_cap()))

    def swept(self) -> tuple[str, ...]:
        """The variants the tuning sweep covers: the baseline alone under shared-lr, every variant under tuned."""
        return tuple(v for v in self.variants if self.protocol == "tuned" or canonical_name(v) == "none")

    def tpp(self) -> float:
        return self.tokens_per_param or self.spec.tokens_per_param


# stored name (options, lab.json "config") -> the setting: a lab axis or a TrainConfig field (its own name). The one
# translation table; its order is lab.json's.
STORED = {k: k for k in ("out", "budget", "variants", "seeds", "tuning_seeds", "confirm_seeds", "protocol",
                         "pilot_pairs", "max_pairs", "accept_code_change", "tokens_per_param", "lrs", "heldout",
                         "sizes", "sets", "data_dir", "jobs", "precision", "recipe")}


# ---------------------------------------------------------------- sizes and units

def size_info(spec: ScalingBudget, size: Size, vocab: int, tokens_per_param: float) -> dict:
    """The contract's `sizes` row: parameters of the ungated model (total, non-embedding), steps and tokens at
    tokens_per_param, and training FLOPs (train.plan's count: 6 x matmul parameters + causal attention)."""
    from gated_attention.presets import model_config, param_report
    from gated_attention.train import plan

    conf = model_config("small", gate="none", vocab_size=vocab, **size.overrides(spec.ffn_mult))
    rep = param_report(conf)
    per_step = spec.batch_size * spec.seq_len
    steps = max(20, math.ceil(tokens_per_param * rep["non_embedding"] / per_step))
    norms = conf.num_hidden_layers * (2 * conf.hidden_size + 2 * conf.head_dim) + conf.hidden_size  # + QK-norm
    matmul = rep["non_embedding"] - norms + conf.vocab_size * conf.hidden_size  # every matmul weight, the LM head too
    fpt = plan.flops_per_token(conf, matmul, spec.seq_len)["model"]
    return {"name": size.name, "hidden": size.hidden, "layers": size.layers, "heads": size.heads,
            "params_total": rep["total"], "params_non_embedding": rep["non_embedding"], "steps": steps,
            "tokens": steps * per_step, "flops": float(fpt) * steps * per_step, "flops_per_token": fpt}


def recipe(spec: ScalingBudget, size: Size, info: dict, name: str | None = None) -> dict:
    """The TrainConfig fields one rung trains with, besides gate, LR and seed: the same recipe at every size, under
    the named change of it (default: the budget's; `gattn compare`'s default budget trains a rung of the default
    ladder with it). The swept LR is multiplied by lr_scale(RECIPES[name])."""
    steps = info["steps"]
    base = dict(steps=steps, warmup_steps=max(5, round(spec.warmup_frac * steps)), schedule="cosine",
                weight_decay=spec.weight_decay, seq_len=spec.seq_len, batch_size=spec.batch_size,
                eval_batches=spec.eval_batches, eval_batch_size=spec.eval_batch_size, ckpt_every=max(1, steps // 4),
                model_overrides=size.overrides(spec.ffn_mult))
    return recipe_changes(base, RECIPES[name or spec.recipe], size.hidden)


def train_config(lab: LabConfig, variant: str, size: Size, info: dict, lr: float, seed: int,
                 recipe_name: str | None = None):
    """The TrainConfig of one unit: lab.train (its corpus and precision as _context decided them) with the ladder's
    shape and recipe (the lab's, or recipe_name for the recipe pilot), then --set."""
    from gated_attention.presets import model_config
    from gated_attention.train.overrides import apply_overrides

    b = lab.spec
    name = recipe_name or lab.recipe_name()
    lr = lr * lr_scale(RECIPES[name])
    cfg = replace(lab.train, gate=variant, seed=seed, lr=lr, min_lr=lr * b.min_lr_frac, **recipe(b, size, info, name))
    if lab.sets:
        cfg = apply_overrides(cfg, list(lab.sets), model_config(cfg.model, gate=variant).to_dict())
    return cfg.validate()


def _files_key(files: tuple[str, ...]) -> list:
    return [[Path(f).name, hashlib.sha256(Path(f).read_bytes()).hexdigest()] for f in files]


def _code_diff(stored: dict, wanted: dict) -> list[str]:
    """The reuse rule's differences, the training code's version left out (--accept-code-change)."""
    return cache.differences({k: v for k, v in stored.items() if k != "code"},
                             {k: v for k, v in wanted.items() if k != "code"})


# figures of a unit's result.json stored under an older name -> today's (units from before the shared Recorder, which
# counted only the process that finished them)
RENAMED_FIGURES = {"cpu_s_this_process": "cpu_s", "wall_s_this_process": "wall_s"}


def train_unit(task: tuple) -> dict:
    """Train (or reuse, or resume) one unit and write its result.json; picklable for --jobs workers.
    task = (cfg_dict, run_dir, heldout files, curve points, accept_code_change). A stored unit made by another
    version of the training code stops the lab (the reuse rule) unless accept_code_change, when it is reused and
    marked `reused_from_code`."""
    cfg_dict, run_dir, heldout, points, accept_code_change = task
    out = Path(run_dir)
    key = {**cfg_dict, "heldout": _files_key(heldout), "code": code_version()}
    stored = cache.load(out / "result.json", key, diff=_code_diff if accept_code_change else None)
    if stored is not None:
        stored = renamed(stored, RENAMED_FIGURES)
        if stored["key"].get("code") != key["code"]:
            stored["reused_from_code"] = stored["key"].get("code")
        return stored
    from gated_attention.experiment.runs import train_or_reuse
    from gated_attention.train.config import TrainConfig

    cfg = TrainConfig.from_dict(cfg_dict).validate()
    rec = Recorder(every=0, steps=cfg.steps)  # the unit's CPU and wall time over every process that trained it
    summary = train_or_reuse(cfg, out, lambda m: print(m, file=sys.stderr, flush=True), "[scaling]", step_hook=rec,
                             resolved_precision=cfg.precision)
    log = read_jsonl(out / "log.jsonl")
    losses = {d: float(v) for d, v in (summary.get("val_losses") or {}).items()}
    val = sum(losses.values()) / len(losses) if losses else math.nan
    held = M.heldout_loss(out / "final", cfg.data_dir, list(heldout), cfg.seq_len)
    result = {"val_loss": val, "val_loss_per_domain": losses, "heldout_loss": held["mean"] if held else None,
              "heldout_loss_per_file": held["per_file"] if held else None, "tokens": summary.get("tokens"),
              "steps": summary.get("steps"), "diverged": bool(summary.get("diverged")),
              "spikes": int(summary.get("spikes") or 0), "resolved_precision": summary.get("resolved_precision"),
              "train_wall_s": summary.get("wall_time_s"), "cpu_s": rec.cpu_s(), "wall_s": rec.wall_s(),
              "curve": M.loss_curve(log, points, cfg.batch_size * cfg.seq_len)}
    result = cache.save(out / "result.json", key, result)
    shutil.rmtree(out / "checkpoints", ignore_errors=True)  # final/ stays: the run's `model_dir`
    print(f"[scaling] {out.name}: val loss {val:.4f}", file=sys.stderr, flush=True)
    return result


def plan_text(lab: LabConfig, vocab: int | None = None) -> str:
    """The ladder as `--plan` prints it: per size its parameters, tokens and FLOPs, and the units' total FLOPs at the
    most the design may run (the sweep's grid for the swept variants, --max-pairs confirm pairs per arm; extensions
    past an edge add more). vocab: the corpus's (default: the budget's)."""
    spec = lab.spec
    vocab = vocab or spec.vocab_size
    rows, total = [], 0.0
    units = len(lab.grid()) * len(lab.tuning_seeds) * len(lab.swept()) + lab.n_cap() * len(lab.variants)
    for s in lab.rungs():
        i = size_info(spec, s, vocab, lab.tpp())
        total += i["flops"] * units
        rows.append(f"  {i['name']:>10}  {i['params_total']:>13,} total  {i['params_non_embedding']:>13,} non-emb.  "
                    f"{i['tokens']:>15,} tokens  {i['flops']:.3g} FLOPs")
    return "\n".join([f"ladder `{lab.budget}` ({len(lab.variants)} variants x {len(lab.rungs())} sizes, protocol "
                      f"{lab.protocol}: at most {units} units a size, vocabulary {vocab}):", *rows,
                      f"total at most {total:.3g} FLOPs (+ evaluation); at 40 % MFU of a 989-TFLOP/s GPU: "
                      f"{total / (0.4 * 989e12) / 3600:.2f} GPU-hours"])


# ---------------------------------------------------------------- the lab

def _stage(points: list[tuple], lab: LabConfig, ctx: dict, log, recipe: str | None = None) -> dict[tuple, dict]:
    """Run (or reuse) units (variant, size, lr, seed), lab.jobs at a time; point -> result. recipe: a recipe's name
    for the recipe pilot (default: the lab's)."""
    tasks = []
    for v, s, lr, seed in points:
        cfg = train_config(lab, v, ctx["size"][s], ctx["info"][s], lr, seed, recipe)
        name = unit_name(v, s, lr, seed, recipe or lab.recipe_name())
        tasks.append((cfg.to_dict(), str(ctx["out"] / "runs" / name), lab.heldout,
                      lab.spec.curve_points, lab.accept_code_change))
    done = sum((Path(d) / "result.json").exists() for d, *_ in (t[1:] for t in tasks))
    if len(tasks) > done:
        log(f"[scaling] {len(tasks) - done} unit(s) to train ({done} stored), {lab.jobs} at a time")
    return dict(zip(points, run_units(train_unit, tasks, jobs=lab.jobs, log=log)))


def sweep(lab: LabConfig, ctx: dict, log, size: str) -> dict[tuple, dict]:
    """One size's tuning: the swept variants on every tuning seed at every LR of the grid, then, while a variant's best
    LR sits at an edge of the LRs tried, one more LR beyond it (at most max_extensions per variant and size)."""
    seeds = lab.tuning_seeds
    results = _stage([(v, size, lr, k) for v in lab.swept() for lr in lab.grid() for k in seeds], lab, ctx, log)
    for _ in range(lab.spec.max_extensions):
        more = []
        for v in lab.swept():
            losses = tuned_losses(results, v, size, seeds)
            nxt = V.extend_grid(list(losses), V.lr_basin(losses)["best_lr"])
            if nxt is not None:
                more += [(v, size, nxt, k) for k in seeds]
        if not more:
            break
        log(f"[scaling] {size}: best LR at an edge for {', '.join(sorted({p[0] for p in more}))}: extending the sweep")
        results.update(_stage(more, lab, ctx, log))
    return results


def design_thresholds(lab: LabConfig, sizes: list[dict], tuning: dict[tuple, dict], base: str) -> tuple[dict, str]:
    """The multiplier rule's threshold in nats at each size, ln(1.14) x the baseline's loss drop per e-fold of
    compute there, from a power law through the baseline's tuned losses (tuning seeds only: no confirm run, no Δ
    enters the plan). With fewer than 3 sizes, or no decreasing fit, δ = 0.0128 nats."""
    best = {}
    for i in sizes:
        losses = tuned_losses(tuning, base, i["name"], lab.tuning_seeds)
        ok = {lr: l for lr, l in losses.items() if math.isfinite(l)}
        if ok:
            best[i["name"]] = min(ok.values())
    try:
        fit = V.fit_power_law([i["flops"] for i in sizes if i["name"] in best], [best[n] for n in best])
        if not fit["alpha"] > 0:
            raise ValueError("no decreasing fit")
    except ValueError:
        return {i["name"]: V.DELTA.value for i in sizes}, "δ = 0.0128 nats (no baseline fit over the tuning runs)"
    thr = {i["name"]: V.LN_K_BAR * D.local_slope(fit, i["flops"]) for i in sizes}
    return thr, (f"ln 1.14 x the baseline's loss drop per e-fold of compute, from L = E + A C^-alpha through its tuned "
                 f"losses (E {fit['E']:.3f}, A {fit['A']:.4g}, alpha {fit['alpha']:.4f})")


def register_design(lab: LabConfig, out: Path, sizes: list[dict], tuning: dict, pilot: dict, base: str,
                    lr_for: dict, log) -> dict:
    """Plan the confirm pairs from the pilot (blind to Δ) and write the design to OUT/design.json before any further
    confirm run. A rerun with the same inputs reads the registered design back unchanged."""
    thresholds, source = design_thresholds(lab, sizes, tuning, base)
    per_size = {}
    for i in sizes:
        s = i["name"]
        per_size[s] = {v: [pilot[(v, s, lr_for[v][s], k)]["val_loss"] for k in lab.confirm_pool()[:lab.n_pilot()]]
                       for v in lab.variants}
    if lab.seeds:
        plan = {s: {"n_planned": lab.seeds, "rule": "fixed by --seeds"} for s in per_size}
    else:
        plan = D.plan_pairs(per_size, thresholds, lab.n_pilot(), lab.n_cap())
    design = {"protocol": lab.protocol, "tuning_seeds": list(lab.tuning_seeds), "pilot_pairs": lab.n_pilot(),
              "n_cap": lab.n_cap(), "lr": lr_for,
              "target_se": {s: thresholds[s] / D.POWER_FACTOR for s in thresholds},
              "n_planned": {s: plan[s]["n_planned"] for s in plan}, "per_size": plan, "threshold_source": source,
              "rule": ("pairs for 80 % power at a two-sided 5 % level to exclude 0 at the multiplier rule's threshold "
                       "(ln 1.14 in nats at each size): SE = sqrt(2) x pooled within-arm sd / sqrt(n) <= threshold / "
                       "2.80; the smallest size doubles its n (the trend's cheap end); capped at n_cap"
                       if not lab.seeds else f"{lab.seeds} pairs at every size, fixed by --seeds")}
    path = out / "design.json"
    if path.is_file():
        old = json.loads(path.read_text())
        if cache.differences(old, to_strict(design)):
            log(f"[scaling] the design differs from the one registered in {path} (settings changed): registering anew")
    atomic_write_json(path, to_strict(design), indent=1)
    return json.loads(path.read_text())


def _context(lab: LabConfig, log) -> tuple[LabConfig, dict, str]:
    """The lab as its units train (lab.train's corpus prepared if missing, its precision decided for this machine)
    and what every stage needs: OUT, the vocabulary, the sizes and their rows."""
    from gated_attention import data
    from gated_attention.util.precision import decide

    precision, line = decide(lab.train.precision, "cpu")
    data_dir = ensure_corpus(lab.train.data_dir or lab.spec.data_dir, lab.spec.vocab_size, log, tag="[scaling]")
    lab = lab.changed(data_dir=str(data_dir), precision=precision)
    vocab = data.Corpus(data_dir).vocab_size
    out = Path(lab.out)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    sizes = [size_info(lab.spec, s, vocab, lab.tpp()) for s in lab.rungs()]
    return lab, {"out": out, "vocab": vocab, "size": {s.name: s for s in lab.rungs()},
                 "info": {i["name"]: i for i in sizes}}, line


@locks_output("lab.out", "gattn lab scaling --recipe-pilot")
def recipe_pilot(lab: LabConfig, size: str, log=print) -> dict:
    """The recipe pilot at one size (recipe_pilot.py): OUT/recipe_pilot.json. Its LR comes from the ladder's tuning
    sweep at that size in OUT (run here if missing)."""
    from .recipe_pilot import run_recipe_pilot

    names = [s.name for s in lab.spec.sizes]
    if size not in names:
        raise ValueError(f"--recipe-pilot {size}: the {lab.budget} ladder's sizes are {', '.join(names)}")
    lab = replace(lab, sizes=(size,), recipe="current").validate()  # candidates change the base recipe
    lab, ctx, line = _context(lab, log)
    log(f"[scaling] recipe pilot at {size}, {line} -> {ctx['out']}")
    return run_recipe_pilot(lab, size, ctx, _stage, sweep, log)


@locks_output("lab.out", "gattn lab scaling")
def run_lab(lab: LabConfig, log=print) -> dict:
    """Tuning sweep, pilot, registered design, confirmation, then lab.json, report.md, report.html and plots."""
    from . import scaling_report
    from .summary import summarize

    asked = lab.validate().settings()
    t0 = time.perf_counter()
    lab, ctx, line = _context(lab, log)
    spec, out, vocab = lab.spec, ctx["out"], ctx["vocab"]
    data_dir, precision = lab.train.data_dir, lab.train.precision
    sizes = list(ctx["info"].values())
    base = next(v for v in lab.variants if canonical_name(v) == "none")
    log(f"[scaling] {len(lab.variants)} variants x {len(sizes)} sizes ({sizes[0]['params_non_embedding']:,}-"
        f"{sizes[-1]['params_non_embedding']:,} non-embedding parameters, {lab.tpp():g} tokens each), protocol "
        f"{lab.protocol}, {line} -> {out}")
    tuning, best, lr_for = {}, {v: {} for v in lab.swept()}, {v: {} for v in lab.variants}
    for s in ctx["size"]:
        tuning.update(sweep(lab, ctx, log, s))
        for v in lab.swept():
            best[v][s] = V.lr_basin(tuned_losses(tuning, v, s, lab.tuning_seeds))["best_lr"]
        for v in lab.variants:
            lr_for[v][s] = best[v][s] if lab.protocol == "tuned" else best[base][s]
    pool = lab.confirm_pool()
    confirm = _stage([(v, s, lr_for[v][s], k) for s in ctx["size"] for k in pool[:lab.n_pilot()] for v in lab.variants],
                     lab, ctx, log)
    design = register_design(lab, out, sizes, tuning, confirm, base, lr_for, log)
    log(f"[scaling] design registered: pairs per size {design['n_planned']}")
    more = [(v, s, lr_for[v][s], k) for s in ctx["size"] for k in pool[lab.n_pilot():design["n_planned"][s]]
            for v in lab.variants]
    confirm.update(_stage(more, lab, ctx, log))
    lab_json = summarize(lab, sizes, tuning, confirm, best, lr_for, base, design,
                                 M.bytes_per_token(str(data_dir)), vocab)
    lab_json["config"] = {**asked, "lrs": list(lab.grid()), "seeds": lab.seeds,
                          "tokens_per_param": lab.tpp(), "params_counted": "non-embedding (ungated model)",
                          "data_dir": str(data_dir), "resolved_precision": precision,
                          "recipe": {k: v for k, v in asdict(spec).items() if k not in ("help", "sizes", "lrs")},
                          "recipe_name": lab.recipe_name(), "recipe_help": RECIPES[lab.recipe_name()].help}
    lab_json["provenance"] = provenance()
    lab_json["provenance"]["units_reused_from_other_code"] = sum(
        1 for r in {**tuning, **confirm}.values() if r.get("reused_from_code"))
    lab_json["wall_time_s"] = time.perf_counter() - t0
    lab_json = to_strict(lab_json)
    return save_lab(out, lab_json, lambda d: scaling_report.make_plots(lab_json, d),
                    lambda: scaling_report.write(lab_json, out))


@locks_output("out", "gattn lab scaling --report-only")
def report_only(out: str | Path) -> dict:
    """Render OUT/lab.json's report (report.md, report.html, plots/) again; trains nothing and leaves lab.json as it
    is."""
    from gated_attention.util.io import read_json_object

    from . import scaling_report

    out = Path(out)
    lab_json = read_json_object(out / "lab.json", "scaling lab result", "run `gattn lab scaling --out` into this "
                                "folder first")
    if not isinstance(lab_json.get("runs"), list):
        raise ValueError(f"{out / 'lab.json'}: not a scaling-lab result (no `runs` list); point --out at a "
                         "`gattn lab scaling` OUT")
    if "design" not in lab_json:
        raise ValueError(f"{out / 'lab.json'}: written before the lab registered a design (no `design`), which this "
                         "report needs; its report.md is the one that version wrote")
    scaling_report.make_plots(lab_json, out / "plots")
    scaling_report.write(lab_json, out)
    return lab_json
