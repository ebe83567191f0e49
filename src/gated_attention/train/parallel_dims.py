"""The ranks' layout of a run, validated in one place (torchtitan's ParallelDims): the world size, HSDP's replicas
(`dp_replicate`), expert parallelism (`expert_parallel`) and the model's routed experts.

    world = dp_replicate x shard          (shard: the ranks of one FSDP2 shard group)
    shard = efsdp x expert_parallel       (efsdp: the ranks of the routed experts' own FSDP2 group)

The routed experts' FSDP2 placement over their efsdp ranks (the same rule without expert parallelism, where efsdp is
the shard group) is `expert_shard_dim`, which the trainer (train/expert_parallel.py) and the plan both call.

Every check of these degrees is a `ParallelDims` built where what it needs is known: `TrainConfig.check_world`
(the world size: the mesh), `overrides.check_model` (the model's experts, before the world is known), the plan (both)
and `expert_parallel.apply_expert_parallel` (the experts of the model being sharded). A layout that does not hold
fails on construction with one line naming the fix; what is built is consistent, so train/dist.py's device mesh reads
its sizes from it. No torch here: the CLI's checks run before torch is imported.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelDims:
    """A run's degrees of parallelism, valid by construction (ValueError with one line otherwise)."""

    world: int | None  # ranks in the run; None: not known yet (a command's settings before launch: only the experts)
    dist: str  # "ddp" or "fsdp" (TrainConfig.dist): replicas and expert parallelism need FSDP2
    dp_replicate: int = 1  # HSDP's replicas of the model (1: plain FSDP2 over every rank)
    expert_parallel: int = 1  # ranks each MoE layer's routed experts are sharded over (1: none)
    num_experts: int | None = None  # the model's routed experts per MoE layer (0: dense); None: not known yet

    def __post_init__(self) -> None:
        if self.world is not None:
            self._check_mesh()
        if self.num_experts is not None:
            self._check_experts()

    @classmethod
    def of(cls, cfg, world: int | None = None, num_experts: int | None = None) -> "ParallelDims":
        """The layout a TrainConfig asks for at `world` ranks, for a model with `num_experts` routed experts."""
        return cls(world=world, dist=cfg.dist, dp_replicate=cfg.dp_replicate, expert_parallel=cfg.expert_parallel,
                   num_experts=num_experts)

    @property
    def shard(self) -> int:
        """Ranks of one FSDP2 shard group (world / dp_replicate)."""
        return (self.world or 1) // self.dp_replicate

    @property
    def efsdp(self) -> int:
        """Ranks of the routed experts' own FSDP2 group (shard / expert_parallel)."""
        return self.shard // self.expert_parallel

    @property
    def mesh(self) -> bool:
        """A device mesh beyond FSDP2's flat group is needed (replicas or expert parallelism)."""
        return self.dp_replicate > 1 or self.expert_parallel > 1

    def _check_mesh(self) -> None:
        """The mesh dp_replicate x (world / dp_replicate) must tile the ranks, and expert parallelism borrows its E
        ranks from each shard group (torchtitan's rule: E divides the shard group, the experts' own FSDP runs over
        the rest); both need FSDP2."""
        if not self.mesh:
            return
        asked = ", ".join(f"{k}={v}" for k, v in (("dp_replicate", self.dp_replicate),
                                                  ("expert_parallel", self.expert_parallel)) if v != 1)
        if self.dist != "fsdp":
            raise ValueError(f"{asked} needs dist=fsdp (FSDP2 shards the rest of the model over the device mesh); "
                             "add --set dist=fsdp")
        if self.world % self.dp_replicate:
            raise ValueError(f"dp_replicate={self.dp_replicate} does not divide the world size {self.world}: the "
                             "replicas must be equal groups of ranks; pick a divisor of the number of ranks")
        if self.shard % self.expert_parallel:
            raise ValueError(f"expert_parallel={self.expert_parallel} must divide the ranks of one shard group "
                             f"(world {self.world} / dp_replicate {self.dp_replicate} = {self.shard}); use one of "
                             f"{[e for e in range(1, self.shard + 1) if self.shard % e == 0]}")

    def _check_experts(self) -> None:
        """E must give every rank the same whole number (>= 1) of experts."""
        E, n = self.expert_parallel, self.num_experts
        if E == 1:
            return
        if not n:
            raise ValueError(f"expert_parallel={E} but the model has no routed experts (a dense model); "
                             "drop expert_parallel or train an MoE model")
        if n % E:
            valid = [e for e in range(1, n + 1) if n % e == 0]
            raise ValueError(f"expert_parallel={E} does not divide the {n} routed experts (each rank holds "
                             f"num_experts / E whole experts); use one of {valid}")


def expert_shard_dim(shape: tuple[int, ...], degree: int) -> int:
    """The dim FSDP2 shards a routed experts' fused tensor of local shape (E_l, a, b) on over its `degree` ranks
    (`gate_up_proj` (E_l, 2I, d), `down_proj` (E_l, d, I)): 0, whole experts, where degree divides the E_l experts;
    else the first of dims 1, 2 that degree divides, else 0 padded. Why: whole experts pad nothing there and FSDP2
    gathers dim 0 in place, but where the ranks outnumber (or do not divide) the experts dim 0 pads up to a whole
    expert per rank (4x at 512 GPUs with expert_parallel=8) and FSDP2 shards a dim > 0 only evenly."""
    if shape[0] % degree == 0:  # degree <= E_l and no remainder: ceil(E_l / degree) whole experts, none padded
        return 0
    return next((dim for dim in (1, 2) if shape[dim] % degree == 0), 0)
