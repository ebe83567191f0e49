"""`gattn lab sinks`'s declaration: its options (each with its help, here only; each knob's default read from the
budgets), how they apply over a budget (`sinks_config`) and how the command runs the lab (sink_lab.run_lab);
cli/lab.py builds the subcommand from STUDY without importing torch."""
from __future__ import annotations

import argparse
from pathlib import Path

from ...experiment.study import Option, Study, options

# option dest -> (argparse keywords, help) of the knobs that are SinkLabConfig fields by the same name
_KNOBS = {
    "layers": ({"type": int}, "decoder layers, 1-3"),
    "heads": ({"type": int}, "attention heads per layer"),
    "steps": ({"type": int}, "optimizer steps per model"),
    "lr": ({"type": float}, "peak learning rate (AdamW)"),
    "gate_init": ({"choices": ("normal", "identity")},
                  "normal: the official N(0, 0.02) init, gate ~0.5 at start; identity: gate == 1 at start"),
    "compile": ({"action": argparse.BooleanOptionalAction},
                "torch.compile the training forward (~2x faster after ~10 s of compiling)"),
    "batch_size": ({"type": int}, "sequences per step"),
    "min_lr": ({"type": float}, "learning rate at the end of the decay"),
    "warmup_steps": ({"type": int}, "linear warm-up steps"),
    "schedule": ({"choices": ("cosine", "wsd")},
                 "cosine decay, or WSD (hold the peak, decay over the last --decay-frac of the steps)"),
    "wsd_decay_frac": ({"type": float, "flag": "--decay-frac"},
                       "WSD: share of the steps spent decaying to --min-lr at the end; 0 = constant LR after the "
                       "warm-up"),
    "weight_decay": ({"type": float}, "AdamW decoupled weight decay on matrices (embeddings, norms and biases "
                                      "excluded)"),
    "beta2": ({"type": float}, "Adam second-moment decay"),
    "eps": ({"type": float, "flag": "--adam-eps"}, "Adam epsilon"),
    "qk_norm": ({"choices": ("on", "off")}, "RMSNorm on q and k per head (Qwen3's QK-norm); Guo et al.'s model has "
                                            "none"),
    "grad_clip": ({"type": float}, "global gradient-norm clip (0 = off)"),
    "hidden_size": ({"type": int}, "model width d"),
    "intermediate_size": ({"type": int}, "FFN width of the ungated model"),
    "eval_every": ({"type": int}, "learning-curve interval in steps"),
}
# option dest -> (BackcopyTask field, type, help)
TASK_OPTIONS = {"vocab": ("vocab", int, "normal tokens V"), "triggers": ("triggers", int, "trigger tokens k"),
                "seq_len": ("seq_len", int, "tokens per sequence incl. BOS"),
                "alpha": ("alpha", float, "Dirichlet concentration of the bigram rows (lower = more predictable)"),
                "task_seed": ("seed", int, "seed of the chain and the triggers")}
_CONFIG_OPTIONS = ("variants", "seeds", "precision", *_KNOBS)  # SinkLabConfig fields set by an option


def _knob(dest: str, kw: dict, text: str) -> Option:
    kw = dict(kw)
    flag = kw.pop("flag", "--" + dest.replace("_", "-"))
    extra = {"dest": dest} if flag != "--" + dest.replace("_", "-") else {}
    return Option((flag,), text, {**kw, **extra, "default": None}, lambda b, d=dest: _stored(b)[d])


def _stored(budget) -> dict:
    """A budget's settings under their stored names (the options')."""
    from .sink_lab import SinkLabConfig, with_changes

    return with_changes(SinkLabConfig(), budget.changes).settings()


def _options() -> list[Option]:
    task = [Option(("--" + dest.replace("_", "-"),), "task: " + text, {"type": kind, "default": None},
                   lambda b, f=field: _stored(b)["task"][f]) for dest, (field, kind, text) in TASK_OPTIONS.items()]
    return [
        options.out("runs/lab/sinks", "runs/<variant>/seed<k>/ (result.json + the finished model as a from_pretrained "
                    "folder), lab.json, report.md, report.html, plots/"),
        options.budget(_budgets()),
        options.variants("gate names (`gattn gates`) and baseline mechanisms (sink_logits, bondarenko_gate, "
                         "clipped_softmax, forgetting, ...)", shown=lambda b: _stored(b)["variants"]),
        *[_knob(d, *_KNOBS[d]) for d in ("layers", "heads", "steps")],
        options.seeds("seeds 0..N-1 per variant: model init and data order, the same for every variant",
                      shown=lambda b: _stored(b)["seeds"]),
        *[_knob(d, *_KNOBS[d]) for d in ("lr", "gate_init")],
        options.precision(None, "; measurements always run in fp32", shown=lambda b: _stored(b)["precision"]),
        *[_knob(d, kw, text) for d, (kw, text) in _KNOBS.items() if d not in ("layers", "heads", "steps", "lr",
                                                                             "gate_init")],
        *task,
        options.jobs("models trained at once"),
        options.report_only("train nothing: write lab.json and the report from the models already finished in --out "
                            "with these settings (a run stopped early; seeds per variant as available)"),
    ]


def sinks_config(args):
    """The budget's SinkLabConfig with every option the user gave applied on top."""
    from .sink_lab import budget_config

    cfg = budget_config(args.budget)
    over = {k: getattr(args, k) for k in _CONFIG_OPTIONS if getattr(args, k, None) is not None}
    task = {f: getattr(args, a) for a, (f, _, _) in TASK_OPTIONS.items() if getattr(args, a, None) is not None}
    if task:
        over["task"] = {**cfg.task, **task}
    if "qk_norm" in over:
        over["qk_norm"] = over["qk_norm"] == "on"
    return cfg.changed(**over).validate()


def _run(args) -> int:
    from ...experiment.runs import default_jobs
    from . import sink_report
    from .sink_lab import run_lab

    cfg = sinks_config(args)
    lab = run_lab(cfg, args.out, jobs=args.jobs if args.jobs is not None else default_jobs(),
                  report_only=args.report_only)
    print(sink_report.text_table(lab))
    print(f"report: {Path(args.out) / 'report.html'}  ({lab['wall_time_s']:.0f}s)")
    return 0


def _budgets() -> dict:
    from .sink_lab import BUDGETS

    return BUDGETS


STUDY = Study("sinks", "Bigram-Backcopy sink lab (Guo et al. 2024): BOS attention of idle heads, baseline vs gates, "
              "in minutes.", _options, _run, budgets=_budgets)
