"""Capturing intermediates (gate scores, SDPA output before/after the gate, q/k) without changing results.

Every attention layer has a `capture` attribute (None by default). Set it to a `Recorder` and the layer calls
`recorder(layer_idx, name, tensor)` at fixed points of its forward pass. Capturing never changes the forward's
results. The tensors are passed as they are, with their autograd graph: `Recorder` (what the analysis uses) detaches
them and decides what to keep (e.g. a running statistic instead of the full tensor, so long sequences stay cheap); a
recorder that keeps the graph (the retrofit lab's `GradTap`) can put them in a loss and backpropagate through them.

Names emitted by the attention layer (shapes with B=batch, T=query length, S=key length):
  "q"          (B, H, T, D)   queries after QK-norm and RoPE (scaled by nothing)
  "k"          (B, KV, S, D)  keys after QK-norm and RoPE, including cached keys
  "v"          (B, KV, S, D)  values the kernel mixes (after any G2 gate), including cached values
  "scale"      python float   the softmax scale used
  "y_pre_gate" (B, T, H, D)   per-head SDPA output before the G1 gate / transform
  "gate"       (B, T, H, D) or (B, T, H, 1)  gate score sigma(XW) actually multiplied (G1/G2/G3/G4) or (B, T, d) for G5
  "y_post_gate"(B, T, H, D)   per-head SDPA output after the gate (what o_proj sees)
  "attn_probs" (B, H, T, S)   only from the eager backend, only when the recorder asks for it (wants_probs=True)
The decoder layer emits "attn_output", "attn_residual", "ffn_output", "ffn_residual" (B, T, d).
"""
from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager
from typing import Callable, Iterable

import torch
from torch import nn


class Recorder:
    """Keeps every captured tensor (or the names it is asked for), keyed by (layer, name)."""

    wants_probs = False

    def __init__(self, names: Iterable[str] | None = None, wants_probs: bool = False, to_cpu: bool = True):
        self.names = set(names) if names is not None else None
        self.wants_probs = wants_probs
        self.to_cpu = to_cpu
        self.data: dict[tuple[int, str], list] = defaultdict(list)

    def wants(self, name: str) -> bool:
        return self.names is None or name in self.names

    def __call__(self, layer: int, name: str, value) -> None:
        if not self.wants(name):
            return
        if isinstance(value, torch.Tensor):
            value = value.detach()
            if self.to_cpu:
                value = value.cpu()
        self.data[(layer, name)].append(value)

    def get(self, layer: int, name: str):
        vals = self.data.get((layer, name), [])
        return vals[-1] if vals else None


@contextmanager
def capture(model: nn.Module, recorder: Callable):
    """Attach `recorder` to every module with a `capture` attribute for the duration of the block."""
    mods = [m for m in model.modules() if hasattr(m, "capture") and not isinstance(m, type)]
    old = [m.capture for m in mods]
    for m in mods:
        m.capture = recorder
    try:
        yield recorder
    finally:
        for m, o in zip(mods, old):
            m.capture = o
