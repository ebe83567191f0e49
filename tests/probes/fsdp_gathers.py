"""Run under torchrun by tests/test_fsdp_policy.py: train dist=fsdp under several FSDP2 gather policies, one after
another in the same ranks, through the trainer's own setup and step (trainer._setup, trainer._train_step), and
record for every step how many all-gathers FSDP2 ran for each shard group (its foreach_all_gather, counted where
FSDPParamGroup.unshard calls it), and the weights after the last step.

    torchrun --nproc_per_node=2 tests/probes/fsdp_gathers.py OUT_DIR RESULT NAME=KEY:VALUE,KEY:VALUE [NAME=...] \
        [-- SET ...]

Each NAME=... is a run with those settings on top of the shared ones (the `--set`s after `--`). Writes
RESULT.rankN.pt: {NAME: {"gathers": [{group: count} per step], "keep_gathered": the plan's decision,
"weights": {key: the whole tensor}}}; a group is "root" or a decoder layer's index.
"""
from __future__ import annotations

import os
import re
import sys
from collections import Counter
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


def main() -> None:
    from gated_attention.train import dist as D
    from gated_attention.train import trainer
    from gated_attention.train.overrides import apply_overrides
    from gated_attention.train.train_presets import tiny

    out, result, rest = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    shared = rest[rest.index("--") + 1:] if "--" in rest else []
    runs = [a.split("=", 1) for a in (rest[:rest.index("--")] if "--" in rest else rest)]
    info = D.setup("cpu", "fsdp")
    counts: Counter = Counter()
    count_all_gathers(counts)
    rec = {}
    for name, sets in runs:
        cfg = apply_overrides(tiny(), ["dist=fsdp", "precision=fp32", "compile=false", "stats_every=0", "ckpt_every=0",
                                       "eval_every=0", *shared, *(s.replace(":", "=", 1) for s in sets.split(",") if s)])
        cfg.validate().check_world(info.world_size, "fp32")
        run = trainer._setup(cfg, out / name, info, "fp32")
        steps = []
        for step in range(cfg.steps):
            counts.clear()
            trainer._train_step(run, step)
            steps.append(dict(counts))
        weights = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                   for k, v in run.par.master.state_dict().items()}
        gather = getattr(run.par, "gather", None)  # None: a trainer without a gather policy (measuring the one before)
        rec[name] = {"gathers": steps, "keep_gathered": gather is not None and gather.keep_gathered, "weights": weights}
    torch.save(rec, f"{result}.rank{os.environ.get('RANK', '0')}.pt")
    D.teardown()


if __name__ == "__main__":
    main()
    from gated_attention.train.dist import exit_process

    exit_process(0)  # a rank whose group ended: no interpreter finalization (train/dist.py says why)
