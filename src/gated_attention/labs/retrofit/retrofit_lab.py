"""`gattn lab retrofit`: can gates added to a trained model remove its attention sink? Recipes measured against a
control, over seeds.

For each starting model (`--from`: sink-lab runs or text models, starts.py), each recipe
(recipes.py) and each seed, one *unit*: add the recipe's gate with `gattn retrofit`'s code (in memory),
train `--steps` steps (default: 25 % of the steps the start was trained for) on batches that are a function of
(seed, step) only — so the control and every recipe see the same batches — and measure before, along the way
(learning curves) and after. The `control` unit (the ungated model, the same steps and batches, the pretrained
weights' LR of the recipes) always runs: each recipe is read against it.

Training goes through the one training loop (`train.trainer.train` via `experiment.train_or_reuse`; the recipe's
parameter groups, phases and penalties are its plug-ins, train/plugins.py): AdamW (betas 0.9/0.95, eps 1e-8, the
start's own weight decay on matrices only, as the sink lab and the trainer; the start's peak LR and batch size),
linear warm-up over 5 % of the steps then cosine to 10 % of the peak, global-norm clipping at 1.0 over the trainable
parameters, autocast in the resolved precision (util/precision.py: bf16 where this CPU runs it fast);
measurements in fp32. The gate seed of the `random` init is the unit's seed.

Layout of OUT: runs/<start>/start.json (the starting model's measurements, cached), runs/<start>/<recipe>/seed<k>/
(result.json, model/ = the retrofitted model, the trainer's run files — checkpoints/ and final/ while training —, loadable with AutoModelForCausalLM after
`import gated_attention.modeling`), lab.json, report.md, report.html, plots/. Finished units are reused, a killed unit
continues from its last checkpoint, other settings in an existing OUT stop the job naming them (experiment.cache).
"""
from __future__ import annotations

import math
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from ...experiment import cache
from ...experiment.runs import run_units
from ...experiment.stats import mean_std, spread
from ...experiment.study import Recorder, finish_unit, save_lab, stored_settings, with_stored
from ...experiment.verdicts import Threshold
from ...util.io import locks_output
from .recipes import CONTROL, DEFAULT_RECIPES, get_recipe, recipe_from_dict
# starts.py (the models and their measurement: torch) is imported where a start is loaded or measured

# the per-seed scalars lab.json aggregates (mean/std over seeds); the first eight are the contract
KEYS = ("sink_before", "sink_after", "skill_before", "skill_after", "gate_dormant", "gate_active",
        "streaming_loss_after", "steps")
EXTRA_KEYS = ("backcopy_ce_before", "backcopy_ce_after", "bigram_ce_before", "bigram_ce_after", "f_attn_before",
              "f_attn_after", "sink_rate_before", "sink_rate_after", "m_act_before", "m_act_after",
              "residual_peak_before", "residual_peak_after", "streaming_loss_before", "streaming_loss_kept_before",
              "streaming_loss_kept_after", "window_full_loss_before", "window_full_loss_after", "gate_dormant_start",
              "gate_active_start", "val_loss_after", "final_train_loss", "steps_to_sink_target", "trained_steps",
              "step_share",
              "trainable_params", "cpu_time_s")
# measurement name -> lab.json key stem (before: the starting model; after: the unit's final model)
MEASURED = {"sink": "sink", "skill": "skill", "backcopy_ce": "backcopy_ce", "bigram_ce": "bigram_ce",
            "f_attn": "f_attn", "sink_rate": "sink_rate", "m_act": "m_act", "residual_peak": "residual_peak",
            "streaming_loss": "streaming_loss", "streaming_loss_kept": "streaming_loss_kept",
            "window_full_loss": "window_full_loss", "val_loss": "val_loss"}
PAIRED = ("sink_after", "skill_after", "backcopy_ce_after", "bigram_ce_after", "streaming_loss_after", "m_act_after")
INPUTS = ("start",)  # the key field naming the starting model (its folder and weights' mtime): a retrained start
# makes a stored unit obsolete (recomputed), not a conflict
# the lab's target on the sink lab (fixed before the lab ran), each with where its number comes from
SINK_TARGET = Threshold(
    "sink removed: dormant-query attention on BOS at most (every seed)", 0.2, "share", "chosen",
    "fixed before the lab ran: a fifth of an idle query's attention, below Gu et al. 2024's sink threshold epsilon = "
    "0.3 with room; a model trained with the gate reaches half of it (the paper's G1 first-token attention, 0.048 / "
    "0.073, rounded up to 0.1, the paper's Table 4), a retrofit is given twice that")
SKILL_MARGIN = Threshold(
    "skill kept: backcopy and bigram CE above the control's at most", 0.05, "nats", "chosen",
    "fixed before the lab ran: a loss difference a user would notice (the streaming rule's noticeable cost)")
STEP_SHARE = Threshold(
    "cheap: retrofit steps at most", 0.25, "of the start's training steps", "chosen",
    "fixed before the lab ran: a retrofit worth doing costs at most a quarter of training the model again")
THRESHOLDS = (SINK_TARGET, SKILL_MARGIN, STEP_SHARE)
TARGET_SINK, TARGET_SKILL_MARGIN, TARGET_STEP_SHARE = SINK_TARGET.value, SKILL_MARGIN.value, STEP_SHARE.value


def _base_train():
    """How every unit trains besides what its start and recipe decide: AdamW 0.9/0.95, warm-up then cosine,
    clipping over the trainable parameters, the lab's measurements in place of the trainer's eval and probes. None
    in steps, lr, batch_size, weight_decay, data_dir, seq_len: the start's (plan_for, starts.resolve_starts)."""
    from gated_attention.train.config import TrainConfig

    return TrainConfig(
        data="custom", schedule="cosine", wd_on_embeddings=False, beta1=0.9, beta2=0.95, eps=1e-8, grad_clip=1.0,
        precision="auto", device="cpu",
        # the plain path: the fused q/k/v/gate GEMM would merge the gate's weights (own LR, own phase) with the rest,
        # and compiling would recompile at every phase change
        fast=False, compile="false", eval_every=0, stats_every=0, max_bad_steps=1,
        ckpt_every=250,  # resumable checkpoint interval in steps (0 = none)
        keep_checkpoints=1, progress=False, tensorboard=False,
        steps=None,  # None: step_share x the steps the start was trained for
        lr=None,  # peak LR of the gates (recipes scale it); None: the start's own training peak LR
        batch_size=None,  # None: the start's training batch size (16 when unknown)
        weight_decay=None,  # on matrices only (the trainer's rule); None: the start's own (0.1 if unknown)
        data_dir=None,  # text: the corpus (default: the training run's); required for HF checkpoints
        seq_len=None)  # text: window length (default: the training run's, else 256)


@dataclass
class RetrofitLabConfig:
    """A retrofit lab: its own axes here; how each unit trains is `train` (a TrainConfig, completed per start and
    recipe by unit_train_config). Its stored form (units' keys, lab.json's "config", the options) is `settings()`."""

    starts: list = field(default_factory=list)  # --from folders
    recipes: list = field(default_factory=lambda: list(DEFAULT_RECIPES))  # `control` is always added
    step_share: float = TARGET_STEP_SHARE  # the default budget: a quarter of the start's training (the lab's target)
    seeds: int = 1  # seeds 0..n-1 per start and recipe: gate init (random) and data order
    warmup_frac: float = 0.05  # linear warm-up over this share of the steps
    min_lr_frac: float = 0.1  # cosine decay to this share of the peak
    curve_every: int | None = None  # learning-curve interval; None: a tenth of the steps
    eval_size: int = 64  # held-out sequences (sink task) / ~windows (text: eval_size // 32 batches of 8 per domain)
    stream_window: int | None = None  # streaming window W; None: a quarter of the sequence length
    keep_models: bool = True  # keep each unit's final model in its model/ folder
    train: object = field(default_factory=_base_train)  # TrainConfig; gate, seed and the start's numbers per unit

    def settings(self) -> dict:
        """The stored form: every setting under its stored name (STORED), as units' keys and lab.json hold them."""
        return stored_settings(self, STORED)

    def changed(self, **stored) -> "RetrofitLabConfig":
        """A copy with settings changed by their stored names (the options' names); not validated."""
        return with_stored(self, stored, STORED, "retrofit-lab")

    def validate(self) -> "RetrofitLabConfig":
        if not self.starts:
            raise ValueError("--from: give at least one starting model folder")
        for r in self.recipes:
            get_recipe(r)
        if len(set(self.recipes)) != len(self.recipes):
            raise ValueError(f"--recipes lists a recipe twice: {self.recipes}")
        s = self.settings()
        for k in ("seeds", "eval_size"):
            if s[k] < 1:
                raise ValueError(f"--{k.replace('_', '-')} must be >= 1; got {s[k]}")
        for k in ("steps", "batch_size", "eval_every", "stream_window", "seq_len"):
            if s[k] is not None and s[k] < 1:
                raise ValueError(f"--{k.replace('_', '-')} must be >= 1; got {s[k]}")
        if s["lr"] is not None and not s["lr"] > 0:
            raise ValueError(f"--lr must be > 0; got {s['lr']}")
        if s["weight_decay"] is not None and not s["weight_decay"] >= 0:
            raise ValueError(f"--weight-decay must be >= 0; got {s['weight_decay']}")
        if not 0 < self.step_share <= 10:
            raise ValueError(f"--step-share must be in (0, 10]; got {self.step_share}")
        from gated_attention.util.precision import check

        check(self.train.precision, "--precision")
        if self.train.precision == "bf16-params":  # recipes train phases of the parameters (the trainer's trainable_at)
            raise ValueError("--precision bf16-params is not supported by this lab: its recipes change which "
                             "parameters train between phases, which the bf16 master copy fixes at the start; use "
                             "auto, bf16 or fp32")
        return self


# stored name (options, units' result.json keys, lab.json "config") -> the setting: a lab axis or a TrainConfig
# field (its own name). The one translation table.
STORED = {"starts": "starts", "recipes": "recipes", "steps": "steps", "step_share": "step_share", "seeds": "seeds",
          "lr": "lr", "batch_size": "batch_size", "warmup_frac": "warmup_frac", "min_lr_frac": "min_lr_frac",
          "weight_decay": "weight_decay", "grad_clip": "grad_clip", "precision": "precision",
          "eval_every": "curve_every", "eval_size": "eval_size", "stream_window": "stream_window",
          "ckpt_every": "ckpt_every", "keep_models": "keep_models", "data_dir": "data_dir", "seq_len": "seq_len"}


@dataclass(frozen=True)
class Plan:
    """A unit's resolved numbers (from the config and its start)."""

    steps: int
    lr: float
    batch_size: int
    weight_decay: float
    eval_every: int
    window: int


def plan_for(cfg: RetrofitLabConfig, start: Start) -> Plan:
    t = cfg.train
    steps = t.steps
    if steps is None:
        if not start.trained_steps:
            raise ValueError(f"{start.path}: the steps it was trained for are unknown; give --steps")
        steps = max(1, round(cfg.step_share * start.trained_steps))
    lr = t.lr or start.train_lr
    if not lr:
        raise ValueError(f"{start.path}: its training LR is unknown; give --lr")
    seq = start.seq_len if start.kind == "text" else start.task["seq_len"]
    wd = t.weight_decay if t.weight_decay is not None else start.train_wd if start.train_wd is not None else 0.1
    return Plan(steps=steps, lr=float(lr), batch_size=t.batch_size or start.batch_size or 16, weight_decay=wd,
                eval_every=cfg.curve_every or max(1, steps // 10), window=cfg.stream_window or max(1, seq // 4))


def _measure_key(cfg: RetrofitLabConfig, start: Start) -> dict:
    return {"start": start.to_dict(), "eval_size": cfg.eval_size, "window": plan_for(cfg, start).window, "format": 1}


def _unit_key(cfg: RetrofitLabConfig, start: Start, name: str, recipe: dict, seed: int) -> dict:
    from gated_attention.util.precision import RESOLVED, resolve

    d = cfg.settings()
    for k in ("starts", "recipes", "seeds", "ckpt_every", "keep_models"):  # a unit does not depend on these
        d.pop(k)
    # what it resolved to here: "auto" reuses a bf16 unit, not fp32. run_lab's units carry its one decision already
    p = cfg.train.precision
    d["precision"] = p if p in RESOLVED else resolve(p, "cpu")
    return {**d, **_measure_key(cfg, start), "plan": asdict(plan_for(cfg, start)), "recipe": name,
            "recipe_settings": recipe, "seed": seed}


def _log(msg: str) -> None:
    print(f"[retrofit] {msg}", file=sys.stderr, flush=True)


def _f(v, d: int = 3) -> str:
    return "–" if v is None else f"{v:.{d}f}"


# ---------------------------------------------------------------- one unit: start x recipe x seed

class _UnitSource:
    """The trainer's data source for a unit (train/plugins.py): the start's batches, a pure function of (seed, step)
    (DATA_SEED offsets them as before); no held-out domains (the lab measures itself)."""

    domains: list = []

    def __init__(self, data):
        self.data = data

    def train_batch(self, batch_size: int, seq_len: int, seed: int, step: int, rows: slice | None = None):
        seqs = self.data.train_batch(seed, step)  # (B, T+1)
        return seqs if rows is None else seqs[rows]

    def eval_batches(self, domain: str, seq_len: int, max_batches: int, batch_size: int):
        return iter(())


class _Penalties:
    """The recipe's extra loss terms as the trainer's extra-loss plug-in: during the penalty phase the forward runs
    under a capture.py tap that keeps q / k / gate scores with their graph (GradTap), and the penalties are computed
    from it; the next-token CE and the penalty values go to the recorder."""

    def __init__(self, recipe, penalty_until: int, rec: "_UnitRecorder"):
        self.recipe, self.penalty_until, self.rec, self.tap = recipe, penalty_until, rec, None

    def forward_context(self, step: int, model):
        from gated_attention.capture import capture

        from .recipes import GradTap

        self.tap = GradTap() if self.recipe.uses_tap and step < self.penalty_until else None
        return capture(model, self.tap) if self.tap is not None else nullcontext()

    def __call__(self, step, inputs, targets, output, ce):
        from .recipes import extra_loss

        extra, logged = extra_loss(self.recipe, self.tap, True)
        self.tap = None
        self.rec.observe(float(ce.detach()), logged)
        return extra, logged


class _UnitRecorder(Recorder):
    """The unit's step hook (experiment.study.Recorder): the learning curve (the start's measurements every
    eval_every steps, from step 0), the trailing training CE and penalty values, CPU and wall time."""

    def __init__(self, label: str, plan: Plan, data, masks):
        from . import starts as S

        super().__init__(plan.eval_every, plan.steps, losses=[], extra={})
        self.label, self.plan, self.data, self.masks, self.measure = label, plan, data, masks, S.measure

    def observe(self, ce: float, logged: dict) -> None:
        n = self.plan.eval_every
        self.trail("losses", ce, max(n, 50))
        for k, v in logged.items():
            self.state["extra"][k] = (self.state["extra"].get(k, []) + [v])[-n:]

    def point(self, step: int, model) -> dict:
        m = self.measure(model, self.data, self.masks, full=False)
        n, st = self.plan.eval_every, self.state
        recent = st["losses"][-n:]
        _log(f"{self.label}: step {step}/{self.plan.steps}  sink {_f(m.get('sink'))}  skill {_f(m.get('skill'))}  "
             f"gate dormant/active {_f(m.get('gate_dormant'))}/{_f(m.get('gate_active'))}  ({self.wall_s():.0f}s)")
        return {"step": step, **{k: m.get(k) for k in ("sink", "skill", "backcopy_ce", "bigram_ce", "val_loss",
                                                        "gate_dormant", "gate_active", "sink_rate", "m_act")},
                "train_loss": sum(recent) / len(recent) if recent else None,
                **{k: (sum(v[-n:]) / len(v[-n:]) if v else None) for k, v in st["extra"].items()}}


def unit_train_config(cfg: RetrofitLabConfig, plan: Plan, recipe, seq_len: int, seed: int, precision: str):
    """The trainer settings of one unit: the lab's `train` completed by the unit's plan, recipe, window and seed
    (warm-up warmup_frac of the steps, cosine to min_lr_frac of the peak)."""
    return replace(cfg.train, gate=recipe.gate or "none", seq_len=seq_len, batch_size=plan.batch_size,
                   steps=plan.steps, lr=plan.lr, min_lr=plan.lr * cfg.min_lr_frac,
                   warmup_steps=max(1, round(cfg.warmup_frac * plan.steps)), weight_decay=plan.weight_decay,
                   precision=precision, seed=seed, data_dir=None).validate()


def train_unit(job: tuple) -> dict:
    """Train one unit (or reuse / resume it) and return its result. job = (cfg dict, start dict, recipe name, recipe
    dict, seed, unit dir): plain data, so it can cross to a worker process. The unit is a trainer run folder
    (experiment.train_or_reuse, the one resume policy): the recipe's parameter groups, phases and penalties are the
    trainer's plug-ins (train/plugins.py); a killed unit resumes from its last checkpoint with its learning curve."""
    import shutil

    from gated_attention.experiment.runs import train_or_reuse
    from gated_attention.modeling import GatedQwen3ForCausalLM
    from gated_attention.train.plugins import Plugins
    from gated_attention.util.io import atomic_dir

    from . import starts as S
    from .recipes import param_groups, set_phase

    cfg_d, start_d, name, recipe_d, seed, unit_dir = job
    cfg, start, recipe = RetrofitLabConfig().changed(**cfg_d), S.Start(**start_d), recipe_from_dict(recipe_d)
    unit_dir = Path(unit_dir)
    key = _unit_key(cfg, start, name, recipe_d, seed)
    done = cache.load(unit_dir / "result.json", key, inputs=INPUTS)
    if done is not None:
        _log(f"{start.label} {name} seed {seed}: reusing {unit_dir / 'result.json'}")
        return done
    plan = plan_for(cfg, start)
    from gated_attention.util.io import read_json_object

    vocab = read_json_object(Path(start.model_dir) / "config.json", "starting model config")["vocab_size"]
    data = S.make_data(start, plan.batch_size, cfg.eval_size, vocab)
    masks = None
    if data.kind == "text" and recipe.gate is not None:  # the start as it is, for its sink masks
        masks = S.start_masks(S.build_model(start.model_dir, None, "identity", seed), data.eval_batches())
    label = f"{start.label} {name} seed {seed}"
    rec = _UnitRecorder(label, plan, data, masks)
    gates_only_until = round(recipe.gates_first * plan.steps)
    seq_len = data.seq_len if data.kind == "text" else data.task.seq_len  # the batches' T (they hold T + 1 tokens)
    plugins = Plugins(source=_UnitSource(data),
                      param_groups=lambda m: param_groups(m, recipe, plan.lr, plan.weight_decay),
                      trainable_at=lambda step, m: set_phase(m, recipe, gates_only=step < gates_only_until),
                      extra_loss=_Penalties(recipe, round(recipe.penalty_until * plan.steps), rec))
    tcfg = unit_train_config(cfg, plan, recipe, seq_len, seed, key["precision"])
    summary = train_or_reuse(tcfg, unit_dir, _log, f"{label}:", step_hook=rec, plugins=plugins,
                             model_factory=lambda c, v: S.build_model(start.model_dir, recipe.gate, recipe.init, seed),
                             key=key, inputs=INPUTS, resolved_precision=key["precision"])
    if summary.get("diverged") or summary.get("stop_reason"):
        raise ValueError(f"{label}: {summary.get('stop_reason') or 'diverged'}; lower --lr (run folder {unit_dir})")
    model = GatedQwen3ForCausalLM.from_pretrained(unit_dir / "final")  # the trained fp32 weights
    model.eval()
    st = rec.state
    final = S.measure(model, data, masks, window=plan.window, full=True)
    result = {"start": start.label, "recipe": name, "seed": seed, "steps": plan.steps,
              **{f"{stem}_after": final.get(k) for k, stem in MEASURED.items()},
              "gate_dormant": final.get("gate_dormant"), "gate_active": final.get("gate_active"),
              "steps_to_sink_target": next((p["step"] for p in st["curve"] if p.get("sink") is not None
                                            and p["sink"] <= TARGET_SINK), None),
              "gate_dormant_start": st["curve"][0].get("gate_dormant"),
              "gate_active_start": st["curve"][0].get("gate_active"), "ppl_after": final.get("ppl"),
              "f_attn_per_layer_after": final.get("f_attn_per_layer"),
              "final_train_loss": sum(st["losses"][-50:]) / max(1, len(st["losses"][-50:])),
              "trainable_params": sum(p.numel() for g in param_groups(model, recipe, plan.lr, plan.weight_decay)
                                      for p in g["params"]),
              "wall_time_s": rec.wall_s(), "cpu_time_s": rec.cpu_s(), "curve": st["curve"],
              "resolved_precision": summary.get("resolved_precision")}
    if cfg.keep_models:
        with atomic_dir(unit_dir / "model", overwrite=True) as tmp:
            for f in (unit_dir / "final").iterdir():
                shutil.copy2(f, Path(tmp) / f.name)
    return finish_unit(unit_dir, key, result)  # the lab keeps the model (model/), not the optimizer state


def measure_start(cfg: RetrofitLabConfig, start: Start, out: Path, log=_log) -> dict:
    """The starting model's measurements (cached in runs/<start>/start.json)."""
    from . import starts as S

    def compute() -> dict:
        model = S.build_model(start.model_dir, None, "identity", 0)
        plan = plan_for(cfg, start)
        data = S.make_data(start, plan.batch_size, cfg.eval_size, model.config.vocab_size)
        m = S.measure(model, data, None, window=plan.window, full=True)
        return {"params": sum(p.numel() for p in model.parameters()), **m}

    return cache.cached(out / "runs" / start.label / "start.json", _measure_key(cfg, start), compute, log, "",
                        inputs=INPUTS)


# ---------------------------------------------------------------- aggregation

T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
       2.120, 2.110, 2.101, 2.093, 2.086)  # two-sided 95 % Student t quantiles, df 1..20


def interval(values: list[float]) -> dict:
    """Mean, sample std and the 95 % t-interval half-width of a list (None where it cannot be computed)."""
    s = spread(values)
    n, sd = s["n"], s["std"]
    t = T95[n - 2] if 2 <= n <= len(T95) + 1 else 1.96
    return {"mean": s["mean"], "std": sd, "ci95": t * sd / math.sqrt(n) if sd is not None else None, "n": n}


def _record(unit: dict, before: dict) -> dict:
    """One lab.json per_seed entry: the unit's result plus its start's before-values (curve kept)."""
    r = {k: v for k, v in unit.items() if k != "key"}
    for k, stem in MEASURED.items():
        r[f"{stem}_before"] = before.get(k)
    r["ppl_before"] = before.get("ppl")
    return r


def _entry(records: list[dict]) -> dict:
    mean, std = mean_std(records, KEYS + EXTRA_KEYS)
    return {"per_seed": records, "mean": mean, "std": std}


def _paired(entry: dict, control: dict) -> dict:
    """recipe - control per (start, seed), for the PAIRED keys: mean, std, 95 % interval, n."""
    ctrl = {(r["start"], r["seed"]): r for r in control["per_seed"]}
    out = {}
    for k in PAIRED:
        diffs = [r[k] - ctrl[(r["start"], r["seed"])][k] for r in entry["per_seed"]
                 if (r["start"], r["seed"]) in ctrl and r.get(k) is not None
                 and ctrl[(r["start"], r["seed"])].get(k) is not None]
        out[k] = interval(diffs)
    return out


def target_check(entry: dict, control: dict, kind: str) -> dict:
    """The lab's target on the sink lab: sink <= 0.2 (mean and every seed), backcopy and bigram CE no worse than the
    control's + 0.05 (means), within 25 % of the start's training steps."""
    recs = entry["per_seed"]
    sinks = [r["sink_after"] for r in recs if r.get("sink_after") is not None]
    share = [r["step_share"] for r in recs if r.get("step_share") is not None]
    out = {"sink_after_max": max(sinks) if sinks else None,
           "sink_le_target": bool(sinks) and max(sinks) <= TARGET_SINK,
           "steps_le_target": bool(share) and max(share) <= TARGET_STEP_SHARE + 1e-9}
    skill_keys = ("backcopy_ce_after", "bigram_ce_after") if kind == "sink" else ("skill_after",)
    for k in skill_keys:
        m, c = entry["mean"].get(k), control["mean"].get(k)
        out[f"{k}_vs_control"] = None if m is None or c is None else m - c
        if kind == "sink":
            out[f"{k}_within_margin"] = m is not None and c is not None and m <= c + TARGET_SKILL_MARGIN
    out["met"] = kind == "sink" and out["sink_le_target"] and out["steps_le_target"] and all(
        out[f"{k}_within_margin"] for k in skill_keys)
    return out


def aggregate(units: list[dict], befores: dict[str, dict], starts: list[Start], recipes: list[str]) -> dict:
    kind = starts[0].kind
    trained = {s.label: s.trained_steps for s in starts}
    by_recipe: dict[str, list] = {}
    for u in units:
        r = _record(u, befores[u["start"]])
        r["trained_steps"] = trained.get(u["start"])
        r["step_share"] = r["steps"] / r["trained_steps"] if r.get("trained_steps") else None
        by_recipe.setdefault(u["recipe"], []).append(r)
    control = _entry(by_recipe.get(CONTROL, []))
    out = {}
    for name in recipes:
        if name == CONTROL or name not in by_recipe:
            continue
        e = _entry(by_recipe[name])
        e["vs_control"] = _paired(e, control)
        e["target"] = target_check(e, control, kind)
        out[name] = e
    return {"control": control, "recipes": out}


# ---------------------------------------------------------------- the lab

@locks_output("out", "gattn lab retrofit")  # one writer per lab folder (its worker processes write inside)
def run_lab(cfg: RetrofitLabConfig, out: str | Path, jobs: int = 1, log=_log) -> dict:
    """Measure every start, train/reuse every unit, aggregate, write lab.json and the report into out."""
    from gated_attention.util.precision import decide

    from . import retrofit_report
    from .recipes import RECIPES

    cfg.validate()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    precision, line = decide(cfg.train.precision, "cpu")  # the lab's one decision: every unit (its job's config) carries it
    from .starts import resolve_starts

    starts = resolve_starts(cfg.starts, cfg.train.data_dir, cfg.train.seq_len, log)
    names = [CONTROL] + [r for r in cfg.recipes if r != CONTROL]
    befores = {}
    for s in starts:
        befores[s.label] = measure_start(cfg, s, out, log)
    jobs_list = [(cfg.changed(precision=precision).settings(), s.to_dict(), n, get_recipe(n).to_dict(), seed,
                  str(out / "runs" / s.label / n / f"seed{seed}"))
                 for seed in range(cfg.seeds) for s in starts for n in names]
    log(f"{len(jobs_list)} units ({len(starts)} start(s) x {len(names)} recipes x {cfg.seeds} seed(s)), "
        f"{jobs} at a time, {line} -> {out}")
    units = run_units(train_unit, jobs_list, jobs=jobs, log=log)
    agg = aggregate(units, befores, starts, names)
    lab = {
        "kind": starts[0].kind,
        "config": {**cfg.settings(), "recipes": names, "resolved_precision": precision,
                   "plans": {s.label: asdict(plan_for(cfg, s)) for s in starts}},
        "recipe_settings": {n: RECIPES[n].to_dict() for n in names},
        "start": {s.label: {**s.to_dict(), "before": {k: v for k, v in befores[s.label].items() if k != "key"}}
                  for s in starts},
        **agg,
        "targets": {"sink_after_le": TARGET_SINK, "skill_margin_vs_control": TARGET_SKILL_MARGIN,
                    "step_share_le": TARGET_STEP_SHARE},
        "thresholds": [t.to_dict() for t in THRESHOLDS],
        "wall_time_s": time.perf_counter() - t0,
    }
    return save_lab(out, lab, lambda d: retrofit_report.make_plots(d, lab), lambda: retrofit_report.write(out, lab))
