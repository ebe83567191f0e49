"""Expert parallelism (`--set expert_parallel=E`): the routed experts of every MoE block sharded over E ranks, each
token's (token, slot) rows sent to the rank that holds its expert and the results sent back, with all-to-all.

Applied to a built model (the model itself stays single-device code, moe.py):
  * `apply_expert_parallel(model, ep_mesh)`: each `MoeExperts`' fused weights `gate_up_proj` (E, 2I, d) and
    `down_proj` (E, d, I) become DTensors `Shard(0)` over the 1-D expert-parallel mesh: rank r of the E holds experts
    [r * E_l, (r + 1) * E_l), E_l = num_experts / E. Their names and global shapes are the model's, so DCP
    checkpoints, `gattn convert` and final/ see the same tensors at any E (one process included).
  * the module's forward becomes `_dispatch_compute_combine`: the router's choice is made on this rank's tokens as
    before; the (token, slot) rows are sorted by expert once (as the grouped path does; sorted by expert is sorted by
    destination rank), the per-expert counts are exchanged (one small all-to-all, then one host read of both split
    sizes together, as every all-to-all dispatcher needs; an activation checkpoint's recompute reuses the forward's,
    moe.recorded, and under `selective` is handed the all-to-alls' outputs, train/activation_checkpoint.py), the rows
    go to their experts' ranks (torch's functional,
    autograd-aware all-to-all, whose backward sends the gradients back), are regrouped from
    source-rank-major to local-expert-major, and run through the same grouped matmuls (moe.grouped_matmul: one
    torch._grouped_mm or one mm per expert) on the local experts; the outputs return by the reverse all-to-all and are
    unsorted and weighted by the router exactly as in one process. Each row meets the same expert weights as in one
    process, so outputs agree to the bit and weight gradients up to float summation order.
  * `shard_experts(model, mesh, **fsdp_kw)`: FSDP2 over the rest of each shard group (`efsdp` = shard group / E
    ranks, torchtitan's layout; with replicas, HSDP over (dp_replicate, efsdp)) on the experts only, before the
    decoder layers are wrapped (which then leave the experts out). Its placement (`expert_placements`, the rule
    parallel_dims.expert_shard_dim): whole local experts (Shard(0)) where efsdp divides the E_l of them, else
    Shard(1) (each expert's 2I rows of gate_up_proj, d rows of down_proj split over efsdp; dim 2 where dim 1 does
    not divide), so a rank stores 1 / (shard group) of the experts with no padding. Without expert parallelism the
    experts sit in their decoder layer's group (train/dist.py: wrap) under the same rule over the shard group.
  * the gradient's scale: each rank's loss is the mean over its own tokens and FSDP2 averages over the data-parallel
    ranks, but an expert's weight gradient already sums the rows of all E ranks of its group (the all-to-all's
    backward brings them) while its FSDP2 group averages over the other world / E ranks only; the local weights are
    therefore used through `_ScaleGrad` (identity forward, gradient x 1/E), which makes it the global batch's mean as
    in one process. (FSDP2's own set_gradient_divide_factor divides twice on a one-rank mesh with sum reductions
    and needs NCCL's pre-multiplied sum otherwise: not used.)

The router, the shared expert, attention and the rest are sharded by FSDP2 over the whole shard group as without EP.
The global-batch load-balancing loss and the z-loss are unchanged: the counts are still all-reduced over every rank
(moe.MoEBalanceState), the router's probabilities are this rank's tokens'.

Layout rules (one error each, before anything is built; train/parallel_dims.py): E divides the ranks of a shard group
and the number of routed experts (every rank holds E_l >= 1 whole experts; E larger than the experts is refused,
naming the valid E); a model without MoE layers is refused; dist=fsdp only. Routing is not capped (no
capacity factor, as in one process): an unbalanced batch sends more rows to the busy experts' ranks, which is what
max_load_over_mean in the log shows.

torch.compile traces the whole path, exchange included, into the layer's graph: under the trainer's dynamo options
(train/fastpath.py: capture_scalar_outputs, set while the compiled layers run) the host read of the split sizes
becomes unbacked sizes in the graph (torch._check'd below) instead of a graph break. The experts' own FSDP2 group
(shard_experts) still runs its hooks outside the graph, and in fp32 the per-expert matmul fallback stays eager
(moe.grouped_matmul), as without expert parallelism.
"""
from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn

from ..moe import MoeExperts, expert_counts, grouped_matmul, moe_blocks, recorded
from .parallel_dims import ParallelDims, expert_shard_dim

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")  # MoeExperts' fused per-expert tensors, sharded on dim 0 over EP


class _ScaleGrad(torch.autograd.Function):
    """x unchanged; its gradient times `scale` (module docstring: the gradient's scale)."""

    @staticmethod
    def forward(ctx, x, scale: float):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (differentiable), or the tensor itself."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


class ExpertParallelExperts(MoeExperts):
    """MoeExperts whose weights are Shard(0) over an expert-parallel group: both expert paths dispatch by all-to-all.
    ("loop" runs one mm per local expert, "grouped" the grouped kernel where usable, moe.grouped_matmul.)"""

    ep_group = None
    ep_size = 1
    num_local = 0

    def forward_grouped(self, h, top_i, top_w, use_grouped_mm=None):
        return _dispatch_compute_combine(self, h, top_i, top_w, use_grouped_mm)

    def forward_loop(self, h, top_i, top_w):
        return _dispatch_compute_combine(self, h, top_i, top_w, False)


def _dispatch_compute_combine(experts: ExpertParallelExperts, h: torch.Tensor, top_i: torch.Tensor,
                              top_w: torch.Tensor, use_grouped_mm) -> torch.Tensor:
    """h (N, d), top_i / top_w (N, k) -> (N, d): this rank's tokens through experts held across the group."""
    N, k = top_i.shape
    ep, n_local, group = experts.ep_size, experts.num_local, experts.ep_group
    flat_e = top_i.reshape(-1)  # (N*k,) expert of each (token, slot), token-major
    order = torch.argsort(flat_e, stable=True)  # (N*k,) sorted position -> flat (token, slot): by expert = by rank
    counts = expert_counts(flat_e, experts.num_experts)  # (E,)
    xs = h[order // k]  # (N*k, d)

    # a checkpoint's recompute reuses its forward's exchange and sizes: no second all-to-all, no second sync
    with torch.no_grad():  # got[s, j] = rows rank s sends to local expert j
        got = recorded(lambda: funcol.all_to_all_single(counts, None, None, group), collective=True)
    got = got.view(ep, n_local)  # (ep, E_l)
    # rows to each rank and from each: the split sizes, read on the host together (one sync per layer)
    send, recv = recorded(lambda: torch.stack([counts.view(ep, n_local).sum(1), got.sum(1)]).tolist())  # (2, ep)
    # under torch.compile the sizes are unbacked symbols (train/fastpath.py's dynamo options): tell it what they are
    for size in (*send, *recv):
        torch._check(size >= 0)
    torch._check(sum(send) == xs.shape[0])
    xr = funcol.all_to_all_single_autograd(xs, recv, send, group)  # (R, d) source-rank-major, expert-sorted inside
    # regroup by local expert, sources in rank order inside each (so an expert's rows are the global batch's order)
    local_e = torch.repeat_interleave(torch.arange(n_local, device=got.device).repeat(ep), got.reshape(-1),
                                      output_size=sum(recv))  # (R,)
    perm = torch.argsort(local_e, stable=True)  # (R,) expert-major position -> received row
    xe = xr[perm]  # (R, d)
    per_expert = got.sum(0)  # (E_l,)
    w_gu = _ScaleGrad.apply(_local(experts.gate_up_proj), 1.0 / ep)  # (E_l, 2I, d)
    w_down = _ScaleGrad.apply(_local(experts.down_proj), 1.0 / ep)  # (E_l, d, I)
    gu = grouped_matmul(xe, w_gu.transpose(1, 2), per_expert, use_grouped_mm)  # (R, 2I)
    gate, up = gu.chunk(2, dim=-1)  # (R, I) each
    ye = grouped_matmul(experts.act_fn(gate) * up, w_down.transpose(1, 2), per_expert, use_grouped_mm)  # (R, d)
    back = torch.empty_like(perm)
    back[perm] = torch.arange(perm.numel(), device=perm.device)
    ys = funcol.all_to_all_single_autograd(ye[back], send, recv, group)  # (N*k, d) this rank's expert-sorted order
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    ys = ys[inverse].view(N, k, -1)  # (N, k, d)
    return (ys * top_w.unsqueeze(-1)).sum(dim=1)  # (N, d)


def apply_expert_parallel(model: nn.Module, ep_mesh) -> int:
    """Shard every MoE block's routed experts over the 1-D mesh `ep_mesh` (module docstring); returns how many blocks.
    Works on a meta-device build (sharded from birth: each rank then fills its own experts) or on a built one (every
    rank built the same model from the same seed, so each keeps its slice)."""
    from torch.distributed.tensor import DTensor, Shard

    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    blocks = moe_blocks(model)
    if not blocks:
        ParallelDims(world=None, dist="fsdp", expert_parallel=ep, num_experts=0)
    for _, block in blocks:
        experts = block.experts
        ParallelDims(world=None, dist="fsdp", expert_parallel=ep, num_experts=experts.num_experts)
        n_local = experts.num_experts // ep
        for name in EXPERT_WEIGHTS:
            p = getattr(experts, name)
            local = p.detach()[rank * n_local:(rank + 1) * n_local]  # (E_l, ...) this rank's experts
            shard = DTensor.from_local(local.clone(), ep_mesh, [Shard(0)], run_check=False, shape=p.shape,
                                       stride=p.stride())
            setattr(experts, name, nn.Parameter(shard, requires_grad=p.requires_grad))
        experts.__class__ = ExpertParallelExperts
        experts.ep_group, experts.ep_size, experts.num_local = ep_mesh.get_group(), ep, n_local
    return len(blocks)


def expert_placements(model: nn.Module, degree: int):
    """fully_shard's `shard_placement_fn` for FSDP2 over `degree` ranks: each MoE block's fused expert tensors on
    the dim parallel_dims.expert_shard_dim picks for their local shape (E_l, ., .); every other parameter None
    (FSDP2's default, Shard(0))."""
    from torch.distributed.tensor import Shard

    dims = {id(p): expert_shard_dim(tuple(_local(p).shape), degree)
            for _, block in moe_blocks(model) for p in (getattr(block.experts, n) for n in EXPERT_WEIGHTS)}
    return lambda p: Shard(dims[id(p)]) if id(p) in dims else None


def shard_experts(model: nn.Module, mesh, **fsdp_kw) -> None:
    """FSDP2 on each expert-parallel experts module over `mesh` (the experts' data-parallel ranks; its last dim
    shards, a first one replicates under HSDP) placed by `expert_placements`, its two forwards registered with FSDP2
    (the MoE block calls them directly, not through __call__)."""
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    placement = expert_placements(model, mesh.size(mesh.ndim - 1))
    for _, block in moe_blocks(model):
        experts = block.experts
        if not isinstance(experts, ExpertParallelExperts):
            continue
        fully_shard(experts, mesh=mesh, shard_placement_fn=placement, **fsdp_kw)
        for method in ("forward_grouped", "forward_loop"):
            register_fsdp_forward_method(experts, method)


def local_expert_numel(model: nn.Module) -> tuple[int, int]:
    """(elements of the routed experts' weights this rank stores, elements of all of them): 1/E of them under EP
    (and 1/(shard group) with the experts' FSDP)."""
    local = full = 0
    for _, block in moe_blocks(model):
        for name in EXPERT_WEIGHTS:
            p = getattr(block.experts, name)
            local += _local(p).numel()
            full += p.numel()
    return local, full
