"""Numerics that do not depend on the layout a run trains in: the MoE load-balancing loss's micro-batch layout (the
resume rule refuses to change it), the router kept fp32 under bf16-params (FSDP2 and the one-process twin), the
evaluation's loss without (B, T, V) logits, garbage collection at the same steps on every rank, and the CUDA
allocator's expandable segments."""
from __future__ import annotations

import gc
import os
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from gated_attention.moe import SparseMoeBlock, moe_blocks, reset_moe_balance
from gated_attention.train import dist as D
from gated_attention.train import runtime
from gated_attention.train.overrides import apply_overrides
from gated_attention.train.resume_rule import changed_settings
from gated_attention.train.train_presets import tiny
from gated_attention.train.trainer import train
from gated_attention.util.errors import UserError
from harness import tiny_lm
from test_moe import make_cfg

MOE_SETS = ["model=tiny-moe", "steps=2", "batch_size=4", "seq_len=16", "ckpt_every=1", "eval_batches=1",
            "eval_batch_size=2", "stats_every=0", "precision=fp32", "compile=false"]


# ---------------------------------------------------------------- the load-balancing loss and the micro-batch layout

def _router_grad(block: SparseMoeBlock, x: torch.Tensor, micro_batches: int) -> torch.Tensor:
    """The router's gradient of the step's mean aux loss over `micro_batches` equal micro-batches of x."""
    block.zero_grad()
    reset_moe_balance(block)
    for chunk in x.chunk(micro_batches):
        block(chunk)
        (block.aux_loss / micro_batches).backward()
    return block.gate.weight.grad.clone()


def test_load_balancing_loss_depends_on_the_micro_batch_layout_and_resume_refuses_changing_it(tmp_path):
    """The measured fact the rule rests on: the same global batch in 1 or 2 micro-batches gives the router another
    load-balancing gradient (micro-batch 1 of 2 sees only its own counts); with that loss off, the same two layouts
    agree (the positive control of the measurement). The rule: an MoE run refuses to resume at another grad_accum
    in one line, a dense run and an MoE run without the loss resume across it."""
    torch.manual_seed(0)
    x = torch.randn(4, 8, 32)
    block = SparseMoeBlock(make_cfg(router_z_loss_coef=0.0)).train()
    one, two = _router_grad(block, x, 1), _router_grad(block, x, 2)
    assert (one - two).abs().max() > 1e-3 * one.abs().max()
    block.aux_loss_coef, block.z_loss_coef = 0.0, 1e-3  # the z-loss is per token: any layout gives the same mean
    torch.testing.assert_close(_router_grad(block, x, 1), _router_grad(block, x, 2), rtol=1e-5, atol=1e-8)

    cfg = apply_overrides(tiny(), MOE_SETS)
    train(cfg, tmp_path / "moe")
    with pytest.raises(UserError, match=r"grad_accum: saved 1 vs requested 2; an MoE run's load-balancing loss"):
        train(replace(cfg, grad_accum=2), tmp_path / "moe", resume=True)
    saved = {**cfg.to_dict(), "world_size": 1}
    assert changed_settings(saved, {**saved, "grad_accum": 2}) == ["grad_accum"]
    assert changed_settings(saved, {**saved, "world_size": 2}) == []  # one micro-batch: every layout sees the batch
    two_micro = {**saved, "grad_accum": 2}
    assert changed_settings(two_micro, {**two_micro, "world_size": 2}) == ["world_size"]
    no_loss = {**saved, "model_overrides": {"router_aux_loss_coef": 0.0}}
    dense = {**tiny().to_dict(), "world_size": 1}
    for d in (no_loss, dense):
        assert changed_settings(d, {**d, "grad_accum": 2, "world_size": 2}) == []


# ---------------------------------------------------------------- the router in fp32 under bf16-params

@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield D.DistInfo(mode="fsdp", group=True)
    finally:
        dist.destroy_process_group()


def _forward_dtypes(model: torch.nn.Module) -> dict:
    """{'router': the router weight's dtype inside its forward, 'expert': the experts' , 'o_proj': attention's}."""
    seen = {}
    block = moe_blocks(model)[0][1]

    def note(name, weight):
        def hook(module, args) -> None:
            seen.setdefault(name, weight(module).dtype)
        return hook

    hooks = [block.gate.register_forward_pre_hook(note("router", lambda m: m.weight)),
             block.register_forward_pre_hook(note("expert", lambda m: m.experts.down_proj)),
             model.model.layers[0].self_attn.o_proj.register_forward_pre_hook(note("o_proj", lambda m: m.weight))]
    model(input_ids=torch.randint(0, model.config.vocab_size, (2, 8))).logits.float().sum().backward()
    for h in hooks:
        h.remove()
    return seen


def test_router_weights_stay_fp32_under_bf16_params(one_rank_group):
    """FSDP2 with the bf16 MixedPrecisionPolicy gathers every weight in bf16 but the router's (fp32, its own group,
    reduced in fp32); the one-process bf16 twin keeps it fp32 as well, so both layouts route from the same weights."""
    from torch.distributed.fsdp import FSDPModule

    from gated_attention.train.mixed_precision import MasterWeights

    torch.manual_seed(0)
    model = tiny_lm(preset="tiny-moe", eval=False)
    layers = list(model.model.layers)
    D.wrap(model, one_rank_group, layers, "bf16-params")
    routers = [b.gate for _, b in moe_blocks(model)]
    assert routers and all(isinstance(r, FSDPModule) for r in routers)
    seen = _forward_dtypes(model)
    assert seen == {"router": torch.float32, "expert": torch.bfloat16, "o_proj": torch.bfloat16}
    assert all(r.weight.grad is not None and r.weight.grad.dtype == torch.float32 for r in routers)

    torch.manual_seed(0)
    plain = tiny_lm(preset="tiny-moe", eval=False)
    twin = MasterWeights(plain).compute
    assert _forward_dtypes(twin) == {"router": torch.float32, "expert": torch.bfloat16, "o_proj": torch.bfloat16}


# ---------------------------------------------------------------- evaluation without (B, T, V) logits

class _LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an op returns while the mode is on."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


class _Wrapped(torch.nn.Module):
    """The same model behind a module of another class: evaluated through its logits (the reference)."""

    def __init__(self, model):
        super().__init__()
        self.inner = model

    def forward(self, **kw):
        return self.inner(**kw)


def test_evaluation_scores_chunks_without_full_vocabulary_logits(monkeypatch):
    """domain_losses on our LM never makes a (B, T, V) tensor (the largest is one chunk of the loss), and its losses
    equal the logits path's; the same evaluation through the logits makes the (B, T, V) tensor (the measurement's
    positive control)."""
    from gated_attention import fused
    from gated_attention.train.data_source import SyntheticSource
    from gated_attention.train.evaluate import domain_losses

    torch.manual_seed(0)
    model = tiny_lm(vocab_size=1024)  # V well above d and T, so (B, T, V) stands out of every other tensor
    V, B, T = model.config.vocab_size, 4, 64
    monkeypatch.setattr(fused, "LOSS_CHUNK_BYTES", 8 * V * 4)  # 8 tokens' fp32 logits per chunk
    source = SyntheticSource(V)
    kw = dict(seq_len=T, max_batches=2, batch_size=B, device=torch.device("cpu"), precision="fp32", positions=True)
    results = {}
    for name, m in (("chunked", model), ("logits", _Wrapped(model))):
        with _LargestTensor() as probe:
            results[name] = domain_losses(m, source, **kw)
        results[name]["largest"] = probe.numel
    assert results["logits"]["largest"] >= B * T * V
    assert results["chunked"]["largest"] <= B * T * V / 4  # the embedding (V, d) is the largest left
    for key in ("losses", "pos_loss"):
        assert results["chunked"][key] == pytest.approx(results["logits"][key], rel=1e-5)


# ---------------------------------------------------------------- garbage collection and the CUDA allocator

def test_garbage_collected_every_n_steps_with_automatic_collection_off(tmp_path, monkeypatch):
    """gc_every=2 over 5 steps: collections after steps 2 and 4 (plus one as the loop starts), automatic collection
    off inside the loop and back on after; gc_every=0 (the control) collects nothing and leaves it on."""
    calls, enabled = [], []
    real = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append(a) or real(*a))

    def hook(step, model):
        enabled.append((step, gc.isenabled(), len(calls)))

    base = apply_overrides(tiny(), ["steps=5", "batch_size=2", "seq_len=8", "ckpt_every=0", "eval_batches=1",
                                    "eval_batch_size=1", "stats_every=0", "model.num_hidden_layers=1"])
    train(replace(base, gc_every=2), tmp_path / "gc", step_hook=hook)
    assert [e[1] for e in enabled] == [False] * 5 and gc.isenabled()
    assert [e[2] for e in enabled] == [1, 1, 2, 2, 3]  # the hook runs before the step's collection
    calls.clear(), enabled.clear()
    train(replace(base, gc_every=0), tmp_path / "auto", step_hook=hook)
    assert calls == [] and [e[1] for e in enabled] == [True] * 5


def test_expandable_segments_set_for_cuda_runs_unless_the_user_set_the_allocator(monkeypatch):
    for name in runtime.ALLOC_CONF_VARS:
        monkeypatch.delenv(name, raising=False)
    D.setup("cpu", "none")
    assert not any(name in os.environ for name in runtime.ALLOC_CONF_VARS)  # a CPU run leaves it alone
    monkeypatch.setattr(D, "pick_device", lambda name, local_rank=0: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    D.setup("cuda", "none")  # one process: nothing touches CUDA before the allocator's first use
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    for name in runtime.ALLOC_CONF_VARS:  # the user's setting, under either name, is kept as it is
        monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
        monkeypatch.setenv(name, "max_split_size_mb:64")
        assert not runtime.cuda_allocator_defaults(torch.device("cuda", 0))
        assert os.environ[name] == "max_split_size_mb:64" and os.environ.get("PYTORCH_CUDA_ALLOC_CONF") in (
            None, "max_split_size_mb:64")
        monkeypatch.delenv(name)
