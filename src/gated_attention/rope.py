"""Rotary position embeddings for the HF `rope_parameters` schema: default, linear, dynamic NTK, YaRN, Llama 3 and
LongRoPE (the types transformers' Llama / Mistral / Qwen2 / Qwen3 classes accept).

The numerics follow transformers 5.24 (`modeling_rope_utils.py` + `Qwen3RotaryEmbedding`) operation for operation, so a
checkpoint extended here gives the same logits under transformers' own Qwen3 with the same `rope_parameters`:
  - the order of float ops is kept (e.g. YaRN builds `base ** (arange/dim)` once and divides, dynamic NTK rebuilds the
    base from a tensor `seq_len` inside forward) because a reordering changes the last bit of inv_freq;
  - dynamic NTK recomputes inv_freq inside forward when the sequence grows past the cached length, and resets to the
    original frequencies when a sequence shorter than the original length arrives after growth (HF's
    `dynamic_rope_update`);
  - LongRoPE switches between its short and long factor sets per forward: long when the longest position exceeds
    `original_max_position_embeddings` (HF's `longrope_frequency_update`).
Config input: any object with `rope_parameters` (dict), `head_dim` (or hidden_size/num_attention_heads),
`max_position_embeddings`, optional `partial_rotary_factor` (the dict's key wins, as after HF standardisation).
"""
from __future__ import annotations

import math

import torch
from torch import nn

# Keys each rope_type accepts (HF's validators' required + optional sets). Anything else fails loudly: a typo such as
# "beta-fast" would otherwise silently fall back to a default and change the frequencies.
_REQUIRED = {
    "default": set(),
    "linear": {"factor"},
    "dynamic": {"factor"},
    "yarn": {"factor", "original_max_position_embeddings"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "longrope": {"short_factor", "long_factor", "original_max_position_embeddings"},
}
_OPTIONAL = {
    "default": set(),
    "linear": set(),
    "dynamic": set(),
    "yarn": {"attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"},
    "llama3": set(),
    "longrope": {"attention_factor", "factor"},
}
_COMMON = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
ROPE_TYPES = tuple(_REQUIRED)


def _validated(config) -> dict:
    """The config's rope_parameters, checked: known type, required keys present, no unknown keys, sane numbers."""
    rp = getattr(config, "rope_parameters", None)
    if not isinstance(rp, dict) or not rp:
        raise ValueError(f"config.rope_parameters must be a non-empty dict like {{'rope_type': 'default', "
                         f"'rope_theta': 10000.0}}; got {rp!r}")
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    if rope_type not in _REQUIRED:
        raise ValueError(f"rope_type {rope_type!r} is not supported; valid: {', '.join(ROPE_TYPES)}")
    missing = sorted(_REQUIRED[rope_type] - set(rp))
    if "rope_theta" not in rp:
        missing.append("rope_theta")
    unknown = sorted(set(rp) - _REQUIRED[rope_type] - _OPTIONAL[rope_type] - _COMMON)
    if missing or unknown:
        raise ValueError(
            f"rope_parameters for rope_type={rope_type!r}: missing keys {missing}, unknown keys {unknown}; "
            f"required: {sorted(_REQUIRED[rope_type] | {'rope_theta'})}, optional: {sorted(_OPTIONAL[rope_type])}")
    factor = rp.get("factor")
    if rope_type in ("linear", "dynamic", "llama3") or (rope_type == "yarn" and factor is not None):
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor < 1.0:
            raise ValueError(f"rope_parameters['factor'] must be a number >= 1 (context extension ratio); got {factor!r}")
    theta = rp["rope_theta"]
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 1.0:
        raise ValueError(f"rope_parameters['rope_theta'] must be a number > 1; got {theta!r}")
    return rp


def _rotary_dim(config, rp: dict) -> int:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    prf = rp.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    return int(head_dim * (1.0 if prf is None else prf))


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    # YaRN's attention temperature: sqrt(1/t) = 0.1 ln(s) + 1 (YaRN paper eq. 22); no change when not extending
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(config, rp: dict, dim: int, device) -> tuple[torch.Tensor, float]:
    base = rp["rope_theta"]
    factor = rp["factor"]
    original = rp["original_max_position_embeddings"]
    if factor is None:  # DeepSeek-V3 style: the ratio of the two context lengths
        factor = config.max_position_embeddings / original
    attention_factor = rp.get("attention_factor")
    mscale, mscale_all_dim = rp.get("mscale"), rp.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
        else:
            attention_factor = _yarn_mscale(factor)
    # HF treats 0/None as "use the paper default" (`or`), so do we
    beta_fast = rp.get("beta_fast") or 32
    beta_slow = rp.get("beta_slow") or 1
    truncate = rp.get("truncate", True)

    def correction_dim(n_rot: float) -> float:
        # the rotary dimension whose wavelength fits n_rot times into the original context
        return (dim * math.log(original / (n_rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)  # (dim/2,)
    extrapolation_weight = 1 - ramp.to(device=device, dtype=torch.float)

    pos_freqs = base ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)  # (dim/2,)
    inv_freq_extrapolation = 1.0 / pos_freqs  # high-frequency dims: keep the trained rotation
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)  # low-frequency dims: stretch like linear scaling
    inv_freq = (inv_freq_interpolation * (1 - extrapolation_weight)
                + inv_freq_extrapolation * extrapolation_weight)
    return inv_freq, attention_factor


def compute_rope_parameters(config, device=None, seq_len=None) -> tuple[torch.Tensor, float]:
    """(inv_freq (rotary_dim/2,), attention_scaling) for `config.rope_parameters`, as transformers computes them.

    `seq_len` only matters for dynamic NTK (the current length, int or 0-d tensor; None = max_position_embeddings).
    """
    rp = _validated(config)
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    dim = _rotary_dim(config, rp)
    base = rp["rope_theta"]
    if rope_type == "yarn":
        return _yarn_inv_freq(config, rp, dim, device)
    if rope_type == "longrope":
        return _longrope_inv_freq(config, rp, dim, device, seq_len)
    if rope_type == "dynamic":
        factor, max_pos = rp["factor"], config.max_position_embeddings
        # NTK-aware: grow the base so the lowest frequency spans the current length; never shrink below the original
        if seq_len is None:
            seq_len = max_pos
        elif isinstance(seq_len, torch.Tensor):
            seq_len = torch.maximum(seq_len, torch.tensor(max_pos, dtype=seq_len.dtype, device=seq_len.device))
        else:
            seq_len = max(seq_len, max_pos)
        base = base * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim))
    if rope_type == "linear":
        inv_freq /= rp["factor"]  # dividing frequencies == dividing positions (position interpolation)
    if rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, rp)
    return inv_freq, 1.0


def _llama3_scale(inv_freq: torch.Tensor, rp: dict) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by `factor`, short ones kept, a smooth blend in between."""
    factor, low, high = rp["factor"], rp["low_freq_factor"], rp["high_freq_factor"]
    old_len = rp["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)  # 0 at the low-frequency edge, 1 at the high one
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _longrope_inv_freq(config, rp: dict, dim: int, device, seq_len) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3 style): per-dimension rescale factors, the long set beyond the original context."""
    original = rp["original_max_position_embeddings"]
    factor = rp.get("factor")
    if factor is None:  # Phi-3 stores the extension as the ratio of the two context lengths
        factor = config.max_position_embeddings / original
    attention_factor = rp.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    use_long = bool(seq_len) and seq_len > original
    ext = torch.tensor(rp["long_factor"] if use_long else rp["short_factor"], dtype=torch.float32, device=device)
    if ext.shape != (dim // 2,):
        raise ValueError(f"rope_parameters long_factor/short_factor need rotary_dim/2 = {dim // 2} entries; "
                         f"got {tuple(ext.shape)}")
    shape = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim  # (dim/2,)
    return 1.0 / (ext * rp["rope_theta"] ** shape), attention_factor


class RotaryEmbedding(nn.Module):
    """Model-level RoPE: forward(x, position_ids) -> (cos, sin) of shape (B, T, rotary_dim), in x's dtype."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        rp = _validated(config)
        self.rope_type = rp.get("rope_type", rp.get("type", "default"))
        # dynamic NTK bookkeeping (HF names): the longest length seen so far and the trained length
        self.max_seq_len_cached = config.max_position_embeddings
        self.original_max_seq_len = config.max_position_embeddings
        inv_freq, self.attention_scaling = compute_rope_parameters(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)

    def _dynamic_update(self, position_ids: torch.Tensor, device) -> None:
        seq_len = torch.max(position_ids) + 1  # 0-d int tensor, as HF passes it on to the base formula
        cached = self.max_seq_len_cached
        if seq_len > cached:  # growth: rescale the base for the new length
            inv_freq, self.attention_scaling = compute_rope_parameters(self.config, device, seq_len=seq_len)
            self.register_buffer("inv_freq", inv_freq, persistent=False)
            self.max_seq_len_cached = seq_len
        if seq_len < self.original_max_seq_len and cached > self.original_max_seq_len:
            # back in the trained range: restore the exact trained frequencies (short inputs lose nothing)
            self.original_inv_freq = self.original_inv_freq.to(device)
            self.register_buffer("inv_freq", self.original_inv_freq, persistent=False)
            self.max_seq_len_cached = self.original_max_seq_len

    def _longrope_update(self, position_ids: torch.Tensor, device) -> None:
        original = self.config.rope_parameters["original_max_position_embeddings"]
        if getattr(self, "long_inv_freq", None) is None:
            self.long_inv_freq, _ = compute_rope_parameters(self.config, device, seq_len=original + 1)
        long_inv_freq = self.long_inv_freq.to(device)
        seq_len = torch.max(position_ids) + 1
        inv_freq = torch.where(seq_len > original, long_inv_freq, self.original_inv_freq.to(device))
        self.inv_freq.copy_(inv_freq)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        if self.rope_type == "dynamic":
            self._dynamic_update(position_ids, x.device)
        elif self.rope_type == "longrope":
            self._longrope_update(position_ids, x.device)
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
