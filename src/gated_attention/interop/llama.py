"""Llama-family interop (stock transformers Llama, Mistral, Qwen2) <-> native, declared per family in `FAMILIES`.

These checkpoints already use Qwen3's parameter names (`model.layers.{i}.self_attn.q_proj.weight`, ...); what differs
is declared here and mapped at the boundary, never inside the model:
  - no QK-norm: native `use_qk_norm=False`;
  - attention biases: Llama's `attention_bias` covers q/k/v/o; Qwen2 always has q/k/v biases and never an o_proj
    bias (native `attention_bias=True, o_proj_bias=False`); Mistral has none;
  - Mistral's `sliding_window` windows every layer; Qwen2's `use_sliding_window` windows the layers its
    `layer_types` marks (those from `max_window_layers` on): native `layer_types` + `sliding_window`, honoured by
    the model's masks (`create_sliding_window_causal_mask`), so results match the stock classes at any length;
  - RoPE: `rope_parameters` as the stock config class standardises them (legacy `rope_theta`/`rope_scaling`, Llama
    3's `llama3` type, `longrope`, `yarn`, ...), `head_dim` as the stock class derives it (Qwen2: hidden/heads
    unless config.json says otherwise);
  - tied / untied embeddings: `tie_word_embeddings`, as in the stock config.
Reading goes through the stock config class itself (`LlamaConfig.from_dict` ...), so every default is exactly the
one transformers applies to that config.json. Writing refuses what the family cannot hold (a gate, QK-norm, MoE,
partial RoPE, an o_proj bias in Qwen2, any bias in Mistral, a mixed window pattern in Mistral, windows in Llama); a
native model without q/k/v biases is written to Qwen2 with zero biases (and Llama gets zero biases for the
projections it lacks when only some are biased), which leaves the logits exactly unchanged.
Llama's `mlp_bias=true` has no native counterpart (SwiGLU without biases) and is refused on read.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .layouts import SHARED_KEYS, ConversionError

# the bias names of one attention layer, in the order q, k, v, o
_QKV = ("q_proj", "k_proj", "v_proj")


@dataclass(frozen=True)
class Family:
    config_class: str  # transformers class whose from_dict standardises a config.json of this family
    qkv_bias: str  # "config" (the `attention_bias` key) | "always" (Qwen2) | "never" (Mistral)
    o_bias: str  # "config" (the `attention_bias` key) | "never"
    sliding: str  # "none" (Llama) | "all" (Mistral: one window on every layer) | "layer_types" (Qwen2)


FAMILIES: dict[str, Family] = {
    "llama": Family("LlamaConfig", "config", "config", "none"),
    "mistral": Family("MistralConfig", "never", "never", "all"),
    "qwen2": Family("Qwen2Config", "always", "never", "layer_types"),
}


def _stock_config(cfg: dict, fmt: str):
    import transformers

    cls = getattr(transformers, FAMILIES[fmt].config_class)
    return cls.from_dict({k: v for k, v in cfg.items() if k != "model_type"})


def config_to_native(cfg: dict, fmt: str) -> dict:
    """Native GatedQwen3Config kwargs from a Llama / Mistral / Qwen2 config.json dict."""
    fam = FAMILIES[fmt]
    hf = _stock_config(cfg, fmt)
    if getattr(hf, "mlp_bias", False):
        raise ConversionError(f"{fmt} config has mlp_bias=true; the native SwiGLU MLP has no biases (no counterpart)")
    out = {k: getattr(hf, k) for k in SHARED_KEYS if k != "head_dim" and hasattr(hf, k)}
    out["head_dim"] = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    rp = dict(hf.rope_parameters)
    prf = rp.pop("partial_rotary_factor", getattr(hf, "partial_rotary_factor", None))
    if prf not in (None, 1.0):
        raise ConversionError(f"{fmt} config has partial_rotary_factor={prf}; stock {fam.config_class[:-6]} rotates "
                              "the full head_dim, so this checkpoint is not a stock one")
    out["rope_parameters"] = rp
    bias = bool(getattr(hf, "attention_bias", False))
    qkv = {"config": bias, "always": True, "never": False}[fam.qkv_bias]
    o = {"config": bias, "never": False}[fam.o_bias]
    out["attention_bias"] = qkv
    if o != qkv:
        out["o_proj_bias"] = o
    n = hf.num_hidden_layers
    window = getattr(hf, "sliding_window", None)
    if fam.sliding == "all" and window is not None:
        out["layer_types"], out["sliding_window"] = ["sliding_attention"] * n, window
    elif fam.sliding == "layer_types":
        types = list(hf.layer_types)
        if "sliding_attention" in types:
            if window is None:
                raise ConversionError(f"{fmt} config marks sliding_attention layers but use_sliding_window is false "
                                      "(so sliding_window is unset); set use_sliding_window=true with a "
                                      "sliding_window, or mark every layer full_attention")
            out["sliding_window"] = window
        out["layer_types"] = types
        out["max_window_layers"] = hf.max_window_layers
    out["use_qk_norm"] = False
    out["gate"] = "none"
    dtype = cfg.get("dtype", cfg.get("torch_dtype"))
    if dtype:
        out["dtype"] = dtype
    return out


def _biases(ncfg: dict) -> tuple[bool, bool]:
    qkv = bool(ncfg.get("attention_bias", False))
    o = ncfg.get("o_proj_bias")
    return qkv, qkv if o is None else bool(o)


def check_native_for(ncfg: dict, fmt: str) -> None:
    """Fail clearly when a native model has no exact `fmt` counterpart (beyond configs.check_native_for's rules)."""
    fam = FAMILIES[fmt]
    if ncfg.get("use_qk_norm", True):
        raise ConversionError(f"use_qk_norm=True (Qwen3 QK-norm) has no {fmt} counterpart; export it as qwen3 (or "
                              "keep native)")
    qkv, o = _biases(ncfg)
    if fam.qkv_bias == "never" and (qkv or o):
        raise ConversionError(f"{fmt} has no attention biases; this model has q/k/v bias={qkv}, o_proj bias={o} "
                              "(export it as llama, or qwen2 when only q/k/v are biased)")
    if fam.o_bias == "never" and o:
        raise ConversionError(f"{fmt} has no o_proj bias but this model has one; export it as llama")
    types = ncfg.get("layer_types") or ["full_attention"] * ncfg["num_hidden_layers"]
    sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    if sliding and fam.sliding == "none":
        raise ConversionError(f"layers {sliding} use a sliding window, which {fmt} cannot express; export as "
                              "mistral or qwen2")
    if sliding and fam.sliding == "all" and len(sliding) != len(types):
        raise ConversionError(f"{fmt} windows every layer or none; this model windows only layers {sliding} "
                              "(export as qwen2, which has per-layer layer_types)")


def config_from_native(full: dict, fmt: str) -> dict:
    """The config.json dict of the stock `fmt` class for a full native config dict (checked by check_native_for)."""
    import transformers

    fam = FAMILIES[fmt]
    cls = getattr(transformers, fam.config_class)
    shared = {k: full[k] for k in SHARED_KEYS}
    kw: dict = {"rope_parameters": dict(full["rope_parameters"])}
    qkv, o = _biases(full)
    if fam.qkv_bias == "config":
        kw["attention_bias"] = qkv or o  # zero biases fill the projections that have none
    types = full["layer_types"]
    windowed = "sliding_attention" in types
    if fam.sliding == "all":
        kw["sliding_window"] = full["sliding_window"] if windowed else None
    elif fam.sliding == "layer_types":
        kw.update(use_sliding_window=windowed, sliding_window=full["sliding_window"] if windowed else None,
                  layer_types=list(types),
                  max_window_layers=types.index("sliding_attention") if windowed else full["max_window_layers"])
    out = cls(**shared, **kw).to_dict()
    out["architectures"] = [fam.config_class.replace("Config", "ForCausalLM")]
    if full.get("dtype"):
        out["dtype"] = full["dtype"]
    return out


def state_from_native(state: dict, ncfg: dict, fmt: str) -> dict:
    """Native state dict -> `fmt` (same names); zero biases where the stock class has a bias the model lacks."""
    fam = FAMILIES[fmt]
    qkv, o = _biases(ncfg)
    want_qkv = {"config": qkv or o, "always": True, "never": False}[fam.qkv_bias]
    want_o = {"config": qkv or o, "never": False}[fam.o_bias]
    out = dict(state)
    for i in range(ncfg["num_hidden_layers"]):
        prefix = f"model.layers.{i}.self_attn."
        names = list(_QKV) * want_qkv + ["o_proj"] * want_o
        for name in names:
            key = prefix + name + ".bias"
            if key not in out:
                w = out[prefix + name + ".weight"]  # (out, in)
                out[key] = torch.zeros(w.shape[0], dtype=w.dtype)
    return out


__all__ = ["FAMILIES", "Family", "config_to_native", "config_from_native", "check_native_for", "state_from_native"]
