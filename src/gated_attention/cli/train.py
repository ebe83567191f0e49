"""Training commands. `gattn train`: build a TrainConfig from a preset plus typed `--set key=value` overrides and run
the trainer; `gattn eval`: per-domain PPL and loss by position; `gattn sweep`: retired (one line naming its
replacement, `gattn lab stability`).

Works unchanged under `torchrun --nproc_per_node=N` (DDP by default, `--set dist=fsdp` for FSDP2).
"""
from __future__ import annotations

from ..util import errors as E  # argparse types: numbers and paths checked where they enter

import argparse
import json
from pathlib import Path

import torch

from ..util.io import atomic_write_json, check_hf_dir, json_dumps, read_json_object
from ..train.config import TRAIN_PRESETS, TrainConfig, apply_overrides, check_model, config_from_args


def configure_train(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default=None, choices=list(TRAIN_PRESETS),
                        help="training preset (each names a model preset); default: small, or with --resume the "
                             "saved run's settings")
    parser.add_argument("--gate", default=None, help="gate variant name (see `gattn gates`); default: the preset's")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="override a TrainConfig field (e.g. lr=1e-3) or a model field with a model. prefix "
                             "(e.g. model.num_hidden_layers=2); repeatable")
    parser.add_argument("--out", type=E.out_dir, required=True, help="run folder: log.jsonl, checkpoints/, final/, summary.json")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    parser.add_argument("--data-dir", type=E.existing_dir, default=None, help="prepared corpus folder (gattn data prepare)")


def _same(key: str, value):
    """Comparable form of a setting given again with --resume: the canonical gate name, the resolved corpus path."""
    if value is None:
        return None
    if key == "gate":
        from ..gates import canonical_name

        try:
            return canonical_name(value)
        except ValueError:
            return value
    return str(Path(value).resolve())


def run_train(args) -> int:
    from ..train.trainer import train

    resume_cfg = Path(args.out) / "train_config.json"
    if args.resume and not resume_cfg.exists() and not (Path(args.out) / "checkpoints").is_dir():
        raise E.UserError(f"nothing to resume in {args.out} (no train_config.json, no checkpoints); drop --resume to "
                          "start a new run there")
    if args.resume and resume_cfg.exists() and args.preset is None:  # continue with the saved settings
        cfg = TrainConfig.from_dict(read_json_object(resume_cfg, "saved run settings", "restore it or use a new --out"))
        for flag, key, value in (("--gate", "gate", args.gate), ("--data-dir", "data_dir", args.data_dir)):
            if value is not None and _same(key, value) != _same(key, getattr(cfg, key)):  # never silently ignored
                raise E.UserError(f"--resume with {flag} {value} but the saved run has {key}={getattr(cfg, key)!r}; "
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


# ---------------------------------------------------------------- gattn sweep (retired)

SWEEP_RETIRED = ("`gattn sweep` is retired; the stability lab replaces it (gates x LRs, QK-norm on/off, seeds, spikes, "
                 "max stable LR with intervals): gattn lab stability --variants GATE ... --lrs LR ... [--set KEY=VALUE "
                 "...] --out DIR (see `gattn lab stability --help`)")


def configure_sweep(parser: argparse.ArgumentParser) -> None:
    parser.description = SWEEP_RETIRED
    parser.add_argument("args", nargs=argparse.REMAINDER, help="ignored: the command only names its replacement")


def run_sweep(args) -> int:
    raise E.UserError(SWEEP_RETIRED)


# ---------------------------------------------------------------- gattn eval

def configure_eval(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", type=E.existing_dir, help="a training run folder (its final/ model is used) or a save_pretrained folder")
    parser.add_argument("--data-dir", type=E.existing_dir, default=None, help="corpus folder (default: the run's own setting)")
    parser.add_argument("--seq-len", type=E.positive_int, default=None, help="tokens per sequence (default: the run's seq_len)")
    parser.add_argument("--batches", type=E.positive_int, default=8, help="validation batches per domain")
    parser.add_argument("--batch-size", type=E.positive_int, default=8, help="sequences per validation batch")
    parser.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto",
                        help="autocast precision: auto (default: bf16 where this machine runs it faster than fp32, "
                             "measured once; fp32 otherwise), or force bf16 / fp32")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument("--out", type=E.out_file, default=None, help="also write the JSON result to this file (atomically)")


def _position_summary(pos: list[float], points: int = 8) -> list[tuple[int, float]]:
    """Loss averaged over `points` equal position buckets, for the table (the JSON keeps every position)."""
    n = len(pos)
    edges = [round(i * n / points) for i in range(points + 1)]
    return [(edges[i], sum(pos[edges[i]:edges[i + 1]]) / max(1, edges[i + 1] - edges[i]))
            for i in range(points) if edges[i + 1] > edges[i]]


def run_eval(args) -> int:
    import gated_attention  # noqa: F401  (registers the model with the Auto classes)
    from gated_attention.modeling import GatedQwen3ForCausalLM

    from ..train.config import TrainConfig
    from ..train.data_source import make_source
    from ..train.evaluate import domain_losses

    root = Path(args.dir)
    model_dir = root / "final" if (root / "final" / "config.json").exists() else root
    if not (model_dir / "config.json").exists():
        raise FileNotFoundError(f"no model in {root} (expected {root}/final/config.json or {root}/config.json)")
    check_hf_dir(model_dir, "model folder")  # config.json parses, weights present and intact
    cfg_path = root / "train_config.json"
    cfg = (TrainConfig.from_dict(read_json_object(cfg_path, "run settings", "restore it or pass --data-dir"))
           if cfg_path.exists() else TrainConfig())
    if args.data_dir is not None:
        cfg.data_dir, cfg.data = args.data_dir, "corpus"
    seq_len = args.seq_len or cfg.seq_len
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = GatedQwen3ForCausalLM.from_pretrained(model_dir).to(device)
    max_pos = getattr(model.config, "max_position_embeddings", None)
    if max_pos and seq_len > max_pos:
        raise E.UserError(f"--seq-len {seq_len} exceeds the model's max_position_embeddings {max_pos}; lower "
                          "--seq-len (or extend the model first with `gattn extend`)")
    source = make_source(cfg, model.config.vocab_size)
    res = domain_losses(model, source, seq_len=seq_len, max_batches=args.batches, batch_size=args.batch_size,
                        device=device, precision=args.precision, positions=True)
    if not res["losses"]:  # otherwise "Avg PPL nan" and exit 0
        raise E.UserError(f"no validation window of {seq_len} tokens in any domain of the corpus; lower --seq-len")
    from ..util.precision import resolve

    res.update({"model": str(model_dir), "seq_len": seq_len, "batches": args.batches, "batch_size": args.batch_size,
                "resolved_precision": resolve(args.precision, device)})
    if args.out:
        atomic_write_json(args.out, res)
    if args.json:
        print(json_dumps(res, indent=1))  # strict JSON, as the file
        return 0
    print(f"model: {model_dir}   seq_len {seq_len}, {args.batches} x {args.batch_size} sequences per domain")
    print(f"{'domain':<20} {'loss':>8} {'ppl':>10}")
    for d, loss in res["losses"].items():
        print(f"{d:<20} {loss:>8.4f} {res['ppl'][d]:>10.3f}")
    print(f"{'Avg PPL':<20} {'':>8} {res['avg_ppl']:>10.3f}")
    if "pos_loss" in res:
        print("loss by position (bucket start: mean loss):")
        print("  " + "  ".join(f"{p}:{v:.3f}" for p, v in _position_summary(res["pos_loss"])))
    return 0
