"""The same model through transformers' own code: stock `Qwen3ForCausalLM` for the ungated model and, for a G1
sigmoid gate, transformers' Qwen3 with the official fused layout (q_proj emits [q_h | g_h] per head, the gate is
applied to the SDPA output before o_proj), built by subclassing `Qwen3Attention`. Weights are copied from ours, so
both compute the same function (`hf_from_ours` checks logits match in fp32) and speed ratios compare code, not math.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers import Qwen3Config, Qwen3ForCausalLM
from transformers.models.qwen3 import modeling_qwen3 as hq

from gated_attention.gates import Activation, Combine, Granularity, Position, Sharing, Source, get_gate


class OfficialLayoutGatedAttention(hq.Qwen3Attention):
    """Qwen3Attention whose q_proj also emits the G1 gate logits: per head [q (D) | g (D elementwise, 1 headwise)]."""

    def __init__(self, config, layer_idx: int, gate_per_head: int):
        super().__init__(config, layer_idx)
        self.gate_per_head = gate_per_head
        H = config.num_attention_heads
        self.q_proj = nn.Linear(config.hidden_size, H * (self.head_dim + gate_per_head), bias=config.attention_bias)

    def forward(self, hidden_states, position_embeddings, attention_mask, cache=None, **kwargs):
        input_shape = hidden_states.shape[:-1]
        qg = self.q_proj(hidden_states).view(*input_shape, -1, self.head_dim + self.gate_per_head)  # (B, T, H, D+g)
        q, gate = qg.split([self.head_dim, self.gate_per_head], dim=-1)
        q = self.q_norm(q).transpose(1, 2)  # (B, H, T, D)
        k = self.k_norm(self.k_proj(hidden_states).view(*input_shape, -1, self.head_dim)).transpose(1, 2)
        v = self.v_proj(hidden_states).view(*input_shape, -1, self.head_dim).transpose(1, 2)  # (B, KV, T, D)
        cos, sin = position_embeddings
        q, k = hq.apply_rotary_pos_emb(q, k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
        interface = hq.ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                            hq.eager_attention_forward)
        out, weights = interface(self, q, k, v, attention_mask, dropout=0.0 if not self.training else
                                 self.attention_dropout, scaling=self.scaling, sliding_window=self.sliding_window,
                                 **kwargs)  # (B, T, H, D)
        out = out * torch.sigmoid(gate)  # G1
        return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights


def hf_config(cfg) -> Qwen3Config:
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "initializer_range",
            "rms_norm_eps", "tie_word_embeddings", "rope_parameters", "attention_bias", "attention_dropout",
            "pad_token_id", "bos_token_id", "eos_token_id")
    return Qwen3Config(**{k: getattr(cfg, k) for k in keys})


def hf_from_ours(model, check: bool = True) -> Qwen3ForCausalLM:
    """transformers' implementation of `model` (ours) with the same weights, same attention backend."""
    cfg = model.config
    spec = get_gate(cfg.gate)
    if cfg.num_experts or not cfg.use_qk_norm:
        raise ValueError("hf_from_ours supports dense models with QK-norm (stock Qwen3)")
    if spec is not None and not (spec.position is Position.SDPA and spec.source is Source.INPUT
                                 and spec.activation is Activation.SIGMOID and spec.combine is Combine.MULTIPLY
                                 and spec.sharing is Sharing.HEAD_SPECIFIC and cfg.gate_init == "normal"):
        raise ValueError(f"hf_from_ours: gate {cfg.gate!r} has no transformers counterpart here; use baseline, "
                         f"sdpa_elementwise or sdpa_headwise")
    hcfg = hf_config(cfg)
    hcfg._attn_implementation = cfg._attn_implementation or "sdpa"
    hf = Qwen3ForCausalLM(hcfg)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    if spec is not None:
        H, D = cfg.num_attention_heads, cfg.head_dim
        g = D if spec.granularity is Granularity.ELEMENTWISE else 1
        for i, layer in enumerate(hf.model.layers):
            layer.self_attn = OfficialLayoutGatedAttention(hcfg, i, g)
            p = f"model.layers.{i}.self_attn."
            for kind in ("weight", "bias"):
                if p + "q_proj." + kind not in sd:
                    continue
                q = sd.pop(p + "q_proj." + kind).view(H, D, -1)  # (H, D, d) or (H, D, 1) for a bias
                gw = sd.pop(p + "gate.proj." + kind).view(H, g, -1)  # (H, g, d)
                sd[p + "q_proj." + kind] = torch.cat([q, gw], dim=1).reshape(H * (D + g), -1).squeeze(-1)
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    missing = [k for k in missing if k != "lm_head.weight" or not cfg.tie_word_embeddings]
    if missing or unexpected:
        raise RuntimeError(f"weight transfer to transformers failed: missing {missing}, unexpected {unexpected}")
    if cfg.tie_word_embeddings:
        hf.tie_weights()
    hf.to(next(model.parameters()).dtype).train(model.training)
    if check:
        with torch.no_grad():
            x = torch.randint(0, cfg.vocab_size, (1, 16))
            a, b = model.float()(x).logits, hf.float()(x).logits
            if not torch.allclose(a, b, atol=1e-4, rtol=1e-4):
                raise RuntimeError(f"transformers copy differs from ours: max |diff| {(a - b).abs().max():.3g}")
    return hf
