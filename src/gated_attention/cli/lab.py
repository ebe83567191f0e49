"""`gattn lab NAME ...`: the labs' subcommand group, built from each lab's study declaration (`STUDY` in
gated_attention/labs/<name>/study.py: its help line, its options with their help, and how it runs;
experiment/study.py). Adding a lab = its declaration + one name in STUDIES.
"""
from __future__ import annotations

import argparse
import importlib

STUDIES = ("sinks", "streaming", "stability", "scaling", "retrofit", "quant")  # the order `gattn lab --help` lists


def lab_entry(name: str) -> tuple:
    """(configure(parser), run(args), one-line help) of `gattn lab NAME`, from its study declaration."""
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
