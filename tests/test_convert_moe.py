"""Checkpoint conversion of MoE models: stock transformers Qwen3-MoE dirs <-> native, with identical logits."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

import gated_attention.modeling  # noqa: F401  (registers the Auto classes)
from gated_attention import GatedQwen3ForCausalLM
from gated_attention.cli import main as cli_main
from gated_attention.interop import ConversionError, convert_state_dict, load_dir
from harness import stock_lm, tiny_lm


def _hf_moe(seed=0, **kw) -> Qwen3MoeForCausalLM:
    """Tiny stock Qwen3-MoE: 3 layers, layer 1 dense via mlp_only_layers, GQA, non-trivial norms."""
    cfg = Qwen3MoeConfig(**{**dict(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16,
        norm_topk_prob=True, mlp_only_layers=[1], max_position_embeddings=64), **kw})
    model = stock_lm(cfg, seed=seed, perturbed=True)  # a dropped or misplaced norm must show in the logits
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)  # spread router logits so the top-k choice is not a near-tie
    return model


def _native_moe(gate="baseline", seed=1, **kw) -> GatedQwen3ForCausalLM:
    return tiny_lm(gate, backend=None, seed=seed, preset="tiny-moe", match_params=None, **kw)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_stock_save_pretrained_dir_converts_with_identical_logits(tmp_path, norm_topk_prob):
    hf = _hf_moe(norm_topk_prob=norm_topk_prob)
    src = tmp_path / "hf"
    hf.save_pretrained(src)
    _, saved = load_dir(src)
    assert any(".mlp.experts.0.gate_proj.weight" in k for k in saved)  # 5.24 writes the per-expert layout
    dst = tmp_path / "native"
    assert cli_main(["convert", str(src), str(dst), "--from", "qwen3-moe"]) == 0
    cfg = json.loads((dst / "config.json").read_text())
    assert (cfg["model_type"], cfg["num_experts"], cfg["norm_topk_prob"], cfg["mlp_only_layers"]) == (
        "gated_qwen3", 6, norm_topk_prob, [1])
    ids = torch.randint(0, 96, (2, 11))
    with torch.no_grad():
        want = hf(ids).logits
        for impl in ("grouped", "loop"):
            ours = AutoModelForCausalLM.from_pretrained(dst, moe_impl=impl).eval()
            got = ours(ids).logits
            print(f"max |dlogits| native({impl}) vs transformers Qwen3MoeForCausalLM: "
                  f"{(got - want).abs().max().item():.3g}")
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_fused_and_per_expert_keys_give_the_same_native_state():
    hf = _hf_moe()
    hf_cfg = {**hf.config.to_dict(), "architectures": ["Qwen3MoeForCausalLM"]}
    fused = hf.state_dict()  # in-memory 5.x layout: mlp.experts.gate_up_proj (E, 2I, d)
    _, from_fused = convert_state_dict(hf_cfg, fused, "qwen3-moe")
    per_expert = {}
    E, I = hf.config.num_experts, hf.config.moe_intermediate_size
    for k, v in fused.items():  # written independently of convert.py: gate rows [0, I), up rows [I, 2I)
        if k.endswith("experts.gate_up_proj"):
            for e in range(E):
                per_expert[k.replace("gate_up_proj", f"{e}.gate_proj.weight")] = v[e, :I].clone()
                per_expert[k.replace("gate_up_proj", f"{e}.up_proj.weight")] = v[e, I:].clone()
        elif k.endswith("experts.down_proj"):
            for e in range(E):
                per_expert[k.replace("down_proj", f"{e}.down_proj.weight")] = v[e].clone()
        else:
            per_expert[k] = v
    _, from_split = convert_state_dict(hf_cfg, per_expert, "qwen3-moe")
    assert set(from_fused) == set(from_split)
    for k in from_fused:
        assert torch.equal(from_fused[k], from_split[k]), k


def test_native_round_trip_bit_exact_and_written_dir_loads_in_transformers(tmp_path):
    model = _native_moe(mlp_only_layers=[0], norm_topk_prob=False, tie_word_embeddings=False)
    cfg = model.config
    state = model.state_dict()
    ocfg, ostate = convert_state_dict(cfg.to_dict(), state, "native", "qwen3-moe")
    assert ocfg["model_type"] == "qwen3_moe" and ocfg["architectures"] == ["Qwen3MoeForCausalLM"]
    assert ocfg["num_experts"] == ocfg["num_local_experts"] == 8  # both spellings, for 4.x and 5.x readers
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in ostate and not any("gate_up" in k for k in ostate)
    ncfg, back = convert_state_dict(ocfg, ostate, "qwen3-moe", "native")
    assert set(back) == set(state)
    assert all(torch.equal(back[k], v) for k, v in state.items())
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                "router_aux_loss_coef", "decoder_sparse_step", "mlp_only_layers"):
        assert ncfg[key] == getattr(cfg, key), key
    # the written directory is a stock checkpoint: transformers loads it and computes the same logits
    src = tmp_path / "native"
    model.save_pretrained(src)
    out = tmp_path / "hf"
    assert cli_main(["convert", str(src), str(out), "--from", "native", "--to", "qwen3-moe"]) == 0
    hf = Qwen3MoeForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids).logits, rtol=0, atol=1e-5)


def test_older_config_spelling_and_defaults():
    hf = _hf_moe()
    old = {k: v for k, v in hf.config.to_dict().items() if k not in ("num_local_experts", "norm_topk_prob")}
    old["num_experts"] = 6  # hub configs (Qwen3-30B-A3B) spell the count this way
    ncfg, _ = convert_state_dict(old, hf.state_dict(), "qwen3-moe")
    assert ncfg["num_experts"] == 6
    assert ncfg["norm_topk_prob"] is False  # transformers' default, not native's True
    with pytest.raises(ConversionError, match="two expert counts"):
        convert_state_dict({**old, "num_local_experts": 5}, hf.state_dict(), "qwen3-moe")


def test_unconvertible_moe_models_fail_clearly():
    model = _native_moe(gate="sdpa_elementwise")
    with pytest.raises(ConversionError, match="'sdpa_elementwise' has no qwen3-moe counterpart"):
        convert_state_dict(model.config.to_dict(), model.state_dict(), "native", "qwen3-moe")
    model = _native_moe()
    with pytest.raises(ConversionError, match="MoE models .* have no qwen3 counterpart; use --to qwen3-moe"):
        convert_state_dict(model.config.to_dict(), model.state_dict(), "native", "qwen3")
    model = _native_moe(shared_expert_intermediate_size=16)
    with pytest.raises(ConversionError, match="a shared expert has no qwen3-moe counterpart"):
        convert_state_dict(model.config.to_dict(), model.state_dict(), "native", "qwen3-moe")
    model = _native_moe(mechanism="clipped_softmax")
    with pytest.raises(ConversionError, match="mechanism='clipped_softmax' is a native-only mechanism"):
        convert_state_dict(model.config.to_dict(), model.state_dict(), "native", "qwen3-moe")


def test_bad_per_expert_state_dicts_name_the_problem():
    model = _native_moe()
    ocfg, ostate = convert_state_dict(model.config.to_dict(), model.state_dict(), "native", "qwen3-moe")
    gone = {k: v for k, v in ostate.items() if k != "model.layers.0.mlp.experts.3.up_proj.weight"}
    with pytest.raises(ConversionError, match=r"model.layers.0.mlp.experts: expert 3 lacks up_proj.weight"):
        convert_state_dict(ocfg, gone, "qwen3-moe")
    odd = {**ostate, "model.layers.0.mlp.experts.2.down_proj.weight": torch.zeros(32, 8)}
    with pytest.raises(ConversionError, match=r"experts.\*.down_proj.weight: experts disagree on shape"):
        convert_state_dict(ocfg, odd, "qwen3-moe")
    fused_too = {**ostate, "model.layers.0.mlp.experts.down_proj": torch.zeros(8, 32, 32)}
    with pytest.raises(ConversionError, match="both per-expert and fused expert keys"):
        convert_state_dict(ocfg, fused_too, "qwen3-moe")
    fewer = {**ocfg, "num_local_experts": 4, "num_experts": 4}  # config says 4 experts, weights hold 8
    with pytest.raises(ConversionError, match=r"wrong shape for model.layers.0.mlp.gate.weight: expected \[4, 32\]"):
        convert_state_dict(fewer, ostate, "qwen3-moe")
