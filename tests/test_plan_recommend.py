"""`gattn plan`'s machine model and `--recommend` (train/plan_comm.py, train/recommend.py, train/plan.py): each
collective's α-β time inside and across nodes, HSDP's layout against FSDP's, the gradients and expert shards a rank
holds under expert parallelism (placed as the trainer places them), the memory margin the `auto` policies and
`fits` leave free, and the search picking the faster of two layouts — each against a hand computation."""
from __future__ import annotations

import io
import json
import math
from contextlib import redirect_stdout
from dataclasses import replace

import pytest

from gated_attention import cli
from gated_attention.train import plan as PL
from gated_attention.train import recommend as RC
from gated_attention.train.overrides import apply_overrides
from gated_attention.train.plan_comm import Topology
from gated_attention.train.train_presets import train_preset

FLAT_10 = Topology(nvlink_gbs=10.0, network_gbs=10.0, nvlink_us=0.0, network_us=0.0)  # one bandwidth, no latency


def tiny_cfg(*sets):
    return apply_overrides(train_preset("tiny"), ["precision=fp32", "seq_len=32", "batch_size=4", *sets])


def test_collective_times_equal_a_hand_computation():
    """A 64 MB tensor's collectives on 8-GPU nodes (400 GB/s and 2 µs a step inside, 40 GB/s and 9 µs across): one
    node is the ring over NVLink; two nodes add one network step carrying 1/16 of it per rank; HSDP's replica
    all-reduce (one rank per node) is the ring over the network, twice; the all-to-all pays one latency and its
    slower link."""
    t = Topology(gpus_per_node=8, nvlink_gbs=400.0, network_gbs=40.0, nvlink_us=2.0, network_us=9.0)
    X, nvl, net = 64e6, 400e9, 40e9
    intra = 7 * 2e-6 + 7 / 8 * X / nvl
    assert t.collective("all_gather", X, 8) == pytest.approx(intra)
    assert t.collective("reduce_scatter", X, 8) == pytest.approx(intra)
    assert t.collective("all_reduce", X, 8) == pytest.approx(2 * intra)
    inter = 9e-6 + 7 * 2e-6 + X / 16 / net + 7 / 8 * X / nvl  # 2 nodes x 8
    assert t.collective("all_gather", X, 16) == pytest.approx(inter)
    assert t.collective("all_reduce", X, 4, stride=8) == pytest.approx(2 * (3 * 9e-6 + 3 / 4 * X / net))
    assert t.collective("all_gather", X, 4, stride=2) == pytest.approx(3 * 2e-6 + 3 / 4 * X / nvl)  # in one node
    assert t.collective("all_to_all", X, 8) == pytest.approx(2e-6 + 7 / 8 * X / nvl)
    assert t.collective("all_to_all", X, 16) == pytest.approx(9e-6 + max(7 / 16 * X / nvl, 8 / 16 * X / net))
    assert t.collective("all_gather", X, 1) == 0
    # at 512 GPUs a 100 MB layer (~200 KB per rank) spends as long in latency as in bytes
    big = Topology()
    latency = 63 * 10e-6 + 7 * 3e-6
    assert big.collective("all_gather", 100e6, 512) == pytest.approx(
        latency + 63 * 100e6 / 512 / 50e9 + 7 / 8 * 100e6 / 450e9)


def test_one_node_uses_nvlink_and_hsdp_differs_from_fsdp():
    """8 GPUs fit one node: the network's bandwidth changes nothing and the text says NVLink; at 64 GPUs it does.
    HSDP (8 replicas of 8-GPU shard groups) gathers inside the node and all-reduces across: not FSDP's time."""
    cfg = train_preset("paper-dense-28l")
    shapes = PL.model_shapes(cfg)
    t = lambda gpus, **k: PL.plan(cfg, gpus=gpus, shapes=shapes, topo=Topology(**k))["comm_per_step"]["seconds"]  # noqa: E731
    assert t(8) == t(8, network_gbs=1.0) and t(8, nvlink_gbs=100.0) > t(8)
    assert t(64, network_gbs=10.0) > t(64)
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert cli.main(["plan", "--preset", "paper-dense-28l", "--gpus", "8"]) == 0
    assert "assumed bandwidth: NVLink 450 GB/s" in buf.getvalue() and "in one node: NVLink only" in buf.getvalue()
    fsdp = PL.plan(cfg, gpus=64, shapes=shapes)["comm_per_step"]
    hsdp = PL.plan(replace(cfg, dp_replicate=8), gpus=64, shapes=shapes)["comm_per_step"]
    assert hsdp["all_reduce_gb"] > 0 and fsdp["all_reduce_gb"] == 0
    assert hsdp["all_gather_seconds"] < fsdp["all_gather_seconds"]  # NVLink only, no network step


def test_expert_parallel_gradients_and_shards_equal_a_hand_computation():
    """Tiny MoE (8 experts of width 32, top-2, d 32, 2 layers, fp32). Whole gradients under EP are this rank's: the
    dense parameters and its E_l experts. The experts are stored as the trainer places them: at 16 ranks with EP=4
    the experts' FSDP2 group (4 ranks) outnumbers the 2 local experts, so they are split on dim 1 (Shard(1)): 1/16
    of them per rank, as every other parameter; at 3 ranks without EP neither the 8 experts nor any dim (64, 32)
    divides by 3: whole experts, padded (3 of 8 per rank)."""
    d, I, E, L = 32, 32, 8, 2
    experts = L * E * 3 * d * I
    cfg = tiny_cfg("model=tiny-moe", "dist=fsdp", "batch_size=8", "grad_accum=2", "accum_grads=auto",
                   "expert_parallel=4")
    p = PL.plan(cfg, gpus=4, device="cpu", gpu_memory_gb=1e3)
    total = p["params_total"]
    assert p["settings"]["grad_accumulation"] == "unsharded"
    assert p["memory_per_gpu_gb"]["grads"] * 1e9 == pytest.approx(4 * total / 4 + 4 * (total - experts * 3 / 4))
    sz = PL.sizes(PL.meta_model(cfg))
    assert PL.expert_share(sz, 16, 4) == 1 / 16 and PL.expert_share(sz, 4, 4) == 1 / 4
    wide = PL.plan(replace(cfg, batch_size=32, accum_grads="sharded"), gpus=16, device="cpu", gpu_memory_gb=1e3)
    assert wide["memory_per_gpu_gb"]["params"] * 1e9 == pytest.approx(4 * total / 16)
    assert wide["settings"]["expert_sharding"].startswith("Shard(1): 2 expert(s) over 4 rank(s), each split 4 ways")
    padded = PL.plan(replace(cfg, expert_parallel=1, batch_size=12, grad_accum=1, accum_grads="sharded"), gpus=3,
                     device="cpu", gpu_memory_gb=1e3)
    assert padded["memory_per_gpu_gb"]["params"] * 1e9 == pytest.approx(4 * ((total - experts) / 3 + experts * 3 / 8))
    assert "Shard(0): 8 expert(s) over 3 rank(s), padded: 3 whole expert(s) per rank" in \
        padded["settings"]["expert_sharding"]
    # the 15A2B MoE at 8 GPUs, EP=8: whole gradients are the dense part and 16 of 128 experts (~12 GB), so auto engages
    moe = apply_overrides(train_preset("paper-moe-15a2b"), ["expert_parallel=8", "accum_grads=auto"])
    big = PL.plan(moe, gpus=8)
    s = PL.sizes(PL.meta_model(moe))
    whole = 4 * (s["trainable"] - s["experts_trainable"] * 7 / 8)
    assert big["settings"]["grad_accumulation"] == "unsharded" and whole < 13e9
    assert big["memory_per_gpu_gb"]["grads"] * 1e9 == pytest.approx(4 * s["trainable"] / 8 + whole)


def test_15a2b_expert_shards_follow_the_trainers_placement():
    """The 15A2B MoE (24 layers of 128 experts, gate_up (E, 1536, 2048), down (E, 2048, 768)) with expert_parallel=8,
    16 local experts: at 64 GPUs the 8 expert-FSDP ranks hold 2 whole experts each (Shard(0)); at 512 GPUs 64 ranks
    would pad a whole expert onto each (4x), so they split dim 1 (Shard(1)): 1/512 of the experts per GPU, by hand,
    in the stored fp32 weights and in what a layer's experts' all-gather moves."""
    moe = apply_overrides(train_preset("paper-moe-15a2b"), ["expert_parallel=8"])
    config, sz = PL.model_shapes(moe)
    per_layer = 128 * (1536 * 2048 + 2048 * 768)
    experts = 24 * per_layer
    assert sz["experts"] == experts
    whole, split = "Shard(0): 16 expert(s) over 8 rank(s), 2 per rank", "Shard(1): 16 expert(s) over 64 rank(s)"
    for gpus, placement, stored in ((64, whole, 24 * 2 * per_layer / 128), (512, split, experts / 512)):
        p = PL.plan(moe, gpus=gpus, shapes=(config, sz))
        assert p["settings"]["expert_sharding"].startswith(placement)
        dense = sz["total"] - experts
        assert p["memory_per_gpu_gb"]["params"] * 1e9 == pytest.approx(4 * (dense / gpus + stored))
        gathered = PL.fsdp_groups(sz, config, shard=gpus, ep=8)["experts"]
        assert gathered == [pytest.approx(per_layer / 8)] * 24  # each layer's 16 local experts, none padded


def test_routed_rows_get_the_imbalance_allowance_under_expert_parallelism():
    """Under EP a rank's routed rows (per token slot: its copy in and out, 2d, and the expert's gate/up/act/product,
    4I, + 32 B) are planned at 1.25x; the rest of the activations not."""
    d, I, k, L = 32, 32, 2, 2
    cfg = tiny_cfg("model=tiny-moe", "dist=fsdp", "batch_size=8", "activation_checkpointing=none")
    config = PL.meta_model(cfg).config
    tokens = PL.plan(cfg, gpus=2, device="cpu")["settings"]["micro_batch"] * 32
    one = PL.activation_bytes(config, tokens, "fp32", "none", routed=1.0)["total"]
    more = PL.activation_bytes(config, tokens, "fp32", "none", routed=PL.ROUTED_ALLOWANCE)["total"]
    routed = tokens * k * ((2 * d + 4 * I) * 4 + 32)
    assert more - one == pytest.approx(0.25 * routed * (L + 1))  # every layer, and one again as working memory
    a = PL.plan(cfg, gpus=2, device="cpu")["memory_per_gpu_gb"]["activations"]
    b = PL.plan(replace(cfg, expert_parallel=2), gpus=2, device="cpu")["memory_per_gpu_gb"]["activations"]
    assert (b - a) * 1e9 == pytest.approx(0.25 * routed * (L + 1))


def test_the_margin_refuses_what_fits_only_without_it():
    """On a GPU 8 % of its memory stays free: a plan whose total fits only into the whole memory does not fit, and
    keep_gathered=auto does not spend the margin (the same room on a CPU, with no margin, keeps them gathered)."""
    cfg = tiny_cfg("dist=fsdp", "grad_accum=2", "model.num_hidden_layers=4")
    total = PL.plan(cfg, gpus=2, device="cuda", gpu_memory_gb=1e3)["memory_per_gpu_gb"]["total"]
    assert not PL.plan(cfg, gpus=2, device="cuda", gpu_memory_gb=total * 1.0001)["fits"]
    assert not PL.plan(cfg, gpus=2, device="cuda", gpu_memory_gb=total / 0.92 * 0.9999)["fits"]
    assert PL.plan(cfg, gpus=2, device="cuda", gpu_memory_gb=total / 0.92 * 1.0001)["fits"]
    layer, L = 9296, 4  # the tiny layer's parameters (tests/test_plan.py: the gather policy by hand)
    room = total + (L - 2) * layer * 4 / 1e9  # every layer gathered instead of two
    keep = replace(cfg, keep_gathered="auto")
    assert not PL.plan(keep, gpus=2, device="cuda", gpu_memory_gb=room)["settings"]["keep_gathered"]
    kept = PL.plan(keep, gpus=2, device="cuda", gpu_memory_gb=room / 0.92 * 1.0001)
    assert kept["settings"]["keep_gathered"] and kept["memory_per_gpu_gb"]["total"] == pytest.approx(room)


def test_recommend_picks_the_faster_of_two_hand_checked_layouts(monkeypatch):
    """Tiny model at 2 ranks, 10 GB/s, no latency, compute negligible: micro-batch 1 x 2 gathers the root and the
    last layer once and the first layer twice per micro-batch and reduce-scatters per micro-batch; micro-batch 2 x 1
    does it all once. The search picks the second, at its hand-computed time, whichever comes first, and the first
    where only it fits."""
    d, V = 32, 128
    cfg = tiny_cfg("dist=fsdp")
    total = PL.plan(cfg, gpus=1, device="cpu")["params_total"]
    root = V * d + d
    layer = (total - root) / 2
    two = (2 * (root + 2 * layer + layer) * 4 / 2 + 2 * 4 * total / 2) / 10e9  # micro-batch 1, grad_accum 2
    one = ((root + 2 * layer + layer) * 4 / 2 + 4 * total / 2) / 10e9  # micro-batch 2, grad_accum 1
    A = RC.Layout("fsdp", 1, 1, "sharded", "false", "none", 1)
    B = RC.Layout("fsdp", 1, 1, "sharded", "false", "none", 2)
    machine = dict(topo=FLAT_10, gpu_tflops=1e9, device="cpu")
    for order in ([A, B], [B, A]):
        monkeypatch.setattr(RC, "layouts", lambda *a, order=order: order)
        rec = RC.recommend(cfg, gpus=2, gpu_memory_gb=1e3, **machine)
        assert rec["layout"]["micro_batch"] == 2 and rec["step_seconds"] == pytest.approx(one)
        assert "micro_batch=2" in rec["set"] and rec["layouts_fit"] == 2
    small = PL.plan(replace(cfg, grad_accum=2), gpus=2, device="cpu", gpu_memory_gb=1e3)["memory_per_gpu_gb"]["total"]
    rec = RC.recommend(cfg, gpus=2, gpu_memory_gb=small * 1.0001, **machine)  # micro-batch 2 needs more activations
    assert rec["layout"]["micro_batch"] == 1 and rec["step_seconds"] == pytest.approx(two)
    assert rec["layouts_fit"] == 1


def test_recommend_on_the_moe_preset_at_8_gpus():
    """paper-moe-15a2b on one 8 x H100 node: the recommended layout fits with the margin, is faster than the shipped
    default and reaches the compute bound (the model FLOPs at the assumed utilisation: nothing recomputed, no
    communication left outside the overlap); its --set settings planned again give the same step."""
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert cli.main(["plan", "--preset", "paper-moe-15a2b", "--gpus", "8", "--recommend", "--json"]) == 0
    p = json.loads(buf.getvalue())
    rec = p["recommended"]
    assert rec["step_seconds"] < p["comm_per_step"]["step_seconds"]
    assert rec["mfu"] == pytest.approx(p["settings"]["mfu"])
    assert rec["memory_per_gpu_gb"] <= 80 * 0.92 and math.isfinite(rec["days"])
    again = PL.plan(apply_overrides(train_preset("paper-moe-15a2b"), rec["set"]), gpus=8)
    assert again["fits"] and again["comm_per_step"]["step_seconds"] == pytest.approx(rec["step_seconds"])


def test_paper_presets_launch_with_the_recommended_layout(capsys):
    """A paper preset under torchrun takes the plan's fastest layout for the world size (the preset's as-written
    layout is the one-process fallback), planned no slower than the preset as written; a layout setting given with
    --set is held while the rest is searched; one process and the other presets keep their own settings."""
    from gated_attention.train.overrides import config_from_args

    written = replace(train_preset("paper-dense-28l"), gate="sdpa_elementwise")
    launched = config_from_args("paper-dense-28l", "sdpa_elementwise", [], "data", world=64)
    rec = RC.recommend(written, gpus=64)
    assert {k: str(getattr(launched, k)).lower() for k in RC.LAYOUT_FIELDS} == \
        {k: str(v).lower() for k, v in rec["layout"].items()}
    step = lambda c: PL.plan(c, gpus=64)["comm_per_step"]["step_seconds"]  # noqa: E731
    assert step(launched) == pytest.approx(rec["step_seconds"]) and step(launched) <= step(written)
    assert "layout: the plan's fastest for 64 ranks" in capsys.readouterr().err
    held = config_from_args("paper-dense-28l", "sdpa_elementwise", ["activation_checkpointing=full"], "data",
                            world=64)
    assert held.activation_checkpointing == "full"
    assert step(held) == pytest.approx(RC.recommend(replace(written, activation_checkpointing="full"), gpus=64,
                                                    keep=("activation_checkpointing",))["step_seconds"])
    one = config_from_args("paper-dense-28l", "sdpa_elementwise", [], "data", world=1)
    assert {k: getattr(one, k) for k in RC.LAYOUT_FIELDS} == {k: getattr(written, k) for k in RC.LAYOUT_FIELDS}
    small = config_from_args("small", None, [], "data", world=8)
    assert (small.micro_batch, small.activation_checkpointing) == (train_preset("small").micro_batch,
                                                                   train_preset("small").activation_checkpointing)
