"""Memory-light, backend-agnostic attention-sink measurement from queries and keys (no T x T map for all heads).

The probability that query i puts on key j is exp(q_i.k_j * scale - LSE_i), where LSE_i is the log-sum-exp of query i's
logits over the keys it may see. Both terms come from one (chunk x S) block of logits at a time, chunked over queries,
so peak extra memory is about `chunk_bytes` whatever the sequence length: a 16k-token sequence with 16 heads needs
16 * 16384 * 4 bytes = 1 MiB per query row, i.e. 256 query rows per 256 MiB chunk. The result equals what an eager
softmax map would give (tests check it), and it works for whatever backend (sdpa, eager, flash) ran the model, because
it only needs q, k, the scale and the mask.

Masks follow the HF attention-interface conventions: None (then `causal` decides), a bool mask (True = may attend) or
an additive float mask, broadcastable to (B, H, T, S). GQA keys (B, KV, S, D) are shared by H // KV query heads.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

DEFAULT_CHUNK_BYTES = 256 * 2**20  # why: keeps one logits block well under the 2 GiB budget for 16k tokens


def _query_chunk(B: int, H: int, S: int, chunk_bytes: int) -> int:
    # several fp32 (B, H, tc, S) temporaries live at once (logits, mask, exp); budget for 4 of them
    return max(1, int(chunk_bytes // (4 * 4 * B * H * max(S, 1))))


def _chunk_logits(q: torch.Tensor, k: torch.Tensor, scale: float, t0: int, t1: int, mask, causal: bool,
                  softcap: float | None) -> torch.Tensor:
    """Masked fp32 logits of queries t0:t1 against all keys: (B, H, tc, S), -inf where a key is not visible."""
    B, H, T, D = q.shape
    KV, S = k.shape[1], k.shape[2]
    G = H // KV
    qc = q[:, :, t0:t1].float().reshape(B, KV, G, t1 - t0, D)  # (B, KV, G, tc, D)
    logits = torch.einsum("bkgtd,bksd->bkgts", qc, k.float()) * scale  # (B, KV, G, tc, S)
    logits = logits.reshape(B, H, t1 - t0, S)  # (B, H, tc, S)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    if mask is not None:
        m = mask[..., t0:t1, :] if mask.shape[-2] == T else mask  # (B|1, H|1, tc|1, S)
        if m.dtype == torch.bool:
            logits = logits.masked_fill(~m, float("-inf"))
        else:
            logits = logits + m.float()
            logits = logits.masked_fill(m.float() <= torch.finfo(m.dtype).min / 2, float("-inf"))
    elif causal:
        qpos = torch.arange(t0, t1, device=q.device)[:, None] + (S - T)  # cache offset when S > T
        logits = logits.masked_fill(torch.arange(S, device=q.device)[None, :] > qpos, float("-inf"))
    return logits


def key_probs_chunked(q: torch.Tensor, k: torch.Tensor, scale: float, keys=(0,), mask=None, causal: bool = True,
                      softcap: float | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES):
    """Attention probability of every query on the given key positions, without materialising the full map.

    q (B, H, T, D), k (B, KV, S, D) -> (probs (B, H, T, len(keys)), visible (B, H, T, len(keys)) bool,
    n_visible (B, H, T) number of keys each query may see). Fully masked rows get probability 0.
    """
    B, H, T, _ = q.shape
    S = k.shape[2]
    keys = list(keys)
    tc = _query_chunk(B, H, S, chunk_bytes)
    probs, visible, n_vis = [], [], []
    for t0 in range(0, T, tc):
        t1 = min(T, t0 + tc)
        logits = _chunk_logits(q, k, scale, t0, t1, mask, causal, softcap)  # (B, H, tc, S)
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # (B, H, tc, 1)
        sel = logits[..., keys]  # (B, H, tc, K)
        p = torch.exp(sel - lse)
        probs.append(torch.nan_to_num(p, nan=0.0))
        visible.append(torch.isfinite(sel))
        n_vis.append(torch.isfinite(logits).sum(-1))
        del logits
    return torch.cat(probs, 2), torch.cat(visible, 2), torch.cat(n_vis, 2)


def head_mean_map(q: torch.Tensor, k: torch.Tensor, scale: float, n: int, mask=None, causal: bool = True,
                  softcap: float | None = None) -> torch.Tensor:
    """Head-averaged attention map of batch element 0 for its first n queries and keys: (n, n).

    For causal attention this is exact (the first n queries only see the first n keys); for an encoder it shows
    the first n columns of rows normalised over all keys.
    """
    n = min(n, q.shape[2], k.shape[2])
    m = None if mask is None else mask[:1]
    logits = _chunk_logits(q[:1], k[:1], scale, 0, n, m, causal, softcap)  # (1, H, n, S)
    return torch.nan_to_num(torch.softmax(logits, -1), nan=0.0)[0, :, :, :n].mean(0)  # (n, n)


@dataclass
class SinkAccumulator:
    """Streams per-layer, per-head attention mass on chosen keys over many batches.

    add(layer, probs, visible, n_visible, query_mask) adds one batch; results give, per layer, the mean probability on
    each key over the (batch, query) pairs that can see it, per head, and the uniform-attention reference.
    """

    keys: tuple = (0,)
    sums: dict = field(default_factory=dict)  # layer -> (H, K) float64
    counts: dict = field(default_factory=dict)  # layer -> (H, K)
    uniform: dict = field(default_factory=dict)  # layer -> [sum over valid queries of 1/n_visible, count]

    def add(self, layer: int, probs: torch.Tensor, visible: torch.Tensor, n_visible: torch.Tensor,
            query_mask: torch.Tensor | None = None) -> None:
        w = visible.double()  # (B, H, T, K)
        if query_mask is not None:
            w = w * query_mask.to(w.device)[:, None, :, None].double()
        s = (probs.double() * w).sum(dim=(0, 2)).cpu()  # (H, K)
        c = w.sum(dim=(0, 2)).cpu()
        self.sums[layer] = self.sums.get(layer, 0) + s
        self.counts[layer] = self.counts.get(layer, 0) + c
        w0 = w[..., 0]  # (B, H, T): queries that see key keys[0]
        u = (w0 / n_visible.double().clamp_min(1)).sum()
        prev = self.uniform.get(layer, [0.0, 0.0])
        self.uniform[layer] = [prev[0] + float(u), prev[1] + float(w0.sum())]

    def per_head(self, layer: int, key_index: int = 0) -> torch.Tensor:
        """(H,) mean probability on keys[key_index] per head of `layer`."""
        return (self.sums[layer][:, key_index] / self.counts[layer][:, key_index].clamp_min(1)).float()

    def uniform_reference(self, layer: int) -> float:
        u, n = self.uniform[layer]
        return u / max(n, 1)
