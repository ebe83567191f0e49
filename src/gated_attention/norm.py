"""Qwen3 RMSNorm, shared by the decoder (pre-norms, QK-norm) and the per-head RMSNorm gate variant."""
from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """fp32 compute, cast back to the input dtype, then * weight (ones-init, not the zero-centred 1 + w form)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"
