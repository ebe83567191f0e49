"""`gattn lab scaling`'s declaration: its options (each with its help, here only) and how the command runs the lab
(scaling_lab.run_lab, or its --plan / --recipe-pilot / --report-only); cli/lab.py builds the subcommand from STUDY
without importing torch."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ...experiment.study import Option, Study, options


def _options() -> list[Option]:
    from . import scaling_lab as sl

    return [
        Option(("--out",), "output folder: runs/<variant>_<size>_lr<lr>_s<seed>/ (trainer run folders with final/ and "
               "result.json), plots/, lab.json, report.md, report.html (default runs/lab/scaling; a re-run reuses "
               "finished units and resumes interrupted ones)", {"default": "runs/lab/scaling"}),
        options.budget(sl.BUDGETS),
        Option(("--variants",), "gate variants, baseline included (default: " + " ".join(sl.DEFAULT_VARIANTS) + ")",
               {"nargs": "+", "default": list(sl.DEFAULT_VARIANTS), "metavar": "NAME"}),
        Option(("--tokens-per-param",), "training tokens per non-embedding parameter of the ungated model at every "
               "size (default: the budget's; 20, Chinchilla's ratio, for default and gpu)",
               {"type": float, "default": None}),
        Option(("--protocol",), "shared-lr (default, the paper's): every arm trains at the baseline's tuned LR; "
               "tuned: every variant is swept and trains at its own best LR (the LR-tolerance question)",
               {"default": "shared-lr", "choices": list(sl.PROTOCOLS)}),
        Option(("--tuning-seeds",), "seeds of the LR sweep (default 0); they pick LRs and never count in a verdict",
               {"nargs": "+", "type": int, "default": [0], "metavar": "SEED"}),
        Option(("--confirm-seeds",), "seeds that measure Δ, in the order they run, the pilot first (default: fresh "
               f"seeds {sl.CONFIRM_FROM}, {sl.CONFIRM_FROM + 1}, ...; never a tuning seed)",
               {"nargs": "+", "type": int, "default": None, "metavar": "SEED"}),
        Option(("--pilot-pairs",), "confirm pairs every size runs before the design is registered; their within-arm "
               "spread (blind to Δ) plans the rest (default: the budget's, 4 for default)",
               {"type": int, "default": None}),
        Option(("--max-pairs",), "the most confirm pairs a size may plan (default: the budget's, 10 for default); "
               "past it the verdict says what the budget could not decide", {"type": int, "default": None}),
        options.seeds("a fixed number of confirm pairs at every size instead of the planned one (>= 2)"),
        Option(("--accept-code-change",), "reuse units trained by another version of the training code (counted "
               "in lab.json provenance); without it such a unit stops the lab with one line",
               {"action": "store_true"}),
        Option(("--lrs",), "the tuning sweep's LRs (default: the budget's, spaced x2); the sweep is extended past an "
               "edge while the best LR sits on it", {"nargs": "+", "type": float, "default": None, "metavar": "LR"}),
        Option(("--sizes",), "train only these rungs of the budget's ladder (names as --plan prints them, e.g. "
               "d48l2; default: all; the loss-vs-compute fit needs 3)",
               {"nargs": "+", "default": None, "metavar": "NAME"}),
        Option(("--heldout",), "plain-text files never trained on: every run's loss on them (heldout_loss)",
               {"nargs": "+", "default": [], "metavar": "PATH"}),
        Option(("--set",), "training overrides for every unit, as in `gattn train --set` (e.g. --set beta2=0.99); "
               "gate, lr, min_lr, seed, steps, data, data_dir, precision and model.* are the lab's",
               {"dest": "sets", "action": "append", "default": [], "metavar": "KEY=VALUE"}),
        Option(("--data-dir",), "prepared corpus folder (default: data_v1k, the 1024-token-vocabulary corpus, "
               "prepared automatically if missing)", {"default": None}),
        Option(("--jobs",), "units trained in parallel, one thread each (default: one per core, at most 2)",
               {"type": int, "default": None}),
        Option(("--plan",), "print the ladder (parameters, tokens, FLOPs per size and the units' total FLOPs) and "
               "exit without training", {"action": "store_true"}),
        Option(("--recipe",), "train every unit under this change of the base recipe (default: the budget's; "
               "default and gpu: init-fan-in, adopted by the recipe pilot; quick: current): "
               + "; ".join(f"{k}: {r.help}" for k, r in sl.RECIPES.items()).replace("%", "%%"),
               {"default": None, "choices": list(sl.RECIPES)}),
        Option(("--recipe-pilot",), "instead of the ladder: train every arm at this size under each candidate "
               "recipe (beta2 0.99, 10 %% warm-up, fan-in init, batch x2) on pilot seeds 200, 201, ... and adopt one "
               "only if it halves the within-arm spread of the final loss (blind to Δ); writes "
               "OUT/recipe_pilot.json", {"default": None, "metavar": "SIZE"}),
        options.precision("fp32", "; fp32 by default: the same numbers on either CPU kind"),
        options.report_only("train nothing: render report.md, report.html and plots/ again from OUT/lab.json"),
    ]


def _run(args: argparse.Namespace) -> int:
    from ...experiment.runs import default_jobs
    from . import scaling_lab as sl
    from . import scaling_report

    if args.report_only:
        res = sl.report_only(args.out)
        print(scaling_report.text_table(res))
        print(f"report: {Path(args.out) / 'report.html'}")
        return 0
    given = {k: tuple(v) if isinstance(v, list) else v for k, v in vars(args).items() if k in sl.STORED}
    lab = sl.LabConfig().changed(**{**given, "jobs": args.jobs if args.jobs is not None else default_jobs()}).validate()
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    if args.plan:
        print(sl.plan_text(lab))
        return 0
    if args.recipe_pilot:
        from . import recipe_pilot as rp

        res = sl.recipe_pilot(lab, args.recipe_pilot, log=log)
        print(rp.text_table(res))
        print(f"written: {Path(args.out) / 'recipe_pilot.json'}  ({res['cpu_s'] / 60:.1f} core-minutes in units)")
        return 0
    res = sl.run_lab(lab, log=log)
    print(scaling_report.text_table(res))
    print(f"report: {Path(args.out) / 'report.html'}  ({res['wall_time_s']:.0f}s, "
          f"{res['cpu_s_runs'] / 60:.1f} core-minutes in units)")
    return 0


STUDY = Study("scaling", "A ladder of model sizes, every variant at its own best LR, over seeds: Δ loss at equal "
              "parameters against the paper's 0.0128 nats, loss-vs-compute fits, LR basins, Δ along training.",
              _options, _run)
