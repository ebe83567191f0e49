"""Expert parallelism (`expert_parallel=E`) and hybrid sharding (`dp_replicate=R`) at 2 ranks under torchrun on CPU
(gloo, fp32), against one process: the same forward and gradients, the same training run (losses and final
weights), each rank holding 1/E of the experts, DCP checkpoints that resume at another world size and another E
and under the experts' other FSDP2 placement (whole experts, or split on dim 1), `gattn convert` of a checkpoint
written under EP; and the layout errors."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from gated_attention.train.overrides import apply_overrides
from gated_attention.train.train_presets import tiny
from gated_attention.train.trainer import train
from gated_attention.util.errors import UserError
from harness import run_gattn, torchrun_argv

# a tiny MoE (8 experts, top-2) with both router losses on, so the global-batch balance loss and the z-loss train too
SETS = ["model=tiny-moe", "model.router_aux_loss_coef=0.01", "model.router_z_loss_coef=0.001", "steps=6",
        "precision=fp32", "compile=false", "stats_every=3", "ckpt_every=2", "seed=1", "dist=fsdp"]
PROBE = Path(__file__).with_name("probes") / "ep_probe.py"


def _sets(sets: list[str]) -> list[str]:
    return sum((["--set", s] for s in sets), [])


def losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "log.jsonl").read_text().splitlines()]


def weights(run: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(run / "final" / "model.safetensors")


def max_weight_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def report(what: str, run: Path, ref_losses: list[float], ref_w: dict) -> None:
    """The measured agreement, for docs/scale.md (pytest -s shows it)."""
    dl = max(abs(a - b) for a, b in zip(losses(run), ref_losses))
    print(f"{what}: max |loss difference| {dl:.2e} over {len(ref_losses)} steps, max |weight difference| "
          f"{max_weight_diff(weights(run), ref_w):.2e}")


def torchrun(out: Path, sets: list[str], env_extra: dict | None = None, resume: bool = False, nproc: int = 2):
    cmd = torchrun_argv("train", "--preset", "tiny", "--out", out, *_sets(sets), *(["--resume"] if resume else []),
                        kill_hooks=True, nproc=nproc)
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="session")  # built once per worker (tests/conftest.py: scheduling)
def reference(tmp_path_factory) -> Path:
    """One process, dist=fsdp: the meta-device build filled with the init stream every world size fills."""
    out = tmp_path_factory.mktemp("one")
    train(apply_overrides(tiny(), SETS), out)
    return out


def probe(tmp_path: Path, sets: list[str], nproc: int = 2, compiled: bool = False) -> list[dict]:
    out = tmp_path / "probe.json"
    cmd = torchrun_argv(out, *(["--compile"] if compiled else []), *_sets(sets), script=PROBE, nproc=nproc)
    p = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(out.read_text())["ranks"]


LAYOUTS = {  # name: (ranks, settings, elements of the experts a rank stores / gathers for compute, as 1/n)
    "ep2": (2, ["expert_parallel=2"], 2, 2),
    "ep2-loop": (2, ["expert_parallel=2", "model.moe_impl=loop"], 2, 2),
    "ep2-efsdp2-ac": (4, ["expert_parallel=2", "activation_checkpointing=full"], 4, 2),  # experts' FSDP2 over 2 too
    "ep2-selective": (2, ["expert_parallel=2", "activation_checkpointing=selective"], 2, 2),  # replays the all-to-all
    "hsdp2-ep2": (4, ["expert_parallel=2", "dp_replicate=2"], 2, 2),
    "hsdp2": (2, ["dp_replicate=2"], 1, 1),  # 2 replicas of a one-rank shard group: every rank holds the whole model
    "fsdp2-3experts": (2, ["model.num_experts=3"], 2, 1),  # 3 experts over 2 ranks: split on dim 1 (Shard(1))
    "ep2-efsdp2-1expert": (4, ["expert_parallel=2", "model.num_experts=2"], 4, 2),  # 1 local expert over 2: Shard(1)
}
SPLIT = {"fsdp2-3experts", "ep2-efsdp2-1expert"}  # the layouts whose experts' FSDP2 ranks do not divide them


FOUR_RANKS = {name for name, (nproc, *_) in LAYOUTS.items() if nproc > 2}  # beyond the 2-rank contract: slow marker


@pytest.mark.parametrize("layout", [pytest.param(n, marks=pytest.mark.slow) if n in FOUR_RANKS else n for n in LAYOUTS])
def test_ep_forward_and_gradients_equal_one_process(tmp_path, layout):
    """Under EP each rank's logits equal the unsharded model's bit for bit (every row meets the same expert weights),
    every gradient (gathered) equals it to float summation order, the mean loss (LM + balance + z) agrees; a rank
    stores 1/(shard group) of the experts' elements and gathers only its 1/E for compute. Also with the loop path,
    with the experts' own FSDP2 over 2 ranks under activation checkpointing (the recompute replays the all-to-all;
    under `selective` too, which keeps the GEMM outputs but no collective's),
    with 2 replicas of an EP=2 shard group (HSDP), HSDP alone (2 replicas: whole on each rank), and with the experts
    split on dim 1 where their FSDP2 ranks do not divide them (3 experts over 2 ranks; 1 local expert over an
    expert-FSDP group of 2) - and only there. What a rank stores is what the plan assumes (plan.expert_share)."""
    from gated_attention.train import plan as PL

    nproc, sets, at_rest, gathered = LAYOUTS[layout]
    ranks = probe(tmp_path, ["model.router_aux_loss_coef=0.01", "model.router_z_loss_coef=0.001", *sets], nproc)
    assert len(ranks) == nproc
    cfg = apply_overrides(tiny(), ["model=tiny-moe", "dist=fsdp", *sets])
    dims = cfg.check_world(nproc)
    share = PL.expert_share(PL.sizes(PL.meta_model(cfg)), dims.shard, dims.expert_parallel)  # what the plan assumes
    for r in ranks:
        assert r["logits"] == 0.0
        assert max(r["grads"].values()) < 1e-5, sorted(r["grads"].items(), key=lambda kv: -kv[1])[:3]
        assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-6)
        assert r["expert_local"] * at_rest == r["expert_gathered"] * gathered == r["expert_full"]
        assert r["expert_local"] == share * r["expert_full"]
        assert any("Shard(dim=1)" in p for p in r["expert_placements"]) == (layout in SPLIT), r["expert_placements"]
    print(f"{layout}: max relative gradient difference {max(max(r['grads'].values()) for r in ranks):.2e}, "
          f"expert elements {ranks[0]['expert_local']} at rest / {ranks[0]['expert_gathered']} gathered / "
          f"{ranks[0]['expert_full']}")


def test_ep_compiles_without_graph_breaks_and_equals_one_process(tmp_path):
    """The expert-parallel dispatch, grouped experts and combine trace as one graph: torch._dynamo.explain counts no
    graph break in an EP=2 MoE block's training forward under bf16 autocast (the grouped kernel) and the trainer's
    dynamo options (the split sizes' host read becomes unbacked sizes), and breaks there without them (the counter's
    positive control). The compiled layers' forward and gradients (the trainer's compiled function, aot_eager, fp32)
    equal one process as eagerly."""
    ranks = probe(tmp_path, ["model.router_aux_loss_coef=0.01", "model.router_z_loss_coef=0.001",
                             "expert_parallel=2"], compiled=True)
    for r in ranks:
        assert r["graph_breaks"] == 0 and r["graph_breaks_without_options"] > 0, r
        assert r["logits"] == 0.0
        assert max(r["grads"].values()) < 1e-5, sorted(r["grads"].items(), key=lambda kv: -kv[1])[:3]
        assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-6)
    print(f"ep2 compiled: graph breaks {ranks[0]['graph_breaks']} (without the options "
          f"{ranks[0]['graph_breaks_without_options']}), max relative gradient difference "
          f"{max(max(r['grads'].values()) for r in ranks):.2e}")


def test_selective_checkpoint_recompute_sends_no_all_to_all_again(tmp_path):
    """The all-to-alls an EP=2 model's forward and backward dispatch (a counting dispatch mode; two MoE layers, each
    three in forward: counts, rows out, rows back, and two in backward): under `selective` as many as without
    checkpointing (its recompute is handed the forward's collective outputs), under `full` more (its recompute sends
    the rows again: the positive control), with the same gradients in all three."""
    calls = {}
    for mode in ("none", "selective", "full"):
        (tmp_path / mode).mkdir()
        ranks = probe(tmp_path / mode, ["expert_parallel=2", f"activation_checkpointing={mode}"])
        assert all(max(r["grads"].values()) < 1e-5 and r["logits"] == 0.0 for r in ranks)
        assert len({r["all_to_all"] for r in ranks}) == 1
        calls[mode] = ranks[0]["all_to_all"]
    assert calls["selective"] == calls["none"] > 0 and calls["full"] > calls["none"], calls
    print(f"all-to-alls in forward + backward at EP=2: {calls}")


def test_fsdp_alone_gathers_every_expert(tmp_path):
    """The contrast: FSDP2 without EP stores half of the experts per rank but gathers all of them for compute."""
    ranks = probe(tmp_path, [])
    assert all(r["expert_local"] * 2 == r["expert_full"] == r["expert_gathered"] for r in ranks)


def test_ep_trains_like_one_process_and_resumes_across_layouts(tmp_path, reference):
    """Trained at 2 ranks with EP=2 (killed after step 4, checkpoint at 4), resumed in one process without EP: the
    losses and final weights equal the one-process run; the same for a one-process run resumed at 2 ranks with
    EP=2; `gattn convert` reads the EP-written checkpoint as the final model."""
    from gated_attention.train.checkpoint import latest_checkpoint

    ref_losses, ref_w = losses(reference), weights(reference)
    # EP=2 at 2 ranks -> one process
    out = tmp_path / "ep_to_one"
    p = torchrun(out, SETS + ["expert_parallel=2"], {"GATTN_TEST_KILL_AT_STEP": "4"})
    assert p.returncode != 0 and latest_checkpoint(out).name.endswith("4")
    assert sorted(f.name for f in (latest_checkpoint(out) / "state").iterdir()) == [".metadata", "__0_0.distcp",
                                                                                   "__1_0.distcp"]
    p = run_gattn("train", "--preset", "tiny", "--out", out, *_sets(SETS), "--resume", env={"OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    assert losses(out) == pytest.approx(ref_losses, abs=1e-5)
    assert max_weight_diff(weights(out), ref_w) < 1e-4
    report("EP=2 (2 ranks) -> 1 process", out, ref_losses, ref_w)
    # one process -> EP=2 at 2 ranks
    out = tmp_path / "one_to_ep"
    p = run_gattn("train", "--preset", "tiny", "--out", out, *_sets(SETS),
                  env={"OMP_NUM_THREADS": "1", "GATTN_TEST_KILL_AT_STEP": "2"}, kill_hooks=True)
    assert p.returncode != 0 and latest_checkpoint(out).name.endswith("2")
    trace = tmp_path / "exit.txt"
    p = torchrun(out, SETS + ["expert_parallel=2"], {"GATTN_TEST_EXIT_TRACE": str(trace)}, resume=True)
    assert p.returncode == 0, p.stderr[-3000:]
    # each rank ran its exit handlers, then left through dist.exit_process (no interpreter finalization while
    # torch 2.13 still runs the destroyed gloo groups' threads: the rare SIGABRT at exit that failed CI once)
    lines = trace.read_text().splitlines()
    for rank in ("0", "1"):
        mine = [line.split(" ")[0] for line in lines if line.split(" ")[1] == rank]
        assert mine == ["atexit", "os._exit"] and f"os._exit {rank} 0" in lines, lines
    print("threads at exit:", [line for line in lines if line.startswith("atexit")])
    assert losses(out) == pytest.approx(ref_losses, abs=1e-5)
    ep_w = weights(out)
    assert max_weight_diff(ep_w, ref_w) < 1e-4
    report("1 process -> EP=2 (2 ranks)", out, ref_losses, ref_w)
    assert json.loads((out / "summary.json").read_text())["parallel"]["expert_parallel"] == 2
    # the last checkpoint (written under EP) converts to the final model
    p = run_gattn("convert", "--from", "native", "--to", "native", latest_checkpoint(out), tmp_path / "conv")
    assert p.returncode == 0, p.stderr[-3000:]
    from safetensors.torch import load_file

    conv = load_file(tmp_path / "conv" / "model.safetensors")
    assert set(conv) == set(ep_w) and all(torch.equal(conv[k], ep_w[k]) for k in ep_w)


def split_dims(state: Path) -> set[int]:
    """The dims a DCP checkpoint's routed-expert tensors are split on among its chunks (what each rank wrote)."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(state)).read_metadata().state_dict_metadata
    return {d for k, m in meta.items() if k.endswith(("experts.gate_up_proj", "experts.down_proj"))
            for c in m.chunks for d, o in enumerate(c.offsets) if o}


@pytest.mark.slow  # three ranks on two cores (~50 s): `pytest -m slow`
def test_checkpoints_resume_across_expert_placements(tmp_path):
    """3 routed experts: at 3 ranks one whole expert each (Shard(0)), at 2 ranks each expert split on dim 1
    (Shard(1)). Trained at 3 ranks (killed after step 2, checkpoint at 2), resumed at 2 ranks (killed after step 4),
    resumed at 3 ranks to the end: each checkpoint is read under the other placement, and the losses and final
    weights equal one process's."""
    from gated_attention.train.checkpoint import latest_checkpoint

    sets = SETS + ["model.num_experts=3", "batch_size=12"]  # 12 sequences: 4 per rank at 3 ranks, 6 at 2
    ref = tmp_path / "one"
    train(apply_overrides(tiny(), sets), ref)
    out = tmp_path / "run"
    for nproc, kill, resume, split in ((3, "2", False, 0), (2, "4", True, 1)):
        p = torchrun(out, sets, {"GATTN_TEST_KILL_AT_STEP": kill}, resume=resume, nproc=nproc)
        assert p.returncode != 0 and latest_checkpoint(out).name.endswith(kill), p.stderr[-3000:]
        assert split_dims(latest_checkpoint(out) / "state") == {split}  # saved in the placement it trained in
    p = torchrun(out, sets, resume=True, nproc=3)
    assert p.returncode == 0, p.stderr[-3000:]
    assert losses(out) == pytest.approx(losses(ref), abs=1e-5)
    assert max_weight_diff(weights(out), weights(ref)) < 1e-4
    report("3 experts: Shard(0) at 3 ranks -> Shard(1) at 2 -> Shard(0) at 3", out, losses(ref), weights(ref))


@pytest.mark.slow  # 25 s; HSDP 2x1's forward and gradients are compared by default (test_ep_forward_..._one_process)
def test_hsdp_trains_like_one_process(tmp_path, reference):
    """HSDP 2x1 (dp_replicate=2: 2 replicas of one shard each) and 1x2 (one replica sharded over both ranks) train
    like one process: the same losses and final weights."""
    ref_losses, ref_w = losses(reference), weights(reference)
    for r in (2, 1):
        out = tmp_path / f"hsdp_{r}"
        p = torchrun(out, SETS + [f"dp_replicate={r}"])
        assert p.returncode == 0, p.stderr[-3000:]
        assert losses(out) == pytest.approx(ref_losses, abs=1e-5)
        assert max_weight_diff(weights(out), ref_w) < 1e-4
        report(f"HSDP {r}x{2 // r}", out, ref_losses, ref_w)


def test_ep_under_bf16_params_gradients_as_close_as_fsdp_alone(tmp_path):
    """precision=bf16-params (FSDP2's MixedPrecisionPolicy: the experts gathered, all-to-all'd and multiplied in bf16,
    reduced in fp32) under EP=2: every gradient is as close to the fp32 one-process gradient as FSDP2 without EP at
    the same precision gets - the rule, fixed before measuring: within 2x FSDP's relative error plus one bf16 rounding
    (2^-8); a wrong expert-gradient scale (the 1/E of the all-to-all's backward) would be off by 50 % or more. The
    loss too, within one bf16 rounding. (Training runs are not compared weight by weight: AdamW turns a sign flip of
    a near-zero bf16 gradient element into a whole lr step.)"""
    base = ["model.router_aux_loss_coef=0.01", "model.router_z_loss_coef=0.001", "precision=bf16-params"]
    (tmp_path / "fsdp").mkdir()
    (tmp_path / "ep").mkdir()
    fsdp = probe(tmp_path / "fsdp", base)
    ep = probe(tmp_path / "ep", base + ["expert_parallel=2"])
    worst = 0.0
    for a, b in zip(ep, fsdp):
        assert a["expert_local"] == b["expert_local"] and a["expert_gathered"] * 2 == b["expert_gathered"]
        for name, err in a["grads"].items():
            assert err <= 2 * b["grads"][name] + 2 ** -8, (name, err, b["grads"][name])
            worst = max(worst, err / max(b["grads"][name], 1e-12))
        assert a["loss"] == pytest.approx(a["ref_loss"], rel=2 ** -8)
    print(f"bf16-params: max relative gradient error vs fp32 EP=2 {max(max(r['grads'].values()) for r in ep):.2e}, "
          f"FSDP alone {max(max(r['grads'].values()) for r in fsdp):.2e}; worst EP / FSDP ratio {worst:.2f}")


@pytest.mark.slow
def test_ep_under_compile_trains_like_one_process(tmp_path, reference):
    """compile=true under EP=2 (the decoder layers compiled before sharding, the exchange traced at unbacked split
    sizes, inductor) trains like the one-process eager run: the EP contract's 1e-4 on the final weights."""
    out = tmp_path / "ep_compiled"
    p = torchrun(out, SETS + ["expert_parallel=2", "compile=true"])
    assert p.returncode == 0, p.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["parallel"]["expert_parallel"] == 2 and summary["speed"]["compiled"] is True
    assert losses(out) == pytest.approx(losses(reference), abs=1e-5)
    assert max_weight_diff(weights(out), weights(reference)) < 1e-4
    report("EP=2 (2 ranks), compile=true -> vs 1 process eager", out, losses(reference), weights(reference))


def test_layout_errors_name_the_fix():
    """E or R that do not tile the ranks, E that does not divide the experts, a dense model, DDP: one line each."""
    from gated_attention.train.overrides import config_from_args

    cfg = apply_overrides(tiny(), ["model=tiny-moe", "dist=fsdp", "expert_parallel=2"])
    with pytest.raises(ValueError, match=r"expert_parallel=2 must divide the ranks of one shard group .*use one of \[1\]"):
        cfg.check_world(1)  # more ranks than the world has
    with pytest.raises(ValueError, match="expert_parallel=3 must divide"):
        apply_overrides(cfg, ["expert_parallel=3"]).check_world(4)
    with pytest.raises(ValueError, match="dp_replicate=3 does not divide the world size 4"):
        apply_overrides(cfg, ["dp_replicate=3", "expert_parallel=1"]).check_world(4)
    with pytest.raises(ValueError, match="expert_parallel=2 must divide the ranks of one shard group .world 4 / "
                                         "dp_replicate 4 = 1"):
        apply_overrides(cfg, ["dp_replicate=4"]).check_world(4)
    with pytest.raises(ValueError, match="needs dist=fsdp"):
        apply_overrides(cfg, ["dist=ddp"]).check_world(2)
    cfg.check_world(4)  # E=2 in a shard group of 4: efsdp 2
    with pytest.raises(ValueError, match=r"expert_parallel=3 does not divide the 8 routed experts.*\[1, 2, 4, 8\]"):
        config_from_args("tiny", None, ["model=tiny-moe", "dist=fsdp", "expert_parallel=3"], None)
    with pytest.raises(ValueError, match="no routed experts"):
        config_from_args("tiny", None, ["dist=fsdp", "expert_parallel=2"], None)
    with pytest.raises((ValueError, UserError), match="expert_parallel"):
        apply_overrides(tiny(), ["expert_parallel=0"])
