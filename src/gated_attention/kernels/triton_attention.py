"""Fused gated flash attention (Triton): the `triton_gated` attention backend.

`gated_flash_attention(q, k, v, mask, scaling, gate_logits, gate_scale)` computes

    out = softmax(q k^T * scaling + mask) v * gate_scale * sigmoid(gate_logits)      (B, T, H, D)

with the G1 gate (elementwise logits (B, T, H, D) or headwise (B, T, H, 1); None = ungated) applied in the forward
kernel's epilogue, so the ungated attention output never leaves registers: the only (B, T, H, D) tensor written is
the gated output, which is also all the backward needs (see triton_jit.py). Causal, GQA (KV heads shared by
H // KV query heads, no repeat_kv copy), key/left padding and arbitrary boolean masks; head_dim any size (padded to a
power of two >= 16 inside the kernel); any sequence length (edge tiles are masked). Forward and backward are Triton
kernels behind two registered torch ops (`gated_attention::flash_attention` and its backward: torch.library.triton_op,
with fake implementations and the forward's autograd), so torch.compile traces through them and dispatch modes
(selective activation checkpointing) see one op; gradients flow to q, k, v and the gate logits.

Masks follow the model's (transformers') conventions, as the sdpa kernel receives them: None = upper-left causal when
T > 1 (no mask when T == 1); a 4-D boolean (or 0/-inf additive) (B|1, 1|H, T, S) mask otherwise. A mask that is
"causal (upper-left or bottom-right) AND a per-sequence key mask" -- what padding and KV caches produce -- is reduced
once per forward to a per-key byte vector, keeping the causal block skipping; any other mask, and under torch.compile
every mask tensor (that reduction depends on its values), is read tile by tile.

It runs on a CUDA GPU, or on CPU tensors under Triton's interpreter (`TRITON_INTERPRET=1` set before Triton compiles
the kernels; slow, for tests). Anything else fails with one line saying what to do. The plain references are the
eager kernel + `Gate` (attention.py / gates.py); tests/test_triton_attention.py checks forward and all gradients.
"""
from __future__ import annotations

import os
import weakref

import torch

from . import FLASH_ATTENTION_OP, TRITON_PIN


def _kernels():
    """The Triton kernel module, imported on first use (importing Triton costs seconds; most runs never need it)."""
    try:
        from . import triton_jit
    except ImportError as e:  # triton missing (or broken)
        raise RuntimeError(f"attn_implementation='triton_gated' needs Triton ({e}); install it with "
                           f"`pip install '{TRITON_PIN}'` (part of the dev extra), or use attn_implementation='sdpa'") from e
    return triton_jit


def interpreted() -> bool:
    """True when the kernels were built by Triton's CPU interpreter (TRITON_INTERPRET=1 at their first import)."""
    return type(_kernels()._fwd_kernel).__name__ == "InterpretedFunction"


def check_device(t: torch.Tensor) -> None:
    """One clear error where the kernel cannot run: Triton missing, or no GPU outside the interpreter."""
    if interpreted():
        import triton.language as tl

        if type(tl.zeros).__name__ != "InterpretedFunction":  # triton.language was built before TRITON_INTERPRET=1
            raise RuntimeError("triton_gated: TRITON_INTERPRET=1 was set after Triton was first imported (e.g. by "
                               "torch.compile), so only part of Triton runs interpreted; set it before importing "
                               "torch (in the environment, or first thing in conftest.py)")
        return
    if t.device.type != "cuda":
        hint = (" (TRITON_INTERPRET=1 is set, but Triton's kernels were built before it was: set it before the first "
                "import of gated_attention.kernels.triton_jit)" if os.environ.get("TRITON_INTERPRET") == "1" else "")
        raise RuntimeError(f"attn_implementation='triton_gated' needs a CUDA GPU, but the tensors are on "
                           f"{t.device.type}{hint}; use attn_implementation='sdpa' here, or run with "
                           f"TRITON_INTERPRET=1 (Triton's CPU interpreter: slow, for tests)")


# --------------------------------------------------------------------------------------------------- masks
class MaskPlan:
    """How the kernel applies a mask: causal (+ offset), a (B, S) key byte vector, or a dense byte mask."""

    def __init__(self, causal: bool, offset: int = 0, key_valid: torch.Tensor | None = None,
                 dense: torch.Tensor | None = None):
        self.causal, self.offset, self.key_valid, self.dense = causal, offset, key_valid, dense


_last_plan: list = [None]  # (weakref to the mask, its version, shape key, plan): the layers of one forward share it


def plan_mask(mask: torch.Tensor | None, b: int, h: int, t: int, s: int) -> MaskPlan:
    if mask is None:
        return MaskPlan(causal=t > 1)  # transformers' convention, as the sdpa kernel: upper-left causal
    if torch.compiler.is_compiling():
        # traced: choosing a plan from the mask's values would break the graph (a data-dependent branch per check),
        # so the mask is read as it is, tile by tile (correct for any mask, without causal block skipping)
        return MaskPlan(False, dense=_bool_mask(mask, b, h, t, s, traced=True).to(torch.uint8))
    key = (mask._version, b, h, t, s)
    cached = _last_plan[0]
    if cached is not None and cached[0]() is mask and cached[1] == key:
        return cached[2]
    plan = _plan_mask(mask, b, h, t, s)
    _last_plan[0] = (weakref.ref(mask), key, plan)
    return plan


_ALIBI = ("triton_gated: the additive attention mask has values other than 0 and -inf/min (a bias such as ALiBi); "
          "the kernel supports masks only: use attn_implementation='sdpa'")


def _bool_mask(mask: torch.Tensor, b: int, h: int, t: int, s: int, traced: bool = False) -> torch.Tensor:
    """The mask checked against (B, H, T, S) and as booleans (True = attend)."""
    if mask.dim() != 4 or mask.shape[-2:] != (t, s) or mask.shape[0] not in (1, b) or mask.shape[1] not in (1, h):
        raise ValueError(f"triton_gated: attention mask of shape {tuple(mask.shape)} does not broadcast to "
                         f"(B={b}, H={h}, T={t}, S={s}); pass a 4-D (B|1, 1|H, T, S) mask or None")
    if mask.dtype == torch.bool:
        return mask
    neg = torch.finfo(mask.dtype).min / 2
    only_mask = ((mask == 0) | (mask <= neg)).all()
    if traced:
        torch._assert_async(only_mask, _ALIBI)  # checked when the graph runs, not while it is traced
    elif not bool(only_mask):
        raise ValueError(_ALIBI)
    return mask == 0


def _plan_mask(mask: torch.Tensor, b: int, h: int, t: int, s: int) -> MaskPlan:
    mask = _bool_mask(mask, b, h, t, s)
    if mask.shape[1] == 1:
        m = mask[:, 0]  # (B|1, T, S)
        key_valid = m.any(dim=1)  # (B|1, S): keys some query sees; empty cache slots and padding are False
        i = torch.arange(t, device=m.device)[:, None]
        j = torch.arange(s, device=m.device)[None, :]
        for causal, off in ((True, s - t), (True, 0), (False, 0)):
            rebuilt = key_valid[:, None, :] & (j <= i + off) if causal else key_valid[:, None, :].expand_as(m)
            if torch.equal(rebuilt, m):
                kv = None if bool(key_valid.all()) else key_valid.expand(b, s).to(torch.uint8)
                return MaskPlan(causal and t > 1, off, key_valid=kv)
    return MaskPlan(False, dense=mask.to(torch.uint8))  # anything else (packed sequences, custom masks): read it


def _mask_args(plan: MaskPlan, dummy: torch.Tensor):
    kv = plan.key_valid if plan.key_valid is not None else dummy
    kv_strides = (plan.key_valid.stride(0), plan.key_valid.stride(1)) if plan.key_valid is not None else (0, 0)
    if plan.dense is not None:
        d = plan.dense
        dense_strides = tuple(0 if d.shape[i] == 1 else d.stride(i) for i in range(4))  # broadcast B|1, H|1
    else:
        d, dense_strides = dummy, (0, 0, 0, 0)
    return kv, kv_strides, d, dense_strides


# --------------------------------------------------------------------------------------------------- launch config
def _d_pad(d: int) -> int:
    return max(16, 1 << (d - 1).bit_length())


def launch_config(d_pad: int, interpret: bool, blocks: tuple[int, int] | None = None, elem_bytes: int = 2) -> dict:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel ("pre": (BLOCK_M, num_warps)). Hopper-sized on a GPU
    (128-query forward tiles, 8 warps at head_dim > 64; backward tiles as Triton's FA2 tutorial uses on H100), smaller
    for fp32 inputs and head_dim > 128 so shared memory stays under Hopper's 227 KiB (checked by
    tests/test_triton_attention.py::test_kernels_compile_for_hopper); 32x32 under the interpreter, where time is per
    program. `blocks=(BLOCK_M, BLOCK_N)` overrides every kernel (correctness holds for any power of two >= 16)."""
    if blocks is not None:
        bm, bn = blocks
        return {"fwd": (bm, bn, 4, 2), "pre": (bm, 4), "dkdv": (bm, bn, 4, 2), "dq": (bm, bn, 4, 2)}
    if interpret:
        return {"fwd": (32, 32, 1, 1), "pre": (32, 1), "dkdv": (32, 32, 1, 1), "dq": (32, 32, 1, 1)}
    if elem_bytes > 2:  # fp32 tiles take twice the shared memory
        return {"fwd": (64, 64, 4, 2), "pre": (64, 4), "dkdv": (32, 64, 4, 2), "dq": (64, 32, 4, 2)}
    if d_pad <= 64:
        return {"fwd": (128, 64, 4, 4), "pre": (128, 4), "dkdv": (32, 128, 4, 5), "dq": (128, 32, 4, 5)}
    if d_pad <= 128:
        return {"fwd": (128, 64, 8, 3), "pre": (128, 8), "dkdv": (32, 128, 8, 3), "dq": (128, 32, 8, 3)}
    return {"fwd": (64, 32, 8, 2), "pre": (64, 8), "dkdv": (32, 64, 8, 2), "dq": (64, 32, 8, 2)}


def _precision(dtype: torch.dtype) -> str:
    # fp32 inputs: exact IEEE products (tf32 would cost ~1e-3 relative error against the fp32 reference)
    return "ieee" if dtype == torch.float32 else "tf32"


def compile_for_gpu(arch: int = 90, head_dim: int = 128, dtype: torch.dtype = torch.bfloat16) -> dict[str, int]:
    """Compile every kernel variant (gate x mask kind) with the GPU launch config to a cubin for sm_`arch`, without a
    GPU (Triton ships ptxas). Returns {variant: shared memory bytes}: a check, on a machine without a GPU, that the
    GPU code path builds and fits. Needs a process whose kernels were not built for the interpreter."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kern = _kernels()
    if interpreted():
        raise RuntimeError("compile_for_gpu: this process built the kernels for Triton's interpreter "
                           "(TRITON_INTERPRET=1); run it in a process without it")
    dt = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    ptr, size = f"*{dt}", torch.empty((), dtype=dtype).element_size()
    dpad = _d_pad(head_dim)
    cfg = launch_config(dpad, False, None, size)
    fp32 = {"Lse", "Delta"}
    u8 = {"KVALID", "MASK"}
    floats = {"sm_scale", "gate_scale"}
    ints = {"H", "KV", "N_REP", "T", "S"}  # besides the lower-case strides and offsets; other capitals are pointers
    out = {}
    for gate in (0, 1, 2):
        for causal, has_kv, dense in ((True, False, False), (True, True, False), (False, False, True)):
            mask = dict(CAUSAL=causal, HAS_KV=has_kv, HAS_DENSE=dense, PRECISION=_precision(dtype))
            jobs = [("fwd", kern._fwd_kernel, dict(mask, GATE=gate)), ("pre", kern._bwd_preprocess, dict(GATE=gate))]
            if gate == 0:  # the dK/dV and dQ kernels do not see the gate
                jobs += [("dkdv", kern._bwd_dkdv, mask), ("dq", kern._bwd_dq, mask)]
            for name, fn, consts in jobs:
                blocks = cfg[name]
                consts = {**consts, "HEAD_DIM": head_dim, "D_PAD": dpad, "BLOCK_M": blocks[0]}
                if name != "pre":
                    consts["BLOCK_N"] = blocks[1]
                params = list(inspect.signature(fn.fn).parameters)
                sig = {p: "constexpr" if p in consts else "*fp32" if p in fp32 else "*u8" if p in u8
                       else "fp32" if p in floats else "i32" if p[0].islower() or p in ints
                       else ptr for p in params}
                src = ASTSource(fn=fn, signature=sig, constexprs={(params.index(k),): v for k, v in consts.items()})
                opts = {"num_warps": blocks[-2] if name != "pre" else blocks[1], "num_stages": blocks[-1]
                        if name != "pre" else 1}
                compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)
                key = f"{name} gate={gate} causal={causal} key_valid={has_kv} dense={dense}"
                out[key] = compiled.metadata.shared
    return out


# --------------------------------------------------------------------------------------------------- the ops
# The kernels are registered torch ops (torch.library.triton_op): torch.compile traces through them (no graph break),
# dispatch modes see them as one op -- selective activation checkpointing keeps `flash_attention`'s outputs by name
# (train/activation_checkpoint.py) -- and on a GPU AOT autograd sees the kernel launches themselves (wrap_triton).
# The mask arrives as its plan's parts (MaskPlan: causal, offset, key_valid, dense), the block override as a list.
def _fwd_outputs(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    bsz, h, t, d = q.shape
    out = torch.empty(bsz, t, h, d, device=q.device, dtype=q.dtype)  # (B, T, H, D): o_proj's layout, no copy
    return out, torch.empty(bsz * h, t, device=q.device, dtype=torch.float32)  # lse (B*H, T)


def _bwd_outputs(q: torch.Tensor, k: torch.Tensor, gate_logits: torch.Tensor | None):
    bsz, h, t, d = q.shape
    kvh, s = k.shape[1], k.shape[2]
    dq = torch.empty(bsz, t, h, d, device=q.device, dtype=q.dtype).transpose(1, 2)  # (B, H, T, D) view
    dk = torch.empty(bsz, s, kvh, d, device=k.device, dtype=k.dtype).transpose(1, 2)  # (B, KV, S, D) view
    dv = torch.empty(bsz, s, kvh, d, device=k.device, dtype=k.dtype).transpose(1, 2)
    # the op returns tensors only: an ungated call's gate gradient is an empty tensor
    dg = q.new_empty(0) if gate_logits is None else torch.empty(gate_logits.shape, device=q.device,
                                                                dtype=gate_logits.dtype)
    return dq, dk, dv, dg


def _blocks(blocks: list[int] | None) -> tuple[int, int] | None:
    return None if blocks is None else (int(blocks[0]), int(blocks[1]))


def _gate_mode(gate_logits: torch.Tensor | None, d: int) -> int:
    return 0 if gate_logits is None else (2 if gate_logits.shape[-1] == 1 and d != 1 else 1)


@torch.library.triton_op(FLASH_ATTENTION_OP, mutates_args=())
def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate_logits: torch.Tensor | None,
                    key_valid: torch.Tensor | None, dense: torch.Tensor | None, causal: bool, offset: int,
                    scaling: float, gate_scale: float, blocks: list[int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward kernel: (out (B, T, H, D), lse (B*H, T) fp32). Use gated_flash_attention, which checks inputs."""
    kern = _kernels()
    bsz, h, t, d = q.shape
    kvh, s = k.shape[1], k.shape[2]
    cfg = launch_config(_d_pad(d), interpreted(), _blocks(blocks), q.element_size())
    out, lse = _fwd_outputs(q, k)
    out_v = out.transpose(1, 2)  # (B, H, T, D) view for the kernel's (b, h, m, d) strides
    plan = MaskPlan(causal, offset, key_valid=key_valid, dense=dense)
    kv, kv_st, dmask, dense_st = _mask_args(plan, q.new_empty(1, dtype=torch.uint8))
    g = gate_logits if gate_logits is not None else q
    bm, bn, warps, stages = cfg["fwd"]
    torch.library.wrap_triton(kern._fwd_kernel)[(triton_cdiv(t, bm), bsz * h)](
        q, k, v, g, out_v, lse, kv, dmask, *q.stride(), *k.stride(), *v.stride(), *_gate_strides(gate_logits),
        *out_v.stride(), *kv_st, *dense_st, h, h // kvh, t, s, offset, scaling, gate_scale,
        HEAD_DIM=d, D_PAD=_d_pad(d), BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal, HAS_KV=key_valid is not None,
        HAS_DENSE=dense is not None, GATE=_gate_mode(gate_logits, d), PRECISION=_precision(q.dtype),
        num_warps=warps, num_stages=stages)
    return out, lse


@torch.library.triton_op(f"{FLASH_ATTENTION_OP}_backward", mutates_args=())
def flash_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             gate_logits: torch.Tensor | None, out: torch.Tensor, lse: torch.Tensor,
                             key_valid: torch.Tensor | None, dense: torch.Tensor | None, causal: bool, offset: int,
                             scaling: float, gate_scale: float, blocks: list[int] | None
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward kernels: (dq, dk, dv, d gate logits (empty when ungated)) from dout (B, T, H, D)."""
    kern = _kernels()
    bsz, h, t, d = q.shape
    kvh, s = k.shape[1], k.shape[2]
    dpad, gate_mode = _d_pad(d), _gate_mode(gate_logits, d)
    cfg = launch_config(dpad, interpreted(), _blocks(blocks), q.element_size())
    out_v, dout_v = out.transpose(1, 2), dout.transpose(1, 2)  # (B, H, T, D) views
    delta = torch.empty_like(lse)
    g = gate_logits if gate_logits is not None else q
    dq, dk, dv, dg = _bwd_outputs(q, k, gate_logits)
    doe = torch.empty(bsz, t, h, d, device=q.device, dtype=q.dtype).transpose(1, 2) if gate_mode else dout_v
    bm, warps = cfg["pre"]
    torch.library.wrap_triton(kern._bwd_preprocess)[(triton_cdiv(t, bm), bsz * h)](
        out_v, dout_v, g, dg if gate_mode else g, doe, delta, *out_v.stride(), *dout_v.stride(),
        *_gate_strides(gate_logits), *_gate_strides(dg if gate_mode else None), *doe.stride(), h, t, gate_scale,
        HEAD_DIM=d, D_PAD=dpad, BLOCK_M=bm, GATE=gate_mode, num_warps=warps)
    plan = MaskPlan(causal, offset, key_valid=key_valid, dense=dense)
    kv, kv_st, dmask, dense_st = _mask_args(plan, q.new_empty(1, dtype=torch.uint8))
    common = dict(HEAD_DIM=d, D_PAD=dpad, CAUSAL=causal, HAS_KV=key_valid is not None, HAS_DENSE=dense is not None,
                  PRECISION=_precision(q.dtype))
    bm, bn, warps, stages = cfg["dkdv"]
    torch.library.wrap_triton(kern._bwd_dkdv)[(triton_cdiv(s, bn), bsz * kvh)](
        q, k, v, doe, lse, delta, dk, dv, kv, dmask, *q.stride(), *k.stride(), *v.stride(), *doe.stride(),
        *dk.stride(), *dv.stride(), *kv_st, *dense_st, h, kvh, h // kvh, t, s, offset, scaling,
        BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages, **common)
    bm, bn, warps, stages = cfg["dq"]
    torch.library.wrap_triton(kern._bwd_dq)[(triton_cdiv(t, bm), bsz * h)](
        q, k, v, doe, lse, delta, dq, kv, dmask, *q.stride(), *k.stride(), *v.stride(), *doe.stride(),
        *dq.stride(), *kv_st, *dense_st, h, h // kvh, t, s, offset, scaling,
        BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages, **common)
    return dq, dk, dv, dg


# Fake implementations: the outputs' shapes, dtypes and strides without running a kernel. (triton_op's default fake is
# the op itself, which launches through wrap_triton: that traces on a GPU, but the interpreter needs real memory.)
@flash_attention.register_fake
def _flash_attention_fake(q, k, v, gate_logits, key_valid, dense, causal, offset, scaling, gate_scale, blocks):
    return _fwd_outputs(q, k)


@flash_attention_backward.register_fake
def _flash_attention_backward_fake(dout, q, k, v, gate_logits, out, lse, key_valid, dense, causal, offset, scaling,
                                   gate_scale, blocks):
    return _bwd_outputs(q, k, gate_logits)


def _keep_whole_under_interpreter(op) -> None:
    """AOT autograd replaces a triton_op by its kernel launches (wrap_triton), which the interpreter cannot be traced
    into (its kernels are plain Python): there the op stays one node of the compiled graph and runs as in eager."""
    from torch._subclasses.functional_tensor import FunctionalTensorMode

    decompose = op._torch_dispatch_fns[FunctionalTensorMode]  # triton_op's own rule (torch is pinned)

    @op.register_torch_dispatch(FunctionalTensorMode)
    def _rule(mode, func, types, args, kwargs):
        if interpreted():
            return mode.__torch_dispatch__(func, types, args, kwargs)
        return decompose(mode, func, types, args, kwargs)


_keep_whole_under_interpreter(flash_attention)
_keep_whole_under_interpreter(flash_attention_backward)


def _setup_context(ctx, inputs, output):
    q, k, v, gate_logits, key_valid, dense, causal, offset, scaling, gate_scale, blocks = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, gate_logits, out, lse, key_valid, dense)
    ctx.causal, ctx.offset, ctx.scaling, ctx.gate_scale, ctx.blocks = causal, offset, scaling, gate_scale, blocks
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    q, k, v, gate_logits, out, lse, key_valid, dense = ctx.saved_tensors
    dq, dk, dv, dg = flash_attention_backward(dout, q, k, v, gate_logits, out, lse, key_valid, dense, ctx.causal,
                                              ctx.offset, ctx.scaling, ctx.gate_scale, ctx.blocks)
    return dq, dk, dv, (dg if gate_logits is not None else None), None, None, None, None, None, None, None


flash_attention.register_autograd(_backward, setup_context=_setup_context)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _gate_strides(g: torch.Tensor | None):
    """(b, h, m, d) strides of gate logits laid out (B, T, H, D|1); the d stride is unused when headwise."""
    if g is None:
        return (0, 0, 0, 0)
    return (g.stride(0), g.stride(2), g.stride(1), g.stride(3))


# --------------------------------------------------------------------------------------------------- public API
def gated_flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                          scaling: float | None = None, gate_logits: torch.Tensor | None = None,
                          gate_scale: float = 1.0, blocks: tuple[int, int] | None = None) -> torch.Tensor:
    """q (B, H, T, D), k/v (B, KV, S, D), gate_logits (B, T, H, D) | (B, T, H, 1) | None -> out (B, T, H, D).

    out = attention(q, k, v) * gate_scale * sigmoid(gate_logits) (ungated when gate_logits is None). Under autocast q,
    k and v are first cast to the autocast dtype (the output is in it too)."""
    check_device(q)
    bsz, h, t, d = q.shape
    if k.dim() != 4 or k.shape != v.shape or k.shape[0] != bsz or k.shape[3] != d or h % k.shape[1]:
        raise ValueError(f"triton_gated: expected q (B, H, T, D), k and v (B, KV, S, D) with H a multiple of KV; "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if gate_logits is not None and (gate_logits.dim() != 4 or tuple(gate_logits.shape[:3]) != (bsz, t, h)
                                    or gate_logits.shape[3] not in (1, d)):
        raise ValueError(f"triton_gated: gate logits must be (B, T, H, D) or (B, T, H, 1) = ({bsz}, {t}, {h}, "
                         f"{d}|1); got {tuple(gate_logits.shape)}")
    if torch.is_autocast_enabled(q.device.type):
        # autocast's rule for an attention kernel: q, k, v in the autocast dtype. Under bf16 autocast q and k leave
        # QK-norm in fp32 (its weight is fp32) while v leaves its projection in bf16; the gradients flow back through
        # the casts in each input's own dtype.
        dtype = torch.get_autocast_dtype(q.device.type)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(f"triton_gated: q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}); pass them in one "
                         "dtype, or run under torch.autocast (which casts them to its dtype)")
    plan = plan_mask(mask, bsz, h, t, k.shape[2])
    scaling = d ** -0.5 if scaling is None else float(scaling)
    if interpreted() and q.dtype == torch.bfloat16:
        # Triton's CPU interpreter computes bf16 tl.dot wrongly (triton-lang/triton#11584): there the kernel runs in
        # fp32 on the bf16 values and rounds its output to bf16, as sdpa_attention does on a CPU; a GPU runs bf16.
        g32 = None if gate_logits is None else gate_logits.float()
        return _apply(q.float(), k.float(), v.float(), g32, plan, scaling, gate_scale, blocks).to(torch.bfloat16)
    return _apply(q, k, v, gate_logits, plan, scaling, gate_scale, blocks)


def _apply(q, k, v, gate_logits, plan: MaskPlan, scaling: float, gate_scale: float, blocks) -> torch.Tensor:
    out, _ = flash_attention(q, k, v, gate_logits, plan.key_valid, plan.dense, plan.causal, plan.offset, scaling,
                             float(gate_scale), None if blocks is None else list(blocks))
    return out


def triton_gated_kernel(module, q, k, v, mask, scaling, dropout=0.0, gate_logits=None, gate_scale=1.0, **kwargs):
    """The attention-kernel contract of attention.py (q (B, H, T, D) -> ((B, T, H, D), None)), plus the G1 gate."""
    if dropout:
        raise ValueError("attn_implementation='triton_gated' has no attention dropout: set attention_dropout=0 "
                         "or use attn_implementation='sdpa'")
    return gated_flash_attention(q, k, v, mask, scaling, gate_logits, gate_scale), None


__all__ = ["gated_flash_attention", "flash_attention", "triton_gated_kernel", "plan_mask", "launch_config", "interpreted",
           "check_device", "compile_for_gpu", "TRITON_PIN"]
