"""Checkpoint conversion: the official split against paper map §1.3's worked example, round trips, file IO and bad input."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

import gated_attention.modeling  # noqa: F401  (registers the Auto classes)
from gated_attention.cli import main as cli_main
from gated_attention.interop import (ConversionError, convert_checkpoint, convert_state_dict, fused_q_rows, load_dir,
                                     save_dir)
from official_reference import official_split
from harness import tiny_lm


def _native(gate="sdpa_elementwise", seed=0, **kw):
    # parameters off their init (norms, biases) so a dropped/shifted tensor shows
    model = tiny_lm(gate, backend=None, seed=seed, match_params=None, perturbed=True, **kw)
    return model.config, model


def _fused_positions(idx: torch.Tensor, H: int, D: int, W: int) -> dict:
    """head -> (fused rows of its query, fused rows of its gate), from the permutation index."""
    pos = torch.empty_like(idx)
    pos[idx] = torch.arange(len(idx))  # stacked row -> fused row
    return {h: (pos[h * D:h * D + D].tolist(), pos[H * D + h * W:H * D + h * W + W].tolist()) for h in range(H)}


def test_official_split_matches_spec_worked_example():
    # paper map §1.3, H=4, KV=2, D=3 (verified there by running the official split)
    ew = _fused_positions(fused_q_rows("per_kv_group", 4, 2, 3, 3), 4, 3, 3)
    assert ew == {0: ([0, 1, 2], [6, 7, 8]), 1: ([3, 4, 5], [9, 10, 11]),
                  2: ([12, 13, 14], [18, 19, 20]), 3: ([15, 16, 17], [21, 22, 23])}
    hw = _fused_positions(fused_q_rows("per_kv_group", 4, 2, 3, 1), 4, 3, 1)
    assert hw == {0: ([0, 1, 2], [6]), 1: ([3, 4, 5], [7]), 2: ([8, 9, 10], [14]), 3: ([11, 12, 13], [15])}
    # Qwen3-Next: per head [q_h | g_h]; with MHA (G=1) the official layout is the same
    nx = _fused_positions(fused_q_rows("per_head", 4, 2, 3, 3), 4, 3, 3)
    assert nx[2] == ([12, 13, 14], [15, 16, 17])
    assert torch.equal(fused_q_rows("per_head", 4, 4, 3, 3), fused_q_rows("per_kv_group", 4, 4, 3, 3))


@pytest.mark.parametrize("gw", [3, 1])
def test_permutation_agrees_with_official_view_split(gw):
    # the index permutation and the official view+split (written independently) assign the same rows to each head
    H, KV, D = 4, 2, 3
    stacked = torch.arange(H * D + H * gw, dtype=torch.float32)  # native order: value = stacked row number
    fused = stacked[fused_q_rows("per_kv_group", H, KV, D, gw)]
    q, g = official_split(fused.view(1, 1, -1), H, KV, D, gw)  # (1, 1, H, D), (1, 1, H, gw)
    assert torch.equal(q.flatten(), stacked[:H * D])
    assert torch.equal(g.flatten(), stacked[H * D:])


@pytest.mark.parametrize("fmt,gate", [("official", "none"), ("official", "sdpa_elementwise"),
                                      ("official", "sdpa_headwise"), ("qwen3", "none"),
                                      ("qwen3-next", "sdpa_elementwise")])
@pytest.mark.parametrize("bias", [False, True])
def test_round_trip_is_bit_exact(fmt, gate, bias):
    cfg, model = _native(gate, attention_bias=bias, tie_word_embeddings=not bias)
    state = model.state_dict()
    ocfg, ostate = convert_state_dict(cfg.to_dict(), state, "native", fmt)
    ncfg, nstate = convert_state_dict(ocfg, ostate, fmt, "native")
    expected = {k: v for k, v in state.items() if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    assert set(nstate) == set(expected)
    for k, v in expected.items():
        assert torch.equal(nstate[k], v), k
    assert ncfg["gate"] == gate and ncfg["attention_bias"] == bias
    assert ncfg["tie_word_embeddings"] == cfg.tie_word_embeddings
    if fmt == "official":
        assert ocfg["qkv_bias"] == bias and ocfg["model_type"] == "qwen3"
        assert ocfg["elementwise_attn_output_gate"] == (gate == "sdpa_elementwise")
        assert ocfg["headwise_attn_output_gate"] == (gate == "sdpa_headwise")
        assert not any(".gate." in k for k in ostate)


def test_bf16_round_trip_through_zero_centred_norms():
    cfg, model = _native("sdpa_elementwise")
    state = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items() if k != "lm_head.weight"}
    ncfg = {**cfg.to_dict(), "dtype": "bfloat16"}
    ocfg, ostate = convert_state_dict(ncfg, state, "native", "qwen3-next")
    assert ostate["model.norm.weight"].dtype == torch.bfloat16
    assert torch.equal(ostate["model.norm.weight"].float(), state["model.norm.weight"].float() - 1)
    _, back = convert_state_dict(ocfg, ostate, "qwen3-next", "native")
    assert all(torch.equal(back[k], v) for k, v in state.items())


def test_official_config_rules(tmp_path):
    cfg, model = _native("sdpa_elementwise", attention_bias=True)
    ocfg, ostate = convert_state_dict(cfg.to_dict(), model.state_dict(), "native", "official")
    both = {**ocfg, "headwise_attn_output_gate": True}  # headwise wins if both flags are set (if/elif order)
    with pytest.raises(ConversionError, match="wrong shape for model.layers.0.self_attn.q_proj.weight"):
        convert_state_dict(both, ostate, "official", "native")
    no_flag = {k: v for k, v in ocfg.items() if k != "qkv_bias"}  # missing qkv_bias: taken from the weights
    no_flag["attention_bias"] = False  # ignored, as the official code ignores it
    ncfg, _ = convert_state_dict(no_flag, ostate, "official", "native")
    assert ncfg["attention_bias"] is True
    legacy = {**ocfg, "rope_theta": 5e5, "rope_scaling": {"type": "yarn", "factor": 4.0}, "auto_map": {"x": "y"}}
    ncfg, _ = convert_state_dict(legacy, ostate, "official", "native")
    assert ncfg["rope_parameters"]["rope_type"] == "yarn" and ncfg["rope_parameters"]["rope_theta"] == 5e5
    assert ncfg["rope_parameters"]["original_max_position_embeddings"] == ocfg["max_position_embeddings"]


def test_gated_to_qwen3_and_unsupported_gates_fail_clearly():
    cfg, model = _native("sdpa_elementwise")
    with pytest.raises(ConversionError, match="'sdpa_elementwise' has no qwen3 counterpart"):
        convert_state_dict(cfg.to_dict(), model.state_dict(), "native", "qwen3")
    cfg, model = _native("sdpa_headwise")
    with pytest.raises(ConversionError, match="'sdpa_headwise' has no qwen3-next counterpart"):
        convert_state_dict(cfg.to_dict(), model.state_dict(), "native", "qwen3-next")
    cfg, model = _native("value_elementwise")
    with pytest.raises(ConversionError, match="'value_elementwise' has no official counterpart"):
        convert_state_dict(cfg.to_dict(), model.state_dict(), "native", "official")
    cfg, model = _native("sdpa_elementwise", gate_init="identity")
    with pytest.raises(ConversionError, match="gate_init='identity'"):
        convert_state_dict(cfg.to_dict(), model.state_dict(), "native", "official")
    cfg, model = _native("sdpa_elementwise", rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                              "partial_rotary_factor": 0.5})
    with pytest.raises(ConversionError, match="partial_rotary_factor=0.5 has no official counterpart"):
        convert_state_dict(cfg.to_dict(), model.state_dict(), "native", "official")
    cfg, model = _native("baseline", use_qk_norm=False)
    with pytest.raises(ConversionError, match="use_qk_norm=False has no qwen3 counterpart"):
        convert_state_dict(cfg.to_dict(), model.state_dict(), "native", "qwen3")


def test_bad_state_dicts_name_key_and_shapes():
    cfg, model = _native("sdpa_elementwise")
    ocfg, ostate = convert_state_dict(cfg.to_dict(), model.state_dict(), "native", "official")
    missing = {k: v for k, v in ostate.items() if k != "model.layers.1.self_attn.k_proj.weight"}
    with pytest.raises(ConversionError, match=r"missing key model.layers.1.self_attn.k_proj.weight \(expected shape \[16, 32\]\)"):
        convert_state_dict(ocfg, missing, "official", "native")
    wrong = {**ostate, "model.layers.0.self_attn.q_proj.weight": torch.zeros(40, 32)}
    with pytest.raises(ConversionError, match=r"q_proj.weight: expected \[64, 32\], found \[40, 32\]"):
        convert_state_dict(ocfg, wrong, "official", "native")
    extra = {**ostate, "model.layers.0.self_attn.gate.proj.weight": torch.zeros(32, 32)}
    with pytest.raises(ConversionError, match="unexpected key model.layers.0.self_attn.gate.proj.weight"):
        convert_state_dict(ocfg, extra, "official", "native")
    with pytest.raises(ConversionError, match="model_type 'qwen3'; found 'llama'"):
        convert_state_dict({**ocfg, "model_type": "llama"}, ostate, "official", "native")
    with pytest.raises(ConversionError, match="unknown checkpoint format 'gguf'"):
        convert_state_dict(ocfg, ostate, "official", "gguf")
    untied = {**ostate, "lm_head.weight": torch.randn(128, 32)}  # tied config but a different head
    with pytest.raises(ConversionError, match="lm_head.weight differs"):
        convert_state_dict(ocfg, untied, "official", "native")


def test_pickles_are_refused(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    (d / "pytorch_model.bin").write_bytes(b"not even loaded")
    with pytest.raises(ConversionError, match=r"only pickle weights \['pytorch_model.bin'\], which are never loaded"):
        load_dir(d)
    with pytest.raises(ConversionError, match="is a pickle file"):
        load_dir(d / "pytorch_model.bin")


def test_files_cli_atomic_and_extras(tmp_path, capsys):
    cfg, model = _native("sdpa_headwise", tie_word_embeddings=False)
    src = tmp_path / "native"
    model.save_pretrained(src)
    (src / "tokenizer.json").write_text("{}")
    off = tmp_path / "official"
    assert cli_main(["convert", str(src), str(off), "--from", "native", "--to", "official"]) == 0
    assert (off / "tokenizer.json").is_file() and (off / "generation_config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["native", "official"]  # no temp dirs left behind
    back = tmp_path / "back"
    assert cli_main(["convert", str(off), str(back), "--from", "official"]) == 0
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(back).eval()
    ids = torch.randint(0, 128, (2, 6))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    # existing DST: refused without --overwrite, replaced with it
    assert cli_main(["convert", str(off), str(back), "--from", "official"]) == 2
    assert "already exists" in capsys.readouterr().err
    assert cli_main(["convert", str(off), str(back), "--from", "official", "--overwrite"]) == 0
    # a failing conversion leaves nothing behind
    bad = tmp_path / "bad"
    save_dir(bad, {"model_type": "qwen3"}, {"x": torch.zeros(1)})
    assert cli_main(["convert", str(bad), str(tmp_path / "never"), "--from", "official"]) == 2
    assert not (tmp_path / "never").exists()


def test_sharded_safetensors_are_read(tmp_path):
    cfg, model = _native("baseline")
    ocfg, ostate = convert_state_dict(cfg.to_dict(), model.state_dict(), "native", "qwen3")
    d = tmp_path / "sharded"
    d.mkdir()
    keys = sorted(ostate)
    half = len(keys) // 2
    save_file({k: ostate[k].contiguous() for k in keys[:half]}, d / "a.safetensors", metadata={"format": "pt"})
    save_file({k: ostate[k].contiguous() for k in keys[half:]}, d / "b.safetensors", metadata={"format": "pt"})
    weight_map = {k: "a.safetensors" if i < half else "b.safetensors" for i, k in enumerate(keys)}
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (d / "config.json").write_text(json.dumps(ocfg))
    out = convert_checkpoint(d, tmp_path / "out", "qwen3")
    _, state = load_dir(out)
    assert set(state) == set(keys)
