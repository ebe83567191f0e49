"""`gattn lab NAME ...`: the labs' subcommand group, built from each lab's study declaration (`STUDY` in
gated_attention/labs/<name>/study.py: its help line, its options with their help, and how it runs;
experiment/study.py). Adding a lab = its declaration + one name in STUDIES. The scaling lab's options are still
written here by hand.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from ..experiment.runs import default_jobs
from ..util import precision as P

STUDIES = ("sinks", "streaming", "stability", "scaling", "retrofit", "quant")  # the order `gattn lab --help` lists


def configure_scaling(parser: argparse.ArgumentParser) -> None:
    from ..labs.scaling import scaling_lab as sl

    parser.add_argument("--out", default="runs/lab/scaling",
                        help="output folder: runs/<variant>_<size>_lr<lr>_s<seed>/ (trainer run folders with "
                             "final/ and result.json), plots/, lab.json, report.md, report.html (default "
                             "runs/lab/scaling; a re-run reuses finished units and resumes interrupted ones)")
    parser.add_argument("--budget", default="default", choices=list(sl.BUDGETS),
                        help="; ".join(f"{k}: {v.help}" for k, v in sl.BUDGETS.items()) + " (default: default)")
    parser.add_argument("--variants", nargs="+", default=list(sl.DEFAULT_VARIANTS), metavar="NAME",
                        help="gate variants, baseline included (default: " + " ".join(sl.DEFAULT_VARIANTS) + ")")
    parser.add_argument("--tokens-per-param", type=float, default=None,
                        help="training tokens per non-embedding parameter of the ungated model at every size "
                             "(default: the budget's; 20, Chinchilla's ratio, for default and gpu)")
    parser.add_argument("--protocol", default="shared-lr", choices=list(sl.PROTOCOLS),
                        help="shared-lr (default, the paper's): every arm trains at the baseline's tuned LR; tuned: "
                             "every variant is swept and trains at its own best LR (the LR-tolerance question)")
    parser.add_argument("--tuning-seeds", nargs="+", type=int, default=[0], metavar="SEED",
                        help="seeds of the LR sweep (default 0); they pick LRs and never count in a verdict")
    parser.add_argument("--confirm-seeds", nargs="+", type=int, default=None, metavar="SEED",
                        help="seeds that measure Δ, in the order they run, the pilot first (default: fresh seeds "
                             f"{sl.CONFIRM_FROM}, {sl.CONFIRM_FROM + 1}, ...; never a tuning seed)")
    parser.add_argument("--pilot-pairs", type=int, default=None,
                        help="confirm pairs every size runs before the design is registered; their within-arm "
                             "spread (blind to Δ) plans the rest (default: the budget's, 4 for default)")
    parser.add_argument("--max-pairs", type=int, default=None,
                        help="the most confirm pairs a size may plan (default: the budget's, 10 for default); past "
                             "it the verdict says what the budget could not decide")
    parser.add_argument("--seeds", type=int, default=None,
                        help="a fixed number of confirm pairs at every size instead of the planned one (>= 2)")
    parser.add_argument("--accept-code-change", action="store_true",
                        help="reuse units trained by another version of the training code (counted in lab.json "
                             "provenance); without it such a unit stops the lab with one line")
    parser.add_argument("--lrs", nargs="+", type=float, default=None, metavar="LR",
                        help="the tuning sweep's LRs (default: the budget's, spaced x2); the sweep is extended past "
                             "an edge while the best LR sits on it")
    parser.add_argument("--sizes", nargs="+", default=None, metavar="NAME",
                        help="train only these rungs of the budget's ladder (names as --plan prints them, e.g. "
                             "d48l2; default: all; the loss-vs-compute fit needs 3)")
    parser.add_argument("--heldout", nargs="+", default=[], metavar="PATH",
                        help="plain-text files never trained on: every run's loss on them (heldout_loss)")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="training overrides for every unit, as in `gattn train --set` (e.g. --set beta2=0.99); "
                             "gate, lr, min_lr, seed, steps, data, data_dir, precision and model.* are the lab's")
    parser.add_argument("--data-dir", default=None,
                        help="prepared corpus folder (default: data_v1k, the 1024-token-vocabulary corpus, "
                             "prepared automatically if missing)")
    parser.add_argument("--jobs", type=int, default=None,
                        help="units trained in parallel, one thread each (default: one per core, at most 2)")
    parser.add_argument("--plan", action="store_true",
                        help="print the ladder (parameters, tokens, FLOPs per size and the units' total FLOPs) "
                             "and exit without training")
    parser.add_argument("--recipe", default=None, choices=list(sl.RECIPES),
                        help="train every unit under this change of the base recipe (default: the budget's; "
                             "default and gpu: init-fan-in, adopted by the recipe pilot; quick: current): "
                             + "; ".join(f"{k}: {r.help}" for k, r in sl.RECIPES.items()).replace("%", "%%"))
    parser.add_argument("--recipe-pilot", default=None, metavar="SIZE",
                        help="instead of the ladder: train every arm at this size under each candidate recipe "
                             "(beta2 0.99, 10 %% warm-up, fan-in init, batch x2) on pilot seeds 200, 201, ... and "
                             "adopt one only if it halves the within-arm spread of the final loss (blind to Δ); "
                             "writes OUT/recipe_pilot.json")
    P.add_argument(parser, default="fp32", note="; fp32 by default: the same numbers on either CPU kind")


def run_scaling(args) -> int:
    from ..labs.scaling import scaling_lab as sl
    from ..labs.scaling import scaling_report

    lab = sl.LabConfig(out=args.out, budget=args.budget, variants=tuple(args.variants), seeds=args.seeds,
                       tuning_seeds=tuple(args.tuning_seeds), protocol=args.protocol,
                       confirm_seeds=tuple(args.confirm_seeds) if args.confirm_seeds else None,
                       pilot_pairs=args.pilot_pairs, max_pairs=args.max_pairs,
                       accept_code_change=args.accept_code_change,
                       tokens_per_param=args.tokens_per_param, lrs=tuple(args.lrs) if args.lrs else None,
                       heldout=tuple(args.heldout), sets=tuple(args.sets), data_dir=args.data_dir,
                       sizes=tuple(args.sizes) if args.sizes else None,
                       precision=args.precision, recipe=args.recipe,
                       jobs=args.jobs if args.jobs is not None else default_jobs()).validate()
    if args.plan:
        print(sl.plan_text(lab))
        return 0
    if args.recipe_pilot:
        from ..labs.scaling import recipe_pilot as rp

        res = sl.recipe_pilot(lab, args.recipe_pilot, log=lambda m: print(m, file=sys.stderr, flush=True))
        print(rp.text_table(res))
        print(f"written: {Path(args.out) / 'recipe_pilot.json'}  ({res['cpu_s'] / 60:.1f} core-minutes in units)")
        return 0
    res = sl.run_lab(lab, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(scaling_report.text_table(res))
    print(f"report: {Path(args.out) / 'report.html'}  ({res['wall_time_s']:.0f}s, "
          f"{res['cpu_s_runs'] / 60:.1f} core-minutes in units)")
    return 0


SCALING_HELP = ("A ladder of model sizes, every variant at its own best LR, over seeds: Δ loss at equal parameters "
                "against the paper's 0.0128 nats, loss-vs-compute fits, LR basins, Δ along training.")


def lab_entry(name: str) -> tuple:
    """(configure(parser), run(args), one-line help) of `gattn lab NAME`, from its study declaration."""
    if name == "scaling":
        return configure_scaling, run_scaling, SCALING_HELP
    study = importlib.import_module(f"gated_attention.labs.{name}.study").STUDY
    return study.configure, study.run, study.help


LABS = {name: lab_entry(name) for name in STUDIES}  # name -> (configure, run, help)


def configure_lab(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Science labs: small controlled experiments that show one effect of gated attention, "
                          "measured over seeds, with lab.json, report.md, report.html and plots.")
    sub = parser.add_subparsers(dest="lab", metavar="LAB", required=True)
    for name, (configure, _, help_text) in LABS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        configure(p)


def run_lab(args) -> int:
    return int(LABS[args.lab][1](args) or 0)
