"""The GGUF layout as data: which llama.cpp architecture holds which of our models, how native tensor names map to
GGUF tensor names, and the M-RoPE sections that make `qwen35`'s interleaved M-RoPE plain RoPE for text.

Facts from llama.cpp (the version llama-cpp-python 0.3.36 vendors; src/models/qwen35.cpp, qwen3.cpp,
src/llama-model.cpp, ggml-cpu/ops.cpp) that the table relies on:
  - `qwen35`, a full-attention layer: one `attn_q` projection of width 2 * heads * head_dim read per head as
    [q_h | g_h] (Qwen3-Next's per-head interleave), QK-norm on q_h and k, RoPE, attention, `attn * sigmoid(g)`,
    `attn_output` (no bias). Dense SwiGLU FFN after `post_attention_norm`. A layer is recurrent (gated delta net)
    unless `full_attention_interval` divides its index + 1, so interval 1 makes every layer full attention; the SSM
    keys are still read (required) but no tensor of a recurrent layer is.
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
    ssm_keys: bool  # the hybrid loader reads the SSM keys and full_attention_interval even with no recurrent layer


ARCHS: dict[str, GGUFArch] = {
    "qwen35": GGUFArch("qwen35", ("sdpa_elementwise", "sdpa_headwise"), True, "ATTN_POST_NORM", True, True),
    "qwen3": GGUFArch("qwen3", ("none",), False, "FFN_NORM", False, False),
}

# The SSM hyper-parameters `qwen35` requires. With full_attention_interval = 1 no layer is recurrent, so no tensor or
# state uses them; they are the smallest consistent values (one group, one head of state 16, kernel 4).
QWEN35_UNUSED_SSM = dict(conv_kernel=4, inner_size=16, state_size=16, time_step_rank=1, group_count=1)

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
