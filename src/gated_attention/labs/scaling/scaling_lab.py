"""`gattn lab scaling`: does the gate lower loss at equal compute, and does the gain change with scale? A ladder of
model sizes, every variant at its own best learning rate, over seeds (issue 41).

Per (variant, size): a learning-rate sweep on seed 0 (the budget's grid, spaced x2; while the best LR is at an edge
of the LRs tried, one more beyond it, at most `max_extensions` times), then seeds 1..N-1 at that variant's own best
LR, paired by seed with the baseline (the batch at step s is a function of (seed, s): every variant sees the same
data in the same order). Every size trains for `tokens_per_param` tokens per non-embedding parameter of the ungated
model (gated models shrink their FFN to the same count, as the paper's dense runs do), with one recipe: AdamW, weight
decay 0.1, QK-norm, linear warm-up over `warmup_frac` of the steps, cosine decay to `min_lr_frac` of the peak.

Measured per run: the validation loss in nats per domain on `eval_batches * eval_batch_size` BOS-started windows
(the mean over domains is the lab's loss), the loss on the user's held-out text (--heldout), and the training-loss
curve against tokens seen (fresh tokens every step: an estimate of the loss on unseen text along the way, free).
verdict.py holds the rules (Δ against the paper's 0.0128 nats, the trend with compute, the fit, the LR basin).

Layout of OUT:
  OUT/runs/<variant>_<size>_lr<lr>_s<seed>/   the trainer's run folder (final/ kept: `model_dir`), result.json
  OUT/lab.json, OUT/report.md, OUT/report.html, OUT/plots/*.png
A unit is finished when its result.json exists (keyed on its trainer settings and the held-out files); an
interrupted one resumes from its last checkpoint (experiment.train_or_reuse: the one resume policy), so a lab killed
anywhere and started again loses at most the steps since a checkpoint and ends with an uninterrupted lab's numbers.
"""
from __future__ import annotations

import hashlib
import math
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from ...experiment import cache
from ...experiment.runs import ensure_corpus, run_units
from ...gates import DEFAULT_VARIANTS, canonical_name
from ...util.io import atomic_write_json, locks_output, read_jsonl, to_strict
from . import verdict as V


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
    lrs: tuple[float, ...]  # seed 0's sweep, spaced x2 (extended past an edge when the best LR sits on it)
    seeds: int = 3  # seeds 0..N-1 at each variant's own best LR (seed 0 is the sweep's run)
    tokens_per_param: float = 20.0  # per NON-embedding parameter of the ungated model (Kaplan et al. 2020's count:
    # at these widths the tied embedding is half the total and its cost per token is a lookup)
    max_extensions: int = 2  # LRs added beyond an edge at most, per (variant, size)
    seq_len: int = 128
    batch_size: int = 8  # sequences per step: small, so the smallest rung still takes ~100 steps
    warmup_frac: float = 0.05  # share of the steps in linear warm-up (>= 5 steps)
    min_lr_frac: float = 0.01  # cosine decay to this share of the peak LR (the paper: 2e-3 -> 3e-5, SPEC §4; a 10 %
    # floor left the seed-0 sweeps' final losses 0.1-0.2 nats apart at neighbouring LRs, more than the LR effect)
    weight_decay: float = 0.1
    ffn_mult: int = 3  # FFN width of the ungated model = ffn_mult x hidden (gated models shrink it to equal params)
    eval_batches: int = 8  # x eval_batch_size = BOS-started validation windows per domain (>= 256)
    eval_batch_size: int = 32
    curve_points: int = 16  # points of the training-loss curve kept per run
    data_dir: str = "data_v1k"  # the corpus when --data-dir is not given (prepared automatically)
    vocab_size: int = 1024


_DEFAULT = ScalingBudget(
    help="4 widths (24, 32, 48, 72; 2 layers, heads of 8, FFN 3d) = 15k-135k non-embedding parameters (8.9x), "
         "20 tokens per non-embedding parameter (0.3M-2.7M tokens), LRs 4e-3..3.2e-2 on seed 0 (extended past an "
         "edge), 3 seeds at each variant's best LR, fp32, eager: 3 variants x 4 sizes x >= 6 units (docs/"
         "experiments/scaling.md gives its measured cost)",
    sizes=ladder((24, 32, 48, 72), head_dim=8), lrs=(4e-3, 8e-3, 1.6e-2, 3.2e-2))

BUDGETS: dict[str, ScalingBudget] = {
    "quick": replace(
        _DEFAULT,
        help="CI: the default's structure on tiny models — 4 widths (8, 12, 16, 24; 1 layer, heads of 4) "
             "spanning 8.8x, 4 LRs, 2 seeds, 2 tokens per parameter, windows of 32 (seconds per run)",
        sizes=ladder((8, 12, 16, 24), head_dim=4, layers=lambda d: 1), lrs=(5e-3, 1e-2, 2e-2, 4e-2), seeds=2,
        tokens_per_param=2.0, max_extensions=1, seq_len=32, batch_size=4, eval_batches=2, eval_batch_size=4,
        curve_points=8),
    "default": _DEFAULT,
    "gpu": replace(
        _DEFAULT,
        help="a GPU ladder: widths 448-1024 with depth = width / 64 (heads of 64, FFN 3d): 18M-218M non-embedding "
             "parameters (12x), 20 tokens per parameter (0.37B-4.4B tokens), LRs 5e-4..4e-3, 3 seeds, windows of "
             "1024, batch 64: 1.4e20 FLOPs for 3 variants (`gattn lab scaling --budget gpu --plan`; ~96 GPU-hours at "
             "40 %% MFU of an H100); give it a corpus with a real vocabulary (--data-dir)",
        sizes=ladder((448, 576, 768, 1024), head_dim=64, layers=lambda d: d // 64), lrs=(5e-4, 1e-3, 2e-3, 4e-3),
        seq_len=1024, batch_size=64, eval_batches=8, eval_batch_size=32),
}

# settings the lab sets per unit or through its own flags: --set may not change them
_LAB_SETTINGS = {"gate": "--variants", "lr": "the sweep", "min_lr": "the budget", "seed": "--seeds",
                 "steps": "--tokens-per-param", "data": "--data-dir", "data_dir": "--data-dir",
                 "precision": "--precision"}


@dataclass
class LabConfig:
    """Everything `gattn lab scaling` was asked for (CLI flags map 1:1)."""

    out: str = "runs/lab/scaling"  # where `gattn compare --scaling-lab` looks by default
    budget: str = "default"
    variants: tuple[str, ...] = DEFAULT_VARIANTS
    seeds: int | None = None  # None = the budget's
    tokens_per_param: float | None = None  # None = the budget's (20 for default and gpu)
    lrs: tuple[float, ...] | None = None  # None = the budget's grid
    heldout: tuple[str, ...] = ()  # plain-text files: out-of-domain loss of every run
    sizes: tuple[str, ...] | None = None  # a subset of the budget's rungs by name (None = all; the fit needs 3)
    sets: tuple[str, ...] = ()  # `key=value` training overrides on top of the recipe (--set)
    data_dir: str | None = None
    jobs: int = 1
    precision: str = "fp32"  # fp32 by default: the same numbers on either CPU kind (bf16 ~60x slower on AVX2)

    def validate(self) -> "LabConfig":
        from gated_attention.util.precision import check

        if self.budget not in BUDGETS:
            raise ValueError(f"unknown --budget {self.budget!r}; valid: {', '.join(BUDGETS)}")
        names = []
        for v in self.variants:
            try:
                names.append(canonical_name(v))
            except ValueError:
                raise ValueError(f"unknown variant {v!r} in --variants (see `gattn gates`)") from None
        if "none" not in names:
            raise ValueError("--variants must include baseline: every gain is measured against it")
        if len(set(names)) != len(names):
            raise ValueError(f"--variants lists a variant twice: {list(self.variants)}")
        if self.seeds is not None and self.seeds < 1:
            raise ValueError(f"--seeds {self.seeds} must be >= 1")
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
        check(self.precision, "--precision")
        return self

    @property
    def spec(self) -> ScalingBudget:
        return BUDGETS[self.budget]

    def grid(self) -> tuple[float, ...]:
        return tuple(sorted(float(x) for x in (self.lrs or self.spec.lrs)))

    def rungs(self) -> tuple[Size, ...]:
        return tuple(s for s in self.spec.sizes if self.sizes is None or s.name in self.sizes)

    def n_seeds(self) -> int:
        return self.seeds or self.spec.seeds

    def tpp(self) -> float:
        return self.tokens_per_param or self.spec.tokens_per_param


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


def recipe(spec: ScalingBudget, size: Size, info: dict) -> dict:
    """The TrainConfig fields one rung trains with, besides gate, LR and seed (the same recipe at every size; `gattn
    compare`'s default budget trains a rung of the default ladder with it)."""
    steps = info["steps"]
    return dict(steps=steps, warmup_steps=max(5, round(spec.warmup_frac * steps)), schedule="cosine",
                weight_decay=spec.weight_decay, seq_len=spec.seq_len, batch_size=spec.batch_size,
                eval_batches=spec.eval_batches, eval_batch_size=spec.eval_batch_size, ckpt_every=max(1, steps // 4),
                model_overrides=size.overrides(spec.ffn_mult))


def unit_name(variant: str, size: str, lr: float, seed: int) -> str:
    return f"{variant}_{size}_lr{lr:g}_s{seed}"


def train_config(lab: LabConfig, data_dir: str, variant: str, size: Size, info: dict, lr: float, seed: int,
                 precision: str):
    """The TrainConfig of one unit: the `small` preset with the ladder's shape and recipe, eager (compile=auto decides
    from a timing: a unit's numbers would depend on the machine's load)."""
    from gated_attention.presets import model_config
    from gated_attention.train.train_presets import train_preset
    from gated_attention.train.overrides import apply_overrides

    b = lab.spec
    cfg = replace(
        train_preset("small"), data="corpus", data_dir=str(data_dir), gate=variant, seed=seed, lr=lr,
        min_lr=lr * b.min_lr_frac, precision=precision, eval_every=0, stats_every=0, tensorboard=False,
        progress=True, compile="false", **recipe(b, size, info))
    if lab.sets:
        cfg = apply_overrides(cfg, list(lab.sets), model_config(cfg.model, gate=variant).to_dict())
    return cfg.validate()


def _curve(log: list[dict], points: int, tokens_per_step: int) -> dict:
    """The training loss averaged over `points` equal bins of steps, at each bin's last step's tokens."""
    rows = [r for r in log if r.get("loss") is not None and math.isfinite(r["loss"])]
    if not rows:
        return {"tokens": [], "loss": []}
    n = len(rows)
    bins = [rows[i * n // points:(i + 1) * n // points] for i in range(points)]
    bins = [b for b in bins if b]
    return {"tokens": [(b[-1]["step"] + 1) * tokens_per_step for b in bins],
            "loss": [sum(r["loss"] for r in b) / len(b) for b in bins]}


def heldout_loss(model_dir: Path, data_dir: str, files: list[str], seq_len: int, max_windows: int = 256,
                 batch_size: int = 32) -> dict | None:
    """Mean loss in nats of the final model on the held-out files (the corpus's tokenizer, BOS-started windows of
    seq_len tokens, up to max_windows per file): {"mean", "per_file"}; None without files."""
    if not files:
        return None
    import numpy as np
    import torch
    import torch.nn.functional as F

    import gated_attention.modeling  # noqa: F401  (registers the Auto classes)
    from gated_attention import data
    from gated_attention.data.tokenizer import text_to_tokens
    from gated_attention.modeling import GatedQwen3ForCausalLM

    corpus = data.Corpus(data_dir)
    model = GatedQwen3ForCausalLM.from_pretrained(model_dir).eval()
    per_file = {}
    for f in files:
        arr = np.asarray(text_to_tokens(Path(f), corpus.tokenizer), dtype=np.int64)
        n = min(max_windows, len(arr) // seq_len)
        if n == 0:
            raise ValueError(f"--heldout {f}: fewer than {seq_len} tokens; give a longer text")
        total = count = 0.0
        for b0 in range(0, n, batch_size):
            rows = range(b0, min(n, b0 + batch_size))
            x = torch.tensor(np.stack([np.concatenate(([corpus.bos_id], arr[r * seq_len:(r + 1) * seq_len]))
                                       for r in rows]))  # (b, T+1)
            with torch.no_grad():
                logits = model(input_ids=x[:, :-1]).logits  # (b, T, V)
            ce = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten(), reduction="sum")
            total += float(ce)
            count += x[:, 1:].numel()
        per_file[Path(f).name] = total / count
    return {"mean": sum(per_file.values()) / len(per_file), "per_file": per_file}


def _files_key(files: tuple[str, ...]) -> list:
    return [[Path(f).name, hashlib.sha256(Path(f).read_bytes()).hexdigest()] for f in files]


def train_unit(task: tuple) -> dict:
    """Train (or reuse, or resume) one unit and write its result.json; picklable for --jobs workers.
    task = (cfg_dict, run_dir, heldout files, curve points)."""
    cfg_dict, run_dir, heldout, points = task
    out = Path(run_dir)
    key = {**cfg_dict, "heldout": _files_key(heldout)}
    done = cache.load(out / "result.json", key)
    if done is not None:
        return done
    from gated_attention.experiment.runs import train_or_reuse
    from gated_attention.train.config import TrainConfig

    cfg = TrainConfig.from_dict(cfg_dict).validate()
    c0, t0 = time.process_time(), time.perf_counter()
    summary = train_or_reuse(cfg, out, lambda m: print(m, file=sys.stderr, flush=True), "[scaling]",
                             resolved_precision=cfg.precision)
    log = read_jsonl(out / "log.jsonl")
    losses = {d: float(v) for d, v in (summary.get("val_losses") or {}).items()}
    val = sum(losses.values()) / len(losses) if losses else math.nan
    held = heldout_loss(out / "final", cfg.data_dir, list(heldout), cfg.seq_len)
    result = {"val_loss": val, "val_loss_per_domain": losses, "heldout_loss": held["mean"] if held else None,
              "heldout_loss_per_file": held["per_file"] if held else None, "tokens": summary.get("tokens"),
              "steps": summary.get("steps"), "diverged": bool(summary.get("diverged")),
              "spikes": int(summary.get("spikes") or 0), "resolved_precision": summary.get("resolved_precision"),
              "train_wall_s": summary.get("wall_time_s"), "cpu_s_this_process": time.process_time() - c0,
              "wall_s_this_process": time.perf_counter() - t0,
              "curve": _curve(log, points, cfg.batch_size * cfg.seq_len)}
    result = cache.save(out / "result.json", key, result)
    shutil.rmtree(out / "checkpoints", ignore_errors=True)  # final/ stays: the run's `model_dir`
    print(f"[scaling] {out.name}: val loss {val:.4f}", file=sys.stderr, flush=True)
    return result


def plan_text(lab: LabConfig, vocab: int | None = None) -> str:
    """The ladder as `--plan` prints it: per size its parameters, tokens and FLOPs, and the units' total FLOPs (the
    sweep's grid and the seeds; extensions past an edge add more). vocab: the corpus's (default: the budget's)."""
    spec = lab.spec
    vocab = vocab or spec.vocab_size
    rows, total = [], 0.0
    units = len(lab.grid()) + lab.n_seeds() - 1
    for s in lab.rungs():
        i = size_info(spec, s, vocab, lab.tpp())
        total += i["flops"] * units * len(lab.variants)
        rows.append(f"  {i['name']:>10}  {i['params_total']:>13,} total  {i['params_non_embedding']:>13,} non-emb.  "
                    f"{i['tokens']:>15,} tokens  {i['flops']:.3g} FLOPs")
    return "\n".join([f"ladder `{lab.budget}` ({len(lab.variants)} variants x {len(lab.rungs())} sizes x {units} units "
                      f"each, vocabulary {vocab}):", *rows,
                      f"total {total:.3g} FLOPs (+ evaluation); at 40 % MFU of a 989-TFLOP/s GPU: "
                      f"{total / (0.4 * 989e12) / 3600:.2f} GPU-hours"])


# ---------------------------------------------------------------- the lab

def _stage(points: list[tuple], lab: LabConfig, ctx: dict, log) -> dict[tuple, dict]:
    """Run (or reuse) units (variant, size, lr, seed), lab.jobs at a time; point -> result."""
    tasks = []
    for v, s, lr, seed in points:
        cfg = train_config(lab, ctx["data_dir"], v, ctx["size"][s], ctx["info"][s], lr, seed, ctx["precision"])
        tasks.append((cfg.to_dict(), str(ctx["out"] / "runs" / unit_name(v, s, lr, seed)), lab.heldout,
                      lab.spec.curve_points))
    done = sum((Path(d) / "result.json").exists() for _, d, _, _ in tasks)
    if len(tasks) > done:
        log(f"[scaling] {len(tasks) - done} unit(s) to train ({done} stored), {lab.jobs} at a time")
    return dict(zip(points, run_units(train_unit, tasks, jobs=lab.jobs, log=log)))


def sweep(lab: LabConfig, ctx: dict, log) -> dict[tuple, dict]:
    """Size by size (smallest first, so a lab stopped early holds whole rungs): seed 0 at every LR of the grid for
    every variant, then, while a variant's best LR sits at an edge of the LRs tried, one more LR beyond it (at most
    max_extensions per variant and size)."""
    results = {}
    for s in ctx["size"]:
        results.update(_stage([(v, s, lr, 0) for v in lab.variants for lr in lab.grid()], lab, ctx, log))
        for _ in range(lab.spec.max_extensions):
            more = []
            for v in lab.variants:
                losses = {p[2]: r["val_loss"] for p, r in results.items() if p[:2] == (v, s)}
                nxt = V.extend_grid(list(losses), V.lr_basin(losses)["best_lr"])
                if nxt is not None:
                    more.append((v, s, nxt, 0))
            if not more:
                break
            log(f"[scaling] {s}: best LR at an edge for {', '.join(p[0] for p in more)}: extending the sweep")
            results.update(_stage(more, lab, ctx, log))
    return results


@locks_output("lab.out", "gattn lab scaling")
def run_lab(lab: LabConfig, log=print) -> dict:
    """Sweep, seeds at each best LR, then lab.json, report.md, report.html and plots into lab.out."""
    from . import scaling_report
    from gated_attention import data
    from gated_attention.util.precision import decide

    lab.validate()
    t0 = time.perf_counter()
    precision, line = decide(lab.precision, "cpu")
    spec = lab.spec
    data_dir = ensure_corpus(lab.data_dir or spec.data_dir, spec.vocab_size, log, tag="[scaling]")
    vocab = data.Corpus(data_dir).vocab_size
    out = Path(lab.out)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    sizes = [size_info(spec, s, vocab, lab.tpp()) for s in lab.rungs()]
    ctx = {"data_dir": str(data_dir), "precision": precision, "out": out,
           "size": {s.name: s for s in lab.rungs()}, "info": {i["name"]: i for i in sizes}}
    log(f"[scaling] {len(lab.variants)} variants x {len(sizes)} sizes ({sizes[0]['params_non_embedding']:,}-"
        f"{sizes[-1]['params_non_embedding']:,} non-embedding parameters, {lab.tpp():g} tokens each), {line} -> {out}")
    results = sweep(lab, ctx, log)
    best = {v: {s: V.lr_basin({p[2]: r["val_loss"] for p, r in results.items() if p[:2] == (v, s)})["best_lr"]
                for s in ctx["size"]} for v in lab.variants}
    seeds = [(v, s, best[v][s], k) for k in range(1, lab.n_seeds()) for s in ctx["size"] for v in lab.variants]
    results.update(_stage(seeds, lab, ctx, log))
    lab_json = summarize(lab, sizes, results, best, out)
    lab_json["config"] = {**asdict(lab), "lrs": list(lab.grid()), "seeds": lab.n_seeds(),
                          "tokens_per_param": lab.tpp(), "params_counted": "non-embedding (ungated model)",
                          "data_dir": str(data_dir), "resolved_precision": precision,
                          "recipe": {k: v for k, v in asdict(spec).items() if k not in ("help", "sizes", "lrs")}}
    lab_json["wall_time_s"] = time.perf_counter() - t0
    lab_json = to_strict(lab_json)
    lab_json["plots"] = {k: str(p.relative_to(out)) for k, p in scaling_report.make_plots(lab_json, out / "plots").items()}
    atomic_write_json(out / "lab.json", lab_json, indent=1)
    scaling_report.write(lab_json, out)
    return lab_json


def summarize(lab: LabConfig, sizes: list[dict], results: dict[tuple, dict], best: dict, out: Path) -> dict:
    """lab.json's measured part (the contract's keys): runs, best_lr, basins, deltas, fits, trends, curves, verdict."""
    runs = [{"variant": v, "size": s, "lr": lr, "seed": k, "tokens": r.get("tokens"), "val_loss": r.get("val_loss"),
             "val_loss_per_domain": r.get("val_loss_per_domain"), "heldout_loss": r.get("heldout_loss"),
             "diverged": r.get("diverged"), "spikes": r.get("spikes"),
             "cpu_s": r.get("cpu_s_this_process"), "model_dir": str(Path("runs") / unit_name(v, s, lr, k) / "final"),
             "curve": r.get("curve")} for (v, s, lr, k), r in sorted(results.items(), key=lambda x: x[0][:2])]
    names = [i["name"] for i in sizes]
    compute = {i["name"]: i["flops"] for i in sizes}
    at_best = {v: {s: {r["seed"]: r["val_loss"] for r in runs if r["variant"] == v and r["size"] == s
                       and r["lr"] == best[v][s] and r["val_loss"] is not None} for s in names} for v in lab.variants}
    base = next(v for v in lab.variants if canonical_name(v) == "none")
    gated = [v for v in lab.variants if v != base]
    deltas, trends, curves = [], {}, {}
    for v in gated:
        diffs = {}
        for s in names:
            d = V.paired_delta(at_best[v][s], at_best[base][s])
            deltas.append({"variant": v, "size": s, "mean": d["mean"], "ci_low": d["ci_low"], "ci_high": d["ci_high"],
                           "n_seeds": d["n_seeds"], "std": d["std"], "per_seed": d["per_seed"],
                           "verdict": V.judge(d["mean"], d["ci_low"], d["ci_high"]),
                           "seeds_needed": V.seeds_needed(d["mean"], d["std"])})
            diffs[s] = {k: at_best[v][s][k] - at_best[base][s][k] for k in at_best[v][s] if k in at_best[base][s]}
            curves.setdefault(v, {})[s] = delta_curve(runs, v, base, s, best)
        trends[v] = V.delta_trend(compute, diffs)
    fits = {}
    for v in lab.variants:
        try:
            fits[v] = V.fit_with_interval(compute, at_best[v])
        except ValueError as exc:
            fits[v] = {"E": None, "A": None, "alpha": None, "alpha_ci": None, "error": str(exc)}
    basins = {v: {s: V.lr_basin({r["lr"]: r["val_loss"] for r in runs if r["variant"] == v and r["size"] == s
                                 and r["seed"] == 0}) for s in names} for v in lab.variants}
    heldout = {v: {s: _mean([r["heldout_loss"] for r in runs if r["variant"] == v and r["size"] == s
                             and r["lr"] == best[v][s]]) for s in names} for v in lab.variants}
    top = names[-1]
    per_variant = {}
    for v in gated:
        d = next(x for x in deltas if x["variant"] == v and x["size"] == top)
        per_variant[v] = {"size": top, "delta": d["mean"], "ci": [d["ci_low"], d["ci_high"]], "gain": d["verdict"],
                          "seeds_needed": d["seeds_needed"] if d["verdict"] == V.INCONCLUSIVE else None,
                          "trend": trends[v]["verdict"], "change_across_ladder": trends[v]["change"]}
    return {"budget": lab.budget, "thresholds": {k: [t.to_dict() for t in ts] for k, ts in V.THRESHOLDS.items()},
            "sizes": sizes, "runs": runs, "best_lr": best, "lr_basin": basins, "deltas": deltas, "fits": fits,
            "trends": trends, "delta_curves": curves, "heldout_at_best": heldout,
            "verdict": {"rule": "Δ at the largest size judged against δ = 0.0128 nats (verdict.py); trend: Δ's "
                                "change across the ladder against the same δ",
                        "per_variant": per_variant, "text": verdict_text(per_variant)},
            "cpu_s_runs": sum(r.get("cpu_s") or 0.0 for r in runs)}


def _mean(vals):
    vals = [x for x in vals if x is not None and math.isfinite(x)]
    return sum(vals) / len(vals) if vals else None


def delta_curve(runs: list[dict], variant: str, base: str, size: str, best: dict) -> dict:
    """Δ of the training-loss curve (gated - baseline, each at its best LR) against tokens, mean and range over the
    seeds both have: where an early gain fades."""
    def curves(v):
        return {r["seed"]: r["curve"] for r in runs if r["variant"] == v and r["size"] == size
                and r["lr"] == best[v][size] and r.get("curve")}
    g, b = curves(variant), curves(base)
    seeds = sorted(set(g) & set(b))
    if not seeds:
        return {"tokens": [], "mean": [], "low": [], "high": []}
    n = min(min(len(g[s]["loss"]), len(b[s]["loss"])) for s in seeds)
    diffs = [[g[s]["loss"][i] - b[s]["loss"][i] for s in seeds] for i in range(n)]
    return {"tokens": g[seeds[0]]["tokens"][:n], "mean": [sum(d) / len(d) for d in diffs],
            "low": [min(d) for d in diffs], "high": [max(d) for d in diffs], "seeds": len(seeds)}


def verdict_text(per_variant: dict) -> str:
    parts = []
    for v, x in per_variant.items():
        ci = x["ci"]
        iv = f" [{ci[0]:+.4f}, {ci[1]:+.4f}]" if ci[0] is not None else ""
        more = f", needs ~{x['seeds_needed']} seeds" if x.get("seeds_needed") else ""
        d = "-" if x["delta"] is None else f"{x['delta']:+.4f}"
        parts.append(f"{v} at {x['size']}: Δ {d}{iv} nats — {x['gain']}{more}; across the ladder: {x['trend']}")
    return "; ".join(parts)
