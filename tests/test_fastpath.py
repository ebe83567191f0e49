"""The trainer's fast path (train/fastpath.py) against the plain reference: loss curves over a few steps (fp32 tight,
bf16 within its noise), checkpoints with the plain names, the compile setting and its auto rule, and the compiled
decoder-layer forward (one graph shared by every layer) against eager, forward and gradients. Tiny models only."""
from __future__ import annotations

import contextlib
import copy
import json

import pytest
import torch

from gated_attention.fused import FusedGatedAttention, fuse_qkv
from gated_attention.train import fastpath
from gated_attention.train.checkpoint import list_checkpoints
from gated_attention.train.train_presets import tiny
from gated_attention.train.overrides import apply_overrides
from gated_attention.train.monitors import decoder_layers
from gated_attention.train.model_setup import build_model_config
from gated_attention.train.trainer import train
from harness import build_lm


def _run(tmp_path, name, sets):
    out = tmp_path / name
    cfg = apply_overrides(tiny(), ["steps=6", "eval_batches=1", "stats_every=3", "ckpt_every=0", *sets])
    summary = train(cfg, out)
    losses = [json.loads(l)["loss"] for l in (out / "log.jsonl").read_text().splitlines()]
    return out, summary, losses


@pytest.mark.parametrize("gate", ["sdpa_elementwise", "sdpa_headwise"])
@pytest.mark.parametrize("precision,tol", [("fp32", 1e-5), ("bf16", 5e-3)])  # measured: 0 and 6e-5
def test_fast_loss_curve_equals_reference(tmp_path, gate, precision, tol):
    common = [f"gate={gate}", f"precision={precision}", "compile=false"]
    _, s_fast, fast = _run(tmp_path, "fast", common)
    _, s_ref, ref = _run(tmp_path, "ref", [*common, "fast=false"])
    assert s_fast["speed"]["fused_attention_layers"] == 2 and s_fast["speed"]["fused_loss"]
    assert s_ref["speed"]["fused_attention_layers"] == 0 and not s_ref["speed"]["fused_loss"]
    assert len(fast) == len(ref) == 6
    assert ref[-1] < ref[0]  # it trains, so the comparison is not between two flat curves
    for a, b in zip(fast, ref):
        assert abs(a - b) <= tol * max(1.0, abs(b)), (fast, ref)
    for d in s_ref["val_losses"]:
        assert abs(s_fast["val_losses"][d] - s_ref["val_losses"][d]) <= tol * max(1.0, s_ref["val_losses"][d])


def test_fast_checkpoints_keep_plain_names(tmp_path):
    fast_out, _, _ = _run(tmp_path, "fast", ["gate=sdpa_elementwise", "compile=false", "ckpt_every=3"])
    ref_out, _, _ = _run(tmp_path, "ref", ["gate=sdpa_elementwise", "compile=false", "ckpt_every=3", "fast=false"])
    (_, ckpt_f), (_, ckpt_r) = list_checkpoints(fast_out)[0], list_checkpoints(ref_out)[0]
    sf = torch.load(ckpt_f / "state.pt", weights_only=False)
    sr = torch.load(ckpt_r / "state.pt", weights_only=False)
    assert set(sf["model"]) == set(sr["model"]) and not any("qkvg" in k for k in sf["model"])
    assert set(sf["optimizer"]["state"]) == set(sr["optimizer"]["state"])  # AdamW moments under the plain names
    from safetensors import safe_open

    with safe_open(str(fast_out / "final" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    with safe_open(str(ref_out / "final" / "model.safetensors"), "pt") as f:
        assert keys == set(f.keys())


def test_compile_setting_parsing_and_auto_rule(tmp_path):
    for text, want in [("auto", "auto"), ("false", "false"), ("off", "false"), ("true", "true"), ("1", "true")]:
        assert apply_overrides(tiny(), [f"compile={text}"]).compile == want
    assert fastpath.compile_choice(True) == "true" and fastpath.compile_choice(False) == "false"
    with pytest.raises(ValueError, match="compile='sometimes'"):
        apply_overrides(tiny(), ["compile=sometimes"])
    assert tiny().compile == "auto" and tiny().fast is True
    # the rule: the time saved over the rest of the run must exceed the compile cost
    steps, saving = fastpath.COMPILE_COST_STEPS, fastpath.COMPILE_SAVING
    assert not fastpath.should_compile(10, 1.0)
    assert fastpath.should_compile(int(steps / saving) + 10, 1.0)  # slow steps: the cost counts in steps
    assert not fastpath.should_compile(int(steps / saving) - 10, 1.0)
    assert fastpath.should_compile(int(steps / saving) + 10, 3.0)  # ... whatever the load
    floor_steps = fastpath.COMPILE_COST_MIN_S / (0.01 * saving)  # fast steps: the floor in seconds counts
    assert not fastpath.should_compile(int(floor_steps) - 10, 0.01)
    assert fastpath.should_compile(int(floor_steps) + 10, 0.01)
    # a short run on auto decides to stay eager, after its probe steps, and says why
    _, s, _ = _run(tmp_path, "auto", ["gate=sdpa_elementwise"])
    assert s["speed"]["compile"] == "auto" and not s["speed"]["compiled"]
    assert s["speed"]["compile_decision"].startswith("compile=auto -> eager")


def test_auto_decides_once_after_probe_steps():
    plan = fastpath.SpeedPlan(True, "auto", 0, True, [torch.nn.Linear(2, 2)], torch.device("cpu"),
                              backend="aot_eager")
    assert plan.observe(100.0, 10_000) is None  # the first step is warm-up, never timed
    assert plan.observe(5.0, 10_000) is None  # one probe step: not yet
    note = plan.observe(4.0, 9_999)
    assert note is not None and plan.decision == note
    assert ("compiled" in note) == (plan.compiled_fn is not None)
    assert plan.observe(4.0, 9_998) is None  # decided once


@pytest.mark.parametrize("gate", ["baseline", "sdpa_elementwise", "sdpa_headwise"])
def test_compiled_layers_match_eager_and_share_one_graph(gate):
    """The compile=true machinery, traced with aot_eager (inductor's C++ build is too slow for the default run)."""
    from torch._dynamo.utils import counters

    cfg = apply_overrides(tiny(), [f"gate={gate}"])
    model = build_lm(build_model_config(cfg), eval=False)
    fuse_qkv(model, separate_params=True)
    ref = copy.deepcopy(model)
    layers = decoder_layers(model)
    torch._dynamo.reset()
    counters.clear()
    plan = fastpath.SpeedPlan(True, "true", 2, True, layers, torch.device("cpu"), backend="aot_eager")
    x = torch.randint(0, model.config.vocab_size, (2, 12))
    y = torch.randint(0, model.config.vocab_size, (2, 12))

    def loss_of(m, compiled):
        with plan.training_forward() if compiled else contextlib.nullcontext():
            return m(input_ids=x, shift_labels=y, fused_loss=True, use_cache=False).loss

    lc, le = loss_of(model, True), loss_of(ref, False)
    gc = torch.autograd.grad(lc, list(model.parameters()))
    ge = torch.autograd.grad(le, list(ref.parameters()))
    torch.testing.assert_close(lc, le)
    for a, b in zip(gc, ge):
        torch.testing.assert_close(a, b)
    # one graph for both layers, and one for the chunked loss's math (its 24 tokens are one chunk)
    assert counters["stats"]["unique_graphs"] == 2
    assert plan.loss_math is not None
    assert all("forward" not in vars(layer) for layer in layers)  # eval / probes after the step run eagerly
    torch._dynamo.reset()


def test_fast_path_leaves_comparison_baselines_plain():
    cfg = apply_overrides(tiny(), ["model.mechanism=sink_logits"],
                          model_fields={"mechanism": "none"})
    model = build_lm(build_model_config(cfg), seed=None, eval=False)
    plan = fastpath.prepare(cfg, model, decoder_layers(model), torch.device("cpu"))
    assert plan.fused_layers == 0 and plan.fused_loss
    assert not any(isinstance(m, FusedGatedAttention) for m in model.modules())


def test_attn_implementation_selects_the_kernel(tmp_path, monkeypatch):
    """`--set attn_implementation=eager` trains through the eager kernel (counted) to sdpa's fp32 loss curve; the
    setting is recorded in train_config.json and may change on resume (same math)."""
    from gated_attention import attention
    from gated_attention.train.resume_rule import changed_settings

    calls = []
    real = attention.KERNELS["eager"]
    monkeypatch.setitem(attention.KERNELS, "eager", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    common = ["gate=sdpa_elementwise", "precision=fp32", "compile=false"]
    out, _, eager = _run(tmp_path, "eager", [*common, "attn_implementation=eager"])
    assert calls  # the layers ran the eager kernel
    n = len(calls)
    _, _, sdpa = _run(tmp_path, "sdpa", common)
    assert len(calls) == n  # ...and the default run did not
    for a, b in zip(eager, sdpa):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), (eager, sdpa)
    saved = json.loads((out / "train_config.json").read_text())
    assert saved["attn_implementation"] == "eager"
    assert changed_settings(saved, {**saved, "attn_implementation": "sdpa"}) == []


def test_triton_gated_without_a_gpu_is_one_clear_error(tmp_path, gattn_main):
    rc, _, err = gattn_main("train", "--preset", "tiny", "--out", tmp_path / "run", "--set", "device=cpu",
                            "--set", "attn_implementation=triton_gated")
    assert rc != 0 and not (tmp_path / "run" / "final").exists()
    lines = [ln for ln in err.splitlines() if ln.strip() and "precision" not in ln]
    assert len(lines) == 1 and "needs a CUDA GPU" in lines[0] and "attn_implementation=sdpa" in lines[0], err
    with pytest.raises(ValueError, match="attn_implementation='flash'.*sdpa, eager, triton_gated"):
        apply_overrides(tiny(), ["attn_implementation=flash"])
