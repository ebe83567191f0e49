"""`gattn export --to gguf` (interop/gguf_export.py): the file's layout read back with gguf-py, its meaning checked by an
independent numpy forward of llama.cpp's graph (tests/support/gguf_reference.py), and — where the `serve` extra
(llama-cpp-python) is installed — the real engine: logits equal to ours at f32 on real text, greedy generations and
tokenization identical, for elementwise and headwise gates, identity-init gates and the ungated model."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

import gguf_reference
from _extras import need
from harness import perturb, tiny_lm

gguf = need("gguf", "pip install -e '.[export]'")

from gated_attention.interop import ConversionError  # noqa: E402
from gated_attention.interop.gguf_export import check_exportable, export_gguf  # noqa: E402
from gated_attention.interop.gguf_map import imrope_component, mrope_sections  # noqa: E402

# Real text (Austen, Pride and Prejudice, ch. 1; public domain): what the exported models are compared on.
TEXT = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want "
        "of a wife. However little known the feelings or views of such a man may be on his first entering a "
        "neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he is considered "
        "the rightful property of some one or other of their daughters.")
GATES = ("sdpa_elementwise", "sdpa_headwise")


@pytest.fixture(scope="session")  # built once per worker (tests/conftest.py: scheduling)
def tok_json(tiny_corpus):
    return tiny_corpus / "tokenizer" / "tokenizer.json"


@pytest.fixture(scope="session")  # built once per worker (tests/conftest.py: scheduling)
def text_ids(tok_json):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tok_json)).encode(TEXT).ids


def _vocab(tok_json) -> int:
    return len(json.loads(tok_json.read_text())["model"]["vocab"])


def _model(gate, tok_json, seed=0, **overrides):
    """A tiny model with every weight well off its init (std 0.2: peaked, not flat, next-token distributions)."""
    m = tiny_lm(gate, seed=seed, vocab_size=_vocab(tok_json), **overrides)
    return perturb(m, seed=seed + 1, std=0.2)


def _ours(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def test_mrope_sections_rotate_every_pair_by_the_position():
    # Qwen3.5's own sections for 64 rotary dims, and every pair on t/h/w (never e, position 0 for text)
    assert mrope_sections(64) == [11, 11, 10, 0]
    for rot in (2, 4, 8, 14, 32, 64, 128, 256):
        s = mrope_sections(rot)
        assert sum(s) == rot // 2
        assert all(imrope_component(k, s) != "e" for k in range(rot // 2)), rot
    # a naive split leaves pairs unrotated: [16, 16, 0, 0] puts pair 2 (2 % 3 == 2, no w section) on e
    assert imrope_component(31, [11, 11, 10, 0]) == "h" and imrope_component(2, [16, 16, 0, 0]) == "e"


@pytest.mark.parametrize("gate", GATES)
def test_attn_q_holds_query_and_gate_rows_per_head(tmp_path, tok_json, gate):
    model = _model(gate, tok_json)
    out = tmp_path / "m.gguf"
    summary = export_gguf(model, out, tok_json)
    assert summary["architecture"] == "qwen35"
    arch, keys, t = gguf_reference.read_gguf(out)
    L = model.config.num_hidden_layers
    assert arch == "qwen35" and keys["qwen35.block_count"] == L + 1
    assert keys["qwen35.attention.recurrent_layers"] == [0] * L + [1]  # ours full attention, then the no-op layer
    assert not t[f"blk.{L}.ssm_out.weight"].any() and not t[f"blk.{L}.ffn_down.weight"].any()
    H, D = model.config.num_attention_heads, model.config.head_dim
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        fused = t[f"blk.{i}.attn_q.weight"].reshape(H, 2 * D, -1)  # (H, [q_h | g_h], d)
        q = attn.q_proj.weight.detach().reshape(H, D, -1)
        g = attn.gate.proj.weight.detach().reshape(H, -1, model.config.hidden_size)  # (H, D or 1, d)
        assert np.array_equal(fused[:, :D], q.numpy())
        assert np.array_equal(fused[:, D:], g.expand(H, D, -1).numpy())  # headwise: the head's row D times
        assert f"blk.{i}.attn_gate.weight" not in t
    assert "output.weight" not in t  # tiny preset: tied head
    assert keys["tokenizer.ggml.pre"] == "gpt-2" and keys["tokenizer.ggml.bos_token_id"] == 0


@pytest.mark.parametrize("gate,init", [*((g, "normal") for g in GATES), ("sdpa_elementwise", "identity"),
                                       ("baseline", "normal")])
def test_reference_forward_of_the_file_matches_our_logits(tmp_path, tok_json, text_ids, gate, init):
    model = _model(gate, tok_json, gate_init=init, tie_word_embeddings=gate != "baseline")
    out = tmp_path / "m.gguf"
    export_gguf(model, out, tok_json)
    ref = gguf_reference.forward(out, text_ids)
    ours = _ours(model, text_ids)
    assert np.abs(ref - ours).max() < 1e-4
    assert (ref.argmax(-1) == ours.argmax(-1)).all()


def test_q8_0_and_gate_type(tmp_path, tok_json, text_ids):
    model = _model("sdpa_elementwise", tok_json)
    kept = export_gguf(model, tmp_path / "kept.gguf", tok_json, "q8_0", gate_type="f32")
    assert kept["tensors"]["blk.0.attn_q.weight"] == "F32" and kept["tensors"]["blk.0.attn_k.weight"] == "Q8_0"
    assert kept["tensors"]["blk.0.attn_norm.weight"] == "F32"
    full = export_gguf(model, tmp_path / "all.gguf", tok_json, "q8_0")
    assert full["tensors"]["blk.0.attn_q.weight"] == "Q8_0"
    ours = _ours(model, text_ids)
    err = {name: np.abs(gguf_reference.forward(tmp_path / name, text_ids) - ours).max()
           for name in ("kept.gguf", "all.gguf")}
    for name, e in err.items():  # quantized: close (a few % of the logits' range), not equal
        assert 0 < e < 0.05 * np.ptp(ours), (name, e, np.ptp(ours))


@pytest.mark.parametrize("overrides,phrase", [
    (dict(gate="value_elementwise"), "no llama.cpp architecture"),
    (dict(gate="sdpa_elementwise", use_qk_norm=False), "use_qk_norm=False"),
    (dict(gate="sdpa_elementwise", attention_bias=True), "o_proj bias"),
    (dict(gate="sdpa_elementwise", rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                                    "original_max_position_embeddings": 128}), "RoPE scaling 'yarn'"),
    (dict(gate="sdpa_headwise", layer_types=["sliding_attention", "full_attention"], sliding_window=8), "sliding"),
])
def test_what_llama_cpp_cannot_compute_is_refused_in_one_line(overrides, phrase):
    from gated_attention.presets import model_config

    gate = overrides.pop("gate")
    with pytest.raises(ConversionError, match="cannot export|no llama.cpp") as err:
        check_exportable(model_config("tiny", gate, **overrides))
    assert phrase in str(err.value) and "\n" not in str(err.value)


def test_cli_export_with_the_checkpoints_tokenizer(tmp_path, tok_json, gattn_main):
    model = _model("sdpa_headwise", tok_json)
    ckpt = tmp_path / "ckpt"
    model.save_pretrained(ckpt)
    code, out, err = gattn_main("export", "--to", "gguf", str(ckpt), str(tmp_path / "a.gguf"))
    assert code == 2 and "no tokenizer.json" in err and "--tokenizer" in err
    for f in tok_json.parent.iterdir():
        shutil.copy(f, ckpt / f.name)
    code, out, err = gattn_main("export", "--to", "gguf", str(ckpt), str(tmp_path / "a.gguf"), "--outtype", "q8_0",
                                "--gate-type", "f16")
    assert code == 0, err
    assert "qwen35" in out
    code, out, err = gattn_main("export", "--to", "gguf", str(ckpt), str(tmp_path / "a.gguf"))
    assert code == 2 and "--overwrite" in err  # the existing file is kept
    arch, _, t = gguf_reference.read_gguf(tmp_path / "a.gguf")
    assert arch == "qwen35"


# ------------------------------------------------------------------------------------------ the real engine
def _llama(path, n_ctx=512, extra_bufts=True):
    """llama.cpp on `path`. extra_bufts=False turns llama.cpp's extra CPU buffer types (AMX, repacked weights) off:
    on an AMX Xeon, 0.3.36's AMX matmul of Q8_0 weights dies with SIGILL for every model (a stock qwen3 file too)."""
    llama_cpp = need("llama_cpp", "pip install -e '.[serve]' (builds llama.cpp from source: 8.5 min on one core)")
    import llama_cpp.llama_cpp as C

    default = C.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = extra_bufts
        return p

    C.llama_model_default_params = params  # Llama() takes no such argument; it builds its params from this
    try:
        return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, logits_all=True, n_threads=1,
                               verbose=False, seed=0)
    finally:
        C.llama_model_default_params = default


@pytest.mark.parametrize("gate,init", [*((g, "normal") for g in GATES), ("sdpa_headwise", "identity"),
                                       ("baseline", "normal")])
def test_llama_cpp_logits_generation_and_tokens_equal_ours(tmp_path, tok_json, text_ids, gate, init):
    model = _model(gate, tok_json, gate_init=init)
    out = tmp_path / "m.gguf"
    export_gguf(model, out, tok_json, "f32")
    llm = _llama(out)
    assert llm.tokenize(TEXT.encode(), add_bos=False, special=False) == text_ids
    llm.eval(text_ids)
    theirs = np.asarray(llm.scores[: len(text_ids)])
    ours = _ours(model, text_ids)
    assert np.abs(theirs - ours).max() <= 1e-2
    assert (theirs.argmax(-1) == ours.argmax(-1)).mean() >= 0.99
    prompt = text_ids[:12]
    with torch.no_grad():
        greedy = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, min_new_tokens=24,
                                eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    llm.reset()
    theirs_gen = []
    for tok in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
        theirs_gen.append(tok)
        if len(theirs_gen) == 24:
            break
    llm.close()
    assert theirs_gen == greedy


@pytest.mark.parametrize("outtype,gate_type", [("f16", None), ("bf16", None), ("q8_0", None), ("q8_0", "f32")])
def test_llama_cpp_runs_low_precision_files_close_to_the_reference(tmp_path, tok_json, text_ids, outtype, gate_type):
    model = _model("sdpa_headwise", tok_json)
    out = tmp_path / "low.gguf"
    export_gguf(model, out, tok_json, outtype, gate_type=gate_type)
    llm = _llama(out, extra_bufts=False)
    llm.eval(text_ids)
    theirs = np.asarray(llm.scores[: len(text_ids)])
    llm.close()
    ref = gguf_reference.forward(out, text_ids)  # the same dequantized weights in fp32
    # llama.cpp also rounds the activations (Q8 / f16 / bf16) for its dot products: close to the reference, not equal
    assert np.abs(theirs - ref).max() < 0.05 * np.ptp(ref)
    assert (theirs.argmax(-1) == ref.argmax(-1)).mean() >= 0.9
