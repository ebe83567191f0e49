"""2-rank DDP and FSDP2 under torchrun on CPU (gloo) give the same losses as one process; resume after a 2-rank run."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from gated_attention.train.config import apply_overrides, tiny
from gated_attention.train.trainer import train
from harness import torchrun_argv

SETS = ["steps=6", "precision=fp32", "stats_every=3", "ckpt_every=3", "seed=1"]


def losses(run: Path) -> list[float]:
    return [json.loads(l)["loss"] for l in (run / "log.jsonl").read_text().splitlines()]


def torchrun(out: Path, sets: list[str], env_extra: dict | None = None, resume: bool = False):
    cmd = torchrun_argv("train", "--preset", "tiny", "--out", out, *sum((["--set", s] for s in sets), []),
                        *(["--resume"] if resume else []), kill_hooks=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[float]:
    out = tmp_path_factory.mktemp("single")
    train(apply_overrides(tiny(), SETS), out)
    return losses(out)


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_ranks_equal_one(tmp_path, reference, mode):
    p = torchrun(tmp_path, SETS + [f"dist={mode}"])
    assert p.returncode == 0, p.stderr[-3000:]
    assert losses(tmp_path) == pytest.approx(reference, abs=1e-5)
    assert (tmp_path / "final" / "model.safetensors").exists()


def test_resume_after_distributed_kill(tmp_path, reference):
    p = torchrun(tmp_path, SETS, {"GATTN_TEST_KILL_AT_STEP": "4"})  # killed after step 4, checkpoint at 3
    assert p.returncode != 0
    p = torchrun(tmp_path, SETS, resume=True)
    assert p.returncode == 0, p.stderr[-3000:]
    assert losses(tmp_path) == pytest.approx(reference, abs=1e-5)
