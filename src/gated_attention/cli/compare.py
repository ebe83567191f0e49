"""`gattn compare`: train the baseline and gated variants, analyse them, write the Table-4 style report."""
from __future__ import annotations

from ..util import errors as E  # argparse types: numbers and paths checked where they enter

import argparse
import sys
from pathlib import Path

from ..compare import job as compare
from ..compare import claims, compare_report

DEFAULT_EVIDENCE = {"--stability-lab": "runs/lab/stability", "--longctx": "runs/longctx",
                    "--scaling-lab": "runs/lab/scaling"}  # may be absent


def configure_compare(parser: argparse.ArgumentParser) -> None:
    corpora = {}
    for name, b in compare.BUDGETS.items():
        corpora.setdefault((b.data_dir, b.vocab_size), []).append(name)
    parser.add_argument("--data-dir", type=E.out_dir, default=None,
                        help="corpus folder; a folder without a prepared corpus (missing, or no manifest.json) is "
                             "prepared there first with the budget's vocabulary (default: the budget's: "
                             + "; ".join(f"{d} (vocabulary {v}) for {', '.join(n)}"
                                         for (d, v), n in corpora.items()) + ")")
    parser.add_argument("--large-sources", action="store_true",
                        help="train on the default sources plus the opt-in large Debian ones (kernel_doc, gcide: "
                             "~100 MB more text; GATTN_LARGE_SOURCES=1 scripts/install_debian_deps.sh), prepared in "
                             "<the budget's data dir>_large unless --data-dir is given; for --budget long and the "
                             "sink-emergence curve, which are data-bound")
    parser.add_argument("--out", type=E.out_dir, default="runs/compare",
                        help="output folder: runs/<variant>/, plots/, compare.json, report.md, report.html "
                             "(default runs/compare; a re-run reuses finished runs)")
    parser.add_argument("--budget", default="default", choices=list(compare.BUDGETS),
                        help="; ".join(f"{k}: {v.help}" for k, v in compare.BUDGETS.items()))
    parser.add_argument("--variants", nargs="+", default=list(compare.DEFAULT_VARIANTS), metavar="NAME",
                        help=f"gate variants to train, first one is the reference (default: {' '.join(compare.DEFAULT_VARIANTS)}; "
                             "names from `gattn gates`)")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="override a training setting for every variant (e.g. steps=3000, lr=1e-2, "
                             "model.num_hidden_layers=6); repeatable")
    parser.add_argument("--sink-lab", action=argparse.BooleanOptionalAction, default=True,
                        help="also run `gattn lab sinks` (Bigram-Backcopy) on the same variants into OUT/sink_lab "
                             "and report it (default on, with the budget's sink-lab settings: "
                             + "; ".join(f"{k}: lab budget {b.sink_lab}, seeds={b.sink_lab_seeds}"
                                         for k, b in compare.BUDGETS.items()) + "; --no-sink-lab skips it)")
    parser.add_argument("--sink-lab-seeds", type=E.positive_int, default=None, metavar="N",
                        help="seeds of that sink lab (default: the budget's, see --sink-lab)")
    parser.add_argument("--streaming", action=argparse.BooleanOptionalAction, default=True,
                        help="also run `gattn lab streaming` on this run's models and the sink lab's (window = a "
                             "quarter of the training length, K = 0 and 4 sink tokens, 16 held-out sequences per "
                             "model) into OUT/streaming; fills the claims row 'Streams with a plain window' "
                             "(default on; --no-streaming skips it)")
    parser.add_argument("--stability-lab", default=None, metavar="DIR",
                        help="a `gattn lab stability` output whose lab.json fills the claims table's stability row "
                             f"(default {DEFAULT_EVIDENCE['--stability-lab']}, 'not run here' when absent; a DIR "
                             "given here must hold a lab.json, else the command stops before training, exit 2)")
    parser.add_argument("--seeds", type=E.positive_int, default=None, metavar="N",
                        help="seeds 0..N-1 of every LM variant (paired: the same batches per seed), for the "
                             "perplexity row's interval (default: the budget's; "
                             + ", ".join(f"{k}: {b.seeds}" for k, b in compare.BUDGETS.items()) + ")")
    parser.add_argument("--scaling-lab", default=None, metavar="DIR",
                        help="a `gattn lab scaling` output whose verdict (tuned LRs, 20 tokens/param, seeds) decides "
                             f"the perplexity row (default {DEFAULT_EVIDENCE['--scaling-lab']}; absent: the row's "
                             "verdict is this run's own; a DIR given here must hold a lab.json, else exit 2)")
    parser.add_argument("--longctx", default=None, metavar="DIR",
                        help="a `gattn longctx` output whose report.json \"claim\" fills the long-context row "
                             f"(default {DEFAULT_EVIDENCE['--longctx']}, 'not run here' when absent; a DIR given here "
                             "must hold such a report.json, else exit 2 before training)")
    parser.add_argument("--report-only", action="store_true",
                        help="train nothing: rebuild the claims table (today's rules, the evidence folders given "
                             "here), the plots whose data OUT/compare.json holds, report.md and report.html from "
                             "OUT/compare.json alone (compare.json keeps its measurements and gets the new claims)")
    parser.add_argument("--jobs", type=int, default=None,
                        help="models trained at once, each in its own process with cores/N threads: the LM variants "
                             "and the sink lab's models, longest first (default: min(2, available cores); measured: "
                             "two at a time with one thread each is 1.15-1.2x faster than one at a time with two "
                             "threads on a 2-core machine); 1 = one after another in this process")


def run_compare(args) -> int:
    for flag, attr in (("--stability-lab", "stability_lab"), ("--longctx", "longctx"),
                       ("--scaling-lab", "scaling_lab")):
        if getattr(args, attr) is None:
            setattr(args, attr, DEFAULT_EVIDENCE[flag])
        else:
            claims.require_evidence(flag, getattr(args, attr))
    if args.report_only:
        res = compare_report.rerender(args.out, args.stability_lab, args.longctx, args.scaling_lab)
        print(compare_report.render_table(res))
        print(f"report: {Path(args.out) / 'report.html'}")
        return 0
    res = compare.run_compare(args.out, args.data_dir, args.budget, args.variants, args.sets,
                              log=lambda m: print(m, file=sys.stderr, flush=True), sink_lab=args.sink_lab,
                              stability_lab=args.stability_lab, longctx=args.longctx, jobs=args.jobs,
                              streaming=args.streaming, large_sources=args.large_sources,
                              sink_lab_changes={"seeds": args.sink_lab_seeds} if args.sink_lab_seeds else None,
                              seeds=args.seeds, scaling_lab=args.scaling_lab)
    print(compare_report.render_table(res))
    print(f"report: {Path(args.out) / 'report.html'}  ({res['wall_time_s']:.0f}s)")
    return 1 if any(r.get("diverged") for r in res["rows"].values()) else 0
