"""`gattn settings`: every training setting (the `--set KEY=VALUE` vocabulary of `gattn train`, `gattn plan` and the
labs) with its type, default, allowed values and meaning, as text or JSON (train/settings.py holds the table)."""
from __future__ import annotations

import argparse
import shutil
import textwrap


def configure_settings(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true",
                        help="print a JSON list instead: one object per setting with name, type, default, choices "
                             "(null = any value of the type), meaning and group")


def run_settings(args) -> int:
    from ..train.settings import settings, show
    from ..util.io import json_dumps

    table = settings()
    if args.json:
        print(json_dumps([s.to_dict() for s in table], indent=1))
        return 0
    width = min(100, shutil.get_terminal_size((100, 24)).columns)
    print(textwrap.fill("Training settings: `gattn train --set KEY=VALUE` (repeatable); model-config fields take a "
                        "`model.` prefix (--set model.num_hidden_layers=4). A preset (--preset) changes some "
                        "defaults; `gattn train --dry-run` prints a run's resolved values.", width))
    group = None
    for s in table:
        if s.group != group:
            group = s.group
            print(f"\n{group}")
        allowed = f"; one of {' | '.join(s.choices)}" if s.choices else ""
        print(f"  {s.name} = {show(s.default) or '(empty)'}   ({s.type}{allowed})")
        print(textwrap.fill(s.meaning, width, initial_indent=" " * 6, subsequent_indent=" " * 6))
    return 0
