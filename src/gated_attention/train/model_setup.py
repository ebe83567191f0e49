"""What a training run trains: the model (fresh, or continued from a checkpoint), which parameters are trainable, and
the optimizer's parameter groups. Split from trainer.py so the loop reads on its own. Activation checkpointing of the
decoder layers has its own file (train/activation_checkpoint.py).
"""
from __future__ import annotations

import torch
from torch import nn

from .config import TrainConfig


def build_model_config(cfg: TrainConfig, vocab_size: int | None = None):
    from gated_attention.presets import model_config

    over = dict(cfg.model_overrides)
    if vocab_size is not None:
        if "vocab_size" in over and over["vocab_size"] < vocab_size:
            raise ValueError(f"model.vocab_size={over['vocab_size']} is smaller than the tokenizer's {vocab_size}")
        over.setdefault("vocab_size", vocab_size)
    return model_config(cfg.model, gate=cfg.gate, attn_implementation=cfg.attn_implementation,
                        ffn_multiple=cfg.ffn_multiple or None, **over)


def check_attn_implementation(name: str, device: torch.device) -> None:
    """One clear error before anything is built when the chosen attention kernel cannot run on this run's device."""
    from gated_attention.util.errors import UserError

    if name != "triton_gated":
        return
    if device.type != "cuda":
        raise UserError(f"attn_implementation=triton_gated needs a CUDA GPU, but this run's device is {device.type}; "
                        "use --set attn_implementation=sdpa (the default) here")
    try:
        import triton  # noqa: F401
    except ImportError:
        from gated_attention.kernels import TRITON_PIN  # not triton_attention: registering its ops imports Triton

        raise UserError(f"attn_implementation=triton_gated needs Triton: pip install '{TRITON_PIN}' (the 'kernel' "
                        "extra), or use --set attn_implementation=sdpa") from None


def build_model(cfg: TrainConfig, vocab_size: int | None = None) -> nn.Module:
    from gated_attention.modeling import GatedQwen3ForCausalLM

    if cfg.init_from:
        return load_init_model(cfg, vocab_size)
    return GatedQwen3ForCausalLM(build_model_config(cfg, vocab_size))


def init_config(cfg: TrainConfig, vocab_size: int | None = None):
    """The model config of continued training from `cfg.init_from`, checked against the run (its gate, the
    tokenizer's vocabulary): what load_init_model loads into, and what a sharded-from-birth run builds on meta."""
    from gated_attention.configuration import GatedQwen3Config
    from gated_attention.gates import canonical_name

    from gated_attention.util.io import check_hf_dir

    check_hf_dir(cfg.init_from, "init_from")  # a folder, config.json parses, weights present and intact
    config = GatedQwen3Config.from_pretrained(cfg.init_from, attn_implementation=cfg.attn_implementation,
                                              **cfg.model_overrides)
    if canonical_name(cfg.gate) != config.gate:
        raise ValueError(f"init_from={cfg.init_from} holds gate {config.gate!r} but the run says gate={cfg.gate!r}; "
                         f"pass --gate {config.gate}")
    if vocab_size is not None and config.vocab_size < vocab_size:
        raise ValueError(f"init_from={cfg.init_from} has vocab_size {config.vocab_size}, smaller than the "
                         f"tokenizer's {vocab_size}: use the tokenizer that checkpoint was trained with")
    return config


def load_init_model(cfg: TrainConfig, vocab_size: int | None = None) -> nn.Module:
    """Continued training: the weights of the checkpoint dir `cfg.init_from` (from_pretrained, fp32 master weights)
    instead of a fresh init. Its config.json sets the model (cfg.model is unused); model.* overrides are applied on
    top and must not change any weight's shape. The run's gate must name the checkpoint's (so logs say what ran)."""
    from gated_attention.modeling import GatedQwen3ForCausalLM

    config = init_config(cfg, vocab_size)
    model, info = GatedQwen3ForCausalLM.from_pretrained(cfg.init_from, config=config, dtype=torch.float32,
                                                        attn_implementation=cfg.attn_implementation,
                                                        output_loading_info=True)
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if bad:  # from_pretrained only warns; a silently re-initialised weight is not continued training
        raise ValueError(f"init_from={cfg.init_from} does not match its model config: {bad}")
    return model


def apply_trainable(model: nn.Module, trainable: str) -> list[str]:
    """Freeze what `trainable` excludes; returns the names left trainable. "gates": only the attention gates'
    parameters (`...self_attn.gate.*`), so a retrofitted pretrained model is fine-tuned at the gate's cost."""
    if trainable == "all":
        return [n for n, p in model.named_parameters() if p.requires_grad]
    names = []
    for name, p in model.named_parameters():
        keep = ".self_attn.gate." in f".{name}"
        p.requires_grad_(keep)
        if keep:
            names.append(name)
    if not names:
        raise ValueError("trainable=gates but the model has no gate parameters (gate=none or a parameter-free "
                         "gate); add one first: gattn retrofit CKPT --gate sdpa_elementwise --init identity --out DIR")
    return names


def param_groups(model: nn.Module, cfg: TrainConfig) -> list[dict]:
    """Weight decay on matrices only: norms/biases (ndim < 2) and, by default, embeddings are not decayed."""
    embed_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    seen = set()
    for _, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))  # tied weights appear once
        if p.ndim < 2 or (id(p) in embed_ids and not cfg.wd_on_embeddings):
            no_decay.append(p)
        else:
            decay.append(p)
    return [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
