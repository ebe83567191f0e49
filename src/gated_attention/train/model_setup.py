"""What a training run trains: the model (fresh, or continued from a checkpoint), which parameters are trainable,
activation checkpointing of its decoder layers, and the optimizer's parameter groups. Split from trainer.py so the loop reads on its own; trainer re-exports these names.
"""
from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import (CheckpointPolicy, _CachedTorchDispatchMode, checkpoint,
                                    create_selective_checkpoint_contexts)

from ..modeling import set_exact_checkpointing
from .config import TrainConfig, checkpointing_mode


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
        from gated_attention.kernels.triton_attention import TRITON_PIN

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


def _aten_ops(*names: str) -> frozenset:
    """The default overloads of the aten ops named that this torch build has (the attention kernels differ by build)."""
    return frozenset(getattr(torch.ops.aten, n).default for n in names if hasattr(torch.ops.aten, n))


# What `selective` keeps: the outputs of the GEMMs (the fused q/k/v/gate projection, o_proj, the SwiGLU's and the
# experts' projections, the router) and of the attention kernel (its output and log-sum-exp). Everything between them
# (RMSNorm, QK-norm, RoPE, the gate's sigmoid and product, SiLU and the SwiGLU product, reshapes, casts, the MoE
# sort/gather) is recomputed in backward from these: cheap elementwise work, ~half the bytes `none` keeps per layer.
SELECTIVE_SAVES = _aten_ops("mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "_scaled_mm",
                            "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                            "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")


def selective_policy(ctx, op, *args, **kwargs):
    """torch.utils.checkpoint's per-op policy of `selective` (SELECTIVE_SAVES kept, the rest recomputed)."""
    return CheckpointPolicy.MUST_SAVE if op in SELECTIVE_SAVES else CheckpointPolicy.PREFER_RECOMPUTE


class _RecomputeUnsaved(_CachedTorchDispatchMode):
    """The recompute's side of `selective`: the kept outputs are handed back in their forward order (torch's
    cached mode, which checks each against the forward's), every other op simply runs again. torch's own mode also
    wants the other ops in the forward's count, which module hooks inside a layer break without changing the math:
    under expert parallelism the experts' own FSDP2 group opens one more profiler range (FSDP::root_pre_forward, a
    dispatcher op) when it runs inside backward, and torch's mode raised there (tests/test_expert_parallel.py's
    ep2-selective). torch's private class, as xformers subclasses it; torch is pinned."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func not in SELECTIVE_SAVES:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


def selective_contexts():
    """`selective`'s context_fn of torch.utils.checkpoint: torch's caching mode in forward (the policy above), the
    recompute in _RecomputeUnsaved. A module function: torch.compile traces a checkpoint with it (the compiled graph's
    partitioner then keeps what the policy says; neither mode runs there)."""
    caching, _ = create_selective_checkpoint_contexts(selective_policy)
    return caching, _RecomputeUnsaved(None, caching.storage)


def apply_activation_checkpointing(layers: list[nn.Module], mode: str) -> int:
    """Checkpoint the decoder layers in `layers` by `mode` (config.checkpointing_mode): "full" every layer keeps only
    its inputs in forward and recomputes itself in backward (torch.utils.checkpoint, non-reentrant); "every:N" the
    same for layers 0, N, 2N, ... only; "selective" every layer keeps its GEMM and attention outputs too
    (SELECTIVE_SAVES, torch.utils.checkpoint's selective contexts) and recomputes the rest; "none" leaves them as they
    are. Returns how many layers now checkpoint.

    The hook is the decoder layer's own (transformers' GradientCheckpointingLayer, documented there: a
    `gradient_checkpointing` flag and the checkpoint function `_gradient_checkpointing_func`): it checkpoints the
    layer's `forward` only in training mode with grad enabled, so FSDP2's module hooks stay outside the recomputed
    region (apply before `fully_shard`), evaluation and no-grad probes run unchanged, and the trainer's compiled layer
    forward (train/fastpath.py: it calls the outermost checkpointing forward) traces the checkpoint into its graph.
    The numbers equal "none" in every mode: the recompute replays the forward exactly (`modeling.exact_checkpoint`:
    the same bf16 GEMM emulation, the MoE blocks' recorded routing and global-batch counts; under `selective` the
    kept outputs are the forward's own tensors)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    kind, every = checkpointing_mode(mode)
    if kind == "none":
        return 0
    if not layers or not all(isinstance(layer, GradientCheckpointingLayer) for layer in layers):
        raise ValueError(f"activation_checkpointing={mode} needs the model's decoder layers (GatedQwen3DecoderLayer, "
                         "or any transformers GradientCheckpointingLayer); use --set activation_checkpointing=none")
    extra = {"context_fn": selective_contexts} if kind == "selective" else {}
    chosen = layers[::every]
    set_exact_checkpointing(chosen, functools.partial(checkpoint, use_reentrant=False, **extra))
    return len(chosen)
