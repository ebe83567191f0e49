"""Checkpoint interop: official gated-attention dirs, stock HF Qwen3 / Qwen3-MoE / Llama / Mistral / Qwen2, Qwen3-Next
attention <-> native.

Every conversion goes through the native layout (hub and spokes): SRC -> native (config kwargs + state dict) -> DST.
All five formats use stock Qwen3 parameter names; they differ only in what `LAYOUTS` declares:
  native      the gate in its own module: `self_attn.gate.proj.weight` (H*D or H rows, head-major), plain RMSNorm weights
  official    (qiuzh20/gated_attention, paper map §1.3) gate rows fused into `q_proj` per KV group g:
              [query rows of heads gG..gG+G-1 | gate rows of the same heads]; flags `elementwise_attn_output_gate` /
              `headwise_attn_output_gate` (headwise wins if both), `use_qk_norm`, `qkv_bias` (also the o_proj bias)
  qwen3       stock transformers `Qwen3ForCausalLM`: no gate, QK-norm always on
  qwen3-moe   stock transformers `Qwen3MoeForCausalLM`: as qwen3, plus MoE layers. Native MoE blocks already use its
              5.x fused names (mlp.gate.weight (E,d), mlp.experts.gate_up_proj (E,2I,d), mlp.experts.down_proj
              (E,d,I)); what transformers 5.24's save_pretrained writes (and every older checkpoint holds) is one key
              per expert, `mlp.experts.{e}.{gate,up,down}_proj.weight`, stacked on read as
              gate_up_proj[e] = cat([gate_e, up_e]) and split again on write. Both key layouts are accepted on read.
  qwen3-next  transformers `Qwen3NextForCausalLM` restricted to full-attention layers and dense MLPs: gate rows fused
              per head [q_h | g_h], and every RMSNorm zero-centred (weight_next = weight - 1, applied as 1 + w)
  llama, mistral, qwen2
              stock transformers `LlamaForCausalLM` / `MistralForCausalLM` / `Qwen2ForCausalLM`: no gate, no QK-norm,
              their bias / sliding-window / RoPE rules declared in convert.llama.FAMILIES
The fused layouts are row permutations (index tensors) applied at the boundary only; the model never sees them.

Choices (documented here because the official code leaves them open):
  - an official config without `qkv_bias` (the official code itself would raise AttributeError) takes the bias flag
    from the weights: q_proj.bias present or not. `attention_bias` in an official config is ignored, as the code does.
  - official legacy RoPE keys (`rope_theta`, `rope_scaling`) go through transformers' own standardisation; a YaRN
    `rope_scaling` without `original_max_position_embeddings` uses `max_position_embeddings` (what transformers
    4.46, the official code's version, used as the pre-scaling length).
  - official dirs are written without `auto_map` (the remote-code files are not ours to ship); one is accepted on read.
  - pickles (.bin/.pt/.pth/.ckpt) are never loaded: a directory with only pickled weights is an error.
  - the qwen3-next `w - 1` norm shift is done in fp32 and cast back; it round-trips bit-exactly for weights in
    [0.5, 2] (Sterbenz: w - 1 is exact there, in fp32 and bf16 alike), and rounds in the last bit outside it.
  - qwen3-moe configs name the expert count `num_local_experts` (5.x save_pretrained) or `num_experts` (older and hub
    configs); missing MoE keys take transformers' Qwen3MoeConfig defaults (e.g. norm_topk_prob=False, unlike native).
    Written configs carry what 5.24's save_pretrained writes. `router_z_loss_coef` and `moe_impl` are training/kernel
    settings with no effect on the logits and no Qwen3-MoE key: they are dropped on write (native defaults on read).
  - a shared expert (Qwen2-MoE style) and runtime baseline mechanisms (`baseline` != "none") have no external
    counterpart and fail clearly; MoE models convert only to native and qwen3-moe.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from ..gates import canonical_name
from ..io import atomic_dir

FORMATS = ("native", "official", "qwen3", "qwen3-moe", "qwen3-next", "llama", "mistral", "qwen2")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Files copied verbatim from SRC to DST (tokenizer and generation settings); weights and config are rewritten.
COPY_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
              "tokenizer.model", "added_tokens.json", "chat_template.jinja", "chat_template.json",
              "generation_config.json")


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
    llama_family: bool = False  # config and bias rules declared in convert.llama.FAMILIES (no QK-norm, no gate)


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


# ----------------------------------------------------------------------------------------------- row permutations
def fused_q_rows(layout: str, num_heads: int, num_kv_heads: int, head_dim: int, gate_width: int) -> torch.Tensor:
    """Index `idx` with fused[r] = stacked[idx[r]], where stacked = cat([query rows (H*D, head-major),
    gate rows (H*gate_width, head-major)]) is the native order and fused is the format's q_proj.

    per_kv_group (official): for each KV group g, [query rows of its G heads | gate rows of the same G heads].
    per_head (Qwen3-Next):   for each head h, [q_h | g_h] (needs gate_width == head_dim)."""
    H, KV, D, W = num_heads, num_kv_heads, head_dim, gate_width
    G = H // KV
    q_rows = lambda h: list(range(h * D, h * D + D))  # noqa: E731 - head h's query rows in the stacked order
    g_rows = lambda h: list(range(H * D + h * W, H * D + h * W + W))  # noqa: E731
    idx: list[int] = []
    if layout == "per_kv_group":
        for g in range(KV):
            heads = range(g * G, g * G + G)
            idx += [r for h in heads for r in q_rows(h)] + [r for h in heads for r in g_rows(h)]
    elif layout == "per_head":
        if W != D:
            raise ConversionError(f"the per-head [q_h | g_h] layout needs an elementwise gate (width {D}); got {W}")
        for h in range(H):
            idx += q_rows(h) + g_rows(h)
    else:
        raise ConversionError(f"unknown fused q_proj layout {layout!r}; valid: per_kv_group, per_head")
    return torch.tensor(idx, dtype=torch.long)


def _fuse(q: torch.Tensor, g: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return torch.cat([q, g], 0)[idx].contiguous()  # (H*D + H*W, ...) in the format's order


def _unfuse(fused: torch.Tensor, idx: torch.Tensor, n_q: int) -> tuple[torch.Tensor, torch.Tensor]:
    stacked = torch.empty_like(fused)
    stacked[idx] = fused  # undo the permutation: stacked = native order
    return stacked[:n_q].contiguous(), stacked[n_q:].contiguous()


# ----------------------------------------------------------------------------------------------- configs
def _gate_width(ncfg: dict) -> int:
    return {"none": 0, "sdpa_elementwise": ncfg["head_dim"], "sdpa_headwise": 1}[canonical_name(ncfg.get("gate", "none"))]


def _fused_q_index(layout: Layout, ncfg: dict) -> torch.Tensor | None:
    """The q_proj row permutation between a fused [q | gate] layout and native, or None if nothing is fused."""
    width = _gate_width(ncfg)
    if layout.fused_q is None or not width:
        return None
    return fused_q_rows(layout.fused_q, ncfg["num_attention_heads"], ncfg["num_key_value_heads"], ncfg["head_dim"], width)


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
    layout = _layout(fmt)
    _check_model_type(cfg, layout.model_type, fmt)
    if layout.llama_family:
        from . import llama as convert_llama

        return convert_llama.config_to_native(cfg, fmt)
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
    """The config.json dict of format `fmt` for native kwargs `ncfg` (already checked by `_check_native_for`)."""
    from ..configuration import GatedQwen3Config

    full = GatedQwen3Config(**ncfg).to_dict()
    if fmt == "native":
        return full
    layout = _layout(fmt)
    if layout.llama_family:
        from . import llama as convert_llama

        return convert_llama.config_from_native(full, fmt)
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


def _layout(fmt: str) -> Layout:
    if fmt not in LAYOUTS:
        raise ConversionError(f"unknown checkpoint format {fmt!r}; valid: {', '.join(FORMATS)}")
    return LAYOUTS[fmt]


def _check_native_for(ncfg: dict, fmt: str) -> None:
    """Fail clearly when a native model has no counterpart in `fmt`."""
    if fmt == "native":
        return
    layout = _layout(fmt)
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
    mechanism = ncfg.get("mechanism", ncfg.get("baseline", "none"))  # "baseline": the key's old name
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
        from . import llama as convert_llama

        convert_llama.check_native_for(ncfg, fmt)


# ----------------------------------------------------------------------------------------------- state dicts
def native_shapes(ncfg: dict) -> dict[str, tuple[int, ...]]:
    """Expected native key -> shape, from the model itself built on the meta device (no memory, always in sync)."""
    from ..configuration import GatedQwen3Config
    from ..modeling import GatedQwen3ForCausalLM

    cfg = GatedQwen3Config(**ncfg)
    with torch.device("meta"):
        model = GatedQwen3ForCausalLM(cfg)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)  # tied: saved once, as embed_tokens
    return shapes


def format_shapes(ncfg: dict, fmt: str) -> dict[str, tuple[int, ...]]:
    """Expected key -> shape of a `fmt` checkpoint for the model described by native kwargs `ncfg`."""
    shapes = native_shapes(ncfg)
    if fmt == "native" or _layout(fmt).fused_q is None:
        return shapes
    for key in [k for k in shapes if ".self_attn.gate.proj." in k]:
        gate_shape = shapes.pop(key)
        q_key = key.replace(".gate.proj.", ".q_proj.")
        shapes[q_key] = (shapes[q_key][0] + gate_shape[0], *shapes[q_key][1:])
    return shapes


def validate_state(state: dict, expected: dict[str, tuple[int, ...]], fmt: str, tied: bool = False) -> None:
    """One error listing every missing key, unexpected key and wrong shape (key, expected, found)."""
    problems = []
    for key, shape in expected.items():
        if key not in state:
            problems.append(f"missing key {key} (expected shape {list(shape)})")
        elif tuple(state[key].shape) != shape:
            problems.append(f"wrong shape for {key}: expected {list(shape)}, found {list(state[key].shape)}")
    extra = [k for k in state if k not in expected and not (tied and k == "lm_head.weight")]
    problems += [f"unexpected key {k} (shape {list(state[k].shape)})" for k in extra]
    if problems:
        raise ConversionError(f"{fmt} checkpoint does not match its config: " + "; ".join(problems[:20])
                              + (f"; ... and {len(problems) - 20} more" if len(problems) > 20 else ""))


def _drop_tied_head(state: dict, tied: bool) -> dict:
    if tied and "lm_head.weight" in state:
        head, emb = state["lm_head.weight"], state.get("model.embed_tokens.weight")
        if emb is not None and not torch.equal(head, emb):
            raise ConversionError("tie_word_embeddings=true but lm_head.weight differs from model.embed_tokens.weight; "
                                  "set tie_word_embeddings=false in config.json to keep both")
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    return state


def _shift_norms(state: dict, delta: float) -> dict:
    out = {}
    for k, v in state.items():
        out[k] = (v.float() + delta).to(v.dtype) if NORM_KEY.search(k) else v
    return out


def _stack_experts(state: dict) -> dict:
    """Per-expert Qwen3-MoE keys -> the fused native tensors; fused keys pass through unchanged."""
    groups: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    out = {}
    for k, v in state.items():
        m = EXPERT_KEY.match(k)
        if m:
            groups.setdefault(m[1], {}).setdefault(int(m[2]), {})[m[3]] = v
        else:
            out[k] = v
    for prefix, experts in groups.items():
        n = max(experts) + 1
        for e in range(n):
            missing = [p for p in ("gate_proj", "up_proj", "down_proj") if p not in experts.get(e, {})]
            if missing:
                raise ConversionError(f"{prefix}: expert {e} lacks {', '.join(missing)}.weight (experts 0..{n - 1} "
                                      "must each have gate_proj, up_proj and down_proj)")
        for name in ("gate_proj", "up_proj", "down_proj"):
            shapes = {tuple(experts[e][name].shape) for e in range(n)}
            if len(shapes) > 1:
                raise ConversionError(f"{prefix}.*.{name}.weight: experts disagree on shape {sorted(shapes)}")
        gate, up = experts[0]["gate_proj"], experts[0]["up_proj"]
        if gate.shape != up.shape:
            raise ConversionError(f"{prefix}: gate_proj {list(gate.shape)} and up_proj {list(up.shape)} differ")
        if f"{prefix}.gate_up_proj" in out or f"{prefix}.down_proj" in out:
            raise ConversionError(f"{prefix} has both per-expert and fused expert keys; keep one layout")
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]], 0) for e in range(n)])  # (E, 2I, d)
        out[f"{prefix}.down_proj"] = torch.stack([experts[e]["down_proj"] for e in range(n)])  # (E, d, I)
    return out


def _unstack_experts(state: dict) -> dict:
    """Fused native expert tensors -> per-expert Qwen3-MoE keys (what transformers' save_pretrained writes)."""
    out = {}
    for k, v in state.items():
        if k.endswith(".mlp.experts.gate_up_proj"):
            prefix = k[: -len(".gate_up_proj")]
            for e, w in enumerate(v):  # w (2I, d)
                gate, up = w.chunk(2, dim=0)  # (I, d) each
                # own storage per tensor: safetensors refuses to save views of one shared buffer
                out[f"{prefix}.{e}.gate_proj.weight"], out[f"{prefix}.{e}.up_proj.weight"] = gate.clone(), up.clone()
        elif k.endswith(".mlp.experts.down_proj"):
            prefix = k[: -len(".down_proj")]
            for e, w in enumerate(v):  # w (d, I)
                out[f"{prefix}.{e}.down_proj.weight"] = w.clone()
        else:
            out[k] = v
    return out


def state_to_native(state: dict, ncfg: dict, fmt: str) -> dict:
    """A `fmt` state dict -> native state dict (validated against the shapes `ncfg` implies)."""
    tied = bool(ncfg.get("tie_word_embeddings", False))
    if fmt != "native" and _layout(fmt).moe:
        state = _stack_experts(state)  # validated below in the fused (native) names
    validate_state(state, format_shapes(ncfg, fmt), fmt, tied)
    state = _drop_tied_head(dict(state), tied)
    if fmt == "native":
        return state
    layout = _layout(fmt)
    if layout.zero_centred_norms:
        state = _shift_norms(state, +1.0)
    idx = _fused_q_index(layout, ncfg)
    if idx is not None:
        n_q = ncfg["num_attention_heads"] * ncfg["head_dim"]
        for key in [k for k in state if Q_KEY.match(k)]:
            i, p = Q_KEY.match(key).groups()
            state[key], state[GATE_KEY.format(i=i, p=p)] = _unfuse(state[key], idx, n_q)
    return state


def state_from_native(state: dict, ncfg: dict, fmt: str) -> dict:
    """A native state dict -> `fmt` state dict. Tied models keep lm_head out, as save_pretrained does."""
    _check_native_for(ncfg, fmt)
    tied = bool(ncfg.get("tie_word_embeddings", False))
    validate_state(state, native_shapes(ncfg), "native", tied)
    state = _drop_tied_head(dict(state), tied)
    if fmt == "native":
        return state
    layout = _layout(fmt)
    if layout.llama_family:
        from . import llama as convert_llama

        return convert_llama.state_from_native(state, ncfg, fmt)
    idx = _fused_q_index(layout, ncfg)
    if idx is not None:
        for key in [k for k in state if Q_KEY.match(k)]:
            i, p = Q_KEY.match(key).groups()
            state[key] = _fuse(state[key], state.pop(GATE_KEY.format(i=i, p=p)), idx)
    if layout.zero_centred_norms:
        state = _shift_norms(state, -1.0)
    if layout.moe:
        state = _unstack_experts(state)
    return state


def convert_state_dict(config: dict, state: dict, src_format: str, dst_format: str = "native") -> tuple[dict, dict]:
    """In memory: (config.json dict, state dict) of `src_format` -> the same pair in `dst_format`."""
    for f in (src_format, dst_format):
        if f not in FORMATS:
            raise ConversionError(f"unknown checkpoint format {f!r}; valid: {', '.join(FORMATS)}")
    ncfg = config_to_native(config, src_format, state)
    nstate = state_to_native(state, ncfg, src_format)
    _check_native_for(ncfg, dst_format)
    return config_from_native(ncfg, dst_format), state_from_native(nstate, ncfg, dst_format)


# ----------------------------------------------------------------------------------------------- files
def load_dir(path: str | os.PathLike) -> tuple[dict, dict]:
    """(config.json dict, state dict) from a checkpoint directory; safetensors only, pickles refused."""
    from ..errors import UserError
    from ..io import load_hf_state, read_json_object

    path = Path(path)
    if path.is_file():
        if path.suffix in PICKLE_SUFFIXES:
            raise ConversionError(f"{path} is a pickle file; pickles can run arbitrary code and are never loaded. "
                                  "Re-save the weights as safetensors (save_pretrained(safe_serialization=True))")
        raise ConversionError(f"{path} is a file; pass the checkpoint directory (config.json + *.safetensors)")
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ConversionError(f"{path} has no config.json")
    try:
        config = read_json_object(cfg_file, "config", "pass a checkpoint folder written by save_pretrained")
        state = load_hf_state(path)  # model.safetensors or the index's shards (confined to the folder), verified
    except UserError as exc:
        raise ConversionError(str(exc)) from None
    return config, state


def save_dir(dst: str | os.PathLike, config: dict, state: dict, src: str | os.PathLike | None = None,
             overwrite: bool = False) -> Path:
    """Write config.json + model.safetensors (+ tokenizer/generation files from `src`) atomically: into a temporary
    sibling directory, then renamed into place, so DST is never half-written."""
    from safetensors.torch import save_file

    dst = Path(dst)
    if dst.exists() and not overwrite:
        raise ConversionError(f"{dst} already exists; pass --overwrite (overwrite=True) to replace it")
    with atomic_dir(dst, overwrite=True) as tmp:  # DST is the old folder or the complete new one, never half
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        # save_file refuses shared storage; tensors from permutations are fresh, others may alias: clone those
        seen, clean = set(), {}
        for k, v in state.items():
            ptr = (v.untyped_storage().data_ptr(), v.storage_offset())
            clean[k] = v.contiguous().clone() if ptr in seen or not v.is_contiguous() else v
            seen.add(ptr)
        save_file(clean, tmp / "model.safetensors", metadata={"format": "pt"})
        if src is not None:
            for name in COPY_FILES:
                if (Path(src) / name).is_file():
                    shutil.copy2(Path(src) / name, tmp / name)
    return dst


def convert_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, src_format: str, dst_format: str = "native",
                       overwrite: bool = False) -> Path:
    """Convert the checkpoint directory SRC (format `src_format`) into DST (format `dst_format`)."""
    config, state = load_dir(src)
    out_config, out_state = convert_state_dict(config, state, src_format, dst_format)
    return save_dir(dst, out_config, out_state, src=src, overwrite=overwrite)


__all__ = ["FORMATS", "LAYOUTS", "Layout", "ConversionError", "fused_q_rows", "config_to_native", "config_from_native",
           "native_shapes", "format_shapes", "validate_state", "state_to_native", "state_from_native",
           "convert_state_dict", "load_dir", "save_dir", "convert_checkpoint"]
