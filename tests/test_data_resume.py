"""Training on a sharded corpus: each rank reads only its rows, and a resumed run sees exactly the batches it would
have seen (issue 29, item 3).

The data position is the step: `sample_batch` is a pure function of (corpus, seed, step), also when the corpus is
split into many shards, so a checkpoint's step is the whole data state. These tests would fail if the position were
lost or a rank read other rows: the losses of a killed-and-resumed run (one process, and 2 ranks under torchrun/gloo)
must equal those of an uninterrupted single-process run, step by step."""
from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path

import pytest
import torch

from gated_attention import data as D
from gated_attention.data import stream
from gated_attention.train.train_presets import tiny
from gated_attention.train.overrides import apply_overrides
from gated_attention.train.data_source import CorpusSource
from gated_attention.train.trainer import train
from harness import run_gattn, torchrun_argv

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


@pytest.fixture(scope="session")  # built once per worker (tests/conftest.py: scheduling)
def sharded(tmp_path_factory):
    """A two-domain corpus cut into shards of 5 chunks (so windows cross shard boundaries)."""
    root = tmp_path_factory.mktemp("src")
    rng = random.Random(0)
    for name in ("a", "b"):
        (root / name).mkdir()
        for i in range(4):
            (root / name / f"d{i}.txt").write_text(
                "\n\n".join(" ".join(rng.choice(WORDS) for _ in range(40)) for _ in range(30)) + "\n")
    mp = pytest.MonkeyPatch()
    mp.setattr(stream, "SHARD_CHUNKS", 5)
    out = tmp_path_factory.mktemp("data")
    D.prepare(D.PrepareConfig(data_dir=str(out), vocab_size=280, sources=(), extra=(str(root / "a"), str(root / "b")),
                              chunk_chars=300, workers=1))
    mp.undo()
    assert len(D.Corpus(out).tokens("a", "train").shards) >= 4
    return out


def _sets(data_dir: Path) -> list[str]:
    return ["steps=6", "precision=fp32", "stats_every=3", "ckpt_every=3", "seed=1", "data=corpus",
            f"data_dir={data_dir}", "eval_batches=1", "seq_len=32", "batch_size=8"]


def _losses(run: Path) -> list[float]:
    return [json.loads(l)["loss"] for l in (run / "log.jsonl").read_text().splitlines() if "loss" in json.loads(l)]


@pytest.fixture(scope="session")  # built once per worker (tests/conftest.py: scheduling)
def reference(sharded, tmp_path_factory) -> list[float]:
    out = tmp_path_factory.mktemp("single")
    train(apply_overrides(tiny(), _sets(sharded)), out)
    return _losses(out)


def test_rank_rows_are_rows_of_the_global_batch(sharded):
    src = CorpusSource(str(sharded), None)
    for step in range(5):
        full = src.train_batch(8, 32, seed=1, step=step)
        assert torch.equal(torch.cat([src.train_batch(8, 32, 1, step, rows=slice(r * 4, r * 4 + 4))
                                      for r in range(2)]), full)


def _gattn_train(out: Path, sets: list[str], env: dict | None = None, resume: bool = False, ranks: int = 1):
    args = ["train", "--preset", "tiny", "--out", str(out), *sum((["--set", s] for s in sets), []),
            *(["--resume"] if resume else [])]
    if ranks == 1:
        return run_gattn(*args, env={"OMP_NUM_THREADS": "1", **(env or {})}, kill_hooks=True)
    return subprocess.run(torchrun_argv(*args, nproc=ranks, kill_hooks=True), capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
def test_killed_run_resumes_with_the_same_batches(sharded, reference, tmp_path, ranks):
    p = _gattn_train(tmp_path, _sets(sharded), {"GATTN_TEST_KILL_AT_STEP": "4"}, ranks=ranks)  # checkpoint at 3
    assert p.returncode != 0
    p = _gattn_train(tmp_path, _sets(sharded), resume=True, ranks=ranks)
    assert p.returncode == 0, p.stderr[-3000:]
    assert len(reference) == 6 and _losses(tmp_path) == pytest.approx(reference, abs=1e-5)
