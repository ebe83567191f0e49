"""The one place where a built model becomes what the training step runs: `parallelize(model, cfg, info, precision)`.

The trainer's setup is one path for every mode (torchtitan's shape): build the model (on the meta device where it is
filled later: train/meta_init.py) -> `parallelize` -> the optimizer. `parallelize` applies, in this order:

  1. materialise + init, when nothing will be sharded (one process, DDP): the whole model is allocated and filled
     before the data-parallel step (DDP broadcasts rank 0's real weights when it wraps);
  2. mixed precision in one process (bf16-params): a bf16 compute twin of the fp32 model (train/mixed_precision.py);
     the fp32 model stays the master the optimizer steps, every later step transforms the twin;
  3. the fast path and the compile plan (train/fastpath.py): the fused q/k/v/gate GEMM per layer; compile=true
     compiles the decoder layer's outermost forward now, compile=auto after timed eager steps;
  4. activation checkpointing per decoder layer by the memory decision's mode (train/activation_checkpoint.py;
     before sharding: FSDP2's hooks stay outside the recomputed region; the compiled forward is the outermost one,
     so it traces the checkpoint);
  5. expert parallelism (`expert_parallel=E`, train/expert_parallel.py): the device mesh of the validated layout
     (train/parallel_dims.py; dist.device_meshes: (dp_replicate, dp_shard), dp_shard unflattened into (efsdp, ep))
     is built, and the MoE blocks' routed experts
     are sharded over the ep dim with all-to-all dispatch before data parallelism, so FSDP then shards only what is
     left (torchtitan's order: TP, EP, then FSDP);
  6. data parallelism (train/dist.py: wrap): DDP, or FSDP2 with one group per decoder layer plus the root
     (MixedPrecisionPolicy under bf16-params); under EP the experts first get their own FSDP2 group over efsdp; the
     routed experts are placed whole, or split on dim 1 where their FSDP2 ranks would pad them (one rule:
     parallel_dims.expert_shard_dim, which the plan uses too);
     hybrid sharding (`dp_replicate=R`, HSDP): the 2-D (replicate, shard) mesh handed to fully_shard in place of the
     flat process group; the memory decision's gather policy (train/fsdp_policy.py: when each group frees its
     gathered parameters, what it prefetches, whether they stay gathered across the micro-batches) set on the groups;
  7. materialise + init after sharding (dist=fsdp): each rank allocates and fills only its own shards.

The memory decisions (train/memory_decision.py: checkpointing, gather policy, gradient accumulation) come in as the
plan's `MemoryDecision` and are applied as they are, never re-derived here.

What comes back is a `Parallel`: the model (the plain module every forward runs on), the master weights, the speed
plan, the memory decision and layout it applied, and the data-parallel controls the step needs (the training forward
through the DDP wrapper, when gradients sync and gathered parameters are freed, the bf16 twin's refresh after an
update, the shards back in place before a step). Nothing else in train/ knows which wrapper a mode uses.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

from torch import nn

from . import dist as D
from . import fastpath
from . import fsdp_policy as FP
from .activation_checkpoint import apply_activation_checkpointing
from .memory_decision import MemoryDecision, decide
from .monitors import decoder_layers
from .parallel_dims import ParallelDims


@dataclass
class Parallel:
    """The model as parallelize left it."""

    model: nn.Module  # the plain module every forward runs on (the step, eval, probes, step hooks, plug-ins): under
    # bf16-params in one process the bf16 compute twin, under FSDP2 the sharded module itself, never a DDP wrapper
    master: nn.Module  # the weights the optimizer steps, checkpoints save and final/ exports: `model` itself, or
    # under bf16-params in one process the fp32 master of the twin
    speed: fastpath.SpeedPlan  # fast path and compile decision
    layers: list  # the model's decoder layers (compiled, checkpointed and sharded one by one)
    info: D.DistInfo
    memory: MemoryDecision  # the plan's memory decisions, as applied (checkpointing, gather policy, accumulation)
    dims: ParallelDims  # the validated layout: HSDP's replicas, expert parallelism
    mixed: object = None  # MasterWeights under bf16-params in one process
    ddp: nn.Module | None = None  # the DDP wrapper (its forward syncs gradients); None in every other mode

    def forward(self, **kwargs):
        """The training forward: through DDP's wrapper where there is one (its hooks all-reduce the gradients)."""
        return (self.ddp or self.model)(**kwargs)

    @property
    def sharded(self) -> bool:
        return self.info.distributed and self.info.mode == "fsdp"

    @property
    def gather(self) -> FP.GatherPolicy | None:
        """FSDP2's gather policy as set on the groups; None in other modes."""
        return self.memory.gather if self.sharded else None

    @property
    def accumulation(self) -> str:
        """How gradients accumulated across micro-batches here: "unsharded", "sharded" (FSDP2, one rank included) or
        "whole"."""
        return "unsharded" if self.memory.unsharded_grads else ("sharded" if self.sharded else "whole")

    def micro_batch(self, last: bool):
        """A context for one micro-batch's forward and backward: DDP all-reduces only on the last micro-batch; FSDP2
        reduce-scatters every micro-batch unless the plan chose whole gradients until the last, all-reduces across
        HSDP's replicas only on the last, and with keep_gathered frees the gathered parameters only after the last
        backward (fsdp_policy.micro_batch)."""
        if self.ddp is not None and not last:
            return self.ddp.no_sync()
        if self.sharded:
            self.model.set_requires_gradient_sync(last or not self.memory.unsharded_grads)  # the all-reduce flag too
            if self.dims.dp_replicate > 1:
                # after the line above, which sets both: a reduce-scatter per micro-batch keeps the shard's sum over
                # the micro-batches (FSDP2's partial reduce output) and the replicas all-reduce it once, at the last
                self.model.set_requires_all_reduce(last)
            FP.micro_batch(self.model, self.gather, last)
        return nullcontext()

    def reshard(self) -> None:
        """Every FSDP2 group back to its shards (a no-op where it is): a forward outside the step (evaluation, the
        stats probe) has no backward to free what its policy keeps gathered after a forward, and the step must start
        from the shards the optimizer stepped — its stats snapshot and update ratio read them."""
        if self.sharded:
            from torch.distributed.fsdp import FSDPModule

            for m in self.model.modules():
                if isinstance(m, FSDPModule):
                    m.reshard()

    def after_update(self) -> None:
        """After an optimizer step: the bf16 twin takes the new master weights (bf16-params in one process)."""
        if self.mixed is not None:
            self.mixed.sync()


def parallelize(model: nn.Module, cfg, info: D.DistInfo, precision: str, materialize: Callable | None = None,
                memory: MemoryDecision | None = None) -> Parallel:
    """Apply the steps above to `model` (built, or on the meta device with `materialize(model)` to fill it) for
    this run's `cfg`, ranks `info` and resolved `precision`; returns the Parallel the trainer runs. memory: the
    plan's decisions for this run (plan.check_fits); None, where no plan was made (a lab's own model): decided here
    with the memory unknown, so no `auto` decision engages."""
    sharded = info.distributed and info.mode == "fsdp"
    dims = ParallelDims.of(cfg, info.world_size)
    count = len(decoder_layers(model))
    if memory is None:
        memory, _ = decide(cfg, layers=count, mode=info.mode, world=info.world_size, grad_accum=cfg.grad_accum)
    if len(memory.gather.reshard_layers) != count:  # its gather policy names each decoder layer's group
        raise ValueError(f"the memory decision was made for {len(memory.gather.reshard_layers)} decoder layers but "
                         f"the model has {count}: plan the model this run builds")
    if materialize is not None and not sharded:  # 1.
        materialize(model)
    master, mixed = model, None
    if precision == "bf16-params" and not info.distributed:  # 2. (several ranks: FSDP2's policy, step 6)
        from .mixed_precision import MasterWeights

        mixed = MasterWeights(model)
        model = mixed.compute
    layers = decoder_layers(model)
    speed = fastpath.prepare(cfg, model, layers, info.device, precision)  # 3.
    apply_activation_checkpointing(layers, memory.activation_checkpointing)  # 4.
    meshes = D.device_meshes(info, dims) if sharded else None
    if meshes is not None and meshes.ep is not None:  # 5.
        from .expert_parallel import apply_expert_parallel

        apply_expert_parallel(model, meshes.ep)
    wrapped = D.wrap(model, info, layers, precision, meshes, memory.gather if sharded else None)  # 6.
    if materialize is not None and sharded:  # 7.
        materialize(model)
    return Parallel(model=model, master=master if mixed is not None else model, speed=speed, layers=layers,
                    info=info, memory=memory, dims=dims, mixed=mixed, ddp=wrapped if wrapped is not model else None)
