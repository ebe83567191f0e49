"""Model shape presets (the paper's Table 7 shapes and tiny CPU shapes) and the analytic parameter count.

`model_config(name, gate=...)` returns a `GatedQwen3Config`. For dense shapes, gated variants shrink the FFN width so
the total parameter count matches the ungated model within 0.1 % (as the paper's dense runs do, paper map §4); the MoE
shape keeps its FFN and reports the gate as added parameters (as the paper's MoE tables do). The shrunk width is
rounded to a multiple of the preset's `FFN_MULTIPLE` where that keeps the 0.1 % (`parity_width`): GEMMs of odd
widths run slower per FLOP (docs/performance.md).
"""
from __future__ import annotations

from .gates import get_gate

# the config class (transformers) and the mechanisms (torch) are imported inside the functions that build or size a
# model: PRESETS' names fill command-line parsers, which are built without either


def _tiny() -> dict:  # unit tests: ~30k parameters, GQA so the per-KV-group layouts are exercised
    return dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=512, tie_word_embeddings=True)


def _small() -> dict:  # CPU experiments (gattn compare): ~5M parameters with an 8k vocabulary
    return dict(vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=64, max_position_embeddings=4096, tie_word_embeddings=True)


def _dense_28l() -> dict:  # paper Table 7: 1.7B, 28 layers (= the public Qwen3-1.7B shape)
    return dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
                tie_word_embeddings=True, rms_norm_eps=1e-6)


def _dense_48l() -> dict:  # paper Table 7: 1.7B, 48 layers, d=1536 with H*D=2048 != d
    return {**_dense_28l(), "hidden_size": 1536, "intermediate_size": 4608, "num_hidden_layers": 48}


def _moe_15a2b() -> dict:  # paper Table 7: 15A2B MoE, 128 fine-grained experts top-8, untied
    return dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
                num_attention_heads=32, num_key_value_heads=4, head_dim=128, max_position_embeddings=4096,
                tie_word_embeddings=False, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                norm_topk_prob=True)


def _tiny_moe() -> dict:
    return {**_tiny(), "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}


def _small_moe() -> dict:
    return {**_small(), "num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 192}


PRESETS = {"tiny": _tiny, "small": _small, "1.7b-28l": _dense_28l, "1.7b-48l": _dense_48l, "15a2b": _moe_15a2b,
           "tiny-moe": _tiny_moe, "small-moe": _small_moe}
PARITY = 1e-3  # a gated dense model's total parameters stay within 0.1 % of the ungated model's
# the alignment a parity-shrunk FFN width aims for (parity_width); 1 = the exact width. GPU shapes: tensor-core GEMMs
# tile N by 64-128 and need multiples of 8 in bf16. The CPU presets keep exact widths: every lab's figures use them
FFN_MULTIPLE = {"1.7b-28l": 128, "1.7b-48l": 128}


def gate_params_per_layer(config: GatedQwen3Config) -> int:
    spec = get_gate(config.gate)
    if spec is None:
        return 0
    return spec.added_params(config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                             config.head_dim, bias=config.attention_bias)


def param_report(config: GatedQwen3Config) -> dict:
    """Analytic parameter counts: total, activated per token (MoE), and the parts. Equals sum(p.numel()).

    Convention (Qwen's): everything stored counts, input embedding and untied lm_head included; "activated" counts
    the router and the k routed experts in place of all E. With it the Qwen3-30B-A3B shape (this 15a2b shape at 48
    layers) gives 30.53B / 3.35B, Qwen's published 30.5B / 3.3B. The paper's 15A2B shape (paper map §4) gives 15.58B total
    / 1.99B activated (embedding 0.31B + lm_head 0.31B + 24 x (attention 18.9M + router 0.26M + 8 experts 37.7M);
    all 128 experts 604M per layer), consistent with its name "15A2B" but not with the 2.54B it prints. The 0.55B gap
    (23.0M per layer = 4.9 experts' worth) is not a counting convention: tying or dropping the input embedding lowers
    the count (1.68B); the elementwise G1 gate adds only 0.20B (2.19B). An unmentioned shared expert of width ~3.7k
    would fit (3072: 2.44B, 4096: 2.59B) but would raise the total to ~16.1B, further from "15B". The paper's own
    "+4 experts = +400M" is also below this formula's 453M (24 x 4 x 3 x 2048 x 768), so its parameter figures look
    loosely rounded; the most plausible reading is a shape detail Table 7 omits (shared/wider experts) or a typo."""
    d, H, KV, D, L = (config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                      config.num_hidden_layers)
    b = int(config.attention_bias)
    attn = d * H * D + 2 * d * KV * D + H * D * d + b * (H * D + 2 * KV * D + d) + (2 * D if config.use_qk_norm else 0)
    gate = gate_params_per_layer(config)
    dense_ffn = 3 * d * config.intermediate_size
    moe_total = moe_active = 0
    n_moe = sum(config.is_moe_layer(i) for i in range(L))
    if n_moe:
        expert = 3 * d * config.moe_intermediate_size
        shared = 3 * d * config.shared_expert_intermediate_size + (d if config.shared_expert_intermediate_size else 0)
        router = d * config.num_experts
        moe_total = router + config.num_experts * expert + shared
        moe_active = router + config.num_experts_per_tok * expert + shared
    norms = 2 * d
    embed = config.vocab_size * d
    head = 0 if config.tie_word_embeddings else config.vocab_size * d
    per_layer_common = attn + gate + norms
    total = embed + head + d + L * per_layer_common + (L - n_moe) * dense_ffn + n_moe * moe_total
    active = embed + head + d + L * per_layer_common + (L - n_moe) * dense_ffn + n_moe * moe_active
    return {"total": total, "activated": active, "embedding": embed, "lm_head": head, "attention_per_layer": attn,
            "gate_per_layer": gate, "gate_total": L * gate, "dense_ffn_per_layer": dense_ffn,
            "moe_layers": n_moe, "moe_total_per_layer": moe_total, "moe_activated_per_layer": moe_active,
            "non_embedding": total - embed - head}


def parity_width(base_width: int, extra: int, per_unit: int, base_total: int, multiple: int = 1) -> int:
    """The FFN width that gives back `extra` parameters (`per_unit` per unit of width), rounded to a multiple of the
    largest of multiple, multiple/2, multiple/4, ... (halving while even) whose rounding keeps the total within
    PARITY of `base_total`; none does: the exact width (nearest integer)."""
    exact = base_width - extra / per_unit
    m = multiple
    while m > 1:
        width = max(m, round(exact / m) * m)
        if abs(width - exact) * per_unit <= PARITY * base_total:
            return width
        m = m // 2 if m % 2 == 0 else 1
    return base_width - round(extra / per_unit)


def model_config(name: str, gate: str = "none", match_params: bool | None = None, ffn_multiple: int | None = None,
                 **overrides) -> GatedQwen3Config:
    """A preset shape with a gate. match_params (default: True for dense, False for MoE) shrinks the dense FFN so the
    total parameter count equals the ungated model's within 0.1 %, at a width aligned to ffn_multiple (default: the
    preset's FFN_MULTIPLE) where the 0.1 % allows (parity_width)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; valid: {', '.join(PRESETS)}")
    from .configuration import GatedQwen3Config

    kw = {**PRESETS[name](), **overrides}
    base = GatedQwen3Config(**kw)
    cfg = GatedQwen3Config(**{**kw, "gate": gate})
    if match_params is None:
        match_params = base.num_experts == 0
    if match_params and cfg.gate != "none":
        n_dense = sum(not cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
        if n_dense == 0:
            raise ValueError("match_params=True needs dense FFN layers to shrink; this model is all-MoE")
        if ffn_multiple is None:
            ffn_multiple = FFN_MULTIPLE.get(name, 1)
        if not isinstance(ffn_multiple, int) or ffn_multiple < 1:
            raise ValueError(f"ffn_multiple={ffn_multiple!r}: use a positive integer (1 = the exact parity width)")
        base_total = param_report(base)["total"]
        extra = param_report(cfg)["total"] - base_total
        per_unit = 3 * cfg.hidden_size * n_dense  # params per unit of FFN width over all dense layers
        cfg.intermediate_size = parity_width(base.intermediate_size, extra, per_unit, base_total, ffn_multiple)
        if cfg.intermediate_size <= 0:
            raise ValueError(f"gate {gate!r} adds more parameters than the FFN of preset {name!r} can give back")
    return cfg


# ---------------------------------------------------------------------------------------------------------------
# The paper's comparison mechanisms at a preset's shape (mechanisms.py is the registry; sizing them needs the presets)

def added_params(spec: MechanismSpec | str, config) -> int:
    """Parameters the baseline adds to the whole model `config` describes (config is the model WITHOUT it)."""
    from .mechanisms import Kind, expanded_config, get_mechanism, per_layer_params

    spec = get_mechanism(spec) if isinstance(spec, str) else spec
    if spec.kind is Kind.EXPAND:
        return param_report(expanded_config(config, spec))["total"] - param_report(config)["total"]
    return config.num_hidden_layers * per_layer_params(spec, config)


def mechanism_config(preset: str, name: str, gate: str = "none", **overrides):
    """`presets.model_config(preset, gate, **overrides)` with mechanism `name` applied, whichever family it is.
    Baselines are compared at the parameter counts the paper reports (added on top), so no FFN shrinking here."""
    from .mechanisms import Kind, expanded_config, get_mechanism

    spec = get_mechanism(name)
    if spec.kind is Kind.EXPAND:
        return expanded_config(model_config(preset, gate=gate, match_params=False, **overrides), spec)
    return model_config(preset, gate=gate, match_params=False, mechanism=name, **overrides)


def paper_report(config=None) -> list[dict]:
    """Every registered baseline with its added parameters for `config` (default: the paper's 15A2B shape) next to
    the paper's 'Added (M)' column, where it has one. `added` is None where the mechanism cannot be built on that
    shape (bondarenko_gate needs hidden_size == H * head_dim; the 15A2B shape has 2048 != 32 * 128)."""
    from .mechanisms import MECHANISMS, Kind

    if config is None:
            config = model_config("15a2b")
    rows = []
    for name, spec in MECHANISMS.items():
        if spec.kind is Kind.NONE or (spec.kind is Kind.EXPAND and spec.extra_experts and not config.num_experts):
            continue
        applicable = spec.kind is not Kind.HEAD_SLICE_GATE or \
            config.hidden_size == config.num_attention_heads * config.head_dim
        rows.append({"name": name, "added": added_params(spec, config) if applicable else None,
                     "paper_added_m": spec.paper_added_m, "paper": spec.paper})
    return rows

