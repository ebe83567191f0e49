"""Tests of the MoE feed-forward (src/gated_attention/moe.py): fast path vs loop reference, loss formulas, global-batch
statistics across micro-batches and ranks, shared expert, top-k renormalisation, and parity with HF Qwen3-MoE."""
from __future__ import annotations

import socket
import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from gated_attention.moe import (
    SparseMoeBlock, collect_aux_loss, moe_stats, reset_moe_balance,
)
from gated_attention.util.bf16_emulation import emulated_bf16
from harness import assert_modules_match, stock_config, stock_lm, tiny_lm


def make_cfg(**overrides):
    cfg = dict(hidden_size=32, hidden_act="silu", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
               norm_topk_prob=True, router_aux_loss_coef=0.01, router_z_loss_coef=0.001,
               shared_expert_intermediate_size=0, moe_impl="grouped", initializer_range=0.2)
    cfg.update(overrides)
    return types.SimpleNamespace(**cfg)


def block_pair(seed=0, **overrides):
    """A loop block and a grouped block with identical weights."""
    torch.manual_seed(seed)
    ref = SparseMoeBlock(make_cfg(moe_impl="loop", **overrides))
    fast = SparseMoeBlock(make_cfg(moe_impl="grouped", **overrides))
    fast.load_state_dict(ref.state_dict())
    return ref, fast


def block_loss(block, x):
    """(output, loss) of a block for harness.assert_modules_match: a non-trivial scalar so every output element gets
    a different upstream gradient, aux loss included."""
    y = block(x)
    weights = torch.linspace(-1, 1, y.numel()).view_as(y).to(y.dtype)
    return y, (y * weights).sum() + block.aux_loss


@pytest.mark.parametrize("shared,norm", [(0, True), (24, False)])
@pytest.mark.parametrize("use_grouped_mm", [True, False])
def test_grouped_matches_loop_fp32(shared, norm, use_grouped_mm):
    # Both kernels of the fast path (torch._grouped_mm and the per-segment mm fallback) against the loop.
    ref, fast = block_pair(shared_expert_intermediate_size=shared, norm_topk_prob=norm)
    fast.use_grouped_mm = use_grouped_mm
    _, (_, g_r, _) = assert_modules_match(fast, ref, block_loss, [torch.randn(3, 7, 32)], rtol=1e-5, atol=1e-6)
    assert g_r["experts.gate_up_proj"].abs().sum() > 0 and g_r["gate.weight"].abs().sum() > 0


def test_grouped_matches_loop_unaligned_and_unused_experts():
    # d=20, I=6: row strides are not 16-byte multiples, so the segment fallback runs; 16 experts for 4 tokens
    # leaves most experts empty.
    ref, fast = block_pair(hidden_size=20, moe_intermediate_size=6, num_experts=16, num_experts_per_tok=3)
    assert_modules_match(fast, ref, block_loss, [torch.randn(1, 4, 20)], rtol=1e-5, atol=1e-6)
    assert int((ref.expert_load == 0).sum()) > 0


def test_grouped_matches_loop_bf16():
    ref, fast = block_pair(shared_expert_intermediate_size=16)
    ref.to(torch.bfloat16)
    fast.to(torch.bfloat16)
    # Different summation order of the k expert outputs: bf16 rounding (8 mantissa bits) differs slightly.
    assert_modules_match(fast, ref, block_loss, [torch.randn(2, 16, 32).to(torch.bfloat16)], rtol=2e-2, atol=2e-2)


def test_grouped_matches_loop_under_emulated_bf16_autocast():
    """precision=bf16 on an AVX2-only CPU: fp32 weights under CPU bf16 autocast with the bf16 GEMM emulation
    (util/bf16_emulation.py), whose grouped GEMMs multiply bf16 casts of the fp32 rows and experts: forward and
    gradients equal the loop's. (The grouped backward multiplied the bf16 output gradient by the fp32 experts and
    failed: a precision=bf16 MoE run on such a CPU died in its first backward.)"""
    ref, fast = block_pair()
    fast.use_grouped_mm = True

    def run(block, x):
        with emulated_bf16(), torch.autocast("cpu", dtype=torch.bfloat16):
            return block_loss(block, x)

    _, (_, g_r, _) = assert_modules_match(fast, ref, run, [torch.randn(2, 16, 32)], rtol=2e-2, atol=2e-2)
    assert g_r["experts.gate_up_proj"].dtype == torch.float32 and g_r["experts.down_proj"].abs().sum() > 0


def dense_reference(block, x):
    """Plain formula: every expert on every token, then combine the top-k with (optionally renormalised) weights."""
    h = x.reshape(-1, x.shape[-1])
    probs = torch.softmax(h @ block.gate.weight.T, dim=-1)  # (N, E)
    top_p, top_i = probs.topk(block.top_k, dim=-1)
    if block.gate.norm_topk_prob:
        top_p = top_p / top_p.sum(-1, keepdim=True)
    I = block.experts.intermediate_size
    out = torch.zeros_like(h)
    for n in range(h.shape[0]):
        for j in range(block.top_k):
            e = int(top_i[n, j])
            w_gate = block.experts.gate_up_proj[e, :I]  # (I, d)
            w_up = block.experts.gate_up_proj[e, I:]  # (I, d)
            hidden = F.silu(w_gate @ h[n]) * (w_up @ h[n])
            out[n] += top_p[n, j] * (block.experts.down_proj[e] @ hidden)
    return out.view_as(x), top_p


@pytest.mark.parametrize("impl", ["loop", "grouped"])
def test_norm_topk_prob_on_off(impl):
    torch.manual_seed(1)
    x = torch.randn(2, 5, 32)
    outs = {}
    for norm in (True, False):
        torch.manual_seed(2)
        block = SparseMoeBlock(make_cfg(norm_topk_prob=norm, moe_impl=impl, num_experts_per_tok=3))
        with torch.no_grad():
            expected, top_p = dense_reference(block, x)
            outs[norm] = block(x)
        torch.testing.assert_close(outs[norm], expected, rtol=1e-5, atol=1e-6)
        if norm:
            torch.testing.assert_close(top_p.sum(-1), torch.ones(10))
        else:
            assert bool((top_p.sum(-1) < 1).all())
    assert not torch.allclose(outs[True], outs[False])


def test_shared_expert_gate():
    torch.manual_seed(3)
    with_shared = SparseMoeBlock(make_cfg(shared_expert_intermediate_size=24))
    without = SparseMoeBlock(make_cfg(shared_expert_intermediate_size=0))
    missing, unexpected = without.load_state_dict(with_shared.state_dict(), strict=False)
    assert not missing and len(unexpected) == 4
    assert tuple(with_shared.shared_expert_gate.weight.shape) == (1, 32)
    x = torch.randn(2, 6, 32)
    with torch.no_grad():
        diff = with_shared(x) - without(x)
        se = with_shared.shared_expert
        # out += sigmoid(x . w_g) * down(silu(gate(x)) * up(x)), per token
        g = torch.sigmoid(x @ with_shared.shared_expert_gate.weight.T)  # (B, T, 1)
        shared = (F.silu(x @ se.gate_proj.weight.T) * (x @ se.up_proj.weight.T)) @ se.down_proj.weight.T
        torch.testing.assert_close(diff, g * shared, rtol=1e-5, atol=1e-6)
        with_shared.shared_expert_gate.weight.zero_()  # sigmoid(0) = 1/2
        torch.testing.assert_close(with_shared(x) - without(x), 0.5 * shared, rtol=1e-5, atol=1e-6)


def planted_block(impl="grouped"):
    """E=4 experts, d=4, router weight = 10*I so each token's logits are 10x its input: routing is chosen by hand."""
    cfg = make_cfg(hidden_size=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, moe_impl=impl,
                   router_aux_loss_coef=0.5, router_z_loss_coef=0.25)
    block = SparseMoeBlock(cfg)
    with torch.no_grad():
        block.gate.weight.copy_(10 * torch.eye(4))
    return block


# Six tokens; the two large entries of each row choose its top-2 experts.
PLANTED_X = torch.tensor([
    [1.0, 0.9, 0.0, 0.0],  # experts 0, 1
    [1.0, 0.0, 0.8, 0.0],  # 0, 2
    [0.9, 0.0, 0.0, 1.0],  # 3, 0
    [0.0, 1.0, 0.7, 0.0],  # 1, 2
    [0.0, 0.0, 1.0, 0.9],  # 2, 3
    [1.0, 0.0, 0.0, 0.6],  # 0, 3
]).view(1, 6, 4)
PLANTED_COUNTS = [4, 2, 3, 3]  # routing slots per expert: 12 = 6 tokens * k=2


def test_load_balancing_loss_hand_computation():
    block = planted_block().train()
    block(PLANTED_X)
    assert block.expert_load.tolist() == PLANTED_COUNTS
    probs = torch.softmax(10 * PLANTED_X[0], dim=-1)  # (6, 4)
    N, E, k = 6, 4, 2
    f = torch.tensor(PLANTED_COUNTS, dtype=torch.float32) / (k * N)  # fraction of routing slots per expert
    P = probs.mean(0)  # mean router probability per expert
    lbl = E * (f * P).sum()
    z = (torch.log(torch.exp(10 * PLANTED_X[0]).sum(-1)) ** 2).mean()
    torch.testing.assert_close(block.lb_loss, lbl)
    torch.testing.assert_close(block.z_loss, z)
    torch.testing.assert_close(block.aux_loss.detach(), 0.5 * lbl + 0.25 * z)
    # Perfectly balanced routing with uniform probabilities gives exactly 1.
    f_uniform, P_uniform = torch.full((4,), 0.25), torch.full((4,), 0.25)
    assert abs(float(E * (f_uniform * P_uniform).sum()) - 1.0) < 1e-7
    # The gradient flows only through P (f is a count): d aux / d router weight = 0.5 * E * sum_i f_i dP_i/dW + z part.
    w = block.gate.weight.detach().clone().requires_grad_()
    logits = PLANTED_X[0] @ w.T
    manual = 0.5 * E * (f * torch.softmax(logits, -1).mean(0)).sum() + 0.25 * (torch.logsumexp(logits, -1) ** 2).mean()
    (g_manual,) = torch.autograd.grad(manual, w)
    block.zero_grad()
    block.aux_loss.backward()
    torch.testing.assert_close(block.gate.weight.grad, g_manual)


def test_z_loss_formula_random():
    torch.manual_seed(4)
    block = SparseMoeBlock(make_cfg(initializer_range=1.0))
    x = torch.randn(2, 9, 32)
    block(x)
    logits = x.reshape(-1, 32) @ block.gate.weight.T
    expected = (torch.log(torch.exp(logits).sum(-1)) ** 2).mean()
    torch.testing.assert_close(block.z_loss, expected.detach())


def test_two_micro_batches_equal_one_big_batch():
    torch.manual_seed(5)
    block = SparseMoeBlock(make_cfg()).train()
    x = torch.randn(4, 8, 32)
    block(x)
    big = {k: v for k, v in block.load_stats().items()}
    big_counts, big_prob = block.balance.counts.clone(), block.balance.prob_sum.clone()
    reset_moe_balance(block)
    assert block.balance.counts is None
    block(x[:1])
    first_counts = block.balance.counts.clone()
    block(x[1:])
    assert not torch.equal(first_counts, big_counts)
    assert torch.equal(block.balance.counts, big_counts)
    assert block.balance.tokens == 32 and block.balance.micro_batches == 2
    torch.testing.assert_close(block.balance.prob_sum, big_prob)
    small = block.load_stats()
    assert small["expert_load"] == big["expert_load"]
    assert small["max_load_over_mean"] == pytest.approx(big["max_load_over_mean"])
    assert small["lb_loss"] == pytest.approx(big["lb_loss"], rel=1e-6)
    # The last micro-batch's loss uses the global f with its own (local) mean probabilities.
    h = x[1:].reshape(-1, 32)
    P_local = torch.softmax(h @ block.gate.weight.T, -1).mean(0)
    f_global = big_counts.float() / (2 * 32)
    torch.testing.assert_close(block.lb_loss, (8 * f_global * P_local).sum().detach())


def test_eval_does_not_accumulate_and_helpers():
    torch.manual_seed(6)
    model = nn.Sequential(SparseMoeBlock(make_cfg()), SparseMoeBlock(make_cfg(moe_impl="loop")))
    assert collect_aux_loss(model) is None and moe_stats(model) == {}
    x = torch.randn(2, 5, 32)
    model.eval()
    model(x)
    assert model[0].balance.counts is None  # eval forwards never enter the training step's global batch
    model.train()
    model(x)
    total = collect_aux_loss(model)
    torch.testing.assert_close(total, model[0].aux_loss + model[1].aux_loss)
    assert total.requires_grad
    stats = moe_stats(model)
    assert sum(stats["0/expert_load"]) == 2 * 5 * 2
    assert stats["1/dropped"] == 0 and stats["moe/dropped"] == 0
    mean_ratio = (stats["0/max_load_over_mean"] + stats["1/max_load_over_mean"]) / 2
    assert stats["moe/max_load_over_mean"] == pytest.approx(mean_ratio)
    assert stats["0/max_load_over_mean"] >= 1.0


def test_bad_config_fails_loudly():
    with pytest.raises(ValueError, match="moe_impl"):
        SparseMoeBlock(make_cfg(moe_impl="fast"))
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        SparseMoeBlock(make_cfg(num_experts_per_tok=9))


@pytest.mark.parametrize("norm", [True, False])
def test_parity_with_hf_qwen3_moe_block(norm):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    hf_cfg = Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
                            norm_topk_prob=norm, hidden_act="silu")
    torch.manual_seed(7)
    hf = Qwen3MoeSparseMoeBlock(hf_cfg)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2)
    ours = SparseMoeBlock(hf_cfg)  # a stock HF config works as-is (missing keys take their defaults)
    ours.load_state_dict(hf.state_dict(), strict=True)  # same names and shapes: no conversion
    x = torch.randn(2, 6, 32)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x), rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------------------------------
# Two ranks (gloo): global counts equal the full batch's; the probability term stays local.
# --------------------------------------------------------------------------------------------------------------
def _rank_main(rank, world, port, x, state, result_file):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        block = SparseMoeBlock(make_cfg()).train()
        block.load_state_dict(state)
        half = x.shape[0] // world
        block(x[rank * half:(rank + 1) * half])
        block(x[rank * half:(rank + 1) * half])  # a second micro-batch: counts keep accumulating
        torch.save({"counts": block.balance.counts, "tokens": block.balance.tokens,
                    "lb_loss": block.lb_loss}, f"{result_file}.{rank}")
    finally:
        dist.destroy_process_group()


def test_all_reduce_is_applied_to_counts_not_probabilities(monkeypatch):
    # In-process stand-in for a second rank: all_reduce adds that rank's packed (counts, prob sums, tokens).
    import gated_attention.moe as moe
    torch.manual_seed(12)
    block = SparseMoeBlock(make_cfg()).train()
    x = torch.randn(4, 6, 32)
    other = SparseMoeBlock(make_cfg()).train()
    other.load_state_dict(block.state_dict())
    other(x[2:])
    packed_other = torch.cat([other.balance.counts, other.balance.prob_sum, torch.tensor([other.balance.tokens])])
    calls = []

    def fake_all_reduce(t, op=None, group=None):
        calls.append(op)
        t += packed_other.to(t.dtype)

    monkeypatch.setattr(moe.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(moe.dist, "all_reduce", fake_all_reduce)
    block(x[:2])
    assert calls == [moe.dist.ReduceOp.SUM]
    full = SparseMoeBlock(make_cfg()).train()
    full.load_state_dict(block.state_dict())
    monkeypatch.undo()
    full(x)
    assert torch.equal(block.balance.counts, full.balance.counts) and block.balance.tokens == 24
    P_local = torch.softmax(x[:2].reshape(-1, 32) @ block.gate.weight.T, -1).mean(0)
    torch.testing.assert_close(block.lb_loss, (8 * full.balance.counts.float() / (2 * 24) * P_local).sum().detach())


@pytest.mark.slow  # spawns two interpreters (about 10-30 s on a shared CPU)
def test_global_counts_across_two_ranks(tmp_path):
    import torch.multiprocessing as mp
    torch.manual_seed(8)
    block = SparseMoeBlock(make_cfg()).train()
    x = torch.randn(4, 6, 32)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "r")
    mp.spawn(_rank_main, args=(2, port, x, block.state_dict(), out), nprocs=2, join=True)
    block(x)
    block(x)  # single process, whole batch twice
    for rank in range(2):
        r = torch.load(f"{out}.{rank}")
        assert torch.equal(r["counts"], block.balance.counts)
        assert r["tokens"] == block.balance.tokens
        h = x[2 * rank:2 * rank + 2].reshape(-1, 32)
        P_local = torch.softmax(h @ block.gate.weight.T, -1).mean(0)
        f_global = block.balance.counts.float() / (2 * block.balance.tokens)
        torch.testing.assert_close(r["lb_loss"], (8 * f_global * P_local).sum().detach())


# --------------------------------------------------------------------------------------------------------------
# The block inside the LM (modeling.py builds SparseMoeBlock for MoE layers and adds collect_aux_loss to the loss)
# --------------------------------------------------------------------------------------------------------------
def tiny_moe_lm(**overrides):
    return tiny_lm(preset="tiny-moe", backend=None, seed=None, eval=False, match_params=None, **overrides)


def test_tiny_moe_lm_equals_hf_qwen3_moe_by_plain_state_dict_load():
    torch.manual_seed(9)
    ours = tiny_moe_lm(norm_topk_prob=False).eval()
    hf = stock_lm(stock_config(ours.config), seed=None)  # drawn after ours, from the same seeded stream
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    ours.load_state_dict(hf.state_dict(), strict=True)  # MoE names/shapes are HF's: nothing to rename
    ids = torch.randint(0, ours.config.vocab_size, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, hf(ids).logits, rtol=1e-5, atol=1e-6)


def test_tiny_moe_lm_loop_vs_grouped_loss_and_grads():
    torch.manual_seed(10)
    fast = tiny_moe_lm(moe_impl="grouped", router_z_loss_coef=1e-3).train()
    ref = tiny_moe_lm(moe_impl="loop", router_z_loss_coef=1e-3).train()
    ref.load_state_dict(fast.state_dict())
    ids = torch.randint(0, fast.config.vocab_size, (2, 10))

    def run(model, ids):
        out = model(ids, labels=ids)
        ce = F.cross_entropy(out.logits[:, :-1].reshape(-1, model.config.vocab_size), ids[:, 1:].reshape(-1))
        torch.testing.assert_close(out.loss.detach(), (ce + out.aux_loss).detach())
        assert 0 < out.aux_loss.item() < 1  # 2 layers * (1e-3 * LBL ~ 1 + 1e-3 * z)
        return out.loss, out.loss

    assert_modules_match(fast, ref, run, [ids], rtol=1e-5, atol=1e-6, grad_rtol=1e-4, grad_atol=1e-6)


def test_tiny_moe_lm_global_batch_stats_over_micro_batches():
    torch.manual_seed(11)
    model = tiny_moe_lm().train()
    ids = torch.randint(0, model.config.vocab_size, (4, 8))
    model(ids)
    big = moe_stats(model)
    reset_moe_balance(model)
    model(ids[:2])
    model(ids[2:])
    split = moe_stats(model)
    for layer in range(model.config.num_hidden_layers):
        key = f"model.layers.{layer}.mlp"
        assert split[f"{key}/expert_load"] == big[f"{key}/expert_load"]
        assert sum(split[f"{key}/expert_load"]) == 4 * 8 * model.config.num_experts_per_tok
        assert split[f"{key}/lb_loss"] == pytest.approx(big[f"{key}/lb_loss"], rel=1e-5)


def test_tiny_moe_lm_activation_checkpointing_counts_once_and_same_grads():
    # Recompute runs the block's forward again inside backward: it must not count the micro-batch twice, and the
    # recomputed loss graph must use the same global f as the original forward.
    torch.manual_seed(13)
    plain = tiny_moe_lm(router_z_loss_coef=1e-3).train()
    ckpt = tiny_moe_lm(router_z_loss_coef=1e-3).train()
    ckpt.load_state_dict(plain.state_dict())
    ckpt.activation_checkpointing_enable()
    ids = torch.randint(0, plain.config.vocab_size, (2, 8))

    def run(model, ids):  # two micro-batches, each backpropagated before the next forward (as the trainer does)
        losses = []
        for micro in (ids[:1], ids[1:]):
            losses.append(model(micro, labels=micro, use_cache=False).loss)
            losses[-1].backward()
        return tuple(losses), None

    assert_modules_match(ckpt, plain, run, [ids], rtol=1e-5, atol=1e-7)
    for layer in range(plain.config.num_hidden_layers):
        key = f"model.layers.{layer}.mlp/expert_load"
        assert moe_stats(ckpt)[key] == moe_stats(plain)[key]
        assert sum(moe_stats(ckpt)[key]) == 2 * 8 * plain.config.num_experts_per_tok


class _HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Records every op that copies a tensor's value to the host (float(t), t.item(), t.tolist(), bool(t), ...: all
    reach aten._local_scalar_dense), i.e. every device->host sync a forward or backward makes on a GPU."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default):
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("micro_batches", [1, 3])
def test_training_forward_and_backward_read_nothing_on_the_host(micro_batches):
    """No device->host sync in an MoE layer's training forward and backward (the fast path, global-batch statistics
    over micro-batches included): one would stall FSDP2's prefetch in every layer. The statistics are read only when
    logged (moe_stats)."""
    torch.manual_seed(0)
    block = SparseMoeBlock(make_cfg(shared_expert_intermediate_size=16)).train()
    block.use_grouped_mm = True  # the grouped kernel (the per-segment fallback splits by counts on the host)
    for _ in range(micro_batches):
        x = torch.randn(2, 5, 32, requires_grad=True)
        with _HostReads() as mode:
            _, loss = block_loss(block, x)
            loss.backward()
        assert mode.reads == []
    stats = moe_stats(block)  # logging reads them, and they are the global batch's
    assert sum(stats["block/expert_load"]) == micro_batches * 10 * 2 and stats["block/lb_loss"] > 0


def test_router_gemm_in_fp32_under_bf16_autocast():
    """The router's logits are an fp32 GEMM of the hidden states under bf16 autocast (and with bf16 parameters):
    a bf16 GEMM would round near-tied experts into another top-k choice."""
    torch.manual_seed(0)
    block = SparseMoeBlock(make_cfg())
    h = torch.randn(12, 32)
    for h_in, w in ((h, block.gate.weight), (h.bfloat16(), block.gate.weight)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits, probs, top_w, top_i = block.gate(h_in)
        assert logits.dtype == probs.dtype == torch.float32
        torch.testing.assert_close(logits, h_in.float() @ w.float().t(), rtol=1e-6, atol=1e-6)
        assert torch.equal(top_i, torch.topk(probs, 2).indices) and top_w.dtype == h_in.dtype
    block = block.to(torch.bfloat16)  # bf16-params: the weights' bf16 values, multiplied in fp32
    logits = block.gate(h.bfloat16())[0]
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, h.bfloat16().float() @ block.gate.weight.float().t(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("shared", [0, 16])
def test_block_traces_without_graph_breaks_under_bf16_autocast(shared):
    """torch._dynamo.explain counts the graph breaks of the MoE block's training forward (grouped path, the fast path
    compiled layers run): none under bf16 autocast, where the grouped kernel runs on bf16 casts (its group sizes stay
    on the device) and the eager-only recompute check is skipped while tracing. In fp32 compile refuses the grouped
    kernel and the per-expert fallback reads its split sizes on the host, a break per grouped matmul: counted the
    same way, the counter's positive control."""
    counts = {}
    for autocast in (True, False):
        torch._dynamo.reset()
        torch.manual_seed(0)
        block = SparseMoeBlock(make_cfg(shared_expert_intermediate_size=shared)).train()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            counts[autocast] = torch._dynamo.explain(block)(torch.randn(2, 8, 32)).graph_break_count
    torch._dynamo.reset()
    assert counts[True] == 0 and counts[False] >= 2, counts


def test_recorded_exchange_is_computed_once_and_replayed_in_order():
    """An expert-parallel dispatch's exchange (`recorded`): computed and kept in a checkpoint's recorded forward,
    taken from the record, in call order, by its recompute, which calls nothing (no second all-to-all of counts, no
    second host read); outside a checkpoint computed every time."""
    from gated_attention.moe import RoutingRecord, recorded, routing_record, routing_replay

    calls = []

    def compute(tag):
        return lambda: calls.append(tag) or (tag, [len(calls)])

    record = RoutingRecord()
    with routing_record(record):
        first, second = recorded(compute("a")), recorded(compute("b"))
    assert calls == ["a", "b"] and len(record.exchanges) == 2
    with routing_replay(record):
        assert (recorded(compute("x")), recorded(compute("y"))) == (first, second)
    assert calls == ["a", "b"]
    recorded(compute("c"))
    recorded(compute("c"))
    assert calls == ["a", "b", "c", "c"] and len(record.exchanges) == 2


def test_recorded_collective_runs_again_under_a_checkpoint_that_keeps_collectives():
    """Under a checkpoint that keeps collectives' outputs itself (`selective`: RoutingRecord(keeps_collectives)), a
    recorded collective is neither kept nor replayed (its recompute dispatches it, to be handed the checkpoint's
    saved output), while the host read after it still is; under `full` both are replayed."""
    from gated_attention.moe import RoutingRecord, recorded, routing_record, routing_replay

    for keeps, replayed_calls in ((True, ["all_to_all", "tolist", "all_to_all"]), (False, ["all_to_all", "tolist"])):
        calls, record = [], RoutingRecord(keeps_collectives=keeps)
        with routing_record(record):
            got = recorded(lambda: calls.append("all_to_all") or "got", collective=True)
            sizes = recorded(lambda: calls.append("tolist") or [1, 2])
        with routing_replay(record):
            assert recorded(lambda: calls.append("all_to_all") or "got", collective=True) == got
            assert recorded(lambda: calls.append("tolist") or [9, 9]) == sizes == [1, 2]
        assert calls == replayed_calls and len(record.exchanges) == (1 if keeps else 2), (keeps, calls)
