"""Progress without a terminal: steady lines (step/total, loss, tok/s, ETA) from the helper and from `gattn train`
run as a subprocess with stderr redirected to a pipe; on a terminal the tqdm bar stays."""
from __future__ import annotations

import io
import re
import time

import pytest

from gated_attention.util.progress import Progress, format_duration
from harness import run_gattn


class _Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_lines_at_a_steady_interval_with_eta():
    out, clock = io.StringIO(), _Clock()
    prog = Progress(10, "train x", "step", stream=out, interval=30.0, clock=clock)
    for i in range(10):
        clock.t += 12.0  # 12 s per step: a line at most every 30 s
        prog.update(1, tokens=600, loss=3.0 - 0.1 * i)
    prog.close()
    lines = out.getvalue().splitlines()
    # step 1 (first update), then every >= 30 s: steps 4 (48 s after step 1's 12 s ... ), 7, 10, and nothing doubled
    steps = [int(re.search(r"step (\d+)/10", l).group(1)) for l in lines]
    assert steps == [1, 4, 7, 10]
    assert lines[0] == "[train x] step 1/10 (10.0%) | loss 3 | 50 tok/s | 12s elapsed | ETA 1m48s"
    assert "loss 2.1 | 50 tok/s | 2m00s elapsed" in lines[-1] and "ETA" not in lines[-1]


def test_interval_zero_prints_every_update_and_env_sets_it(monkeypatch):
    out = io.StringIO()
    with Progress(None, "sweep", "run", stream=out, interval=0) as prog:
        prog.update(1, gate="g1")
        prog.update(1, gate="g2")
    assert [l.split(" | ")[:2] for l in out.getvalue().splitlines()] == [["[sweep] run 1", "gate g1"],
                                                                         ["[sweep] run 2", "gate g2"]]
    monkeypatch.setenv("GATTN_PROGRESS_INTERVAL", "7.5")
    assert Progress(3, "x", stream=io.StringIO()).interval == 7.5
    monkeypatch.setenv("GATTN_PROGRESS_INTERVAL", "soon")
    with pytest.raises(ValueError, match="GATTN_PROGRESS_INTERVAL"):
        Progress(3, "x", stream=io.StringIO())


def test_disabled_prints_nothing_and_tty_keeps_the_bar():
    out = io.StringIO()
    with Progress(5, "quiet", stream=out, interval=0, enabled=False) as prog:
        prog.update(1, loss=1.0)
    assert out.getvalue() == ""
    out = io.StringIO()
    with Progress(5, "bar", stream=out, interval=0, tty=True) as prog:
        assert prog.bar is not None
        prog.update(2, tokens=10, loss=1.5)
    text = out.getvalue()
    assert "\rbar:" in text and "|" in text and "[bar]" not in text  # tqdm's redrawn bar, not our lines


def test_heartbeat_prints_during_one_long_unit():
    out = io.StringIO()
    prog = Progress(2, "data prepare", "stage", stream=out, interval=0.05, heartbeat=True)
    prog.update(1, stage="tokenizer")
    deadline = time.monotonic() + 5.0
    while out.getvalue().count("\n") < 3 and time.monotonic() < deadline:
        time.sleep(0.02)  # one long stage: the heartbeat keeps the log alive
    prog.close()
    lines = out.getvalue().splitlines()
    assert len(lines) >= 3 and all(l.startswith("[data prepare] stage 1/2 (50.0%) | stage tokenizer") for l in lines[:3])
    assert not prog._thread.is_alive()


def test_format_duration():
    assert [format_duration(s) for s in (0, 59.4, 61, 3600 + 62)] == ["0s", "59s", "1m01s", "1h01m02s"]


def test_gattn_train_prints_progress_lines_when_stderr_is_a_pipe(tmp_path):
    res = run_gattn("train", "--preset", "tiny", "--out", tmp_path / "run", "--set", "steps=4", "--set",
                    "progress=true", "--set", "stats_every=0", "--set", "ckpt_every=0",
                    env={"GATTN_PROGRESS_INTERVAL": "0", "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-2000:]
    lines = [l for l in res.stderr.splitlines() if l.startswith("[train run] ")]
    assert [re.search(r"step (\d)/4", l).group(1) for l in lines] == ["1", "2", "3", "4"]
    assert all(re.search(r"\| loss \d+\.\d+ \| [\d,]+ tok/s \| \d+s elapsed", l) for l in lines)
    assert "ETA" in lines[0] and "\r" not in res.stderr
