"""Gate retrofit (paper App. A.7, official issue #10): identity keeps the logits bit for bit, random is the official
N(0, std) init, stock Qwen3 dirs are accepted, bad requests fail clearly, and continued training with the normal
trainer (`init_from`) starts from the retrofitted weights and moves the gate."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import Qwen3Config

from gated_attention import GatedQwen3ForCausalLM
from gated_attention.cli import main
from gated_attention.interop.retrofit import retrofit_checkpoint
from gated_attention.train.train_presets import tiny
from gated_attention.train.data_source import SyntheticSource
from gated_attention.train.trainer import train
from harness import stock_lm, tiny_lm


def _perturbed_tiny(**overrides) -> GatedQwen3ForCausalLM:
    """A tiny ungated model with every parameter off its init, so no part can be silently dropped."""
    return tiny_lm("none", backend=None, match_params=None, perturbed=True, **overrides)


def _load(path) -> GatedQwen3ForCausalLM:
    model, info = GatedQwen3ForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info  # every weight came from the file
    return model.eval()


IDS = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("gate", ["sdpa_elementwise", "sdpa_headwise", "value_elementwise", "dense_elementwise",
                                  "sdpa_input_independent", "sdpa_additive_silu"])
def test_identity_keeps_logits_exactly(tmp_path, gate):
    src = _perturbed_tiny(attention_bias=True)
    src.save_pretrained(tmp_path / "src")
    retrofit_checkpoint(tmp_path / "src", tmp_path / "dst", gate, "identity")
    out = _load(tmp_path / "dst")
    assert out.config.gate == gate and out.config.gate_init == "identity"
    gate_params = {k: v for k, v in out.state_dict().items() if ".self_attn.gate." in k}
    assert gate_params and all(torch.count_nonzero(v) == 0 for v in gate_params.values())
    for k, v in src.state_dict().items():  # every trained tensor copied bit for bit
        assert torch.equal(out.state_dict()[k], v), k
    for impl in ("sdpa", "eager"):
        src.set_attn_implementation(impl)
        out.set_attn_implementation(impl)
        with torch.no_grad():
            assert torch.equal(out(IDS).logits, src(IDS).logits), impl


def test_random_init_is_official_normal(tmp_path):
    src = _perturbed_tiny()
    src.save_pretrained(tmp_path / "src")
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        retrofit_checkpoint(tmp_path / "src", tmp_path / name, "sdpa_elementwise", "random", seed=seed)
    a, b, c = (load_file(tmp_path / n / "model.safetensors") for n in "abc")
    w = torch.cat([a[f"model.layers.{i}.self_attn.gate.proj.weight"].flatten() for i in range(2)])  # 2 * 32 * 32
    std = json.loads((tmp_path / "a" / "config.json").read_text())["initializer_range"]
    assert abs(w.mean().item()) < 0.2 * std and 0.9 * std < w.std().item() < 1.1 * std
    assert all(torch.equal(a[k], b[k]) for k in a)  # seeded
    assert not torch.equal(a["model.layers.0.self_attn.gate.proj.weight"], c["model.layers.0.self_attn.gate.proj.weight"])
    out = _load(tmp_path / "a")
    assert out.config.gate_init == "normal"  # plain sigmoid: the gate starts near 0.5, the logits change
    with torch.no_grad():
        assert (out(IDS).logits - src(IDS).logits).abs().max() > 1e-2


def test_stock_qwen3_dir_identity(tmp_path):
    cfg = Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False)
    stock = stock_lm(cfg)
    stock.save_pretrained(tmp_path / "stock")
    (tmp_path / "stock" / "tokenizer.json").write_text("{}")  # stands in for the tokenizer: must be carried along
    assert main(["retrofit", str(tmp_path / "stock"), "--gate", "headwise", "--init", "identity",
                 "--out", str(tmp_path / "dst")]) == 0
    out = _load(tmp_path / "dst")
    assert out.config.gate == "sdpa_headwise" and (tmp_path / "dst" / "tokenizer.json").read_text() == "{}"
    with torch.no_grad():
        assert torch.equal(out(IDS).logits, stock(IDS).logits)


def test_bad_requests_fail_clearly(tmp_path, capsys):
    src = _perturbed_tiny()
    src.save_pretrained(tmp_path / "src")
    with pytest.raises(ValueError, match="parameter-free.*--init random"):
        retrofit_checkpoint(tmp_path / "src", tmp_path / "x", "sdpa_silu", "identity")
    with pytest.raises(ValueError, match="act\\(0\\) != 0"):  # Y * silu(0) = 0: no identity start exists
        retrofit_checkpoint(tmp_path / "src", tmp_path / "x", "sdpa_elementwise_silu", "identity")
    with pytest.raises(ValueError, match="unknown gate 'nope'"):
        retrofit_checkpoint(tmp_path / "src", tmp_path / "x", "nope", "identity")
    with pytest.raises(ValueError, match="adds nothing"):
        retrofit_checkpoint(tmp_path / "src", tmp_path / "x", "baseline", "identity")
    retrofit_checkpoint(tmp_path / "src", tmp_path / "g", "sdpa_elementwise", "identity")
    with pytest.raises(ValueError, match="already has gate 'sdpa_elementwise'"):
        retrofit_checkpoint(tmp_path / "g", tmp_path / "x", "sdpa_headwise", "identity")
    assert not (tmp_path / "x").exists()
    # CLI: an existing --out is refused with one line, kept intact, and replaced with --overwrite
    before = (tmp_path / "g" / "model.safetensors").read_bytes()
    args = ["retrofit", str(tmp_path / "src"), "--gate", "g1", "--init", "random", "--out", str(tmp_path / "g")]
    assert main(args) == 2
    assert "already exists" in capsys.readouterr().err
    assert (tmp_path / "g" / "model.safetensors").read_bytes() == before
    assert main(args + ["--overwrite"]) == 0
    assert (tmp_path / "g" / "model.safetensors").read_bytes() != before


def test_continued_training_starts_from_retrofit(tmp_path):
    # 1. a briefly trained ungated model (the trainer's own export)
    base = tiny()
    base.steps, base.ckpt_every, base.stats_every, base.precision = 6, 0, 0, "fp32"
    train(base, tmp_path / "base")
    retrofit_checkpoint(tmp_path / "base" / "final", tmp_path / "retro", "sdpa_elementwise", "identity")
    # 2. the loss the continued run must log at step 0 if it really starts from these weights
    retro = _load(tmp_path / "retro").train()
    batch = SyntheticSource(retro.config.vocab_size).train_batch(base.batch_size, base.seq_len, base.seed, 0)
    with torch.no_grad():
        expected = F.cross_entropy(retro(input_ids=batch[:, :-1]).logits.flatten(0, 1), batch[:, 1:].flatten()).item()
    cont = tiny()
    cont.steps, cont.ckpt_every, cont.stats_every, cont.precision = 4, 0, 0, "fp32"
    cont.gate, cont.init_from = "sdpa_elementwise", str(tmp_path / "retro")
    summary = train(cont, tmp_path / "cont")
    log = [json.loads(l) for l in (tmp_path / "cont" / "log.jsonl").read_text().splitlines()]
    assert log[0]["loss"] == pytest.approx(expected, rel=1e-5)
    assert summary["gate"] == "sdpa_elementwise" and not summary["diverged"]
    final = _load(tmp_path / "cont" / "final")
    assert final.config.gate_init == "identity"  # the 2*sigmoid scale stays for the model's life
    moved = [final.state_dict()[f"model.layers.{i}.self_attn.gate.proj.weight"].abs().max().item() for i in range(2)]
    assert all(m > 0 for m in moved), moved
    # the run's gate must name the checkpoint's (so the summary and sweep tables say what trained)
    cont.gate = "baseline"
    with pytest.raises(ValueError, match="holds gate 'sdpa_elementwise'.*--gate sdpa_elementwise"):
        train(cont, tmp_path / "wrong")
