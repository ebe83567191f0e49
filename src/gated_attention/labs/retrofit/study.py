"""`gattn lab retrofit`'s declaration: its options (each with its help, here only) and how the command runs the lab
(retrofit_lab.run_lab); cli/lab.py builds the subcommand from STUDY without importing torch."""
from __future__ import annotations

import argparse
from pathlib import Path

from ...experiment.study import Option, Study, options
from ...util import errors as E

# option dest -> the lab's setting by its stored name (RetrofitLabConfig.changed): every option but --jobs and --out
_KNOBS = ("starts", "recipes", "steps", "step_share", "seeds", "lr", "batch_size", "weight_decay", "precision",
          "eval_every", "eval_size", "stream_window", "data_dir", "seq_len", "keep_models")


def _options() -> list[Option]:
    from .recipes import CONTROL, DEFAULT_RECIPES, RECIPES, REST_LR
    from .retrofit_lab import RetrofitLabConfig

    d = RetrofitLabConfig()
    return [
        Option(("--from",), "trained UNGATED starting models, all of one kind: sink-lab runs (OUT/runs/baseline/seed0 "
               "of `gattn lab sinks`), training runs (RUN or RUN/final of gattn train / compare), or HF checkpoint "
               "folders (with --data-dir: a corpus in the model's vocabulary)",
               {"dest": "starts", "nargs": "+", "required": True, "metavar": "DIR"}),
        Option(("--recipes",), f"recipes to compare against the control ({CONTROL!r} always runs; REST_LR = "
               f"{REST_LR:g}): " + "; ".join(f"{n}: {r.help}".replace("%", "%%") for n, r in RECIPES.items())
               + f". Default: {' '.join(DEFAULT_RECIPES)}",
               {"nargs": "+", "default": list(DEFAULT_RECIPES), "metavar": "NAME"}),
        Option(("--steps",), "retrofit steps per unit (default: --step-share x the steps the start was trained for)",
               {"type": E.positive_int, "default": None}),
        Option(("--step-share",), f"default --steps as a share of the start's training steps (default "
               f"{d.step_share:g})", {"type": E.positive_float, "default": d.step_share}),
        options.seeds(f"seeds 0..N-1 per start and recipe: gate init (random) and data order (default {d.seeds})",
                      type=E.positive_int, default=d.seeds),
        Option(("--lr",), "peak LR of the gates; recipes train the pretrained weights at REST_LR x this (default: the "
               "start's own training peak LR)", {"type": E.positive_float, "default": None}),
        Option(("--batch-size",), "sequences per step (default: the start's training batch size, 16 when unknown)",
               {"type": E.positive_int, "default": None}),
        Option(("--weight-decay",), "AdamW weight decay on matrices (default: the start's own, 0.1 when unknown)",
               {"type": E.nonneg_float, "default": None}),
        options.precision(d.train.precision, "; lab.json records the resolved one; measurements always run in fp32"),
        Option(("--eval-every",), "learning-curve interval in steps (default: a tenth of the steps)",
               {"type": E.positive_int, "default": None}),
        Option(("--eval-size",), "held-out sequences (sink task; text: eval-size/32 batches of 8 windows per domain) "
               f"(default {d.eval_size})", {"type": E.positive_int, "default": d.eval_size}),
        Option(("--stream-window",), "sliding window W of the streaming loss (default: a quarter of the sequence "
               "length)", {"type": E.positive_int, "default": None}),
        Option(("--data-dir",), "text: the prepared corpus (default: the training run's; required for an HF "
               "checkpoint, prepared with `gattn data prepare --tokenizer DIR`)", {"default": None}),
        Option(("--seq-len",), "text: window length (default: the training run's, else 256)",
               {"type": E.positive_int, "default": None}),
        Option(("--keep-models",), "keep each unit's final model in OUT/runs/<start>/<recipe>/seed<k>/model "
               "(default on)", {"action": argparse.BooleanOptionalAction, "default": d.keep_models}),
        options.jobs(type=E.positive_int),
        options.out("runs/lab/retrofit", "runs/<start>/<recipe>/seed<k>/, lab.json, report.md, report.html, plots/",
                    type=E.out_dir),
    ]


def _run(args) -> int:
    from ...experiment.runs import default_jobs
    from . import retrofit_report
    from .retrofit_lab import RetrofitLabConfig, run_lab

    cfg = RetrofitLabConfig().changed(**{k: getattr(args, k) for k in _KNOBS}).validate()
    lab = run_lab(cfg, args.out, jobs=args.jobs if args.jobs is not None else default_jobs())
    print(retrofit_report.text_table(lab))
    print(f"report: {Path(args.out) / 'report.html'}  ({lab['wall_time_s']:.0f}s)")
    return 0


STUDY = Study("retrofit", "Gates added to a trained ungated model: can they remove its sink? Recipes vs a control, "
              "over seeds (sink, skill, gates, streaming loss, learning curves).", _options, _run)
