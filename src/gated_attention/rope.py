"""Rotary position embeddings, computed exactly as HF transformers does for the `rope_parameters` schema.

(Minimal first version: default RoPE only. Owned by the long-context work, which adds linear / dynamic / YaRN.)
"""
from __future__ import annotations

import torch
from torch import nn


def compute_rope_parameters(config, device=None) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention_scaling) for `config.rope_parameters`, as transformers computes them."""
    rp = config.rope_parameters
    rope_type = rp.get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(f"rope_type {rope_type!r} is not supported yet; valid: 'default'")
    base = rp["rope_theta"]
    dim = int(config.head_dim * getattr(config, "partial_rotary_factor", 1.0))
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim))
    return inv_freq, 1.0


class RotaryEmbedding(nn.Module):
    """Model-level RoPE: forward(x, position_ids) -> (cos, sin) of shape (B, T, rotary_dim), in x's dtype."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        inv_freq, self.attention_scaling = compute_rope_parameters(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)  # (B, T, dim/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (B, T, dim)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim: int = 1):
    """Rotate q and k (B, heads, T, D) by cos/sin (B, T, rot); dims beyond `rot` pass through (partial RoPE)."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    rot = cos.shape[-1]
    if rot == q.shape[-1]:
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    q_r, q_p = q[..., :rot], q[..., rot:]
    k_r, k_p = k[..., :rot], k[..., rot:]
    q_r = q_r * cos + rotate_half(q_r) * sin
    k_r = k_r * cos + rotate_half(k_r) * sin
    return torch.cat((q_r, q_p), dim=-1), torch.cat((k_r, k_p), dim=-1)
