"""A run's memory decisions, made once by `decide` and applied as they are: how the fp32 gradients accumulate across
a step's micro-batches, FSDP2's gather policy (whether the parameters stay gathered across them: fsdp_policy.py), and
the activation checkpointing the activations were planned under.

`gattn plan` and the trainer's fit check (train/plan.py) call `decide` with the plan's memory model and get a
`MemoryDecision`; the trainer hands that object to parallelize (train/parallelize.py), which checkpoints the decoder
layers by its mode, sets its gather policy on FSDP2's groups and follows its accumulation around each micro-batch
(`Parallel.micro_batch`). Nothing is re-derived on the way: what the plan counted is what runs. A run without a plan
(a lab's own model) gets `decide` with the memory unknown, where no `auto` decision engages.

The two `auto` decisions, in this order (each sees the memory the one before it left):
  accum_grads=auto     whole (unsharded) gradients kept until the last micro-batch, one reduce-scatter per step,
                       where what they add fits what the plan leaves of a rank's memory (margin kept);
  keep_gathered=auto   every layer's parameters gathered across the micro-batches, one all-gather per group per step,
                       where that fits beside everything else.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

from . import fsdp_policy as FP

GB = 1e9
GRAD_ACCUMULATION = ("whole", "sharded", "unsharded")  # MemoryDecision.grad_accumulation's words (`gattn plan`'s)


@dataclass(frozen=True)
class MemoryDecision:
    """What `decide` chose for one run, and the figures its `auto` decisions compared (GB per rank; None where the
    memory was not known)."""

    grad_accumulation: Literal["whole", "sharded", "unsharded"]  # "whole": every rank holds whole gradients anyway
    # (DDP, one process); "sharded": FSDP2 reduce-scatters every micro-batch; "unsharded": FSDP2 keeps whole
    # gradients until the last micro-batch (accum_grads=auto where they fit)
    gather: FP.GatherPolicy  # FSDP2's gather policy, keep_gathered among it (applied under dist=fsdp only)
    activation_checkpointing: str  # the mode the activations were planned under and the decoder layers get
    whole_grads_gb: float | None = None  # what whole gradients add over sharded ones
    grads_room_gb: float | None = None  # what a rank had left (margin kept) when that was decided
    keep_gathered_gb: float | None = None  # what keeping every layer gathered adds
    gather_room_gb: float | None = None  # what a rank had left when that was decided
    total_gb: float | None = None  # the plan's memory per rank under these decisions
    available_gb: float | None = None  # the memory a rank has, as the plan was told

    def __post_init__(self) -> None:
        if self.grad_accumulation not in GRAD_ACCUMULATION:
            raise ValueError(f"grad_accumulation={self.grad_accumulation!r}; use one of {', '.join(GRAD_ACCUMULATION)}")

    @property
    def unsharded_grads(self) -> bool:
        """FSDP2 skips the reduce-scatter of every micro-batch but the last (set_requires_gradient_sync)."""
        return self.grad_accumulation == "unsharded"

    @property
    def keep_gathered(self) -> bool:
        return self.gather.keep_gathered

    def describe(self) -> str:
        """The decisions in words, with the figures behind each `auto` one."""
        def cost(extra, room):
            return "" if extra is None else f" (+{extra:.3g} GB, {room:.3g} GB left)"

        grads = {"whole": "whole gradients on every rank",
                 "sharded": "gradients reduce-scattered every micro-batch",
                 "unsharded": "whole gradients until the last micro-batch"}[self.grad_accumulation]
        if self.grad_accumulation != "whole":
            grads += cost(self.whole_grads_gb, self.grads_room_gb)
            kept = "kept" if self.keep_gathered else "not kept"
            grads += f"; parameters {kept} gathered across micro-batches" + cost(self.keep_gathered_gb,
                                                                                  self.gather_room_gb)
        return f"{grads}; activation checkpointing {self.activation_checkpointing}"


def unsharded_accumulation(policy: str, mode: str, world: int, grad_accum: int, extra_bytes: float,
                           spare_bytes: float | None) -> bool:
    """The gradient-accumulation rule under FSDP2. True: keep whole (unsharded) fp32 gradients across a step's
    micro-batches and reduce-scatter once, at the last (FSDP2's set_requires_gradient_sync(False) before it: one
    reduce-scatter per step, but every rank holds the whole model's gradients); False: reduce-scatter after every
    micro-batch into the sharded gradients (a rank holds 1/N of them; grad_accum reduce-scatters per step, each
    overlapped with the backward).

    Unsharded only under dist=fsdp at world > 1 with grad_accum > 1, policy "auto", and `extra_bytes` (what whole
    gradients add over sharded ones) within `spare_bytes` (what the plan leaves of a rank's memory; None: unknown,
    so not). DDP and one process keep whole gradients anyway."""
    if mode != "fsdp" or world <= 1 or grad_accum <= 1 or policy != "auto":
        return False
    return spare_bytes is not None and extra_bytes <= spare_bytes


def decide(cfg, *, layers: int, mode: str, world: int, grad_accum: int,
           memory: Callable[[bool, int], dict] | None = None,
           available_gb: float | None = None) -> tuple[MemoryDecision, dict | None]:
    """The memory decisions of training `cfg` (a TrainConfig) with `layers` decoder layers in `mode` ("fsdp", "ddp"
    or "none") over `world` ranks and `grad_accum` micro-batches: (the decision, the memory by part under it).
    memory(unsharded_grads, gathered_layers): the plan's memory per rank in GB (plan.memory: "total" and "margin"
    among its parts) with whole gradients or not and that many decoder layers gathered at once; available_gb: what a
    rank has. Without them the memory is unknown: no `auto` decision engages, and the second item is None."""
    def policy(keep: str, **room) -> FP.GatherPolicy:
        return FP.gather_policy(cfg.reshard_after_forward, cfg.fsdp_prefetch, keep, layers=layers, mode=mode,
                                world=world, grad_accum=grad_accum, **room)

    def decision(unsharded: bool, gather: FP.GatherPolicy, **figures) -> MemoryDecision:
        word = "unsharded" if unsharded else ("sharded" if mode == "fsdp" else "whole")
        return MemoryDecision(word, gather, cfg.activation_checkpointing, **figures)

    if memory is None:
        return decision(unsharded_accumulation(cfg.accum_grads, mode, world, grad_accum, 0.0, None),
                        policy(cfg.keep_gathered)), None
    held = FP.peak_gathered_layers(policy("false"))
    mem, whole = memory(False, held), memory(True, held)
    grads_room = available_gb - mem["margin"] - mem["total"]
    unsharded = unsharded_accumulation(cfg.accum_grads, mode, world, grad_accum,
                                       (whole["total"] - mem["total"]) * GB, grads_room * GB)
    whole_extra = whole["total"] - mem["total"]
    if unsharded:
        mem = whole
    kept = memory(unsharded, layers)
    gather_room = available_gb - mem["margin"] - mem["total"]
    gather = policy(cfg.keep_gathered, extra_bytes=(kept["total"] - mem["total"]) * GB,
                    spare_bytes=gather_room * GB)
    final = kept if gather.keep_gathered else mem
    return decision(unsharded, gather, whole_grads_gb=whole_extra, grads_room_gb=grads_room,
                    keep_gathered_gb=kept["total"] - mem["total"], gather_room_gb=gather_room,
                    total_gb=final["total"], available_gb=available_gb), final
