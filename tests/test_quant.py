"""Quantization schemes and gate policies (gated_attention.quant, the `quant` extra): each scheme's grid against a
plain reference written from the format's definition, AWQ's search against plain int4, and what each policy does to
the gate and to q (keep-gate leaves the gate bit-exact; `all` makes q share the gate's per-tensor scale, `split-gate`
does not)."""
from __future__ import annotations

import pytest
import torch

from _extras import need
from harness import perturb, tiny_lm

need("torchao", "pip install -e '.[quant]'")

from gated_attention.quant import quantize_model  # noqa: E402
from gated_attention.quant.schemes import (awq_scales, int4_groups, int8_rows, int8_tensor, mxfp4,  # noqa: E402
                                           nvfp4, quantize_activation)

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # FP4 E2M1 magnitudes (OCP MX spec)


def _w(shape=(48, 256), seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def test_int8_matches_the_plain_definition():
    w = _w()
    ref_rows = (w / (w.abs().amax(1, keepdim=True) / 127)).round().clamp(-127, 127) * (w.abs().amax(1, keepdim=True) / 127)
    torch.testing.assert_close(int8_rows(w), ref_rows, rtol=0, atol=1e-6)
    s = w.abs().max() / 127
    torch.testing.assert_close(int8_tensor(w), (w / s).round().clamp(-127, 127) * s, rtol=0, atol=1e-6)
    x = _w((5, 256), 1)  # per-token activation quant = per-row int8 of the tokens
    torch.testing.assert_close(quantize_activation(x, "w8a8-row"), int8_rows(x))
    assert torch.equal(quantize_activation(x, "int4-weight"), x)


def test_int4_groups_have_16_levels_and_half_step_error():
    w = _w()
    q = int4_groups(w, 128)
    for g in q.reshape(48, 2, 128).reshape(-1, 128):
        assert g.unique().numel() <= 16
    blocks = w.reshape(-1, 128)
    step = (blocks.amax(1) - blocks.amin(1)) / 15
    assert ((q.reshape(-1, 128) - blocks).abs() <= step[:, None] / 2 + 1e-6).all()
    with pytest.raises(ValueError, match="do not tile"):
        int4_groups(_w((4, 200)), 128)


def test_mxfp4_blocks_are_e2m1_times_a_power_of_two():
    w = _w((8, 64))
    q = mxfp4(w).reshape(-1, 32)
    for block, orig in zip(q, w.reshape(-1, 32)):
        # one shared power of two per block, 2^(floor(log2 amax) - 2) (E2M1's largest exponent is 2), times E2M1
        shared = 2.0 ** (torch.log2(orig.abs().max()).floor() - 2)
        assert torch.isin(block.abs() / shared, E2M1).all(), (block, shared)


def test_nvfp4_blocks_of_16_share_one_scale():
    w = _w((8, 64))
    q = nvfp4(w).reshape(-1, 16)
    for block in q:
        nz = block.abs()[block != 0]
        ratios = nz / nz.min()
        assert block.unique().numel() <= 15 and (ratios <= 12 + 1e-4).all()  # E2M1 spans 0.5 .. 6
    err = (nvfp4(w) - w).abs().max()
    assert 0 < err < 0.7


def test_awq_search_never_loses_to_plain_int4_and_wins_on_outlier_channels():
    w = _w((64, 128))
    x = _w((256, 128), 2)
    x[:, :4] *= 30  # a few outlier input channels, as in LLM activations
    s, alpha = awq_scales(w, x, group=32)
    ref = x @ w.T
    err_awq = ((x / s) @ int4_groups(w * s, 32).T - ref).pow(2).mean()
    err_plain = (x @ int4_groups(w, 32).T - ref).pow(2).mean()
    assert alpha > 0 and err_awq < 0.8 * err_plain


@pytest.fixture(scope="session")  # built once per worker (tests/conftest.py: scheduling)
def gated():
    m = perturb(tiny_lm("sdpa_elementwise", vocab_size=128, hidden_size=64, head_dim=16), std=0.1)
    with torch.no_grad():  # a gate with large weights, the fused-projection failure the issues report
        for layer in m.model.layers:
            layer.self_attn.gate.proj.weight.mul_(20)
    return m


def test_policies_treat_the_gate_as_declared(gated):
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    base = gated.state_dict()
    q_err = {}
    for policy in ("all", "keep-gate", "split-gate"):
        qm = quantize_model(gated, "w8a8-tensor", policy)
        st = qm.state_dict()
        gate_key, q_key = "model.layers.0.self_attn.gate.proj.weight", "model.layers.0.self_attn.q_proj.weight"
        assert torch.equal(st[gate_key], base[gate_key]) == (policy == "keep-gate")
        assert not torch.equal(st["model.layers.0.mlp.down_proj.weight"], base["model.layers.0.mlp.down_proj.weight"])
        assert torch.equal(st["lm_head.weight"], base["lm_head.weight"])  # the head is never quantized
        q_err[policy] = (st[q_key] - base[q_key]).abs().max().item()
        with torch.no_grad():
            assert torch.isfinite(qm(ids).logits).all()
    assert torch.equal(gated.state_dict()["model.layers.0.self_attn.q_proj.weight"], base[q_key])  # model untouched
    # fused with a 20x gate, q gets the gate's coarse per-tensor step; apart, its own
    assert q_err["all"] > 5 * q_err["split-gate"] and q_err["keep-gate"] == q_err["split-gate"]


def test_every_scheme_runs_on_a_model_and_awq_needs_calibration(gated):
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = gated(ids).logits
    for scheme in ("int8-weight", "w8a8-row", "int4-weight", "nvfp4", "mxfp4"):
        with torch.no_grad():
            out = quantize_model(gated, scheme, "split-gate")(ids).logits
        assert torch.isfinite(out).all() and not torch.equal(out, ref), scheme
    with pytest.raises(ValueError, match="calibration"):
        quantize_model(gated, "awq-int4")
    with torch.no_grad():
        out = quantize_model(gated, "awq-int4", "all", calibration=[ids])(ids).logits
    assert torch.isfinite(out).all()


def test_rows_that_do_not_tile_end_in_a_short_block():
    """The main job's d48 models have rows of 48 and 142 inputs: int4 groups of 128, MX blocks of 32 and NVFP4 blocks
    of 16 end in a short block (zero padding changes no scale), equal to quantizing that block alone."""
    from gated_attention.quant.schemes import quantize_weight

    w = _w((6, 144), 3)
    q = quantize_weight(w, "int4-weight")
    torch.testing.assert_close(q[:, :128], int4_groups(w[:, :128], 128), rtol=0, atol=0)
    torch.testing.assert_close(q[:, 128:], int4_groups(w[:, 128:], 16), rtol=0, atol=0)
    torch.testing.assert_close(quantize_weight(w[:, :48], "int4-weight"), int4_groups(w[:, :48], 48), rtol=0, atol=0)
    m = quantize_weight(w[:, :48], "mxfp4")  # blocks of 32 + a short one of 16
    torch.testing.assert_close(m[:, :32], mxfp4(w[:, :32]), rtol=0, atol=0)
    for block, orig in zip(m[:, 32:], w[:, 32:48]):
        shared = 2.0 ** (torch.log2(orig.abs().max()).floor() - 2)
        assert torch.isin(block.abs() / shared, E2M1).all()
    n = quantize_weight(w[:, :40], "nvfp4")  # blocks of 16, 16 and a short one of 8
    assert n.shape == (6, 40) and torch.equal(n[:, :32], nvfp4(w[:, :40].new_zeros(6, 48).index_copy(
        1, torch.arange(40), w[:, :40]))[:, :32])
    assert 0 < (n - w[:, :40]).abs().max() < 0.7
