"""Training numerics chosen by the hardware, and the one definition of the precision choices.

The choices (PRECISIONS; every parser takes them from `add_argument`):
  fp32         fp32 parameters and compute.
  bf16         bf16 autocast: fp32 parameters and residual stream, bf16 matmul inputs and outputs (CPU or CUDA autocast).
  bf16-params  what clusters train in (Megatron's --bf16, FSDP2's MixedPrecisionPolicy): bf16 parameters and
               activations in forward and backward, so the residual stream itself is bf16 and an update smaller than
               half a bf16 ulp of the value it is added to is lost; fp32 master weights, gradient reduction/accumulation
               and optimizer state (train/mixed_precision.py in one process; FSDP2's policy under dist=fsdp).
  auto         CUDA with bf16: bf16-params under dist=fsdp, bf16 autocast otherwise; CPU: bf16 autocast iff a measured
               bf16 GEMM beats fp32 by BF16_MIN_SPEEDUP, else fp32; anything else fp32.

Why measure instead of reading CPU flags: on a CPU with native bf16 instructions (AMX, AVX512-BF16) a bf16 GEMM runs
about 2x faster than fp32, but on an AVX2-only CPU PyTorch's kernel runs 12-60x *slower* (measured: 204-236 ms vs
3.8 ms for a 512x512 matmul on one thread of an AMD EPYC without AVX512-BF16). Names and flags do not say which
kernel oneDNN/MKL will pick for this torch build, so `bf16_speedup()` times it: a short 512x512 GEMM under CPU
autocast (fp32 inputs, as a training step runs it) against the same GEMM in fp32, best of a few interleaved calls,
on one thread, ~0.3 s on a bf16-capable CPU and ~1 s without. The answer is cached per process.

bf16 where it is slow: a forced bf16 / bf16-params run on such a CPU computes its bf16 GEMMs as fp32 GEMMs of the
bf16 values, rounded to bf16 (util/bf16_emulation.py: the same numerics up to summation order, at ~1.1x the fp32
cost), so bf16 numerics can be studied on any CPU. `gemm_mode(device)` says which ("native" | "emulated");
`GATTN_BF16_GEMM=native|emulated` forces it. `numerics(resolved, device)` is the one context a forward (and backward)
runs in: autocast for "bf16", the emulation where the GEMMs are emulated, nothing for fp32.

`GATTN_BF16_SPEEDUP=<float>` replaces the measurement (a known machine; tests fake both kinds of CPU with it).
`decide(precision, device, dist)` is a command's one decision (the resolved precision and its log line), made where
the run is configured and passed down: the trainer, the labs' units and the worker processes take it as it is.
Every job records the outcome as `resolved_precision` (summary.json, lab.json's config, bench JSON) and keys its
caches on it, so a bf16 result is never reused as an fp32 one. fp16 is refused: CPU fp16 matmuls are ~1000x slower
and training in fp16 needs loss scaling, which the trainer does not do.
"""
from __future__ import annotations

import os
import sys
import time
from contextlib import ExitStack, nullcontext

# torch is imported inside the functions that compute: `add_argument` and `check` serve argparse tables, which the
# `gattn` command builds without torch (its --help answers at once)

PRECISIONS = ("auto", "bf16", "bf16-params", "fp32")  # what a user may ask for
RESOLVED = ("bf16", "bf16-params", "fp32")  # what a run computes in (resolved_precision)
GEMM_MODES = ("native", "emulated")
BF16_MIN_SPEEDUP = 1.25  # CPU: bf16 GEMM must beat fp32 by this factor for auto to pick it (casts cost the rest)
_GEMM_N = 512  # big enough that the GEMM, not call overhead, is timed; small enough that emulated bf16 takes < 1 s
_cache: dict[str, float] = {}  # device type -> measured speed-up (once per process)
_warned: set[str] = set()  # one warning per process


def check(precision: str, what: str = "precision") -> str:
    """`precision` if it is one of PRECISIONS, else a ValueError naming the choices (fp16 with its reason)."""
    if precision == "fp16":
        raise ValueError(f"{what}='fp16' is not supported (CPU fp16 matmuls are ~1000x slower, and fp16 training "
                         f"needs loss scaling); use one of {', '.join(PRECISIONS)}")
    if precision not in PRECISIONS:
        raise ValueError(f"{what}={precision!r}; use one of {', '.join(PRECISIONS)}")
    return precision


def _device(device) -> torch.device:
    import torch

    if device is None or (isinstance(device, str) and device == "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def device_type(device=None) -> str:
    """"cpu", "cuda", ... of a device setting ("auto"/None: cuda if present, else cpu): decisions are per device."""
    return _device(device).type


def _time_gemm(a: torch.Tensor, b: torch.Tensor, bf16: bool) -> float:
    import torch

    t0 = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        a @ b
    return time.perf_counter() - t0


def _measure_cpu_speedup() -> float:
    """fp32 time / bf16-autocast time of a 512x512 GEMM, best of interleaved calls (> 1: bf16 is faster).

    Timed on one thread: a multi-threaded GEMM on a loaded machine waits for its slowest thread, so one preempted
    thread can make either side look many times slower; the per-thread kernel is what decides the ratio."""
    import torch

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


def gemm_mode(device=None) -> str:
    """'native' or 'emulated': how bf16 GEMMs run on `device` (CPU: emulated where a native bf16 GEMM is slower than
    fp32; GATTN_BF16_GEMM overrides). CUDA and other devices: native."""
    dev = _device(device)
    env = os.environ.get("GATTN_BF16_GEMM")
    if env:
        if env not in GEMM_MODES:
            raise ValueError(f"GATTN_BF16_GEMM={env!r}; use one of {', '.join(GEMM_MODES)}, or unset it")
        return env if dev.type == "cpu" else "native"
    if dev.type != "cpu":
        return "native"
    return "emulated" if bf16_speedup(dev) < 1.0 else "native"


def resolve(precision: str = "auto", device=None, dist: str = "none") -> str:
    """'bf16', 'bf16-params' or 'fp32' for a requested precision on `device` (None/'auto': cuda if present, else
    cpu); `dist` is the run's distribution mode ("none", "ddp", "fsdp"): auto on CUDA picks bf16-params under fsdp."""
    check(precision)
    dev = _device(device)
    if precision in RESOLVED:
        if precision != "fp32" and dev.type == "cpu":
            _warn_if_slow(precision, dev)
        return precision
    if dev.type == "cuda":
        import torch

        if not torch.cuda.is_bf16_supported():
            return "fp32"
        return "bf16-params" if dist == "fsdp" else "bf16"
    if dev.type == "cpu":
        return "bf16" if bf16_speedup(dev) >= BF16_MIN_SPEEDUP else "fp32"
    return "fp32"


def _warn_if_slow(precision: str, dev: torch.device) -> None:
    """Forced bf16 on a CPU without bf16 units: one line per process saying what it costs."""
    ratio = bf16_speedup(dev)
    if ratio >= 1.0 or dev.type in _warned:
        return
    _warned.add(dev.type)
    if gemm_mode(dev) == "emulated":
        print(f"gattn: precision={precision}: this CPU runs a bf16 matmul at {ratio:.2f}x the fp32 speed (no native "
              "bf16 instructions), so bf16 GEMMs are emulated (fp32 GEMMs of bf16 values, rounded to bf16: the same "
              "numerics at about the fp32 cost)", file=sys.stderr, flush=True)
    else:
        print(f"gattn: warning: precision={precision} is forced, but on this CPU a bf16 matmul runs at {ratio:.2f}x "
              f"the fp32 speed ({1 / ratio:.0f}x slower: no native bf16 instructions) and GATTN_BF16_GEMM=native "
              "keeps it; unset GATTN_BF16_GEMM to emulate, or use precision=auto or fp32", file=sys.stderr, flush=True)


def decide(precision: str = "auto", device=None, dist: str = "none") -> tuple[str, str]:
    """The one precision decision of a command, made where its run is configured: (the resolved precision, one log
    line saying what was asked, what it resolved to and why). The command passes the resolved value down (to the
    trainer, its units, its worker processes), and the layers below accept it as it is, so a process decides once."""
    dev = _device(device)
    resolved = resolve(precision, dev, dist)
    why = ""
    if dev.type == "cpu" and precision != "fp32":
        ratio = bf16_speedup(dev)
        src = "GATTN_BF16_SPEEDUP" if os.environ.get("GATTN_BF16_SPEEDUP") else "measured"
        why = f" (bf16 matmul {ratio:.2f}x the fp32 speed on this CPU, {src})"
        if resolved != "fp32" and gemm_mode(dev) == "emulated":
            why += "; bf16 GEMMs emulated"
    elif dev.type == "cuda" and precision == "auto":
        why = " (CUDA bf16 support)" if resolved != "fp32" else " (no CUDA bf16 support)"
    return resolved, f"precision {precision} -> {resolved}{why}"


def check_resolved(resolved: str, what: str = "resolved precision") -> str:
    """`resolved` if it is a decided precision (one of RESOLVED): what a layer handed a decision accepts as it is."""
    if resolved not in RESOLVED:
        raise ValueError(f"{what}={resolved!r} is not a decided precision (one of {', '.join(RESOLVED)}); decide "
                         "it once with util.precision.decide where the run is configured")
    return resolved


def numerics(resolved: str, device=None):
    """The context a forward (and its backward) runs in for a resolved precision ('auto' is resolved first): bf16
    autocast for "bf16", nothing for "fp32" and "bf16-params" (its parameters are bf16 themselves), plus the bf16
    GEMM emulation wherever bf16 GEMMs happen on a CPU without bf16 units."""
    import torch

    dev = _device(device)
    if resolved == "auto":
        resolved = resolve(resolved, dev)
    if check(resolved) == "fp32":
        return nullcontext()
    stack = ExitStack()
    if resolved == "bf16":
        stack.enter_context(torch.autocast(device_type=dev.type, dtype=torch.bfloat16))
    if gemm_mode(dev) == "emulated":
        from .bf16_emulation import emulated_bf16

        stack.enter_context(emulated_bf16())
    return stack


def param_dtype(resolved: str) -> torch.dtype:
    """The dtype a run's compute parameters are in: bf16 for "bf16-params", else fp32 (autocast casts per GEMM)."""
    import torch

    return torch.bfloat16 if check(resolved) == "bf16-params" else torch.float32


# what each choice means, in every parser's help
_CHOICE_HELP = {
    "auto": "bf16 autocast where this CPU runs a measured bf16 GEMM faster than fp32 (on CUDA: bf16, or bf16-params "
            "under dist=fsdp), else fp32",
    "bf16": "autocast (fp32 weights and residual stream, bf16 matmuls)",
    "bf16-params": "bf16 weights and activations with fp32 master weights and optimizer state",
    "fp32": "fp32 throughout",
}


def add_argument(parser, *, default: str | None = "auto", flag: str = "--precision", what: str = "training numerics",
                 note: str = "", choices: tuple[str, ...] = PRECISIONS) -> None:
    """The one `--precision` option of every parser (the CLI's and the benches'): the choices and what each means.
    choices: a subset of PRECISIONS, in their order, for a tool that cannot run them all (a bench workload that
    autocasts has no bf16-params)."""
    choices, text = option_help(default, what, note, choices)
    parser.add_argument(flag, choices=choices, default=default, help=text)


def option_help(default: str | None = "auto", what: str = "training numerics", note: str = "",
                choices: tuple[str, ...] = PRECISIONS) -> tuple[tuple[str, ...], str]:
    """(choices in PRECISIONS' order, help text) of the `--precision` option (add_argument)."""
    bad = [c for c in choices if c not in PRECISIONS]
    if bad or not choices:
        raise ValueError(f"precision choices {list(choices)}: each must be one of {', '.join(PRECISIONS)}")
    choices = tuple(c for c in PRECISIONS if c in choices)
    shown = f"default {default}" if default is not None else "default: the job's own setting"
    return choices, (f"{what} ({shown}): " + "; ".join(f"{c} = {_CHOICE_HELP[c]}" for c in choices)
                     + ". bf16 GEMMs are emulated (same numerics, ~fp32 speed) on CPUs without bf16 instructions" + note)


def dtype_of(resolved: str) -> torch.dtype:
    """torch dtype of a resolved precision (weights of a bench or an inference run)."""
    import torch

    return {"bf16": torch.bfloat16, "bf16-params": torch.bfloat16, "fp32": torch.float32}[check(resolved)]
