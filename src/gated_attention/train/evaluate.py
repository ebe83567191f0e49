"""Held-out evaluation: per-domain loss and perplexity, the paper's "Avg PPL", and a loss-by-position curve.

"Avg PPL" (paper Table 1/2) is the mean over domains of each domain's perplexity, exp(mean token loss in that domain),
not exp of the pooled loss. `gattn eval DIR` prints a table and writes/prints JSON.
"""
from __future__ import annotations

import math
import torch
import torch.nn.functional as F



def autocast_for(device: torch.device, precision: str):
    """Autocast context of a precision ("auto" resolves by measurement: gated_attention.util.precision)."""
    from gated_attention.util.precision import autocast

    return autocast(precision, device)


@torch.no_grad()
def domain_losses(model, source, *, seq_len: int, max_batches: int, batch_size: int, device: torch.device,
                  precision: str = "auto", positions: bool = False) -> dict:
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
