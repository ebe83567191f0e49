"""bench/bench_plan.py run — what bench/gpu_check.sh measures beside the plan — on CPU: in one process with periodic
checkpoints (the trainer hands its save a `background` argument) and under torchrun with gloo (dist=fsdp, 2 ranks),
each rank recording its memory of every step as the trainer's log line reads it, before that line resets the peaks.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness import torchrun_argv

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "bench_plan.py"
SETS = ["--set", "steps=4", "--set", "ckpt_every=2", "--set", "eval_batches=1", "--set", "stats_every=0"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}


def _ranks(out: Path, world: int) -> list[dict]:
    recs = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    log = [json.loads(x) for x in (out / "run" / "log.jsonl").read_text().splitlines() if x.strip()]
    for rec in recs:
        assert rec["world_size"] == world
        assert len(rec["steps_memory"]) == len(log) == 4  # one record per step, as many as log lines
        assert all(m["rss_peak_gb"] >= m["rss_gb"] > 0 for m in rec["steps_memory"])  # the CPU's figures
        assert len(rec["save_s"]) == 2  # the periodic checkpoint at step 2 and the final one at 4
        assert rec["cuda_peak_allocated_gb"] is None  # no CUDA here: nothing is made up
    # the log line's memory is the max over ranks of what each rank read for that step
    for step, line in enumerate(log):
        assert line["rss_gb"] == pytest.approx(max(r["steps_memory"][step]["rss_gb"] for r in recs))
    return recs


def test_one_process_with_periodic_checkpoints(tmp_path):
    p = subprocess.run([sys.executable, str(BENCH), "run", "--preset", "tiny", *SETS, "--out", str(tmp_path)],
                       env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "bench_plan: tiny world 1" in p.stdout
    _ranks(tmp_path, 1)


def test_two_ranks_under_torchrun_with_gloo(tmp_path):
    cmd = torchrun_argv("run", "--preset", "tiny", *SETS, "--set", "dist=fsdp", "--out", tmp_path, script=BENCH)
    p = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    recs = _ranks(tmp_path, 2)
    assert {r["dist"] for r in recs} == {"fsdp"} and [r["rank"] for r in recs] == [0, 1]


SHRUNK = ["model.hidden_size=64", "model.intermediate_size=128", "model.num_attention_heads=4",
          "model.num_key_value_heads=2", "model.head_dim=16", "model.vocab_size=256"]
MOE_SHRUNK = ["model.num_experts=8", "model.num_experts_per_tok=2", "model.moe_intermediate_size=32"]
PARALLEL = ROOT / "bench" / "parallel_check.py"


@pytest.mark.slow
@pytest.mark.parametrize("parts,sets", [("dense-fsdp,dense-hsdp", SHRUNK), ("moe-ep", SHRUNK + MOE_SHRUNK)])
def test_parallel_check_parts_on_cpu_with_gloo(tmp_path, parts, sets):
    """bench/parallel_check.py's parts (the GPU check's FSDP2, HSDP and EP runs) on CPU: 2 gloo ranks each, the
    model shrunk to seconds; every part measured beside its plan, its collectives timed by the profiler."""
    argv = [sys.executable, str(PARALLEL), "--nproc", "2", "--device", "cpu", "--seq", "32", "--steps", "4",
            "--parts", parts, "--out", str(tmp_path), *sum((["--set", s] for s in sets), [])]
    p = subprocess.run(argv, env=ENV, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + "".join((d / "log.txt").read_text()[-3000:]
                                                         for d in tmp_path.iterdir() if (d / "log.txt").exists())
    rows = json.loads((tmp_path / "parallel_check.json").read_text())["parts"]
    assert list(rows) == parts.split(",")
    for name, row in rows.items():
        assert row["dist"] == "fsdp" and row["world_size"] == 2, name
        assert all(x > 0 for x in row["peak_rss_gb"]) and row["plan_memory_gb"] > 0, name
        assert row["comm_s_per_step"] > 0, name  # gloo's collectives were seen by the profiler
        recs = [json.loads((tmp_path / name / f"rank{r}.json").read_text()) for r in (0, 1)]
        assert all(len(r["steps_memory"]) == 4 for r in recs), name
    layouts = {n: json.loads((tmp_path / n / "run" / "summary.json").read_text())["parallel"] for n in rows}
    if "dense-hsdp" in layouts:
        assert layouts["dense-hsdp"]["dp_replicate"] == 2 and layouts["dense-fsdp"]["dp_replicate"] == 1
    if "moe-ep" in layouts:
        assert layouts["moe-ep"]["expert_parallel"] == 2
