"""The plan's communication model: the time of each collective on a two-level machine (GPUs in nodes), as an α-β cost
(a latency α per algorithm step plus bytes over bandwidth β), with NVLink inside a node and the network across nodes.

A collective over a group of S ranks spans `nodes` nodes with `local` of its ranks in each (S = local x nodes; where
its ranks sit follows the trainer's device mesh, train.dist.device_meshes: a shard group is consecutive ranks, a
replica group (HSDP) takes one rank per shard group, an expert-parallel group is consecutive ranks and the experts' own
FSDP2 group strides over them). The algorithms are the hierarchical forms of the ring (what NCCL's multi-rail rings
achieve: every GPU's own NIC carries its share of the traffic across nodes):

  all-gather of a tensor of X bytes (each rank holds X / S): across nodes first, each rank with its counterparts in
      the other nodes ((nodes - 1) steps, (nodes - 1) X / S bytes received over the network), then inside the node
      ((local - 1) steps, (local - 1) / local x X over NVLink):
          t = (nodes - 1) α_net + (local - 1) α_nvl + (nodes - 1) X / (S β_net) + (local - 1) X / (local β_nvl)
      one node: the ring, (S - 1) α_nvl + (S - 1) / S x X / β_nvl; one rank per node: the same over the network.
  reduce-scatter: the same steps and bytes in reverse (X: the whole tensor, each rank keeps X / S).
  all-reduce: a reduce-scatter then an all-gather (twice both).
  all-to-all of X bytes a rank sends (spread evenly over the S ranks): every pair at once, one latency of the slowest
      link it crosses; the (local - 1) / S share that stays in the node over NVLink while the (S - local) / S that
      leaves it goes over the network (different links, concurrent: the slower bounds).

The defaults are an H100 SXM node (DEFAULT_TOPOLOGY):
  NVLink 4: 900 GB/s per GPU bidirectional (NVIDIA H100 Tensor Core GPU datasheet), 450 GB/s each way;
  InfiniBand NDR: one 400 Gb/s ConnectX-7 per GPU (NVIDIA DGX H100 user guide: 8 per node for the compute fabric),
      50 GB/s each way;
  latencies per algorithm step: 3 µs over NVLink, 10 µs over the network - the order of NCCL's own tuning model's
      per-step ring latencies with its Simple protocol (NCCL's src/graph/tuning.cc, hwLat: a few µs on NVLink, more
      across the network). Both bandwidths are upper bounds a real collective approaches for large messages only;
      the latency term is what makes small per-layer collectives at large S cost more than their bytes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

GB = 1e9
US = 1e-6


@dataclass(frozen=True)
class Topology:
    """The machine a plan assumes: GPUs per node and each link's bandwidth (GB/s per GPU, one direction) and latency
    per algorithm step (µs)."""

    gpus_per_node: int = 8
    nvlink_gbs: float = 450.0
    network_gbs: float = 50.0
    nvlink_us: float = 3.0
    network_us: float = 10.0

    def span(self, size: int, stride: int = 1) -> tuple[int, int]:
        """(ranks per node, nodes) of a group of `size` ranks whose members are `stride` ranks apart (the group's
        first member on a node boundary, as the trainer's meshes place them)."""
        if size <= 1:
            return 1, 1
        local = max(1, min(size, self.gpus_per_node // stride)) if stride < self.gpus_per_node else 1
        return local, math.ceil(size / local)

    def collective(self, kind: str, nbytes: float, size: int, stride: int = 1) -> float:
        """Seconds of one collective (module docstring) over `size` ranks `stride` apart. nbytes: the whole tensor
        (all-gather, reduce-scatter, all-reduce) or what one rank sends (all-to-all)."""
        if size <= 1 or nbytes <= 0:
            return 0.0
        local, nodes = self.span(size, stride)
        b_nvl, b_net = self.nvlink_gbs * GB, self.network_gbs * GB
        if kind == "all_to_all":
            alpha = (self.network_us if nodes > 1 else self.nvlink_us) * US
            inside, outside = nbytes * (local - 1) / size, nbytes * (size - local) / size
            return alpha + max(inside / b_nvl, outside / b_net)
        one = ((nodes - 1) * self.network_us + (local - 1) * self.nvlink_us) * US \
            + (nodes - 1) * nbytes / (size * b_net) + (local - 1) * nbytes / (local * b_nvl)
        if kind in ("all_gather", "reduce_scatter"):
            return one
        if kind == "all_reduce":
            return 2 * one
        raise ValueError(f"unknown collective {kind!r}")

    def describe(self, world: int) -> str:
        """The assumption in words, as `gattn plan` prints it."""
        nodes = math.ceil(world / self.gpus_per_node)
        where = (f"{world} GPU(s) in one node: NVLink only" if nodes == 1
                 else f"{nodes} nodes of {self.gpus_per_node} GPUs")
        return (f"NVLink {self.nvlink_gbs:g} GB/s, {self.nvlink_us:g} µs per step inside a node; network "
                f"{self.network_gbs:g} GB/s, {self.network_us:g} µs per step across nodes ({where})")

    def as_dict(self) -> dict:
        return {"gpus_per_node": self.gpus_per_node, "nvlink_gbs": self.nvlink_gbs, "network_gbs": self.network_gbs,
                "nvlink_latency_us": self.nvlink_us, "network_latency_us": self.network_us}


DEFAULT_TOPOLOGY = Topology()


def topology(*, gpus_per_node: int | None = None, nvlink_gbs: float | None = None, network_gbs: float | None = None,
             nvlink_us: float | None = None, network_us: float | None = None) -> Topology:
    """DEFAULT_TOPOLOGY with the figures given, checked."""
    from ..util.errors import check_number

    given = {"gpus_per_node": gpus_per_node, "nvlink_gbs": nvlink_gbs, "network_gbs": network_gbs,
             "nvlink_us": nvlink_us, "network_us": network_us}
    t = {k: getattr(DEFAULT_TOPOLOGY, k) if v is None else v for k, v in given.items()}
    check_number("gpus_per_node", t["gpus_per_node"], kind=int, min=1)
    for key in ("nvlink_gbs", "network_gbs"):
        check_number(key, t[key], min=0.0, min_open=True)
    for key in ("nvlink_us", "network_us"):
        check_number(key, t[key], min=0.0)
    return Topology(**t)


DDP_BUCKET_BYTES = 25 * 2 ** 20  # DDP's default bucket_cap_mb: one all-reduce per 25 MiB of gradients


def comm_per_step(sz: dict, groups: dict, *, world: int, dist: str, pd: int, grad_accum: int,
                  unsharded_grads: bool, gathers: dict, topo: Topology, replicate: int = 1, ep: int = 1,
                  all_to_all: float = 0.0, moe_passes: int = 0) -> dict:
    """Bytes one GPU moves per optimizer step and their time, collective by collective (module docstring).
    `groups`: each FSDP2 group's sizes (plan.fsdp_groups: the root's and each layer's dense parameters, each
    layer's routed experts as gathered, padding included); `gathers`: FSDP2's all-gathers of each group per step
    (fsdp_policy.all_gathers_per_step); `all_to_all`: bytes one rank sends per MoE layer and pass
    (plan.all_to_all_bytes), `moe_passes` such exchanges per micro-batch. FSDP2's collectives and DDP's all-reduce
    overlap the compute; the all-to-all does not (plan._step_time)."""
    shard = world // replicate
    efsdp = shard // ep
    f, fe = (shard - 1) / shard, (efsdp - 1) / efsdp
    reductions = 1 if unsharded_grads else grad_accum
    out = {"all_gather": [0.0, 0.0, 0], "reduce": [0.0, 0.0], "all_reduce": [0.0, 0.0], "all_to_all": [0.0, 0.0]}

    def add(part: str, nbytes: float, seconds: float, count: int = 0) -> None:
        out[part][0] += nbytes
        out[part][1] += seconds
        if part == "all_gather":
            out[part][2] += count

    if dist == "fsdp" and world > 1:
        dense = [("root", groups["root"], gathers["root"])] + [
            ("layer", p, n) for p, n in zip(groups["layers"], gathers["layers"])]
        for _, p, n in dense:  # each group over the shard group (consecutive ranks)
            if p and shard > 1:
                add("all_gather", n * pd * p * f, n * topo.collective("all_gather", pd * p, shard), n)
            add("reduce", reductions * 4 * p * f, reductions * topo.collective("reduce_scatter", 4 * p, shard))
            if replicate > 1:  # HSDP: each rank's gradient shard all-reduced across the replicas (one per shard group)
                add("all_reduce", 2 * 4 * p / shard * (replicate - 1) / replicate,  # once per step: the trainer
                    topo.collective("all_reduce", 4 * p / shard, replicate, stride=shard))  # skips it until the last
        for e, n in zip(groups["experts"], gathers["layers"]):  # the experts' own group: efsdp ranks ep apart
            if not e:
                continue
            if efsdp > 1:
                add("all_gather", n * pd * e * fe, n * topo.collective("all_gather", pd * e, efsdp, stride=ep), n)
            add("reduce", reductions * 4 * e * fe,
                reductions * topo.collective("reduce_scatter", 4 * e, efsdp, stride=ep))
            if replicate > 1:
                add("all_reduce", 2 * 4 * e / efsdp * (replicate - 1) / replicate,
                    topo.collective("all_reduce", 4 * e / efsdp, replicate, stride=shard))
    elif dist == "ddp" and world > 1:
        total = 4 * sz["trainable"]
        buckets = max(1, math.ceil(total / DDP_BUCKET_BYTES))
        add("reduce", 2 * total * f, buckets * topo.collective("all_reduce", total / buckets, world))  # its reduction
    if all_to_all and ep > 1:
        n = grad_accum * moe_passes
        add("all_to_all", n * all_to_all * (ep - 1) / ep, n * topo.collective("all_to_all", all_to_all, ep))
    total_b = sum(v[0] for v in out.values())
    seconds = sum(v[1] for v in out.values())
    return {"all_gather_gb": out["all_gather"][0] / GB, "all_gathers": out["all_gather"][2],
            "reduce_gb": out["reduce"][0] / GB, "all_reduce_gb": out["all_reduce"][0] / GB,
            "all_to_all_gb": out["all_to_all"][0] / GB, "total_gb": total_b / GB,
            "all_gather_seconds": out["all_gather"][1], "reduce_seconds": out["reduce"][1],
            "all_reduce_seconds": out["all_reduce"][1], "all_to_all_seconds": out["all_to_all"][1],
            "seconds": seconds, "topology": topo.as_dict()}
