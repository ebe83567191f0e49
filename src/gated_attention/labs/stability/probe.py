"""Wortsman et al. (2023) instability proxies, measured on the trainer's own probe forwards.

The trainer runs a no-grad forward in train mode on the step's first micro-batch every `stats_every` steps (to log
max |activation| per layer). `StabilityProbe` rides on exactly that forward: attached to the attention layers'
`capture` slot (capture.py) and to the LM head, it records, per probe,
  - the max attention logit q.k*scale over causal (query, key) pairs, per layer (Wortsman's "attention logit growth":
    without QK-norm the logits grow with the LR until the softmax is one-hot and the loss stalls or diverges);
  - the max |output logit| (Wortsman's "output logit divergence").
Training forwards (grad enabled) and the evaluation forwards (eval mode) are ignored, so the probe costs one extra
matmul per layer every `stats_every` steps and never changes the numbers of the run.
"""
from __future__ import annotations

import copy
import math

import torch
from torch import nn

from ...attention import repeat_kv


def max_attention_logit(q: torch.Tensor, k: torch.Tensor, scale: float) -> float:
    """Largest q.k*scale over the pairs a causal softmax sees. q (B, H, T, D), k (B, KV, S, D) with S >= T
    (the last T keys are the queries' own positions, as with a cache); computed in fp32."""
    n_rep = q.shape[1] // k.shape[1]
    k = repeat_kv(k, n_rep)  # (B, H, S, D)
    logits = torch.matmul(q.float(), k.float().transpose(2, 3)) * scale  # (B, H, T, S)
    t, s = q.shape[2], k.shape[2]
    allowed = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(diagonal=s - t)  # (T, S) causal
    return float(logits.masked_fill(~allowed, float("-inf")).max())


class StabilityProbe:
    """Capture recorder + LM-head hook: per probe forward, the max attention logit per layer and the max |logit|.

    `records` holds one dict per probe forward, in order: {"attn_logit": [per layer], "output_logit": float}.
    The trainer's probes run at steps 0, stats_every, 2*stats_every, ... (after that step's update)."""

    wants_probs = False  # the capture protocol: never force the eager kernel

    def __init__(self, model: nn.Module):
        self.model = model
        self.records: list[dict] = []
        self._pending: dict[int, dict] = {}  # layer -> {"q": ..., "k": ...} until "scale" arrives
        self._current: dict | None = None
        self._handles = []

    def __deepcopy__(self, memo) -> "StabilityProbe":
        """A model copied with its probe attached (the bf16 compute twin of precision bf16-params,
        train/mixed_precision.py) gets a probe of its own that records into the same `records`: the probe forwards run
        on the copy."""
        twin = StabilityProbe.__new__(StabilityProbe)
        memo[id(self)] = twin
        twin.model = copy.deepcopy(self.model, memo)  # the copy of the model being copied (already in memo)
        twin.records, twin._pending, twin._current, twin._handles = self.records, {}, None, []
        return twin

    def active(self) -> bool:
        """True only inside the trainer's stats probe: train mode, no autograd."""
        return self.model.training and not torch.is_grad_enabled()

    def _record(self) -> dict:
        if self._current is None:
            self._current = {"attn_logit": {}, "output_logit": None}
        return self._current

    def __call__(self, layer: int, name: str, value) -> None:
        if not self.active() or name not in ("q", "k", "scale"):
            return
        slot = self._pending.setdefault(layer, {})
        if name != "scale":
            slot[name] = value.detach()
            return
        q, k = slot.pop("q", None), slot.pop("k", None)
        if q is None or k is None:
            return
        found = max_attention_logit(q, k, float(value))
        rec = self._record()["attn_logit"]
        rec[layer] = max(rec.get(layer, -math.inf), found)

    def _head_hook(self, _mod, _inp, out) -> None:
        if not self.active():
            return
        rec = self._record()
        rec["output_logit"] = float(out.detach().float().abs().max())
        # the LM head runs last in a forward: the probe for this step is complete
        layers = sorted(rec["attn_logit"])
        self.records.append({"attn_logit": [rec["attn_logit"][i] for i in layers], "output_logit": rec["output_logit"]})
        self._current = None

    def attach(self) -> "StabilityProbe":
        mods = [m for m in self.model.modules() if hasattr(m, "capture") and not isinstance(m, type)]
        if not mods:
            raise ValueError("StabilityProbe needs a model whose attention layers have a `capture` slot (GatedQwen3)")
        for m in mods:
            m.capture = self
        head = self.model.get_output_embeddings()
        self._handles.append(head.register_forward_hook(self._head_hook))
        return self

    def detach(self) -> None:
        for m in self.model.modules():
            if getattr(m, "capture", None) is self:
                m.capture = None
        for h in self._handles:
            h.remove()
        self._handles = []
