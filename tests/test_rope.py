"""RoPE scaling parity with transformers 5.24: inv_freq / attention scaling on a parameter grid, dynamic NTK's
per-forward update against Qwen3RotaryEmbedding, cos/sin, partial rotary, and the loud-failure paths."""
from __future__ import annotations

import itertools
import math

import pytest
import torch
from transformers import Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from gated_attention.rope import RotaryEmbedding, apply_rotary_pos_emb, compute_rope_parameters, rotate_half
from harness import stock_lm


def hf_config(rope_parameters: dict, head_dim: int = 16, max_pos: int = 64, **kw) -> Qwen3Config:
    return Qwen3Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=head_dim,
                       max_position_embeddings=max_pos, rope_parameters=dict(rope_parameters), **kw)


def assert_same(ours, theirs):
    inv_o, scale_o = ours
    inv_t, scale_t = theirs
    assert inv_o.dtype == inv_t.dtype and inv_o.shape == inv_t.shape
    assert torch.equal(inv_o, inv_t), (inv_o - inv_t).abs().max()
    assert scale_o == scale_t


YARN_GRID = [
    dict(factor=f, original_max_position_embeddings=o, **extra)
    for f, o, extra in itertools.product(
        [1.0, 2.0, 4.0, 8.5], [64, 4096, 32768],
        [{}, {"beta_fast": 16, "beta_slow": 2}, {"attention_factor": 0.7}, {"mscale": 1.0, "mscale_all_dim": 0.5},
         {"mscale": 0.707}, {"truncate": False}, {"truncate": False, "beta_fast": 64.0, "beta_slow": 0.5}])
]


@pytest.mark.parametrize("theta", [10000.0, 1_000_000.0])
@pytest.mark.parametrize("head_dim", [16, 128])
def test_yarn_matches_transformers(theta, head_dim):
    for params in YARN_GRID:
        rp = {"rope_type": "yarn", "rope_theta": theta, **params}
        cfg = hf_config(rp, head_dim=head_dim, max_pos=int(params["original_max_position_embeddings"] * params["factor"]))
        assert_same(compute_rope_parameters(cfg), ROPE_INIT_FUNCTIONS["yarn"](cfg))


def test_yarn_factor_none_uses_length_ratio():
    cfg = hf_config({"rope_type": "yarn", "rope_theta": 1e4, "factor": None, "original_max_position_embeddings": 16},
                    max_pos=64)
    ours = compute_rope_parameters(cfg)
    assert_same(ours, ROPE_INIT_FUNCTIONS["yarn"](cfg))
    assert ours[1] == pytest.approx(0.1 * math.log(4) + 1)


@pytest.mark.parametrize("rope_type", ["linear", "dynamic"])
def test_linear_dynamic_match_transformers(rope_type):
    for theta, factor, head_dim, max_pos in itertools.product([10000.0, 5e5], [1.0, 2.0, 3.7, 16.0], [8, 64, 128],
                                                              [32, 4096]):
        cfg = hf_config({"rope_type": rope_type, "rope_theta": theta, "factor": factor}, head_dim=head_dim,
                        max_pos=max_pos)
        assert_same(compute_rope_parameters(cfg), ROPE_INIT_FUNCTIONS[rope_type](cfg))
        if rope_type == "dynamic":  # explicit lengths: python int and the 0-d tensor forward passes
            for n in (max_pos // 2, max_pos + 1, 3 * max_pos):
                assert_same(compute_rope_parameters(cfg, seq_len=n), ROPE_INIT_FUNCTIONS[rope_type](cfg, seq_len=n))
                t = torch.tensor(n)
                assert_same(compute_rope_parameters(cfg, seq_len=t), ROPE_INIT_FUNCTIONS[rope_type](cfg, seq_len=t))


def test_partial_rotary_matches_transformers():
    for rope_type, extra in [("linear", {"factor": 2.0}), ("dynamic", {"factor": 2.0}),
                             ("yarn", {"factor": 4.0, "original_max_position_embeddings": 16})]:
        cfg = hf_config({"rope_type": rope_type, "rope_theta": 1e4, "partial_rotary_factor": 0.5, **extra})
        ours = compute_rope_parameters(cfg)
        assert ours[0].shape == (4,)
        assert_same(ours, ROPE_INIT_FUNCTIONS[rope_type](cfg))


def test_default_matches_qwen3():
    cfg = hf_config({"rope_type": "default", "rope_theta": 1e6}, head_dim=128)
    assert_same(compute_rope_parameters(cfg), Qwen3RotaryEmbedding.compute_default_rope_parameters(cfg))


@pytest.mark.parametrize("rp", [
    {"rope_type": "default", "rope_theta": 1e4},
    {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0},
    {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 16},
])
def test_cos_sin_match_qwen3(rp):
    cfg = hf_config(rp, max_pos=64)
    ours, theirs = RotaryEmbedding(cfg), Qwen3RotaryEmbedding(cfg)
    x = torch.zeros(1, dtype=torch.bfloat16)
    pos = torch.arange(200)[None].expand(2, -1)  # (B, T), past max_position_embeddings on purpose
    for a, b in zip(ours(x, pos), theirs(x, pos)):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b)


def test_dynamic_forward_update_matches_qwen3():
    """A sequence of forwards (short, long, longer, shorter-than-cached, short again) keeps the two modules in lockstep:
    growth recomputes the base, a length between original and cached keeps the cached frequencies, a length under the
    original resets them."""
    cfg = hf_config({"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}, max_pos=32)
    ours, theirs = RotaryEmbedding(cfg), Qwen3RotaryEmbedding(cfg)
    x = torch.zeros(1)
    seen = []
    for n in (10, 32, 50, 80, 60, 40, 20, 90, 31):
        pos = torch.arange(n)[None]  # (1, T)
        for a, b in zip(ours(x, pos), theirs(x, pos)):
            assert torch.equal(a, b), n
        assert torch.equal(ours.inv_freq, theirs.inv_freq)
        assert int(ours.max_seq_len_cached) == int(theirs.max_seq_len_cached)
        seen.append(ours.inv_freq.clone())
    default = compute_rope_parameters(hf_config({"rope_type": "default", "rope_theta": 1e4}, max_pos=32))[0]
    assert torch.equal(seen[0], default) and torch.equal(seen[-3], default)  # short inputs use the trained frequencies
    assert seen[3][-1] < seen[2][-1] < default[-1]  # growth lowers the slowest frequency
    assert torch.equal(seen[4], seen[3]) and torch.equal(seen[5], seen[3])  # no shrink until back under original


def test_apply_rotary_pos_emb_partial_and_full():
    torch.manual_seed(0)
    q, k = torch.randn(2, 3, 5, 8), torch.randn(2, 1, 5, 8)  # (B, H, T, D)
    cfg = hf_config({"rope_type": "default", "rope_theta": 1e4}, head_dim=8)
    cos, sin = RotaryEmbedding(cfg)(q, torch.arange(5)[None].expand(2, -1))
    qf, kf = apply_rotary_pos_emb(q, k, cos, sin)
    assert torch.allclose(qf, q * cos[:, None] + rotate_half(q) * sin[:, None])
    # partial: rotate the first 4 dims only, the rest pass through untouched
    cfg_p = hf_config({"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}, head_dim=8)
    cos_p, sin_p = RotaryEmbedding(cfg_p)(q, torch.arange(5)[None].expand(2, -1))
    assert cos_p.shape == (2, 5, 4)
    qp, kp = apply_rotary_pos_emb(q, k, cos_p, sin_p)
    assert torch.equal(qp[..., 4:], q[..., 4:]) and torch.equal(kp[..., 4:], k[..., 4:])
    assert torch.allclose(qp[..., :4], q[..., :4] * cos_p[:, None] + rotate_half(q[..., :4]) * sin_p[:, None])
    # a rotation keeps the norm of every rotated pair
    assert torch.allclose(qp.norm(dim=-1), q.norm(dim=-1), atol=1e-5)


class _Cfg:
    head_dim = 16
    max_position_embeddings = 64

    def __init__(self, rp):
        self.rope_parameters = rp


@pytest.mark.parametrize("rp, match", [
    ({"rope_type": "ntk-by-parts", "rope_theta": 1e4}, "not supported"),
    ({"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}, "original_max_position_embeddings"),
    ({"rope_type": "linear", "rope_theta": 1e4}, "missing keys \\['factor'\\]"),
    ({"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 8, "beta-fast": 3},
     "unknown keys \\['beta-fast'\\]"),
    ({"rope_type": "linear", "rope_theta": 1e4, "factor": 0.5}, "factor"),
    ({"rope_type": "default"}, "rope_theta"),
    ({}, "non-empty dict"),
])
def test_bad_parameters_fail_loudly(rp, match):
    with pytest.raises(ValueError, match=match):
        compute_rope_parameters(_Cfg(rp))
    with pytest.raises(ValueError, match=match):
        RotaryEmbedding(_Cfg(rp))


def test_plain_object_config_and_attribute_partial_factor():
    cfg = _Cfg({"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0})
    cfg.partial_rotary_factor = 0.25
    inv, scale = compute_rope_parameters(cfg)
    expected = 1.0 / (1e4 ** (torch.arange(0, 4, 2).float() / 4)) / 2.0
    assert torch.equal(inv, expected) and scale == 1.0


# ---------------------------------------------------------------------------------------------------------------------
# Checkpoint extension (gattn extend)
def _tiny_qwen3_checkpoint(path):
    cfg = hf_config({"rope_type": "default", "rope_theta": 10000.0}, head_dim=16, max_pos=64)
    stock_lm(cfg).save_pretrained(path)
    (path / "tokenizer.json").write_text("{}")  # stands in for tokenizer files: must be copied verbatim
    return path


@pytest.mark.parametrize("method, theta", [("yarn", None), ("linear", 5e5), ("dynamic", None)])
def test_extend_checkpoint_loads_with_transformers(tmp_path, method, theta):
    import json

    from transformers import AutoConfig, AutoModelForCausalLM

    from gated_attention.cli import main
    from gated_attention.longctx.extend import extend_checkpoint

    src = _tiny_qwen3_checkpoint(tmp_path / "src")
    dst = tmp_path / "ext"
    argv = ["extend", str(src), "--method", method, "--factor", "4", "--out", str(dst)]
    if theta:
        argv += ["--rope-theta", str(theta)]
    assert main(argv) == 0
    model = AutoModelForCausalLM.from_pretrained(dst)
    rp = model.config.rope_parameters
    assert rp["rope_type"] == method and rp["factor"] == 4.0 and rp["rope_theta"] == (theta or 10000.0)
    assert model.config.max_position_embeddings == (64 if method == "dynamic" else 256)
    if method == "yarn":
        assert rp["original_max_position_embeddings"] == 64
    assert (dst / "tokenizer.json").read_text() == "{}"
    src_model = AutoModelForCausalLM.from_pretrained(src)
    for (n, a), (_, b) in zip(src_model.state_dict().items(), model.state_dict().items()):
        assert torch.equal(a, b), n  # weights untouched
    # our RoPE on the extended config == the loaded transformers model's rotary embedding, past the old length
    cfg = AutoConfig.from_pretrained(dst)
    x, pos = torch.zeros(1), torch.arange(300)[None]  # (1, T)
    for a, b in zip(RotaryEmbedding(cfg)(x, pos), model.model.rotary_emb(x, pos)):
        assert torch.equal(a, b)
    on_disk = json.loads((dst / "config.json").read_text())
    assert on_disk["rope_parameters"]["rope_type"] == method
    # refuse to clobber, to re-extend an extended checkpoint silently, or to write over the source
    with pytest.raises(ValueError, match="not empty"):
        extend_checkpoint(src, dst)
    with pytest.raises(ValueError, match="already extended"):
        extend_checkpoint(dst, tmp_path / "twice")
    with pytest.raises(ValueError, match="differ"):
        extend_checkpoint(src, src)
    assert main(["extend", str(src), "--factor", "0.5", "--out", str(tmp_path / "bad")]) == 2
    assert not (tmp_path / "bad").exists()


def test_extended_gated_baseline_matches_transformers_qwen3_logits(tmp_path):
    """The issue's check: an extended checkpoint (our baseline model, YaRN x4) gives the same logits as transformers'
    Qwen3 with the same rope_parameters, past the original length."""
    from transformers import AutoModelForCausalLM

    from gated_attention.longctx.extend import extend_checkpoint
    from harness import tiny_lm

    tiny_lm("baseline", backend=None, match_params=None, eval=False, max_position_embeddings=64).save_pretrained(
        tmp_path / "src")
    extend_checkpoint(tmp_path / "src", tmp_path / "ext", "yarn", 4.0)
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "ext").eval()
    ours.set_attn_implementation("eager")
    keys = set(Qwen3Config().to_dict()) - {"model_type", "architectures", "transformers_version"}
    hcfg = Qwen3Config(**{k: v for k, v in ours.config.to_dict().items() if k in keys})
    hcfg._attn_implementation = "eager"
    theirs = stock_lm(hcfg, seed=None)
    theirs.load_state_dict(ours.state_dict())
    assert theirs.config.rope_parameters["rope_type"] == "yarn"
    ids = torch.randint(0, ours.config.vocab_size, (1, 200))  # (1, T), T > original 64
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, theirs(ids).logits)
