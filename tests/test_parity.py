"""Logit parity after conversion: official checkpoints (vs the independent official forward), stock transformers
Qwen3ForCausalLM (default RoPE and YaRN, both directions) and Qwen3-Next attention / Qwen3NextForCausalLM.

Each test prints its max |delta| (run with -s to see them)."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3NextConfig, Qwen3NextForCausalLM

import gated_attention.modeling  # noqa: F401  (registers the Auto classes)
from gated_attention.interop import convert_checkpoint, convert_state_dict, load_dir
from official_reference import official_forward
from gated_attention.presets import model_config
from harness import build_lm, perturb, stock_lm

TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16}
DEFAULT = {"rope_type": "default", "rope_theta": 10000.0}
TOL = 2e-5  # official reference: fp32, equivalent but differently ordered ops (its own RoPE, loop, eager softmax)
# Stock Qwen3 / Qwen3-Next run the same ops in the same order as the native model: logits are bit-identical.
EXACT = 0.0


def _report(name, a, b):
    delta = (a - b).abs().max().item()
    print(f"\n[parity] {name}: max |dlogits| = {delta:.3g}")
    return delta


def _ids(seq=12, batch=2, seed=3):
    return torch.randint(0, TINY["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------------------------------------- official
def _official_dir(path, gate: str, tied: bool, bias: bool, qk_norm: bool = True, seed: int = 0):
    """An official-format checkpoint built from paper map §1.5 (not from our converter): random weights, fused q_proj."""
    H, KV, D, d, V, inter = (TINY[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim",
                                                "hidden_size", "vocab_size", "intermediate_size"))
    q_rows = {"none": H * D, "headwise": H * D + H, "elementwise": 2 * H * D}[gate]
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: 0.1 * torch.randn(*shape, generator=g)  # noqa: E731
    sd = {"model.embed_tokens.weight": rnd(V, d), "model.norm.weight": 1 + rnd(d)}
    for i in range(TINY["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for name, shape in (("self_attn.q_proj", (q_rows, d)), ("self_attn.k_proj", (KV * D, d)),
                            ("self_attn.v_proj", (KV * D, d)), ("self_attn.o_proj", (d, H * D))):
            sd[p + name + ".weight"] = rnd(*shape)
            if bias:
                sd[p + name + ".bias"] = rnd(shape[0])
        if qk_norm:
            sd[p + "self_attn.q_norm.weight"], sd[p + "self_attn.k_norm.weight"] = 1 + rnd(D), 1 + rnd(D)
        sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"] = rnd(inter, d), rnd(inter, d)
        sd[p + "mlp.down_proj.weight"] = rnd(d, inter)
        sd[p + "input_layernorm.weight"], sd[p + "post_attention_layernorm.weight"] = 1 + rnd(d), 1 + rnd(d)
    if not tied:
        sd["lm_head.weight"] = rnd(V, d)
    config = {**TINY, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "rope_theta": 10000.0,
              "rope_scaling": None, "rms_norm_eps": 1e-6, "tie_word_embeddings": tied, "use_qk_norm": qk_norm,
              "qkv_bias": bias, "attention_bias": False, "elementwise_attn_output_gate": gate == "elementwise",
              "headwise_attn_output_gate": gate == "headwise", "torch_dtype": "float32",
              "auto_map": {"AutoConfig": "configuration_qwen3.Qwen3Config",
                           "AutoModelForCausalLM": "modeling_qwen3.Qwen3ForCausalLM"}}
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
    return config, sd


@pytest.mark.parametrize("gate,tied,bias,qk_norm", [("none", True, False, True), ("elementwise", True, False, True),
                                                    ("headwise", True, False, True), ("elementwise", False, True, True),
                                                    ("headwise", False, True, False)])
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_official_checkpoint_logits_match_official_forward(tmp_path, gate, tied, bias, qk_norm, impl):
    config, sd = _official_dir(tmp_path / "official", gate, tied, bias, qk_norm)
    convert_checkpoint(tmp_path / "official", tmp_path / "native", "official")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "native", attn_implementation=impl).eval()
    assert model.config.gate == {"none": "none", "elementwise": "sdpa_elementwise",
                                 "headwise": "sdpa_headwise"}[gate]
    ids = _ids()
    with torch.no_grad():
        ours, ref = model(ids).logits, official_forward(config, sd, ids)
    assert _report(f"official {gate} tied={tied} bias={bias} qk_norm={qk_norm} {impl}", ours, ref) < TOL
    # native -> official again gives back the very same tensors
    convert_checkpoint(tmp_path / "native", tmp_path / "official2", "native", "official")
    cfg2, sd2 = load_dir(tmp_path / "official2")
    assert set(sd2) == set(sd) and all(torch.equal(sd2[k], sd[k]) for k in sd)
    assert cfg2["elementwise_attn_output_gate"] == config["elementwise_attn_output_gate"]
    assert cfg2["headwise_attn_output_gate"] == config["headwise_attn_output_gate"]
    assert cfg2["qkv_bias"] == bias and cfg2["use_qk_norm"] == qk_norm


def test_official_forward_split_matters(tmp_path):
    # the test above can fail: reading the fused official q_proj as if it were per-head [q_h | g_h] changes the logits
    config, sd = _official_dir(tmp_path / "official", "elementwise", True, False)
    ncfg, nsd = convert_state_dict(config, sd, "official", "native")
    wrong_cfg, wrong_sd = convert_state_dict(config, sd, "official", "native")
    H, D = TINY["num_attention_heads"], TINY["head_dim"]
    for i in range(TINY["num_hidden_layers"]):
        fused = sd[f"model.layers.{i}.self_attn.q_proj.weight"].view(H, 2 * D, -1)  # (H, 2D, d) per-head reading
        wrong_sd[f"model.layers.{i}.self_attn.q_proj.weight"] = fused[:, :D].reshape(H * D, -1)
        wrong_sd[f"model.layers.{i}.self_attn.gate.proj.weight"] = fused[:, D:].reshape(H * D, -1)
    ids = _ids()
    ref = official_forward(config, sd, ids)
    results = []
    for state in (nsd, wrong_sd):
        m = build_lm(gated_attention.GatedQwen3Config(**ncfg), seed=None)
        m.load_state_dict(state, strict=False)
        m.tie_weights()
        with torch.no_grad():
            results.append((m(ids).logits - ref).abs().max().item())
    assert results[0] < TOL and results[1] > 1e-3


# --------------------------------------------------------------------------------------------------------- qwen3
@pytest.mark.parametrize("rope", [DEFAULT, YARN], ids=["default", "yarn"])
@pytest.mark.parametrize("tied", [True, False])
def test_stock_qwen3_to_native(tmp_path, rope, tied):
    stock = stock_lm(Qwen3Config(**TINY, rope_parameters=dict(rope), tie_word_embeddings=tied), perturbed=True)
    stock.save_pretrained(tmp_path / "stock")
    convert_checkpoint(tmp_path / "stock", tmp_path / "native", "qwen3")
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "native").eval()
    assert ours.config.gate == "none" and ours.config.rope_parameters["rope_type"] == rope["rope_type"]
    ids = _ids(seq=40)  # past original_max_position_embeddings=16 so YaRN's extension is exercised
    with torch.no_grad():
        delta = _report(f"qwen3 -> native ({rope['rope_type']}, tied={tied})", ours(ids).logits, stock(ids).logits)
    assert delta == EXACT


@pytest.mark.parametrize("rope", [DEFAULT, YARN], ids=["default", "yarn"])
def test_native_to_stock_qwen3(tmp_path, rope):
    cfg = model_config("tiny", rope_parameters=dict(rope), max_position_embeddings=64, attention_bias=True,
                       tie_word_embeddings=False)
    ours = build_lm(cfg, perturbed=True)
    ours.save_pretrained(tmp_path / "native")
    convert_checkpoint(tmp_path / "native", tmp_path / "stock", "native", "qwen3")
    stock = Qwen3ForCausalLM.from_pretrained(tmp_path / "stock").eval()
    assert type(stock.config) is Qwen3Config and stock.config.attention_bias
    ids = _ids(seq=40)
    with torch.no_grad():
        delta = _report(f"native -> qwen3 ({rope['rope_type']})", ours(ids).logits, stock(ids).logits)
    assert delta == EXACT


# --------------------------------------------------------------------------------------------------------- qwen3-next
def _next_config(prf=1.0):
    return Qwen3NextConfig(**TINY, rope_parameters={**DEFAULT, "partial_rotary_factor": prf}, num_experts=0,
                           mlp_only_layers=[], layer_types=["full_attention"] * TINY["num_hidden_layers"],
                           tie_word_embeddings=False)


def test_attention_matches_qwen3_next_attention():
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextAttention, Qwen3NextRotaryEmbedding

    cfg = model_config("tiny", gate="sdpa_elementwise", attn_implementation="eager", **{
        k: TINY[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim")})
    ours = build_lm(cfg, perturbed=True)
    _, next_state = convert_state_dict(cfg.to_dict(), ours.state_dict(), "native", "qwen3-next")
    ncfg = _next_config()
    ncfg._attn_implementation = "eager"
    theirs = Qwen3NextAttention(ncfg, layer_idx=0).eval()
    theirs.load_state_dict({k.removeprefix("model.layers.0.self_attn."): v for k, v in next_state.items()
                            if k.startswith("model.layers.0.self_attn.")})
    x = torch.randn(2, 10, TINY["hidden_size"])
    pos = torch.arange(10)[None]
    mask = torch.full((10, 10), float("-inf")).triu(1)[None, None]  # (1, 1, T, T) additive causal
    with torch.no_grad():
        pe_next = Qwen3NextRotaryEmbedding(ncfg)(x, pos)
        pe_ours = ours.model.rotary_emb(x, pos)
        a, _ = ours.model.layers[0].self_attn(x, pe_ours, mask)
        b, _ = theirs(x, pe_next, mask)
    assert _report("native attention vs Qwen3NextAttention", a, b) == EXACT


@pytest.mark.parametrize("prf", [1.0, 0.5])
def test_native_to_qwen3_next_model(tmp_path, prf):
    rope = {**DEFAULT, **({"partial_rotary_factor": prf} if prf != 1.0 else {})}
    cfg = model_config("tiny", gate="sdpa_elementwise", rope_parameters=rope, tie_word_embeddings=False)
    ours = build_lm(cfg, perturbed=True)
    ours.save_pretrained(tmp_path / "native")
    convert_checkpoint(tmp_path / "native", tmp_path / "next", "native", "qwen3-next")
    theirs = Qwen3NextForCausalLM.from_pretrained(tmp_path / "next").eval()
    assert theirs.config.rope_parameters["partial_rotary_factor"] == prf
    ids = _ids()
    with torch.no_grad():
        delta = _report(f"native -> Qwen3NextForCausalLM (partial_rotary_factor={prf})", ours(ids).logits,
                        theirs(ids, use_cache=False).logits)
    assert delta == EXACT


def test_qwen3_next_model_to_native(tmp_path):
    theirs = perturb(stock_lm(_next_config(prf=0.25)), seed=5)
    theirs.save_pretrained(tmp_path / "next")
    convert_checkpoint(tmp_path / "next", tmp_path / "native", "qwen3-next")
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "native").eval()
    assert ours.config.gate == "sdpa_elementwise"
    ids = _ids()
    with torch.no_grad():
        delta = _report("Qwen3NextForCausalLM -> native (partial_rotary_factor=0.25)", ours(ids).logits,
                        theirs(ids, use_cache=False).logits)
    assert delta == EXACT


def test_qwen3_next_hybrid_or_moe_fails_clearly(tmp_path):
    base = _next_config().to_dict()
    with pytest.raises(ValueError, match="Gated DeltaNet"):
        convert_state_dict({**base, "layer_types": ["linear_attention", "full_attention"]}, {}, "qwen3-next")
    with pytest.raises(ValueError, match=r"layers \[0, 1\] are MoE"):
        convert_state_dict({**base, "num_experts": 4}, {}, "qwen3-next")
