"""Training commands. `gattn train`: build a TrainConfig from a preset plus typed `--set key=value` overrides and run
the trainer; `gattn sweep`: gates x learning rates, tabulated; `gattn eval`: per-domain PPL and loss by position.

Works unchanged under `torchrun --nproc_per_node=N` (DDP by default, `--set dist=fsdp` for FSDP2).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ..io import atomic_write_json
from ..train.config import TRAIN_PRESETS, TrainConfig, apply_overrides, config_from_args


def configure_train(parser: argparse.ArgumentParser) -> None:
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


def run_train(args) -> int:
    from ..train.trainer import train

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


# ---------------------------------------------------------------- gattn sweep

def configure_sweep(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="small-stress", choices=list(TRAIN_PRESETS), help="training preset")
    parser.add_argument("--gates", nargs="+", default=["baseline", "sdpa_elementwise"], help="gate variants to compare")
    parser.add_argument("--lrs", nargs="+", type=float, required=True, help="peak learning rates to try")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="TrainConfig / model.* overrides applied to every run; repeatable")
    parser.add_argument("--out", required=True, help="sweep folder: one sub-folder per run, results.md, results.json")
    parser.add_argument("--data-dir", default=None, help="prepared corpus folder")


def run_sweep(args) -> int:
    from ..train.sweep import sweep, table

    rows = sweep(args.preset, args.gates, args.lrs, args.out, args.sets, args.data_dir)
    print(table(rows), end="")
    return 0


# ---------------------------------------------------------------- gattn eval

def configure_eval(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", help="a training run folder (its final/ model is used) or a save_pretrained folder")
    parser.add_argument("--data-dir", default=None, help="corpus folder (default: the run's own setting)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the run's seq_len)")
    parser.add_argument("--batches", type=int, default=8, help="validation batches per domain")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per validation batch")
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16", help="autocast precision")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument("--out", default=None, help="also write the JSON result to this file (atomically)")


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
    cfg_path = root / "train_config.json"
    cfg = TrainConfig.from_dict(json.loads(cfg_path.read_text())) if cfg_path.exists() else TrainConfig()
    if args.data_dir is not None:
        cfg.data_dir, cfg.data = args.data_dir, "corpus"
    seq_len = args.seq_len or cfg.seq_len
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = GatedQwen3ForCausalLM.from_pretrained(model_dir).to(device)
    source = make_source(cfg, model.config.vocab_size)
    res = domain_losses(model, source, seq_len=seq_len, max_batches=args.batches, batch_size=args.batch_size,
                        device=device, precision=args.precision, positions=True)
    res.update({"model": str(model_dir), "seq_len": seq_len, "batches": args.batches, "batch_size": args.batch_size})
    if args.out:
        atomic_write_json(args.out, res)
    if args.json:
        print(json.dumps(res, indent=1))
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
