"""Windowed (StreamingLLM) decoding in decode.py against an independent reference: a full forward through a plain
attention kernel with the equivalent mask (query t sees keys j < K and t - W < j <= t) and StreamingLLM's positions
(a sink key j seen from query t sits K + W - 1 - j positions back once the cache is full, i.e. it is rotated by the
number of evicted tokens on top of its own position). Also: greedy windowed generation is consistent with that
reference, the cache is updated in place and the stream's measured memory is flat over 40x W tokens, and the
refusals."""
import pytest
import torch
from transformers import AttentionInterface

from gated_attention.decode import SinkWindowCache, generate_fast, stream_logits, stream_nll
from gated_attention.rope import rotate_half
from harness import tiny_lm

WINDOW = {"W": None, "K": None}  # the reference kernel's settings (set per test)


def reference_kernel(module, q, k, v, mask, scaling, dropout=0.0, **kwargs):
    """q (B, H, T, D) and k, v (B, KV, T, D) of a full forward (keys rotated at absolute positions 0..T-1)."""
    W, K = WINDOW["W"], WINDOW["K"]
    b, h, t, d = q.shape
    rep = h // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)  # (B, H, T, D)
    scores = (q @ k.transpose(2, 3)).float() * scaling  # (B, H, T, T)
    if K:
        inv_freq = module.rope_inv_freq  # set by the test: (rot/2,)
        e = (torch.arange(t) - (K + W - 1)).clamp_min(0)  # tokens evicted when query t runs
        freqs = e[:, None].float() * inv_freq[None]  # (T, rot/2)
        emb = torch.cat((freqs, freqs), -1)  # (T, rot)
        cos, sin = emb.cos()[None, None, :, None], emb.sin()[None, None, :, None]  # (1, 1, T, 1, rot)
        ks = k[:, :, None, :K].float()  # (B, H, 1, K, D): sink keys, moved per query
        rot = emb.shape[-1]
        ks_r = ks[..., :rot] * cos + rotate_half(ks[..., :rot]) * sin
        ks = torch.cat((ks_r, ks[..., rot:].expand(*ks_r.shape[:-1], -1)), -1)  # (B, H, T, K, D)
        scores[..., :K] = torch.einsum("bhtd,bhtkd->bhtk", q.float(), ks) * scaling
    i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
    allowed = (j <= i) & ((j < K) | (j > i - W))  # (T, T)
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return (probs.to(v.dtype) @ v).transpose(1, 2).contiguous(), None  # (B, T, H, D)


AttentionInterface.register("streaming_reference", reference_kernel)


def reference_logits(model, ids, W, K):
    WINDOW.update(W=W, K=K)
    for layer in model.model.layers:
        layer.self_attn.rope_inv_freq = model.model.rotary_emb.inv_freq.float()
    old = model.config._attn_implementation
    model.set_attn_implementation("streaming_reference")
    try:
        with torch.no_grad():
            return model(input_ids=ids).logits.float()  # (B, T, V)
    finally:
        model.set_attn_implementation(old)


def model_for(gate, **kw):
    torch.manual_seed(0)
    return tiny_lm(gate, backend="sdpa", seed=0, initializer_range=0.3, **kw)


@pytest.mark.parametrize("gate,K", [("baseline", 0), ("baseline", 3), ("sdpa_elementwise", 2)])
def test_stream_logits_equal_masked_full_forward(gate, K):
    model = model_for(gate)
    ids = torch.randint(1, 128, (2, 41), generator=torch.Generator().manual_seed(1))
    W = 7
    got = stream_logits(model, ids, window=W, sink_tokens=K).float()
    ref = reference_logits(model, ids, W, K)
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)
    # and the reference is not trivially the full model: the window really cuts context
    full = model(input_ids=ids).logits.float()
    assert (full[:, K + W + 2:] - ref[:, K + W + 2:]).abs().max() > 1e-2
    assert torch.allclose(full[:, :K + W], ref[:, :K + W], atol=2e-4)  # nothing evicted yet: the same model


def test_yarn_scaled_rope_streams_like_the_reference():
    rp = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0}
    model = model_for("sdpa_headwise", rope_parameters=rp)
    assert model.model.rotary_emb.attention_scaling != 1.0  # the pure shift must not apply YaRN's scale twice
    ids = torch.randint(1, 128, (1, 30), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(stream_logits(model, ids, window=5, sink_tokens=2).float(),
                               reference_logits(model, ids, 5, 2), atol=2e-4, rtol=1e-4)


def test_stream_nll_matches_logits_and_full():
    model = model_for("baseline")
    ids = torch.randint(1, 128, (2, 25), generator=torch.Generator().manual_seed(3))
    nll = stream_nll(model, ids, window=6, sink_tokens=1)
    lg = reference_logits(model, ids[:, :-1], 6, 1)
    want = torch.nn.functional.cross_entropy(lg.transpose(1, 2), ids[:, 1:], reduction="none")
    torch.testing.assert_close(nll, want, atol=2e-4, rtol=1e-4)
    full = torch.nn.functional.cross_entropy(model(input_ids=ids[:, :-1]).logits.float().transpose(1, 2), ids[:, 1:],
                                             reduction="none")
    torch.testing.assert_close(stream_nll(model, ids, window=None), full)


def test_windowed_greedy_generation_follows_the_reference():
    """Each generated token is the argmax of the reference's logits at its position (the prompt is longer than the
    cache, so it streams too), and a window larger than everything gives plain generation."""
    model = model_for("sdpa_elementwise")
    ids = torch.randint(1, 128, (2, 15), generator=torch.Generator().manual_seed(4))
    W, K = 6, 2
    out = generate_fast(model, ids, 30, window=W, sink_tokens=K, stop_at_eos=False)
    assert out.shape == (2, 45) and torch.equal(out[:, :15], ids)
    ref = reference_logits(model, out[:, :-1], W, K)
    assert torch.equal(ref[:, 14:].argmax(-1), out[:, 15:])
    assert len(set(out[0, 15:].tolist())) > 3  # really varies
    plain = generate_fast(model, ids, 20, stop_at_eos=False)
    assert torch.equal(generate_fast(model, ids, 20, window=40, sink_tokens=0, stop_at_eos=False), plain)


def test_cache_is_updated_in_place_with_bounded_positions():
    model = model_for("baseline")
    W, K = 8, 4
    cache = SinkWindowCache(model, 1, W, K, torch.float32, torch.device("cpu"))
    ptrs = [t.data_ptr() for t in cache.keys + cache.values]
    from gated_attention.decode import _stream_chunks

    ids = torch.randint(1, 128, (1, 10 * W + K), generator=torch.Generator().manual_seed(5))
    n = 0
    with torch.no_grad():
        for _, lg in _stream_chunks(model, ids, W, K, cache):
            n += lg.shape[1]
            assert [t.data_ptr() for t in cache.keys + cache.values] == ptrs  # the same buffers, written in place
            assert cache.get_seq_length() <= W + K
    assert n == ids.shape[1] and cache.seen == ids.shape[1]
    assert int(cache.position_of(torch.tensor(ids.shape[1] - 1), cache.seen)) == W + K - 1  # bounded positions


def test_memory_is_flat_over_forty_windows():
    """Measured, not the cache's own account: in a fresh process (warmed up by a 2-window stream), streaming 40
    windows of tokens grows the peak RSS by far less than the keys and values of the tokens past the window
    (what a cache that kept them, or a stream that held its logits, would add: ~20 MB here)."""
    import memprobe

    W, K, T = 64, 4, 40 * 64
    layers, kv, d = 4, 4, 64
    got = memprobe.run_peak(f"""
import torch
from gated_attention.decode import _stream_chunks
from harness import tiny_lm
model = tiny_lm("baseline", backend="sdpa", seed=0, num_hidden_layers={layers}, num_attention_heads={kv},
                num_key_value_heads={kv}, head_dim={d}, vocab_size=2048)
g = torch.Generator().manual_seed(5)
def stream(t):
    n = 0
    with torch.no_grad():
        for _, lg in _stream_chunks(model, torch.randint(1, 2048, (1, t), generator=g), {W}, {K}):
            n += lg.shape[1]
    return n
stream(2 * ({W} + {K}))
""", f"out['n'] = stream({T})")
    assert got["n"] == T
    per_token = 2 * layers * kv * d * 4  # fp32 keys + values of one token, all layers
    unbounded = (T - (W + K)) * per_token
    assert got["grown"] < 0.2 * unbounded, (got["grown"], unbounded)


def test_refusals():
    model = model_for("baseline")
    x = torch.randint(1, 128, (2, 6))
    am = torch.ones_like(x)
    am[1, 0] = 0
    with pytest.raises(ValueError, match="unpadded"):
        generate_fast(model, x, 3, attention_mask=am, window=4)
    with pytest.raises(ValueError, match="compile_step"):
        generate_fast(model, x, 3, window=4, compile_step=True)
    with pytest.raises(ValueError, match="window >= 1"):
        generate_fast(model, x, 3, window=0)
    cache = SinkWindowCache(model, 1, 4, 1, torch.float32, torch.device("cpu"))
    cache.plan(3)
    with pytest.raises(ValueError, match="evict within itself"):
        cache.plan(3)
