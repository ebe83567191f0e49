"""The attention layer: GQA with optional QK-norm and RoPE, and the gate applied outside the kernel.

Order of operations (official code, paper map §1.3): q/k/v projections of the pre-normed input X -> [G4/G3/G2 gates on the
raw projections] -> QK-norm -> RoPE -> KV cache -> kernel (eager or sdpa) -> (B, T, H, D) -> [G1 gate] -> o_proj ->
[G5 gate]. Because the gate never enters the kernel, every backend (ours or transformers' registered ones) works.
The eager kernel is the plain reference that materialises probabilities; sdpa is the fast path. The one exception is
`triton_gated` (kernels/triton_attention.py, GPU): a flash kernel that applies a G1 sigmoid gate (elementwise or headwise) in
its epilogue from the gate logits; every other gate stays outside it, as with the other kernels.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from .gate_layer import build_gate
from .gates import Position
from .mechanisms import build_attention_mechanism
from .norm import RMSNorm
from .rope import apply_rotary_pos_emb


_NO_CONTEXT = contextlib.nullcontext()


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, KV, S, D) -> (B, KV*n_rep, S, D); query head h reads KV head h // n_rep."""
    if n_rep == 1:
        return x
    b, kv, s, d = x.shape
    return x[:, :, None].expand(b, kv, n_rep, s, d).reshape(b, kv * n_rep, s, d)


def eager_attention(module, q, k, v, mask, scaling, dropout=0.0, **kwargs):
    """Reference kernel. q (B, H, T, D), k/v (B, KV, S, D), mask additive float (B, 1, T, S) or None.
    Returns ((B, T, H, D), probs (B, H, T, S)). Softmax in fp32, as HF and the official code do."""
    n_rep = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    logits = torch.matmul(q, k.transpose(2, 3)) * scaling  # (B, H, T, S)
    if mask is None and getattr(module, "is_causal", True) and q.shape[2] > 1:
        # transformers skips the mask (sdpa) only when upper-left causal alignment is right: T == S, or a static
        # cache's first prefill (S = cache length, future slots empty). Rebuild exactly that mask.
        t, s = q.shape[2], k.shape[2]
        mask = torch.ones(t, s, dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        if mask.dtype == torch.bool:
            logits = logits.masked_fill(~mask, torch.finfo(logits.dtype).min)
        else:
            logits = logits + mask
    probs = F.softmax(logits, dim=-1, dtype=torch.float32).to(q.dtype)
    probs_used = F.dropout(probs, p=dropout, training=module.training) if dropout else probs
    out = torch.matmul(probs_used, v)  # (B, H, T, D)
    return out.transpose(1, 2).contiguous(), probs


def sdpa_attention(module, q, k, v, mask, scaling, dropout=0.0, **kwargs):
    """torch SDPA. Same contract as `eager_attention`, probabilities not returned.

    bf16 on a CPU runs in fp32 (inputs upcast, output cast back): PyTorch's CPU flash kernel is slower in bf16 than
    in fp32 (it converts block by block); measured at the `gattn compare` shape (B 16, H 4 / KV 2, T 256, D 32, one
    thread, forward + backward): 38.5 ms bf16 vs 29.6 ms with the upcast, ~8 % of a bf16 training step, and the
    softmax is then fp32 as in the eager reference. CUDA keeps bf16 (its flash kernels are fastest there)."""
    # transformers' convention: no mask with T > 1 means upper-left causal (T == S, or a static-cache prefill whose
    # slots past T are empty); T == 1 means see every key
    is_causal = mask is None and q.shape[2] > 1
    dtype = q.dtype
    upcast = dtype == torch.bfloat16 and q.device.type == "cpu"
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
        if mask is not None and mask.is_floating_point():
            mask = mask.float()
    with torch.autocast("cpu", enabled=False) if upcast else _NO_CONTEXT:  # autocast would cast back to bf16
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout if module.training else 0.0, is_causal=is_causal,
            scale=scaling, enable_gqa=q.shape[1] != k.shape[1],
        )  # (B, H, T, D)
    return out.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format), None  # (B, T, H, D), one copy


def triton_gated_attention(module, q, k, v, mask, scaling, dropout=0.0, **kwargs):
    """Fused flash attention in Triton (kernels/triton_attention.py); applies a G1 sigmoid gate in its epilogue when given
    `gate_logits=`. Imported on first use: Triton is optional and slow to import."""
    from .kernels.triton_attention import triton_gated_kernel

    return triton_gated_kernel(module, q, k, v, mask, scaling, dropout=dropout, **kwargs)


KERNELS = {"eager": eager_attention, "sdpa": sdpa_attention, "triton_gated": triton_gated_attention}
FUSED_GATE_KERNELS = frozenset({"triton_gated"})  # kernels that take gate_logits= and apply the G1 gate themselves


def _register_with_transformers() -> None:
    """Make `attn_implementation="triton_gated"` a name transformers accepts (from_pretrained, set_attn_implementation)
    and give it sdpa's masks (4-D boolean or None), the convention every kernel here reads."""
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register("triton_gated", triton_gated_attention)
    AttentionMaskInterface.register("triton_gated", sdpa_mask)


_register_with_transformers()


def get_kernel(name: str | None):
    if name is None or name in KERNELS:
        return KERNELS[name or "sdpa"]
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # flash / flex / kernels from the hub registry

    if name in ALL_ATTENTION_FUNCTIONS:
        hf = ALL_ATTENTION_FUNCTIONS[name]

        def kernel(module, q, k, v, mask, scaling, dropout=0.0, **kw):
            return hf(module, q, k, v, mask, scaling=scaling, dropout=dropout, **kw)

        return kernel
    valid = ", ".join(dict.fromkeys([*KERNELS, *ALL_ATTENTION_FUNCTIONS]))
    raise ValueError(f"unknown attention implementation {name!r}; valid: {valid}")


class GatedAttention(nn.Module):
    """Qwen3 attention with a gate from the registry. Parameter names are stock Qwen3's; the gate (if any) lives in
    the `gate` submodule so an ungated layer has exactly stock keys."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_kv_heads
        self.head_dim = config.head_dim
        self.scaling = self.head_dim ** -0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        d, hd, bias = config.hidden_size, self.head_dim, config.attention_bias
        self.q_proj = nn.Linear(d, self.num_heads * hd, bias=bias)
        self.k_proj = nn.Linear(d, self.num_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(d, self.num_kv_heads * hd, bias=bias)
        o_bias = bias if config.o_proj_bias is None else config.o_proj_bias  # Qwen2: q/k/v biased, o_proj not
        self.o_proj = nn.Linear(self.num_heads * hd, d, bias=o_bias)
        # the mask implements the window for eager/sdpa; hub kernels (flash, ...) also read it from here
        self.layer_type = config.layer_types[layer_idx]
        self.sliding_window = config.sliding_window if self.layer_type == "sliding_attention" else None
        if config.use_qk_norm:
            self.q_norm = RMSNorm(hd, config.rms_norm_eps)
            self.k_norm = RMSNorm(hd, config.rms_norm_eps)
        self.gate = build_gate(config.gate, config)
        self.gate_position = self.gate.spec.position if self.gate is not None else None
        self.mechanism = build_attention_mechanism(config)  # None, or the hooks of a comparison mechanism
        self.capture = None  # a Recorder (capture.py) while analysing; None costs nothing

    def _emit(self, name, value):
        if self.capture is not None:
            self.capture(self.layer_idx, name, value)

    def _maybe_gate(self, position: Position, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.gate_position is not position:
            return y
        if position is Position.SDPA:
            self._emit("y_pre_gate", y)
        y, score = self.gate(y, x)
        if score is not None:
            self._emit("gate", score)
        if position is Position.SDPA:
            self._emit("y_post_gate", y)
        return y

    def _project(self, x: torch.Tensor):
        """q (B, T, H, D) and k, v (B, T, KV, D) after any G2-G4 gate, plus pre-activation G1 gate logits when the
        projection computes them (None here; the fused layer in fused.py folds them into its GEMM)."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim)  # (B, T, H, D)
        if self.mechanism is None or (kv := self.mechanism.project_kv(x, self.k_proj, self.v_proj)) is None:
            k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)  # (B, T, KV, D)
            v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim)  # (B, T, KV, D)
        else:
            k, v = kv  # (B, T, KV, D) each: expert mixtures (Switch Heads)
        if self.gate_position is not None:
            q = self._maybe_gate(Position.QUERY, q, x)
            k = self._maybe_gate(Position.KEY, k, x)
            v = self._maybe_gate(Position.VALUE, v, x)
        return q, k, v, None

    def _gate_sdpa(self, y: torch.Tensor, x: torch.Tensor, gate_logits: torch.Tensor | None) -> torch.Tensor:
        """Everything between the kernel's (B, T, H, D) output and o_proj: the G1 gate (and Bondarenko's)."""
        if self.mechanism is not None:
            y = self.mechanism.gate_output(y, x)  # Bondarenko et al. per-head gate
        return self._maybe_gate(Position.SDPA, y, x)

    def forward(self, hidden_states, position_embeddings, attention_mask=None, cache=None, **kwargs):
        x = hidden_states
        b, t, _ = x.shape
        q, k, v, gate_logits = self._project(x)
        if self.config.use_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, D)
        cos, sin = position_embeddings
        if self.mechanism is None or self.mechanism.use_rope:
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if self.mechanism is not None:
            k = self.mechanism.extend_keys(k, x)  # FoX: (B, KV, T, D + n_rep), log f rides along in the cache
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)  # (B, KV, S, D) including the past
        if self.capture is not None:
            self._emit("q", q)
            self._emit("k", k if self.mechanism is None else self.mechanism.key_view(k))
            self._emit("v", v)
            self._emit("scale", self.scaling)
        impl = self.config._attn_implementation or "sdpa"
        if self.capture is not None and getattr(self.capture, "wants_probs", False):
            impl = "eager"
        kernel = get_kernel(impl) if self.mechanism is None else self.mechanism.wrap(get_kernel(impl), impl)
        if self.sliding_window is not None and impl not in KERNELS:
            kwargs = {**kwargs, "sliding_window": self.sliding_window}
        # a G1 sigmoid gate goes into a kernel that fuses it (its epilogue), unless an analysis captures Y pre-gate
        fuse_gate = (impl in FUSED_GATE_KERNELS and self.gate_position is Position.SDPA and self.mechanism is None
                     and self.capture is None and self.gate.spec.fusable_in_kernel)
        if fuse_gate:
            logits = gate_logits if gate_logits is not None else self.gate.logits(x)  # (B, T, width)
            kwargs = {**kwargs, "gate_logits": logits.view(b, t, self.num_heads, -1),  # (B, T, H, D | 1)
                      "gate_scale": self.gate.scale}
        y, probs = kernel(self, q, k, v, attention_mask, self.scaling,
                          dropout=self.attention_dropout if self.training else 0.0, **kwargs)  # (B, T, H, D)
        if probs is not None:
            self._emit("attn_probs", probs)
        if not fuse_gate:
            y = self._gate_sdpa(y, x, gate_logits)
        out = self.o_proj(y.reshape(b, t, self.num_heads * self.head_dim))  # (B, T, d)
        if self.gate_position is Position.DENSE:
            out = self._maybe_gate(Position.DENSE, out, x)
        return out, probs
