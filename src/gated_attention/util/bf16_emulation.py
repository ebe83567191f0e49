"""bf16 GEMMs computed as fp32 GEMMs of bf16 values: bf16 numerics at about fp32 speed on CPUs without bf16 units.

Why: on an AVX2-only CPU PyTorch's bf16 matmul runs ~50x slower than fp32 (measured: 204 ms vs 3.8 ms for 512x512 on
one thread of an AMD EPYC without AVX512-BF16), so bf16 training — the precision the paper's stability argument is
about — could not run there at all. A bf16 GEMM on a GPU (or with AVX512-BF16) multiplies bf16 inputs, accumulates in
fp32 and rounds the output to bf16. The product of two bf16 numbers is exact in fp32 (8 + 8 significand bits < 24),
so an fp32 GEMM of the bf16 values followed by rounding the output to bf16 computes the same thing up to the order
of the fp32 summation — at 1.1x the fp32 cost (4.2 ms for the same 512x512), not 50x.

`emulated_bf16()` is a TorchFunctionMode (a Python hook on torch-level calls, free for every other call: measured
no slower than no mode on a 12-layer training step, where an aten-level TorchDispatchMode added ~70 %). Inside it:
  - F.linear / matmul / mm / bmm / addmm / baddbmm / einsum / _grouped_mm whose floating inputs are all bf16 run as
    fp32 GEMMs of those values and return bf16; with gradients, through autograd Functions whose backward GEMMs are
    emulated the same way (input and weight gradients rounded to bf16, as a bf16 backward GEMM returns them);
  - under CPU bf16 autocast, the same calls with fp32 inputs are first cast to bf16 (what autocast does), so
    precision "bf16" (autocast) is emulated too;
  - anything else (fp32 GEMMs, CUDA tensors, mixed dtypes) passes through untouched.
Attention itself already runs in fp32 on a CPU (attention.sdpa_attention upcasts bf16 q/k/v). The plain reference
is PyTorch's native bf16 kernel: tests/test_bf16_emulation.py compares forward and gradients against it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_BF16 = torch.bfloat16
_T = torch.Tensor


class _Linear(torch.autograd.Function):
    """F.linear of bf16 x, w (and b) as an fp32 GEMM of their values; output and gradients rounded to bf16."""

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        ctx.has_bias = b is not None
        return F.linear(x.float(), w.float(), None if b is None else b.float()).to(_BF16)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g32 = g.float()
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = (g32 @ w.float()).to(_BF16)  # (..., in)
        if ctx.needs_input_grad[1]:
            gw = (g32.reshape(-1, g.shape[-1]).t() @ x.float().reshape(-1, x.shape[-1])).to(_BF16)  # (out, in)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g32.reshape(-1, g.shape[-1]).sum(0).to(_BF16)  # (out,)
        return gx, gw, gb


class _Gemm(torch.autograd.Function):
    """Any other GEMM-like call: fn(*args) in fp32 on the bf16 values, output rounded to bf16; the backward
    recomputes fn in fp32 under autograd (these calls are rare on the default path: eager attention, a mechanism's
    einsum, MoE grouped matmuls) and rounds each input gradient to bf16."""

    @staticmethod
    def forward(ctx, fn, template, kwargs, *tensors):
        ctx.fn, ctx.template, ctx.kwargs = fn, template, kwargs
        ctx.save_for_backward(*tensors)
        return fn(*_fill(template, [t.float() for t in tensors]), **kwargs).to(_BF16)

    @staticmethod
    def backward(ctx, g):
        saved = ctx.saved_tensors
        with torch.enable_grad():
            ups = [t.detach().float().requires_grad_(bool(need)) for t, need in zip(saved, ctx.needs_input_grad[3:])]
            out = ctx.fn(*_fill(ctx.template, ups), **ctx.kwargs)
            wanted = [u for u in ups if u.requires_grad]
            grads = iter(torch.autograd.grad(out, wanted, g.float()) if wanted else ())
        return (None, None, None, *[next(grads).to(_BF16) if u.requires_grad else None for u in ups])


_HOLE = object()  # where a bf16 tensor goes back into an argument list


def _fill(template: list, tensors: list) -> list:
    it = iter(tensors)
    return [next(it) if a is _HOLE else a for a in template]


def _floats(args) -> list[torch.Tensor]:
    return [a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]


_LINEAR = {F.linear}
_GEMMS = {torch.matmul, _T.matmul, _T.__matmul__, _T.__rmatmul__, torch.mm, _T.mm, torch.bmm, _T.bmm, torch.addmm,
          _T.addmm, torch.baddbmm, _T.baddbmm, torch.einsum}
if hasattr(torch, "_grouped_mm"):
    _GEMMS.add(torch._grouped_mm)


class EmulatedBF16(TorchFunctionMode):
    """The mode behind `emulated_bf16()` (module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        linear = func in _LINEAR
        if not linear and func not in _GEMMS:
            return func(*args, **kwargs)
        floats = _floats(args) + _floats(kwargs.values())
        if not floats or any(t.device.type != "cpu" for t in floats):
            return func(*args, **kwargs)
        if torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == _BF16:
            # autocast would cast these inputs to bf16 and run a bf16 GEMM: do the cast here, emulate the GEMM
            args = tuple(a.to(_BF16) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
            kwargs = {k: v.to(_BF16) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                      for k, v in kwargs.items()}
            floats = _floats(args) + _floats(kwargs.values())
            with torch.autocast("cpu", enabled=False):
                return self._emulate(func, linear, args, kwargs, floats)
        if any(t.dtype != _BF16 for t in floats):
            return func(*args, **kwargs)  # fp32 (or mixed: PyTorch's own error) stays native
        return self._emulate(func, linear, args, kwargs, floats)

    @staticmethod
    def _emulate(func, linear, args, kwargs, floats):
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in floats)
        if linear:
            x, w = args[0], args[1]
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            if grad:
                return _Linear.apply(x, w, b)
            return F.linear(x.float(), w.float(), None if b is None else b.float()).to(_BF16)
        if any(isinstance(v, torch.Tensor) and v.is_floating_point() for v in kwargs.values()):
            return func(*args, **kwargs)  # floating tensors passed by keyword: not a form the model uses
        template = [_HOLE if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
        tensors = [a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
        if grad:
            return _Gemm.apply(func, template, kwargs, *tensors)
        return func(*_fill(template, [t.float() for t in tensors]), **kwargs).to(_BF16)


def emulating() -> bool:
    """True inside `emulated_bf16()` (checkpointing re-enters it for the recompute, which runs in backward, outside)."""
    return any(isinstance(m, EmulatedBF16) for m in torch.overrides._get_current_function_mode_stack())


def emulated_bf16() -> EmulatedBF16:
    """Context manager: bf16 GEMMs inside it are computed as fp32 GEMMs of bf16 values (module docstring)."""
    return EmulatedBF16()
