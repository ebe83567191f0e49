"""Held-out evaluation: per-domain loss and perplexity, the paper's "Avg PPL", and a loss-by-position curve.

"Avg PPL" (paper Table 1/2) is the mean over domains of each domain's perplexity, exp(mean token loss in that domain),
not exp of the pooled loss. `gattn eval DIR` prints a table and writes/prints JSON.
"""
from __future__ import annotations

import argparse
import json
import math
import os
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F

from ..io import atomic_write_json, json_dumps


def autocast_for(device: torch.device, precision: str):
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return nullcontext()


@torch.no_grad()
def domain_losses(model, source, *, seq_len: int, max_batches: int, batch_size: int, device: torch.device,
                  precision: str = "bf16", positions: bool = False) -> dict:
    """{"losses": {domain: mean nats/token}, "ppl": {...}, "avg_ppl", "pos_loss": [T] (if positions)}."""
    was_training = model.training
    model.eval()
    losses, ppl = {}, {}
    pos_sum = torch.zeros(seq_len, dtype=torch.float64)
    pos_count = 0
    for domain in source.domains:
        total, count = 0.0, 0
        for batch in source.eval_batches(domain, seq_len, max_batches, batch_size):
            batch = batch.to(device)  # (B, T+1)
            x, y = batch[:, :-1], batch[:, 1:]  # (B, T) each
            with autocast_for(device, precision):
                logits = model(input_ids=x).logits  # (B, T, V)
            ce = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none").view_as(y)  # (B, T)
            total += float(ce.double().sum())
            count += ce.numel()
            if positions:
                pos_sum[: ce.shape[1]] += ce.double().sum(0).cpu()
                pos_count += ce.shape[0]
        if count == 0:
            continue
        losses[domain] = total / count
        ppl[domain] = math.exp(min(losses[domain], 700.0))
    model.train(was_training)
    out = {"losses": losses, "ppl": ppl, "avg_ppl": sum(ppl.values()) / len(ppl) if ppl else float("nan")}
    if positions and pos_count:
        out["pos_loss"] = (pos_sum / pos_count).tolist()
    return out


# ---------------------------------------------------------------- gattn eval

def configure(parser: argparse.ArgumentParser) -> None:
    from gated_attention import errors as E  # argparse types: numbers/paths checked where they enter

    parser.add_argument("dir", type=E.existing_dir, help="a training run folder (its final/ model is used) or a save_pretrained folder")
    parser.add_argument("--data-dir", type=E.existing_dir, default=None, help="corpus folder (default: the run's own setting)")
    parser.add_argument("--seq-len", type=E.positive_int, default=None, help="tokens per sequence (default: the run's seq_len)")
    parser.add_argument("--batches", type=E.positive_int, default=8, help="validation batches per domain")
    parser.add_argument("--batch-size", type=E.positive_int, default=8, help="sequences per validation batch")
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16", help="autocast precision")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument("--out", type=E.out_file, default=None, help="also write the JSON result to this file (atomically)")


def _position_summary(pos: list[float], points: int = 8) -> list[tuple[int, float]]:
    """Loss averaged over `points` equal position buckets, for the table (the JSON keeps every position)."""
    n = len(pos)
    edges = [round(i * n / points) for i in range(points + 1)]
    return [(edges[i], sum(pos[edges[i]:edges[i + 1]]) / max(1, edges[i + 1] - edges[i]))
            for i in range(points) if edges[i + 1] > edges[i]]


def run(args) -> int:
    import gated_attention  # noqa: F401  (registers the model with the Auto classes)
    from gated_attention.modeling import GatedQwen3ForCausalLM

    from .config import TrainConfig
    from .data_source import make_source

    root = Path(args.dir)
    model_dir = root / "final" if (root / "final" / "config.json").exists() else root
    if not (model_dir / "config.json").exists():
        raise FileNotFoundError(f"no model in {root} (expected {root}/final/config.json or {root}/config.json)")
    from ..io import check_hf_dir, read_json_object

    check_hf_dir(model_dir, "model folder")
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
        from ..errors import UserError

        raise UserError(f"--seq-len {seq_len} exceeds the model's max_position_embeddings {max_pos}; lower --seq-len "
                        "(or extend the model first with `gattn extend`)")
    source = make_source(cfg, model.config.vocab_size)
    res = domain_losses(model, source, seq_len=seq_len, max_batches=args.batches, batch_size=args.batch_size,
                        device=device, precision=args.precision, positions=True)
    if not res["losses"]:  # otherwise "Avg PPL nan" and exit 0
        from ..errors import UserError

        raise UserError(f"no validation window of {seq_len} tokens in any domain of the corpus; lower --seq-len")
    res.update({"model": str(model_dir), "seq_len": seq_len, "batches": args.batches, "batch_size": args.batch_size})
    if args.out:
        atomic_write_json(args.out, res)
    if args.json:
        print(json_dumps(res, indent=1))
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
