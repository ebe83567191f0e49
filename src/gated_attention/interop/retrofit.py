"""Gate retrofit: add a gate to a trained ungated checkpoint for continued pre-training (paper App. A.7, official
repository's issue #10). `gattn retrofit CKPT --gate NAME --init {identity,random} --out DST`.

Input: a native checkpoint (`save_pretrained` dir, e.g. a training run's `final/`), or a stock transformers Qwen3 /
Qwen3-MoE / Llama / Mistral / Qwen2 dir or an ungated official one, which first go through interop's format ->
native maps (the format is read from config.json's model_type). Every
existing tensor is copied bit for bit; only the gate's parameters are new. The result is a normal native checkpoint
(config.json + model.safetensors + the source's tokenizer files), written atomically; continue training it with
`gattn train --gate NAME --set init_from=DST` (add `--set trainable=gates` to train only the new gate parameters).

The two inits (what issue #10 reports for each):
  identity  gate weights zero and `gate_init="identity"` in config.json, which makes the gate module scale its score by
            1/act(0) (sigmoid: 2*sigmoid(XW)); at step 0 the score is exactly 1 and the logits are bit-identical to the
            source's. This is the maintainer's trick from issue #10, and the 1/act(0) scale STAYS for the rest of the
            model's life (it is part of the architecture, not an init): the gate ranges over (0, 2) instead of (0, 1).
            Maintainer's finding: the gate parameters barely move and there is no gain.
  random    the official from-scratch init: gate weights ~ N(0, initializer_range), bias 0, `gate_init="normal"`
            (score ~0.5 at start, so each gated layer's attention output roughly halves). Maintainer's finding: a loss
            spike, then a slow recovery that "often harms" the model.
Inits the gate's kind fixes regardless: the input-independent gate's theta starts at 0 (the paper's init) under both;
the parameter-free transforms (sdpa_rmsnorm, sdpa_silu) change the output, so they cannot start as an identity and are
refused with `identity`.

The FFN is NOT shrunk (unlike `presets.model_config(..., match_params=True)` for from-scratch runs): retrofitting keeps
the trained weights, so the model grows by the gate's parameters, as in the paper's continued-pre-training experiment.
"""
from __future__ import annotations

from pathlib import Path

from .layouts import UNGATED_SOURCES, ConversionError

# torch and the converters are imported inside the functions: `gattn retrofit`'s options read INITS and
# SOURCE_FORMATS without them

INITS = ("identity", "random")
SOURCE_FORMATS = UNGATED_SOURCES  # a new ungated Layout row is a retrofit source without an edit here
_BY_MODEL_TYPE = {"gated_qwen3": "native", "qwen3_moe": "qwen3-moe", "llama": "llama", "mistral": "mistral",
                  "qwen2": "qwen2"}
# config.json keys that only the official code writes (its model_type is plain "qwen3", like stock Qwen3's)
_OFFICIAL_KEYS = ("elementwise_attn_output_gate", "headwise_attn_output_gate", "qkv_bias", "use_qk_norm")


def detect_format(config: dict) -> str:
    """The convert format of a config.json dict: native, qwen3-moe, llama, mistral, qwen2, official (qwen3 +
    official flags) or qwen3."""
    mt = config.get("model_type")
    if mt in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[mt]
    if mt == "qwen3":
        return "official" if any(k in config for k in _OFFICIAL_KEYS) else "qwen3"
    raise ConversionError(f"cannot retrofit a checkpoint with model_type {mt!r}; supported: gated_qwen3 (native), "
                          "qwen3 (stock or official, ungated), qwen3_moe, llama, mistral, qwen2 (convert other "
                          "formats first: gattn convert)")


def _gate_tensors(config, layer_idx: int, init: str, dtype: torch.dtype, generator: torch.Generator) -> dict:
    """The new gate parameters of one layer, keyed by their full state-dict names."""
    import torch

    from ..gate_layer import build_gate

    gate = build_gate(config.gate, config)
    prefix = f"model.layers.{layer_idx}.self_attn.gate."
    out = {}
    for name, p in gate.named_parameters():
        if name == "proj.weight" and init == "random":
            # the official init of every Linear: N(0, initializer_range); drawn in fp32 so the numbers do not
            # depend on the checkpoint's dtype, then cast
            t = torch.randn(p.shape, generator=generator) * config.initializer_range
        elif name == "norm.weight":
            t = torch.ones(p.shape)  # RMSNorm gain starts at 1 (Qwen3 convention)
        else:
            t = torch.zeros(p.shape)  # identity: zero weights and bias; random: bias 0; constant gate: theta 0
        out[prefix + name] = t.to(dtype)
    return out


def retrofit_state(config: dict, state: dict, gate: str, init: str = "identity", seed: int = 0,
                   src_format: str = "auto") -> tuple[dict, dict]:
    """In memory: an ungated (config.json dict, state dict) -> the native (config.json dict, state dict) with `gate`
    added. Existing tensors are passed through unchanged (same objects)."""
    import torch

    from ..configuration import GatedQwen3Config
    from ..gates import Source, canonical_name, get_gate
    from .configs import config_from_native, config_to_native
    from .states import native_shapes, state_to_native, validate_state

    if init not in INITS:
        raise ValueError(f"unknown retrofit init {init!r}; valid: {', '.join(INITS)}")
    if src_format not in SOURCE_FORMATS:
        raise ValueError(f"unknown source format {src_format!r}; valid: {', '.join(SOURCE_FORMATS)}")
    fmt = detect_format(config) if src_format == "auto" else src_format
    ncfg = config_to_native(config, fmt, state)
    nstate = state_to_native(state, ncfg, fmt)
    have = ncfg.get("gate", "none")
    if canonical_name(have) != "none":
        raise ValueError(f"the checkpoint already has gate {have!r}; retrofit adds a gate to an UNGATED model "
                         "(train it further with `gattn train --set init_from=DIR` instead)")
    name = canonical_name(gate)
    spec = get_gate(name)
    if spec is None:
        raise ValueError("--gate baseline adds nothing; name a gate (see `gattn gates`), e.g. sdpa_elementwise")
    if init == "identity" and spec.source is Source.NONE:
        raise ValueError(f"gate {name!r} is a parameter-free transform of the attention output; it cannot start as an "
                         "identity: use --init random (it has no random parameters) or a gate with a score")
    new = {**ncfg, "gate": name, "gate_init": "identity" if init == "identity" else "normal"}
    cfg = GatedQwen3Config(**new)  # validates the gate/init pair (e.g. identity needs act(0) != 0 when multiplying)
    dtype = nstate["model.layers.0.self_attn.q_proj.weight"].dtype
    generator = torch.Generator().manual_seed(seed)
    out_state = dict(nstate)
    for i in range(cfg.num_hidden_layers):
        out_state.update(_gate_tensors(cfg, i, init, dtype, generator))
    validate_state(out_state, native_shapes(new), "retrofitted", tied=bool(cfg.tie_word_embeddings))
    out_config = config_from_native(new, "native")
    out_config["architectures"] = ["GatedQwen3ForCausalLM"]
    return out_config, out_state


def retrofit_checkpoint(src: str | Path, dst: str | Path, gate: str, init: str = "identity", seed: int = 0,
                        src_format: str = "auto", overwrite: bool = False) -> Path:
    """Read the ungated checkpoint dir SRC, add `gate`, write the native checkpoint DST atomically (with SRC's
    tokenizer and generation files). Returns DST."""
    from .checkpoints import load_dir, save_dir

    config, state = load_dir(src)
    out_config, out_state = retrofit_state(config, state, gate, init, seed, src_format)
    return save_dir(dst, out_config, out_state, src=src, overwrite=overwrite)


__all__ = ["INITS", "detect_format", "retrofit_state", "retrofit_checkpoint"]
