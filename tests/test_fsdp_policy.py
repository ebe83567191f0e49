"""FSDP2's gather policy (train/fsdp_policy.py) at 2 ranks on CPU (gloo): the all-gathers each shard group runs per
training step, counted, equal what the policy predicts by hand and what `gattn plan` counts; every policy ends with
the default's weights exactly; and a run under the policy that holds the most gathered, with a probe forward and an
evaluation between steps, trains like one process. HSDP's all-reduces across replicas, counted the same way: once
per step under gradient accumulation."""
from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

from gated_attention.train import fsdp_policy as FP
from gated_attention.train import plan as PL
from gated_attention.train.overrides import apply_overrides
from gated_attention.train.train_presets import tiny
from gated_attention.train.trainer import train
from harness import torchrun_argv
from test_distributed import losses, torchrun

SHARED = ["model.num_hidden_layers=4", "grad_accum=2", "steps=2"]  # 8 sequences = 2 ranks x 2 micro-batches of 2
# run -> its settings, and the all-gathers per step by hand (4 layers, 2 micro-batches): (root, per layer)
RUNS = {
    # a layer freed after forward is gathered for forward and again for backward; the last layer and the root are
    # kept from forward to backward: 2 per micro-batch for layers 0-2, 1 for layer 3 and the root (the trainer before
    # this policy freed the last layer too: 18 per step)
    "default": ("", (2, [4, 4, 4, 2])),
    "always": ("reshard_after_forward:always", (4, [4, 4, 4, 4])),
    "never": ("reshard_after_forward:never", (2, [2, 2, 2, 2])),
    "keep": ("keep_gathered:auto", (1, [1, 1, 1, 1])),  # the plan says it fits this host: once per step
    "whole-grads": ("accum_grads:auto", (2, [4, 4, 4, 2])),  # one reduce-scatter per step: its own summation order
    "keep-whole-grads": ("keep_gathered:auto,accum_grads:auto", (1, [1, 1, 1, 1])),
    "prefetch2": ("fsdp_prefetch:2", (2, [4, 4, 4, 2])),  # when, not how often
    "checkpointed": ("activation_checkpointing:full", (2, [4, 4, 4, 2])),  # the recompute gathers nothing more
}
# HSDP 2x1 (2 replicas of a one-rank shard group) under each accumulation policy, in the same torchrun job
HSDP_RUNS = {"hsdp": "dp_replicate:2", "hsdp-whole-grads": "dp_replicate:2,accum_grads:auto"}


def config(sets: str):
    return apply_overrides(tiny(), ["dist=fsdp", "precision=fp32", *SHARED,
                                    *(s.replace(":", "=", 1) for s in sets.split(",") if s)])


@pytest.fixture(scope="session")  # built once per worker (tests/conftest.py: scheduling)
def measured(tmp_path_factory) -> list[dict]:
    """Each rank's record of the RUNS, trained one after another in one torchrun job (tests/probes/fsdp_gathers.py)."""
    tmp = tmp_path_factory.mktemp("gathers")
    runs = [f"{name}={sets}" for name, (sets, _) in RUNS.items()] + [f"{n}={sets}" for n, sets in HSDP_RUNS.items()]
    cmd = torchrun_argv(tmp / "runs", tmp / "res", *runs, "--", *SHARED,
                        script=Path(__file__).with_name("probes") / "fsdp_gathers.py")
    p = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return [torch.load(tmp / f"res.rank{r}.pt", weights_only=True) for r in (0, 1)]


@pytest.mark.parametrize("name", list(RUNS))
def test_all_gathers_per_step_are_what_the_policy_and_the_plan_count(measured, name):
    sets, (root, layers) = RUNS[name]
    want = {"root": root, **dict(enumerate(layers))}
    for rank in measured:
        assert rank[name]["gathers"] == [want, want], (name, rank[name]["gathers"])  # both steps
        assert rank[name]["keep_gathered"] == name.startswith("keep")
    p = PL.plan(config(sets), gpus=2, device="cpu", gpu_memory_gb=1e3)
    assert p["comm_per_step"]["all_gathers"] == root + sum(layers)
    policy = FP.gather_policy(p["settings"]["reshard_after_forward"], p["settings"]["fsdp_prefetch"],
                              "true" if p["settings"]["keep_gathered"] else "false", layers=4, mode="fsdp", world=2,
                              grad_accum=2)
    assert FP.all_gathers_per_step(policy, 2) == {"root": root, "layers": tuple(layers)}


def test_no_policy_changes_the_weights(measured):
    """The gathered values are the same whenever they are gathered: every run ends with the weights of the default
    policy under the same accumulation, to the bit, on both ranks (whole gradients reduced once per step sum in
    another order than a reduce-scatter per micro-batch: that pair is compared with its own kind)."""
    for rank in measured:
        for name in RUNS:
            ref = rank["whole-grads" if "whole-grads" in name else "default"]["weights"]
            got = rank[name]["weights"]
            assert set(got) == set(ref) and [k for k in ref if not torch.equal(got[k], ref[k])] == [], name


@pytest.mark.parametrize("name", list(HSDP_RUNS))
def test_hsdp_all_reduces_across_replicas_once_per_step(measured, name, tmp_path):
    """HSDP 2x1 with 2 micro-batches: FSDP2 all-reduces each group's gradient shard across the replicas once per step
    (5 groups: 4 layers and the root), not once per micro-batch (10 before: the trainer never set
    set_requires_all_reduce(False) on the first micro-batch); with sharded accumulation the shard sums the
    micro-batches first. Plain FSDP2 has no replica dim. The first step's gradients equal one process's (float
    summation order)."""
    from gated_attention.train import dist as D
    from gated_attention.train import trainer
    from probes.fsdp_gathers import first_step_grads, run_config

    for rank in measured:
        assert rank[name]["all_reduces"] == [{"dp_replicate": 5}] * 2, rank[name]["all_reduces"]
        assert rank["default"]["all_reduces"] == [{}] * 2
    cfg = run_config(SHARED, "")  # the same run in this process: no replicas, no wrapper
    cfg.validate().check_world(1, "fp32")
    with first_step_grads(trainer) as want:
        trainer._train_step(trainer._setup(cfg, tmp_path, D.DistInfo(), "fp32"), 0)
    worst = 0.0
    for rank in measured:
        got = rank[name]["grads"]
        assert set(got) == set(want)
        worst = max(worst, *(float((got[k] - want[k]).abs().max() / want[k].abs().max()) for k in want))
    assert worst < 1e-5, worst
    print(f"{name}: max relative gradient difference from one process {worst:.2e}")  # for docs/scale.md (-s)


def test_held_gathered_through_probes_and_evaluation_trains_like_one_process(tmp_path):
    """keep_gathered (every group gathered from its first forward) with explicit prefetch, the stats probe every step
    and an evaluation every 2 steps: each forward outside a step leaves the groups gathered, and the next step starts
    from the shards (Parallel.reshard). Before it, even the default policy failed at 2 ranks with stats_every=1: the
    snapshot read the root's gathered embedding (128 rows) and compared it with its 64-row shard after the update.
    The losses equal one process's; summary.json records the policy applied."""
    sets = ["precision=fp32", "steps=4", "stats_every=1", "eval_every=2", "ckpt_every=0", "grad_accum=2", "seed=1",
            "dist=fsdp", "keep_gathered=true", "fsdp_prefetch=1", "reshard_after_forward=always"]
    train(apply_overrides(tiny(), sets), tmp_path / "one")
    p = torchrun(tmp_path / "two", sets)
    assert p.returncode == 0, p.stderr[-3000:]
    assert losses(tmp_path / "two") == pytest.approx(losses(tmp_path / "one"), abs=1e-5)
    par = json.loads((tmp_path / "two" / "summary.json").read_text())["parallel"]
    assert (par["keep_gathered"], par["fsdp_prefetch"], par["reshard_after_forward"]) == (True, 1, "always")


def test_gather_settings_are_checked_and_change_only_the_layout():
    """One error per bad setting (a name, a count, FSDP2's settings under DDP); a JSON true is "true"; a run resumes
    under another gather policy (resume_rule: the layout, not the math)."""
    from gated_attention.train.resume_rule import changed_settings
    from gated_attention.util.errors import UserError

    cfg = apply_overrides(tiny(), ["dist=fsdp", "reshard_after_forward=never", "fsdp_prefetch=2"])
    cfg.keep_gathered = True  # as a train_config.json may hold it
    assert cfg.validate().keep_gathered == "true"
    assert changed_settings(apply_overrides(tiny(), ["dist=fsdp"]).to_dict(), cfg.to_dict()) == []
    for sets, msg in ((["keep_gathered=true"], "keep_gathered=true needs dist=fsdp"),
                      (["fsdp_prefetch=1", "reshard_after_forward=never"],
                       "reshard_after_forward=never, fsdp_prefetch=1 needs dist=fsdp"),
                      (["dist=fsdp", "keep_gathered=maybe"], "keep_gathered='maybe'; use 'false', 'auto'"),
                      (["dist=fsdp", "reshard_after_forward=sometimes"], "reshard_after_forward='sometimes'"),
                      (["dist=fsdp", "fsdp_prefetch=-1"], "fsdp_prefetch")):
        with pytest.raises(UserError, match=re.escape(msg)):
            apply_overrides(tiny(), sets).validate()
