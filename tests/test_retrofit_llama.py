"""Retrofitting a gate onto Llama-family checkpoints (auto-detected from model_type): identity init keeps the stock
model's logits, and `trainable=gates` fine-tunes only the new gate parameters."""
from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file

from gated_attention import GatedQwen3ForCausalLM
from gated_attention.cli import main
from gated_attention.interop.retrofit import detect_format
from gated_attention.train.config import TrainConfig
from gated_attention.train.train_presets import tiny
from gated_attention.train.trainer import train
from harness import stock_lm

BASE = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)
STOCK = {
    "llama": transformers.LlamaConfig(**BASE, head_dim=24, attention_bias=True,
                                      rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
                                                           low_freq_factor=1.0, high_freq_factor=4.0,
                                                           original_max_position_embeddings=16)),
    "mistral": transformers.MistralConfig(**BASE, sliding_window=8, tie_word_embeddings=True),
    "qwen2": transformers.Qwen2Config(**BASE),
}


def _stock(fmt, path):
    model = stock_lm(STOCK[fmt], perturbed=True)  # norms and biases off their init: a dropped one shows
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("fmt", list(STOCK))
@pytest.mark.parametrize("gate", ["sdpa_elementwise", "sdpa_headwise"])
def test_identity_retrofit_keeps_stock_logits(fmt, gate, tmp_path):
    stock = _stock(fmt, tmp_path / "src")
    assert detect_format(json.loads((tmp_path / "src" / "config.json").read_text())) == fmt
    assert main(["retrofit", str(tmp_path / "src"), "--gate", gate, "--init", "identity",
                 "--out", str(tmp_path / "retro")]) == 0
    retro, info = GatedQwen3ForCausalLM.from_pretrained(tmp_path / "retro", dtype=torch.float32,
                                                        output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert retro.config.gate == gate and not retro.config.use_qk_norm
    ids = torch.randint(0, BASE["vocab_size"], (2, 20))  # longer than Mistral's window
    with torch.no_grad():
        assert torch.equal(stock(ids).logits, retro.eval()(ids).logits)


def test_trainable_gates_moves_only_the_gates(tmp_path):
    _stock("llama", tmp_path / "src")
    assert main(["retrofit", str(tmp_path / "src"), "--gate", "sdpa_elementwise", "--init", "identity",
                 "--out", str(tmp_path / "retro")]) == 0
    cfg = tiny()
    cfg.steps, cfg.ckpt_every, cfg.stats_every, cfg.precision, cfg.lr = 5, 0, 0, "fp32", 1e-2
    cfg.gate, cfg.init_from, cfg.trainable = "sdpa_elementwise", str(tmp_path / "retro"), "gates"
    summary = train(cfg, tmp_path / "run")
    assert summary["steps"] == 5 and not summary["diverged"]
    before = load_file(tmp_path / "retro" / "model.safetensors")
    after = load_file(tmp_path / "run" / "final" / "model.safetensors")
    assert set(before) == set(after)
    gates = [k for k in before if ".self_attn.gate." in k]
    assert len(gates) == 2 * 2  # proj.weight and proj.bias (Llama attention_bias) in each of the 2 layers
    for k in before:
        if k in gates:
            assert not torch.equal(before[k], after[k]), f"{k} did not train"
        else:
            assert torch.equal(before[k], after[k]), f"{k} changed but only the gates should train"


def test_trainable_setting_is_validated(tmp_path):
    with pytest.raises(ValueError, match="trainable='gate'"):
        TrainConfig(trainable="gate").validate()
    cfg = tiny()
    cfg.steps, cfg.trainable = 2, "gates"  # the ungated tiny model has nothing to train
    with pytest.raises(ValueError, match="no gate parameters"):
        train(cfg, tmp_path / "run")


def test_data_prepare_with_the_models_own_tokenizer(tmp_path):
    """`gattn data prepare --tokenizer DIR`: token files in a foreign vocabulary (here one without a BOS token, like
    Qwen2's), so gate fine-tuning data matches a pretrained model; documents end with ITS eos."""
    from transformers import PreTrainedTokenizerFast

    from gated_attention.data import Corpus, PrepareConfig, prepare, train_tokenizer

    text = "the quick brown fox jumps over the lazy dog. " * 400
    base = train_tokenizer([text], vocab_size=300)
    foreign = PreTrainedTokenizerFast(tokenizer_object=base.backend_tokenizer, eos_token="<|eos|>")  # no bos, no pad
    foreign.save_pretrained(tmp_path / "model")
    (tmp_path / "t.txt").write_text(text)
    assert main(["data", "prepare", "--data-dir", str(tmp_path / "data"), "--tokenizer", str(tmp_path / "model"),
                 "--sources", "--extra", str(tmp_path / "t.txt"), "--chunk-chars", "2048"]) == 0
    corpus = Corpus(tmp_path / "data")
    eos = foreign.eos_token_id
    assert (corpus.bos_id, corpus.eos_id, corpus.pad_id) == (eos, eos, eos)
    assert corpus.manifest["tokenizer"]["external"] == str(tmp_path / "model")
    train_ids = corpus.tokens("t", "train")
    assert train_ids[-1] == eos
    first_doc = train_ids[: list(train_ids).index(eos)]
    assert foreign.decode(first_doc) == text[: len(foreign.decode(first_doc))]  # the foreign vocabulary, decodable
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        prepare(PrepareConfig(data_dir=str(tmp_path / "d2"), sources=(), extra=(str(tmp_path / "t.txt"),),
                              tokenizer=str(tmp_path)))
