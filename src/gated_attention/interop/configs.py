"""Config maps: a foreign config.json dict <-> native `GatedQwen3Config` kwargs, for every format in `FORMATS`, and
`check_native_for`, the one place that says which native models a format cannot hold (and why, with the fix).
The Llama family's own rules live in llama.py; the choices made where the official code is silent are listed in
interop/__init__.py.
"""
from __future__ import annotations

from ..gates import canonical_name
from . import llama
from .layouts import FORMATS, MOE_KEYS, OFFICIAL_DEFAULTS, SHARED_KEYS, ConversionError, get_layout


def _rope_from_legacy(cfg: dict) -> dict:
    """rope_parameters from a config that may carry only the legacy rope_theta / rope_scaling keys."""
    rp = cfg.get("rope_parameters")
    if not rp:
        from transformers import Qwen3Config  # transformers' own standardisation of the legacy keys

        scaling = dict(cfg.get("rope_scaling") or {})
        rtype = scaling.get("rope_type", scaling.get("type"))
        if rtype == "yarn" and "original_max_position_embeddings" not in scaling:
            scaling["original_max_position_embeddings"] = cfg.get("max_position_embeddings", 32768)
        kw = {"rope_theta": cfg.get("rope_theta", 10000.0), "max_position_embeddings": cfg.get(
            "max_position_embeddings", 32768)}
        if scaling:
            kw["rope_scaling"] = scaling
        rp = Qwen3Config(**kw).rope_parameters
    rp = dict(rp)
    if "type" in rp:  # legacy alias of rope_type
        rp.setdefault("rope_type", rp.pop("type"))
        rp.pop("type", None)
    rp.setdefault("rope_type", "default")
    rp.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    return rp


def _legacy_rope(rp: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) for formats that store the legacy keys (official)."""
    rest = {k: v for k, v in rp.items() if k != "rope_theta"}
    return rp["rope_theta"], (None if rest.get("rope_type", "default") == "default" and len(rest) <= 1 else rest)


def _check_model_type(cfg: dict, expected: str, fmt: str) -> None:
    found = cfg.get("model_type")
    if found != expected:
        raise ConversionError(f"--from {fmt} expects config.json model_type {expected!r}; found {found!r}. "
                              f"Pick the --from format that matches the checkpoint (valid: {', '.join(FORMATS)})")


def config_to_native(cfg: dict, fmt: str, state: dict | None = None) -> dict:
    """Native GatedQwen3Config kwargs from a `fmt` config.json dict."""
    if fmt == "native":
        _check_model_type(cfg, "gated_qwen3", fmt)
        return {k: v for k, v in cfg.items() if k not in ("model_type", "transformers_version", "architectures")}
    layout = get_layout(fmt)
    _check_model_type(cfg, layout.model_type, fmt)
    if layout.llama_family:
        return llama.config_to_native(cfg, fmt)
    if fmt == "official":
        cfg = {**OFFICIAL_DEFAULTS, **cfg}
    out = {k: cfg[k] for k in SHARED_KEYS if k in cfg}
    out["rope_parameters"] = _rope_from_legacy(cfg)
    if cfg.get("use_sliding_window"):
        raise ConversionError(f"{fmt} config has use_sliding_window=true; the native model has full attention only")
    dtype = cfg.get("dtype", cfg.get("torch_dtype"))
    if dtype:
        out["dtype"] = dtype
    if fmt == "official":
        out["use_qk_norm"] = bool(cfg["use_qk_norm"])
        out["gate"] = ("sdpa_headwise" if cfg["headwise_attn_output_gate"]
                       else "sdpa_elementwise" if cfg["elementwise_attn_output_gate"] else "none")
        if "qkv_bias" in cfg:
            out["attention_bias"] = bool(cfg["qkv_bias"])
        else:  # the official code would raise; the weights say what the model had
            out["attention_bias"] = state is not None and "model.layers.0.self_attn.q_proj.bias" in state
        return out
    out["attention_bias"] = bool(cfg.get("attention_bias", False))
    if fmt == "qwen3":
        out["gate"] = "none"
        return out
    if fmt == "qwen3-moe":
        out["gate"] = "none"
        out.update(_moe_config_to_native(cfg))
        return out
    # qwen3-next: only full-attention layers with dense MLPs have a native counterpart
    n = cfg.get("num_hidden_layers", 0)
    types = cfg.get("layer_types") or []
    bad = [f"{i}:{t}" for i, t in enumerate(types) if t != "full_attention"]
    if bad or len(types) != n:
        raise ConversionError(f"qwen3-next layer_types must be 'full_attention' for all {n} layers; found {bad or types} "
                              "(Gated DeltaNet layers have no native counterpart)")
    mlp_only = set(cfg.get("mlp_only_layers") or [])
    step = cfg.get("decoder_sparse_step", 1)
    moe = [i for i in range(n) if cfg.get("num_experts", 0) > 0 and i not in mlp_only and (i + 1) % step == 0]
    if moe:
        raise ConversionError(f"qwen3-next layers {moe} are MoE (num_experts={cfg.get('num_experts')}); only dense "
                              "MLPs convert: set num_experts=0 or list every layer in mlp_only_layers")
    rp = out["rope_parameters"]
    prf = cfg.get("partial_rotary_factor", rp.get("partial_rotary_factor"))
    rp.pop("partial_rotary_factor", None)
    if prf is not None and prf != 1.0:
        rp["partial_rotary_factor"] = prf
    out["gate"] = "sdpa_elementwise"
    out["use_qk_norm"] = True
    return out


def _moe_config_to_native(cfg: dict) -> dict:
    """MoE kwargs from a Qwen3-MoE config.json, missing keys at transformers' Qwen3MoeConfig defaults."""
    from transformers import Qwen3MoeConfig

    hf_defaults = {f: Qwen3MoeConfig.__dataclass_fields__[f].default for f in (*MOE_KEYS, "num_experts")}
    spellings = {k: cfg[k] for k in ("num_local_experts", "num_experts") if cfg.get(k) is not None}
    if len(set(spellings.values())) > 1:
        raise ConversionError(f"qwen3-moe config gives two expert counts {spellings}; keep one of them")
    out = {k: cfg.get(k, hf_defaults[k]) for k in MOE_KEYS}
    out["num_experts"] = next(iter(spellings.values()), hf_defaults["num_experts"])
    out["mlp_only_layers"] = list(out["mlp_only_layers"] or [])
    return out


def config_from_native(ncfg: dict, fmt: str) -> dict:
    """The config.json dict of format `fmt` for native kwargs `ncfg` (already checked by `check_native_for`)."""
    from ..configuration import GatedQwen3Config

    full = GatedQwen3Config(**ncfg).to_dict()
    if fmt == "native":
        return full
    layout = get_layout(fmt)
    if layout.llama_family:
        return llama.config_from_native(full, fmt)
    shared = {k: full[k] for k in SHARED_KEYS}
    dtype = full.get("dtype")
    rp = dict(full["rope_parameters"])
    if fmt == "official":
        theta, scaling = _legacy_rope(rp)
        out = {"architectures": [layout.architecture], "model_type": "qwen3", **shared, "rope_theta": theta,
               "rope_scaling": scaling, "use_sliding_window": False, "sliding_window": None,
               "max_window_layers": full["max_window_layers"], "use_qk_norm": full["use_qk_norm"],
               "qkv_bias": full["attention_bias"], "attention_bias": full["attention_bias"],
               "elementwise_attn_output_gate": full["gate"] == "sdpa_elementwise",
               "headwise_attn_output_gate": full["gate"] == "sdpa_headwise"}
        if dtype:
            out["torch_dtype"] = dtype
        return out
    if fmt == "qwen3":
        from transformers import Qwen3Config

        hf = Qwen3Config(**shared, rope_parameters=rp, attention_bias=full["attention_bias"], use_sliding_window=False,
                         max_window_layers=full["max_window_layers"])
    elif fmt == "qwen3-moe":
        from transformers import Qwen3MoeConfig

        hf = Qwen3MoeConfig(**shared, rope_parameters=rp, attention_bias=full["attention_bias"],
                            use_sliding_window=False, num_experts=full["num_experts"], **{k: full[k] for k in MOE_KEYS})
    else:
        from transformers import Qwen3NextConfig

        rp.setdefault("partial_rotary_factor", 1.0)  # Qwen3-Next's own default is 0.25: always write it explicitly
        hf = Qwen3NextConfig(**shared, rope_parameters=rp, attention_bias=full["attention_bias"], num_experts=0,
                             mlp_only_layers=[], layer_types=["full_attention"] * full["num_hidden_layers"])
    out = hf.to_dict()
    out["architectures"] = [layout.architecture]
    if fmt == "qwen3-moe":  # 5.x writes num_local_experts only; transformers 4.x and hub configs read num_experts
        out["num_experts"] = full["num_experts"]
    if dtype:
        out["dtype"] = dtype
    return out



def check_native_for(ncfg: dict, fmt: str) -> None:
    """Fail clearly when a native model has no counterpart in `fmt`."""
    if fmt == "native":
        return
    layout = get_layout(fmt)
    gate = canonical_name(ncfg.get("gate", "none"))
    if gate not in layout.gates:
        raise ConversionError(f"gate {gate!r} has no {fmt} counterpart; {fmt} can hold: {', '.join(layout.gates)}"
                              + (" (a gated model needs --to official or native)" if fmt == "qwen3" else "")
                              + (f" (stock {layout.architecture} has no gate: a gated model stays native; export the "
                                 "ungated model it was retrofitted from)" if layout.llama_family else ""))
    if gate != "none" and ncfg.get("gate_init", "normal") != "normal":
        raise ConversionError(f"gate_init={ncfg['gate_init']!r} scales the gate (2*sigmoid); {fmt} applies a plain "
                              "sigmoid, so the logits would change")
    if ncfg.get("num_experts", 0) and not layout.moe:
        raise ConversionError(f"MoE models (num_experts={ncfg['num_experts']}) have no {fmt} counterpart; "
                              "use --to qwen3-moe (ungated) or native")
    if ncfg.get("shared_expert_intermediate_size", 0):
        raise ConversionError(f"shared_expert_intermediate_size={ncfg['shared_expert_intermediate_size']}: a shared "
                              f"expert has no {fmt} counterpart (Qwen3-MoE has none)")
    mechanism = ncfg.get("mechanism", "none")
    if mechanism != "none":
        raise ConversionError(f"mechanism={mechanism!r} is a native-only mechanism with no {fmt} counterpart; "
                              "keep such models in the native format")
    prf = (ncfg.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0)
    if prf != 1.0 and not layout.partial_rope:
        raise ConversionError(f"partial_rotary_factor={prf} has no {fmt} counterpart (it rotates the full head_dim)")
    if layout.needs_qk_norm and not ncfg.get("use_qk_norm", True):
        raise ConversionError(f"use_qk_norm=False has no {fmt} counterpart (it always applies QK-norm)")
    if not layout.llama_family:
        o_bias = ncfg.get("o_proj_bias")
        if o_bias is not None and o_bias != bool(ncfg.get("attention_bias", False)):
            raise ConversionError(f"o_proj_bias={o_bias} with attention_bias={ncfg.get('attention_bias', False)} "
                                  f"has no {fmt} counterpart (one flag covers q/k/v/o there); export as qwen2 or llama")
        if "sliding_attention" in (ncfg.get("layer_types") or ()):
            raise ConversionError(f"sliding-window layers have no {fmt} counterpart here; export as mistral or qwen2")
    else:
        llama.check_native_for(ncfg, fmt)

