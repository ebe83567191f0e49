"""Typed `--set key=value` overrides of a TrainConfig, and a command's training settings from its arguments (a preset,
a gate, a corpus folder, `--set`s; with `--resume`, the saved run's own settings).

Model-config fields are overridden with a `model.` prefix (`model.num_hidden_layers=4`) and stored in
`model_overrides`.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import types
import typing
from dataclasses import replace

from ..util.errors import FALSE_WORDS, TRUE_WORDS
from .config import TrainConfig
from .train_presets import train_preset


def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in TRUE_WORDS:
        return True
    if low in FALSE_WORDS:
        return False
    raise ValueError(f"expected a boolean (true/false), got {text!r}")


def _convert(text: str, tp, key: str):
    """Convert `text` to the annotated type `tp` (str | None, list[int], ...)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if text.strip().lower() in ("none", "null") and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(text, inner[0], key)
    if origin is list:
        if text.strip().startswith("["):
            items = json.loads(text)
        else:
            items = [t for t in text.split(",") if t.strip()]
        return [_convert(str(i), args[0] if args else str, key) for i in items]
    if origin is dict or tp is dict:
        val = json.loads(text)
        if not isinstance(val, dict):
            raise ValueError(f"{key}: expected a JSON object")
        return val
    if tp is bool:
        return _parse_bool(text)
    if tp is int:
        return int(float(text)) if ("e" in text.lower() and float(text).is_integer()) else int(text)
    if tp is float:
        return float(text)
    return text


def _convert_like(text: str, current, key: str):
    """Model-config values: convert to the type of the current value; JSON for anything structured."""
    if isinstance(current, bool):
        return _parse_bool(text)
    if isinstance(current, int):
        return int(text)
    if isinstance(current, float):
        return float(text)
    if isinstance(current, str):
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def apply_overrides(cfg: TrainConfig, sets: list[str], model_fields: dict | None = None) -> TrainConfig:
    """Apply `key=value` strings. `model.KEY=V` goes to model_overrides, checked against `model_fields`
    (name -> current value of the model config) when given."""
    hints = typing.get_type_hints(TrainConfig)
    names = [f.name for f in dataclasses.fields(TrainConfig)]
    changes: dict = {}
    model_over = dict(cfg.model_overrides)
    for item in sets:
        if "=" not in item:
            raise ValueError(f"--set {item!r}: expected key=value")
        key, text = item.split("=", 1)
        key = key.strip()
        if key.startswith("model."):
            mkey = key[len("model."):]
            if model_fields is not None and mkey not in model_fields:
                raise ValueError(f"--set {key}: unknown model-config field {mkey!r}; valid: "
                                 f"{', '.join(sorted(k for k in model_fields if not k.startswith('_')))}")
            try:
                model_over[mkey] = _convert_like(text, (model_fields or {}).get(mkey), key)
            except ValueError as exc:
                raise ValueError(f"--set {key}={text!r}: {exc}; give a value of the field's type") from None
            continue
        if key not in names or key == "model_overrides":
            valid = [n for n in names if n != "model_overrides"]
            close = difflib.get_close_matches(key, valid, n=1)
            hint = f"did you mean `{close[0]}`? " if close else ""
            raise ValueError(f"--set {key}: unknown training setting; {hint}valid: {', '.join(valid)} (`gattn "
                             "settings` explains each; model-config fields take a 'model.' prefix)")
        try:
            changes[key] = _convert(text, hints[key], key)
        except (ValueError, json.JSONDecodeError) as exc:
            raise ValueError(f"--set {key}={text!r}: {exc}") from None
    return replace(cfg, model_overrides=model_over, **changes).validate()


def config_from_args(preset: str, gate: str | None, sets: list[str], data_dir: str | None,
                     world: int | None = None) -> TrainConfig:
    """A training preset with a gate, a corpus folder and `--set key=value` overrides (model.* keys checked). A
    preset that takes the recommended layout (train_presets.RECOMMENDED_LAYOUT) gets the plan's fastest for `world`
    ranks (default: torchrun's WORLD_SIZE), the layout settings given with --set held fixed."""
    cfg = train_preset(preset)
    if gate is not None:
        cfg.gate = gate
    if data_dir is not None:
        # a corpus folder given means training on it: the `tiny` preset's synthetic data would otherwise ignore it
        cfg.data_dir, cfg.data = data_dir, "corpus" if cfg.data == "synthetic" else cfg.data
    from gated_attention.presets import model_config

    cfg = apply_overrides(cfg, sets, model_config(cfg.model, gate=cfg.gate).to_dict())
    if data_dir is not None and cfg.data == "synthetic":
        raise ValueError(f"--data-dir {data_dir} with --set data=synthetic: synthetic data reads no corpus; drop one")
    check_model(cfg)
    from .train_presets import RECOMMENDED_LAYOUT

    if preset in RECOMMENDED_LAYOUT:
        cfg = _launch_layout(cfg, sets, world)
    return cfg


def _launch_layout(cfg: TrainConfig, sets: list[str], world: int | None) -> TrainConfig:
    """The recommended layout at this launch (train.recommend.launch_layout), said on stderr by rank 0."""
    import os
    import sys

    from .recommend import launch_layout

    world = world if world is not None else int(os.environ.get("WORLD_SIZE", "1"))
    keys = tuple(item.split("=", 1)[0].strip() for item in sets)
    import torch

    # planned for the GPUs these presets are made for: this machine's GPU memory where it has one, else the plan's
    cuda = cfg.device in ("cuda", "auto") and torch.cuda.is_available()
    memory = torch.cuda.get_device_properties(0).total_memory / 1e9 if cuda else None
    cfg, line = launch_layout(cfg, world, keys, gpu_memory_gb=memory)
    if line and os.environ.get("RANK", "0") == "0":
        print(f"gattn train: {line}", file=sys.stderr, flush=True)
    return cfg



def run_config(out: str, preset: str | None = None, gate: str | None = None, sets: list[str] = (),
               data_dir: str | None = None, resume: bool | str = False) -> TrainConfig:
    """The settings of `gattn train --out OUT [--resume [auto]]`. With resume and no preset: the saved run's own
    settings (OUT/train_config.json) plus `sets`, where a gate or corpus given again must be the saved one (never
    silently ignored). Otherwise the preset's (default `small`) with `gate`, `data_dir` and `sets`. resume="auto"
    is resume where OUT holds a saved run and a new run elsewhere (no error). The trainer then checks a resumed run's
    settings against its checkpoint (changed_settings)."""
    from pathlib import Path

    from ..util.errors import UserError
    from .checkpoint import check_layout, saved_settings

    folder = Path(out)
    if resume and folder.is_dir():
        check_layout(folder)
    # train_config.json, or where it is missing or damaged the settings in the newest intact checkpoint
    saved = saved_settings(folder) if resume and folder.is_dir() else None
    if resume == "auto":
        resume = saved is not None
    if resume and saved is None and not (folder / "checkpoints").is_dir():
        raise UserError(f"nothing to resume in {out} (no train_config.json, no checkpoints); drop --resume to start "
                        "a new run there")
    if not (resume and saved is not None and preset is None):
        return config_from_args(preset or "small", gate, list(sets), data_dir)
    cfg = TrainConfig.from_dict(saved)
    for flag, key, value in (("--gate", "gate", gate), ("--data-dir", "data_dir", data_dir)):
        if value is not None and _comparable(key, value) != _comparable(key, getattr(cfg, key)):
            raise UserError(f"--resume with {flag} {value} but the saved run has {key}={getattr(cfg, key)!r}; drop "
                            f"{flag} (or pass the saved value) or start a new --out")
    cfg = apply_overrides(cfg, list(sets))
    check_model(cfg)
    return cfg


def _comparable(key: str, value):
    """A setting given again with --resume, in the form it is compared in: the canonical gate name, the resolved
    corpus path."""
    from pathlib import Path

    if value is None:
        return None
    if key == "gate":
        from gated_attention.gates import canonical_name

        try:
            return canonical_name(value)
        except ValueError:
            return value
    return str(Path(value).resolve())


def check_model(cfg: TrainConfig) -> None:
    """Build the model config now (cheap), so a bad model.* override fails before anything is written."""
    if cfg.init_from:  # the checkpoint's config.json decides (checked against the run when loaded): a model folder?
        from ..util.io import check_hf_dir

        check_hf_dir(cfg.init_from, "init_from")
        return
    from gated_attention.presets import model_config

    from ..util.errors import UserError

    from .parallel_dims import ParallelDims

    try:
        config = model_config(cfg.model, gate=cfg.gate, ffn_multiple=cfg.ffn_multiple or None, **cfg.model_overrides)
    except ValueError as exc:  # the model config names its field; the line names what the user typed
        named = [k for k in cfg.model_overrides if k in str(exc)]
        if not named:
            raise
        raise UserError(f"--set model.{named[0]}: {exc}") from None
    ParallelDims.of(cfg, num_experts=config.num_experts or 0)  # E must give each rank whole experts
