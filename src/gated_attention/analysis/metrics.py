"""Pure metric functions on tensors, plus small running reducers, for the paper's analyses (paper map §5, §10 item 10).

Everything here is model-agnostic: functions take attention probabilities, activations or gate scores and return numbers.
Running reducers (`RunningStats`, `LogHistogram`) let the analysis stream over many batches without keeping tensors:
long sequences and many batches cost the same memory as one chunk.

Definitions (paper / Gu et al. 2024):
  F-Attn      attention probability on key position 0, averaged over batch, heads and all (valid) queries of a layer;
              the mean over layers is the headline number (baseline 0.467 vs gated 0.048 in Table 4).
  Sink_k^eps  share of heads whose mean attention to key k, over the queries that can see key k, exceeds eps (0.3).
  M-Act       max |value| of a layer's output hidden state over tokens and channels; mean over layers is the headline.
  Gate score  mean sigma over all gate entries, tokens and layers; sparsity = fraction of |Y| below 1e-2 / 1e-3.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

SPARSITY_THRESHOLDS = (1e-2, 1e-3)


def key_attention_from_probs(probs: torch.Tensor, key: int = 0, query_mask: torch.Tensor | None = None,
                             causal: bool = True) -> torch.Tensor:
    """Per-head mean attention to `key` over the queries that can see it. probs (B, H, T, S) -> (H,).

    With `causal`, query i sees key j only when j <= i + (S - T) (a cache offset when S > T), so queries before `key`
    are excluded (for key 0 every query counts). `query_mask` (B, T) bool drops padded queries.
    """
    B, H, T, S = probs.shape
    col = probs[..., key].float()  # (B, H, T)
    valid = torch.ones(B, T, dtype=torch.bool, device=probs.device)
    if causal:
        valid &= (torch.arange(T, device=probs.device) + (S - T) >= key)[None, :]
    if query_mask is not None:
        valid &= query_mask.bool()
    w = valid[:, None, :].float()  # (B, 1, T)
    return (col * w).sum(dim=(0, 2)) / w.sum(dim=(0, 2)).clamp_min(1)


def first_token_attention(probs: torch.Tensor, query_mask: torch.Tensor | None = None) -> float:
    """F-Attn of one layer from its (B, H, T, S) probability map: mean probability on key 0 over batch, heads, queries."""
    return float(key_attention_from_probs(probs, 0, query_mask).mean())


def sink_rate(per_head_key_attention: torch.Tensor, eps: float = 0.3) -> float:
    """Sink_k^eps: share of heads (any shape; all entries count) whose mean attention to key k exceeds eps."""
    return float((per_head_key_attention > eps).float().mean())


def uniform_first_token_attention(T: int, causal: bool = True) -> float:
    """F-Attn that uniform attention would give: causal query i spreads over i+1 keys, so the mean of 1/(i+1)."""
    if not causal:
        return 1.0 / T
    return float(sum(1.0 / (i + 1) for i in range(T)) / T)


def nanmax(a: float, b: float) -> float:
    """max() that propagates NaN (Python's max(0.0, nan) is 0.0: a NaN activation would vanish from M-Act)."""
    return math.nan if (a != a or b != b) else max(a, b)


def nanmin(a: float, b: float) -> float:
    return math.nan if (a != a or b != b) else min(a, b)


def max_abs(x: torch.Tensor) -> float:
    """M-Act of one tensor: max |value| over every token and channel."""
    return float(x.detach().abs().max())


def fraction_below(x: torch.Tensor, threshold: float) -> float:
    """Sparsity: share of entries with |x| < threshold."""
    return float((x.detach().abs() < threshold).float().mean())


def loss_by_position(logits: torch.Tensor, input_ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Next-token cross-entropy averaged over the batch at each position. logits (B, T, V), ids (B, T) -> (T-1,).

    Entry t is the loss of predicting token t+1 from tokens 0..t (HF's shifted-labels convention).
    """
    ce = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), input_ids[:, 1:], reduction="none")  # (B, T-1)
    if mask is None:
        return ce.mean(0)
    w = mask[:, 1:].float()
    return (ce * w).sum(0) / w.sum(0).clamp_min(1)


class RunningStats:
    """Streaming count/mean/std/min/max, overall and per slot along one axis (e.g. per head).

    `update(x, dim)` reduces x over every axis except `dim` (the slot axis); dim=None tracks only the overall numbers.
    Sums are kept in float64 so a mean over millions of entries stays exact to print precision.
    """

    def __init__(self):
        self.n = 0
        self.sum = 0.0
        self.sumsq = 0.0
        self.min = math.inf
        self.max = -math.inf
        self.slot_n = self.slot_sum = self.slot_sumsq = self.slot_min = self.slot_max = None

    def update(self, x: torch.Tensor, dim: int | None = None) -> None:
        x = x.detach().double()
        self.n += x.numel()
        self.sum += float(x.sum())
        self.sumsq += float((x * x).sum())
        self.min = nanmin(self.min, float(x.min()))
        self.max = nanmax(self.max, float(x.max()))
        if dim is None:
            return
        s = x.movedim(dim, 0).flatten(1)  # (slots, rest)
        n = torch.full((s.shape[0],), s.shape[1], dtype=torch.float64)
        parts = (n, s.sum(1).cpu(), (s * s).sum(1).cpu(), s.amin(1).cpu(), s.amax(1).cpu())
        if self.slot_n is None:
            self.slot_n, self.slot_sum, self.slot_sumsq, self.slot_min, self.slot_max = parts
        else:
            self.slot_n = self.slot_n + parts[0]
            self.slot_sum = self.slot_sum + parts[1]
            self.slot_sumsq = self.slot_sumsq + parts[2]
            self.slot_min = torch.minimum(self.slot_min, parts[3])
            self.slot_max = torch.maximum(self.slot_max, parts[4])

    @property
    def mean(self) -> float | None:
        return self.sum / self.n if self.n else None

    @property
    def std(self) -> float | None:
        if not self.n:
            return None
        return math.sqrt(max(self.sumsq / self.n - (self.sum / self.n) ** 2, 0.0))

    def per_slot(self) -> dict[str, list[float]] | None:
        if self.slot_n is None:
            return None
        mean = self.slot_sum / self.slot_n
        std = (self.slot_sumsq / self.slot_n - mean ** 2).clamp_min(0).sqrt()
        return {"mean": mean.tolist(), "std": std.tolist(), "min": self.slot_min.tolist(), "max": self.slot_max.tolist()}


class Histogram:
    """Fixed-bin streaming histogram on [lo, hi] (values outside are clamped into the end bins)."""

    def __init__(self, lo: float = 0.0, hi: float = 1.0, bins: int = 50):
        self.lo, self.hi, self.bins = lo, hi, bins
        self.counts = torch.zeros(bins, dtype=torch.float64)

    def update(self, x: torch.Tensor) -> None:
        x = x.detach().float().flatten().clamp(self.lo, self.hi)
        self.counts += torch.histc(x, bins=self.bins, min=self.lo, max=self.hi).double().cpu()

    def to_dict(self) -> dict:
        edges = torch.linspace(self.lo, self.hi, self.bins + 1)
        return {"edges": [round(float(e), 6) for e in edges], "counts": [int(c) for c in self.counts]}


class LogHistogram:
    """Streaming histogram of |x| on log-spaced bins, to read "fraction of |x| below t" for any t after the fact.

    Used for the "pre-gate output x mean gate" sparsity: the mean gate is only known at the end, and
    |y * m| < t  <=>  |y| < t / m, so the fraction is read at t / m with linear interpolation inside one bin
    (100 bins per decade: the threshold is resolved to ~2.3 %).
    """

    def __init__(self, lo_exp: int = -12, hi_exp: int = 6, per_decade: int = 100):
        self.lo_exp, self.hi_exp, self.per_decade = lo_exp, hi_exp, per_decade
        nb = (hi_exp - lo_exp) * per_decade
        self.counts = torch.zeros(nb + 2, dtype=torch.float64)  # + underflow (incl. exact zeros) and overflow bins
        self.n = 0

    def update(self, x: torch.Tensor) -> None:
        a = x.detach().float().abs().flatten()
        self.n += a.numel()
        pos = (torch.log10(a.clamp_min(1e-30)) - self.lo_exp) * self.per_decade  # fractional bin index
        idx = (pos.floor().long() + 1).clamp(0, self.counts.numel() - 1)
        self.counts += torch.bincount(idx, minlength=self.counts.numel()).double().cpu()

    def fraction_below(self, t: float) -> float | None:
        if not self.n:
            return None
        if t <= 0:
            return 0.0
        pos = (math.log10(t) - self.lo_exp) * self.per_decade
        nb = self.counts.numel() - 2
        if pos <= 0:
            return float(self.counts[0]) / self.n
        if pos >= nb:
            return float(self.counts[:-1].sum()) / self.n
        i = int(pos)
        below = float(self.counts[: i + 1].sum()) + float(self.counts[i + 1]) * (pos - i)
        return below / self.n
