"""FSDP2's gather policy: when each shard group's parameters are all-gathered and freed within a training step,
decided in one place (`gather_policy`) that the trainer applies (`apply` when dist.wrap shards the model,
`micro_batch` around each micro-batch's backward) and `gattn plan` counts (`all_gathers_per_step` for its
communication, `peak_gathered_layers` for its buffers).

The groups are one per decoder layer (under expert parallelism its experts' own group follows it) and the root
(embeddings, final norm, head). The settings (TrainConfig; torchtitan's policy, FSDP2's API):

  reshard_after_forward  "default": every decoder layer frees its gathered parameters after its forward and gathers
                         them again for its backward, except the last, whose backward follows at once; the root keeps
                         its own (FSDP2's rule for the root: the head's backward is the first thing backward does).
                         Per micro-batch: two all-gathers per layer, one for the last layer and one for the root.
                         "always": every group frees them, the root too (two all-gathers per group per micro-batch).
                         "never": no group frees them (one per group per micro-batch; every layer stays gathered in
                         the compute dtype from its forward to its backward: the whole model at the backward's start).
  keep_gathered          the parameters stay gathered across a step's micro-batches: no group frees them after a
                         forward, and none after a backward but the last micro-batch's (FSDP2's
                         set_reshard_after_backward), so each group is all-gathered once per step; the cost is the
                         whole model's unsharded parameters in the compute dtype for the whole step. "auto": only where
                         `gattn plan` says that fits this rank's memory (the trainer follows the plan); "true"; "false".
                         Nothing to keep with one micro-batch (or one rank): then off, and reshard_after_forward rules.
  fsdp_prefetch          0: FSDP2's implicit prefetch (backward: the next layer, in the reverse of the forward's order;
                         forward: each layer's gather is issued when its forward is reached). N > 0: each layer's
                         forward issues the next N layers' gathers and its backward the previous N
                         (set_modules_to_forward_prefetch / set_modules_to_backward_prefetch; the root: the first N in
                         forward, the last N in backward): earlier collectives to overlap with compute, N + 1 layers
                         gathered at once. The number of all-gathers does not change.

None of it changes the math: every forward and backward sees the same gathered values (tests/test_fsdp_policy.py
compares the weights and counts the all-gathers at 2 ranks).
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

RESHARD_AFTER_FORWARD = ("default", "always", "never")
KEEP_GATHERED = ("false", "auto", "true")


@dataclass(frozen=True)
class GatherPolicy:
    """What `gather_policy` decided for one run."""

    reshard_layers: tuple[bool, ...]  # per decoder layer: free its gathered parameters after its forward
    reshard_root: bool  # the same for the root group (embeddings, final norm, head)
    prefetch: int  # layers all-gathered ahead explicitly (0: FSDP2's implicit prefetch)
    keep_gathered: bool  # gathered across the step's micro-batches, freed after the last one's backward


def keep_choice(value) -> str:
    """Normalise a `keep_gathered` setting to 'false' | 'auto' | 'true' (bools and the usual spellings accepted, as a
    JSON train_config.json or `--set keep_gathered=on` may hold them)."""
    from ..util.errors import switch_choice

    return switch_choice(value, "keep_gathered", "'false', 'auto' (where `gattn plan` says it fits) or 'true'")


def gather_policy(reshard: str, prefetch: int, keep: str, *, layers: int, mode: str, world: int, grad_accum: int,
                  extra_bytes: float = 0.0, spare_bytes: float | None = None) -> GatherPolicy:
    """The policy of a run with `layers` decoder layers (module docstring) — the one place it is decided.
    keep_gathered: only under dist=fsdp at world > 1 with grad_accum > 1; "true" always there, "auto" where
    `extra_bytes` (what keeping the parameters gathered adds to the plan's total) fits within `spare_bytes` (what the
    plan leaves of a rank's memory; None: unknown, so not)."""
    if reshard not in RESHARD_AFTER_FORWARD:
        raise ValueError(f"reshard_after_forward={reshard!r}; use one of {', '.join(RESHARD_AFTER_FORWARD)}")
    keep = keep_choice(keep)
    kept = mode == "fsdp" and world > 1 and grad_accum > 1 and (
        keep == "true" or (keep == "auto" and spare_bytes is not None and extra_bytes <= spare_bytes))
    if kept or reshard == "never":
        flags, root = (False,) * layers, False
    elif reshard == "always":
        flags, root = (True,) * layers, True
    else:  # torchtitan's default: not the last layer (its backward follows at once), not the root (FSDP2's rule)
        flags, root = (True,) * max(layers - 1, 0) + (False,) * min(layers, 1), False
    return GatherPolicy(reshard_layers=flags, reshard_root=root, prefetch=prefetch, keep_gathered=kept)


def all_gathers_per_step(policy: GatherPolicy, grad_accum: int) -> dict:
    """FSDP2's all-gathers of each group in one optimizer step of `grad_accum` micro-batches: {"root": n, "layers":
    (n per decoder layer, ...)}. A group freed after its forward is gathered for the forward and again for the
    backward, one kept is gathered once per micro-batch (each backward frees it), and once per step with
    keep_gathered. Prefetch changes when, not how often."""
    if policy.keep_gathered:
        return {"root": 1, "layers": (1,) * len(policy.reshard_layers)}
    return {"root": grad_accum * (2 if policy.reshard_root else 1),
            "layers": tuple(grad_accum * (2 if r else 1) for r in policy.reshard_layers)}


def peak_gathered_layers(policy: GatherPolicy) -> int:
    """Decoder layers whose parameters are gathered at once at the step's peak (the backward, where every activation
    is still held): while layer i runs its backward, itself, the max(1, prefetch) layers gathered ahead of it, and
    every earlier layer its forward left gathered; every layer with keep_gathered."""
    layers = len(policy.reshard_layers)
    if policy.keep_gathered:
        return layers
    ahead = max(1, policy.prefetch)
    held = [1 + min(ahead, i) + sum(not r for r in policy.reshard_layers[:max(0, i - ahead)]) for i in range(layers)]
    return min(max(held, default=0), layers)


def apply(model: nn.Module, layers: list[nn.Module], policy: GatherPolicy) -> None:
    """Set `policy` on a model dist.wrap has just sharded (`model` the root, `layers` its decoder layers, each its
    own FSDP2 module): reshard-after-forward per group (a layer's nested groups, its experts' under EP, follow it)
    and, with prefetch N > 0, the explicit prefetch lists."""
    from torch.distributed.fsdp import FSDPModule

    for layer, reshard in zip(layers, policy.reshard_layers):
        layer.set_reshard_after_forward(reshard)  # recursive: the layer's experts group too
    model.set_reshard_after_forward(policy.reshard_root, recurse=False)
    n = policy.prefetch
    if n <= 0 or not layers:
        return
    groups = [[m for m in layer.modules() if isinstance(m, FSDPModule)] for layer in layers]  # layer, then experts

    def flat(items):
        return [m for group in items for m in group]

    model.set_modules_to_forward_prefetch(flat(groups[:n]))
    model.set_modules_to_backward_prefetch(flat(reversed(groups[-n:])))
    for i, layer in enumerate(layers):
        layer.set_modules_to_forward_prefetch(flat(groups[i + 1:i + 1 + n]))
        layer.set_modules_to_backward_prefetch(flat(reversed(groups[max(0, i - n):i])))


def micro_batch(model: nn.Module, policy: GatherPolicy, last: bool) -> None:
    """Before a micro-batch's backward: with keep_gathered, free the gathered parameters only after the last
    micro-batch's (the optimizer then steps the shards, and the next step gathers them anew)."""
    if policy.keep_gathered:
        model.set_reshard_after_backward(last)
