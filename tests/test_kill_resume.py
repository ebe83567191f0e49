"""The one resume policy, end to end: a command that trains several models (a job's or a lab's units), SIGKILLed in
the middle of one unit and run again, trains only what the kill lost and ends with the figures of an uninterrupted
run.

Each case is one command line (tiny models, few steps), the unit to kill (its trainer run folder) and the step to
kill it after. For each: an uninterrupted run (the reference), then the same command killed there
(tests/probes/kill_hooks.py) and rerun. Checked: the kill landed mid-unit after a checkpoint; the rerun trained the
killed unit from that checkpoint to its end, the units the killed process had finished not at all, and the units it had
not reached in full (the step traces of kill_hooks.py); the command's output figures (compare.json / lab.json without
wall or CPU times, which a rerun measures anew) equal the reference's exactly. Every process runs with one thread in
fp32 (GATTN_BF16_SPEEDUP < 1: "auto" resolves alike in every process), so equal means bitwise-equal training.

A lab joins by one more KillCase row."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from gated_attention.train.checkpoint import list_checkpoints
from harness import traced_gattn

ENV = {"OMP_NUM_THREADS": "1", "GATTN_BF16_SPEEDUP": "0.5"}  # one thread, fp32: the same numbers in every process
# not figures: times measured anew by each invocation, its layout (how much it trained) and its output folder
NOT_FIGURES = {"wall_time_s", "wall_s", "cpu_s", "cpu_time_s", "cpu_s_runs", "timings_s", "train_wall_time_s", "layout",
               "out"}


def without_times(obj):
    """A result JSON without the wall/CPU times, the layout and the --out path, recursively."""
    if isinstance(obj, dict):
        return {k: without_times(v) for k, v in obj.items() if k not in NOT_FIGURES}
    if isinstance(obj, list):
        return [without_times(v) for v in obj]
    return obj


def differing(a, b, where: str = "") -> list[str]:
    """The leaf paths where two JSON values differ, with both values (the assertion's message)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in differing(a.get(k), b.get(k), f"{where}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differing(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r} vs {b!r}"]


def _json(path: Path) -> dict:
    return without_times(json.loads(path.read_text()))


@dataclass(frozen=True)
class KillCase:
    name: str
    argv: Callable[[Path, dict], list]  # (out, inputs: "corpus" and the fixtures named in `needs`) -> the command
    victim: str  # the unit killed: its trainer run folder, relative to out
    kill_at: int  # killed right after this step (0-based) of the victim, past a checkpoint of it
    figures: Callable[[Path], dict]  # the command's final figures, from its output folder
    needs: tuple = ()  # fixtures the command reads (their values in argv's inputs under their names)


CASES = [
    KillCase("compare",
             lambda out, inp: ["compare", "--budget", "small", "--data-dir", inp["corpus"], "--out", out, "--jobs", "1",
                                  "--variants", "baseline", "sdpa_elementwise", "--no-streaming"],
             victim="runs/sdpa_elementwise", kill_at=40,  # the small budget: 60 steps, a checkpoint every 30
             figures=lambda out: _json(out / "compare.json")),
    KillCase("stability",
             lambda out, inp: ["lab", "stability", "--budget", "small", "--data-dir", inp["corpus"], "--out", out,
                                  "--jobs", "1", "--variants", "baseline", "--qk-norm", "off", "--lrs", "1e-3", "3e-2",
                                  "--seeds", "1"],
             victim="runs/baseline_qkoff_lr0.03_s0", kill_at=14,  # the small budget: 30 steps, a checkpoint every 10
             figures=lambda out: _json(out / "lab.json")),
    KillCase("sinks",
             lambda out, inp: ["lab", "sinks", "--budget", "small", "--out", out, "--jobs", "1",
                                  "--variants", "baseline", "sdpa_elementwise", "--seeds", "1"],
             victim="runs/sdpa_elementwise/seed0", kill_at=40,  # the small budget: 60 steps, a checkpoint every 30
             figures=lambda out: _json(out / "lab.json")),
    KillCase("scaling",
             lambda out, inp: ["lab", "scaling", "--budget", "quick", "--data-dir", inp["corpus"], "--out", out,
                               "--jobs", "1", "--variants", "baseline", "sdpa_elementwise", "--lrs", "0.01", "0.02",
                               "--seeds", "2", "--sizes", "d24l1"],
             victim="runs/baseline_d24l1_lr0.02_s0", kill_at=40,  # 119 steps, a checkpoint every 29 (a tuning unit:
             # under shared-lr only the baseline is swept)
             figures=lambda out: _json(out / "lab.json")),
    KillCase("retrofit",
             lambda out, inp: ["lab", "retrofit", "--from", inp["sink_start"], "--recipes", "bos-penalty",
                               "--steps", "300", "--eval-size", "8", "--jobs", "1", "--out", out],
             victim="runs/baseline_seed0/bos-penalty/seed0", kill_at=270,  # a checkpoint every 250 steps
             figures=lambda out: _json(out / "lab.json"), needs=("sink_start",)),
]


@pytest.fixture(scope="session")  # built once per worker (tests/conftest.py: scheduling)
def sink_start(tmp_path_factory):
    """A trained sink-lab baseline (the small budget), the retrofit case's starting model."""
    from harness import run_gattn

    out = tmp_path_factory.mktemp("sink_start")
    r = run_gattn("lab", "sinks", "--budget", "small", "--variants", "baseline", "--seeds", "1", "--jobs", "1",
                  "--out", str(out), env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    return str(out / "runs" / "baseline" / "seed0")


# the default run keeps the main job's row; the labs' rows (the same policy through experiment.train_or_reuse,
# 30-85 s each on a 2-core AVX2 CPU) run with `pytest -m slow`
SLOW_CASES = {"sinks", "stability", "scaling", "retrofit"}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c.name in SLOW_CASES else c
                                  for c in CASES], ids=[c.name for c in CASES])
def test_sigkill_mid_unit_then_rerun_ends_as_uninterrupted(case: KillCase, tiny_corpus, tmp_path, request):
    ref, out = tmp_path / "ref", tmp_path / "killed"
    inputs = {"corpus": tiny_corpus, **{n: request.getfixturevalue(n) for n in case.needs}}
    victim = case.victim
    p, full = traced_gattn(*case.argv(ref, inputs), root=ref, trace=tmp_path / "ref.trace", env=ENV)
    assert p.returncode == 0, p.stderr[-3000:]
    assert len(full) >= 2 and victim in full and case.kill_at + 1 < len(full[victim])  # the kill lands mid-unit

    p, before = traced_gattn(*case.argv(out, inputs), root=out, trace=tmp_path / "killed.trace", env=ENV,
                             kill_in=victim, kill_at=case.kill_at)
    assert p.returncode == -9, p.stderr[-3000:]
    assert before[victim] == full[victim][:case.kill_at + 1]
    ckpts = [s for s, _ in list_checkpoints(out / case.victim)]
    assert ckpts and 0 < ckpts[-1] <= case.kill_at, ckpts  # a checkpoint before the kill, none after it
    assert not (out / case.victim / "summary.json").exists()

    p, after = traced_gattn(*case.argv(out, inputs), root=out, trace=tmp_path / "rerun.trace", env=ENV)
    assert p.returncode == 0, p.stderr[-3000:]
    # what the rerun trained: the killed unit from its checkpoint on; finished units not at all; the rest in full
    assert after.get(victim) == full[victim][ckpts[-1]:]
    for unit, steps in full.items():
        if unit != victim:
            assert before.get(unit, []) in ([], steps), unit  # nothing else was interrupted
            assert after.get(unit, []) == ([] if before.get(unit) else steps), unit
    diffs = differing(case.figures(out), case.figures(ref))
    assert not diffs, diffs
