"""Shared helpers of the benchmark scripts: interleaved timing with medians, machine facts, the precision the
workload runs in, atomic JSON/markdown.

Absolute times on a shared CPU are noise; every script times the things it compares round-robin in ONE process
(rep 1 of A, B, C, then rep 2 of A, B, C, ...) and reports medians and their ratios, so a slow spell hits all alike.

Precision: every bench takes `--precision auto|bf16|fp32` (default auto, as the product: bf16 autocast only where this
CPU runs bf16 GEMMs fast, gated_attention.util.precision), resolves it once (`precision_arg` / `resolve_precision`), runs
its workload in it, times the in-run GEMM peak in the same precision (`matmul_peak_fn`), and writes
`resolved_precision` into its result JSON; `machine()` records the CPU's ISA flags and the measured bf16/fp32 GEMM
ratio beside it, so a figure is never read without the numerics and the CPU kind it was measured on.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parent
# where results/<name>.json go: bench/results, or BENCH_RESULTS (run_all.py --results DIR: e.g. a forced-fp32 run kept
# apart from the auto one)
RESULTS = Path(os.environ["BENCH_RESULTS"]).resolve() if os.environ.get("BENCH_RESULTS") else ROOT / "results"
sys.path.insert(0, str(ROOT.parent / "src"))  # run from a checkout without installing


def clock() -> Callable[[], float]:
    """The timer: wall time, or with BENCH_CLOCK=cpu the process's CPU time. On a machine loaded far above its core
    count (8 engineers on 2 cores: load 15+) wall time mostly measures waiting for a core and its repetitions spread
    by 2x; CPU time of a --threads 1 run measures the work itself (memory-bandwidth contention remains)."""
    return time.process_time if os.environ.get("BENCH_CLOCK", "wall") == "cpu" else time.perf_counter


def interleaved(fns: dict[str, Callable[[], None]], reps: int, warmup: int = 1,
                log: Callable[[str], None] | None = print) -> dict[str, list[float]]:
    """Seconds per call of each fn, `reps` round-robin rounds after `warmup` rounds (warmup also triggers compiles).
    Timed with `clock()` (wall, or CPU time under BENCH_CLOCK=cpu)."""
    now = clock()
    for w in range(warmup):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            if log:
                log(f"  warmup {w + 1}/{warmup} {name}: {time.perf_counter() - t:.2f}s")
    times: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(reps):
        order = list(fns) if r % 2 == 0 else list(reversed(fns))  # alternate order: no fixed neighbour bias
        for name in order:
            t = now()
            fns[name]()
            times[name].append(now() - t)
        if log:
            log(f"  rep {r + 1}/{reps}: " + ", ".join(f"{n}={times[n][-1]:.3f}s" for n in fns))
    return times


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def rel_spread(xs: list[float]) -> float:
    """Interquartile range over the median: how noisy one timing's repetitions were (0.05 = +-2.5 %)."""
    if len(xs) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return (q3 - q1) / statistics.median(xs)


# the product's choices (gated_attention.util.precision) less bf16-params: the workloads cast weights per GEMM
# (autocast), not the parameters
PRECISIONS = ("auto", "bf16", "fp32")


def precision_arg(ap, what: str = "numerics of the workload", note: str = "; the in-run GEMM peak is timed in the "
                  "same precision; the result JSON records resolved_precision") -> None:
    """Add the one `--precision` option (util.precision.add_argument, the CLI's) to a bench's argument parser."""
    from gated_attention.util import precision as P

    P.add_argument(ap, default="auto", what=what, note=note, choices=PRECISIONS)


def resolve_precision(asked: str, device="cpu") -> str:
    """'bf16' | 'fp32' for the bench's --precision (the bench's one decision), with the product's log line (what and
    why) printed once."""
    from gated_attention.util import precision as P

    resolved, line = P.decide(asked, device)
    print(f"bench: {line}", flush=True)
    return resolved


def autocast(resolved: str, device="cpu"):
    """The workload's autocast context: bf16 autocast, or a no-op for fp32 (what the trainer uses)."""
    from gated_attention.util import precision as P

    return P.numerics(resolved, device)


def matmul_peak_fn(n: int = 2048, precision: str = "bf16") -> tuple[Callable[[], None], float]:
    """A square GEMM in `precision` ('bf16' | 'fp32': the workload's) to time next to the workload; returns (fn, flops
    per call). Peak = best FLOP/s observed. Under bf16 autocast a training step's GEMMs run on bf16 operands, so the
    bf16 GEMM is its peak; in fp32 the fp32 GEMM is (on a CPU without native bf16 the bf16 GEMM is emulated and far
    slower, so a bf16 peak would flatter an fp32 run by 10x or more)."""
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[precision]
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    iters = 4

    def fn():
        for _ in range(iters):
            torch.mm(a, b)

    return fn, 2.0 * n ** 3 * iters


def machine() -> dict:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
            f.seek(0)
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    isa = cpu_isa(flags)
    import transformers

    from gated_attention.util import precision as P

    return {"cpu": cpu, "isa": isa, "cpu_kind": cpu_kind(isa), "bf16_gemm_speedup": P.bf16_speedup("cpu"),
            "arch": platform.machine(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
            "load_avg": os.getloadavg(), "clock": os.environ.get("BENCH_CLOCK", "wall"), "utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
            "commit": _commit()}


def _commit() -> str | None:
    """The checkout's commit (with "+dirty" when it has uncommitted changes), so a result names the code it timed."""
    import subprocess

    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (head + ("+dirty" if dirty else "")) or None


ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16")  # /proc/cpuinfo names


def cpu_isa(flags_line: str) -> list[str]:
    """The ISA flags of a /proc/cpuinfo "flags" line that decide GEMM speed per precision (in ISA_FLAGS order)."""
    have = set(flags_line.split(":", 1)[-1].split())
    return [x for x in ISA_FLAGS if x in have]


def cpu_kind(isa: list[str]) -> str:
    """The CPU kinds the project's figures are stated for: native bf16 GEMMs (AMX or AVX512-BF16) or not."""
    if "amx_bf16" in isa:
        return "AMX-BF16"
    if "avx512_bf16" in isa:
        return "AVX512-BF16"
    if "avx512f" in isa:
        return "AVX-512 without BF16"
    return "AVX2" if "avx2" in isa else "other"


def write_json(name: str, obj) -> Path:
    """Atomic write of bench/results/<name>.json, or of `name` itself when it is a path (holds a "/" or ends in
    .json); a crash never leaves a half-written result."""
    path = Path(name) if "/" in name or name.endswith(".json") else RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f, indent=1)
    os.chmod(tmp, 0o644)  # mkstemp makes 0600; results are for everyone to read
    os.replace(tmp, path)
    return path


def write_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def md_table(rows: list[dict], cols: list[str]) -> str:
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(_fmt(r.get(c, "")) for c in cols) + " |")
    return "\n".join(out)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)
