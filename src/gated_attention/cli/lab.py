"""`gattn lab NAME ...`: the labs' subcommand group. Each lab has `configure_<name>(parser)` (its options, each with
help text) and `run_<name>(args) -> int` here, calling its library module in gated_attention/labs/. Adding a lab = one
row in LABS + those two functions.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dataclasses import replace

from ..labs import sinks_report
from ..labs.common import default_jobs
from ..labs.sinks import BUDGETS, DEFAULT_VARIANTS, SinkLabConfig
from ..labs.sinks import run_lab as run_sink_lab
from ..labs import stability as stab

def configure_sinks(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="runs/lab/sinks",
                        help="output folder: runs/<variant>/seed<k>/, lab.json, report.md, report.html, plots/ "
                             "(default runs/lab/sinks; a re-run reuses finished models and continues killed ones)")
    parser.add_argument("--budget", default="default", choices=list(BUDGETS),
                        help="; ".join(f"{k}: {v[0]}" for k, v in BUDGETS.items()))
    parser.add_argument("--variants", nargs="+", default=None, metavar="NAME",
                        help=f"gate names (`gattn gates`) and baseline mechanisms (sink_logits, bondarenko_gate, "
                             f"clipped_softmax, forgetting, ...); default: {' '.join(DEFAULT_VARIANTS)}")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers, 1-3 (default 1)")
    parser.add_argument("--heads", type=int, default=None, help="attention heads per layer (default 1)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per model (budget's by default)")
    parser.add_argument("--seeds", type=int, default=None,
                        help="seeds 0..N-1 per variant: model init and data order, the same for every variant")
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate (AdamW; default 3e-3)")
    parser.add_argument("--gate-init", choices=("normal", "identity"), default=None,
                        help="normal: the official N(0, 0.02) init, gate ~0.5 at start (default); identity: gate == 1 "
                             "at start")
    parser.add_argument("--precision", choices=("bf16", "fp32"), default=None,
                        help="training numerics: bf16 autocast (default, ~2x faster on CPU) or fp32; measurements "
                             "always run in fp32")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="torch.compile the training forward (default on for --budget default: ~2x faster "
                             "after ~10 s of compiling; off for small)")
    parser.add_argument("--batch-size", type=int, default=None, help="sequences per step (default 32)")
    parser.add_argument("--min-lr", type=float, default=None, help="learning rate at the end of the decay")
    parser.add_argument("--warmup-steps", type=int, default=None, help="linear warm-up steps")
    parser.add_argument("--schedule", choices=("cosine", "wsd"), default=None,
                        help="cosine decay, or WSD (hold the peak, decay over the last 20 %%)")
    parser.add_argument("--hidden-size", type=int, default=None, help="model width d (default 128)")
    parser.add_argument("--intermediate-size", type=int, default=None, help="FFN width of the ungated model")
    parser.add_argument("--eval-every", type=int, default=None, help="learning-curve interval in steps")
    parser.add_argument("--vocab", type=int, default=None, help="task: normal tokens V (default 64)")
    parser.add_argument("--triggers", type=int, default=None, help="task: trigger tokens k (default 3)")
    parser.add_argument("--seq-len", type=int, default=None, help="task: tokens per sequence incl. BOS (default 128)")
    parser.add_argument("--task-seed", type=int, default=None, help="task: seed of the chain and the triggers (default 0)")
    parser.add_argument("--jobs", type=int, default=None,
                        help="models trained at once, one core each (default: min(2, available cores))")
    parser.add_argument("--report-only", action="store_true",
                        help="train nothing: write lab.json and the report from the models already finished in "
                             "--out with these settings (a run stopped early; seeds per variant as available)")


_SINK_OPTIONS = ("variants", "layers", "heads", "steps", "seeds", "lr", "gate_init", "precision", "compile",
                "batch_size", "min_lr", "warmup_steps", "schedule", "hidden_size", "intermediate_size", "eval_every")
_SINK_TASK_OPTIONS = {"vocab": "vocab", "triggers": "triggers", "seq_len": "seq_len", "task_seed": "seed"}


def sinks_config(args) -> SinkLabConfig:
    """The budget's config with every option the user gave applied on top."""
    cfg = replace(SinkLabConfig(), **BUDGETS[args.budget][1])
    over = {k: getattr(args, k) for k in _SINK_OPTIONS if getattr(args, k, None) is not None}
    task = {f: getattr(args, a) for a, f in _SINK_TASK_OPTIONS.items() if getattr(args, a, None) is not None}
    if task:
        over["task"] = {**cfg.task, **task}
    return replace(cfg, **over).validate()


def run_sinks(args) -> int:

    cfg = sinks_config(args)
    jobs = args.jobs if args.jobs is not None else default_jobs()
    lab = run_sink_lab(cfg, args.out, jobs=jobs, report_only=args.report_only)
    print(sinks_report.text_table(lab))
    print(f"report: {Path(args.out) / 'report.html'}  ({lab['wall_time_s']:.0f}s)")
    return 0


def configure_stability(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="runs/lab/stability",
                        help="output folder: runs/, plots/, lab.json, report.md, report.html (default "
                             "runs/lab/stability, where `gattn compare` reads it; a re-run reuses finished runs and "
                             "retrains interrupted ones, so a stopped lab continues where it was)")
    parser.add_argument("--budget", default="default", choices=list(stab.BUDGETS),
                        help="; ".join(f"{k}: {v.help}" for k, v in stab.BUDGETS.items()) + " (default: default)")
    parser.add_argument("--variants", nargs="+", default=list(stab.DEFAULT_VARIANTS), metavar="NAME",
                        help=f"gate variants (names from `gattn gates`; default: {' '.join(stab.DEFAULT_VARIANTS)})")
    parser.add_argument("--lrs", nargs="+", type=float, default=None, metavar="LR",
                        help="peak learning rates of the grid (default: the budget's; default "
                             f"{' '.join(f'{x:g}' for x in stab.BUDGETS['default'].lrs)})")
    parser.add_argument("--qk-norm", default="both", choices=list(stab.QK_SETTINGS),
                        help="train with QK-norm on, off, or both (default both)")
    parser.add_argument("--steps", type=int, default=None,
                        help="optimizer steps per run (default: the budget's; every run sees the same tokens)")
    parser.add_argument("--seeds", type=int, default=None,
                        help=f"seeds per setting (default: the budget's, {stab.BUDGETS['default'].seeds} for "
                             f"default); >= 3 gives bootstrap intervals worth reading")
    parser.add_argument("--seed-lrs", default=None, choices=("edge", "all"),
                        help="where seeds 1.. run: every LR (all: whole curves per seed, which the intervals need; "
                             "the default of every budget but shallow) or only the last stable LR and the first LR "
                             "past the edge of each setting, found from seed 0 (edge)")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="training / model.* overrides on top of the budget's recipe for every run, as in "
                             "`gattn train --set` (e.g. --set model.num_hidden_layers=24 --set beta2=0.99); "
                             "repeatable. gate, lr, min_lr, seed, steps, data, data_dir and model.use_qk_norm are set "
                             "by the lab's own flags")
    parser.add_argument("--data-dir", default=None,
                        help="prepared corpus folder (default: the budget's, data_v1k with the 1024-token "
                             "vocabulary, prepared automatically if missing)")
    parser.add_argument("--jobs", type=int, default=None,
                        help="runs trained in parallel, one thread each (default: one per core, at most 2)")


def run_stability(args) -> int:
    lab = stab.LabConfig(out=args.out, budget=args.budget, variants=tuple(args.variants),
                         lrs=tuple(args.lrs) if args.lrs else None, qk_norm=args.qk_norm, steps=args.steps,
                         seeds=args.seeds, seed_lrs=args.seed_lrs, sets=tuple(args.sets), data_dir=args.data_dir,
                         jobs=args.jobs if args.jobs is not None else default_jobs())
    res = stab.run_lab(lab, log=lambda m: print(m, file=sys.stderr, flush=True))
    from ..labs.stability_report import sensitivity_text

    print(sensitivity_text(res))
    print(f"report: {Path(args.out) / 'report.html'}  ({res['wall_time_s']:.0f}s, "
          f"{res['cpu_s_runs'] / 60:.1f} core-minutes of training)")
    return 0


# name -> (configure, run, one-line help)
LABS = {
    "sinks": (configure_sinks, run_sinks,
              "Bigram-Backcopy sink lab (Guo et al. 2024): BOS attention of idle heads, baseline vs gates, in minutes."),
    "stability": (configure_stability, run_stability,
                  "LR sweeps of deep narrow models with/without QK-norm (Wortsman et al. 2023 proxies): loss "
                  "spikes, divergence, max stable LR, LR sensitivity with intervals over seeds, logit growth."),
}


def configure_lab(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Science labs: small controlled experiments that show one effect of gated attention, "
                          "measured over seeds, with lab.json, report.md, report.html and plots.")
    sub = parser.add_subparsers(dest="lab", metavar="LAB", required=True)
    for name, (configure, _, help_text) in LABS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        configure(p)


def run_lab(args) -> int:
    from ..io import lock_dir

    with lock_dir(args.out, f"gattn lab {args.lab}"):  # one writer per lab folder (its worker processes write inside)
        return int(LABS[args.lab][1](args) or 0)
