"""Fast paths for the gated attention layer, applied to a built (or loaded) model; the plain layer is the reference.

- `fuse_qkv(model)`: every attention layer computes q, k, v and (for an input-dependent G1 gate) the gate logits with
  ONE GEMM against a weight concatenated at conversion time, [W_q; W_k; W_v; W_gate] -> (H*D + 2*KV*D + width, d).
  Checkpoints keep the separate-module names: `state_dict()` splits the fused weight back into `q_proj.weight`,
  `k_proj.weight`, `v_proj.weight`, `gate.proj.weight`, and `load_state_dict()` accepts those keys. `unfuse_qkv(model)`
  converts back. `fuse_qkv(model, separate_params=True)` (the trainer's choice) keeps the plain Parameters themselves
  and concatenates them per forward: the same single GEMM, with parameter names and order untouched.
- `fused_sigmoid_mul(y, logits, scale)`: Y * scale * sigmoid(logits) as one autograd node that saves (logits, output)
  instead of (Y, score). The output is what o_proj saves anyway, so one (B, T, H, D) activation per layer less is
  kept for backward; the backward uses d/dlogits = g * out * (1 - s) and d/dY = g * scale * s.
- Static KV cache: the model uses transformers' caches, so `generate(cache_implementation="static")` works unchanged
  (tests/test_fused.py checks cached == uncached). The lean decode loop with its own static cache and an optional
  compiled single-token step is `decode.generate_fast`.
- `torch.compile(model, fullgraph=True)` works on the plain and the fused model (no graph breaks; tested).
- `chunked_lm_loss(hidden, weight, targets)`: lm_head + cross-entropy over chunks of tokens that never holds the
  (N, V) logits in fp32 (or at all) for more than one chunk. The forward also computes the gradients (softmax - onehot
  is known once the log-sum-exp is), so there is no second pass over the logits in backward; backward only scales the
  saved d/dhidden and d/dweight by the incoming gradient. `GatedQwen3ForCausalLM.forward(..., fused_loss=True)` uses
  it (logits are then not returned); the trainer uses it by default. Reference: `reference_lm_loss` (= transformers'
  ForCausalLMLoss on lm_head's logits).

fp32 upcasts that remain in hot paths, each because the numerics need it (same as transformers' Qwen3):
RMSNorm / QK-norm variance (bf16 mean of squares loses the eps scale), the eager reference kernel's softmax, and the
loss (transformers' ForCausalLMLoss upcasts the (B, T, V) logits for a stable log-softmax). Gate, RoPE and SDPA run in
the autocast dtype.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from .attention import GatedAttention
from .gate_layer import _activate
from .gates import Activation, Combine, Position, Sharing, Source


class _SigmoidMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, logits, scale: float):
        out = y * (torch.sigmoid(logits) * scale)  # logits broadcast: (B, T, H, D) elementwise or (B, T, H, 1) headwise
        ctx.save_for_backward(logits, out)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, g):
        logits, out = ctx.saved_tensors
        s = torch.sigmoid(logits)
        grad_y = g * (s * ctx.scale)
        grad_l = g * out * (1 - s)  # d(y*c*s)/dl = y*c*s*(1-s) = out*(1-s)
        if grad_l.shape != logits.shape:  # headwise: sum over the broadcast head_dim axis
            grad_l = grad_l.sum(dim=-1, keepdim=True)
        return grad_y, grad_l.to(logits.dtype), None


OPAQUE_GATE_UNDER_COMPILE = False  # True: trace the custom Function under compile too (bench/profile_train.py --compile)


def fused_sigmoid_mul(y: torch.Tensor, logits: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """y * scale * sigmoid(logits); logits is y's shape or broadcasts over y's last axis (headwise).

    Eager: one autograd node that saves (logits, out). Under torch.compile: the plain expression, because a custom
    autograd.Function is an opaque unit to AOT autograd's partitioner (its saved tensors and its backward are fixed),
    while the plain ops let inductor fuse the gate into the neighbouring pointwise kernels (SDPA's output copy, the
    o_proj input) and choose what to save or recompute (bench/profile_train.py --compile shows the difference)."""
    if torch.compiler.is_compiling() and not OPAQUE_GATE_UNDER_COMPILE:
        return y * (torch.sigmoid(logits) * scale)
    return _SigmoidMul.apply(y, logits, scale)


def _uses_fused_mul(gate) -> bool:
    spec = gate.spec
    return (spec.activation is Activation.SIGMOID and spec.combine is Combine.MULTIPLY
            and spec.sharing is Sharing.HEAD_SPECIFIC and spec.source is Source.INPUT)


class FusedGatedAttention(GatedAttention):
    """GatedAttention with one q/k/v(/gate) GEMM. Built from a plain layer by `fuse_qkv`; same outputs, same captures.

    The G1 input gate's projection is folded into the GEMM; gates at other positions keep their own projection.
    """

    def __init__(self, attn: GatedAttention, fused_gate_mul: bool = True, separate_params: bool = False):
        if getattr(attn, "mechanism", None) is not None:
            raise ValueError(f"fuse_qkv: layer {attn.layer_idx} uses the comparison mechanism "
                             f"{type(attn.mechanism).__name__}, which changes the projections; run it unfused")
        nn.Module.__init__(self)  # the parent's __init__ would build fresh projections; we take attn's weights
        self.mechanism = None
        for name in ("config", "layer_idx", "num_heads", "num_kv_heads", "num_key_value_groups", "head_dim",
                     "scaling", "attention_dropout", "is_causal", "gate_position", "capture", "layer_type",
                     "sliding_window"):
            setattr(self, name, getattr(attn, name))
        hq, hkv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        parts = [attn.q_proj, attn.k_proj, attn.v_proj]
        self.fold_gate = (attn.gate is not None and attn.gate_position is Position.SDPA
                          and attn.gate.spec.source is Source.INPUT)
        if self.fold_gate:
            parts.append(attn.gate.proj)
        self.splits = [hq, hkv, hkv] + ([attn.gate.width] if self.fold_gate else [])
        self.separate_params = separate_params
        self._part_names = ["q_proj", "k_proj", "v_proj"] + (["gate.proj"] if self.fold_gate else [])
        if separate_params:
            # training: the Parameters stay the plain layer's (same names and order for optimizer state, DDP/FSDP,
            # checkpoints); their weights are concatenated per forward, a (sum(splits), d) copy, tiny next to activations
            self.q_proj, self.k_proj, self.v_proj = attn.q_proj, attn.k_proj, attn.v_proj
        self.o_proj = attn.o_proj
        if self.config.use_qk_norm:
            self.q_norm, self.k_norm = attn.q_norm, attn.k_norm
        self.gate = attn.gate
        if not separate_params:
            ref = attn.q_proj.weight
            bias = attn.q_proj.bias is not None
            self.qkvg_proj = nn.Linear(ref.shape[1], sum(self.splits), bias=bias, device=ref.device, dtype=ref.dtype)
            with torch.no_grad():
                self.qkvg_proj.weight.copy_(torch.cat([p.weight for p in parts], dim=0))  # (sum(splits), d)
                if bias:
                    self.qkvg_proj.bias.copy_(torch.cat([p.bias for p in parts], dim=0))
            if self.fold_gate:
                del self.gate.proj  # its weight lives in qkvg_proj now; state_dict still writes gate.proj.*
            self.register_state_dict_post_hook(_split_state_dict)
            self.register_load_state_dict_pre_hook(_merge_state_dict)
        self.fused_mul = fused_gate_mul and self.fold_gate and _uses_fused_mul(self.gate)

    def _score_from_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Gate.score after its projection: activation, head sharing, identity-init scale. logits (B, T, H, D|1)."""
        gate = self.gate
        s = _activate(logits, gate.spec.activation)
        if gate.spec.sharing is Sharing.HEAD_SHARED:
            s = s.mean(dim=-2, keepdim=True)  # (B, T, 1, D)
        return s * gate.scale if gate.scale != 1.0 else s

    def _gate_sdpa(self, y: torch.Tensor, x: torch.Tensor, logits: torch.Tensor | None) -> torch.Tensor:
        if not self.fold_gate:
            return self._maybe_gate(Position.SDPA, y, x)
        self._emit("y_pre_gate", y)
        logits = logits.view(*y.shape[:-1], -1)  # (B, T, H, D) elementwise | (B, T, H, 1) headwise
        if self.fused_mul:
            out = fused_sigmoid_mul(y, logits, self.gate.scale)
            score = torch.sigmoid(logits) * self.gate.scale if self.capture is not None else None
        else:
            score = self._score_from_logits(logits)
            out = y * score if self.gate.spec.combine is Combine.MULTIPLY else y + score
        if score is not None:
            self._emit("gate", score)
        self._emit("y_post_gate", out)
        return out

    def _project(self, x: torch.Tensor):
        b, t, _ = x.shape
        if self.separate_params:
            mods = [self.q_proj, self.k_proj, self.v_proj] + ([self.gate.proj] if self.fold_gate else [])
            w = torch.cat([m.weight for m in mods], dim=0)  # (sum(splits), d)
            bias = torch.cat([m.bias for m in mods], dim=0) if self.q_proj.bias is not None else None
            qkvg = F.linear(x, w, bias)  # (B, T, sum(splits))
        else:
            qkvg = self.qkvg_proj(x)  # (B, T, sum(splits))
        parts = qkvg.split(self.splits, dim=-1)  # each (B, T, width)
        q = parts[0].view(b, t, self.num_heads, self.head_dim)  # (B, T, H, D)
        k = parts[1].view(b, t, self.num_kv_heads, self.head_dim)  # (B, T, KV, D)
        v = parts[2].view(b, t, self.num_kv_heads, self.head_dim)  # (B, T, KV, D)
        if self.gate_position is not None and not self.fold_gate:
            q = self._maybe_gate(Position.QUERY, q, x)
            k = self._maybe_gate(Position.KEY, k, x)
            v = self._maybe_gate(Position.VALUE, v, x)
        return q, k, v, parts[3] if self.fold_gate else None  # gate logits (B, T, width)

    def split_weights(self) -> dict[str, torch.Tensor]:
        """The fused parameters as the separate modules' tensors: {'q_proj.weight': ..., 'gate.proj.bias': ...}."""
        if self.separate_params:
            return {k: v.detach() for k, v in self.state_dict().items()
                    if any(k.startswith(f"{name}.") for name in self._part_names)}
        out = {}
        for kind in ("weight", "bias"):
            p = getattr(self.qkvg_proj, kind)
            if p is None:
                continue
            for name, chunk in zip(self._part_names, p.detach().split(self.splits, dim=0)):
                out[f"{name}.{kind}"] = chunk
        return out


def _split_state_dict(module: FusedGatedAttention, state_dict, prefix, local_metadata):
    for kind in ("weight", "bias"):
        key = f"{prefix}qkvg_proj.{kind}"
        if key not in state_dict:
            continue
        fused = state_dict.pop(key)
        for name, chunk in zip(module._part_names, fused.split(module.splits, dim=0)):
            state_dict[f"{prefix}{name}.{kind}"] = chunk.clone()  # clone: a view would save the whole fused tensor


def _merge_state_dict(module: FusedGatedAttention, state_dict, prefix, local_metadata, strict, missing_keys,
                      unexpected_keys, error_msgs):
    for kind in ("weight", "bias"):
        keys = [f"{prefix}{name}.{kind}" for name in module._part_names]
        if all(k in state_dict for k in keys):
            state_dict[f"{prefix}qkvg_proj.{kind}"] = torch.cat([state_dict.pop(k) for k in keys], dim=0)


def fuse_qkv(model: nn.Module, fused_gate_mul: bool = True, separate_params: bool = False,
             strict: bool = True) -> nn.Module:
    """Convert every plain GatedAttention in `model` (in place) to FusedGatedAttention; returns the model.

    separate_params=False (inference, decode): one concatenated `qkvg_proj` Parameter, built once; do it after loading
    weights and before building the optimizer (the fused weight is a new Parameter). separate_params=True (what the
    trainer uses): the plain layer's Parameters are kept, with their names, and concatenated in every forward, so
    optimizer state, DDP/FSDP and checkpoints see exactly the plain model's parameters.
    strict=False leaves layers it cannot fuse (comparison mechanisms) plain and converts zero layers without error."""
    n = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is GatedAttention:
                if not strict and getattr(child, "mechanism", None) is not None:
                    continue
                setattr(parent, name, FusedGatedAttention(child, fused_gate_mul, separate_params))
                n += 1
    if n == 0 and strict:
        raise ValueError("fuse_qkv: no plain GatedAttention layer found (already fused, or not a gated_attention model)")
    return model


def unfuse_qkv(model: nn.Module) -> nn.Module:
    """Inverse of fuse_qkv (in place): plain layers with separate q/k/v/gate projections; returns the model."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, FusedGatedAttention):
                plain = GatedAttention(child.config, child.layer_idx).to(child.qkvg_proj.weight.device,
                                                                         child.qkvg_proj.weight.dtype)
                plain.load_state_dict(child.state_dict())
                if plain.gate is not None and hasattr(plain.gate, "proj"):
                    plain.gate.proj._is_gate_proj = True  # as GatedQwen3Model tags it (identity-init bookkeeping)
                plain.capture = child.capture
                setattr(parent, name, plain)
    return model



LOSS_CHUNK_BYTES = 256 * 2**20  # the (c, V) temporaries of one chunk of the loss, fp32 logits + their compute-dtype copy


def loss_chunk_tokens(vocab: int, compute_dtype: torch.dtype, chunk_bytes: int = LOSS_CHUNK_BYTES) -> int:
    """Tokens per chunk of `chunked_lm_loss`: as many as fit `chunk_bytes` of (c, V) temporaries (the fp32 logits,
    exponentiated in place, plus their copy in the compute dtype when it is not fp32). At Qwen3's 151,936-token
    vocabulary in bf16 that is 294 tokens (14 chunks per 4,096 tokens); a fixed ~2M-logit chunk was 32 (128)."""
    copy = 0 if compute_dtype == torch.float32 else torch.empty((), dtype=compute_dtype).element_size()
    per_token = vocab * (4 + copy)  # bytes of (1, V) temporaries
    return max(1, chunk_bytes // per_token)


def _accumulate_weight_grad(grad_w: torch.Tensor, g: torch.Tensor, hc: torch.Tensor) -> None:
    """grad_w (V, d) fp32 += g.T @ hc, without a (V, d) temporary where the GEMM can accumulate into grad_w itself:
    fp32 compute (addmm_ in place), CUDA half compute (addmm's fp32 out_dtype into grad_w). A CPU bf16 GEMM cannot
    write fp32, so there one (V, d) product per chunk is added (few chunks: loss_chunk_tokens)."""
    if g.dtype == torch.float32:
        grad_w.addmm_(g.t(), hc)
    elif g.is_cuda:
        torch.addmm(grad_w, g.t(), hc, out_dtype=torch.float32, out=grad_w)
    else:
        grad_w += g.t() @ hc


def _valid_targets(tc: torch.Tensor, ignore_index: int):
    """(which targets count (c,), the targets with ignored ones set to 0 so they can index a row)."""
    valid = tc != ignore_index
    return valid, torch.where(valid, tc, torch.zeros_like(tc))


def _chunk_ce(hc: torch.Tensor, w: torch.Tensor, tc: torch.Tensor, ignore_index: int):
    """One chunk's cross-entropy per token (0 where ignored), and what its gradient reuses: (ce (c,), exp(logit -
    max) (c, V) fp32, its row sums z (c,), the valid mask (c,), the targets with ignored ones set to 0 (c,))."""
    logits = (hc @ w.t()).float()  # (c, V): fp32 only for the log-sum-exp, as transformers does
    valid, safe = _valid_targets(tc, ignore_index)
    picked = logits.gather(1, safe[:, None]).squeeze(1)  # (c,)
    top = logits.amax(dim=-1)  # (c,)
    # one exp pass serves both the loss (log of its row sum) and the gradient (the softmax itself)
    e = logits.sub_(top[:, None]).exp_()  # (c, V) = exp(logit - max), in place
    z = e.sum(dim=-1)  # (c,)
    lse = top + z.log()
    return torch.where(valid, lse - picked, torch.zeros_like(lse)), e, z, valid, safe


def _ce_and_grad(logits: torch.Tensor, safe: torch.Tensor, valid: torch.Tensor, w_tok: torch.Tensor):
    """One chunk's math after its GEMM, written out of place for the compiler: logits (c, V) in the compute dtype ->
    (CE per token (c,) fp32, 0 where ignored; (softmax - onehot) * w_tok (c, V) in the compute dtype). Inductor fuses
    the fp32 cast, max, exp, sum and the gradient's scale, scatter and cast into passes over the logits that keep no
    fp32 (c, V) temporary: what `_chunk_ce` and the eager gradient below do in place, pass by pass."""
    x = logits.float()  # (c, V): fused away by the compiler
    top = x.amax(dim=-1, keepdim=True)  # (c, 1)
    e = (x - top).exp()  # (c, V)
    z = e.sum(dim=-1)  # (c,)
    lse = top.squeeze(1) + z.log()
    picked = x.gather(1, safe[:, None]).squeeze(1)  # (c,)
    ce = torch.where(valid, lse - picked, torch.zeros_like(lse))
    g = (e * (w_tok / z)[:, None]).scatter_add(1, safe[:, None], -w_tok[:, None])  # (c, V)
    return ce, g.to(logits.dtype)


_COMPILED_MATH = None  # the compiled `_ce_and_grad` while a compiled training forward is open (use_compiled_math)


@contextmanager
def use_compiled_math(fn):
    """While open, the training loss's per-chunk math after each GEMM runs `fn` (torch.compile of `_ce_and_grad`, the
    trainer's compiled step: train/fastpath.py) instead of the eager in-place passes; None leaves them eager."""
    global _COMPILED_MATH
    before, _COMPILED_MATH = _COMPILED_MATH, fn
    try:
        yield
    finally:
        _COMPILED_MATH = before


class _ChunkedLinearCE(torch.autograd.Function):
    """sum over valid tokens of CE(hidden @ weight.T, targets) / denom, gradients computed in the same pass."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, denom, chunk: int, ignore_index: int, compute_dtype, want_grad: bool):
        n = hidden.shape[0]
        with torch.autocast(hidden.device.type, enabled=False):  # dtypes are explicit below
            h = hidden.to(compute_dtype)  # (N, d)
            w = weight.to(compute_dtype)  # (V, d)
            total = torch.zeros((), dtype=torch.float32, device=hidden.device)
            grad_h = torch.empty_like(h) if want_grad else None  # (N, d)
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_grad else None
            math = _COMPILED_MATH if want_grad else None  # the compiled step's fused passes, or the eager ones
            for s in range(0, n, chunk):
                hc, tc = h[s:s + chunk], targets[s:s + chunk]  # (c, d), (c,)
                if math is not None:
                    valid, safe = _valid_targets(tc, ignore_index)
                    ce, g = math(hc @ w.t(), safe, valid, valid.to(torch.float32) / denom)  # (c,), (c, V)
                else:
                    ce, e, z, valid, safe = _chunk_ce(hc, w, tc, ignore_index)
                    if want_grad:
                        w_tok = valid.to(e.dtype) / denom  # (c,) per-token weight; ignored tokens contribute nothing
                        e.mul_((w_tok / z)[:, None])  # softmax * weight, one pass
                        e.scatter_add_(1, safe[:, None], -w_tok[:, None])  # (softmax - onehot) * weight
                        g = e.to(compute_dtype)  # (c, V)
                total = total + ce.sum()
                if want_grad:
                    grad_h[s:s + chunk] = g @ w
                    _accumulate_weight_grad(grad_w, g, hc)  # (V, d), accumulated in fp32 across chunks
            loss = total / denom
        if want_grad:
            ctx.save_for_backward(grad_h, grad_w)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        hd, wd = ctx.dtypes
        return ((grad_h * grad_loss).to(hd), (grad_w * grad_loss).to(wd), None, None, None, None, None, None)


def chunked_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                    num_items_in_batch: torch.Tensor | int | None = None, ignore_index: int = -100,
                    chunk_tokens: int | None = None, chunk_bytes: int | None = None,
                    reduction: str = "mean") -> torch.Tensor:
    """Mean cross-entropy of (hidden @ weight.T) against `targets` (already aligned: position t predicts targets[t]).

    hidden (..., d), targets (...) with `ignore_index` for positions without a target. Divides by the number of valid
    targets, or by `num_items_in_batch` when given (transformers' convention for gradient accumulation). The matmul runs
    in the autocast dtype when autocast is on (as lm_head would), the log-sum-exp in fp32. Chunks of `chunk_tokens`,
    or by default as many tokens as fit `chunk_bytes` (default LOSS_CHUNK_BYTES) of (c, V) temporaries
    (loss_chunk_tokens). reduction="none": each position's loss (targets' shape, fp32, 0 where ignored), without
    gradient (evaluation: train/evaluate.py)."""
    d = hidden.shape[-1]
    h = hidden.reshape(-1, d)  # (N, d)
    t = targets.reshape(-1).to(h.device)  # (N,)
    if t.shape[0] != h.shape[0]:
        raise ValueError(f"chunked_lm_loss: {h.shape[0]} positions but {t.shape[0]} targets")
    dev = h.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else h.dtype
    if num_items_in_batch is None:
        denom = (t != ignore_index).sum().to(torch.float32)
    else:
        denom = torch.as_tensor(num_items_in_batch, device=h.device).to(torch.float32)
    chunk = chunk_tokens or loss_chunk_tokens(weight.shape[0], dtype, chunk_bytes or LOSS_CHUNK_BYTES)
    if reduction == "none":
        if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
            raise ValueError("chunked_lm_loss(reduction='none') has no backward; call it under torch.no_grad()")
        with torch.autocast(dev, enabled=False):
            w = weight.to(dtype)  # (V, d)
            per_token = torch.cat([_chunk_ce(h[s:s + chunk].to(dtype), w, t[s:s + chunk], ignore_index)[0]
                                   for s in range(0, h.shape[0], chunk)])  # (N,)
        return per_token.view(targets.shape)
    if reduction != "mean":
        raise ValueError(f"chunked_lm_loss: reduction={reduction!r}; use 'mean' or 'none'")
    want_grad = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    return _ChunkedLinearCE.apply(h, weight, t, denom, chunk, ignore_index, dtype, want_grad)


def shift_for_loss(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """transformers' label convention: labels are the inputs; position t is scored against labels[t + 1]."""
    return torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]  # (B, T)


def reference_lm_loss(hidden, weight, targets, num_items_in_batch=None, ignore_index: int = -100):
    """The plain path chunked_lm_loss replaces: full logits through a linear, fp32 cross-entropy (transformers')."""
    logits = torch.nn.functional.linear(hidden, weight).float()  # (..., V)
    red = "sum" if num_items_in_batch is not None else "mean"
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                             ignore_index=ignore_index, reduction=red)
    return loss / num_items_in_batch if num_items_in_batch is not None else loss


__all__ = ["fuse_qkv", "unfuse_qkv", "fused_sigmoid_mul", "FusedGatedAttention", "chunked_lm_loss", "shift_for_loss",
           "reference_lm_loss", "loss_chunk_tokens", "LOSS_CHUNK_BYTES"]
