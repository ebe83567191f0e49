"""Checkpoint interop, the layer between foreign checkpoints and the model: conversion between layouts
(`convert_checkpoint`, `gattn convert`) and adding a gate to an ungated checkpoint (retrofit.py, `gattn retrofit`).
The model never sees a foreign layout; everything is mapped here, at the boundary.

Modules, by job: layouts.py (the formats as data: `FORMATS`, `LAYOUTS`, key patterns), configs.py (config.json maps and
`check_native_for`, what a format cannot hold), states.py (state-dict maps), llama.py (the Llama family's rules),
checkpoints.py (whole conversions, folder reading and atomic writing), retrofit.py. This file re-exports the API.

Formats: official gated-attention dirs, stock HF Qwen3 / Qwen3-MoE / Llama / Mistral / Qwen2, Qwen3-Next
attention <-> native.

Every conversion goes through the native layout (hub and spokes): SRC -> native (config kwargs + state dict) -> DST.
All formats use stock Qwen3 parameter names; they differ only in what `LAYOUTS` declares:
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
              their bias / sliding-window / RoPE rules declared in llama.FAMILIES
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
  - a shared expert (Qwen2-MoE style) and runtime comparison mechanisms (`mechanism` != "none") have no external
    counterpart and fail clearly; MoE models convert only to native and qwen3-moe.
"""
from ..util.lazy import lazy_exports

HOMES = {**dict.fromkeys(("convert_checkpoint", "convert_state_dict", "load_dir", "save_dir"), "checkpoints"),
         **dict.fromkeys(("check_native_for", "config_from_native", "config_to_native"), "configs"),
         **dict.fromkeys(("FORMATS", "LAYOUTS", "ConversionError", "Layout", "get_layout"), "layouts"),
         **dict.fromkeys(("format_shapes", "fused_q_rows", "native_shapes", "state_from_native", "state_to_native",
                          "validate_state"), "states")}  # loaded on first use: the layouts alone need no torch
__all__ = list(HOMES)
__getattr__, __dir__ = lazy_exports(__name__, HOMES)
