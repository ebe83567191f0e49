"""Run under torchrun by tests/test_fsdp_policy.py: train dist=fsdp under several FSDP2 gather policies and layouts,
one after another in the same ranks, through the trainer's own setup and step (trainer._setup,
trainer._train_step), and record for every step how many all-gathers FSDP2 ran for each shard group (its
foreach_all_gather, counted where FSDPParamGroup.unshard calls it) and how many all-reduces it ran over each device
mesh dim (HSDP's across replicas: torch.distributed.all_reduce, which FSDP2's foreach_reduce calls), the first
step's gradients and the weights after the last step.

    torchrun --nproc_per_node=2 tests/probes/fsdp_gathers.py OUT_DIR RESULT NAME=KEY:VALUE,KEY:VALUE [NAME=...] \
        [-- SET ...]

Each NAME=... is a run with those settings on top of the shared ones (the `--set`s after `--`). Writes
RESULT.rankN.pt: {NAME: {"gathers": [{group: count} per step], "all_reduces": [{mesh dim: count} per step],
"keep_gathered": the plan's decision, "grads": {name: the whole gradient of step 0}, "weights": {key: the whole
tensor}}}; a group is "root" or a decoder layer's index.
"""
from __future__ import annotations

import os
import re
import sys
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import torch


def count_all_gathers(counts: Counter) -> None:
    """Count FSDP2's all-gathers into `counts` by group from now on (every one goes through foreach_all_gather)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as G

    gather = G.foreach_all_gather

    def counted(fsdp_params, *args, **kwargs):
        m = re.search(r"(?:^|\.)layers\.(\d+)\.", fsdp_params[0]._param_fqn)
        counts[int(m.group(1)) if m else "root"] += 1
        return gather(fsdp_params, *args, **kwargs)

    G.foreach_all_gather = counted


def count_all_reduces(counts: Counter, dims: dict) -> None:
    """Count torch.distributed.all_reduce calls into `counts` by the mesh dim their group is (`dims`: group name ->
    dim name, filled per run; calls on other groups, e.g. the loss's mean over the world, are not counted)."""
    import torch.distributed as dist

    all_reduce = dist.all_reduce

    def counted(tensor, *args, **kwargs):
        group = kwargs.get("group", args[1] if len(args) > 1 else None)
        name = dims.get(getattr(group, "group_name", None))
        if name is not None:
            counts[name] += 1
        return all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counted


def mesh_dims(model) -> dict:
    """{process group name: mesh dim name} of the device meshes `model`'s (DTensor) parameters live on."""
    dims = {}
    for p in model.parameters():
        mesh = getattr(p, "device_mesh", None)
        for name in (mesh.mesh_dim_names or ()) if mesh is not None else ():
            dims[mesh.get_group(name).group_name] = name
    return dims


def whole(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


@contextmanager
def first_step_grads(trainer):
    """While open, the gradients of the trainer's step 0 as its optimizer sees them (the whole tensors, by name) go
    into the dict this yields (trainer.update wrapped: by then the step's micro-batches are reduced)."""
    update, grads = trainer.update, {}

    def update_after_a_look(run, step, *args, **kwargs):
        if step == 0:
            grads.update({n: whole(p.grad) for n, p in run.par.master.named_parameters() if p.grad is not None})
        return update(run, step, *args, **kwargs)

    trainer.update = update_after_a_look
    try:
        yield grads
    finally:
        trainer.update = update


def run_config(shared: list[str], sets: str):
    """The TrainConfig of a run: the shared `--set`s, then the run's KEY:VALUE,KEY:VALUE settings."""
    from gated_attention.train.overrides import apply_overrides
    from gated_attention.train.train_presets import tiny

    return apply_overrides(tiny(), ["dist=fsdp", "precision=fp32", "compile=false", "stats_every=0", "ckpt_every=0",
                                    "eval_every=0", *shared, *(s.replace(":", "=", 1) for s in sets.split(",") if s)])


def main() -> None:
    from gated_attention.train import dist as D
    from gated_attention.train import trainer

    out, result, rest = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    shared = rest[rest.index("--") + 1:] if "--" in rest else []
    runs = [a.split("=", 1) for a in (rest[:rest.index("--")] if "--" in rest else rest)]
    info = D.setup("cpu", "fsdp")
    counts, reductions, dims = Counter(), Counter(), {}
    count_all_gathers(counts)
    count_all_reduces(reductions, dims)
    rec = {}
    with first_step_grads(trainer) as grads:
        for name, sets in runs:
            cfg = run_config(shared, sets)
            cfg.validate().check_world(info.world_size, "fp32")
            run = trainer._setup(cfg, out / name, info, "fp32")
            dims.clear()
            dims.update(mesh_dims(run.par.master))
            grads.clear()
            steps, reduced = [], []
            for step in range(cfg.steps):
                counts.clear()
                reductions.clear()
                trainer._train_step(run, step)
                steps.append(dict(counts))
                reduced.append(dict(reductions))
            weights = {k: whole(v) for k, v in run.par.master.state_dict().items()}
            gather = getattr(run.par, "gather", None)  # None: a trainer without a gather policy (the one before)
            rec[name] = {"gathers": steps, "all_reduces": reduced, "grads": dict(grads), "weights": weights,
                         "keep_gathered": gather is not None and gather.keep_gathered}
    torch.save(rec, f"{result}.rank{os.environ.get('RANK', '0')}.pt")
    D.teardown()


if __name__ == "__main__":
    main()
    from gated_attention.train.dist import exit_process

    exit_process(0)  # a rank whose group ended: no interpreter finalization (train/dist.py says why)
