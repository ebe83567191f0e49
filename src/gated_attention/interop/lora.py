"""LoRA that knows the gate: PEFT (`peft` on PyPI, the `lora` extra) on our models, with the gate's projection as its
own target, and a native adapter's q + gate pair rewritten for a fused [q | gate] layout.

In the native layout the G1 gate is its own module (`self_attn.gate.proj`, H*D or H rows), so a LoRA on it has its
own A/B of the right width: nothing is sized from q_proj (the SGLang undersized-buffer bug) and nothing is split by
a flat half (the engines that split q/gate flat instead of per head). Layouts that fuse the gate into q_proj
(Qwen3-Next per head, official per KV group) need ONE adapter on the fused projection; `fused_lora` builds it exactly:
    A_fused = [A_q ; A_g]                 (r_q + r_g, d)
    B_fused = P [[s_q B_q, 0], [0, s_g B_g]]   (2HD or HD + H rows, r_q + r_g), P the layout's row permutation,
so B_fused A_fused = P [s_q B_q A_q ; s_g B_g A_g]: the fused projection's update is the two native updates, row for
row where the layout puts them (s = alpha / r, PEFT's scaling, folded into B; the fused adapter's own scaling is 1).
"""
from __future__ import annotations

import torch

from .layouts import ConversionError, get_layout
from .states import fused_q_rows

# --lora target name -> the module-name suffix PEFT matches (Qwen3 names; the gate is its own module)
LORA_TARGETS: dict[str, str] = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate.proj",
                                "mlp_gate": "mlp.gate_proj", "mlp_up": "mlp.up_proj", "mlp_down": "mlp.down_proj"}


def add_lora(model, targets=("q", "gate"), r: int = 8, alpha: float = 16.0, dropout: float = 0.0, seed: int = 0):
    """`model` wrapped by PEFT with LoRA adapters on `targets` (names of LORA_TARGETS); only the adapters train.
    The gate is a separate target: ("q", "gate") adapts both, ("q",) leaves the gate as trained."""
    from peft import LoraConfig, get_peft_model

    unknown = [t for t in targets if t not in LORA_TARGETS]
    if unknown:
        raise ValueError(f"unknown LoRA target(s) {unknown}; valid: {', '.join(LORA_TARGETS)}")
    if "gate" in targets and getattr(model.config, "gate", "none") == "none":
        raise ValueError("LoRA target 'gate' on an ungated model: it has no gate projection; drop 'gate'")
    torch.manual_seed(seed)  # PEFT's A init (kaiming) draws from the global RNG; B starts at zero
    cfg = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, bias="none",
                     target_modules=[LORA_TARGETS[t] for t in targets])
    return get_peft_model(model, cfg)


def _ab(layer) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(A (r, in), B (out, r), scaling) of a PEFT LoRA layer's default adapter."""
    name = layer.active_adapters[0]
    return layer.lora_A[name].weight.detach(), layer.lora_B[name].weight.detach(), float(layer.scaling[name])


def fused_lora(peft_model, layout: str = "qwen3-next") -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per layer i: (A_fused, B_fused) of one adapter on the fused q_proj of `layout` (scaling 1), equal to the
    native q and gate adapters together (module docstring). Layers with no adapter on q or the gate get a zero one."""
    fmt = get_layout(layout)
    if fmt.fused_q is None:
        raise ConversionError(f"layout {layout!r} keeps the gate apart from q_proj; the native adapters apply as they are")
    cfg = peft_model.config
    H, KV, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    out = {}
    for i, layer in enumerate(peft_model.base_model.model.model.layers):
        attn = layer.self_attn
        parts = []
        for mod, rows in ((attn.q_proj, H * D), (attn.gate.proj, attn.gate.width)):
            if hasattr(mod, "lora_A"):
                a, b, s = _ab(mod)
                parts.append((a, b * s))
            else:  # no adapter on this projection: a rank-1 zero update keeps the block shapes
                parts.append((torch.zeros(1, cfg.hidden_size), torch.zeros(rows, 1)))
        (a_q, b_q), (a_g, b_g) = parts
        width = b_g.shape[0] // H  # D (elementwise) or 1 (headwise)
        idx = fused_q_rows(fmt.fused_q, H, KV, D, width)
        b_stack = torch.block_diag(b_q, b_g)  # (HD + H*width, r_q + r_g): native [q rows ; gate rows]
        out[i] = (torch.cat([a_q, a_g], 0).contiguous(), b_stack[idx].contiguous())
    return out
