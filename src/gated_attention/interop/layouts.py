"""The checkpoint formats interop knows, declared as data: `FORMATS`, one `Layout` row per foreign format (how it
differs from native), the key patterns the state maps use, and the config keys every format shares. The format
descriptions and the choices made where the official code leaves them open are in interop/__init__.py.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

class ConversionError(ValueError):
    """A checkpoint that cannot be converted; the message names the key, shapes or reason and the fix."""


@dataclass(frozen=True)
class Layout:
    """How one external format differs from native. Everything not declared here is copied under its own name."""
    model_type: str  # config.json model_type this format carries
    fused_q: str | None  # None: gate (if any) separate | "per_kv_group" (official) | "per_head" (Qwen3-Next)
    gates: tuple[str, ...]  # native gate names this format can express
    zero_centred_norms: bool  # RMSNorm weights stored as w - 1 (applied as 1 + w)
    needs_qk_norm: bool  # the format has no switch to turn QK-norm off
    architecture: str  # architectures[0] written to config.json
    partial_rope: bool  # can rotate only part of head_dim (partial_rotary_factor < 1)
    moe: bool = False  # holds Qwen3-MoE layers (per-expert keys on write, per-expert or fused on read)
    llama_family: bool = False  # config and bias rules declared in llama.FAMILIES (no QK-norm, no gate)


LAYOUTS: dict[str, Layout] = {
    "official": Layout("qwen3", "per_kv_group", ("none", "sdpa_elementwise", "sdpa_headwise"), False, False,
                       "Qwen3ForCausalLM", False),
    "qwen3": Layout("qwen3", None, ("none",), False, True, "Qwen3ForCausalLM", False),
    "qwen3-moe": Layout("qwen3_moe", None, ("none",), False, True, "Qwen3MoeForCausalLM", False, moe=True),
    "qwen3-next": Layout("qwen3_next", "per_head", ("sdpa_elementwise",), True, True, "Qwen3NextForCausalLM", True),
    "llama": Layout("llama", None, ("none",), False, False, "LlamaForCausalLM", False, llama_family=True),
    "mistral": Layout("mistral", None, ("none",), False, False, "MistralForCausalLM", False, llama_family=True),
    "qwen2": Layout("qwen2", None, ("none",), False, False, "Qwen2ForCausalLM", False, llama_family=True),
}
FORMATS = ("native", *LAYOUTS)  # every format `gattn convert` reads and writes: native plus one row each above
# what `gattn retrofit` can add a gate to: the formats that can hold an ungated model (auto = read config.json)
UNGATED_SOURCES = ("auto", "native", *(name for name, layout in LAYOUTS.items() if "none" in layout.gates))

# Every RMSNorm weight (Qwen3-Next stores them all zero-centred).
NORM_KEY = re.compile(r"(^model\.norm|\.input_layernorm|\.post_attention_layernorm|\.q_norm|\.k_norm)\.weight$")
Q_KEY = re.compile(r"^model\.layers\.(\d+)\.self_attn\.q_proj\.(weight|bias)$")
GATE_KEY = "model.layers.{i}.self_attn.gate.proj.{p}"
# One expert's projection in the per-expert (pre-5.x / save_pretrained) Qwen3-MoE layout.
EXPERT_KEY = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
# Qwen3-MoE config keys carried 1:1 (the expert count separately: it has two spellings).
MOE_KEYS = ("num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "router_aux_loss_coef",
            "decoder_sparse_step", "mlp_only_layers")

# Official config defaults (Qwen3Config.__init__ of the official code, paper map §1.2) for keys a saved config may omit.
OFFICIAL_DEFAULTS = dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=32, head_dim=128, hidden_act="silu",
                         max_position_embeddings=32768, initializer_range=0.02, rms_norm_eps=1e-6, use_cache=True,
                         tie_word_embeddings=False, rope_theta=10000.0, rope_scaling=None, use_sliding_window=False,
                         sliding_window=4096, max_window_layers=28, attention_dropout=0.0, use_qk_norm=True,
                         elementwise_attn_output_gate=False, headwise_attn_output_gate=False)
# Keys carried 1:1 between an external config and the native one (same name and meaning everywhere).
SHARED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "initializer_range",
               "rms_norm_eps", "use_cache", "tie_word_embeddings", "attention_dropout", "pad_token_id",
               "bos_token_id", "eos_token_id")


def get_layout(fmt: str) -> Layout:
    """The Layout row of foreign format `fmt` (one clear error for an unknown name)."""
    if fmt not in LAYOUTS:
        raise ConversionError(f"unknown checkpoint format {fmt!r}; valid: {', '.join(FORMATS)}")
    return LAYOUTS[fmt]


