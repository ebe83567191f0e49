"""A small, independent re-implementation of the OFFICIAL gated-attention forward (qiuzh20/gated_attention), for tests.

The official code is not available offline (and does not import under transformers 5.x), so the parity tests compare
converted checkpoints against this function instead. It works directly on an official-format config dict and state
dict and follows paper map §1.3 step by step, sharing no code with the native model or the converter:
  fused q_proj output viewed per KV group and split [G*D | G*gw] (the official `view(b, s, KV, -1)` + `split`),
  QK-norm (fp32 RMSNorm, cast back, * weight) before RoPE, default rotate_half RoPE over the full head_dim,
  repeat_interleave for GQA, eager softmax in fp32 with a causal mask, `y * sigmoid(gate)` on the (b, s, H, D) layout,
  then o_proj; pre-norm decoder layers with a SwiGLU MLP; tied or untied lm_head.
Only default RoPE (rope_theta, no rope_scaling) is supported: that is what the released checkpoints use.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def _lin(x, sd, name):
    return F.linear(x, sd[name + ".weight"], sd.get(name + ".bias"))


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def official_split(qg: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, gate_width: int):
    """The official per-KV-group split of the fused q_proj output (b, s, rows) -> query (b, s, H, D), gate (b, s, H, gw)."""
    b, s, _ = qg.shape
    G = num_heads // num_kv_heads
    qg = qg.view(b, s, num_kv_heads, G * head_dim + G * gate_width)  # (b, s, KV, G*D + G*gw)
    q, g = torch.split(qg, [G * head_dim, G * gate_width], dim=-1)
    return q.reshape(b, s, num_heads, head_dim), g.reshape(b, s, num_heads, gate_width)


def official_forward(config: dict, state: dict, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits (b, s, V) of an official-format checkpoint (config.json dict + state dict) for `input_ids` (b, s)."""
    if config.get("rope_scaling"):
        raise ValueError("official_forward implements default RoPE only; rope_scaling must be None")
    H, KV, D = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    eps, theta = config.get("rms_norm_eps", 1e-6), config.get("rope_theta", 10000.0)
    gw = 1 if config.get("headwise_attn_output_gate") else D if config.get("elementwise_attn_output_gate") else 0
    qk_norm = config.get("use_qk_norm", True)
    b, s = input_ids.shape
    x = F.embedding(input_ids, state["model.embed_tokens.weight"])  # (b, s, d)
    inv_freq = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D))  # (D/2,)
    freqs = torch.arange(s, dtype=torch.float32)[:, None] * inv_freq[None]  # (s, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (s, D)
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = _rms(x, state[p + "input_layernorm.weight"], eps)
        qg = _lin(h, state, p + "self_attn.q_proj")  # (b, s, H*D + H*gw), fused per KV group
        if gw:
            q, gate = official_split(qg, H, KV, D, gw)  # (b, s, H, D), (b, s, H, gw)
        else:
            q, gate = qg.view(b, s, H, D), None
        k = _lin(h, state, p + "self_attn.k_proj").view(b, s, KV, D)
        v = _lin(h, state, p + "self_attn.v_proj").view(b, s, KV, D)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (b, heads, s, D)
        if qk_norm:
            q = _rms(q, state[p + "self_attn.q_norm.weight"], eps)
            k = _rms(k, state[p + "self_attn.k_norm.weight"], eps)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        k = k.repeat_interleave(H // KV, dim=1)  # (b, H, s, D): query head h reads KV head h // G
        v = v.repeat_interleave(H // KV, dim=1)
        scores = (q @ k.transpose(2, 3)) / (D ** 0.5)  # (b, H, s, s)
        scores = scores.masked_fill(~causal, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        y = (probs @ v).transpose(1, 2)  # (b, s, H, D)
        if gate is not None:
            y = y * torch.sigmoid(gate)  # gate (b, s, H, D) or (b, s, H, 1), model dtype
        x = x + _lin(y.reshape(b, s, H * D), state, p + "self_attn.o_proj")
        h = _rms(x, state[p + "post_attention_layernorm.weight"], eps)
        mlp = _lin(F.silu(_lin(h, state, p + "mlp.gate_proj")) * _lin(h, state, p + "mlp.up_proj"), state,
                   p + "mlp.down_proj")
        x = x + mlp
    x = _rms(x, state["model.norm.weight"], eps)
    head = state["model.embed_tokens.weight"] if config.get("tie_word_embeddings") else state["lm_head.weight"]
    return F.linear(x, head)  # (b, s, V)
