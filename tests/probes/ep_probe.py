"""Run under torchrun by tests/test_expert_parallel.py: one forward/backward of a tiny MoE model under expert
parallelism (the mesh, apply_expert_parallel and train.dist.wrap as train/parallelize.py applies them; dist=fsdp,
expert_parallel=E, dp_replicate=R) against the same model in this process unsharded, on the same global batch (each
rank its rows, as the trainer splits them).

    torchrun --nproc_per_node=N tests/probes/ep_probe.py OUT.json [--compile] [--set KEY=VALUE ...]

Every rank builds the model from the same seed (the one-process reference, fp32), then a second copy is wrapped (in
the run's precision: fp32, or bf16-params as FSDP2's MixedPrecisionPolicy). Rank 0
writes OUT.json: per rank the largest |difference| of its rows' logits, the largest relative difference of every
gathered gradient from the reference's, the elements of the routed experts' weights it stores at rest, gathered for
compute, and all of them, their placements, the mean loss over ranks beside the reference's, and (eager) how many
all-to-alls its forward and backward dispatched.

--compile: the wrapped model's training forward runs its decoder layers compiled as the trainer compiles them
(train/fastpath.py's SpeedPlan, aot_eager backend: the same tracing, no C++ build); also written per rank:
torch._dynamo.explain's graph-break count of an expert-parallel MoE block under the trainer's dynamo options and
without them (explain_moe_block).
"""
from __future__ import annotations

import contextlib
import copy
import json
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def main() -> None:
    from gated_attention.train import dist as D
    from gated_attention.train.overrides import apply_overrides
    from gated_attention.train.train_presets import tiny
    from gated_attention.train.expert_parallel import apply_expert_parallel, local_expert_numel
    from gated_attention.train.activation_checkpoint import apply_activation_checkpointing
    from gated_attention.train.model_setup import build_model
    from gated_attention.train.monitors import decoder_layers

    out, sets = sys.argv[1], [a for a in sys.argv[2:] if a not in ("--set", "--compile")]
    compiled = "--compile" in sys.argv
    cfg = apply_overrides(tiny(), ["model=tiny-moe", "dist=fsdp", "precision=fp32"] + sets)
    info = D.setup("cpu", "fsdp")
    dims = cfg.check_world(info.world_size)
    torch.manual_seed(cfg.seed)
    ref = build_model(cfg, None).train()
    model = copy.deepcopy(ref)
    apply_activation_checkpointing(decoder_layers(model), cfg.activation_checkpointing)  # the recompute replays EP
    meshes = D.device_meshes(info, dims)  # as train/parallelize.py steps 5-6
    if meshes is not None and meshes.ep is not None:
        apply_expert_parallel(model, meshes.ep)
    model = D.wrap(model, info, decoder_layers(model), cfg.precision, meshes)  # bf16-params: FSDP2's mixed precision
    g = torch.Generator().manual_seed(7)
    batch = torch.randint(0, ref.config.vocab_size, (cfg.batch_size, cfg.seq_len + 1), generator=g)
    x, y = batch[:, :-1], batch[:, 1:]  # (B, T) each
    per = cfg.batch_size // info.world_size
    rows = slice(info.rank * per, (info.rank + 1) * per)

    def loss_of(m, xs, ys):
        return m(input_ids=xs, shift_labels=ys, fused_loss=True, use_cache=False).loss

    # the reference: the mean loss over the global batch equals the mean over ranks of each rank's mean
    ref_loss = loss_of(ref, x, y)
    ref_loss.backward()
    with torch.no_grad():
        ref_logits = ref(input_ids=x[rows], use_cache=False).logits  # (B/N, T, V)
    mine, count = {}, _CountAllToAll()
    if compiled:
        from gated_attention.train.fastpath import SpeedPlan

        mine = explain_moe_block(ref, meshes.ep, x[rows])
        plan = SpeedPlan(True, "false", 0, True, decoder_layers(model), info.device, backend="aot_eager")
        plan._enable("probe: compiled layers")
        with plan.training_forward():
            loss = loss_of(model, x[rows], y[rows])
        loss.backward()
    else:
        with count:  # forward and backward, the recompute of checkpointed layers included
            loss = loss_of(model, x[rows], y[rows])
            loss.backward()
        mine["all_to_all"] = count.calls
    grads = {}
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        if p.grad is None:
            grads[name] = float("inf")
            continue
        gfull = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        grads[name] = float((gfull - q.grad).abs().max() / q.grad.abs().max().clamp_min(1e-30))
    local, full = local_expert_numel(model)  # at rest
    placements = sorted({str(tuple(p.placements)) for n, p in model.named_parameters() if n.endswith("_proj")
                         and ".experts." in n})  # the experts' FSDP2 (and EP) placements as sharded
    from torch.distributed.fsdp import FSDPModule

    fsdp = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in fsdp:  # gathered as for compute: FSDP2 all-gathers over its mesh (under EP: efsdp only)
        m.unshard()
    gathered, _ = local_expert_numel(model)
    for m in fsdp:
        m.reshard()
    with torch.no_grad():
        logits = model(input_ids=x[rows], use_cache=False).logits
    mine |= {"rank": info.rank, "logits": float((logits - ref_logits).abs().max()), "grads": grads,
            "expert_local": local, "expert_gathered": gathered, "expert_full": full, "expert_placements": placements,
            "loss": float(D.reduce_mean(loss.detach(), info)), "ref_loss": float(ref_loss)}
    ranks = D.gather_objects(mine, info)
    if info.is_main:
        with open(out, "w") as fh:
            json.dump({"ranks": ranks}, fh)
    D.teardown()


class _CountAllToAll(TorchDispatchMode):
    """Counts the all-to-all collectives dispatched while it is on (an op a checkpoint's recompute is handed from
    the forward's saved outputs is not dispatched again, so not counted)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func is torch.ops._c10d_functional.all_to_all_single.default
        return func(*args, **(kwargs or {}))


def explain_moe_block(ref, ep_mesh, input_ids) -> dict:
    """torch._dynamo.explain of the expert-parallel path: the first MoE block of a copy of `ref` with its experts
    sharded over `ep_mesh` (apply_expert_parallel; no FSDP2), in training mode on that block's real input under bf16
    autocast (the grouped kernel: fp32 under compile takes the per-expert fallback, a break of its own with or
    without expert parallelism, moe.grouped_matmul), under the trainer's dynamo options and without them:
    {"graph_breaks": n, "graph_breaks_without_options": n}."""
    from gated_attention.moe import moe_blocks
    from gated_attention.train.expert_parallel import apply_expert_parallel
    from gated_attention.train.fastpath import dynamo_options

    model = copy.deepcopy(ref)
    apply_expert_parallel(model, ep_mesh)
    _, block = moe_blocks(model)[0]
    seen = {}
    handle = block.register_forward_pre_hook(lambda m, args: seen.setdefault("h", args[0].detach()))
    with torch.no_grad():
        model(input_ids=input_ids, use_cache=False)
    handle.remove()
    counts = {}
    for key, options in (("graph_breaks", dynamo_options), ("graph_breaks_without_options", contextlib.nullcontext)):
        torch._dynamo.reset()
        with options(), torch.autocast("cpu", dtype=torch.bfloat16):
            counts[key] = torch._dynamo.explain(block)(seen["h"]).graph_break_count
    torch._dynamo.reset()
    return counts


if __name__ == "__main__":
    main()
    from gated_attention.train.dist import exit_process

    exit_process(0)  # a rank whose group ended: no interpreter finalization (train/dist.py says why)
