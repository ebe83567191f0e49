"""`gattn lab stability`'s declaration: its options (each with its help, here only) and how the command runs the
lab (stability_lab.run_lab); cli/lab.py builds the subcommand from STUDY without importing torch."""
from __future__ import annotations

import sys
from pathlib import Path

from ...experiment.study import Option, Study, options


def _options() -> list[Option]:
    from . import stability_lab as S

    return [
        options.out("runs/lab/stability", "runs/, plots/, lab.json, report.md, report.html; where `gattn compare` "
                    "reads it"),
        options.budget(S.BUDGETS),
        options.variants("gate variants (names from `gattn gates`)", S.DEFAULT_VARIANTS),
        Option(("--lrs",), "peak learning rates of the grid (default: the budget's; default "
               f"{' '.join(f'{x:g}' for x in S.budget_settings('default')['lrs'])})",
               {"nargs": "+", "type": float, "default": None, "metavar": "LR"}),
        Option(("--qk-norm",), "train with QK-norm on, off, or both (default both)",
               {"default": "both", "choices": list(S.QK_SETTINGS)}),
        Option(("--steps",), "optimizer steps per run (default: the budget's; every run sees the same tokens)",
               {"type": int, "default": None}),
        options.seeds(f"seeds per setting (default: the budget's, {S.budget_settings('default')['seeds']} for default); >= 3 "
                      "gives bootstrap intervals worth reading"),
        Option(("--seed-lrs",), "where seeds 1.. run: every LR (all: whole curves per seed, which the intervals need; "
               "the default of every budget but shallow) or only the last stable LR and the first LR past the edge "
               "of each setting, found from seed 0 (edge)", {"default": None, "choices": ("edge", "all")}),
        options.sets("gate, lr, min_lr, seed, steps, data, data_dir and model.use_qk_norm are set by the lab's own "
                     "flags (e.g. --set model.num_hidden_layers=24)"),
        Option(("--data-dir",), "prepared corpus folder (default: the budget's, data_v1k with the 1024-token "
               "vocabulary, prepared automatically if missing)", {"default": None}),
        options.jobs("runs trained in parallel"),
        options.precision("auto", "; lab.json records the resolved precision of every run"),
    ]


def _run(args) -> int:
    from ...experiment.runs import default_jobs
    from . import stability_lab as S
    from .stability_report import sensitivity_text

    lab = S.LabConfig(out=args.out, budget=args.budget, variants=tuple(args.variants),
                      lrs=tuple(args.lrs) if args.lrs else None, qk_norm=args.qk_norm, seeds=args.seeds,
                      seed_lrs=args.seed_lrs, sets=tuple(args.sets),
                      train={k: getattr(args, k) for k in S.TRAIN_FLAGS if getattr(args, k) is not None},
                      jobs=args.jobs if args.jobs is not None else default_jobs())
    res = S.run_lab(lab, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(sensitivity_text(res))
    print(f"report: {Path(args.out) / 'report.html'}  ({res['wall_time_s']:.0f}s, "
          f"{res['cpu_s_runs'] / 60:.1f} core-minutes of training)")
    return 0


STUDY = Study("stability", "LR sweeps of deep narrow models with/without QK-norm (Wortsman et al. 2023 proxies): "
              "loss spikes, divergence, max stable LR, LR sensitivity with intervals over seeds, logit growth.",
              _options, _run)
