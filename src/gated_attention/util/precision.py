"""Training numerics chosen by the hardware: `precision="auto"` resolves to bf16 autocast only where bf16 is fast.

Why measure instead of reading CPU flags: on a CPU with native bf16 instructions (AMX, AVX512-BF16) a bf16 GEMM runs
about 2x faster than fp32, but on an AVX2-only CPU PyTorch emulates it and it runs 12-60x *slower* (measured: 236 ms
vs 3.9 ms for a 512x512 matmul on one thread of an AMD EPYC without AVX512-BF16). Names and flags do not say which
kernel oneDNN/MKL will pick for this torch build, so `bf16_speedup()` times it: a short 512x512 GEMM under CPU
autocast (fp32 inputs, as a training step runs it) against the same GEMM in fp32, best of a few interleaved calls,
on one thread, ~0.3 s on a bf16-capable CPU and ~1 s without. The answer is cached per process.

    resolve("auto", device) -> "bf16" | "fp32"
        CUDA: bf16 where torch.cuda.is_bf16_supported(); CPU: bf16 iff the measured speed-up >= BF16_MIN_SPEEDUP
        (autocast also adds casts around every GEMM, so a GEMM that is only marginally faster does not make a faster
        step); any other device: fp32.
    resolve("bf16" | "fp32", device) -> the forced choice; forcing bf16 on a CPU where it is slow prints one warning
        line with the measured ratio (once per process).
    autocast(resolved, device) -> the autocast context for a resolved precision (a no-op for fp32).

`GATTN_BF16_SPEEDUP=<float>` replaces the measurement (a known machine; tests fake both kinds of CPU with it).
Every job records the outcome as `resolved_precision` (summary.json, lab.json's config, bench JSON) and keys its
caches on it, so a bf16 result is never reused as an fp32 one. fp16 is refused: CPU fp16 matmuls are ~1000x slower
and training in fp16 needs loss scaling, which the trainer does not do.
"""
from __future__ import annotations

import os
import sys
import time
from contextlib import nullcontext

import torch

PRECISIONS = ("auto", "bf16", "fp32")  # what a user may ask for
BF16_MIN_SPEEDUP = 1.25  # CPU: bf16 GEMM must beat fp32 by this factor for auto to pick it (casts cost the rest)
_GEMM_N = 512  # big enough that the GEMM, not call overhead, is timed; small enough that emulated bf16 takes < 1 s
_cache: dict[str, float] = {}  # device type -> measured speed-up (once per process)
_warned: set[str] = set()  # one warning per process


def check(precision: str, what: str = "precision") -> str:
    """`precision` if it is one of PRECISIONS, else a ValueError naming the choices (fp16 with its reason)."""
    if precision == "fp16":
        raise ValueError(f"{what}='fp16' is not supported (CPU fp16 matmuls are ~1000x slower, and fp16 training "
                         "needs loss scaling); use 'auto', 'bf16' or 'fp32'")
    if precision not in PRECISIONS:
        raise ValueError(f"{what}={precision!r}; use one of {', '.join(PRECISIONS)}")
    return precision


def _device(device) -> torch.device:
    if device is None or (isinstance(device, str) and device == "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _time_gemm(a: torch.Tensor, b: torch.Tensor, bf16: bool) -> float:
    t0 = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        a @ b
    return time.perf_counter() - t0


def _measure_cpu_speedup() -> float:
    """fp32 time / bf16-autocast time of a 512x512 GEMM, best of interleaved calls (> 1: bf16 is faster).

    Timed on one thread: a multi-threaded GEMM on a loaded machine waits for its slowest thread, so one preempted
    thread can make either side look many times slower; the per-thread kernel is what decides the ratio."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(_GEMM_N, _GEMM_N, generator=g)
    b = torch.randn(_GEMM_N, _GEMM_N, generator=g)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _time_gemm(a, b, False), _time_gemm(a, b, True)  # warm-up: kernel selection, packing buffers
        fp32, bf16 = [], []
        deadline = time.perf_counter() + 0.3
        while len(bf16) < 3 or (len(bf16) < 20 and time.perf_counter() < deadline):
            fp32.append(_time_gemm(a, b, False))
            bf16.append(_time_gemm(a, b, True))
    finally:
        torch.set_num_threads(threads)
    return min(fp32) / min(bf16)


def bf16_speedup(device=None) -> float | None:
    """Measured fp32/bf16 GEMM time ratio on `device` (cached per process); None where it is not measured (CUDA)."""
    dev = _device(device)
    if dev.type != "cpu":
        return None
    env = os.environ.get("GATTN_BF16_SPEEDUP")
    if env:
        try:
            value = float(env)
        except ValueError:
            raise ValueError(f"GATTN_BF16_SPEEDUP={env!r} must be a number (fp32 time / bf16 time; e.g. 2.0 or "
                             "0.02); unset it to measure") from None
        if not value > 0:
            raise ValueError(f"GATTN_BF16_SPEEDUP={env!r} must be > 0; unset it to measure")
        return value
    if dev.type not in _cache:
        _cache[dev.type] = _measure_cpu_speedup()
    return _cache[dev.type]


def shared_measurement() -> float | None:
    """This process's measured CPU bf16 speed-up, if it has measured one (else None): a job hands it to its worker
    processes (experiment.run_units), so every model of one job resolves "auto" alike, whatever the load on the
    core each worker happens to time its GEMM on."""
    return _cache.get("cpu")


def adopt_measurement(ratio: float | None) -> None:
    """Use a parent process's measurement (shared_measurement) instead of timing again; None leaves this one alone."""
    if ratio is not None:
        _cache["cpu"] = float(ratio)


def resolve(precision: str = "auto", device=None) -> str:
    """'bf16' or 'fp32' for a requested precision on `device` (None/'auto': cuda if present, else cpu)."""
    check(precision)
    dev = _device(device)
    if precision == "fp32":
        return "fp32"
    if precision == "bf16":
        if dev.type == "cpu":
            ratio = bf16_speedup(dev)
            if ratio < 1.0 and dev.type not in _warned:
                _warned.add(dev.type)
                print(f"gattn: warning: precision=bf16 is forced, but on this CPU a bf16 matmul runs at {ratio:.2f}x "
                      f"the fp32 speed ({1 / ratio:.0f}x slower: no native bf16 instructions); use precision=auto or "
                      "fp32", file=sys.stderr, flush=True)
        return "bf16"
    if dev.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp32"
    if dev.type == "cpu":
        return "bf16" if bf16_speedup(dev) >= BF16_MIN_SPEEDUP else "fp32"
    return "fp32"


def describe(precision: str = "auto", device=None) -> str:
    """One log line: what was asked, what it resolved to, and why (the measured ratio on a CPU)."""
    dev = _device(device)
    resolved = resolve(precision, dev)
    why = ""
    if dev.type == "cpu" and precision != "fp32":
        ratio = bf16_speedup(dev)
        src = "GATTN_BF16_SPEEDUP" if os.environ.get("GATTN_BF16_SPEEDUP") else "measured"
        why = f" (bf16 matmul {ratio:.2f}x the fp32 speed on this CPU, {src})"
    elif dev.type == "cuda" and precision == "auto":
        why = " (CUDA bf16 support)" if resolved == "bf16" else " (no CUDA bf16 support)"
    return f"precision {precision} -> {resolved}{why}"


def autocast(resolved: str, device=None):
    """The autocast context of a precision ('auto' is resolved first): bf16 autocast, or a no-op for fp32."""
    dev = _device(device)
    if resolved == "auto":
        resolved = resolve(resolved, dev)
    if check(resolved) == "bf16":
        return torch.autocast(device_type=dev.type, dtype=torch.bfloat16)
    return nullcontext()


def dtype_of(resolved: str) -> torch.dtype:
    """torch dtype of a resolved precision (weights of a bench or an inference run)."""
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[resolved]
