"""The GGUF layout as data: which llama.cpp architecture holds which of our models, how native tensor names map to
GGUF tensor names, and the M-RoPE sections that make `qwen35`'s interleaved M-RoPE plain RoPE for text.

Facts from llama.cpp (the version llama-cpp-python 0.3.36 vendors; src/models/qwen35.cpp, qwen3.cpp,
src/llama-model.cpp, ggml-cpu/ops.cpp) that the table relies on:
  - `qwen35`, a full-attention layer: one `attn_q` projection of width 2 * heads * head_dim read per head as
    [q_h | g_h] (Qwen3-Next's per-head interleave), QK-norm on q_h and k, RoPE, attention, `attn * sigmoid(g)`,
    `attn_output` (no bias). Dense SwiGLU FFN after `post_attention_norm`. Which layers are recurrent (gated delta
    net) is `attention.recurrent_layers` (or `full_attention_interval`); the SSM keys are always read.
  - llama.cpp cannot run a `qwen35` file with NO recurrent layer unpatched: the hybrid memory's input
    (llm_graph_input_mem_hybrid::set_input, src/llama-graph.cpp) writes the recurrent state-copy tensor `s_copy`,
    which no node of an all-attention graph uses, so the scheduler never allocates it and the first decode aborts
    with `GGML_ASSERT(buffer) failed` (ggml-backend.cpp, ggml_backend_buffer_get_type). `qwen3next` builds the same
    hybrid input (src/models/qwen3next.cpp). The export therefore appends ONE no-op recurrent layer after the model's
    layers: every projection out of it (ssm_out, ffn_down) is zero, all its other tensors zero or one, so it adds
    exactly 0.0 to the residual stream (x + 0 == x in floating point) and the logits are the model's. Its cost: one
    FFN of zeros (llama.cpp sizes every layer's FFN alike) and a 16-wide delta-net state.
  - RMSNorm everywhere is `w * x / rms(x)` (plain, as ours; HF's Qwen3.5 checkpoints store zero-centred w - 1 and
    their converter adds the 1 back, so there is nothing to undo here).
  - `qwen35` rotates with interleaved M-RoPE (rope type IMROPE): pair k of the rotated dims takes the position of
    component t, h or w by k % 3 (while k < 3 * sections[k % 3]) and component e otherwise. For a text token llama.cpp
    sets t = h = w = the position and e = 0, so every pair assigned to t/h/w turns exactly as NEOX RoPE does (the
    frequency depends on k alone). `mrope_sections` assigns every pair: sections[j] = #{k < rot/2 : k % 3 == j}.
  - `qwen3` (our ungated models): separate q/k/v, QK-norm, NEOX RoPE, `ffn_norm` before the FFN.
  - Both: a missing `output` tensor means a tied head (token_embd is reused); q/k/v biases are optional.
"""
from __future__ import annotations

from dataclasses import dataclass

# Native (HF Qwen3) parameter name -> gguf-py MODEL_TENSOR member; "{i}" is the layer index. The GGUF name itself
# comes from gguf-py's TENSOR_NAMES, so a spelling can never drift from llama.cpp's.
COMMON_TENSORS: dict[str, str] = {
    "model.embed_tokens.weight": "TOKEN_EMBD",
    "model.norm.weight": "OUTPUT_NORM",
    "lm_head.weight": "OUTPUT",
    "model.layers.{i}.input_layernorm.weight": "ATTN_NORM",
    "model.layers.{i}.self_attn.q_proj.weight": "ATTN_Q",  # qwen35: the fused per-head [q_h | g_h] rows
    "model.layers.{i}.self_attn.q_proj.bias": "ATTN_Q",
    "model.layers.{i}.self_attn.k_proj.weight": "ATTN_K",
    "model.layers.{i}.self_attn.k_proj.bias": "ATTN_K",
    "model.layers.{i}.self_attn.v_proj.weight": "ATTN_V",
    "model.layers.{i}.self_attn.v_proj.bias": "ATTN_V",
    "model.layers.{i}.self_attn.o_proj.weight": "ATTN_OUT",
    "model.layers.{i}.self_attn.q_norm.weight": "ATTN_Q_NORM",
    "model.layers.{i}.self_attn.k_norm.weight": "ATTN_K_NORM",
    "model.layers.{i}.mlp.gate_proj.weight": "FFN_GATE",
    "model.layers.{i}.mlp.up_proj.weight": "FFN_UP",
    "model.layers.{i}.mlp.down_proj.weight": "FFN_DOWN",
}


@dataclass(frozen=True)
class GGUFArch:
    """One llama.cpp architecture our models export to, and how it differs from the common map above."""
    name: str  # general.architecture (gguf-py MODEL_ARCH value)
    gates: tuple[str, ...]  # native gate names it runs exactly
    fused_gate: bool  # the gate rows live in attn_q, per head [q_h | g_h] (Qwen3-Next's per_head layout)
    pre_ffn_norm: str  # MODEL_TENSOR of post_attention_layernorm: qwen35 ATTN_POST_NORM, qwen3 FFN_NORM
    mrope: bool  # rope type IMROPE: write rope.dimension_sections
    ssm_keys: bool  # the hybrid loader reads the SSM keys and the recurrent-layer list
    noop_recurrent_layer: bool  # append one recurrent layer that adds exactly zero (see the module docstring)


ARCHS: dict[str, GGUFArch] = {
    "qwen35": GGUFArch("qwen35", ("sdpa_elementwise", "sdpa_headwise"), True, "ATTN_POST_NORM", True, True, True),
    "qwen3": GGUFArch("qwen3", ("none",), False, "FFN_NORM", False, False, False),
}

# The SSM hyper-parameters `qwen35` requires; only the no-op recurrent layer uses them: the smallest consistent values
# (one group, one value head, state 16, conv kernel 4).
QWEN35_NOOP_SSM = dict(conv_kernel=4, inner_size=16, state_size=16, time_step_rank=1, group_count=1)


# no-op layer tensors kept F32 whatever --outtype says: its delta-net tensors (tiny: 16-wide), as llama.cpp's own
# converter keeps them out of quantization (ggml's CPU ssm_conv takes an F32 kernel only, and a Q8_0 ssm_beta of
# one row crashed the CPU backend here). Its FFN (zeros) follows --outtype.
NOOP_F32 = ("attn_qkv.weight", "attn_gate.weight", "ssm_conv1d.weight", "ssm_beta.weight", "ssm_alpha.weight",
            "ssm_out.weight")


def noop_recurrent_tensors(layer: int, hidden: int, ffn: int) -> dict[str, tuple[tuple[int, ...], float]]:
    """GGUF name -> (shape in PyTorch (out, in) order, fill value) of the no-op delta-net layer `layer`, shapes as
    qwen35's load_block_trunk creates them (llama.cpp's ne order is this reversed). Only the norms are one; the
    tensors named in NOOP_F32 stay F32."""
    s = QWEN35_NOOP_SSM
    key_dim, value_dim = s["state_size"] * s["group_count"], s["state_size"] * s["time_step_rank"]
    b = f"blk.{layer}."
    return {
        b + "attn_norm.weight": ((hidden,), 1.0),
        b + "post_attention_norm.weight": ((hidden,), 1.0),
        b + "attn_qkv.weight": ((2 * key_dim + value_dim, hidden), 0.0),
        b + "attn_gate.weight": ((value_dim, hidden), 0.0),
        b + "ssm_conv1d.weight": ((2 * key_dim + value_dim, s["conv_kernel"]), 0.0),
        b + "ssm_dt.bias": ((s["time_step_rank"],), 0.0),
        b + "ssm_a": ((s["time_step_rank"],), 0.0),
        b + "ssm_beta.weight": ((s["time_step_rank"], hidden), 0.0),
        b + "ssm_alpha.weight": ((s["time_step_rank"], hidden), 0.0),
        b + "ssm_norm.weight": ((s["state_size"],), 1.0),
        b + "ssm_out.weight": ((hidden, value_dim), 0.0),
        b + "ffn_gate.weight": ((ffn, hidden), 0.0),
        b + "ffn_up.weight": ((ffn, hidden), 0.0),
        b + "ffn_down.weight": ((hidden, ffn), 0.0),
    }

# --outtype / --gate-type names -> gguf-py GGMLQuantizationType member; 1-D tensors (norms, biases) stay F32 always.
OUTTYPES: dict[str, str] = {"f32": "F32", "f16": "F16", "bf16": "BF16", "q8_0": "Q8_0"}
# general.file_type of a file whose matrices are mostly OUTTYPE (gguf-py LlamaFileType member)
FILE_TYPES: dict[str, str] = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0"}

# tokenizer.json pre-tokenizers llama.cpp reproduces, by its `tokenizer.ggml.pre` name. Ours (data/tokenizer.py) is
# byte-level BPE with HF ByteLevel(add_prefix_space=False, use_regex=True): GPT-2's regex, llama.cpp's "gpt-2".
BYTE_LEVEL_GPT2 = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}
PRE_TOKENIZERS: dict[str, dict] = {"gpt-2": BYTE_LEVEL_GPT2}


def arch_for(gate: str) -> GGUFArch:
    """The architecture that runs a model with native gate `gate` unpatched (or one clear error)."""
    for arch in ARCHS.values():
        if gate in arch.gates:
            return arch
    runnable = ", ".join(f"{g} ({a.name})" for a in ARCHS.values() for g in a.gates)
    raise ValueError(f"gate {gate!r} has no llama.cpp architecture that computes it; GGUF export takes: {runnable}")


def mrope_sections(rotary_dim: int) -> list[int]:
    """[t, h, w, e] sections under which interleaved M-RoPE rotates every one of the rotary_dim / 2 pairs by the
    token's position (component e, position 0 for text, gets none): plain NEOX RoPE for text."""
    pairs = rotary_dim // 2
    return [len(range(j, pairs, 3)) for j in range(3)] + [0]


def imrope_component(pair: int, sections: list[int]) -> str:
    """Which position component llama.cpp's interleaved M-RoPE uses for rotary pair `pair` (ggml_mrope_cache_init's
    rule, restated for the check in the tests): 't', 'h', 'w' or 'e'."""
    sector = pair % sum(sections)
    for j, comp in ((1, "h"), (2, "w"), (0, "t")):
        if sector % 3 == j and sector < 3 * sections[j]:
            return comp
    return "e"


def gguf_tensor(native_key: str, arch: GGUFArch) -> tuple[str, str] | None:
    """(MODEL_TENSOR member, GGUF tensor name) of a native key; None: the key has no GGUF tensor of its own."""
    import re

    import gguf

    m = re.match(r"^model\.layers\.(\d+)\.(.*)$", native_key)
    pattern, layer = (f"model.layers.{{i}}.{m[2]}", int(m[1])) if m else (native_key, None)
    suffix = native_key.rsplit(".", 1)[1]  # weight | bias
    if pattern == "model.layers.{i}.post_attention_layernorm.weight":
        member = arch.pre_ffn_norm
    else:
        member = COMMON_TENSORS.get(pattern)
    if member is None:
        return None
    base = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR[member]]
    return member, (base.format(bid=layer) if layer is not None else base) + f".{suffix}"
