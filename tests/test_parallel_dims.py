"""The ranks' layout (train/parallel_dims.py) is validated in one object: every bad combination of world size,
dp_replicate, expert_parallel and the model's experts fails with one line naming the fix, a good one gives its
shard and expert-FSDP group sizes, and each place that checks a layout (the config at a world size, a command's
settings before launch, the plan, expert parallelism applied to a model) answers with the object's own line; the
routed experts' FSDP2 placement rule (`expert_shard_dim`) keeps whole experts where they divide and pads nothing
where any dim divides."""
from __future__ import annotations

import math
from dataclasses import FrozenInstanceError

import pytest

from gated_attention.train import plan as PL
from gated_attention.train.overrides import apply_overrides, config_from_args
from gated_attention.train.parallel_dims import ParallelDims, expert_shard_dim
from gated_attention.train.train_presets import tiny
from gated_attention.util.errors import UserError

BAD = [  # (world, dist, dp_replicate, expert_parallel, num_experts) -> the line's start
    ((4, "ddp", 2, 1, None), "dp_replicate=2 needs dist=fsdp"),
    ((4, "ddp", 1, 2, 8), "expert_parallel=2 needs dist=fsdp"),
    ((4, "fsdp", 3, 1, None), "dp_replicate=3 does not divide the world size 4"),
    ((4, "fsdp", 1, 3, None), r"expert_parallel=3 must divide the ranks of one shard group \(world 4 / dp_replicate "
                              r"1 = 4\); use one of \[1, 2, 4\]"),
    ((4, "fsdp", 4, 2, 8), r"expert_parallel=2 must divide the ranks of one shard group \(world 4 / dp_replicate 4 "
                           r"= 1\)"),
    ((4, "fsdp", 1, 4, 6), r"expert_parallel=4 does not divide the 6 routed experts .*use one of \[1, 2, 3, 6\]"),
    ((4, "fsdp", 1, 2, 0), "expert_parallel=2 but the model has no routed experts"),
    ((None, "ddp", 1, 4, 6), "expert_parallel=4 does not divide the 6 routed experts"),  # the world not known yet
]


@pytest.mark.parametrize("dims, line", BAD)
def test_each_bad_layout_is_one_line(dims, line):
    with pytest.raises(ValueError, match=line) as err:
        ParallelDims(*dims)
    assert "\n" not in str(err.value)


def test_a_good_layout_gives_its_groups():
    """world = dp_replicate x shard, shard = efsdp x expert_parallel; a layout is frozen once validated."""
    d = ParallelDims(world=16, dist="fsdp", dp_replicate=2, expert_parallel=4, num_experts=8)
    assert (d.shard, d.efsdp, d.mesh) == (8, 2, True)
    plain = ParallelDims(world=4, dist="ddp")
    assert (plain.shard, plain.efsdp, plain.mesh) == (4, 4, False)
    assert ParallelDims(world=None, dist="ddp", expert_parallel=4, num_experts=8).expert_parallel == 4  # not checked
    # against a world it does not know yet (the mesh is checked where it is)
    with pytest.raises(FrozenInstanceError):
        d.expert_parallel = 3


def test_every_check_is_the_objects():
    """The config at a world size (the mesh; check_world returns the layout), a command's settings (the model's
    experts, before the world is known), the plan (both, as the CLI's one line) and expert parallelism applied to a
    model each answer with ParallelDims' line."""
    moe = apply_overrides(tiny(), ["model=tiny-moe", "dist=fsdp", "expert_parallel=2"])
    assert moe.check_world(4) == ParallelDims(world=4, dist="fsdp", expert_parallel=2)
    with pytest.raises(ValueError, match=r"expert_parallel=2 must divide the ranks of one shard group"):
        moe.check_world(1)
    with pytest.raises(ValueError, match=r"expert_parallel=3 does not divide the 8 routed experts"):
        config_from_args("tiny", None, ["model=tiny-moe", "dist=fsdp", "expert_parallel=3"], None)
    with pytest.raises(UserError, match=r"expert_parallel=2 but the model has no routed experts .*\(gattn plan: "):
        PL.plan(apply_overrides(tiny(), ["dist=fsdp", "expert_parallel=2"]), gpus=2, device="cpu")
    assert PL.plan(moe, gpus=4, device="cpu")["settings"]["expert_parallel"] == 2


def test_expert_parallelism_refuses_a_model_it_cannot_split():
    """apply_expert_parallel checks the model in hand (a lab's own model meets no plan): a dense model, or experts
    that E does not divide, fail before any weight is touched."""
    from gated_attention.train.expert_parallel import apply_expert_parallel
    from harness import tiny_lm

    class Mesh:  # apply_expert_parallel reads only these two before the check
        def __init__(self, n):
            self.n = n

        def size(self):
            return self.n

        def get_local_rank(self):
            return 0

    with pytest.raises(ValueError, match="expert_parallel=2 but the model has no routed experts"):
        apply_expert_parallel(tiny_lm(preset="tiny"), Mesh(2))
    moe = tiny_lm(preset="tiny-moe")
    before = {k: v.clone() for k, v in moe.state_dict().items()}
    with pytest.raises(ValueError, match="expert_parallel=3 does not divide the 8 routed experts"):
        apply_expert_parallel(moe, Mesh(3))
    assert all(v.equal(before[k]) for k, v in moe.state_dict().items())


def test_expert_placement_keeps_whole_experts_where_they_divide_and_never_pads_where_it_can_split():
    """The 15A2B MoE's fused tensors (gate_up (E_l, 2I, d) = (., 1536, 2048), down (., 2048, 768)) with
    expert_parallel=8 (E_l = 16): whole experts over 8 or 16 expert-FSDP ranks (64 or 128 GPUs), dim 1 over 64 (512
    GPUs: whole experts would pad 16 to 64, 4x); without EP (E_l = 128) whole experts up to 128 ranks. Dim 2 only
    where dim 1 does not divide, dim 0 padded where nothing does. Over a grid of shapes and degrees, the rank's chunk
    (FSDP2's: ceil(size / degree) along the dim) holds exactly 1/degree of the tensor whenever some dim divides."""
    gate_up, down = (16, 1536, 2048), (16, 2048, 768)
    assert [expert_shard_dim(s, g) for s in (gate_up, down) for g in (1, 8, 16, 64)] == [0, 0, 0, 1] * 2
    assert expert_shard_dim((128, 1536, 2048), 128) == 0 and expert_shard_dim((128, 1536, 2048), 256) == 1
    assert expert_shard_dim((3, 64, 32), 2) == 1  # the 2-rank test layout: 3 experts over 2 ranks
    assert expert_shard_dim((1, 6, 8), 4) == 2 and expert_shard_dim((1, 6, 6), 4) == 0
    for shape in [(e, a, b) for e in (1, 2, 3, 6, 16) for a in (6, 8, 12) for b in (4, 9, 10)]:
        for g in (1, 2, 3, 4, 6, 8, 32):
            dim = expert_shard_dim(shape, g)
            chunk = math.prod(shape) // shape[dim] * math.ceil(shape[dim] / g)
            if any(n % g == 0 for n in shape):
                assert chunk * g == math.prod(shape), (shape, g, dim)  # no padding
            assert dim == 0 or shape[0] % g != 0  # whole experts wherever they divide
