"""LoRA that knows the gate (interop/lora.py, the `lora` extra): PEFT adapters on q and on the gate's own projection
train, merge into our model, convert to the Qwen3-Next layout with the per-head [q_h | g_h] interleave exact, and
export to GGUF with the merged model's logits (the numpy reference of llama.cpp's graph; llama.cpp itself where the
`serve` extra is installed). The fused-layout adapter equals the two native adapters row for row."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import gguf_reference
from _extras import need
from harness import perturb, tiny_lm

need("peft", "pip install -e '.[lora]'")
need("gguf", "pip install -e '.[export]'")

from gated_attention.interop import convert_state_dict  # noqa: E402
from gated_attention.interop.gguf_export import export_gguf  # noqa: E402
from gated_attention.interop.lora import add_lora, fused_lora  # noqa: E402

TEXT = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want "
        "of a wife.")


def _batches(tiny_corpus, n, seed=0):
    from gated_attention.data import Corpus, sample_batch

    corpus = Corpus(tiny_corpus)
    return [sample_batch(corpus, "train", 4, 32, seed=seed, step=step) for step in range(n)]


@pytest.fixture(scope="session")  # built once per worker (tests/conftest.py: scheduling)
def trained(tiny_corpus):
    """A perturbed tiny elementwise-gated model with LoRA on q and the gate, trained 8 steps, and its losses."""
    from gated_attention.data import Corpus

    vocab = Corpus(tiny_corpus).vocab_size
    model = perturb(tiny_lm("sdpa_elementwise", vocab_size=vocab, eval=False), std=0.1)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    peft_model = add_lora(model, ("q", "gate"), r=4, alpha=8.0)
    opt = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=2e-2)
    losses = []
    batch = _batches(tiny_corpus, 1)[0]
    for _ in range(8):  # one batch again and again: the loss must fall if the adapters learn
        loss = peft_model(input_ids=batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return peft_model.eval(), base, losses


def test_only_the_q_and_gate_adapters_train(trained):
    peft_model, base, losses = trained
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert any(".gate.proj.lora_B" in n for n in trainable) and any(".q_proj.lora_B" in n for n in trainable)
    assert not any(k in n for n in trainable for k in ("k_proj", "v_proj", "o_proj", "mlp"))
    gate_lora = peft_model.base_model.model.model.layers[0].self_attn.gate.proj
    assert gate_lora.lora_B["default"].weight.shape[0] == gate_lora.base_layer.out_features  # its own width, H*D
    assert losses[-1] < losses[0] - 0.05, losses


def test_fused_adapter_equals_the_native_pair_per_head(trained):
    peft_model, _, _ = trained
    cfg = peft_model.config
    H, D = cfg.num_attention_heads, cfg.head_dim
    for i, (a, b) in fused_lora(peft_model, "qwen3-next").items():
        attn = peft_model.base_model.model.model.layers[i].self_attn
        delta = (b @ a).reshape(H, 2 * D, -1)  # the fused update, per head [q_h | g_h]
        dq, dg = attn.q_proj.get_delta_weight("default"), attn.gate.proj.get_delta_weight("default")
        torch.testing.assert_close(delta[:, :D], dq.reshape(H, D, -1), rtol=0, atol=1e-6)
        torch.testing.assert_close(delta[:, D:], dg.reshape(H, D, -1), rtol=0, atol=1e-6)


def test_merge_convert_to_qwen3_next_and_export_keep_the_logits(trained, tiny_corpus, tmp_path):
    peft_model, base, _ = trained
    ids = torch.tensor([_batches(tiny_corpus, 1, seed=1)[0][0].tolist()])
    with torch.no_grad():
        adapted = peft_model(input_ids=ids).logits[0]
    merged = copy.deepcopy(peft_model).merge_and_unload().eval()  # the shared fixture keeps its adapters
    with torch.no_grad():
        logits = merged(ids).logits[0]
    torch.testing.assert_close(logits, adapted, rtol=0, atol=1e-5)
    state = merged.state_dict()
    assert not torch.equal(state["model.layers.0.self_attn.gate.proj.weight"],
                           base["model.layers.0.self_attn.gate.proj.weight"])  # the gate itself was adapted

    # Qwen3-Next: q_proj rows per head [q_h | g_h] of the MERGED weights, exactly; and back again
    ncfg = merged.config.to_dict()
    ncfg = {k: v for k, v in ncfg.items() if k in type(merged.config).__dataclass_fields__}
    ncfg.update(model_type="gated_qwen3", dtype="float32")
    next_cfg, next_state = convert_state_dict(ncfg, state, "native", "qwen3-next")
    H, D = merged.config.num_attention_heads, merged.config.head_dim
    for i in range(merged.config.num_hidden_layers):
        fused = next_state[f"model.layers.{i}.self_attn.q_proj.weight"].reshape(H, 2 * D, -1)
        assert torch.equal(fused[:, :D], state[f"model.layers.{i}.self_attn.q_proj.weight"].reshape(H, D, -1))
        assert torch.equal(fused[:, D:], state[f"model.layers.{i}.self_attn.gate.proj.weight"].reshape(H, D, -1))
    _, back = convert_state_dict(next_cfg, next_state, "qwen3-next", "native")
    for k, v in back.items():
        torch.testing.assert_close(v, state[k], rtol=0, atol=1e-6)  # norms: the w - 1 shift rounds in the last bit

    # GGUF: the file's forward (llama.cpp's graph) gives the merged model's logits
    tok = tiny_corpus / "tokenizer" / "tokenizer.json"
    export_gguf(merged, tmp_path / "lora.gguf", tok)
    ref = gguf_reference.forward(tmp_path / "lora.gguf", ids[0].tolist())
    assert np.abs(ref - logits.numpy()).max() < 1e-4
    llama_cpp = need("llama_cpp", "pip install -e '.[serve]'")
    llm = llama_cpp.Llama(model_path=str(tmp_path / "lora.gguf"), n_ctx=128, n_batch=128, logits_all=True,
                          n_threads=1, verbose=False)
    llm.eval(ids[0].tolist())
    theirs = np.asarray(llm.scores[: ids.shape[1]])
    llm.close()
    assert np.abs(theirs - logits.numpy()).max() <= 1e-2
    assert (theirs.argmax(-1) == logits.numpy().argmax(-1)).mean() >= 0.99
