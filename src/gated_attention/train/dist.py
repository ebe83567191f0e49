"""Distributed setup on PyTorch's own engine: torchrun env -> process group, DDP or FSDP2 wrapping.

One process (no WORLD_SIZE in the environment, or WORLD_SIZE=1) runs unwrapped, except dist=fsdp under
`torchrun --nproc_per_node=1`: FSDP2 over a one-rank group, so one GPU runs the FSDP2 path itself. Under
`torchrun --nproc_per_node=N` the backend is gloo on CPU and nccl on CUDA. The model is built on the meta device and
filled from one init stream in every mode (train/meta_init.py): under DDP every rank fills the whole model from the
same seed before it is wrapped, so the replicas agree before DDP's own broadcast; under FSDP2 it is sharded first and
each rank fills only its own shards, with bf16-params as FSDP2's MixedPrecisionPolicy (wrap).

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
    group: bool = False  # a process group is up at world size 1: dist=fsdp under torchrun --nproc_per_node=1
    timeout_s: float = 0.0  # the collectives' timeout every group here gets (0: PyTorch's default)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """Collectives and wrapping apply: several ranks, or FSDP2 over one rank (one GPU checking the FSDP2 path:
        sharding, the mixed-precision policy, DCP checkpoints, accumulation)."""
        return self.world_size > 1 or self.group


def pick_device(name: str, local_rank: int = 0) -> torch.device:
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError("device='cuda' but CUDA is not available; use --set device=cpu")
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def setup(device: str, mode: str, timeout_s: float = 0.0) -> DistInfo:
    """Initialise the process group when launched by torchrun with more than one process; `timeout_s` > 0: a rank
    waits at most that long in one collective (else PyTorch's default), in every group this module makes."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = pick_device(device, local_rank)
    from .runtime import cuda_allocator_defaults

    cuda_allocator_defaults(dev)  # expandable segments, before the run's first CUDA allocation (unless the user's)
    one_rank_fsdp = world == 1 and mode == "fsdp" and "TORCHELASTIC_RUN_ID" in os.environ  # launched by torchrun
    if world <= 1 and not one_rank_fsdp:
        return DistInfo(device=dev)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        _init_group("nccl" if dev.type == "cuda" else "gloo", timeout_s)
    return DistInfo(rank=rank, world_size=world, local_rank=local_rank, device=dev, mode=mode, group=one_rank_fsdp,
                    timeout_s=timeout_s)


def _timeout(seconds: float) -> dict:
    """init_process_group / new_group's timeout argument: every collective of the group waits at most this long."""
    from datetime import timedelta

    return {"timeout": timedelta(seconds=seconds)} if seconds > 0 else {}


def _init_group(backend: str, timeout_s: float = 0.0) -> None:
    """init_process_group from torchrun's environment. Under torchrun the group's keys go under a prefix of this
    rendezvous round's own (`_round_prefix`): torchrun's agents share one store with their workers and keep it
    across restarts, so without one the new workers read the addresses the dead ones published (gloo:
    `connectFullMesh ... Connection refused`; NCCL: a stale unique id; pytorch/pytorch#135712)."""
    kw = _timeout(timeout_s)
    if "TORCHELASTIC_RUN_ID" not in os.environ:  # not launched by torchrun: a store of its own
        dist.init_process_group(backend=backend, **kw)
        return
    from torch.distributed.constants import default_pg_timeout
    from torch.distributed.rendezvous import rendezvous

    store, rank, world = next(rendezvous("env://", **kw))  # the store's waits: the run's timeout, else torch's
    limit = kw.get("timeout", default_pg_timeout).total_seconds()
    dist.init_process_group(backend=backend, store=dist.PrefixStore(_round_prefix(store, rank, world, limit), store),
                            rank=rank, world_size=world, **kw)


def _round_prefix(store, rank: int, world: int, limit_s: float) -> str:
    """The store prefix of this round of workers, the same on every rank and new in every round: "gattn/round_N".

    Why not torchrun's TORCHELASTIC_RESTART_COUNT: each node's agent counts its own restarts, and a restart because
    another node's worker failed (a membership change) is not counted, so after one failure the nodes' workers hold
    different counts (2 nodes, one worker SIGKILLed: its node's new worker has 1, the other node's 0, and the two
    wait on different keys until the store times out; tests/test_distributed.py). The rendezvous round all agents
    share is not passed to the workers (torch 2.13 exports RANK, GROUP_RANK, the sizes, MASTER_ADDR/PORT, the
    restart count, the run id) and lives in the rendezvous backend's own store, not the one the workers get. A
    counter every rank increments would drift for good once a worker died before incrementing it, and a value
    agreed over the process group comes too late: the group's own set-up is what reads the stale keys.

    So the round is agreed through the store, on keys no earlier round wrote: every round's workers start after the
    previous round's are all gone (each agent stops its workers before it rejoins the rendezvous), and rank 0 is one
    new process per round. Rank 0 draws N from a counter; every other rank appends a fresh random nonce to a join
    list, reads N from the key its nonce names (only rank 0 of this round writes it) and counts itself in under
    round N. Rank 0 answers each rank's latest nonce until all of this round's ranks are counted in; answers to a
    dead worker's nonce are never read."""
    import time
    import uuid

    if rank != 0:
        nonce = uuid.uuid4().hex
        store.append("gattn/joins", f"{rank}:{nonce} ")
        n = int(store.get(f"gattn/welcome/{nonce}"))  # waits for rank 0, up to the store's timeout
        store.add(f"gattn/round_{n}/joined", 1)
        return f"gattn/round_{n}"
    n = store.add("gattn/rounds", 1)
    deadline, answered = time.monotonic() + limit_s, {}
    while store.add(f"gattn/round_{n}/joined", 0) < world - 1:
        if time.monotonic() > deadline:
            raise RuntimeError(f"rank 0 waited {limit_s:.0f} s for the other {world - 1} ranks to join round {n} "
                               f"of the process group; {store.add(f'gattn/round_{n}/joined', 0)} did")
        if store.check(["gattn/joins"]):
            latest = dict(entry.split(":") for entry in store.get("gattn/joins").decode().split())  # rank -> nonce
            for r, nonce in latest.items():
                if answered.get(r) != nonce:
                    store.set(f"gattn/welcome/{nonce}", str(n))
                    answered[r] = nonce
        time.sleep(0.02)
    return f"gattn/round_{n}"


_ENDED_A_GROUP = False  # teardown ended a process group cleanly in this process (exit_process acts only then)


def teardown(failed: bool = False) -> None:
    """End the process group. A clean end waits for every rank (barrier) first; a rank that failed (`failed`) must
    not: its peers may be inside a collective it will never join (the next step's all-gather), so it destroys the
    group at once (NCCL aborts its communicators) and exits with its error — its peers then fail their collective
    (gloo: the connection closes) or are stopped by torchrun, instead of every rank waiting out the collective
    timeout."""
    global _ENDED_A_GROUP
    if not dist.is_initialized():
        return
    if not failed:
        dist.barrier()
    dist.destroy_process_group()
    if not failed:
        _ENDED_A_GROUP = True


def exit_process(code: int) -> None:
    """End a process whose process group `teardown` ended cleanly: Python's exit handlers run (atexit: logging,
    TensorBoard writers), stdout and stderr are flushed, and the process exits with `code` without interpreter
    finalization. Does nothing in a process that ran no process group (one process, the tests' own).

    Why: destroy_process_group does not free the gloo process groups in torch 2.13. Once a DTensor was built on a
    device mesh (FSDP2's parameters, the experts under expert parallelism) about ten references to each group's
    Python object stay in C++ (measured: the refcount of a mesh's group goes 11 -> 21 at the first DTensor and stays
    after every DTensor, the mesh and the group are gone), so each group's worker threads (pt_gloo_runloop,
    gloo_tcp_loop) still run when the interpreter finalizes and C++ static destructors run. A rank then
    occasionally died there after a finished run, "terminate called without an active exception" (SIGABRT: twice
    in six full test runs on a loaded 2-core CPU, after an HSDP and an EP run; pytorch PR 179291 describes the
    same teardown race). Everything the run writes is closed by then; skipping finalization removes the race."""
    if not _ENDED_A_GROUP:
        return
    import atexit
    import sys

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or a broken pipe: nothing left to lose
            pass
    os._exit(code)


@dataclass
class Meshes:
    """The device meshes of dist=fsdp with HSDP or expert parallelism (`device_meshes`)."""

    dp: object  # the dense parameters' FSDP2 mesh: ("dp_shard",) or, with replicas, ("dp_replicate", "dp_shard")
    ep: object = None  # the routed experts' expert-parallel mesh ("ep",), or None
    expert_dp: object = None  # the experts' own FSDP2 mesh: ("efsdp",) or ("dp_replicate", "efsdp"), or None


def device_meshes(info: DistInfo, dims) -> Meshes | None:
    """The world as a (dp_replicate, dp_shard) mesh (a dim of size 1 left out), replicas the slowest dim (across
    nodes); under expert parallelism dp_shard unflattened into (efsdp, ep) as torchtitan lays it out: an
    expert-parallel group is E consecutive ranks (one node's GPUs first). None for plain FSDP (FSDP2's default: one
    shard group of every rank). `dims`: the layout, validated (parallel_dims.ParallelDims at this world size)."""
    if not dims.mesh:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    R, E = dims.dp_replicate, dims.expert_parallel
    sizes = ((("dp_replicate", R),) if R > 1 else ()) + (("dp_shard", dims.shard),)
    names = tuple(k for k, _ in sizes)
    world = init_device_mesh(info.device.type, tuple(n for _, n in sizes), mesh_dim_names=names,
                             backend_override=_mesh_timeout(info, names))
    if E == 1:
        return Meshes(dp=world)
    split = world._unflatten("dp_shard", (dims.efsdp, E), ("efsdp", "ep"),
                             backend_override=_mesh_timeout(info, ("efsdp", "ep")))
    replicate = ("dp_replicate",) if R > 1 else ()
    return Meshes(dp=world, ep=split["ep"], expert_dp=split[replicate + ("efsdp",)])


def _mesh_timeout(info: DistInfo, names: tuple[str, ...]) -> dict | None:
    """The mesh dims' process groups with the run's collective timeout (a mesh's sub-groups otherwise get
    PyTorch's default, whatever the world group's is)."""
    if info.timeout_s <= 0:
        return None
    cuda = info.device.type == "cuda"
    options = dist.ProcessGroupNCCL.Options() if cuda else dist.ProcessGroupGloo._Options()
    options._timeout = _timeout(info.timeout_s)["timeout"]
    return {name: ("nccl" if cuda else "gloo", options) for name in names}


def wrap(model: nn.Module, info: DistInfo, layers: list[nn.Module], precision: str = "fp32",
         meshes: Meshes | None = None, gather=None) -> nn.Module:
    """DDP, or FSDP2 with one shard group per decoder layer plus the root (embeddings, final norm, head); under
    precision bf16-params FSDP2's MixedPrecisionPolicy: parameters all-gathered and computed in bf16, gradients
    reduced in fp32 into the fp32 sharded master parameters the optimizer steps (the modules marked
    `keeps_fp32_params`, the MoE routers, in groups of their own gathered in fp32). `meshes` (device_meshes): HSDP on
    the (replicate, shard) mesh; under expert parallelism (experts already sharded over `meshes.ep`) the experts get
    their own FSDP2 group over `meshes.expert_dp` first, which the decoder layers' groups then leave out; either way
    the experts' fused tensors are placed by expert_parallel.expert_placements (whole experts, or split on dim 1
    where the ranks would pad them). `gather` (fsdp_policy.GatherPolicy): when the groups free their gathered
    parameters and what they prefetch; None: FSDP2's own defaults."""
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
        from .expert_parallel import expert_placements, shard_experts

        ep = meshes is not None and meshes.ep is not None
        if ep:
            shard_experts(model, meshes.expert_dp, **kw)
        if meshes is not None:
            kw["mesh"] = meshes.dp
        shard = meshes.dp.size(meshes.dp.ndim - 1) if meshes is not None else info.world_size  # the sharding dim
        layer_kw = kw if ep else {**kw, "shard_placement_fn": expert_placements(model, shard)}  # experts in the layer
        if precision == "bf16-params":  # modules that compute from fp32 weights (the MoE routers): own fp32 groups
            fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32,
                                        cast_forward_inputs=False)  # their inputs keep the bf16 activations' dtype
            for module in fp32_modules(model):
                fully_shard(module, **{**kw, "mp_policy": fp32})
        for layer in layers:
            fully_shard(layer, **layer_kw)
        fully_shard(model, **kw)  # the root: tied embedding/head stay together in this group
        if gather is not None:
            from .fsdp_policy import apply

            apply(model, layers, gather)
        return model
    raise ValueError(f"unknown dist mode {info.mode!r}; use 'ddp' or 'fsdp'")


def fp32_modules(model: nn.Module) -> list[nn.Module]:
    """The modules whose weights stay fp32 under bf16-params (marked `keeps_fp32_params`, e.g. moe.MoeRouter)."""
    return [m for m in model.modules() if getattr(m, "keeps_fp32_params", False)]


def clip_grad_norm(params, max_norm: float) -> torch.Tensor:
    """torch's clip_grad_norm_, also where parameters live on different device meshes (the routed experts under
    expert parallelism): the norm of each mesh's gradients is completed over its mesh first (a DTensor op cannot
    mix meshes), then they are combined into the one global norm every gradient is scaled by."""
    params = [p for p in params if p.grad is not None]
    groups: dict = {}
    for p in params:
        groups.setdefault(id(getattr(p, "device_mesh", None)), []).append(p)
    if len(groups) <= 1:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    norms = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group])
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    total = torch.stack(norms).square().sum().sqrt()
    for group in groups.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


def checkpoint_group(info: DistInfo):
    """A gloo process group of every rank for asynchronous checkpoints (a collective: every rank calls it at the same
    point), or None in one process. DCP's background writer runs its collectives (planning, gathering the write
    results) in another thread while the training step runs its own: on one group the two threads' collectives
    could interleave differently on different ranks; on a group of their own they cannot. Gloo because
    dcp.async_save needs a CPU backend (the staged state is in CPU memory), so this holds under NCCL too."""
    if not info.distributed:
        return None
    return dist.new_group(backend="gloo", **_timeout(info.timeout_s))


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


def gather_objects(obj, info: DistInfo) -> list:
    """Every rank's `obj` (picklable), in rank order, on every rank."""
    if not info.distributed:
        return [obj]
    out = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


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


def on_rank0(info: DistInfo, fn):
    """The one protocol of a rank-0 decision or write: `fn()` runs on rank 0 only and its value (picklable) comes
    back on every rank (broadcast). If it raised, every rank raises (agree), so no rank waits in a later collective
    for a rank 0 that stopped."""
    value, exc = None, None
    if info.is_main:
        try:
            value = fn()
        except Exception as e:  # noqa: BLE001 - handed to agree, which re-raises it on rank 0
            exc = e
    agree(info, exc)
    return broadcast_object(value, info)


def on_every_rank(info: DistInfo, fn):
    """`fn()` on every rank (a rank's own write, its share of a collective save); returns this rank's value. If it
    raised on any rank, every rank raises (agree): a full disk on one rank stops them all."""
    value, exc = None, None
    try:
        value = fn()
    except Exception as e:  # noqa: BLE001 - handed to agree, which re-raises it on this rank
        exc = e
    agree(info, exc)
    return value
