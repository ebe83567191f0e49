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
the compiled function calls the layer's class forward as it is at call time, i.e. the outermost wrapper: under
activation checkpointing the one that checkpoints (transformers' GradientCheckpointingLayer checkpoints only from the
outermost `forward`, and FSDP2's `fully_shard` subclasses the layer, adding one), so the checkpoint is traced into
the layer's graph whether compile starts before or after wrapping (torchtitan's order too: checkpoint, then compile
each block, then shard); FSDP2's hooks stay outside, in `__call__`. Under `activation_checkpointing=selective` the
checkpoint's per-op policy is traced with it (the graph's partitioner keeps the outputs the policy names); under
`every:N` checkpointed and plain layers are two graphs (the graph guards on the layer's checkpointing flag).
evaluation, the stats probe and analysis run the same layers eagerly, so their hooks and no_grad never trigger a
recompile. While the compiled layers run, torch._dynamo's settings are DYNAMO_OPTIONS (scoped, not set at import):
a host read such as expert parallelism's split sizes is traced as data-dependent sizes instead of breaking the graph.
Compiling the whole model instead cost ~4x longer before its first step for the same steady step time.
With the layers, the chunked loss's math after each lm_head GEMM is compiled too (`fused.use_compiled_math`): the
fp32 log-sum-exp and the softmax gradient become fused passes over each chunk's logits, with no fp32 (c, V) copy
(the eager path's separate passes and casts were what made our step slower than a whole-model compile).

auto: a run shorter than its compile time does not compile. The first steps run eagerly; after AUTO_PROBE_STEPS
timed steps (the process's first step is warm-up and not timed) the trainer compiles iff
    steps_left * eager_step_s * COMPILE_SAVING > max(COMPILE_COST_MIN_S, COMPILE_COST_STEPS * eager_step_s).
The compile cost is estimated in eager steps because both scale with the machine's speed and load. Measured at the
`gattn compare` model (d=128, 4 layers, vocab 1024, batch 16 x 256), one thread, quiet AMD EPYC Zen 4 core
(AVX512-BF16), cold inductor cache, in both precisions (runs/perf-style interleaved timing, bench/bench_mainjob.py):
    fp32: eager 0.57-0.61 s, compiled 0.47-0.52 s (15-18 % saved), compile 25 s (first graph) / 11 s (second)
    bf16: eager 0.42-0.46 s, compiled 0.35-0.37 s (18-20 % saved), compile 31 s / 18 s
i.e. the compile costs 40-70 eager steps and saves ~15-20 % in either precision; on a loaded Xeon (load ~16, two
threads) the same compile took 100-170 eager steps and saved 24-45 %. The constants take the low saving and the high
cost, so auto compiles only where it pays on either kind of CPU: at this model once ~470 steps remain; the 40-step
test runs never compile. Compiling needs a C++ compiler on CPU (inductor) or Triton on CUDA; without one, auto stays
eager and compile=true fails loudly.
"""
from __future__ import annotations

import functools
import shutil
from contextlib import contextmanager

import torch
from torch import nn

COMPILE_COST_STEPS = 70.0  # cold compile of the layer graph (fwd + bwd) in eager steps of the compare model (40-70)
COMPILE_COST_MIN_S = 30.0  # ...and never less than this (a tiny model's steps are fast, its compile is not)
COMPILE_SAVING = 0.15  # share of the eager fast-path step compiling saves (measured 0.15-0.20, fp32 and bf16)
AUTO_PROBE_STEPS = 2  # eager steps timed before auto decides (after one untimed warm-up step)
# torch._dynamo settings the compiled layers are traced under (set while they run, not at import):
# capture_scalar_outputs turns a host read of a device tensor (.tolist(): expert parallelism's all-to-all split sizes,
# the per-expert matmul's group sizes) into unbacked symbolic sizes inside the graph instead of a graph break, as
# torchtitan's compile does for token-choice MoE dispatch.
DYNAMO_OPTIONS = {"capture_scalar_outputs": True}


def compile_choice(value) -> str:
    """Normalise a `compile` setting to 'auto' | 'true' | 'false' (bools and the usual spellings accepted)."""
    from ..util.errors import switch_choice

    return switch_choice(value, "compile", "'auto', 'true' or 'false'")


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


def dynamo_options():
    """Context under which the compiled layers are traced (DYNAMO_OPTIONS)."""
    return torch._dynamo.config.patch(**DYNAMO_OPTIONS)


def compile_cost_s(eager_step_s: float) -> float:
    """Estimated seconds to compile the layer graph on this machine now."""
    return max(COMPILE_COST_MIN_S, COMPILE_COST_STEPS * eager_step_s)


def should_compile(steps_left: int, eager_step_s: float, saving: float = COMPILE_SAVING) -> bool:
    """The auto rule: compile when the time it saves over the rest of the run exceeds its own cost."""
    return steps_left * eager_step_s * saving > compile_cost_s(eager_step_s)


def _class_forward(layer: nn.Module, *args, **kwargs):
    """The layer's class `forward` as it is now (not when compile was enabled): after `fully_shard` the FSDP
    subclass's, the outermost, which is the one that checkpoints. Compiling a class's forward captured before
    wrapping ran the inner one, which saw itself not outermost and silently did not checkpoint."""
    return type(layer).forward(layer, *args, **kwargs)


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
        self.loss_math = None  # compiled per-chunk loss math, with the layers (fused.use_compiled_math)
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
        self.compiled_fn = torch.compile(_class_forward, backend=self.backend)
        if self.fused_loss:  # the chunked loss's math after each GEMM, fused by the compiler (fused._ce_and_grad)
            from ..fused import _ce_and_grad

            self.loss_math = torch.compile(_ce_and_grad, backend=self.backend, dynamic=False)
        self.decision = why

    @contextmanager
    def training_forward(self):
        """While open, the decoder layers run the compiled forward (no-op when not compiling)."""
        if self.compiled_fn is None:
            yield
            return
        from ..fused import use_compiled_math

        for layer in self.layers:  # an instance attribute shadows the class's forward; hooks stay outside the graph
            layer.forward = functools.partial(self.compiled_fn, layer)
        try:
            with dynamo_options(), use_compiled_math(self.loss_math):
                yield
        finally:
            for layer in self.layers:
                del layer.forward

    def observe(self, step_s: float, steps_left: int, agree=None) -> str | None:
        """Time of one finished training step; returns the decision line when auto decides (once per process).
        agree(decision) -> decision: the trainer's broadcast of rank 0's (compile or not, the line) to every rank,
        called at the same step on every rank — ranks timing under different load could otherwise disagree."""
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
            choice = (False, f"compile=auto -> eager ({missing})")
        elif should_compile(steps_left, eager):
            choice = (True, f"compile=auto -> compiled from here ({est})")
        else:
            choice = (False, f"compile=auto -> eager ({est})")
        on, line = agree(choice) if agree is not None else choice
        if on:
            self._enable(line)
        else:
            self.decision = line
        return self.decision

    def describe(self) -> dict:
        return {"fast": self.fast, "fused_attention_layers": self.fused_layers, "fused_loss": self.fused_loss,
                "compile": self.setting, "compiled": self.compiled_fn is not None,
                "compile_decision": self.decision}


def prepare(cfg, model: nn.Module, layers: list[nn.Module], device: torch.device, precision: str = "fp32"
            ) -> SpeedPlan:
    """Apply `cfg.fast` to the (unwrapped, not yet DDP/FSDP-wrapped) model in place; returns the plan. Where the
    resolved `precision` has its bf16 GEMMs emulated (util/bf16_emulation.py: a Python mode torch.compile does not
    trace), the layers run eagerly: compile=auto stays eager, compile=true fails with the reason."""
    from ..modeling import GatedQwen3ForCausalLM
    from ..util.precision import gemm_mode

    ours = isinstance(model, GatedQwen3ForCausalLM)
    fused = 0
    if cfg.fast and ours:
        from ..fused import FusedGatedAttention, fuse_qkv

        fuse_qkv(model, separate_params=True, strict=False)
        fused = sum(isinstance(m, FusedGatedAttention) for m in model.modules())
    setting = compile_choice(cfg.compile)
    emulated = precision != "fp32" and gemm_mode(device) == "emulated"
    if emulated and setting == "true":
        raise ValueError(f"compile=true with precision {precision}: this CPU emulates bf16 GEMMs (no bf16 "
                         "instructions), which runs eagerly; use --set compile=auto or false")
    plan = SpeedPlan(bool(cfg.fast), "false" if emulated else setting, fused, bool(cfg.fast and ours), layers, device)
    if emulated:
        plan.setting = setting
        plan.decision = f"compile={setting} -> eager (bf16 GEMMs emulated on this CPU: an eager Python mode)"
    return plan
