"""The trainer's one init stream, in every mode: the model is built on the meta device (no memory, no RNG draws),
parallelized (under dist=fsdp sharded by FSDP2 while it holds no data), then allocated and filled — from the init
stream below, or from an `init_from` checkpoint read slice by slice — each rank only its own shards under FSDP2, so
no rank ever holds the whole model there.

The init stream is Hugging Face's own: `_init_weights` module by module in `PreTrainedModel.initialize_weights`'
post-order, from `torch.manual_seed(cfg.seed)`. It is replayed on a *twin*, a second meta build of the unsharded
model: one module at a time, the twin's own parameters and buffers get full-size temporaries, `_init_weights` fills
them (the same draws, in the same order, whatever the mode), each rank copies its block (FSDP2 shards dim 0 in
`torch.chunk` pieces; the routed experts dim 1 where whole experts would pad) into its local shard — in one process
and under DDP, the whole tensor — and the temporaries go. The temporaries live on the device the rank trains on, so
a GPU rank draws its init there (the device's own generator, seeded by the same `torch.manual_seed`) and copies its
block without a trip through host memory; no rank draws on the CPU for a GPU model.
The largest temporary is one module's own parameters (the embedding, a layer's experts), never the model; RNG draws
are identical on every rank, in every mode and at every world size, so a seed gives the same weights in one process,
under DDP and under FSDP2 on one kind of device (tested on CPU: one process, DDP and FSDP2 at 2 ranks, gathered and
compared exactly). A GPU's generator is not the CPU's: the same seed gives other (equally distributed) weights on a
GPU than on a CPU.

This stream is not the one of a model constructed on CPU (`GatedQwen3ForCausalLM(config)`: its layers draw a default
init at construction before HF's init overwrites it, which shifts the generator); `init_model` is the one-process
build with the trainer's stream, for code that needs the trainer's model outside a run (the stability lab's loss at
init). A lab's own model factory keeps its own weights.
"""
from __future__ import annotations

import torch
from torch import nn


def build_on_meta(factory, cfg, vocab_size: int | None) -> nn.Module:
    """factory(cfg, vocab_size) under the meta device: parameters and buffers without storage; HF skips its init.
    Continued training (`init_from`) builds the checkpoint's model (its config, checked) without loading it."""
    from .model_setup import build_model, init_config

    with torch.device("meta"):
        if cfg.init_from and factory is build_model:
            from ..modeling import GatedQwen3ForCausalLM

            return GatedQwen3ForCausalLM(init_config(cfg, vocab_size))
        return factory(cfg, vocab_size)


def _post_order(module: nn.Module, path: str = ""):
    """(path, module) in the order `PreTrainedModel.initialize_weights` visits them: children first."""
    for name, child in module.named_children():
        yield from _post_order(child, f"{path}.{name}" if path else name)
    yield path, module


def local_index(dst, shape) -> tuple[slice, ...]:
    """The slices of a global tensor of `shape` that the DTensor `dst` holds on this rank, from its own mesh and
    placements: FSDP2's dim-0 Shard over every rank (torch.chunk pieces of ceil(rows / N) rows: the last ranks may
    hold fewer or none), HSDP's (Replicate, Shard(0)) over the (replicate, shard) mesh, the routed experts'
    expert-parallel Shard(0) under FSDP2's strided dim-0 shard, or their Shard(1) where whole experts would pad
    (train/expert_parallel.py: expert_placements): each a block of the global tensor."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local, offset = compute_local_shape_and_global_offset(tuple(shape), dst.device_mesh, dst.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, local))


def fill(dst: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's part of the full tensor `full` into `dst` (a plain tensor, or a sharded DTensor)."""
    to_local = getattr(dst, "to_local", None)
    if to_local is None:
        dst.data.copy_(full.to(dst.device, dst.dtype))
        return
    local = to_local()
    index = local_index(dst, full.shape) if full.dim() else ()
    part = full[index] if full.dim() else full
    if tuple(local.shape) != tuple(part.shape):
        raise RuntimeError(f"shard of shape {tuple(local.shape)} vs {index} of {tuple(full.shape)}: not a block of "
                           "the global tensor")
    local.copy_(part.to(local.device, local.dtype))


def _to_empty(model: nn.Module, device: torch.device) -> None:
    """Storage for every parameter and buffer; tied weights stay one tensor (to_empty allocates per module: an
    unsharded model is re-tied by HF's tie_weights; FSDP2 holds a shared parameter once already)."""
    model.to_empty(device=device)
    sharded = any(hasattr(p, "to_local") for p in model.parameters())
    if not sharded and hasattr(model, "tie_weights"):
        model.tie_weights()


def materialize(model: nn.Module, twin: nn.Module, seed: int, device: torch.device) -> None:
    """Allocate `model` (meta, sharded or not) on `device` and fill it with the init stream of `twin` (an unsharded
    meta build of the same model) from `seed`, one module at a time."""
    from transformers import initialization as hf_init

    _to_empty(model, device)
    torch.manual_seed(seed)
    with torch.no_grad(), hf_init.guard_torch_init_functions():
        for path, tmod in _post_order(twin):
            own_p = [(n, p) for n, p in tmod._parameters.items() if p is not None]
            own_b = [(n, b) for n, b in tmod._buffers.items() if b is not None]
            if not own_p and not own_b:
                twin._initialize_weights(tmod)  # draws nothing, but keeps HF's visiting flags as in one process
                continue
            for n, p in own_p:  # on the rank's device: the draws happen where the shard lives
                tmod._parameters[n] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                                   p.requires_grad)
            for n, b in own_b:
                tmod._buffers[n] = torch.empty(b.shape, dtype=b.dtype, device=device)
            twin._initialize_weights(tmod)
            dst = model.get_submodule(path)
            for n, _ in own_p:
                fill(dst._parameters[n], tmod._parameters[n].data)
            for n, _ in own_b:
                dst._buffers[n].copy_(tmod._buffers[n].to(dst._buffers[n].device))
            for n, p in own_p:  # the temporaries go: the twin keeps no data
                tmod._parameters[n] = p
            for n, b in own_b:
                tmod._buffers[n] = b
    _check_no_meta_left(model)


def _check_no_meta_left(model: nn.Module) -> None:
    """Tensors a module keeps as plain attributes (not parameters or buffers) are not touched by to_empty: none may
    stay on the meta device."""
    for name, mod in model.named_modules():
        for k, v in vars(mod).items():
            if isinstance(v, torch.Tensor) and v.is_meta:
                raise RuntimeError(f"{name}.{k} is a meta tensor outside the module's parameters and buffers; "
                                   "register it as a buffer so the meta-device build can materialise it")


def fill_model(model: nn.Module, cfg, vocab_size: int | None, device: torch.device) -> None:
    """Allocate and fill a meta-built training model (sharded or not): from `cfg.init_from`, else from the init stream
    at `cfg.seed`."""
    from .model_setup import build_model

    if cfg.init_from:
        load_sharded(model, cfg.init_from, device)
    else:
        materialize(model, build_on_meta(build_model, cfg, vocab_size), cfg.seed, device)


def init_model(cfg, vocab_size: int | None, device: torch.device) -> nn.Module:
    """The trainer's model at `cfg.seed` in one process: the meta build filled from the one init stream (or
    `cfg.init_from`), on `device`."""
    from .model_setup import build_model

    model = build_on_meta(build_model, cfg, vocab_size)
    fill_model(model, cfg, vocab_size, device)
    return model


def load_sharded(model: nn.Module, folder: str, device: torch.device) -> None:
    """Allocate `model` (meta, sharded) on `device` and fill every parameter and persistent buffer from the HF
    safetensors folder `folder`, each rank reading only its block (safetensors' lazy slices)."""
    from safetensors import safe_open

    from ..util.io import hf_weight_files

    _to_empty(model, device)
    state = dict(model.named_parameters())
    state.update(model.named_buffers())
    filled, unexpected, names = set(), [], set(model.state_dict())
    with torch.no_grad():
        for f in hf_weight_files(folder):  # each file opened once; each tensor read as this rank's block only
            with safe_open(str(f), framework="pt") as fh:
                for k in fh.keys():
                    dst = state.get(k)
                    if dst is None:
                        if k not in names:  # (a tied head stored twice is the embedding's)
                            unexpected.append(k)
                        continue
                    sl = fh.get_slice(k)
                    shape = sl.get_shape()
                    if tuple(shape) != tuple(dst.shape):
                        raise ValueError(f"init_from={folder}: {k} has shape {tuple(shape)}, the model "
                                         f"{tuple(dst.shape)}; model.* overrides must not change a weight's shape")
                    if hasattr(dst, "to_local") and shape:  # this rank's block (rows, or a dim > 0's slice)
                        dst.to_local().copy_(sl[local_index(dst, shape)].to(dst.dtype))
                    else:
                        dst.copy_(sl[:].to(dst.dtype))
                    filled.add(k)
    if unexpected:  # a weight the model has no place for: not this model's checkpoint (a silently dropped weight)
        raise ValueError(f"init_from={folder} does not match its model config: unexpected keys {sorted(unexpected)[:5]}")
    missing = [k for k in state if k not in filled and k in model.state_dict()]
    tied = {k for k in missing if k == "lm_head.weight" and getattr(model.config, "tie_word_embeddings", False)}
    if set(missing) - tied:
        raise ValueError(f"init_from={folder} lacks {sorted(set(missing) - tied)[:5]}")
    for mod in model.modules():  # non-persistent buffers (RoPE frequencies) are in no checkpoint: computed anew
        if type(mod).__name__ == "RotaryEmbedding":
            model._init_weights(mod)
