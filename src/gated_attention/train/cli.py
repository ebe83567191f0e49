"""`gattn train`: build a TrainConfig from a preset plus typed `--set key=value` overrides and run the trainer.

Works unchanged under `torchrun --nproc_per_node=N` (DDP by default, `--set dist=fsdp` for FSDP2).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..errors import UserError, out_dir
from .config import TRAIN_PRESETS, TrainConfig, apply_overrides, train_preset


def configure(parser: argparse.ArgumentParser) -> None:
    from gated_attention import errors as E  # argparse types: numbers/paths checked where they enter

    parser.add_argument("--preset", default=None, choices=list(TRAIN_PRESETS),
                        help="training preset (each names a model preset); default: small, or with --resume the "
                             "saved run's settings")
    parser.add_argument("--gate", default=None, help="gate variant name (see `gattn gates`); default: the preset's")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="override a TrainConfig field (e.g. lr=1e-3) or a model field with a model. prefix "
                             "(e.g. model.num_hidden_layers=2); repeatable")
    parser.add_argument("--out", required=True, type=out_dir, help="run folder: log.jsonl, checkpoints/, final/, summary.json")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    parser.add_argument("--data-dir", type=E.existing_dir, default=None, help="prepared corpus folder (gattn data prepare)")


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
    cfg = apply_overrides(cfg, sets, model_fields)
    check_model(cfg)
    return cfg


def check_model(cfg: TrainConfig) -> None:
    """Build the model config now (cheap), so a bad model.* override fails before anything is written."""
    if cfg.init_from:
        return  # the checkpoint's config.json decides; checked when it is loaded
    try:
        from gated_attention.presets import model_config
    except ImportError:
        return
    model_config(cfg.model, gate=cfg.gate, **cfg.model_overrides)


def _same(key: str, value):
    """Comparable form of a resumable setting: the canonical gate name, the resolved corpus path."""
    if value is None:
        return None
    if key == "gate":
        from gated_attention.gates import canonical_name

        try:
            return canonical_name(value)
        except (KeyError, ValueError):
            return value
    return str(Path(value).resolve())


def run(args) -> int:
    from .trainer import train

    resume_cfg = Path(args.out) / "train_config.json"
    if args.resume and not resume_cfg.exists() and not (Path(args.out) / "checkpoints").is_dir():
        raise UserError(f"nothing to resume in {args.out} (no train_config.json, no checkpoints); drop --resume to "
                        "start a new run there")
    if args.resume and resume_cfg.exists() and args.preset is None:  # continue with the saved settings
        from ..io import read_json_object

        cfg = TrainConfig.from_dict(read_json_object(resume_cfg, "saved run settings", "restore it or use a new --out"))
        for flag, key, value in (("--gate", "gate", args.gate), ("--data-dir", "data_dir", args.data_dir)):
            if value is not None and _same(key, value) != _same(key, getattr(cfg, key)):  # never silently ignored
                raise UserError(f"--resume with {flag} {value} but the saved run has {key}={getattr(cfg, key)!r}; "
                                f"drop {flag} (or pass the saved value) or start a new --out")
        cfg = apply_overrides(cfg, args.sets)
        check_model(cfg)
    else:
        cfg = config_from_args(args.preset or "small", args.gate, args.sets, args.data_dir)
    summary = train(cfg, args.out, resume=args.resume)
    if summary:
        keys = ("final_loss", "avg_ppl", "spikes", "skipped_steps", "diverged", "tokens", "wall_time_s")
        print(json.dumps({k: summary.get(k) for k in keys}))
    return 1 if summary.get("diverged") else 0
