"""Peak resident memory of a block of code, measured by the kernel (Linux /proc), for the tests of memory properties.

`ru_maxrss` is a high-water mark since the process started: after an earlier, larger peak (an import, a previous
test) a block's growth reads 0 whatever it allocates. Here the mark is reset first (writing 5 to
/proc/self/clear_refs resets VmHWM to the current RSS, Linux >= 4.0), so `peak - before` is what the block itself
added at its highest point: tensors, file pages it touched (a memory-mapped safetensors read), allocator slack.

    start = reset_peak()          # bytes resident now, and the mark reset to it
    ...                           # the block
    grown = peak_bytes() - start  # its own peak growth

`run_peak(setup, body)` runs `setup` then `body` in a fresh Python process (nothing of this process's history in
the measurement) and returns body's peak growth in bytes and what body left in a dict named `out`.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024  # kB
    raise RuntimeError(f"/proc/self/status has no {field}")


def available() -> bool:
    """Whether this kernel lets a process reset its own peak RSS (Linux)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def reset_peak() -> int:
    """Reset this process's peak RSS to its current RSS; returns that RSS in bytes."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status("VmRSS")


def peak_bytes() -> int:
    """This process's peak RSS (bytes) since the last reset_peak()."""
    return _status("VmHWM")


def need_probe() -> None:
    """Skip where the peak cannot be reset (not Linux): the measurement would read an old high-water mark."""
    if not available():
        pytest.skip("needs Linux /proc/self/clear_refs to reset the peak RSS")


def run_peak(setup: str, body: str, env: dict | None = None, timeout: int = 600) -> dict:
    """Run `setup`, reset the peak, run `body`, in a fresh interpreter; returns {"grown": body's peak RSS growth in
    bytes, **out} where `out` is a dict body may fill."""
    need_probe()
    code = "\n".join([
        "import json, sys", f"sys.path.insert(0, {str(Path(__file__).parent)!r})", "import memprobe",
        textwrap.dedent(setup), "out = {}", "start = memprobe.reset_peak()",
        textwrap.dedent(body), "out['grown'] = memprobe.peak_bytes() - start", "print('MEMPROBE ' + json.dumps(out))"])
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    assert p.returncode == 0, p.stderr[-3000:]
    line = [l for l in p.stdout.splitlines() if l.startswith("MEMPROBE ")][-1]
    return json.loads(line[len("MEMPROBE "):])
