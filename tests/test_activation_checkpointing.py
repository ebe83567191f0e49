"""Activation checkpointing (`--set activation_checkpointing=full|selective|every:N`): the same gradients as `none`
for every parameter (fp32, dense and MoE, fast path and plain, eager and compiled), the checkpointed layers recomputed
in backward (forward calls per layer; GEMM FLOPs of the backward: `selective` recomputes none), keeping only their
inputs under `full` and their inputs plus GEMM and attention outputs under `selective`, where the plan's activation
model says (saved-activation bytes per layer: eager, compiled, compiled before the layer's class changes, FSDP2 at 2
ranks), the recompute identical to the forward (the bf16 GEMM emulation re-entered, the MoE routing replayed), and a
training run that logs the same losses."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from gated_attention.train import fastpath
from gated_attention.train import plan as PL
from gated_attention.train.train_presets import tiny
from gated_attention.train.overrides import apply_overrides
from gated_attention.train.activation_checkpoint import apply_activation_checkpointing
from gated_attention.train.monitors import decoder_layers
from gated_attention.train.trainer import train
from gated_attention.util.errors import UserError
from harness import tiny_lm, torchrun_argv
from probes import ac_probe


MODES = ("full", "selective", "every:2")  # every checkpointing mode, each against "none"
CHECKPOINTED = {"none": [], "full": [0, 1], "selective": [0, 1], "every:2": [0]}  # of the tiny models' 2 layers


def _grads(mode: str, preset: str = "tiny", fast: bool = True, compiled: bool = False) -> tuple[float, dict]:
    """Loss and every parameter's gradient after one forward/backward of a fresh seeded model (its layer forward
    compiled with aot_eager, as compile=true does, when `compiled`)."""
    torch._dynamo.reset()
    model = tiny_lm("sdpa_elementwise", preset=preset, eval=False, seed=0)
    model.train()
    layers = decoder_layers(model)
    plan = fastpath.prepare(type("C", (), {"fast": fast, "compile": "false"})(), model, layers, torch.device("cpu"))
    if compiled:
        plan.backend = "aot_eager"
        plan._enable("compile=true")
    assert apply_activation_checkpointing(layers, mode) == len(CHECKPOINTED[mode])
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
            torch.testing.assert_close(b[name], a[name], rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("preset,fast", [("tiny", True), ("tiny", False), ("tiny-moe", True)])
def test_checkpointing_gives_the_same_gradients(preset, fast, mode):
    loss_none, g_none = _grads("none", preset, fast)
    loss, g = _grads(mode, preset, fast)
    assert loss == loss_none
    _assert_same_grads(g_none, g)
    assert all(t is not None for t in g.values())  # every parameter got a gradient


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_compiled_checkpointing_gives_the_same_gradients(preset, mode):
    """The trainer's compiled layer forward (aot_eager) under each mode against eager `none`: the checkpoint (and
    under `selective` its per-op policy) traced into the layer's graph, or for an MoE layer run eagerly around its
    compiled parts."""
    loss_none, g_none = _grads("none", preset)
    loss, g = _grads(mode, preset, compiled=True)
    assert loss == pytest.approx(loss_none, rel=1e-6)
    _assert_same_grads(g_none, g)


@pytest.mark.parametrize("mode", ("none",) + MODES)
def test_checkpointed_layers_recompute_in_backward(mode):
    """A checkpointed layer's forward runs twice per step (the forward, then its recomputation inside backward,
    with grad enabled both times), any other once: counted at every layer's attention and MLP."""
    model, plan, layers = ac_probe.build(mode)
    calls = {}
    for i, layer in enumerate(layers):
        for part in (layer.self_attn, layer.mlp):
            part.register_forward_pre_hook(lambda m, a, key=(i, id(part)): calls.setdefault(key, []).append(
                torch.is_grad_enabled()))
    ids = torch.randint(0, model.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids[:, :-1], shift_labels=ids[:, 1:], fused_loss=True, use_cache=False).loss.backward()
    assert len(calls) == 2 * len(layers)
    for (i, _), c in calls.items():
        assert c == [True] * (2 if i in CHECKPOINTED[mode] else 1), (mode, calls)


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_backward_gemm_flops_follow_the_plan(preset):
    """The GEMM FLOPs of a training step's backward (torch.utils.flop_counter): `full` adds one forward of every
    layer's GEMMs, `every:2` half of that, `selective` none (its recompute takes the kept GEMM outputs) — the
    recompute share `gattn plan` counts in hardware_flops_per_token (plan.recompute_share)."""
    from torch.utils.flop_counter import FlopCounterMode

    backward = {}
    for mode in ("none",) + MODES:
        model, plan, layers = ac_probe.build(mode, preset)
        ids = torch.randint(0, model.config.vocab_size, (2, 33), generator=torch.Generator().manual_seed(1))
        out = model(input_ids=ids[:, :-1], shift_labels=ids[:, 1:], fused_loss=True, use_cache=False)
        with FlopCounterMode(display=False) as counter:
            out.loss.backward()
        backward[mode] = counter.get_total_flops()
    recompute = backward["full"] - backward["none"]
    assert recompute > 0.2 * backward["none"]  # a real recompute of the layers' GEMMs
    for mode in MODES:
        share = PL.recompute_share(model.config, mode)
        assert backward[mode] - backward["none"] == pytest.approx(share * recompute, abs=1), mode


# A fully checkpointed layer keeps its input (and the compiled graph a few small tensors); without checkpointing it
# keeps ~15x more at this shape. A layer that silently stops checkpointing keeps ~0.8x of "none".
AC_KEEPS_AT_MOST = 0.25
PLAN_TOLERANCE = 0.10  # the plan's activation model against the bytes measured (tests/test_plan.py's tolerance)
TOKENS = 2 * 32  # ac_probe.saved_bytes_per_layer's batch


def _assert_checkpointed(none: list[int], full: list[int]) -> None:
    assert len(none) == len(full) >= 2 and all(n > 0 for n in none)
    assert all(f <= AC_KEEPS_AT_MOST * n for f, n in zip(full, none)), (full, none)  # every layer, not just one


def _assert_modes_keep(saved: dict, config) -> None:
    """Per layer, measured {mode: [bytes per layer]}: `full` keeps <= AC_KEEPS_AT_MOST of `none`; `every:2` that on
    layer 0 and all of `none` on layer 1; `selective` strictly between `full` and `none`, where the plan's activation
    model says (plan.layer_kept_bytes, within PLAN_TOLERANCE)."""
    none = saved["none"]
    _assert_checkpointed(none, saved["full"])
    assert saved["every:2"][0] <= AC_KEEPS_AT_MOST * none[0] and saved["every:2"][1] == none[1], saved
    for i, kept in enumerate(saved["selective"]):
        assert saved["full"][i] < kept < none[i], saved
        predicted = PL.layer_kept_bytes(config, i, TOKENS, "fp32", "selective")
        assert kept == pytest.approx(predicted, rel=PLAN_TOLERANCE), (i, kept, predicted)


def _keep_cases():
    """Every preset x gate, eager and compiled; of the compiled ones only the gated dense model runs by default (each
    compiles for 13-26 s on 2 cores): the MoE's compiled checkpointing is also checked by its gradients
    (test_compiled_checkpointing_gives_the_same_gradients) and under FSDP2; the rest: -m slow."""
    for preset in ("tiny", "tiny-moe"):
        for gate in ("none", "sdpa_elementwise"):
            for compile_at, name in ((None, "eager"), ("before", "compiled")):
                slow = compile_at is not None and (preset, gate) != ("tiny", "sdpa_elementwise")
                yield pytest.param(preset, gate, compile_at, id=f"{preset}-{gate}-{name}",
                                   marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize("preset,gate,compile_at", list(_keep_cases()))
def test_each_mode_keeps_what_the_plan_says_for_every_layer(preset, gate, compile_at):
    """Saved-activation bytes per layer (ac_probe.py: what autograd saves and the selective cache holds), eager and
    with the trainer's compiled layer forward (an MoE layer's checkpoint runs eagerly around its compiled parts and
    replays its routing), dense and MoE, gated and not."""
    saved = {}
    for mode in ("none",) + MODES:
        torch._dynamo.reset()
        model, plan, layers = ac_probe.build(mode, preset, compile_at=compile_at, gate=gate)
        saved[mode] = ac_probe.saved_bytes_per_layer(model, plan, layers)
    _assert_modes_keep(saved, model.config)
    if compile_at is None:  # eager: every mode at the plan's bytes (compiled graphs save a little less or more)
        for mode in ("none",) + MODES:
            predicted = [PL.layer_kept_bytes(model.config, i, TOKENS, "fp32", mode) for i in range(len(layers))]
            assert saved[mode] == pytest.approx(predicted, rel=PLAN_TOLERANCE), (mode, saved[mode], predicted)


def test_compiled_layer_keeps_checkpointing_when_its_class_changes_after_compile():
    """compile=true compiles the layer forward before the model is wrapped, and FSDP2's fully_shard then makes each
    layer an instance of a subclass (whose own forward wrapper is the outermost one). The compiled forward must still
    checkpoint: the same subclassing here, in one process (the 2-rank FSDP2 run is the test below)."""
    saved = {}
    for mode in ("none",) + MODES:
        model, plan, layers = ac_probe.build(mode, compile_at="before")
        for layer in layers:
            layer.__class__ = type("Wrapped" + type(layer).__name__, (type(layer),), {})  # as fully_shard does
        torch._dynamo.reset()
        saved[mode] = ac_probe.saved_bytes_per_layer(model, plan, layers)
    _assert_modes_keep(saved, model.config)


def test_checkpointing_under_fsdp_at_two_ranks_eager_and_compiled(tmp_path):
    """FSDP2 at 2 ranks (gloo): per-layer saved bytes of every mode, eager and compiled before / after the wrap
    (ac_probe.py)."""
    out = tmp_path / "bytes.json"
    cmd = torchrun_argv(out, script=Path(ac_probe.__file__))
    p = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(out.read_text())
    config = ac_probe.build("none")[0].config
    for case in ("eager", "before", "after"):
        _assert_modes_keep({mode: got[f"{mode}/{case}"] for mode in ac_probe.MODES}, config)


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_recompute_runs_in_the_forwards_bf16_emulation(preset, mode):
    """On a CPU without bf16 units the forward runs in the bf16 GEMM emulation (a Python mode) and the backward, where
    the recompute happens, outside it: the recompute must rebuild the forward's graph (it raised CheckpointError on
    AVX2-only CPUs), so the gradients equal those without checkpointing. The emulation is entered directly here, so
    this runs the same on every CPU."""
    from gated_attention.util.bf16_emulation import emulated_bf16

    grads = {}
    for ac in ("none", mode):
        model = tiny_lm("sdpa_elementwise", preset=preset, eval=False, seed=0).to(torch.bfloat16)
        model.train()
        layers = decoder_layers(model)
        fastpath.prepare(type("C", (), {"fast": True, "compile": "false"})(), model, layers, torch.device("cpu"))
        apply_activation_checkpointing(layers, ac)
        ids = torch.randint(0, model.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
        with emulated_bf16():
            out = model(input_ids=ids[:, :-1], shift_labels=ids[:, 1:], fused_loss=True, use_cache=False)
        out.loss.backward()  # outside the mode, as the trainer's backward
        grads[ac] = {n: p.grad.clone() for n, p in model.named_parameters()}
    for name, g in grads["none"].items():
        assert torch.equal(grads[mode][name], g), name


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_moe_recompute_replays_the_forwards_routing(monkeypatch, mode):
    """The recompute takes the routing its forward chose instead of choosing again, so a router whose top-k would
    come out differently on a second run (a GEMM that rounds differently, a tie) cannot change the recomputed graph:
    forced here by a top-k that picks other experts whenever it runs inside backward."""
    real_topk = torch.topk

    def flaky_topk(x, k, *args, **kwargs):
        task = torch._C._current_graph_task_id()
        return real_topk(-x if task != -1 else x, k, *args, **kwargs)  # in backward: the k least likely experts

    monkeypatch.setattr(torch, "topk", flaky_topk)
    grads = {}
    for ac in ("none", mode):
        model, plan, layers = ac_probe.build(ac, preset="tiny-moe")
        ids = torch.randint(0, model.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
        model(input_ids=ids[:, :-1], shift_labels=ids[:, 1:], fused_loss=True, use_cache=False).loss.backward()
        grads[ac] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert grads[mode].keys() == grads["none"].keys()
    for name, g in grads["none"].items():
        torch.testing.assert_close(grads[mode][name], g, rtol=1e-6, atol=1e-7, msg=name)


def test_bad_setting_fails_with_one_line():
    forms = "use 'none', 'full', 'selective' .* or 'every:N' .*N >= 2"
    for bad in ("some", "every:", "every:two", "every:-2", "Full", "selective:2"):
        with pytest.raises(UserError, match=f"activation_checkpointing='{bad}'; {forms}"):
            apply_overrides(tiny(), [f"activation_checkpointing={bad}"])
    with pytest.raises(UserError, match="'every:1': N must be at least 2 \\('full' checkpoints every layer\\)"):
        apply_overrides(tiny(), ["activation_checkpointing=every:1"])
    for good in ("none", "full", "selective", "every:2", "every:12"):
        assert apply_overrides(tiny(), [f"activation_checkpointing={good}"]).activation_checkpointing == good
    for mode in MODES:
        with pytest.raises(ValueError, match=f"activation_checkpointing={mode} needs the model's decoder layers"):
            apply_activation_checkpointing([torch.nn.Linear(2, 2)], mode)


@pytest.mark.parametrize("mode", MODES)
def test_training_run_with_checkpointing_logs_the_same_losses(tmp_path, mode):
    sets = ["steps=3", "precision=fp32", "stats_every=2", "ckpt_every=0", "compile=false"]
    losses = {}
    for ac in ("none", mode):
        out = tmp_path / ac.replace(":", "-")
        summary = train(apply_overrides(tiny(), sets + [f"activation_checkpointing={ac}"]), out)
        assert summary["steps"] == 3
        losses[ac] = [json.loads(line)["loss"] for line in (out / "log.jsonl").read_text().splitlines()]
    assert losses[mode] == pytest.approx(losses["none"], rel=1e-6)
