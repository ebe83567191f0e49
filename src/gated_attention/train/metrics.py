"""The numbers a scale user watches per logged step (memory, TFLOP/s, MFU) and torch.profiler traces on request.

Each log.jsonl line (and TensorBoard scalar) gains, next to `tokens_per_s`:
  mem_allocated_gb, mem_reserved_gb, mem_peak_gb, mem_peak_reserved_gb   CUDA: the caching allocator's allocated /
                   reserved bytes now and the peaks allocated / reserved since the previous log line (both read, then
                   reset, by the line: a reader of torch.cuda.max_memory_* after it sees only what came later); max
                   over ranks
  rss_gb, rss_peak_gb   CPU: the process's resident set now and its high-water mark since it started (/proc VmRSS,
                   VmHWM; resource.getrusage elsewhere); max over ranks
  tflops           achieved MODEL TFLOP/s per device: tokens_per_s x flops_per_token / world size, where
                   flops_per_token is the planner's count (train/plan.py: 6 x activated matmul parameters + causal
                   attention; activation-checkpointing recompute not counted, as MFU conventionally does not)
  mfu              tflops / the device's peak: on a GPU the nominal dense peak of a small table keyed by the device
                   name and the compute dtype (bf16, tf32 where fp32 matmuls may use TF32, fp32); on a CPU measured
                   once per process by a short GEMM in the compute dtype at the run's thread count (so MFU on a CPU
                   is against what this machine's GEMM achieves, not a datasheet); `--set peak_tflops=X` overrides
                   both. Absent where the peak is unknown (a GPU not in the table) or the model is not this
                   project's LM (a stand-in without a config).
Communication time is not in every line: FSDP2 and DDP overlap their collectives with compute on side streams, so
no per-step figure is both cheap and honest. `--set profile_steps=A-B` records steps A..B (log.jsonl step numbers,
inclusive) with torch.profiler on every rank and writes OUT/profile/rank<r>/trace.json (chrome://tracing, Perfetto)
and summary.json, whose `comm_s_per_step` is the time in collective kernels (CUDA: NCCL kernels' device time) or
collective ops (CPU: the ops' own CPU time, which misses gloo's background threads: a lower bound); the log line of
step B carries it as `comm_s`. The measured peak, its source and flops_per_token go into summary.json
("throughput").
"""
from __future__ import annotations

import json
import re
import time
from functools import lru_cache
from pathlib import Path

import torch

from .config import parse_profile_steps  # the setting's parser lives with its checks

GB = 1e9
# Nominal dense peaks in TFLOP/s (vendor datasheets, no sparsity), matched as substrings of
# torch.cuda.get_device_name in this order (more specific names first)
GPU_PEAK_TFLOPS = (
    ("H100 PCIe", {"bf16": 756.0, "tf32": 378.0, "fp32": 51.2}),
    ("H100", {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9}),  # SXM ("NVIDIA H100 80GB HBM3")
    ("H200", {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9}),  # the H100 SXM's compute with more memory
    ("A100", {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("L40S", {"bf16": 362.1, "tf32": 183.0, "fp32": 91.6}),
    ("L4", {"bf16": 121.0, "tf32": 60.0, "fp32": 30.3}),
)
_COLLECTIVE = re.compile(r"c10d::|nccl|gloo", re.IGNORECASE)  # the process group's ops and NCCL's kernels (not
# FSDP's own ranges around them, which include its copies in and out)


# ---------------------------------------------------------------- memory

def rss_bytes() -> tuple[int, int]:
    """(current, peak) resident set size of this process in bytes. The kernel folds per-thread RSS counts into VmHWM
    lazily, so the peak can trail the current figure by a little: it is reported as at least the current one."""
    try:
        with open("/proc/self/status") as fh:
            fields = dict(line.split(":", 1) for line in fh if ":" in line)
        cur, hwm = int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024
        return cur, max(cur, hwm)
    except (OSError, KeyError, ValueError):
        import resource
        import sys

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
        return peak, peak  # no current figure without /proc: the peak stands in for both


def memory_record(device: torch.device) -> dict:
    """This process's memory figures for one log line (see the module docstring); resets the CUDA peak."""
    if device.type == "cuda":
        rec = {"mem_allocated_gb": torch.cuda.memory_allocated(device) / GB,
               "mem_reserved_gb": torch.cuda.memory_reserved(device) / GB,
               "mem_peak_gb": torch.cuda.max_memory_allocated(device) / GB,
               "mem_peak_reserved_gb": torch.cuda.max_memory_reserved(device) / GB}
        torch.cuda.reset_peak_memory_stats(device)
        return rec
    cur, peak = rss_bytes()
    return {"rss_gb": cur / GB, "rss_peak_gb": peak / GB}


# ---------------------------------------------------------------- FLOPs and the device peak

def model_flops_per_token(model, seq_len: int) -> int | None:
    """The planner's model FLOPs per training token of `model` (plan.sizes + plan.flops_per_token), or None for a
    model that is not this project's LM (no config / decoder layers)."""
    from .plan import flops_per_token, sizes

    if not hasattr(getattr(model, "config", None), "num_hidden_layers") or not hasattr(getattr(model, "model", None),
                                                                                       "layers"):
        return None
    return int(flops_per_token(model.config, sizes(model)["matmul_activated"], seq_len)["model"])


def _tf32_allowed() -> bool:
    return bool(torch.backends.cuda.matmul.allow_tf32) or torch.get_float32_matmul_precision() != "highest"


def compute_kind(device: torch.device, precision: str) -> str:
    """The dtype the matmuls run in: bf16, tf32 (fp32 on a GPU that allows TF32 matmuls) or fp32."""
    if precision in ("bf16", "bf16-params"):
        return "bf16"
    if device.type == "cuda" and _tf32_allowed():
        return "tf32"
    return "fp32"


@lru_cache(maxsize=None)
def measured_cpu_tflops(kind: str, threads: int, n: int = 512, seconds: float = 0.2) -> float:
    """The best TFLOP/s of an n x n GEMM in `kind` over ~`seconds` on this CPU (once per process and setting)."""
    dtype = torch.bfloat16 if kind == "bf16" else torch.float32
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=g).to(dtype), torch.randn(n, n, generator=g).to(dtype)
    torch.mm(a, b)  # warm-up: the first call picks kernels and touches memory
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = max(best, 2 * n ** 3 / max(time.perf_counter() - t0, 1e-9))
    return best / 1e12


def device_peak_tflops(device: torch.device, precision: str, override: float = 0.0) -> tuple[float | None, str]:
    """(peak TFLOP/s of one device for this run's compute dtype or None, where the figure comes from)."""
    kind = compute_kind(device, precision)
    if override > 0:
        return float(override), "set (peak_tflops)"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peaks in GPU_PEAK_TFLOPS:
            if key in name:
                return peaks[kind], f"nominal {key} {kind} dense"
        return None, f"unknown GPU {name!r}: --set peak_tflops=X to report MFU"
    threads = torch.get_num_threads()
    if kind == "bf16":
        from ..util.precision import gemm_mode

        if gemm_mode(device) == "emulated":  # bf16 GEMMs run as fp32 GEMMs here (util/bf16_emulation.py)
            return (measured_cpu_tflops("fp32", threads),
                    f"measured fp32 512x512 GEMM (bf16 emulated), {threads} thread(s)")
    return measured_cpu_tflops(kind, threads), f"measured {kind} 512x512 GEMM, {threads} thread(s)"


def achieved_tflops(tokens_per_s: float, flops_per_token: float, world_size: int) -> float:
    """Model TFLOP/s one device achieves when the run as a whole processes tokens_per_s."""
    return tokens_per_s * flops_per_token / max(world_size, 1) / 1e12


# ---------------------------------------------------------------- the profiler

def comm_seconds(prof, device: torch.device) -> float:
    """Seconds in collectives over the profiled window: the self time (no double counting of nested ops) of events
    whose name is a collective's, on the device for CUDA (NCCL kernels), else on the CPU."""
    total_us = 0.0
    for ev in prof.key_averages():
        if _COLLECTIVE.search(ev.key):
            total_us += (getattr(ev, "self_device_time_total", 0.0) if device.type == "cuda"
                         else ev.self_cpu_time_total)
    return total_us / 1e6


class StepProfiler:
    """torch.profiler over log steps [first, last] of this rank, written under OUT/profile/rank<r>/."""

    def __init__(self, steps: tuple[int, int], out: Path, rank: int, device: torch.device):
        self.first, self.last = steps
        self.dir, self.device, self.prof = out / "profile" / f"rank{rank}", device, None
        self.started = self.seen = None  # the first and the latest step recorded

    def before(self, step: int) -> None:
        """Called before step `step` runs: start when it is in the window and nothing is recording."""
        if self.prof is None and self.first <= step <= self.last:
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self.prof = profile(activities=acts)
            self.prof.__enter__()
            self.started = step

    def after(self, step: int) -> float | None:
        """Called after step `step` was logged: at the window's end, write the trace; returns comm_s per step."""
        if self.prof is not None:
            self.seen = step  # the last step recorded so far
        if self.prof is None or step < self.last:
            return None
        self.prof.__exit__(None, None, None)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.prof.export_chrome_trace(str(self.dir / "trace.json"))
        steps = step - self.started + 1
        comm = comm_seconds(self.prof, self.device) / steps
        top = sorted(self.prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:15]
        summary = {"steps": [self.started, step], "comm_s_per_step": comm, "device": self.device.type,
                   "top_ops_self_cpu_s": {e.key: e.self_cpu_time_total / 1e6 for e in top}}
        (self.dir / "summary.json").write_text(json.dumps(summary, indent=1))
        self.prof = None
        return comm

    def close(self) -> None:
        if self.prof is not None:  # the run ended inside the window (a stop, a divergence): keep what was recorded
            self.last = -1
            self.after(self.seen if self.seen is not None else self.started)


# ---------------------------------------------------------------- the per-run meter

class StepMeter:
    """Adds memory, TFLOP/s and MFU (and comm_s at a profile window's end) to each log record. `record` is called on
    every rank (memory is a max over ranks: a collective); only rank 0's record is written."""

    def __init__(self, *, device: torch.device, world_size: int, flops_per_token: int | None,
                 peak: tuple[float | None, str], profiler: StepProfiler | None = None, reduce_max=None):
        self.device, self.world_size, self.flops_per_token = device, world_size, flops_per_token
        self.peak_tflops, self.peak_source = peak
        self.profiler, self.reduce_max = profiler, reduce_max or (lambda values: values)

    @classmethod
    def for_run(cls, run) -> "StepMeter":
        from . import dist as D

        cfg, info = run.cfg, run.info
        steps = parse_profile_steps(cfg.profile_steps)
        fpt = model_flops_per_token(run.model, cfg.seq_len)
        peak = device_peak_tflops(info.device, run.precision, cfg.peak_tflops) if info.is_main and fpt else \
            (None, "not measured")
        return cls(device=info.device, world_size=info.world_size, flops_per_token=fpt, peak=peak,
                   profiler=StepProfiler(steps, run.out, info.rank, info.device) if steps else None,
                   reduce_max=lambda values: D.reduce_max(values, info))

    def record(self, rec: dict) -> dict:
        mem = memory_record(self.device)
        out = dict(zip(mem, self.reduce_max(list(mem.values()))))
        if self.flops_per_token and rec.get("tokens_per_s"):
            out["tflops"] = achieved_tflops(rec["tokens_per_s"], self.flops_per_token, self.world_size)
            if self.peak_tflops:
                out["mfu"] = out["tflops"] / self.peak_tflops
        if self.profiler is not None:
            comm = self.profiler.after(rec["step"])
            if comm is not None:
                out["comm_s"] = comm
            self.profiler.before(rec["step"] + 1)
        return out

    def start(self, step: int) -> None:
        if self.profiler is not None:
            self.profiler.before(step)

    def close(self) -> None:
        if self.profiler is not None:
            self.profiler.close()

    def describe(self) -> dict:
        return {"flops_per_token": self.flops_per_token, "peak_tflops": self.peak_tflops,
                "peak_source": self.peak_source, "world_size": self.world_size}
