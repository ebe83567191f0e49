"""The run's memory decisions (train/memory_decision.py) are one object, made by the plan and applied as they are:
measured on built models — which decoder layers recompute in backward, which FSDP2 groups stay gathered after a
forward and after a micro-batch's backward, whether a micro-batch's gradients were reduced — the plan's
`MemoryDecision` is what parallelize applies, even where the config says otherwise (positive control: without a
decision the config's own settings apply), and the trainer's setup hands it the plan's decision unchanged."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from gated_attention.train import dist as D
from gated_attention.train import plan as PL
from gated_attention.train import trainer
from gated_attention.train.memory_decision import MemoryDecision, decide
from gated_attention.train.meta_init import build_on_meta, fill_model
from gated_attention.train.model_setup import build_model
from gated_attention.train.monitors import decoder_layers
from gated_attention.train.overrides import apply_overrides
from gated_attention.train.parallelize import parallelize
from gated_attention.train.plan_activations import checkpointed_layers
from gated_attention.train.train_presets import tiny

LAYERS = 3  # so that FSDP2's default policy (every layer but the last freed after forward) differs from "never"


def config(*sets):
    return apply_overrides(tiny(), ["precision=fp32", "compile=false", f"model.num_hidden_layers={LAYERS}",
                                    "stats_every=0", *sets])


def planned(cfg, gpus: int = 2, **options) -> tuple[dict, MemoryDecision]:
    """The plan of `cfg` on `gpus` CPU ranks of ample memory, and its decision."""
    return PL.plan_and_decide(cfg, gpus=gpus, device="cpu", gpu_memory_gb=1e3, **options)


def built(cfg, memory: MemoryDecision | None, info: D.DistInfo | None = None):
    """The trainer's build of `cfg` (meta, then filled by parallelize) under `memory`: the Parallel."""
    info = info or D.DistInfo()
    torch.manual_seed(0)
    model = build_on_meta(build_model, cfg, None)
    par = parallelize(model, cfg, info, "fp32", lambda m: fill_model(m, cfg, None, info.device), memory)
    par.model.train()
    return par


def batch(par, seed: int = 0) -> dict:
    ids = torch.randint(0, par.model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:], "use_cache": False}


def recomputed(par) -> list[int]:
    """The decoder layers whose forward ran twice in one training forward and backward (once more in backward)."""
    calls = [0] * len(par.layers)
    hooks = [layer.self_attn.register_forward_pre_hook(lambda m, a, i=i: calls.__setitem__(i, calls[i] + 1))
             for i, layer in enumerate(par.layers)]
    par.forward(**batch(par)).loss.backward()
    for h in hooks:
        h.remove()
    assert set(calls) <= {1, 2}, calls
    return [i for i, n in enumerate(calls) if n == 2]


@pytest.mark.parametrize("mode", ["full", "every:2", "selective"])
def test_parallelize_checkpoints_the_layers_the_decision_names(mode):
    """A decision planned under `mode` for a config that says none: the built model recomputes exactly the layers
    the plan counted for `mode`; without a decision it follows the config (none recomputed)."""
    cfg = config()
    p, decision = planned(cfg, gpus=1, activation_checkpointing=mode)
    assert decision.activation_checkpointing == mode == p["settings"]["activation_checkpointing"]
    want = sorted(checkpointed_layers(built(cfg, decision).model.config, mode))
    assert want and recomputed(built(cfg, decision)) == want
    assert recomputed(built(cfg, None)) == []  # the control: cfg's own "none"
    assert recomputed(built(replace(cfg, activation_checkpointing=mode), None)) == want


def test_trainer_setup_applies_the_plans_decision_unchanged(tmp_path, monkeypatch):
    """`_setup` plans the model it built on the meta device (no second build) and hands the plan's decision to
    parallelize: the same object the plan makes for this machine, and the layers it names recompute."""
    monkeypatch.setattr(PL, "available_gb", lambda device, local_world=1: 4.0)
    cfg = config("activation_checkpointing=every:2", "grad_accum=2")
    builds = []
    monkeypatch.setattr(PL, "meta_model", lambda *a, **k: builds.append(a) or pytest.fail("a second meta build"))
    run = trainer._setup(cfg, tmp_path, D.DistInfo(), "fp32")
    _, want = PL.plan_and_decide(cfg, gpus=1, gpu_memory_gb=4.0, precision="fp32", device="cpu",
                                 micro_batch=cfg.batch_size // cfg.grad_accum,
                                 shapes=(run.model.config, PL.sizes(run.model)))
    assert run.par.memory == want and run.par.memory.grad_accumulation == "whole" and not builds
    assert recomputed(run.par) == [0, 2]


@pytest.fixture
def one_rank_group(tmp_path):
    """A gloo process group of this process alone: FSDP2 over one rank (DistInfo as under torchrun
    --nproc_per_node=1), torn down after the test."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        yield D.DistInfo(world_size=1, mode="fsdp", group=True)
    finally:
        dist.destroy_process_group()


def gathered(par) -> list[bool]:
    """Per FSDP2 group (each decoder layer, then the root): whether it holds its parameters gathered now (FSDP2
    registers the unsharded tensors while gathered, its sharded DTensors otherwise)."""
    from torch.distributed.tensor import DTensor

    mods = [layer.self_attn.o_proj for layer in par.layers] + [par.model.model.embed_tokens]
    return [not isinstance(m.weight, DTensor) for m in mods]


def micro_batches(par, n: int = 2) -> list[dict]:
    """Run a step's `n` micro-batches through Parallel.micro_batch; per micro-batch, the groups gathered after its
    forward and after its backward, and whether every trainable parameter has its (sharded) gradient after it."""
    out = []
    for i in range(n):
        with par.micro_batch(i == n - 1):
            loss = par.forward(**batch(par, i)).loss
            after_forward = gathered(par)
            loss.backward()
        out.append({"forward": after_forward, "backward": gathered(par),
                    "grads": all(p.grad is not None for p in par.master.parameters() if p.requires_grad)})
    return out


def test_fsdp_groups_follow_the_decisions_gather_policy(one_rank_group):
    """FSDP2 over one rank: the default decision frees every layer but the last after its forward (the root kept) and
    all after backward; a decision planned with keep_gathered=true (for 2 ranks) keeps every group gathered
    through every micro-batch but the last, although this run's config says false (the control, no decision: the
    config's policy); reshard_after_forward=always frees every group, the root too."""
    cfg = config("dist=fsdp", "grad_accum=2")
    default = micro_batches(built(cfg, None, one_rank_group))
    assert [m["forward"] for m in default] == [[False, False, True, True]] * 2
    assert [m["backward"] for m in default] == [[False] * 4] * 2
    _, keep = planned(replace(cfg, keep_gathered="true"))
    assert keep.keep_gathered and keep.gather.reshard_layers == (False,) * LAYERS
    kept = micro_batches(built(cfg, keep, one_rank_group))
    assert [m["forward"] for m in kept] == [[True] * 4] * 2
    assert [m["backward"] for m in kept] == [[True] * 4, [False] * 4]
    _, always = planned(replace(cfg, reshard_after_forward="always"))
    assert [m["forward"] for m in micro_batches(built(cfg, always, one_rank_group))] == [[False] * 4] * 2


def test_gradients_accumulate_as_the_decision_says(one_rank_group):
    """FSDP2 over one rank: under the plan's "unsharded" decision (accum_grads=auto where it fits) the first
    micro-batch's gradients stay whole (no sharded gradient yet) and the last one reduces them; under "sharded" (the
    config's own, and the control) every micro-batch's are reduced at once. The run's summary word follows."""
    cfg = config("dist=fsdp", "grad_accum=2")
    _, whole = planned(replace(cfg, accum_grads="auto"))
    assert whole.grad_accumulation == "unsharded"
    par = built(cfg, whole, one_rank_group)
    assert [m["grads"] for m in micro_batches(par)] == [False, True] and par.accumulation == "unsharded"
    par = built(cfg, None, one_rank_group)
    assert [m["grads"] for m in micro_batches(par)] == [True, True] and par.accumulation == "sharded"


def test_the_plan_prints_its_decision_and_the_figures_behind_it():
    """`gattn plan`'s JSON words are the decision's; each `auto` decision engages exactly where what it adds fits
    what the memory before it left, and the decision's total is the plan's."""
    cfg = config("dist=fsdp", "grad_accum=2", "accum_grads=auto", "keep_gathered=auto")
    p, d = planned(cfg)
    s = p["settings"]
    assert (s["grad_accumulation"], s["keep_gathered"]) == (d.grad_accumulation, d.keep_gathered) == ("unsharded", True)
    assert d.total_gb == p["memory_per_gpu_gb"]["total"] and d.available_gb == 1e3
    assert d.whole_grads_gb > 0 and d.keep_gathered_gb > 0
    need = d.total_gb - d.keep_gathered_gb  # what the run needs with whole gradients and nothing kept
    for memory, kept in ((need + d.keep_gathered_gb + 1e-9, True), (need + d.keep_gathered_gb - 1e-6, False)):
        q, e = PL.plan_and_decide(cfg, gpus=2, device="cpu", gpu_memory_gb=memory)
        assert e.keep_gathered is kept and q["settings"]["keep_gathered"] is kept
        assert e.grad_accumulation == "unsharded" and e.gather_room_gb == pytest.approx(memory - need)
    line = d.describe()
    assert "whole gradients until the last micro-batch" in line and "kept gathered" in line


def test_without_a_plan_no_auto_decision_engages():
    """decide() with the memory unknown: `auto` never engages, an explicit keep_gathered=true does (FSDP2, several
    ranks, several micro-batches); outside FSDP2 the gradients are whole and nothing is kept."""
    def made(*sets, mode="fsdp", world=2):
        cfg = config("dist=fsdp", "grad_accum=2", *sets)
        decision, memory = decide(cfg, layers=LAYERS, mode=mode, world=world, grad_accum=2)
        assert memory is None and decision.total_gb is None
        return decision.grad_accumulation, decision.keep_gathered

    assert made("accum_grads=auto", "keep_gathered=auto") == ("sharded", False)
    assert made("keep_gathered=true") == ("sharded", True)
    assert made("keep_gathered=true", world=1) == ("sharded", False)
    assert made("keep_gathered=true", mode="none", world=1) == ("whole", False)


def test_a_decision_is_typed_and_fits_only_its_model():
    """An unknown accumulation word is refused; the object is frozen; a decision made for another number of decoder
    layers is refused by parallelize with one line (it would set the wrong groups' policy)."""
    _, d = planned(config(), gpus=1)
    with pytest.raises(ValueError, match="grad_accumulation='partial'"):
        replace(d, grad_accumulation="partial")
    with pytest.raises(AttributeError):
        d.activation_checkpointing = "full"
    _, other = planned(config(f"model.num_hidden_layers={LAYERS + 1}"), gpus=1)
    with pytest.raises(ValueError, match=f"made for {LAYERS + 1} decoder layers but the model has {LAYERS}"):
        built(config(), other)
    assert len(decoder_layers(built(config(), d).model)) == LAYERS
