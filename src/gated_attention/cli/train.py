"""Training commands. `gattn train`: build a TrainConfig from a preset plus typed `--set key=value` overrides and run
the trainer; `gattn eval`: per-domain PPL and loss by position.

Works unchanged under `torchrun --nproc_per_node=N` (DDP by default, `--set dist=fsdp` for FSDP2).
"""
from __future__ import annotations

from ..util import errors as E  # argparse types: numbers and paths checked where they enter
from ..util import precision as P

import argparse
import json
from dataclasses import replace

from ..train.train_presets import TRAIN_PRESETS
from ..train.overrides import run_config
from ..util.io import json_dumps


def configure_train(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default=None, choices=list(TRAIN_PRESETS),
                        help="training preset (each names a model preset); default: small, or with --resume the "
                             "saved run's settings")
    parser.add_argument("--gate", default=None, help="gate variant name (see `gattn gates`); default: the preset's")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="override a training setting (e.g. lr=1e-3; `gattn settings` lists every KEY with its "
                             "default, choices and meaning) or a model field with a model. prefix "
                             "(e.g. model.num_hidden_layers=2); repeatable")
    parser.add_argument("--out", type=E.out_dir, required=True, help="run folder: log.jsonl, checkpoints/, final/, summary.json")
    parser.add_argument("--resume", nargs="?", const=True, default=False, choices=["auto"],
                        help="continue from the latest valid checkpoint in --out (an error when there is none); "
                             "`--resume auto`: resume when --out holds a valid checkpoint, else start a new run "
                             "there: one command line for the first launch and every restart (torchrun "
                             "--max-restarts=N)")
    parser.add_argument("--data-dir", type=E.existing_dir, default=None,
                        help="prepared corpus folder (gattn data prepare); giving one trains on it (data=corpus, also "
                             "for the tiny preset, whose default is synthetic data)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the resolved settings and the run's memory and throughput plan (as `gattn plan` "
                             "at this launch's world size, and whether it fits this machine), then stop: nothing is "
                             "trained or written")
    parser.add_argument("--overwrite", action="store_true",
                        help="start the run in --out even when that folder holds other files (it is refused "
                             "otherwise): the run's files replace those of the same names, the rest are kept")


def run_train(args) -> int:
    cfg = run_config(args.out, args.preset, args.gate, args.sets, args.data_dir, args.resume)
    if args.dry_run:
        print(dry_run(cfg, args.preset or ("the saved run" if args.resume else "small")))
        return 0
    from ..train.trainer import train

    summary = train(cfg, args.out, resume=args.resume, overwrite=args.overwrite)
    if summary:
        keys = ("final_loss", "avg_ppl", "spikes", "skipped_steps", "diverged", "tokens", "wall_time_s")
        print(json.dumps({k: summary.get(k) for k in keys}))
    return 1 if summary.get("diverged") else 0


def dry_run(cfg, preset: str) -> str:
    """`gattn train --dry-run`: the resolved settings (`*` where a preset or --set changed the default), the plan at
    this launch's world size with `gattn plan`'s hardware defaults, and the trainer's own fit check on this machine."""
    import os

    import torch

    from ..train.plan import check_fits, format_plan, plan
    from ..train.settings import settings, show

    lines = ["gattn train --dry-run: nothing is trained or written", "settings (* = not the TrainConfig default):"]
    for s in settings():
        value = getattr(cfg, s.name)
        lines.append(f"  {'*' if value != s.default else ' '} {s.name} = {show(value) or '(empty)'}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    lines.append(format_plan(plan(cfg, gpus=world), preset))
    device = torch.device(P.device_type(cfg.device))
    precision = P.resolve(cfg.precision, device, cfg.dist if world > 1 else "none")
    run = replace(cfg)
    run.check_world(world, precision)  # what the trainer does first (micro_batch sets grad_accum for this world)
    try:
        here = check_fits(run, device, world, precision)
        lines.append(f"this machine ({device.type}, {precision}): fits, ~{here.total_gb:.2f} GB per rank of "
                     f"{here.available_gb:.1f} GB available; {here.describe()}")
    except E.UserError as exc:
        lines.append(f"this machine ({device.type}, {precision}): does not fit: {exc}")
    return "\n".join(lines)


# ---------------------------------------------------------------- gattn eval

def configure_eval(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", type=E.existing_dir, help="a training run folder (its final/ model is used) or a save_pretrained folder")
    parser.add_argument("--data-dir", type=E.existing_dir, default=None, help="corpus folder (default: the run's own setting)")
    parser.add_argument("--seq-len", type=E.positive_int, default=None, help="tokens per sequence (default: the run's seq_len)")
    parser.add_argument("--batches", type=E.positive_int, default=8, help="validation batches per domain")
    parser.add_argument("--batch-size", type=E.positive_int, default=8, help="sequences per validation batch")
    P.add_argument(parser, default="auto", what="evaluation numerics")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument("--out", type=E.out_file, default=None, help="also write the JSON result to this file (atomically)")


def _position_summary(pos: list[float], points: int = 8) -> list[tuple[int, float]]:
    """Loss averaged over `points` equal position buckets, for the table (the JSON keeps every position)."""
    n = len(pos)
    edges = [round(i * n / points) for i in range(points + 1)]
    return [(edges[i], sum(pos[edges[i]:edges[i + 1]]) / max(1, edges[i + 1] - edges[i]))
            for i in range(points) if edges[i + 1] > edges[i]]


def run_eval(args) -> int:
    from ..train.evaluate import evaluate_folder

    res = evaluate_folder(args.dir, args.data_dir, args.seq_len, args.batches, args.batch_size, args.precision,
                          args.out)
    if args.json:
        print(json_dumps(res, indent=1))  # strict JSON, as the file
        return 0
    print(f"model: {res['model']}   seq_len {res['seq_len']}, {args.batches} x {args.batch_size} sequences per domain")
    print(f"{'domain':<20} {'loss':>8} {'ppl':>10}")
    for d, loss in res["losses"].items():
        print(f"{d:<20} {loss:>8.4f} {res['ppl'][d]:>10.3f}")
    print(f"{'Avg PPL':<20} {'':>8} {res['avg_ppl']:>10.3f}")
    if "pos_loss" in res:
        print("loss by position (bucket start: mean loss):")
        print("  " + "  ".join(f"{p}:{v:.3f}" for p, v in _position_summary(res["pos_loss"])))
    return 0
