"""GGUF export: a built `GatedQwen3ForCausalLM` written as a llama.cpp model file with PyPI's `gguf` (`gattn export
--to gguf`). A function applied to the model; the model never sees the layout.

What is mapped, and how (the architecture choice and llama.cpp's facts are in gguf_map.py):
  - G1 sigmoid gates (sdpa_elementwise, sdpa_headwise) -> `qwen35`, every layer of ours full attention, plus one
    appended recurrent layer that adds exactly zero (llama.cpp aborts on a qwen35 file without any recurrent
    layer; the facts are in gguf_map.py). The gate rows go
    into `attn_q` per head [q_h | g_h]; a headwise gate's row g_h is repeated head_dim times, which is exact
    (sigmoid of the same logit on every element of the head). gate_init="identity" scales the gate by 1/sigmoid(0)=2:
    folded into `attn_output` (o_proj is linear in the gated output; x2 is exact in binary floating point).
  - the ungated model -> `qwen3`.
  - RMSNorm weights are written as they are (ours and llama.cpp's are both w * x / rms(x)); QK-norm -> attn_q_norm /
    attn_k_norm; a tied head -> no `output` tensor (llama.cpp reuses token_embd); q/k/v/gate biases -> attn_q/k/v
    biases.
  - refused with one line each: other gates, no QK-norm, an o_proj bias, MoE layers, sliding-window layers,
    comparison mechanisms, RoPE scalings other than linear.
Types: 1-D tensors (norms, biases) are F32; matrices take --outtype, the tensors that hold gate rows (qwen35's
attn_q) take --gate-type (default: --outtype), so a quantized file can keep the gate in high precision. Q8_0 needs
rows whose length is a multiple of 32; other matrices fall back to F16 (and the summary says which), as llama.cpp's
own converter does.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from ..util.io import atomic_write_with
from .gguf_map import (ARCHS, FILE_TYPES, NOOP_F32, OUTTYPES, QWEN35_NOOP_SSM, GGUFArch, arch_for, gguf_tensor, mrope_sections,
                       noop_recurrent_tensors)
from .gguf_vocab import add_vocab, read_vocab
from .layouts import ConversionError
from .states import fused_q_rows

GATE_HOLDERS = ("ATTN_Q",)  # MODEL_TENSOR members that carry gate rows in a fused-gate architecture
Q8_BLOCK = 32  # Q8_0 block length along a row


def check_exportable(config) -> GGUFArch:
    """The GGUF architecture for `config`, or one ConversionError naming what llama.cpp cannot compute and the fix."""
    try:
        arch = arch_for(config.gate)
    except ValueError as exc:
        raise ConversionError(str(exc)) from None
    rp = config.rope_parameters or {}
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    problems = []
    if not config.use_qk_norm:
        problems.append("use_qk_norm=False: llama.cpp's qwen3/qwen35 always apply QK-norm (train with QK-norm on)")
    o_bias = config.attention_bias if config.o_proj_bias is None else config.o_proj_bias
    if o_bias:
        problems.append("an o_proj bias: llama.cpp's qwen3/qwen35 attention output has no bias")
    if config.num_experts:
        problems.append("MoE layers: only dense models export (qwen35moe is not mapped here)")
    if config.has_sliding_layers:
        problems.append("sliding-window layers: qwen3/qwen35 attend over the full context in every layer")
    if config.mechanism != "none":
        problems.append(f"mechanism={config.mechanism!r}: a comparison mechanism llama.cpp does not implement")
    if rope_type not in ("default", "linear"):
        problems.append(f"RoPE scaling {rope_type!r}: only default and linear map exactly (export before `gattn extend`)")
    if problems:
        raise ConversionError("cannot export to GGUF: " + "; ".join(problems))
    return arch


def _gate_rows(attn, head_dim: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gate's (H*D, d) weight and (H*D,) bias, a headwise gate's rows repeated head_dim times."""
    w = attn.gate.proj.weight.detach().float()
    b = attn.gate.proj.bias.detach().float() if attn.gate.proj.bias is not None else None
    if w.shape[0] == attn.num_heads:  # headwise: one row per head
        w = w.repeat_interleave(head_dim, dim=0)  # (H*D, d): row h*D + j = gate row h
        b = b.repeat_interleave(head_dim) if b is not None else None
    return w, b


def native_tensors(model, arch: GGUFArch) -> dict[str, torch.Tensor]:
    """Native name -> fp32 tensor in the layout `arch` reads: fused per-head [q_h | g_h] q_proj, the gate's scale
    folded into o_proj, the tied head left out."""
    cfg = model.config
    state = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    if not arch.fused_gate:
        return state
    H, KV, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    idx = fused_q_rows("per_head", H, KV, D, D)  # fused[r] = cat([q, g])[idx[r]]
    for i, layer in enumerate(model.model.layers):
        attn, pre = layer.self_attn, f"model.layers.{i}.self_attn."
        gw, gb = _gate_rows(attn, D)
        state[pre + "q_proj.weight"] = torch.cat([state[pre + "q_proj.weight"], gw], 0)[idx].contiguous()  # (2HD, d)
        if gb is not None:
            state[pre + "q_proj.bias"] = torch.cat([state[pre + "q_proj.bias"], gb], 0)[idx].contiguous()  # (2HD,)
        if attn.gate.scale != 1.0:  # y * scale * sigmoid(g) -> o_proj(y * sigmoid(g)) with o_proj * scale
            state[pre + "o_proj.weight"] = state[pre + "o_proj.weight"] * attn.gate.scale
        for k in [k for k in state if k.startswith(pre + "gate.")]:
            del state[k]
    return state


def _quantize(arr, qtype_name: str):
    """(data, GGMLQuantizationType) of an fp32 numpy array in type `qtype_name` (gguf-py's own quantizers)."""
    import gguf
    import numpy as np

    qtype = gguf.GGMLQuantizationType[qtype_name]
    if qtype == gguf.GGMLQuantizationType.F32:
        return arr.astype(np.float32), qtype
    if qtype == gguf.GGMLQuantizationType.F16:
        return arr.astype(np.float16), qtype
    return gguf.quants.quantize(arr, qtype), qtype


def export_gguf(model, out: str | os.PathLike, tokenizer_json: str | os.PathLike, outtype: str = "f32",
                gate_type: str | None = None, name: str = "gated-attention", overwrite: bool = False) -> dict:
    """Write `model` (a built GatedQwen3ForCausalLM) to the GGUF file `out` with the tokenizer at `tokenizer_json`.
    Returns a summary: {architecture, file, outtype, gate_type, tensors: {gguf name: type}, fallbacks: [...]}."""
    import gguf

    cfg = model.config
    arch = check_exportable(cfg)
    for flag, value in (("--outtype", outtype), ("--gate-type", gate_type)):
        if value is not None and value not in OUTTYPES:
            raise ConversionError(f"{flag} {value!r} is not a GGUF type this export writes; valid: {', '.join(OUTTYPES)}")
    if gate_type is not None and not arch.fused_gate:
        raise ConversionError(f"--gate-type {gate_type}: this model has no gate (gate={cfg.gate!r}); drop the flag")
    out = Path(out)
    if out.exists() and not overwrite:
        raise ConversionError(f"{out} already exists; pass --overwrite (overwrite=True) to replace it")
    vocab = read_vocab(tokenizer_json, cfg.vocab_size)
    tensors = native_tensors(model, arch)

    summary = {"architecture": arch.name, "file": str(out), "outtype": outtype, "gate_type": gate_type or outtype,
               "tensors": {}, "fallbacks": []}
    planned = []
    for key, t in tensors.items():
        mapped = gguf_tensor(key, arch)
        if mapped is None:
            raise ConversionError(f"no GGUF tensor for {key} (shape {list(t.shape)}) in {arch.name}")
        member, gname = mapped
        holds_gate = arch.fused_gate and member in GATE_HOLDERS
        want = "f32" if t.ndim == 1 else (gate_type or outtype) if holds_gate else outtype
        if OUTTYPES[want] == "Q8_0" and t.shape[-1] % Q8_BLOCK:
            summary["fallbacks"].append(f"{gname}: rows of {t.shape[-1]} are not a multiple of {Q8_BLOCK}; F16")
            want = "f16"
        planned.append((gname, t.numpy(), OUTTYPES[want]))
    if arch.noop_recurrent_layer:
        import numpy as np

        for gname, (shape, fill) in noop_recurrent_tensors(cfg.num_hidden_layers, cfg.hidden_size,
                                                           cfg.intermediate_size).items():
            keep_f32 = len(shape) == 1 or gname.endswith(NOOP_F32)
            want = "f32" if keep_f32 else "f16" if OUTTYPES[outtype] == "Q8_0" and shape[-1] % Q8_BLOCK else outtype
            planned.append((gname, np.full(shape, fill, dtype=np.float32), OUTTYPES[want]))

    def write(tmp):
        w = gguf.GGUFWriter(tmp, arch.name)
        _add_hparams(w, cfg, arch)
        w.add_name(name)
        w.add_file_type(gguf.LlamaFileType[FILE_TYPES[outtype]])
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        add_vocab(w, vocab)
        for gname, arr, qname in planned:
            data, qtype = _quantize(arr, qname)
            w.add_tensor(gname, data, raw_dtype=qtype)
            summary["tensors"][gname] = qtype.name
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    atomic_write_with(out, write)
    return summary


def _add_hparams(w, cfg, arch: GGUFArch) -> None:
    """The {arch}.* keys llama.cpp's loader reads for this architecture."""
    rp = cfg.rope_parameters or {}
    prf = rp.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None))
    rot = int(cfg.head_dim * (1.0 if prf is None else prf))  # as rope._rotary_dim
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    n_layers = cfg.num_hidden_layers + (1 if arch.noop_recurrent_layer else 0)
    w.add_block_count(n_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(rot)
    w.add_rope_freq_base(float(rp.get("rope_theta", 10000.0)))
    if rp.get("rope_type", rp.get("type")) == "linear":  # HF linear: positions / factor; llama.cpp: freq_scale
        import gguf

        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(rp["factor"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if arch.mrope:
        w.add_rope_dimension_sections(mrope_sections(rot))
    if arch.ssm_keys:
        s = QWEN35_NOOP_SSM
        w.add_ssm_conv_kernel(s["conv_kernel"])
        w.add_ssm_inner_size(s["inner_size"])
        w.add_ssm_state_size(s["state_size"])
        w.add_ssm_time_step_rank(s["time_step_rank"])
        w.add_ssm_group_count(s["group_count"])
        # ours are full attention; the appended no-op layer (if any) is the one recurrent layer
        recurrent = [0] * cfg.num_hidden_layers + [1] * (n_layers - cfg.num_hidden_layers)
        w.add_array(f"{arch.name}.attention.recurrent_layers", recurrent)


__all__ = ["ARCHS", "check_exportable", "native_tensors", "export_gguf"]
