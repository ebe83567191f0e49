"""Activation checkpointing of the decoder layers (`activation_checkpointing`: "full", "selective", "every:N"):
which layers recompute their forward in backward, and under `selective` which op outputs each layer keeps.

`apply_activation_checkpointing(layers, mode)` is step 4 of train/parallelize.py (before sharding, so FSDP2's hooks
stay outside the recomputed region, and before the compiled forward traces the checkpoint); the plan's activation
model (train/plan_activations.py) counts what each mode keeps. The setting's forms are parsed by
config.checkpointing_mode.
"""
from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import (CheckpointPolicy, _CachedTorchDispatchMode, checkpoint,
                                    create_selective_checkpoint_contexts)

from ..kernels import FLASH_ATTENTION_OP
from ..modeling import set_exact_checkpointing
from .config import checkpointing_mode


def _ops(namespace, *names: str) -> frozenset:
    """The default overloads of the ops named that this torch build has (the attention kernels differ by build)."""
    return frozenset(getattr(namespace, n).default for n in names if hasattr(namespace, n))


# What `selective` keeps: the outputs of the GEMMs (the fused q/k/v/gate projection, o_proj, the SwiGLU's and the
# experts' projections, the router) and of the attention kernel (its output and log-sum-exp; for `triton_gated` the
# gated output). Everything between them
# (RMSNorm, QK-norm, RoPE, the gate's sigmoid and product, SiLU and the SwiGLU product, reshapes, casts, the MoE
# sort/gather) is recomputed in backward from these: cheap elementwise work, ~half the bytes `none` keeps per layer.
# And the outputs of the functional collectives (expert parallelism's all-to-alls; reduce-scatter and all-gather as
# torchtitan's list has the first two), so a recompute never communicates again. Not wait_tensor (nor in
# torchtitan's list): it returns its input, here a kept output already, so waiting again communicates nothing.
SELECTIVE_SAVES = _ops(torch.ops.aten, "mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "_scaled_mm",
                       "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                       "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention"
                       ) | _ops(torch.ops._c10d_functional, "all_to_all_single", "reduce_scatter_tensor",
                                "all_gather_into_tensor")
# ...and, by name, the `triton_gated` kernel's op, which exists only once that backend has run (kernels/__init__.py)
SELECTIVE_SAVE_NAMES = frozenset({FLASH_ATTENTION_OP})


def keeps(op) -> bool:
    """True for the ops whose outputs `selective` keeps."""
    return op in SELECTIVE_SAVES or (isinstance(op, torch._ops.OpOverload) and op.name() in SELECTIVE_SAVE_NAMES)


def selective_policy(ctx, op, *args, **kwargs):
    """torch.utils.checkpoint's per-op policy of `selective` (the ops `keeps` names kept, the rest recomputed)."""
    return CheckpointPolicy.MUST_SAVE if keeps(op) else CheckpointPolicy.PREFER_RECOMPUTE


class _RecomputeUnsaved(_CachedTorchDispatchMode):
    """The recompute's side of `selective`: the kept outputs are handed back in their forward order (torch's
    cached mode, which checks each against the forward's), every other op simply runs again. torch's own mode also
    wants the other ops in the forward's count, which module hooks inside a layer break without changing the math:
    under expert parallelism the experts' own FSDP2 group opens one more profiler range (FSDP::root_pre_forward, a
    dispatcher op) when it runs inside backward, and torch's mode raised there (tests/test_expert_parallel.py's
    ep2-selective). torch's private class, as xformers subclasses it; torch is pinned."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not keeps(func):
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
    (`keeps`, torch.utils.checkpoint's selective contexts) and recomputes the rest; "none" leaves them as they are.
    Returns how many layers now checkpoint.

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
    set_exact_checkpointing(chosen, functools.partial(checkpoint, use_reentrant=False, **extra),
                            keeps_collectives=kind == "selective")
    return len(chosen)
