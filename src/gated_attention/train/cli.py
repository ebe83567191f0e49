"""`gattn train`: build a TrainConfig from a preset plus typed `--set key=value` overrides and run the trainer.

Works unchanged under `torchrun --nproc_per_node=N` (DDP by default, `--set dist=fsdp` for FSDP2).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from .config import TRAIN_PRESETS, TrainConfig, apply_overrides, train_preset


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default=None, choices=list(TRAIN_PRESETS),
                        help="training preset (each names a model preset); default: small, or with --resume the "
                             "saved run's settings")
    parser.add_argument("--gate", default=None, help="gate variant name (see `gattn gates`); default: the preset's")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="override a TrainConfig field (e.g. lr=1e-3) or a model field with a model. prefix "
                             "(e.g. model.num_hidden_layers=2); repeatable")
    parser.add_argument("--out", required=True, help="run folder: log.jsonl, checkpoints/, final/, summary.json")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    parser.add_argument("--data-dir", default=None, help="prepared corpus folder (gattn data prepare)")


def config_from_args(preset: str, gate: str | None, sets: list[str], data_dir: str | None) -> TrainConfig:
    cfg = train_preset(preset)
    if gate is not None:
        cfg.gate = gate
    if data_dir is not None:
        cfg.data_dir = data_dir
    model_fields = None
    try:
        from gated_attention.presets import model_config

        model_fields = model_config(cfg.model, gate=cfg.gate).to_dict()
    except ImportError:  # model package incomplete: accept model.* keys unchecked
        pass
    return apply_overrides(cfg, sets, model_fields)


def run(args) -> int:
    from .trainer import train

    resume_cfg = Path(args.out) / "train_config.json"
    if args.resume and resume_cfg.exists() and args.preset is None:  # continue with the saved settings
        cfg = TrainConfig.from_dict(json.loads(resume_cfg.read_text()))
        cfg = apply_overrides(cfg, args.sets)
    else:
        cfg = config_from_args(args.preset or "small", args.gate, args.sets, args.data_dir)
    summary = train(cfg, args.out, resume=args.resume)
    if summary:
        keys = ("final_loss", "avg_ppl", "spikes", "skipped_steps", "diverged", "tokens", "wall_time_s")
        print(json.dumps({k: summary.get(k) for k in keys}))
    return 1 if summary.get("diverged") else 0
