"""Quantization schemes as fake-quant (quantize, then dequantize back to fp32) of a weight and, for W8A8, of the
activations — the numbers a deployment computes with, on any CPU. Every scheme's math is torchao's (0.18, the `quant`
extra); only AWQ's scale search is written here (torchao's AWQ is a calibration flow around its own int4 kernels),
and it quantizes with torchao's int4 primitive.

  int8-weight   per output row, symmetric int8 (torchao choose/quantize/dequantize_affine, block (1, in))
  w8a8-tensor   weight: ONE symmetric int8 scale for the whole tensor; activation: one dynamic scale per call
  w8a8-row      weight per output row; activation per token (row) — torchao's Int8DynamicActivationInt8Weight math
  int4-weight   group-wise asymmetric uint4, groups of GROUP (128, or the row when shorter) along the input dim
  nvfp4         FP4 E2M1 in blocks of 16 with an FP8 E4M3 block scale and an fp32 per-tensor scale (NVFP4Tensor)
  mxfp4         FP4 E2M1 in blocks of 32 with a power-of-two E8M0 block scale (MX, to_mx / to_dtype)
  awq-int4      int4-weight after AWQ's activation-aware scaling: W diag(s) quantized, the input divided by s,
                s = mean|x|^alpha per input channel, alpha from a grid minimising the output error on calibration x
"""
from __future__ import annotations

# torch is imported inside the functions: the scheme names (`gattn lab quant`'s options) load without it

SCHEMES = ("int8-weight", "w8a8-tensor", "w8a8-row", "int4-weight", "nvfp4", "mxfp4", "awq-int4")
GROUP = 128  # int4 group size along the input dim (torchao's default)
AWQ_GRID = 20  # alpha in {0, 1/20, ..., 19/20} (AWQ's grid)


def _affine(w: torch.Tensor, block: tuple[int, int], bits: int, symmetric: bool) -> torch.Tensor:
    import torch

    from torchao.quantization.quant_primitives import (MappingType, choose_qparams_affine, dequantize_affine,
                                                       quantize_affine)

    if symmetric:
        mt, qmin, qmax, dtype = MappingType.SYMMETRIC, -(2 ** (bits - 1)) + 1, 2 ** (bits - 1) - 1, torch.int8
    else:
        mt, qmin, qmax, dtype = MappingType.ASYMMETRIC, 0, 2 ** bits - 1, torch.uint8
    scale, zero = choose_qparams_affine(w, mt, block, dtype, qmin, qmax, eps=torch.finfo(torch.float32).eps,
                                        scale_dtype=torch.float32, zero_point_dtype=torch.int32)
    q = quantize_affine(w, block, scale, zero, dtype, qmin, qmax)
    return dequantize_affine(q, block, scale, zero, dtype, qmin, qmax, output_dtype=torch.float32)


def int8_rows(w: torch.Tensor) -> torch.Tensor:
    """Symmetric int8, one scale per row (max |row| / 127)."""
    return _affine(w.float(), (1, w.shape[-1]), 8, True)


def int8_tensor(w: torch.Tensor) -> torch.Tensor:
    """Symmetric int8, one scale for the whole tensor."""
    return _affine(w.float().reshape(1, -1), (1, w.numel()), 8, True).reshape(w.shape)


def int4_groups(w: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    """Asymmetric uint4 with a scale and zero point per group of `group` inputs of a row (the row if shorter)."""
    g = min(group, w.shape[-1])
    if w.shape[-1] % g:
        raise ValueError(f"int4 groups of {g} do not tile rows of {w.shape[-1]}; use a multiple of the group size")
    return _affine(w.float(), (1, g), 4, False)


def nvfp4(w: torch.Tensor) -> torch.Tensor:
    import torch

    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

    w = w.float()
    t = NVFP4Tensor.to_nvfp4(w, block_size=16, per_tensor_scale=per_tensor_amax_to_scale(w.abs().max()))
    return t.dequantize(torch.float32)


def mxfp4(w: torch.Tensor) -> torch.Tensor:
    import torch

    from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx

    scale, data = to_mx(w.float().contiguous(), torch.float4_e2m1fn_x2, 32)
    return to_dtype(data, scale, torch.float4_e2m1fn_x2, 32, torch.float32)


def awq_scales(w: torch.Tensor, x: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, float]:
    """(s (in,), alpha): AWQ's per-input-channel scales for weight `w` (out, in) from calibration inputs `x` (N, in):
    s = mean|x|^alpha (normalised by sqrt(max * min)), alpha minimising || x W^T - (x / s) Q(W diag(s))^T ||."""
    w, x = w.float(), x.float().reshape(-1, w.shape[-1])
    mag = x.abs().mean(0).clamp_min(1e-8)  # (in,)
    ref = x @ w.T
    best = (float("inf"), None, 0.0)
    block = min(group, w.shape[-1])
    for k in range(AWQ_GRID):
        alpha = k / AWQ_GRID
        s = mag ** alpha
        s = s / (s.max() * s.min()).sqrt()
        wq = padded(lambda t: int4_groups(t, group), w * s, block)  # a short last group where rows do not tile
        err = ((x / s) @ wq.T - ref).pow(2).mean().item()
        if err < best[0]:
            best = (err, s, alpha)
    return best[1], best[2]


BLOCKS = {"int4-weight": GROUP, "awq-int4": GROUP, "nvfp4": 16, "mxfp4": 32}  # block size along the input dim


def padded(fn, w: torch.Tensor, block: int) -> torch.Tensor:
    """fn(w) for a row length that is not a multiple of `block`: the rows zero-padded to the next multiple, quantized,
    and cut back — a short last block, what an engine that pads K with zeros computes (the padded weights meet zero
    activations). Zeros change no block's scale: symmetric formats scale by amax, torchao's asymmetric int4 always
    keeps 0 in its range."""
    import torch

    n = w.shape[-1]
    if n % block == 0:
        return fn(w)
    pad = torch.zeros(*w.shape[:-1], block - n % block, dtype=w.dtype, device=w.device)
    return fn(torch.cat([w, pad], -1))[..., :n]


def quantize_weight(w: torch.Tensor, scheme: str) -> torch.Tensor:
    """The fake-quantized weight of `scheme` (awq-int4 needs `awq_scales` first: see policies.quantize_model). Rows
    longer than a block but not a multiple of it end in a short block (`padded`)."""
    fns = {"int8-weight": int8_rows, "w8a8-tensor": int8_tensor, "w8a8-row": int8_rows, "int4-weight": int4_groups,
           "nvfp4": nvfp4, "mxfp4": mxfp4, "awq-int4": int4_groups}
    if scheme not in fns:
        raise ValueError(f"unknown quantization scheme {scheme!r}; valid: {', '.join(SCHEMES)}")
    if scheme not in BLOCKS:
        return fns[scheme](w)
    block = min(BLOCKS[scheme], w.shape[-1]) if scheme in ("int4-weight", "awq-int4") else BLOCKS[scheme]
    return padded(fns[scheme], w, block)  # int4: a row shorter than a group is its own group


def quantize_activation(x: torch.Tensor, scheme: str) -> torch.Tensor:
    """Dynamic activation fake-quant of W8A8 schemes (per call for w8a8-tensor, per token for w8a8-row); else x."""
    if scheme == "w8a8-tensor":
        return int8_tensor(x).to(x.dtype)
    if scheme == "w8a8-row":
        return int8_rows(x.reshape(-1, x.shape[-1])).reshape(x.shape).to(x.dtype)
    return x
