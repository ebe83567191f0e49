"""`gattn lab NAME ...`: the labs' subcommand group, a thin table over the lab modules.

Each entry names a module with `configure(parser)` and `run(args) -> int`, like the top-level table in
gated_attention/cli.py. Adding a lab = one row here + configure/run in its module.
"""
from __future__ import annotations

import argparse
import importlib

# name -> (module, one-line help)
LABS: dict[str, tuple[str, str]] = {
    "sinks": ("gated_attention.labs.sinks",
              "Bigram-Backcopy sink lab (Guo et al. 2024): BOS attention of idle heads, baseline vs gates, in minutes."),
    "stability": ("gated_attention.labs.stability",
                  "LR sweeps with/without QK-norm (Wortsman et al. 2023 proxies): loss, spikes, logit growth, LR "
                  "sensitivity."),
}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Science labs: small controlled experiments that show one effect of gated attention, "
                          "measured over seeds, with lab.json, report.md, report.html and plots.")
    sub = parser.add_subparsers(dest="lab", metavar="LAB", required=True)
    for name, (module, help_text) in LABS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        mod = importlib.import_module(module)  # lab modules import torch lazily, so this stays cheap
        mod.configure(p)
        p.set_defaults(_lab_module=module)


def run(args) -> int:
    return int(importlib.import_module(args._lab_module).run(args) or 0)
