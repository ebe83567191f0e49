"""Llama-family interop: stock transformers Llama / Mistral / Qwen2 <-> native, logits against the stock classes in
fp32 (both directions, eager and sdpa), sliding windows honoured in prefill and cached decoding, and clear refusals."""
from __future__ import annotations

import json

import pytest
import torch
import transformers

import gated_attention.modeling  # noqa: F401  (registers the Auto classes)
from gated_attention import GatedQwen3ForCausalLM
from gated_attention.cli import main as cli_main
from gated_attention.configuration import GatedQwen3Config
from gated_attention.interop import ConversionError, convert_checkpoint, convert_state_dict
from harness import build_lm, stock_lm

TOL = 1e-5  # the fp32 bound (measured: bit-identical)
BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)
LLAMA3 = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=16)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16)
LONGROPE = dict(rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=16,
                short_factor=[1.0 + 0.1 * i for i in range(12)], long_factor=[1.0 + 0.5 * i for i in range(12)])
CLASSES = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig, "qwen2": transformers.Qwen2Config}
# (format, stock config kwargs): head_dim != hidden/heads, biases, windows shorter than the test sequence, each RoPE type
STOCK_CASES = [
    ("llama", dict(head_dim=24, attention_bias=True, rope_parameters=LLAMA3)),
    ("llama", dict(tie_word_embeddings=True, rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0,
                                                                  factor=2.0))),
    ("llama", dict(head_dim=24, rope_parameters=LONGROPE)),
    ("mistral", dict(head_dim=32, sliding_window=8, tie_word_embeddings=True)),
    ("mistral", dict(sliding_window=None, rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0))),
    ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1, rope_parameters=YARN)),
    ("qwen2", dict(tie_word_embeddings=True, head_dim=8)),
]
SEQ = 24  # longer than every window above and than LongRoPE's original length (the long factors are used)


def _stock(fmt, kw, tmp_path):
    # norms and biases off their init, so a dropped or misplaced one shows in the logits
    model = stock_lm(CLASSES[fmt](**BASE, **kw), perturbed=True)
    src = tmp_path / f"{fmt}-src"
    model.save_pretrained(src)
    return model, src


def _load(path, cls=transformers.AutoModelForCausalLM):
    model, info = cls.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    assert not bad, bad
    return model.eval()


def _max_diff(a, b, ids, mask=None) -> float:
    out = 0.0
    for impl in ("eager", "sdpa"):
        a.set_attn_implementation(impl)
        b.set_attn_implementation(impl)
        with torch.no_grad():
            out = max(out, float((a(ids, attention_mask=mask).logits - b(ids, attention_mask=mask).logits).abs().max()))
    return out


@pytest.mark.parametrize("fmt,kw", STOCK_CASES)
def test_stock_to_native_logits(fmt, kw, tmp_path):
    stock, src = _stock(fmt, kw, tmp_path)
    convert_checkpoint(src, tmp_path / "native", fmt, "native")
    native = _load(tmp_path / "native")
    assert isinstance(native, GatedQwen3ForCausalLM) and not native.config.use_qk_norm
    torch.manual_seed(2)
    ids = torch.randint(0, BASE["vocab_size"], (2, SEQ))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding in one row
    assert _max_diff(stock, native, ids) <= TOL
    assert _max_diff(stock, native, ids, mask) <= TOL
    # the converted model declares what makes it Llama-shaped
    cfg = json.loads((tmp_path / "native" / "config.json").read_text())
    assert cfg["model_type"] == "gated_qwen3" and cfg["gate"] == "none"
    if fmt == "qwen2":
        assert cfg["attention_bias"] and cfg["o_proj_bias"] is False
        assert "o_proj.bias" not in " ".join(native.state_dict())


@pytest.mark.parametrize("fmt", ["mistral", "qwen2"])
def test_sliding_window_matters_and_is_honoured_in_cached_decoding(fmt, tmp_path):
    kw = dict(sliding_window=6) if fmt == "mistral" else dict(use_sliding_window=True, sliding_window=6,
                                                              max_window_layers=0)
    stock, src = _stock(fmt, kw, tmp_path)
    convert_checkpoint(src, tmp_path / "native", fmt, "native")
    native = _load(tmp_path / "native")
    assert native.config.layer_types == ["sliding_attention"] * 2 and native.config.sliding_window == 6
    ids = torch.randint(0, BASE["vocab_size"], (1, SEQ))
    # the window changes the result at this length: a full-attention copy differs a lot
    full = build_lm(GatedQwen3Config(**{**native.config.to_dict(), "layer_types": None, "sliding_window": None}),
                    seed=None)
    full.load_state_dict(native.state_dict())
    assert _max_diff(stock, full, ids) > 1e-3
    assert _max_diff(stock, native, ids) <= TOL
    # generation past the window: the KV cache keeps a window too, and greedy tokens and scores agree
    for m in (stock, native):
        m.set_attn_implementation("sdpa")
    prompt = ids[:, :4]
    kw = dict(max_new_tokens=12, do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    a, b = stock.generate(prompt, **kw), native.generate(prompt, **kw)
    assert torch.equal(a.sequences, b.sequences)
    assert max(float((x - y).abs().max()) for x, y in zip(a.scores, b.scores)) <= TOL


def _native_model(seed=0, **kw):
    cfg = GatedQwen3Config(**{**BASE, "head_dim": 24, "use_qk_norm": False, **kw})
    return cfg, build_lm(cfg, seed=seed, perturbed=True)


NATIVE_CASES = [
    ("llama", dict(rope_parameters=LLAMA3)),
    ("llama", dict(attention_bias=True, o_proj_bias=False, tie_word_embeddings=True)),  # zero o_proj bias written
    ("llama", dict(attention_bias=True, rope_parameters=LONGROPE)),
    ("mistral", dict(layer_types=["sliding_attention"] * 2, sliding_window=8)),
    ("mistral", dict(tie_word_embeddings=True, rope_parameters=YARN)),
    ("qwen2", dict(attention_bias=True, o_proj_bias=False, layer_types=["full_attention", "sliding_attention"],
                   sliding_window=8)),
    ("qwen2", dict()),  # no biases: written with zero q/k/v biases, same logits
]


@pytest.mark.parametrize("fmt,kw", NATIVE_CASES)
def test_native_to_stock_logits(fmt, kw, tmp_path):
    cfg, native = _native_model(**kw)
    native.save_pretrained(tmp_path / "native")
    convert_checkpoint(tmp_path / "native", tmp_path / fmt, "native", fmt)
    written = json.loads((tmp_path / fmt / "config.json").read_text())
    assert written["model_type"] == fmt and written["architectures"] == [CLASSES[fmt].__name__.replace(
        "Config", "ForCausalLM")]
    stock = _load(tmp_path / fmt)
    assert type(stock).__name__ == written["architectures"][0]
    ids = torch.randint(0, BASE["vocab_size"], (2, SEQ))
    assert _max_diff(native, stock, ids) <= TOL
    # and back: native -> fmt -> native is the same model
    convert_checkpoint(tmp_path / fmt, tmp_path / "back", fmt, "native")
    assert _max_diff(native, _load(tmp_path / "back"), ids) <= TOL


def _refusal(ncfg_kw, fmt):
    cfg, model = _native_model(**ncfg_kw)
    with pytest.raises(ConversionError) as exc:
        convert_state_dict(cfg.to_dict(), model.state_dict(), "native", fmt)
    return str(exc.value)


def test_refusals_name_the_problem():
    assert "no gate" in _refusal(dict(gate="sdpa_elementwise"), "llama")
    assert "QK-norm" in _refusal(dict(use_qk_norm=True), "mistral")
    assert "no attention biases" in _refusal(dict(attention_bias=True), "mistral")
    assert "no o_proj bias" in _refusal(dict(attention_bias=True), "qwen2")
    assert "sliding window" in _refusal(dict(layer_types=["full_attention", "sliding_attention"], sliding_window=4),
                                        "llama")
    assert "every layer or none" in _refusal(dict(layer_types=["full_attention", "sliding_attention"],
                                                  sliding_window=4), "mistral")
    assert "no qwen3 counterpart" in _refusal(dict(use_qk_norm=True, attention_bias=True, o_proj_bias=False), "qwen3")
    with pytest.raises(ValueError, match="sliding_window"):
        GatedQwen3Config(**BASE, layer_types=["sliding_attention"] * 2)  # a window layer needs a window length


def test_import_refusals_and_cli(tmp_path, capsys):
    cfg = transformers.LlamaConfig(**BASE, mlp_bias=True).to_dict()
    with pytest.raises(ConversionError, match="mlp_bias"):
        convert_state_dict(cfg, {}, "llama", "native")
    with pytest.raises(ConversionError, match="model_type 'llama'"):
        convert_state_dict(transformers.MistralConfig(**BASE).to_dict(), {}, "llama", "native")
    _, src = _stock("llama", {}, tmp_path)
    assert cli_main(["convert", str(src), str(tmp_path / "n"), "--from", "llama"]) == 0
    assert cli_main(["convert", str(tmp_path / "n"), str(tmp_path / "q"), "--from", "native", "--to", "qwen2"]) == 0
    capsys.readouterr()
    gated = build_lm(GatedQwen3Config(**BASE, use_qk_norm=False, gate="sdpa_headwise"), seed=None, eval=False)
    gated.save_pretrained(tmp_path / "g")
    assert cli_main(["convert", str(tmp_path / "g"), str(tmp_path / "x"), "--from", "native", "--to", "llama"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no gate" in err[0] and not (tmp_path / "x").exists()


def test_longrope_short_and_long_factors_like_stock(tmp_path):
    # short factors up to original_max_position_embeddings (16), long ones past it, also while generating across it
    stock, src = _stock("llama", dict(head_dim=24, rope_parameters=LONGROPE), tmp_path)
    convert_checkpoint(src, tmp_path / "native", "llama", "native")
    native = _load(tmp_path / "native")
    for n in (10, 16, 17):
        assert _max_diff(stock, native, torch.randint(0, BASE["vocab_size"], (1, n))) <= TOL
    kw = dict(max_new_tokens=8, do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    prompt = torch.randint(0, BASE["vocab_size"], (1, 12))
    a, b = stock.generate(prompt, **kw), native.generate(prompt, **kw)
    assert torch.equal(a.sequences, b.sequences)
    assert max(float((x - y).abs().max()) for x, y in zip(a.scores, b.scores)) <= TOL
