"""`gattn plan` (train/plan.py) and the paper's training presets: the JSON contract, the meta-device build, the
numbers against a hand computation and against what autograd really saves, fits / does not fit, the trainer's refusal
naming `gattn plan`, and the three paper presets training a few steps shrunk at 2 ranks."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from gated_attention import cli
from gated_attention.presets import param_report
from gated_attention.train import plan as PL
from gated_attention.train.config import accum_for
from gated_attention.train.plan_comm import Topology
from gated_attention.train.train_presets import train_preset
from gated_attention.train.overrides import apply_overrides
from harness import torchrun_argv

PAPER = ("paper-dense-28l", "paper-dense-48l", "paper-moe-15a2b")
FLAT_10 = Topology(nvlink_gbs=10.0, network_gbs=10.0, nvlink_us=0.0, network_us=0.0)  # one bandwidth, no latency


def plan_json(*args) -> dict:
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert cli.main(["plan", *args, "--json"]) == 0
    return json.loads(buf.getvalue())  # stdout holds only the object


def test_json_contract():
    p = plan_json("--preset", "paper-dense-28l", "--gpus", "8")
    assert list(p)[:len(PL.JSON_KEYS)] == list(PL.JSON_KEYS)
    mem = p["memory_per_gpu_gb"]
    assert {"params", "grads", "optimizer", "activations", "total"} <= set(mem)
    step = sum(mem[k] for k in PL.STEP_KEYS) - min(mem["loss"], mem["backward_buffers"])  # never both at once
    assert mem["total"] == pytest.approx(max(step, sum(mem[k] for k in PL.EVAL_KEYS) - mem["backward_buffers"]))
    assert isinstance(p["fits"], bool) and p["tokens_per_s"] > 0 and p["days"] > 0
    assert p["params_total"] == param_report(PL.meta_model(train_preset("paper-dense-28l")).config)["total"]
    s = p["settings"]  # the preset's recipe as planned
    assert (s["dist"], s["precision"], s["activation_checkpointing"], s["seq_len"], s["micro_batch"]) == \
        ("fsdp", "bf16-params", "full", 4096, 1)
    assert s["grad_accum"] == 1024 // 8


def test_table_and_flags():
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert cli.main(["plan", "--preset", "paper-dense-48l", "--gpus", "4", "--dist", "fsdp", "--seq-len", "2048",
                         "--micro-batch", "2", "--activation-checkpointing", "none", "--mfu", "0.3"]) == 0
    text = buf.getvalue()
    assert "memory / GPU" in text and "micro-batch 2 x grad_accum 128" in text and "seq 2048" in text


def test_bad_split_is_one_line(capsys):
    assert cli.main(["plan", "--preset", "paper-dense-48l", "--gpus", "4", "--micro-batch", "3", "--json"]) == 2
    err = capsys.readouterr()
    assert err.out == "" and "not divisible" in err.err and len(err.err.strip().splitlines()) == 1


def test_meta_build_holds_no_memory():
    """The 15A2B model (62 GB of fp32 weights, more than this machine has) is planned in shapes only: its meta build
    and plan, in a fresh process with the peak RSS reset just before, grow the process by well under 1 GB."""
    import memprobe

    got = memprobe.run_peak(
        "from gated_attention.train import plan as PL\nfrom gated_attention.train.train_presets import train_preset\n"
        "cfg = train_preset('paper-moe-15a2b')",
        "model = PL.meta_model(cfg)\nsz = PL.sizes(model)\n"
        "out.update(meta=all(p.is_meta for p in model.parameters()), total=sz['total'], activated=sz['activated'])")
    assert got["grown"] < 1e9, got["grown"]  # building it for real would take total * 4 bytes = 62 GB
    assert got["meta"]
    ref = param_report(PL.meta_model(train_preset("paper-moe-15a2b")).config)
    assert (got["total"], got["activated"]) == (ref["total"], ref["activated"])  # 15.58B / 1.99B


def tiny_cfg(*sets):
    return apply_overrides(train_preset("tiny"), ["precision=fp32", "seq_len=32", "batch_size=4", *sets])


def test_numbers_equal_a_hand_computation():
    """The tiny model (vocab 128, d 32, FFN 64, 2 layers, 4 q / 2 kv heads of 8, tied), counted by hand."""
    d, f, L, H, KV, D, V, T = 32, 64, 2, 4, 2, 8, 128, 32
    attn = d * H * D + 2 * d * KV * D + H * D * d  # q, k, v, o projections
    layer = attn + 2 * D + 2 * d + 3 * d * f  # + QK-norm weights, the two RMSNorms, SwiGLU
    total = V * d + d + L * layer  # tied embedding, final norm
    matmul = L * (attn + 3 * d * f) + V * d  # every GEMM weight, the (tied) lm_head included
    flops = 6 * matmul + 6 * L * H * D * (T + 1)
    p = PL.plan(tiny_cfg(), gpus=1, gpu_memory_gb=1.0, mfu=0.5, gpu_tflops=100.0, device="cpu")
    assert (p["params_total"], p["params_activated"], p["flops_per_token"]) == (total, total, flops)
    m = p["memory_per_gpu_gb"]
    assert m["params"] * 1e9 == pytest.approx(4 * total) and m["grads"] * 1e9 == pytest.approx(4 * total)
    assert m["optimizer"] * 1e9 == pytest.approx(8 * total) and m["buffers"] == 0
    assert p["tokens_per_s"] == pytest.approx(0.5 * 100e12 / flops)
    cfg = tiny_cfg()
    assert p["days"] == pytest.approx(cfg.steps * cfg.batch_size * T / p["tokens_per_s"] / 86400)
    # two ranks: FSDP2 shards params, grads and moments; DDP keeps them whole and adds its gradient buckets
    fs = PL.plan(tiny_cfg("dist=fsdp"), gpus=2, device="cpu")["memory_per_gpu_gb"]
    dd = PL.plan(tiny_cfg("dist=ddp"), gpus=2, device="cpu")["memory_per_gpu_gb"]
    assert fs["params"] * 1e9 == pytest.approx(2 * total) and fs["optimizer"] * 1e9 == pytest.approx(4 * total)
    root_and_layer = 2 * (V * d + d) * 4 + layer * (2 * 4 + 4 + 4)  # root gathered (+ its grad), 2 layers, 1 grad
    assert fs["buffers"] * 1e9 == pytest.approx(root_and_layer)
    assert dd["params"] * 1e9 == pytest.approx(4 * total) and dd["buffers"] * 1e9 == pytest.approx(4 * total)
    # bf16-params in one process: the fp32 master and its bf16 compute twin
    bp = PL.plan(tiny_cfg("precision=bf16-params"), gpus=1, device="cpu")["memory_per_gpu_gb"]
    assert bp["params"] * 1e9 == pytest.approx(6 * total)


def test_gradients_follow_the_accumulation_policy():
    """Under FSDP2 with grad_accum > 1 the plan counts the gradients the trainer holds, by the trainer's own policy
    function (train.memory_decision.unsharded_accumulation): sharded (4 B / N) by default; accum_grads=auto plans
    whole ones plus the sharded output (4 B + 4 B / N) only where those fit the GPU's memory, at the byte."""
    Pt = PL.plan(tiny_cfg(), gpus=1, device="cpu")["params_trainable"]
    cfg = tiny_cfg("dist=fsdp", "grad_accum=2")  # 4 sequences = 2 ranks x 2 micro-batches of 1
    sh = PL.plan(cfg, gpus=2, gpu_memory_gb=1e3, device="cpu")
    assert sh["settings"]["grad_accumulation"] == "sharded"
    assert sh["memory_per_gpu_gb"]["grads"] * 1e9 == pytest.approx(4 * Pt / 2)
    auto = replace(cfg, accum_grads="auto")
    room = sh["memory_per_gpu_gb"]["total"]  # the sharded plan's total: what whole gradients must fit beside
    fits = PL.plan(auto, gpus=2, gpu_memory_gb=room + 4 * Pt / 1e9, device="cpu")
    assert fits["settings"]["grad_accumulation"] == "unsharded"
    assert fits["memory_per_gpu_gb"]["grads"] * 1e9 == pytest.approx(4 * Pt + 4 * Pt / 2)
    assert fits["memory_per_gpu_gb"]["total"] == pytest.approx(room + 4 * Pt / 1e9)
    tight = PL.plan(auto, gpus=2, gpu_memory_gb=room + (4 * Pt - 8) / 1e9, device="cpu")
    assert tight["settings"]["grad_accumulation"] == "sharded"
    # one process and DDP hold whole gradients whatever the policy; one micro-batch needs no choice
    assert PL.plan(replace(auto, dist="ddp"), gpus=2, device="cpu")["settings"]["grad_accumulation"] == "whole"
    one = PL.plan(replace(auto, grad_accum=1), gpus=2, gpu_memory_gb=1e3, device="cpu")
    assert one["settings"]["grad_accumulation"] == "sharded"
    # the 15A2B MoE at 64 GPUs, micro-batch 1 (16 micro-batches): a 1/64 shard of the fp32 gradients, not all 62 GB
    moe = PL.plan(train_preset("paper-moe-15a2b"), gpus=64)
    assert moe["settings"]["grad_accumulation"] == "sharded" and moe["settings"]["grad_accum"] == 16
    assert moe["memory_per_gpu_gb"]["grads"] == pytest.approx(4 * moe["params_trainable"] / 64 / 1e9)


def test_loss_stats_eval_and_communication_equal_a_hand_computation():
    """The parts a run holds beside its weights and activations, and the communication `days` includes, by hand on
    the tiny model (vocab 128, d 32, fp32) and at the paper presets' 151,936-token vocabulary."""
    d, V, T = 32, 128, 32
    total = PL.plan(tiny_cfg(), gpus=1, device="cpu")["params_total"]
    p = PL.plan(tiny_cfg("stats_every=10", "eval_batch_size=4"), gpus=1, gpu_memory_gb=1.0, mfu=0.5,
                gpu_tflops=100.0, device="cpu")
    m = p["memory_per_gpu_gb"]
    tokens = 4 * T  # micro-batch 4 x 32
    chunk = min(tokens, 256 * 2 ** 20 // (V * 4))  # the chunked loss's byte-budget chunk: all 128 tokens here
    assert m["loss"] * 1e9 == pytest.approx(2 * 4 * chunk * V)  # fp32 logits + grad; fp32 adds no (V, d) product
    assert m["stats"] * 1e9 == pytest.approx(4 * total)  # the stats step's fp32 parameter snapshot
    assert m["eval"] * 1e9 == pytest.approx(4 * chunk * V + 4 * tokens)  # one chunk's fp32 logits + token losses
    step = sum(m[k] for k in ("params", "grads", "optimizer", "activations", "loss", "stats", "buffers", "overhead"))
    assert m["backward_buffers"] == 0  # one process: no FSDP2 gradient buffers, so the parts add up
    assert m["total"] == pytest.approx(max(step, m["params"] + m["optimizer"] + m["buffers"] + m["overhead"]
                                           + m["eval"]))
    off = PL.plan(tiny_cfg("stats_every=0"), gpus=1, device="cpu")["memory_per_gpu_gb"]
    assert off["stats"] == 0
    plain = PL.plan(tiny_cfg("fast=false"), gpus=1, device="cpu")["memory_per_gpu_gb"]
    assert plain["loss"] * 1e9 == pytest.approx(2 * 4 * tokens * V)
    # the paper presets: evaluation's (4, 4096) batch scored in chunks, no (4, 4096, 151,936) logits
    paper = PL.plan(train_preset("paper-dense-28l"), gpus=8)
    assert paper["settings"]["vocab_size"] == 151936 and paper["settings"]["eval_batch_size"] == 4
    chunk = 256 * 2 ** 20 // (151936 * (4 + 2))  # 294 tokens: fp32 logits + their bf16 copy within 256 MiB
    assert chunk == 294
    assert paper["memory_per_gpu_gb"]["eval"] * 1e9 == pytest.approx((2 + 4) * chunk * 151936 + 4 * 4 * 4096)
    assert paper["memory_per_gpu_gb"]["loss"] * 1e9 == pytest.approx((4 + 2 + 4) * chunk * 151936 + 4 * 151936 * 2048)
    # communication at 2 ranks, grad_accum 2, fp32, 10 GB/s: FSDP2 all-gathers the first layer twice per
    # micro-batch (forward, backward), the last layer and the root (embedding, final norm) once (the default gather
    # policy: test_gather_policy_equals_a_hand_computation), and reduce-scatters the gradients once per micro-batch,
    # each moving half of the tensor; DDP all-reduces once per step
    fs = PL.plan(tiny_cfg("dist=fsdp", "grad_accum=2"), gpus=2, device="cpu", topo=FLAT_10, mfu=0.5,
                 gpu_tflops=1e-6)
    c = fs["comm_per_step"]
    root = V * d + d
    layer = (total - root) / 2
    gathered = 2 * (root + 2 * layer + layer) * 4 / 2
    assert c["all_gather_gb"] * 1e9 == pytest.approx(gathered) and c["all_gathers"] == 2 * (1 + 2 + 1)
    assert c["reduce_gb"] * 1e9 == pytest.approx(2 * 4 * total / 2)
    assert c["seconds"] == pytest.approx((gathered + 8 * total / 2) / 10e9)
    assert c["compute_seconds"] == pytest.approx(4 * T * fs["flops_per_token"] / (0.5 * 1e-6 * 1e12 * 2))
    assert fs["tokens_per_s"] == pytest.approx(4 * T / max(c["seconds"], c["compute_seconds"]))
    slow = PL.plan(tiny_cfg("dist=fsdp", "grad_accum=2"), gpus=2, device="cpu",
                   topo=Topology(nvlink_gbs=1e-6, network_gbs=1e-6))
    assert slow["comm_per_step"]["step_seconds"] == slow["comm_per_step"]["seconds"]  # communication bounds it
    assert slow["days"] == pytest.approx(slow["token_budget"] / (4 * T / slow["comm_per_step"]["seconds"]) / 86400)
    dd = PL.plan(tiny_cfg("dist=ddp"), gpus=2, device="cpu", topo=FLAT_10)["comm_per_step"]
    assert dd["all_gather_gb"] == 0 and dd["reduce_gb"] * 1e9 == pytest.approx(2 * 4 * total / 2)
    assert PL.plan(tiny_cfg(), gpus=1, device="cpu")["comm_per_step"]["seconds"] == 0


def test_expert_parallel_and_hsdp_equal_a_hand_computation():
    """EP and HSDP by hand on the tiny MoE (8 experts of width 32, top-2, d 32, 2 MoE layers, fp32), 4 ranks,
    grad_accum 2, 10 GB/s: at rest the same 1/shard-group share as FSDP2; a layer gathers 1/E of its experts; the
    experts' collectives run over their own world / (R E) ranks; every MoE layer all-to-alls k rows of d per token
    out and back in forward and backward (and the recompute), (E-1)/E of them leaving the rank; HSDP all-reduces
    each rank's gradient shard across the replicas once per step (not per micro-batch); the all-to-all adds to the
    step, the rest overlaps compute."""
    d, I, E, k, L, T = 32, 32, 8, 2, 2, 32
    moe = lambda *sets: tiny_cfg("model=tiny-moe", "dist=fsdp", "batch_size=8", "grad_accum=2",  # noqa: E731
                                 "reshard_after_forward=always", *sets)  # every group gathered twice per micro-batch
    base = PL.plan(moe(), gpus=4, device="cpu", topo=FLAT_10)
    total, experts = base["params_total"], L * E * 3 * d * I  # gate_up (E, 2I, d) + down (E, d, I) per layer
    tokens = 1 * T  # 8 sequences / 4 ranks / 2 micro-batches
    for sets, R, ep in (([], 1, 1), (["expert_parallel=2"], 1, 2), (["expert_parallel=4"], 1, 4),
                        (["dp_replicate=2"], 2, 1), (["dp_replicate=2", "expert_parallel=2"], 2, 2)):
        p = PL.plan(moe(*sets), gpus=4, device="cpu", topo=FLAT_10, mfu=0.5, gpu_tflops=1e-3)
        S = 4 // R
        m, c, s = p["memory_per_gpu_gb"], p["comm_per_step"], p["settings"]
        assert (s["dp_replicate"], s["expert_parallel"], s["experts_per_rank"]) == (R, ep, E // ep)
        assert m["params"] * 1e9 == pytest.approx(4 * total / S) and m["optimizer"] * 1e9 == pytest.approx(8 * total / S)
        dense, f, fe = total - experts, (S - 1) / S, (S // ep - 1) / (S // ep)
        assert c["all_gather_gb"] * 1e9 == pytest.approx(2 * 2 * 4 * (dense * f + experts / ep * fe))
        assert c["reduce_gb"] * 1e9 == pytest.approx(2 * 4 * (dense * f + experts / ep * fe))
        assert c["all_reduce_gb"] * 1e9 == pytest.approx(2 * 4 * total / S * (R - 1) / R)  # once, 2 (R-1)/R
        a2a = 2 * L * tokens * k * d * 4 * 4 * (ep - 1) / ep  # 2 micro-batches, 4 passes, fp32
        assert c["all_to_all_gb"] * 1e9 == pytest.approx(a2a)
        assert c["step_seconds"] == pytest.approx(max(c["compute_seconds"], c["seconds"] - a2a / 10e9) + a2a / 10e9)
    # the gathered layer: 1/E of its experts under EP (the buffers hold the current and the prefetched layer)
    b1 = PL.plan(moe(), gpus=4, device="cpu")["memory_per_gpu_gb"]["buffers"]
    b4 = PL.plan(moe("expert_parallel=4"), gpus=4, device="cpu")["memory_per_gpu_gb"]["buffers"]
    assert (b1 - b4) * 1e9 == pytest.approx(experts / L * (1 - 1 / 4) * (2 * 4 + 4 + 4))
    # activation checkpointing replays the forward's all-to-alls: 6 passes instead of 4
    ac = PL.plan(moe("expert_parallel=2", "activation_checkpointing=full"), gpus=4, device="cpu")
    assert ac["comm_per_step"]["all_to_all_gb"] * 1e9 == pytest.approx(2 * L * tokens * k * d * 4 * 6 / 2)
    # the 15A2B MoE at 64 GPUs with EP=8: 16 experts per rank, the all-to-all in the table
    big = PL.plan(apply_overrides(train_preset("paper-moe-15a2b"), ["expert_parallel=8"]), gpus=64)
    assert big["settings"]["experts_per_rank"] == 16 and big["comm_per_step"]["all_to_all_gb"] > 0
    assert big["comm_per_step"]["total_gb"] < PL.plan(train_preset("paper-moe-15a2b"), gpus=64)["comm_per_step"]["total_gb"]
    with pytest.raises(Exception, match="expert_parallel=3 does not divide the 8 routed experts"):
        PL.plan(replace(moe(), expert_parallel=3, batch_size=12), gpus=3, device="cpu")


def test_gather_policy_equals_a_hand_computation():
    """FSDP2's gather policy in the plan (train.fsdp_policy, the function the trainer applies), by hand on the tiny
    model with 4 layers at 2 ranks, grad_accum 2: the all-gathers per step and the bytes they move (half of a
    group's parameters each, in the compute dtype), and the layers the buffers hold gathered (the root and its
    gradient, the gathered layers, one layer's gradients in the compute dtype and fp32); the gradients exist in the
    backward only, the fused loss's temporaries in the forward only, so the total counts the larger of the two. keep_gathered=auto keeps
    the parameters gathered only where the whole gathered model fits beside the rest, at the byte; nothing to keep
    across one micro-batch. The all-gathers a run really makes: tests/test_fsdp_policy.py."""
    d, f, H, KV, D, V, L = 32, 64, 4, 2, 8, 128, 4
    layer = d * H * D + 2 * d * KV * D + H * D * d + 2 * D + 2 * d + 3 * d * f  # 9296
    root = V * d + d  # tied embedding and head, final norm

    def cfg(*sets):
        return tiny_cfg("dist=fsdp", "grad_accum=2", f"model.num_hidden_layers={L}", *sets)

    cases = {  # settings -> (all-gathers per step: the root's, each layer's), layers held gathered, kept
        (): ((2, 4, 4, 4, 2), 2, False), ("reshard_after_forward=always",): ((4, 4, 4, 4, 4), 2, False),
        ("reshard_after_forward=never",): ((2, 2, 2, 2, 2), L, False), ("fsdp_prefetch=2",): ((2, 4, 4, 4, 2), 3, False),
        ("fsdp_prefetch=9",): ((2, 4, 4, 4, 2), L, False), ("keep_gathered=true",): ((1, 1, 1, 1, 1), L, True),
        ("keep_gathered=true", "grad_accum=1"): ((1, 2, 2, 2, 1), 2, False),  # one micro-batch: nothing to keep
        ("precision=bf16-params",): ((2, 4, 4, 4, 2), 2, False)}
    for sets, (counts, held, kept) in cases.items():
        p = PL.plan(cfg(*sets), gpus=2, device="cpu", gpu_memory_gb=1e3)
        c, m, s = p["comm_per_step"], p["memory_per_gpu_gb"], p["settings"]
        pd = 2 if "precision=bf16-params" in sets else 4
        assert c["all_gathers"] == sum(counts), sets
        assert c["all_gather_gb"] * 1e9 == pytest.approx(pd * (counts[0] * root + sum(counts[1:]) * layer) / 2), sets
        assert m["buffers"] * 1e9 == pytest.approx(2 * root * pd + held * layer * pd + layer * (pd + 4)), sets
        backward = root * pd + layer * (pd + 4)  # the root's and one layer's unsharded gradients: backward only
        assert m["backward_buffers"] * 1e9 == pytest.approx(backward), sets
        step = sum(m[k] for k in PL.STEP_KEYS) - min(m["loss"], m["backward_buffers"])  # the loss's: forward only
        assert m["total"] == pytest.approx(max(step, sum(m[k] for k in PL.EVAL_KEYS) - m["backward_buffers"])), sets
        assert s["gathered_layers"] == held and s["keep_gathered"] == kept, sets
    room = PL.plan(cfg(), gpus=2, device="cpu", gpu_memory_gb=1e3)["memory_per_gpu_gb"]["total"]
    extra = (L - 2) * layer * 4  # every layer gathered instead of two
    fits = PL.plan(cfg("keep_gathered=auto"), gpus=2, device="cpu", gpu_memory_gb=room + extra / 1e9)
    assert fits["settings"]["keep_gathered"] and fits["comm_per_step"]["all_gathers"] == 1 + L
    assert fits["memory_per_gpu_gb"]["total"] == pytest.approx(room + extra / 1e9)
    tight = PL.plan(cfg("keep_gathered=auto"), gpus=2, device="cpu", gpu_memory_gb=room + (extra - 8) / 1e9)
    assert not tight["settings"]["keep_gathered"] and tight["comm_per_step"]["all_gathers"] == 16
    assert PL.plan(cfg("keep_gathered=true"), gpus=1, device="cpu")["comm_per_step"]["all_gathers"] == 0


def test_a_gather_policy_that_does_not_fit_names_its_fix(monkeypatch):
    from gated_attention.util.errors import UserError

    monkeypatch.setattr(PL, "available_gb", lambda device, local_world=1: 0.5)  # less than the runtime itself
    with pytest.raises(UserError, match="--set keep_gathered=false, --set reshard_after_forward=default"):
        PL.check_fits(tiny_cfg("dist=fsdp", "grad_accum=2", "keep_gathered=true", "reshard_after_forward=never"),
                      torch.device("cpu"), 2, "fp32")
    with pytest.raises(UserError) as err:
        PL.check_fits(tiny_cfg("dist=fsdp", "grad_accum=2"), torch.device("cpu"), 2, "fp32")
    assert "keep_gathered" not in str(err.value)


def test_flops_equal_the_bench_count():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from bench_train import train_flops

    cfg = tiny_cfg("gate=sdpa_elementwise", "model.hidden_size=48", "model.intermediate_size=96")
    p = PL.plan(cfg, gpus=1, device="cpu")
    config = PL.meta_model(cfg).config
    assert p["flops_per_token"] == pytest.approx(train_flops(config, 1, cfg.seq_len) / cfg.seq_len)


def test_moe_activated_matmul_counts_k_experts():
    cfg = tiny_cfg("model=tiny-moe")
    model = PL.meta_model(cfg)
    c = model.config
    sz = PL.sizes(model)
    expert = 3 * c.hidden_size * c.moe_intermediate_size
    dense = sz["matmul_activated"] - c.num_hidden_layers * (c.num_experts_per_tok * expert
                                                            + c.hidden_size * c.num_experts)
    attn = 2 * c.hidden_size * c.num_attention_heads * c.head_dim + 2 * c.hidden_size * c.num_key_value_heads * c.head_dim
    assert dense == c.num_hidden_layers * attn + c.vocab_size * c.hidden_size


def saved_bytes(cfg) -> tuple[int, object, int]:
    """Bytes of the unique non-parameter storages autograd saves in one training forward of `cfg` (the trainer's
    model, fast path, precision and checkpointing) and, under activation_checkpointing=selective, the op outputs its
    cache holds (ac_probe.sac_cache), the model config, and the tokens it ran on."""
    from probes.ac_probe import sac_cache
    from gated_attention.train import fastpath
    from gated_attention.train.mixed_precision import MasterWeights
    from gated_attention.train.activation_checkpoint import apply_activation_checkpointing
    from gated_attention.train.model_setup import build_model
    from gated_attention.train.monitors import decoder_layers
    from gated_attention.util.precision import numerics

    torch.manual_seed(0)
    model = build_model(cfg)
    if cfg.precision == "bf16-params":
        model = MasterWeights(model).compute
    layers = decoder_layers(model)
    fastpath.prepare(cfg, model, layers, torch.device("cpu"), cfg.precision)
    apply_activation_checkpointing(layers, cfg.activation_checkpointing)
    model.train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    b = cfg.batch_size
    x = torch.randint(0, model.config.vocab_size, (b, cfg.seq_len + 1))
    cached_before = sac_cache()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), numerics(cfg.precision, torch.device("cpu")):
        out = model(input_ids=x[:, :-1], shift_labels=x[:, 1:], fused_loss=True, use_cache=False)
    for key, wrapper in sac_cache().items():
        if key not in cached_before and isinstance(wrapper.val, torch.Tensor):
            pack(wrapper.val)
    del out
    return sum(seen.values()), model.config, b * cfg.seq_len


SHAPE = ["model.hidden_size=96", "model.intermediate_size=160", "model.head_dim=16", "model.vocab_size=512",
         "model.num_hidden_layers=3", "compile=false", "seq_len=64", "batch_size=2"]


@pytest.mark.parametrize("precision", ["fp32", "bf16-params"])
@pytest.mark.parametrize("model", ["tiny", "tiny-moe"])
@pytest.mark.parametrize("gate", ["none", "sdpa_elementwise"])
def test_activation_formula_matches_what_autograd_saves(precision, model, gate):
    """The plan's saved-activation bytes (layers + embedding/norm/loss part) against the storages autograd holds in
    a real forward of the trainer's model: within 10 %, so the formula tracks this code rather than a textbook's."""
    cfg = tiny_cfg(f"precision={precision}", f"model={model}", f"gate={gate}", *SHAPE)
    counted, config, tokens = saved_bytes(cfg)
    a = PL.activation_bytes(config, tokens, precision, "none", fused_loss=True)
    predicted = a["saved_layers"] + a["rest"]
    assert predicted == pytest.approx(counted, rel=0.10), (predicted, counted)


@pytest.mark.parametrize("precision,checkpointing", [("fp32", "full"), ("fp32", "selective"), ("fp32", "every:2"),
                                                     ("bf16-params", "full"), ("bf16-params", "every:2"),
                                                     ("bf16-params", "selective")])
@pytest.mark.parametrize("model", ["tiny", "tiny-moe"])
@pytest.mark.parametrize("gate", ["none", "sdpa_elementwise"])
def test_checkpointing_formula_matches_what_the_forward_keeps(precision, checkpointing, model, gate, monkeypatch):
    """What every layer keeps from its forward under each checkpointing mode (plan.layer_kept_bytes: the input, plus
    under `selective` the GEMM and attention outputs; every:2 of 3 layers checkpoints layers 0 and 2) and the
    embedding/norm/loss part, against what autograd saves and the selective cache holds: within 10 %. bf16 GEMMs run
    natively here (an AVX2-only CPU's emulation computes fp32 GEMMs, whose fp32 outputs `selective` would keep: twice
    what a bf16 GEMM writes, which the plan models)."""
    monkeypatch.setenv("GATTN_BF16_GEMM", "native")
    cfg = tiny_cfg(f"precision={precision}", f"model={model}", f"gate={gate}", *SHAPE,
                   f"activation_checkpointing={checkpointing}")
    counted, config, tokens = saved_bytes(cfg)
    L = config.num_hidden_layers
    kept = sum(PL.layer_kept_bytes(config, i, tokens, precision, checkpointing) for i in range(L))
    a = PL.activation_bytes(config, tokens, precision, checkpointing, fused_loss=True)
    assert kept + a["rest"] == pytest.approx(counted, rel=0.10), (kept + a["rest"], counted)
    # ... and the plan adds the largest checkpointed layer's activations: one layer is recomputed at a time
    every = {"every:2": [0, 2]}.get(checkpointing, range(L))
    assert PL.checkpointed_layers(config, checkpointing) == list(every)
    largest = max(PL.layer_activation_bytes(config, i, tokens, precision)["total"] for i in every)
    assert a["saved_layers"] == kept + largest


def test_checkpointing_modes_equal_a_hand_computation():
    """The tiny models (d 32, 4 x 8 query heads, 2 KV heads, FFN 64; MoE: 8 experts of width 32, top-2; 2 layers)
    under each mode by hand: `selective` keeps per token the input d, the q/k/v projection q + 2kv, o_proj d, the
    attention output q and its fp32 log-sum-exp H, and the FFN's GEMM outputs (2f + d; MoE: fp32 router logits E
    and k (2I + d)); full checkpointing recomputes one forward of every layer's GEMMs (every:2: layer 0's), selective
    none; the recompute replays an MoE layer's all-to-alls (6 passes instead of 4) under full and selective."""
    d, q, kv, f, H, E, k, I, L, T = 32, 32, 16, 64, 4, 8, 2, 32, 2, 32
    dense = PL.meta_model(tiny_cfg()).config
    moe = PL.meta_model(tiny_cfg("model=tiny-moe")).config
    assert PL.selective_layer_bytes(dense, 0, T, "fp32") == T * 4 * (d + q + 2 * kv + d + q + 2 * f + d + H)
    assert PL.selective_layer_bytes(moe, 0, T, "fp32") == T * 4 * (d + q + 2 * kv + d + q + H + E + k * (2 * I + d))
    assert PL.selective_layer_bytes(dense, 0, T, "bf16-params") == T * (2 * d + 4 * H + 2 * (
        q + 2 * kv + d + q + 2 * f + d))  # bf16 stream and GEMM outputs, fp32 log-sum-exp
    assert PL.selective_layer_bytes(moe, 1, T, "bf16") == T * (4 * d + 4 * H + 4 * E + 2 * (
        q + 2 * kv + d + q + k * (2 * I + d)))  # autocast: fp32 stream and router, bf16 GEMM outputs
    assert PL.layer_kept_bytes(dense, 0, T, "fp32", "full") == T * d * 4
    whole = PL.layer_activation_bytes(dense, 1, T, "fp32")["total"]
    assert PL.layer_kept_bytes(dense, 1, T, "fp32", "every:2") == whole  # layer 1 is not checkpointed
    assert [PL.recompute_share(dense, m) for m in ("none", "full", "selective", "every:2")] == [0, 1, 0, 0.5]
    for mode, extra in (("none", 0), ("full", 1), ("selective", 0), ("every:2", 0.5)):
        p = PL.plan(tiny_cfg(f"activation_checkpointing={mode}"), gpus=1, device="cpu")
        fl = PL.flops_per_token(dense, PL.sizes(PL.meta_model(tiny_cfg()))["matmul_activated"], T)
        assert p["hardware_flops_per_token"] == p["flops_per_token"] + round(extra * fl["forward"]), mode
    a2a = lambda mode: PL.all_to_all_bytes(moe, tokens=T, precision="fp32", ep=2, checkpointing=mode)  # noqa: E731
    assert {a2a(m)[0] for m in ("none", "full", "selective", "every:2")} == {T * k * d * 4}  # one exchange's bytes
    # exchanges per layer: `selective` keeps the all-to-alls' outputs, so its recompute sends nothing again
    assert [a2a(m)[1] / L for m in ("none", "full", "selective", "every:2")] == [4, 6, 4, 5]


def test_checkpointing_modes_order_the_paper_presets_activations():
    """At the 28-layer dense preset (micro-batch 4 x 4096, bf16-params, 8 GPUs): none > every:2 > selective > full,
    and on the command line (`gattn plan --activation-checkpointing`), which refuses a bad form with the fix."""
    dense = train_preset("paper-dense-28l")
    act = {m: PL.plan(dense, gpus=8, micro_batch=4, activation_checkpointing=m)["memory_per_gpu_gb"]["activations"]
           for m in ("none", "every:2", "selective", "full")}
    assert act["none"] > act["every:2"] > act["selective"] > act["full"], act
    p = plan_json("--preset", "paper-dense-28l", "--activation-checkpointing", "selective", "--micro-batch", "4")
    assert p["settings"]["activation_checkpointing"] == "selective"
    assert p["memory_per_gpu_gb"]["activations"] == pytest.approx(act["selective"])
    err = io.StringIO()
    with pytest.raises(SystemExit), redirect_stderr(err):
        cli.main(["plan", "--preset", "paper-dense-28l", "--activation-checkpointing", "every:1"])
    assert "'every:1': N must be at least 2" in err.getvalue()


def test_fits_and_does_not_fit():
    moe = train_preset("paper-moe-15a2b")
    one = PL.plan(moe, gpus=1, gpu_memory_gb=80)
    eight = PL.plan(moe, gpus=8, gpu_memory_gb=80)
    assert not one["fits"] and one["memory_per_gpu_gb"]["params"] > 80  # 15.6B fp32 masters alone: 62 GB
    assert eight["fits"] and eight["memory_per_gpu_gb"]["total"] < one["memory_per_gpu_gb"]["total"] / 4
    # activation checkpointing is what lets 4096-token sequences of the 28-layer model sit beside the weights
    dense = train_preset("paper-dense-28l")
    full = PL.plan(dense, gpus=8, micro_batch=4)["memory_per_gpu_gb"]["activations"]
    none = PL.plan(dense, gpus=8, micro_batch=4, activation_checkpointing="none")["memory_per_gpu_gb"]["activations"]
    assert none > 5 * full


def test_trainer_refuses_a_run_that_does_not_fit(monkeypatch, tmp_path):
    from gated_attention.train.trainer import train
    from gated_attention.util.errors import UserError

    monkeypatch.setattr(PL, "available_gb", lambda device, local_world=1: 16.0)  # a 16 GB host
    with pytest.raises(UserError, match="gattn plan") as err:  # 1.7B params + AdamW in one process: ~31 GB
        train(apply_overrides(train_preset("paper-dense-28l"), ["data=synthetic"]), tmp_path / "run")
    assert "per rank at world size 1" in str(err.value) and not (tmp_path / "run" / "checkpoints").exists()
    train(tiny_cfg("steps=2", "eval_batches=1"), tmp_path / "tiny")  # a run that fits starts as before


def test_paper_presets_hold_the_papers_recipes():
    spec = {"paper-dense-28l": ("1.7b-28l", 4e-3, 95_367), "paper-dense-48l": ("1.7b-48l", 4e-3, 95_367),
            "paper-moe-15a2b": ("15a2b", 2e-3, 100_000)}
    for name, (model, lr, steps) in spec.items():
        c = train_preset(name)
        assert (c.model, c.lr, c.steps, c.batch_size, c.seq_len, c.warmup_steps, c.min_lr, c.schedule) == \
            (model, lr, steps, 1024, 4096, 1000, 3e-5, "cosine")
        assert (c.dist, c.precision, c.activation_checkpointing, c.micro_batch) == ("fsdp", "bf16-params", "full", 1)
    moe = PL.meta_model(train_preset("paper-moe-15a2b")).config
    assert moe.router_aux_loss_coef > 0 and moe.router_z_loss_coef > 0  # global-batch LBL (moe.py) and z-loss
    assert accum_for(1024, 8, 1) == 128


SHRUNK = ["model.num_hidden_layers=2", "model.hidden_size=64", "model.intermediate_size=128",
          "model.num_attention_heads=4", "model.num_key_value_heads=2", "model.head_dim=16", "model.vocab_size=256",
          "seq_len=32", "batch_size=4", "steps=3", "warmup_steps=1", "data=synthetic", "eval_batches=1",
          "eval_batch_size=2", "ckpt_every=0", "stats_every=2", "compile=false", "progress=false",
          "tensorboard=false"]
MOE_SHRUNK = ["model.num_experts=8", "model.num_experts_per_tok=2", "model.moe_intermediate_size=32"]


@pytest.mark.parametrize("name", [pytest.param("paper-dense-28l", marks=pytest.mark.slow),
                                  pytest.param("paper-dense-48l", marks=pytest.mark.slow), "paper-moe-15a2b"])
def test_paper_preset_trains_shrunk_at_two_ranks(tmp_path, name):
    """The recipe as it is (FSDP2, bf16-params, activation checkpointing, micro-batch 1 -> grad_accum 2 at 2 ranks;
    for the MoE its LBL and z-loss) on a model shrunk to seconds, under torchrun with gloo."""
    sets = SHRUNK + (MOE_SHRUNK if "moe" in name else [])
    cmd = torchrun_argv("train", "--preset", name, "--out", tmp_path, *sum((["--set", s] for s in sets), []))
    p = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    saved = json.loads((tmp_path / "train_config.json").read_text())
    assert (saved["dist"], saved["resolved_precision"], saved["activation_checkpointing"], saved["grad_accum"]) == \
        ("fsdp", "bf16-params", "full", 2)
    log = [json.loads(x) for x in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert len(log) == 3 and all(r["loss"] == r["loss"] for r in log)  # finite
    if "moe" in name:
        assert all(r["aux_loss"] > 0 for r in log) and log[0]["moe"]["z_loss"][0] > 0


def test_gpu_check_dry_run(tmp_path):
    """bench/gpu_check.sh --dry-run works without a GPU: every part's command and limit (within the script's total),
    and the plan of the paper part's exact settings."""
    root = Path(__file__).resolve().parents[1]
    bin_dir = tmp_path / "bin"  # the GPU machine's own python3 is the default interpreter (no .venv)
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bin_dir / "python3").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    env |= {"OUT": str(tmp_path / "out"), "WORK": str(tmp_path / "work"), "PYTHONPATH": str(root / "src"),
            "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    p = subprocess.run(["bash", str(root / "bench" / "gpu_check.sh"), "--dry-run"], env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    out = p.stdout
    for name in ("kernel_tests", "paper_28l", "bench_kernel", "train_triton_gated", "train_sdpa", "train_compare",
                 "fsdp_full", "fsdp_restart", "fsdp_compare"):
        assert f"== {name} (limit" in out and "would run" in out, name
    assert "would run: env TRITON_INTERPRET=0 python3 -m pytest" in out
    # every run folder (checkpoints) is under WORK, none under OUT (what comes back from the GPU machine)
    assert "--out " + str(tmp_path / "out") not in out and out.count("--out " + str(tmp_path / "work")) >= 3
    fsdp = next(line for line in out.splitlines() if line.startswith("== fsdp_restart"))
    for s in ("--nproc_per_node=1", "--max-restarts=1", "dist=fsdp", "grad_accum=4", "compile=true",
              "activation_checkpointing=selective", "keep_gathered=true", "fsdp_prefetch=2", "precision=bf16-params",
              "--resume auto", "GATTN_TEST_KILL_AT_STEP=5"):
        assert s in fsdp, s
    inside = subprocess.run(["bash", str(root / "bench" / "gpu_check.sh"), "--dry-run"],
                            env={**env, "WORK": str(tmp_path / "out" / "w")}, capture_output=True, text=True)
    assert inside.returncode == 2 and "inside OUT" in inside.stderr
    limits = [int(x) for x in __import__("re").findall(r"\(limit (\d+)s\) would run", out)]
    assert sum(limits) <= 470  # one command under 8 minutes
    assert "bench/bench_plan.py run --preset paper-dense-28l" in out
    assert "gattn plan: paper-dense-28l" in out and "bf16-params, activation checkpointing full" in out
    assert "attn_implementation=triton_gated" in out
