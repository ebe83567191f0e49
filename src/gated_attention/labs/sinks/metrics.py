"""Pure metric functions of the sink lab, on tensors with known meaning (tests feed hand-built inputs).

Query masks are (B, T) bool over query positions. Attention on a key for a set of queries reuses the analysis
toolkit's `key_attention_from_probs` (per-head mean over the masked queries), so the lab's "BOS attention" is the
same quantity as F-Attn restricted to a query subset.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from gated_attention.analysis.metrics import key_attention_from_probs


def key_attention(probs: torch.Tensor, query_mask: torch.Tensor, key: int = 0) -> list[float | None]:
    """Per-head mean probability on key position `key` over the queries in `query_mask`. probs (B, H, T, S) -> [H].
    None per head when the mask selects no query."""
    if not bool(query_mask.any()):
        return [None] * probs.shape[1]
    return [float(v) for v in key_attention_from_probs(probs, key, query_mask)]


def prev_token_attention(probs: torch.Tensor, query_mask: torch.Tensor) -> list[float | None]:
    """Per-head mean probability query t puts on key t-1, over the queries in `query_mask` (t >= 1; a masked query
    at t = 0 has no previous token and is ignored). probs (B, H, T, S) with S == T -> [H]."""
    diag = torch.diagonal(probs.float(), offset=-1, dim1=2, dim2=3)  # (B, H, T-1): entry t-1 = P(query t -> key t-1)
    w = query_mask[:, 1:].float()[:, None, :]  # (B, 1, T-1)
    n = float(w.sum())
    if n == 0:
        return [None] * probs.shape[1]
    return [float(v) for v in (diag * w).sum(dim=(0, 2)) / n]


def value_drain_ratio(v: torch.Tensor) -> list[float]:
    """Per KV head: ||v_BOS|| / mean_j>=1 ||v_j||, averaged over the batch. v (B, KV, S, D) -> [KV].
    Below 1 = the sink's value is small, so parking attention on it adds little to the output."""
    n = v.float().norm(dim=-1)  # (B, KV, S)
    ratio = n[..., 0] / n[..., 1:].mean(-1).clamp_min(1e-12)  # (B, KV)
    return [float(r) for r in ratio.mean(0)]


def residual_peak_ratio(h: torch.Tensor) -> float:
    """||h_BOS|| / median_j>=1 ||h_j|| of a residual-stream state h (B, T, d), averaged over the batch.
    Far above 1 = a massive activation on the first token."""
    n = h.float().norm(dim=-1)  # (B, T)
    return float((n[:, 0] / n[:, 1:].median(dim=-1).values.clamp_min(1e-12)).mean())


def masked_ce(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> float | None:
    """Mean next-token cross-entropy (nats) over positions in mask. logits (B, T, V), targets/mask (B, T)."""
    if not bool(mask.any()):
        return None
    return float(F.cross_entropy(logits.detach()[mask].float(), targets[mask]))


def gate_by_query(gate: torch.Tensor, query_mask: torch.Tensor) -> list[float | None]:
    """Per-head mean gate score over the queries in `query_mask`. gate (B, T, H, D) or (B, T, H, 1) or (B, T, H)
    -> [H]; the mean runs over the gate's last axis too (elementwise gates give one score per channel)."""
    g = gate.float()
    if g.dim() == 4:
        g = g.mean(-1)  # (B, T, H)
    if not bool(query_mask.any()):
        return [None] * g.shape[-1]
    return [float(x) for x in g[query_mask].mean(0)]


def steps_to_skill(steps: list[int], values: list[float], threshold: float = 0.5) -> int | None:
    """The first step whose value is below `threshold` (None if none is): "time to skill" from a curve of the
    backcopy CE. `values` may hold None/NaN (unmeasured) entries, which never count."""
    for s, v in zip(steps, values):
        if v is not None and math.isfinite(v) and v < threshold:
            return int(s)
    return None


def trailing_mean(values: list[float], window: int) -> list[float]:
    """Trailing mean over `window` entries (NaN entries skipped; NaN while the window holds none)."""
    out, q = [], []
    for v in values:
        q.append(v)
        if len(q) > window:
            q.pop(0)
        ok = [x for x in q if x is not None and math.isfinite(x)]
        out.append(sum(ok) / len(ok) if ok else math.nan)
    return out
