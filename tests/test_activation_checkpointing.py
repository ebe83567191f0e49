"""Activation checkpointing (`--set activation_checkpointing=full`): the same gradients as `none` for every parameter
(fp32, dense and MoE, fast path and plain, eager and compiled), each layer really recomputed in backward, and a
training run that logs the same losses."""
from __future__ import annotations

import json

import pytest
import torch

from gated_attention.train import fastpath
from gated_attention.train.config import apply_overrides, tiny
from gated_attention.train.model_setup import apply_activation_checkpointing
from gated_attention.train.monitors import decoder_layers
from gated_attention.train.trainer import train
from gated_attention.util.errors import UserError
from harness import tiny_lm


def _grads(mode: str, preset: str = "tiny", fast: bool = True, compile_backend: str | None = None,
           calls: list | None = None) -> tuple[float, dict]:
    """Loss and every parameter's gradient after one forward/backward of a fresh seeded model."""
    model = tiny_lm("sdpa_elementwise", preset=preset, eval=False, seed=0)
    model.train()
    layers = decoder_layers(model)
    plan = fastpath.prepare(type("C", (), {"fast": fast, "compile": "false"})(), model, layers, torch.device("cpu"))
    if compile_backend is not None:
        plan = fastpath.SpeedPlan(fast, "true", plan.fused_layers, plan.fused_loss, layers, torch.device("cpu"),
                                  backend=compile_backend)
    assert apply_activation_checkpointing(layers, mode) == (len(layers) if mode == "full" else 0)
    if calls is not None:  # forward calls of the first layer's attention: 2 per step when it is recomputed
        layers[0].self_attn.register_forward_pre_hook(lambda *_: calls.append(torch.is_grad_enabled()))
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


def test_full_checkpointing_recomputes_each_layer_in_backward():
    calls_none, calls_full = [], []
    _grads("none", calls=calls_none)
    _grads("full", calls=calls_full)
    assert len(calls_none) == 1
    assert len(calls_full) == 2  # the forward, then its recomputation inside backward


def test_full_checkpointing_composes_with_the_compiled_layer_forward():
    loss_none, g_none = _grads("none")
    loss_full, g_full = _grads("full", compile_backend="aot_eager")  # the trainer's compiled layer graph
    assert loss_full == pytest.approx(loss_none, rel=1e-6)
    _assert_same_grads(g_none, g_full)


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
