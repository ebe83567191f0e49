"""`gattn plan`'s activation model: what a decoder layer saves for backward per micro-batch, under each
activation checkpointing mode, and the recompute it costs (calibrated against the storages autograd really saves:
tests/test_plan.py). plan.py re-exports every name, so `plan.activation_bytes` and the rest keep their home there."""
from __future__ import annotations

from .config import checkpointing_mode

# Bytes per token one decoder layer saves for backward (unique storages), eager, as counted with
# torch.autograd.graph.saved_tensors_hooks on this project's layers while varying one width at a time (d hidden,
# q = H*D, kv = KV*D, f FFN width, H / KV heads). fp32: 6d + 4q + 4kv + 4f + 2H + KV + 2 elements (the RMSNorm input,
# its normalised value and output, the fused q/k/v output, QK-norm's, RoPE's and sdpa's q/k/out, the log-sum-exp,
# SwiGLU's gate/up/act/product); bf16-params: the same in bf16 plus the fp32 copies RMSNorm and QK-norm compute in;
# bf16 autocast: fp32 residual-side tensors, bf16 matmul outputs.
LAYER_COEF = {  # precision -> bytes per token per unit of (d, q, kv, f, H, KV, 1)
    "fp32": (24, 16, 16, 16, 8, 4, 8),
    "bf16-params": (16, 16, 14, 8, 8, 4, 8),
    "bf16": (22, 14, 12, 8, 8, 4, 8),
}
GATE_COEF = {"fp32": (4, 4), "bf16-params": (2, 4), "bf16": (2, 4)}  # G1 gate: bytes per (score width g, q)
# Under expert parallelism a rank computes the rows its experts are sent, which the router does not balance exactly
# (routing is not capped: train/expert_parallel.py); the plan allows its MoE layers' routed rows this factor over the
# balanced k per token - the capacity factor 1.25 of GShard / Switch Transformer (Lepikhin et al. 2020, Fedus et
# al. 2021) as an allowance, not a cap.
ROUTED_ALLOWANCE = 1.25
REST_COEF = {"fp32": (12, 4), "bf16-params": (8, 2), "bf16": (10, 4)}  # final norm + loss input: per (d, D), + 12


def _gate_width(config) -> int:
    from gated_attention.gates import get_gate

    spec = get_gate(config.gate)
    d, H, KV, D = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
    return spec.score_width(d, H, KV, D) if spec is not None and spec.source.value == "input" else 0


def layer_activation_bytes(config, layer_idx: int, tokens: int, precision: str, fused: bool = True,
                           routed: float = 1.0) -> dict:
    """What decoder layer `layer_idx` saves for backward over a micro-batch of `tokens` tokens (LAYER_COEF; a G1
    gate adds its logits and the gated output): `per_token` x tokens, plus `weights`, the weight-sized tensors a
    forward keeps (the fast path's concatenated q/k/v/gate weight; under autocast the bf16 copy of every weight it
    cast). An MoE layer replaces the SwiGLU's 4f by the router's logits and probabilities (8 B per expert) and, per
    routed slot (k per token), the token's copy in and out of its expert (2d) and the expert's gate/up/act/product
    (4I), plus 32 B of indices and weights; `routed` scales the routed slots (ROUTED_ALLOWANCE under expert
    parallelism, where a rank computes the rows its experts receive, not its own tokens' k)."""
    d, H, KV, D = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
    q, kv, f = H * D, KV * D, config.intermediate_size
    g = _gate_width(config)
    cd, cq, ckv, cf, cH, cKV, c0 = LAYER_COEF[precision]
    ab = 4 if precision == "fp32" else 2  # bytes of the FFN's matmul outputs
    moe = config.is_moe_layer(layer_idx)
    per_token = cd * d + cq * q + ckv * kv + cH * H + cKV * KV + c0
    if g:
        per_token += GATE_COEF[precision][0] * g + GATE_COEF[precision][1] * q
    if moe:
        k, E, I = config.num_experts_per_tok, config.num_experts, config.moe_intermediate_size
        per_token += 8 * E + round(routed * k * ((2 * d + 4 * I) * ab + 32)) + 8
        ffn_weights = 3 * d * I * E + d * E  # autocast casts the fused expert tensors whole, and the router
    else:
        per_token += cf * f
        ffn_weights = 3 * d * f
    qkv_weights = (q + 2 * kv + g) * d
    if precision == "bf16":  # autocast's cache: a bf16 copy of every weight cast, held by the graph until backward
        weights = 2 * (qkv_weights + q * d + ffn_weights)
    else:
        weights = qkv_weights * (4 if precision == "fp32" else 2) if fused else 0
    return {"per_token": per_token, "tokens": tokens, "weights": weights, "total": per_token * tokens + weights}


def selective_layer_bytes(config, layer_idx: int, tokens: int, precision: str, routed: float = 1.0,
                          ep: int = 1) -> int:
    """What decoder layer `layer_idx` keeps under `activation_checkpointing=selective` (activation_checkpoint.SELECTIVE_SAVES)
    over `tokens` tokens: its input (the residual stream's dtype) and the outputs of its GEMMs and attention kernel,
    per token: the fused q/k/v(/G1 gate) projection q + 2kv + g, o_proj d, the attention output q and its fp32
    log-sum-exp H, then the SwiGLU's gate, up and down projections 2f + d, or an MoE layer's fp32 router logits E and
    per routed slot the experts' gate/up and down projections k (2I + d) (a shared expert: 2s + d + 1 more), and under
    expert parallelism (`ep` > 1) the all-to-alls' outputs, the rows received for the local experts and the rows
    returned, k (d + d) (the routed ones scaled by `routed`). GEMM and
    attention outputs are in the compute dtype (fp32, or bf16 as a GPU writes them; the bf16 GEMM emulation of
    AVX2-only CPUs keeps its fp32 GEMM outputs instead, twice that)."""
    d, H, KV, D = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
    q, kv = H * D, KV * D
    stream = 2 if precision == "bf16-params" else 4  # the residual stream: bf16 only under bf16-params
    ab = 4 if precision == "fp32" else 2  # GEMM and attention outputs
    elements = (q + 2 * kv + _gate_width(config)) + d + q  # projections, o_proj, attention output
    per_token = stream * d + 4 * H  # the input, the fp32 log-sum-exp
    if config.is_moe_layer(layer_idx):
        k, I = config.num_experts_per_tok, config.moe_intermediate_size
        s = int(getattr(config, "shared_expert_intermediate_size", 0) or 0)
        elements += round(routed * k * (2 * I + d)) + (2 * s + d + 1 if s else 0)
        if ep > 1:
            elements += round(routed * k * d) + k * d
        per_token += 4 * config.num_experts  # the router GEMM runs in fp32
    else:
        elements += 2 * config.intermediate_size + d
    return (per_token + ab * elements) * tokens


def checkpointed_layers(config, checkpointing: str) -> list[int]:
    """The decoder layers `checkpointing` recomputes in backward (config.checkpointing_mode): all of them under
    "full" and "selective", layers 0, N, 2N, ... under "every:N", none under "none"."""
    kind, every = checkpointing_mode(checkpointing)
    return [] if kind == "none" else list(range(0, config.num_hidden_layers, every))


def activation_bytes(config, tokens: int, precision: str, checkpointing: str, fused_loss: bool = True,
                     routed: float = 1.0, ep: int = 1) -> dict:
    """Saved activations of a micro-batch of `tokens` tokens: `saved_layers` (what every layer keeps through the
    forward, `layer_kept_bytes`, plus, under checkpointing, the largest checkpointed layer's activations: one layer
    is recomputed at a time), `rest` (the final norm and the loss: the fused loss computes its gradients in the
    forward and keeps its fp32 (V, d) head gradient; the plain loss keeps fp32 logits), and `working`: the backward's
    own memory, estimated as one layer's activations and two gradients of the residual stream. `routed`: the MoE
    layers' routed rows per token slot (layer_activation_bytes); `ep`: the expert-parallel degree."""
    L, d, V, D = config.num_hidden_layers, config.hidden_size, config.vocab_size, config.head_dim
    layers = [layer_activation_bytes(config, i, tokens, precision, fused_loss, routed)["total"] for i in range(L)]
    recomputed = checkpointed_layers(config, checkpointing)
    saved = sum(layer_kept_bytes(config, i, tokens, precision, checkpointing, fused_loss, routed, ep)
                for i in range(L))
    saved += max((layers[i] for i in recomputed), default=0)
    cd, cD = REST_COEF[precision]
    rest = tokens * (cd * d + cD * D + 12)
    rest += V * d * 4 if fused_loss else tokens * (4 * V + 8)
    working = max(layers) + 2 * tokens * d * 4
    return {"saved_layers": saved, "rest": rest, "working": working, "total": saved + rest + working}


def layer_kept_bytes(config, layer_idx: int, tokens: int, precision: str, checkpointing: str,
                     fused_loss: bool = True, routed: float = 1.0, ep: int = 1) -> int:
    """What decoder layer `layer_idx` keeps from its forward until its backward under `checkpointing`: everything
    it saves (`layer_activation_bytes`) when it is not checkpointed, its input alone (the residual stream's dtype)
    under full checkpointing, its input and GEMM / attention outputs under "selective" (`selective_layer_bytes`)."""
    if layer_idx not in checkpointed_layers(config, checkpointing):
        return layer_activation_bytes(config, layer_idx, tokens, precision, fused_loss, routed)["total"]
    if checkpointing_mode(checkpointing)[0] == "selective":
        return selective_layer_bytes(config, layer_idx, tokens, precision, routed, ep)
    return tokens * config.hidden_size * (2 if precision == "bf16-params" else 4)


def recompute_share(config, checkpointing: str) -> float:
    """The share of the layers' forward GEMM FLOPs the backward runs again: 1 under "full", the checkpointed
    layers' share under "every:N", 0 under "selective" (it keeps every GEMM's output; what it recomputes, norms,
    RoPE, gates and activations, are not counted in FLOPs) and "none"."""
    if checkpointing_mode(checkpointing)[0] == "selective":
        return 0.0
    return len(checkpointed_layers(config, checkpointing)) / config.num_hidden_layers
