"""Activation checkpointing (`--set activation_checkpointing=full`): the same gradients as `none` for every parameter
(fp32, dense and MoE, fast path and plain), every layer recomputed in backward and keeping only its inputs (measured
by saved-activation bytes per layer: eager, compiled, compiled before the layer's class changes, FSDP2 at 2 ranks),
the recompute identical to the forward (the bf16 GEMM emulation re-entered, the MoE routing replayed), and a training
run that logs the same losses."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

import ac_probe
from gated_attention.train import fastpath
from gated_attention.train.train_presets import tiny
from gated_attention.train.overrides import apply_overrides
from gated_attention.train.model_setup import apply_activation_checkpointing
from gated_attention.train.monitors import decoder_layers
from gated_attention.train.trainer import train
from gated_attention.util.errors import UserError
from harness import tiny_lm, torchrun_argv


def _grads(mode: str, preset: str = "tiny", fast: bool = True) -> tuple[float, dict]:
    """Loss and every parameter's gradient after one forward/backward of a fresh seeded model."""
    model = tiny_lm("sdpa_elementwise", preset=preset, eval=False, seed=0)
    model.train()
    layers = decoder_layers(model)
    plan = fastpath.prepare(type("C", (), {"fast": fast, "compile": "false"})(), model, layers, torch.device("cpu"))
    assert apply_activation_checkpointing(layers, mode) == (len(layers) if mode == "full" else 0)
    ids = torch.randint(0, model.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    x, y = ids[:, :-1], ids[:, 1:]  # (B, T) each
    with plan.training_forward():
        out = (model(input_ids=x, shift_labels=y, fused_loss=True, use_cache=False) if plan.fused_loss
               else model(input_ids=x, labels=x, use_cache=False))  # HF shifts the labels
    out.loss.backward()
    return float(out.loss.detach()), {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def _assert_same_grads(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and len(a) > 10
    for name in a:
        assert (a[name] is None) == (b[name] is None), name
        if a[name] is not None:
            torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("preset,fast", [("tiny", True), ("tiny", False), ("tiny-moe", True)])
def test_full_checkpointing_gives_the_same_gradients(preset, fast):
    loss_none, g_none = _grads("none", preset, fast)
    loss_full, g_full = _grads("full", preset, fast)
    assert loss_full == pytest.approx(loss_none, rel=1e-6)
    _assert_same_grads(g_none, g_full)
    assert all(g is not None for g in g_full.values())  # every parameter got a gradient


def test_full_checkpointing_recomputes_every_layer_in_backward():
    """Each layer's forward runs twice per step with checkpointing (the forward, then its recomputation inside
    backward, with grad enabled both times), once without: counted at every layer's attention and MLP."""
    for mode, expected in (("none", 1), ("full", 2)):
        model, plan, layers = ac_probe.build(mode)
        calls = {}
        for i, layer in enumerate(layers):
            for part in (layer.self_attn, layer.mlp):
                part.register_forward_pre_hook(lambda m, a, key=(i, id(part)): calls.setdefault(key, []).append(
                    torch.is_grad_enabled()))
        ids = torch.randint(0, model.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
        model(input_ids=ids[:, :-1], shift_labels=ids[:, 1:], fused_loss=True, use_cache=False).loss.backward()
        assert len(calls) == 2 * len(layers) and all(c == [True] * expected for c in calls.values()), (mode, calls)


# A checkpointed layer keeps its input (and the compiled graph a few small tensors); without checkpointing it keeps
# ~15x more at this shape. A layer that silently stops checkpointing keeps ~0.8x of "none".
AC_KEEPS_AT_MOST = 0.25


def _assert_checkpointed(none: list[int], full: list[int]) -> None:
    assert len(none) == len(full) >= 2 and all(n > 0 for n in none)
    assert all(f <= AC_KEEPS_AT_MOST * n for f, n in zip(full, none)), (full, none)  # every layer, not just one


@pytest.mark.parametrize("compile_at", [None, "before"], ids=["eager", "compiled"])
@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_checkpointing_saves_only_layer_inputs_for_every_layer(preset, compile_at):
    """Saved-activation bytes per layer (ac_probe.py), eager and with the trainer's compiled layer forward (an MoE
    layer's checkpoint runs eagerly around its compiled parts and replays its routing)."""
    torch._dynamo.reset()
    none = ac_probe.saved_bytes_per_layer(*ac_probe.build("none", preset, compile_at=compile_at))
    full = ac_probe.saved_bytes_per_layer(*ac_probe.build("full", preset, compile_at=compile_at))
    _assert_checkpointed(none, full)


def test_compiled_layer_keeps_checkpointing_when_its_class_changes_after_compile():
    """compile=true compiles the layer forward before the model is wrapped, and FSDP2's fully_shard then makes each
    layer an instance of a subclass (whose own forward wrapper is the outermost one). The compiled forward must still
    checkpoint: the same subclassing here, in one process (the 2-rank FSDP2 run is the test below)."""
    saved = {}
    for mode in ("none", "full"):
        model, plan, layers = ac_probe.build(mode, compile_at="before")
        for layer in layers:
            layer.__class__ = type("Wrapped" + type(layer).__name__, (type(layer),), {})  # as fully_shard does
        torch._dynamo.reset()
        saved[mode] = ac_probe.saved_bytes_per_layer(model, plan, layers)
    _assert_checkpointed(saved["none"], saved["full"])


def test_checkpointing_under_fsdp_at_two_ranks_eager_and_compiled(tmp_path):
    """FSDP2 at 2 ranks (gloo): per-layer saved bytes, eager and compiled before / after the wrap (ac_probe.py)."""
    out = tmp_path / "bytes.json"
    cmd = torchrun_argv(out, script=Path(ac_probe.__file__))
    p = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(out.read_text())
    for case in ("eager", "before", "after"):
        _assert_checkpointed(got[f"none/{case}"], got[f"full/{case}"])


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_recompute_runs_in_the_forwards_bf16_emulation(preset):
    """On a CPU without bf16 units the forward runs in the bf16 GEMM emulation (a Python mode) and the backward, where
    the recompute happens, outside it: the recompute must rebuild the forward's graph (it raised CheckpointError on
    AVX2-only CPUs), so the gradients equal those without checkpointing. The emulation is entered directly here, so
    this runs the same on every CPU."""
    from gated_attention.util.bf16_emulation import emulated_bf16

    grads = {}
    for mode in ("none", "full"):
        model = tiny_lm("sdpa_elementwise", preset=preset, eval=False, seed=0).to(torch.bfloat16)
        model.train()
        layers = decoder_layers(model)
        fastpath.prepare(type("C", (), {"fast": True, "compile": "false"})(), model, layers, torch.device("cpu"))
        apply_activation_checkpointing(layers, mode)
        ids = torch.randint(0, model.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
        with emulated_bf16():
            out = model(input_ids=ids[:, :-1], shift_labels=ids[:, 1:], fused_loss=True, use_cache=False)
        out.loss.backward()  # outside the mode, as the trainer's backward
        grads[mode] = {n: p.grad.clone() for n, p in model.named_parameters()}
    for name, g in grads["none"].items():
        assert torch.equal(grads["full"][name], g), name


def test_moe_recompute_replays_the_forwards_routing(monkeypatch):
    """The recompute takes the routing its forward chose instead of choosing again, so a router whose top-k would
    come out differently on a second run (a GEMM that rounds differently, a tie) cannot change the recomputed graph:
    forced here by a top-k that picks other experts whenever it runs inside backward."""
    real_topk = torch.topk

    def flaky_topk(x, k, *args, **kwargs):
        task = torch._C._current_graph_task_id()
        return real_topk(-x if task != -1 else x, k, *args, **kwargs)  # in backward: the k least likely experts

    monkeypatch.setattr(torch, "topk", flaky_topk)
    grads = {}
    for mode in ("none", "full"):
        model, plan, layers = ac_probe.build(mode, preset="tiny-moe")
        ids = torch.randint(0, model.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
        model(input_ids=ids[:, :-1], shift_labels=ids[:, 1:], fused_loss=True, use_cache=False).loss.backward()
        grads[mode] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert grads["full"].keys() == grads["none"].keys()
    for name, g in grads["none"].items():
        torch.testing.assert_close(grads["full"][name], g, rtol=1e-5, atol=1e-7, msg=name)


def test_bad_setting_fails_with_one_line():
    with pytest.raises(UserError, match="activation_checkpointing='some'; use one of none, full"):
        apply_overrides(tiny(), ["activation_checkpointing=some"])
    with pytest.raises(ValueError, match="needs the model's decoder layers"):
        apply_activation_checkpointing([torch.nn.Linear(2, 2)], "full")


def test_training_run_with_full_checkpointing_logs_the_same_losses(tmp_path):
    sets = ["steps=3", "precision=fp32", "stats_every=2", "ckpt_every=0", "compile=false"]
    losses = {}
    for mode in ("none", "full"):
        out = tmp_path / mode
        summary = train(apply_overrides(tiny(), sets + [f"activation_checkpointing={mode}"]), out)
        assert summary["steps"] == 3
        losses[mode] = [json.loads(line)["loss"] for line in (out / "log.jsonl").read_text().splitlines()]
    assert losses["full"] == pytest.approx(losses["none"], rel=1e-6)
