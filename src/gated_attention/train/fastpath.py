"""The trainer's speed settings applied to a built model: the fastest correct path by default, the plain reference
on request (`--set fast=false`, `--set compile=false`).

fast=true (default):
  - `fast.fuse_qkv(model, separate_params=True)`: one q/k/v(/G1 gate) GEMM per layer and the fused sigmoid gate. The
    plain layer's Parameters are kept under their own names and concatenated per forward, so optimizer state,
    DDP/FSDP, checkpoints and `final/` are exactly the plain model's (a run may switch `fast` on resume).
  - the chunked lm_head + cross-entropy (`fast.chunked_lm_loss`): no fp32 (B, T, V) logits.
  Layers the fused projection cannot take (comparison mechanisms that change the projections) stay plain.
fast=false: the plain layers and the plain full-logits cross-entropy (the reference the fast path is tested against).

compile ("auto" by default, or "true" / "false"): what is compiled is the decoder layer's forward, ONCE for every
layer (the layers are identical code; parameters are graph inputs), and it is used for the training forward only:
evaluation, the stats probe and analysis run the same layers eagerly, so their hooks and no_grad never trigger a
recompile. Measured at the `gattn compare --budget default` shape on the shared 2-core machine: compiling the whole
model cost 227 s before its first step (load ~10), one layer graph 60 s, for the same steady step time (31 % saved).

auto: a run shorter than its compile time does not compile. The first steps run eagerly; after AUTO_PROBE_STEPS
timed steps (the process's first step is warm-up and not timed) the trainer compiles iff
    steps_left * eager_step_s * COMPILE_SAVING > max(COMPILE_COST_MIN_S, COMPILE_COST_STEPS * eager_step_s).
The compile cost is estimated in eager steps because both scale with the machine's load: bench/bench_mainjob.py
(cold inductor cache, load ~16) measured 250-424 s of compile per variant against 2.5-2.8 s eager steps, i.e.
100-171 steps; the compiled step saved 37 % (per-variant 24-45 %, noisy). So at the default budget auto compiles
once ~500 steps remain, whatever the load; the 40-step test runs never compile. Compiling needs a C++ compiler on CPU
(inductor) or Triton on CUDA; without one, auto stays eager and compile=true fails loudly.
"""
from __future__ import annotations

import functools
import shutil
from contextlib import contextmanager

import torch
from torch import nn

COMPILE_COST_STEPS = 150.0  # cold compile of the layer graph (fwd + bwd) in eager steps of the default budget (measured)
COMPILE_COST_MIN_S = 60.0  # ...and never less than this (a tiny model's steps are fast, its compile is not)
COMPILE_SAVING = 0.30  # share of the eager fast-path step compiling saves (measured 0.31-0.37 at the default budget)
AUTO_PROBE_STEPS = 2  # eager steps timed before auto decides (after one untimed warm-up step)


def compile_choice(value) -> str:
    """Normalise a `compile` setting to 'auto' | 'true' | 'false' (bools and the usual spellings accepted)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    low = str(value).strip().lower()
    if low == "auto":
        return "auto"
    if low in ("1", "true", "yes", "on"):
        return "true"
    if low in ("0", "false", "no", "off"):
        return "false"
    raise ValueError(f"compile={value!r}; use 'auto', 'true' or 'false'")


def compiler_missing(device: torch.device) -> str | None:
    """Why torch.compile cannot run here (None when it can)."""
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return "Triton is not installed (pip install triton)"
        return None
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        cxx = get_cpp_compiler()
    except Exception as exc:  # no compiler found, or inductor unusable
        return f"no C++ compiler for inductor ({exc})"
    return None if shutil.which(cxx) or shutil.which(cxx.split()[0]) else f"no C++ compiler {cxx!r} on PATH"


def compile_cost_s(eager_step_s: float) -> float:
    """Estimated seconds to compile the layer graph on this machine now."""
    return max(COMPILE_COST_MIN_S, COMPILE_COST_STEPS * eager_step_s)


def should_compile(steps_left: int, eager_step_s: float, saving: float = COMPILE_SAVING) -> bool:
    """The auto rule: compile when the time it saves over the rest of the run exceeds its own cost."""
    return steps_left * eager_step_s * saving > compile_cost_s(eager_step_s)


class SpeedPlan:
    """What the trainer runs: built once per process by `prepare(cfg, model, layers, device)`.

    `fused_loss` tells the loop which loss to use; `training_forward()` wraps the training forward (compiled layers
    while it is open); `observe(step_s, steps_left)` feeds the auto rule; `describe()` goes into summary.json."""

    def __init__(self, fast: bool, compile_setting: str, fused_layers: int, fused_loss: bool, layers: list[nn.Module],
                 device: torch.device, backend: str = "inductor"):
        self.backend = backend  # torch.compile backend; tests use "aot_eager" (same tracing, no C++ build)
        self.fast, self.setting, self.fused_layers, self.fused_loss = fast, compile_setting, fused_layers, fused_loss
        self.layers = layers
        self.device = device
        self.compiled_fn = None
        self.decision = None  # one line: what was decided about compiling, and why
        self._timed: list[float] = []
        self._seen = 0
        if compile_setting == "true":
            missing = compiler_missing(device) if backend == "inductor" else None
            if missing:
                raise ValueError(f"compile=true but torch.compile cannot run here: {missing}; "
                                 "use --set compile=false (or auto)")
            if not layers:
                raise ValueError("compile=true needs a model with decoder layers (model.model.layers)")
            self._enable("compile=true")
        elif compile_setting == "false":
            self.decision = "compile=false: eager"

    def _enable(self, why: str) -> None:
        # one compiled function for every layer: the layers are instances of one class with the same structure
        self.compiled_fn = torch.compile(type(self.layers[0]).forward, backend=self.backend)
        self.decision = why

    @contextmanager
    def training_forward(self):
        """While open, the decoder layers run the compiled forward (no-op when not compiling)."""
        if self.compiled_fn is None:
            yield
            return
        for layer in self.layers:  # an instance attribute shadows the class's forward; hooks stay outside the graph
            layer.forward = functools.partial(self.compiled_fn, layer)
        try:
            yield
        finally:
            for layer in self.layers:
                del layer.forward

    def observe(self, step_s: float, steps_left: int) -> str | None:
        """Time of one finished training step; returns the decision line when auto decides (once per process)."""
        self._seen += 1
        if self.setting != "auto" or self.decision is not None or self._seen == 1:
            return None  # the first step of a process pays one-off costs (allocator, caches): not timed
        self._timed.append(step_s)
        if len(self._timed) < AUTO_PROBE_STEPS:
            return None
        eager = min(self._timed)
        saves = steps_left * eager * COMPILE_SAVING
        est = (f"eager step {eager:.2f} s x {steps_left} steps left x {COMPILE_SAVING:.2f} saved = {saves:.0f} s "
               f"vs ~{compile_cost_s(eager):.0f} s to compile")
        missing = compiler_missing(self.device) if self.layers else "no decoder layers to compile"
        if missing:
            self.decision = f"compile=auto -> eager ({missing})"
        elif should_compile(steps_left, eager):
            self._enable(f"compile=auto -> compiled from here ({est})")
        else:
            self.decision = f"compile=auto -> eager ({est})"
        return self.decision

    def describe(self) -> dict:
        return {"fast": self.fast, "fused_attention_layers": self.fused_layers, "fused_loss": self.fused_loss,
                "compile": self.setting, "compiled": self.compiled_fn is not None,
                "compile_decision": self.decision}


def prepare(cfg, model: nn.Module, layers: list[nn.Module], device: torch.device) -> SpeedPlan:
    """Apply `cfg.fast` to the (unwrapped, not yet DDP/FSDP-wrapped) model in place; returns the plan."""
    from ..modeling import GatedQwen3ForCausalLM

    ours = isinstance(model, GatedQwen3ForCausalLM)
    fused = 0
    if cfg.fast and ours:
        from ..fast import FusedGatedAttention, fuse_qkv

        fuse_qkv(model, separate_params=True, strict=False)
        fused = sum(isinstance(m, FusedGatedAttention) for m in model.modules())
    return SpeedPlan(bool(cfg.fast), compile_choice(cfg.compile), fused, bool(cfg.fast and ours), layers, device)
