"""Distributed setup on PyTorch's own engine: torchrun env -> process group, DDP or FSDP2 wrapping.

One process (no WORLD_SIZE in the environment, or WORLD_SIZE=1) runs unwrapped. Under
`torchrun --nproc_per_node=N` the backend is gloo on CPU and nccl on CUDA. Under DDP every rank builds the full model
from the same seed, so DDP needs no initial broadcast to agree; under FSDP2 the model is built on the meta device,
sharded, and each rank fills only its own shards (train/meta_init.py), with bf16-params as FSDP2's
MixedPrecisionPolicy (wrap).

Data: every rank draws the same GLOBAL batch (a function of (seed, step)) and keeps rows
[rank*B/N, (rank+1)*B/N); DDP/FSDP average gradients over ranks, which for equal slices equals the mean over the
global batch, so N ranks compute the same update as one process (up to float summation order).

Checkpoints: under DDP the gathered FULL state dict (one rank-independent state.pt written by rank 0); under FSDP2
sharded torch.distributed.checkpoint folders written by every rank (train/state.py, train/checkpoint.py). Both resume
at any world size, one process included.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    mode: str = "none"  # "none", "ddp" or "fsdp"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def pick_device(name: str, local_rank: int = 0) -> torch.device:
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError("device='cuda' but CUDA is not available; use --set device=cpu")
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def setup(device: str, mode: str) -> DistInfo:
    """Initialise the process group when launched by torchrun with more than one process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = pick_device(device, local_rank)
    if world <= 1:
        return DistInfo(device=dev)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo")
    return DistInfo(rank=rank, world_size=world, local_rank=local_rank, device=dev, mode=mode)


def teardown() -> None:
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def wrap(model: nn.Module, info: DistInfo, layers: list[nn.Module], precision: str = "fp32") -> nn.Module:
    """DDP, or FSDP2 with one shard group per decoder layer plus the root (embeddings, final norm, head); under
    precision bf16-params FSDP2's MixedPrecisionPolicy: parameters all-gathered and computed in bf16, gradients
    reduced in fp32 into the fp32 sharded master parameters the optimizer steps."""
    if not info.distributed:
        return model
    if info.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model, device_ids=[info.device.index] if info.device.type == "cuda" else None)
    if info.mode == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        kw = {}
        if precision == "bf16-params":
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in layers:
            fully_shard(layer, **kw)
        fully_shard(model, **kw)  # the root: tied embedding/head stay together in this group
        return model
    raise ValueError(f"unknown dist mode {info.mode!r}; use 'ddp' or 'fsdp'")


def barrier(info: DistInfo) -> None:
    if info.distributed:
        dist.barrier()


def reduce_mean(value: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.distributed:
        value = value.clone()
        dist.all_reduce(value)
        value /= info.world_size
    return value


def reduce_max(values: list[float], info: DistInfo) -> list[float]:
    if not info.distributed or not values:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=info.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.cpu().tolist()


def mean_over_ranks(values: list[float], info: DistInfo) -> list[float]:
    """Element-wise mean of a list of floats over ranks (each rank measured the same number of elements)."""
    if not info.distributed or not values:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=info.device)
    dist.all_reduce(t)
    return (t / info.world_size).cpu().tolist()


def broadcast_object(obj, info: DistInfo):
    if not info.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def agree(info: DistInfo, exc: BaseException | None) -> None:
    """Collective error check: every rank passes the exception it hit (or None). If any rank failed, every rank
    raises — the failing one its own error, the others a UserError naming it — so no rank waits forever in a
    later collective (a full disk on rank 0 must not hang rank 1)."""
    if not info.distributed:
        if exc is not None:
            raise exc
        return
    flag = torch.tensor([float(info.rank + 1) if exc is not None else 0.0], device=info.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    failed = int(flag.item())
    if exc is not None:
        raise exc
    if failed:
        from ..util.errors import UserError

        raise UserError(f"rank {failed - 1} stopped with an error (see its message above); this rank stops too")
