"""async_checkpoint (dist=fsdp): DCP's async_save writes a periodic checkpoint in the background and the trainer
commits it before the next save, at the end, or on an error (train/saving.py). At 2 ranks (gloo, torchrun): the
checkpoints, losses and final weights equal a blocking run's bit for bit; a rank SIGKILLed while its write is in flight
leaves no checkpoint of that step, and the resume continues from the one before as if never stopped; a run that fails
after an async save commits it first. Plus the setting itself: refused without dist=fsdp, free to change on resume."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gated_attention.train.checkpoint import checkpoint_root, list_checkpoints, verify
from harness import log_losses, torchrun_train

SETS = ["steps=6", "precision=fp32", "stats_every=3", "ckpt_every=2", "keep_checkpoints=3", "seed=1", "dist=fsdp",
        "compile=false"]
ASYNC = SETS + ["async_checkpoint=true"]


@pytest.fixture(scope="session")  # built once per worker (tests/conftest.py: scheduling)
def blocking(tmp_path_factory) -> Path:
    """The same run with blocking saves: checkpoints at steps 2, 4 and 6, all kept."""
    out = tmp_path_factory.mktemp("blocking") / "run"
    p = torchrun_train(out, SETS)
    assert p.returncode == 0, p.stderr[-3000:]
    return out


def dcp_state(ckpt: Path, tmp: Path) -> dict:
    """A checkpoint's sharded state (model and AdamW) as one plain state dict, read in this process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dest = tmp / f"{ckpt.parent.parent.name}_{ckpt.name}.pt"
    dcp_to_torch_save(ckpt / "state", dest)
    return torch.load(dest, weights_only=True)


def same(a, b) -> bool:
    """Nested containers equal, tensors bit for bit (dtype and shape included)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def meta(ckpt: Path) -> dict:
    """meta.json without what may differ between two runs of the same numbers: the settings and the wall time."""
    m = json.loads((ckpt / "meta.json").read_text())
    m.pop("config")
    m["state"].pop("wall_time")
    return m


def assert_same_checkpoint(got: Path, want: Path, tmp: Path, ranks: int = 2) -> None:
    assert verify(got) is None and all(verify(got, r, ranks) is None for r in range(ranks))
    assert same(dcp_state(got, tmp), dcp_state(want, tmp)), f"{got} holds other weights or AdamW state than {want}"
    assert meta(got) == meta(want)
    for rank in range(ranks):
        name = f"rng_rank{rank}.pt"
        assert same(torch.load(got / name, weights_only=True), torch.load(want / name, weights_only=True))


def final_weights(run: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(run / "final" / "model.safetensors")


def test_async_run_equals_a_blocking_one(tmp_path, blocking):
    """Every checkpoint (weights, AdamW moments, counters and spike window, each rank's RNG), every loss and the final
    weights equal the blocking run's bit for bit, although the first save's write starts 3 s late (a slow disk:
    tests/probes/kill_hooks.py) while steps 2-3 train on: a save holds the state of its own step (one that did not copy
    it at staging, or wrote meta.json at the commit, would differ) and the save of step 4 waits for that write before
    it commits it (one that did not would hash a folder without shards, which fails verification)."""
    out = tmp_path / "run"
    p = torchrun_train(out, ASYNC, {"GATTN_TEST_DELAY_CKPT_WRITE": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    assert "warning" not in p.stderr.lower(), p.stderr[-3000:]
    assert [s for s, _ in list_checkpoints(out)] == [s for s, _ in list_checkpoints(blocking)] == [2, 4, 6]
    assert not [d for d in checkpoint_root(out).iterdir() if not d.name.startswith("step_")]  # no leftovers
    for (_, got), (_, want) in zip(list_checkpoints(out), list_checkpoints(blocking)):
        assert_same_checkpoint(got, want, tmp_path)
    assert log_losses(out) == log_losses(blocking)
    assert same(final_weights(out), final_weights(blocking))


def test_sigkill_while_an_async_save_is_in_flight(tmp_path, blocking):
    """Rank 1 SIGKILLed right after the save of step 4 returned to the loop, its shard write still in flight (it
    starts 3 s late: tests/probes/kill_hooks.py): step 4 is no checkpoint — only an uncommitted temporary folder
    without DCP's .metadata —, step 2 (saved asynchronously, committed at the save of step 4) is; the rerun resumes from
    step 2, trains steps 2-5 again and ends with the blocking run's losses, checkpoints and final weights. A save
    committed at once (renamed before the loop goes on) would leave a step_00000004 here."""
    out, trace = tmp_path / "run", tmp_path / "steps.txt"
    p = torchrun_train(out, ASYNC, {"GATTN_TEST_KILL_AFTER_SAVE": "2", "GATTN_TEST_DELAY_CKPT_WRITE": "2",
                                      "GATTN_TEST_FAULT_RANK": "1"})
    assert p.returncode != 0
    assert [s for s, _ in list_checkpoints(out)] == [2]
    tmp = checkpoint_root(out) / ".tmp-step_00000004"
    assert tmp.is_dir() and not (tmp / "manifest.json").exists() and not (tmp / "state" / ".metadata").exists()
    assert_same_checkpoint(list_checkpoints(out)[0][1], list_checkpoints(blocking)[0][1], tmp_path)
    p = torchrun_train(out, ASYNC, {"GATTN_TEST_STEP_TRACE": str(trace)}, resume=True)
    assert p.returncode == 0, p.stderr[-3000:]
    steps = sorted(int(line.rsplit(" ", 1)[1]) for line in trace.read_text().splitlines())
    assert steps == [2, 2, 3, 3, 4, 4, 5, 5]  # each rank, from the checkpoint of step 2
    assert not tmp.exists()
    assert log_losses(out) == log_losses(blocking)
    for (_, got), (_, want) in zip(list_checkpoints(out), list_checkpoints(blocking)):
        assert_same_checkpoint(got, want, tmp_path)
    assert same(final_weights(out), final_weights(blocking))


def test_a_failing_run_commits_its_async_save_first(tmp_path, blocking):
    """Every rank raises right after the save of step 4 was staged, its write starting 3 s late: before exiting, the
    run waits for that write and commits it (rank 0 alone: no collective on the error path), a checkpoint equal to
    the blocking run's."""
    out = tmp_path / "run"
    p = torchrun_train(out, ASYNC, {"GATTN_TEST_RAISE_AT_STEP": "3", "GATTN_TEST_DELAY_CKPT_WRITE": "2"})
    assert p.returncode != 0 and "injected failure at step 3" in p.stderr, p.stderr[-3000:]
    assert [s for s, _ in list_checkpoints(out)] == [2, 4]
    for (_, got), (_, want) in zip(list_checkpoints(out), list_checkpoints(blocking)):
        assert_same_checkpoint(got, want, tmp_path)


def test_one_process(tmp_path):
    """dist=fsdp in one process (no process group: DCP's one-process path) saves asynchronously too: the same
    checkpoints and losses as its blocking saves, and DCP's one-process warning (emitted from its writer thread) is
    not shown."""
    import warnings

    from gated_attention.train.overrides import apply_overrides
    from gated_attention.train.train_presets import tiny
    from gated_attention.train.trainer import train

    for mode, extra in (("blocking", []), ("async", ["async_checkpoint=true"])):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train(apply_overrides(tiny(), SETS + extra), tmp_path / mode)
        assert not [w for w in caught if "torch.distributed is disabled" in str(w.message)]
    runs = [list_checkpoints(tmp_path / mode) for mode in ("async", "blocking")]
    assert [s for s, _ in runs[0]] == [s for s, _ in runs[1]] == [2, 4, 6]
    for (_, got), (_, want) in zip(*runs):
        assert_same_checkpoint(got, want, tmp_path, ranks=1)
    assert log_losses(tmp_path / "async") == log_losses(tmp_path / "blocking")


def test_the_setting(tmp_path):
    """--set async_checkpoint=true is a setting; without dist=fsdp it is refused with one line naming the fix; it
    may change on --resume (how checkpoints are written, not what they hold)."""
    from gated_attention.train.config import TrainConfig
    from gated_attention.train.overrides import apply_overrides
    from gated_attention.train.resume_rule import changed_settings
    from gated_attention.train.train_presets import tiny

    assert apply_overrides(tiny(), ["dist=fsdp", "async_checkpoint=true"]).async_checkpoint is True
    assert TrainConfig().async_checkpoint is False
    with pytest.raises(ValueError, match=r"async_checkpoint=true needs dist=fsdp .*add --set dist=fsdp"):
        apply_overrides(tiny(), ["async_checkpoint=true"])
    with pytest.raises(ValueError, match="async_checkpoint='yes' must be true or false"):
        TrainConfig(dist="fsdp", async_checkpoint="yes").validate()
    saved = apply_overrides(tiny(), ["dist=fsdp"]).to_dict()
    assert changed_settings(saved, {**saved, "async_checkpoint": True}) == []
