"""The shared test harness (plain functions; tests/conftest.py exposes them as fixtures too).

  tiny_lm(gate, backend, seed, ...)          a tiny GatedQwen3ForCausalLM for any gate / mechanism / backend / seed
  build_lm(config, backend, seed, ...)       the same from a ready GatedQwen3Config (a lab's, a hand-written one)
  stock_lm(config, seed, ...)                a stock transformers model (Llama, Qwen3, ...): the trusted peer
  stock_config(config)                       the stock Qwen3 / Qwen3-MoE config of the same shape as one of ours
  perturb(model, seed, ...)                  every parameter moved off its init (the one helper; any nn.Module)
  prepare_text_corpus(out, domains, ...)     a prepared corpus (gattn data prepare) from in-memory texts, in seconds
  write_text_domains(src, domains)           the same texts as --extra sources (folders of files, JSONL files)
  run_gattn(*args, env=..., kill_hooks=...)  `python -m gated_attention.cli ...` in a subprocess (CompletedProcess)
  gattn_argv(*args, kill_hooks=...)          the same command line, for subprocess.Popen
  torchrun_argv(*args, nproc=2, ...)         the same command under torchrun (nproc ranks on this machine; or one
                                             agent of several as nodes, nodes=(N, endpoint))
  torchrun_train(out, sets, env=..., ...)    `gattn train --preset tiny` under torchrun, through
                                             tests/probes/kill_hooks.py
  log_losses(run)                            the per-step losses of a trainer run folder (its log.jsonl)
  traced_gattn(*args, root=..., trace=...)   run_gattn through tests/probes/kill_hooks.py, recording the steps every
                                             trainer run of the command trained ({run folder under root: [steps]}); with
                                             kill_in / kill_at, SIGKILLed after that step of that unit (kill tests)
  assert_matches_reference(fast, ref, ...)   a fast path against its plain reference: outputs AND input gradients
  assert_modules_match(fast, ref, run, ...)  two modules (a fast path and its reference): outputs, every parameter's
                                             gradient by name, and the inputs' gradients

In-process CLI calls go through `gated_attention.cli.main([...])` itself (or the gattn_main fixture, which also
captures the output); a CLI in another process always through run_gattn / gattn_argv / torchrun_argv.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable, Sequence

import torch


def build_lm(config, backend: str | None = None, seed: int | None = 0, eval: bool = True, perturbed: bool = False):
    """A GatedQwen3ForCausalLM from a ready config (a GatedQwen3Config, e.g. a lab's or a hand-written one).

    seed=None leaves the global RNG alone; backend=None keeps the default attention implementation; perturbed
    moves every parameter off its init (`perturb` below, seeded seed + 1) so a dropped or shifted tensor shows."""
    from gated_attention.modeling import GatedQwen3ForCausalLM

    if seed is not None:
        torch.manual_seed(seed)
    model = GatedQwen3ForCausalLM(config)
    if perturbed:
        perturb(model, seed=1 if seed is None else seed + 1)
    if eval:
        model.eval()
    if backend is not None:
        model.set_attn_implementation(backend)
    return model


def tiny_lm(gate: str = "baseline", backend: str | None = "sdpa", seed: int | None = 0, preset: str = "tiny",
            match_params: bool | None = False, eval: bool = True, perturbed: bool = False, **overrides):
    """A tiny model (presets `tiny` / `tiny-moe`) with `gate` and config `overrides` (e.g. mechanism="sink_logits").

    match_params=None uses the preset rule (shrink the dense FFN for gated variants); the other arguments as build_lm."""
    from gated_attention.presets import model_config

    return build_lm(model_config(preset, gate, match_params=match_params, **overrides), backend, seed, eval, perturbed)


def stock_lm(config, seed: int | None = 0, eval: bool = True, perturbed: bool = False):
    """A stock transformers causal LM from its config (transformers.LlamaConfig, Qwen3Config, Qwen3MoeConfig, ...):
    the independent peer our models and converters are compared with. seed, eval and perturbed as in build_lm."""
    import transformers

    if seed is not None:
        torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    if perturbed:
        perturb(model, seed=1 if seed is None else seed + 1)
    return model.eval() if eval else model


def stock_config(config, **overrides):
    """The stock transformers config (Qwen3Config, or Qwen3MoeConfig for an MoE model) with the shape of one of ours
    (an ungated GatedQwen3Config): its state dict loads into stock_lm(stock_config(config)) by plain names."""
    import transformers

    keys = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "rms_norm_eps", "tie_word_embeddings", "rope_parameters",
            "max_position_embeddings", "attention_bias"]
    cls = transformers.Qwen3Config
    if config.num_experts:
        keys += ["num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob"]
        cls = transformers.Qwen3MoeConfig
    return cls(**{**{k: getattr(config, k) for k in keys}, **overrides})


def perturb(model, seed: int = 1, std: float = 0.05, norm_std: float = 0.2):
    """Move every parameter off its init, in place, and return the model: norm weights (init 1) by N(0, norm_std),
    everything else (biases and sink logits start at 0) by N(0, std), from a private generator (the global RNG is left
    alone). Any nn.Module: ours, or a stock transformers model compared with ours."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            p.add_((norm_std if name.endswith("norm.weight") else std) * noise.to(p.dtype))
    return model


def write_text_domains(src: str | Path, domains: dict[str, Sequence[str] | Sequence[dict] | dict[str, str]]
                       ) -> tuple[str, ...]:
    """Write each domain's documents under src as a `gattn data prepare --extra` source and return those paths, in
    order: a list of texts -> folder NAME/ with doc0.txt, doc1.txt, ...; a dict -> folder NAME/ with file name ->
    text; a list of records ({"text": ..., ...}) -> the JSONL file NAME.jsonl. The domain is named NAME either way."""
    src = Path(src)
    src.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, docs in domains.items():
        if not isinstance(docs, dict) and docs and isinstance(docs[0], dict):
            path = src / f"{name}.jsonl"
            path.write_text("".join(json.dumps(rec) + "\n" for rec in docs), encoding="utf-8")
        else:
            path = src / name
            path.mkdir(exist_ok=True)
            files = docs if isinstance(docs, dict) else {f"doc{i}.txt": text for i, text in enumerate(docs)}
            for fname, text in files.items():
                (path / fname).write_text(text, encoding="utf-8")
        paths.append(str(path))
    return tuple(paths)


def prepare_text_corpus(out: str | Path, domains: dict[str, Sequence[str] | Sequence[dict] | dict[str, str]],
                        vocab_size: int = 300, *, src: str | Path | None = None, **prepare_kw) -> str:
    """Write the domains' documents (write_text_domains, under src; default: OUT_src next to out) and prepare them into
    `out` with only these --extra domains (no built-in sources). Returns str(out)."""
    from gated_attention import data

    out = Path(out)
    extra = write_text_domains(src if src is not None else out.with_name(out.name + "_src"), domains)
    data.prepare(data.PrepareConfig(data_dir=str(out), vocab_size=vocab_size, sources=(), extra=extra, **prepare_kw))
    return str(out)


# `gattn` + GATTN_TEST_KILL_* fault injection (test-only)
KILL_HOOKS = Path(__file__).resolve().parents[1] / "probes" / "kill_hooks.py"


def gattn_argv(*args, kill_hooks: bool = False) -> list[str]:
    """The command line of `gattn ARGS` as a separate Python process (for subprocess.Popen); kill_hooks runs it
    through tests/probes/kill_hooks.py, whose GATTN_TEST_KILL_* variables SIGKILL it at a chosen point."""
    runner = [str(KILL_HOOKS)] if kill_hooks else ["-m", "gated_attention.cli"]
    return [sys.executable, *runner, *map(str, args)]


def torchrun_argv(*args, nproc: int = 2, kill_hooks: bool = False, script: str | Path | None = None,
                  max_restarts: int = 0, nodes: tuple[int, str] | None = None) -> list[str]:
    """`gattn ARGS` under torchrun: nproc ranks on this machine (--standalone), each the command of gattn_argv; with
    `script`, each rank runs that test script with ARGS instead; max_restarts: torchrun restarts every worker that
    many times after one fails. nodes=(N, "HOST:PORT"): this command is one of N nodes (one agent each, started
    separately) meeting in a c10d rendezvous at that endpoint instead of --standalone."""
    ranks = [str(script), *map(str, args)] if script is not None else gattn_argv(*args, kill_hooks=kill_hooks)[1:]
    launch = ["--standalone"] if nodes is None else [f"--nnodes={nodes[0]}", "--rdzv-backend=c10d",
                                                     f"--rdzv-endpoint={nodes[1]}", "--rdzv-id=gattn-test"]
    return [sys.executable, "-m", "torch.distributed.run", *launch, f"--nproc_per_node={nproc}",
            f"--max-restarts={max_restarts}", *ranks]


def torchrun_train(out: str | Path, sets: Sequence[str], env: dict | None = None, resume: bool = False,
                   nproc: int = 2) -> subprocess.CompletedProcess:
    """`gattn train --preset tiny --out OUT --set S ...` under torchrun (nproc ranks, one thread each), through
    tests/probes/kill_hooks.py (its GATTN_TEST_* variables in `env` inject faults), with --resume if `resume`."""
    cmd = torchrun_argv("train", "--preset", "tiny", "--out", out, *sum((["--set", s] for s in sets), []),
                        *(["--resume"] if resume else []), nproc=nproc, kill_hooks=True)
    return subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, capture_output=True,
                          text=True, timeout=600)


def log_losses(run: str | Path) -> list[float]:
    """The loss of every step in a trainer run folder's log.jsonl, in order."""
    return [json.loads(line)["loss"] for line in (Path(run) / "log.jsonl").read_text().splitlines()]


def run_gattn(*args, env: dict | None = None, timeout: float = 600, kill_hooks: bool = False
              ) -> subprocess.CompletedProcess:
    """`gattn ARGS` as a separate process (inherits PYTHONPATH and the environment, plus `env`), text output
    captured; kill_hooks as in gattn_argv."""
    return subprocess.run(gattn_argv(*args, kill_hooks=kill_hooks), env={**os.environ, **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


def traced_gattn(*args, root: Path, trace: Path, env: dict | None = None, kill_in: str | None = None,
                 kill_at: int | None = None, timeout: float = 900) -> tuple[subprocess.CompletedProcess, dict]:
    """`gattn ARGS` in a subprocess with kill_hooks.py's step trace in file `trace` (made fresh), optionally SIGKILLed
    right after step `kill_at` of the trainer run in folder root/`kill_in`. Returns (the process, the steps each
    trainer run trained in it: {its folder relative to root, e.g. "runs/baseline": [step, ...]} in order)."""
    trace, root = Path(trace), Path(root).resolve()
    trace.unlink(missing_ok=True)
    extra = {"GATTN_TEST_STEP_TRACE": str(trace)}
    if kill_in is not None:
        extra |= {"GATTN_TEST_KILL_IN_RUN": (root / kill_in).as_posix(), "GATTN_TEST_KILL_AT_STEP": str(kill_at)}
    p = run_gattn(*args, env={**(env or {}), **extra}, timeout=timeout, kill_hooks=True)
    steps: dict[str, list[int]] = {}
    if trace.exists():
        for line in trace.read_text().splitlines():
            path, step = line.rsplit(" ", 1)
            steps.setdefault(Path(path).relative_to(root).as_posix(), []).append(int(step))
    return p, steps


def assert_matches_reference(fast: Callable, reference: Callable, inputs: Sequence[torch.Tensor],
                             grad_wrt: Sequence[int] | None = None, upstream: torch.Tensor | float | None = None,
                             rtol: float | None = None, atol: float | None = None,
                             grad_rtol: float | None = None, grad_atol: float | None = None):
    """Call `fast(*inputs)` and `reference(*inputs)`, assert the outputs match, then backpropagate `upstream` (a
    tensor shaped like the output, or a scalar factor; default: a fixed random tensor on the output's device) through
    both and assert the gradients w.r.t. inputs[i] for i in grad_wrt (default: every input that requires grad) match,
    within grad_rtol / grad_atol (default: rtol / atol). Returns (fast output, fast gradients) for further checks."""
    if grad_rtol is None and grad_atol is None:
        grad_rtol, grad_atol = rtol, atol
    out_f, out_r = fast(*inputs), reference(*inputs)
    torch.testing.assert_close(out_f, out_r.to(out_f.dtype), rtol=rtol, atol=atol)
    idx = [i for i, x in enumerate(inputs) if x.requires_grad] if grad_wrt is None else list(grad_wrt)
    if not idx:
        return out_f, ()
    if upstream is None:
        g = torch.Generator().manual_seed(1234)
        upstream = torch.randn(out_f.shape, generator=g).to(out_f.device, out_f.dtype)
    wrt = [inputs[i] for i in idx]
    if isinstance(upstream, torch.Tensor):
        grads_f = torch.autograd.grad(out_f, wrt, upstream)
        grads_r = torch.autograd.grad(out_r, wrt, upstream.to(out_r.dtype))
    else:
        grads_f = torch.autograd.grad(upstream * out_f, wrt)
        grads_r = torch.autograd.grad(upstream * out_r, wrt)
    for i, a, b in zip(idx, grads_f, grads_r):
        torch.testing.assert_close(a, b.to(a.dtype), rtol=grad_rtol, atol=grad_atol,
                                   msg=lambda m, i=i: f"grad of input {i}: {m}")
    return out_f, grads_f


def assert_modules_match(fast, reference, run: Callable, inputs: Sequence = (), rtol: float | None = None,
                         atol: float | None = None, grad_rtol: float | None = None, grad_atol: float | None = None):
    """Two modules that compute the same function with the same parameter names (a fast path and its reference, one
    model under two kernels or layouts): `run(module, *inputs)` returns (outputs, loss) with outputs a tensor or a
    tuple of tensors to compare and loss a scalar to backpropagate (None: `run` backpropagated itself). Each module
    gets its own leaf copies of the floating-point inputs. Asserts the outputs match (rtol / atol), then the gradient
    of every parameter, by name, and of each floating-point input (grad_rtol / grad_atol, default rtol / atol).
    Returns ((outputs, {name: grad}, [input grads]) of fast, the same of reference) for further checks."""
    if grad_rtol is None and grad_atol is None:
        grad_rtol, grad_atol = rtol, atol
    results = []
    for module in (fast, reference):
        module.zero_grad(set_to_none=True)
        xs = [x.detach().clone().requires_grad_() if isinstance(x, torch.Tensor) and x.is_floating_point() else x
              for x in inputs]
        outputs, loss = run(module, *xs)
        if loss is not None:
            loss.backward()
        outputs = tuple(o.detach() for o in outputs) if isinstance(outputs, (tuple, list)) else outputs.detach()
        grads = {n: None if p.grad is None else p.grad.detach().clone() for n, p in module.named_parameters()}
        results.append((outputs, grads, [x.grad for x in xs if isinstance(x, torch.Tensor) and x.is_floating_point()]))
    (out_f, g_f, gx_f), (out_r, g_r, gx_r) = results
    for i, (a, b) in enumerate(zip(*((o,) if isinstance(o, torch.Tensor) else o for o in (out_f, out_r)))):
        torch.testing.assert_close(a, b.to(a.dtype), rtol=rtol, atol=atol, msg=lambda m, i=i: f"output {i}: {m}")
    assert set(g_f) == set(g_r), f"parameter names differ: {sorted(set(g_f) ^ set(g_r))}"
    for name, b in g_r.items():
        a = g_f[name]
        assert (a is None) == (b is None), f"{name}: gradient {'missing' if a is None else 'unexpected'} in fast"
        if a is not None:
            torch.testing.assert_close(a, b.to(a.dtype), rtol=grad_rtol, atol=grad_atol, msg=lambda m, n=name: f"{n}: {m}")
    for i, (a, b) in enumerate(zip(gx_f, gx_r)):
        torch.testing.assert_close(a, b.to(a.dtype), rtol=grad_rtol, atol=grad_atol,
                                   msg=lambda m, i=i: f"grad of input {i}: {m}")
    return results[0], results[1]
