"""decode.generate_fast against transformers' `model.generate` (the reference): same greedy tokens for batch 1, a
left-padded batch, EOS handling and the fused layers; sampling reproducible under a seed; errors. Tiny models only."""
import pytest
import torch

import gated_attention.modeling  # noqa: F401  (registers the Auto classes)
from gated_attention.decode import generate_fast
from gated_attention.fused import fuse_qkv
from harness import tiny_lm


def tiny(gate, seed=0):
    # a wide init so greedy decoding does not collapse onto one repeated token (that would make equality trivial)
    return tiny_lm(gate, backend=None, seed=seed, initializer_range=0.5)


def left_padded(seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(1, 128, (3, 7), generator=g)
    am = torch.ones_like(x)
    am[1, :3] = 0
    am[2, :1] = 0
    return x.masked_fill(am == 0, 0), am


@pytest.mark.parametrize("gate", ["baseline", "sdpa_elementwise", "sdpa_headwise"])
def test_greedy_batch1_matches_generate(gate):
    model = tiny(gate)
    x = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(2))
    ref = model.generate(x, max_new_tokens=16, do_sample=False)
    out = generate_fast(model, x, 16)
    assert len(set(ref[0, 5:].tolist())) > 3  # the model really varies its output
    assert out.tolist() == ref.tolist()


@pytest.mark.parametrize("fused", [False, True])
def test_greedy_left_padded_batch_matches_generate(fused):
    model = tiny("sdpa_elementwise")
    if fused:
        fuse_qkv(model)
    x, am = left_padded()
    ref = model.generate(x, attention_mask=am, max_new_tokens=12, do_sample=False, pad_token_id=0)
    out = generate_fast(model, x, 12, attention_mask=am)
    assert out.tolist() == ref.tolist()


def test_eager_kernel_matches_generate():
    model = tiny("sdpa_headwise")
    model.set_attn_implementation("eager")
    x, am = left_padded(3)
    ref = model.generate(x, attention_mask=am, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert generate_fast(model, x, 8, attention_mask=am).tolist() == ref.tolist()


@pytest.mark.parametrize("which", [0, 2])
def test_eos_pads_finished_rows_and_stops_like_generate(which):
    model = tiny("sdpa_elementwise")
    x, am = left_padded()
    free = model.generate(x, attention_mask=am, max_new_tokens=12, do_sample=False, pad_token_id=0)
    eos = int(free[0, 7 + which])  # row 0 emits it as its first (which=0) or third new token
    ref = model.generate(x, attention_mask=am, max_new_tokens=12, do_sample=False, eos_token_id=eos, pad_token_id=0)
    out = generate_fast(model, x, 12, attention_mask=am, eos_token_id=eos, pad_token_id=0)
    assert out.tolist() == ref.tolist()
    assert (out[0, 7 + which + 1:] == 0).all()
    # every row finished early: both stop early, with the same length
    ids = [int(free[r, 7]) for r in range(3)]
    ref = model.generate(x, attention_mask=am, max_new_tokens=12, do_sample=False, eos_token_id=ids, pad_token_id=0)
    out = generate_fast(model, x, 12, attention_mask=am, eos_token_id=ids, pad_token_id=0)
    assert out.shape[1] == 8 and out.tolist() == ref.tolist()


def _ranks(model, seq, prompt_len):
    """(B, n) rank of each generated token among its step's logits (0 = the argmax), each step's logits from a plain
    forward over the whole prefix (no cache: an oracle independent of generate_fast's incremental path)."""
    with torch.no_grad():
        logits = model(input_ids=seq[:, :-1]).logits[:, prompt_len - 1:].float()  # (B, n, V): step t predicts t + 1
    chosen = logits.gather(-1, seq[:, prompt_len:, None])  # (B, n, 1)
    return (logits > chosen).sum(-1)  # logits strictly above the chosen one


def test_sampling_is_seeded_and_respects_top_k():
    model = tiny("sdpa_elementwise")
    x = torch.randint(0, 128, (2, 4), generator=torch.Generator().manual_seed(4))
    a = generate_fast(model, x, 10, do_sample=True, top_k=5, generator=torch.Generator().manual_seed(0))
    b = generate_fast(model, x, 10, do_sample=True, top_k=5, generator=torch.Generator().manual_seed(0))
    assert a.tolist() == b.tolist()
    # top_k=5: every sampled token is among its step's 5 highest logits. A high temperature flattens the distribution
    # so the check has teeth: the same sampling without top_k leaves the top 5 (positive control), and with top_k=5
    # it still picks tokens other than the argmax (not greedy in disguise).
    hot = dict(do_sample=True, temperature=3.0, stop_at_eos=False)
    k5 = _ranks(model, generate_fast(model, x, 24, top_k=5, **hot, generator=torch.Generator().manual_seed(1)), 4)
    free = _ranks(model, generate_fast(model, x, 24, **hot, generator=torch.Generator().manual_seed(1)), 4)
    assert int(k5.max()) < 5 and int((k5 > 0).sum()) > 5, k5
    assert int(free.max()) >= 5, free
    one = generate_fast(model, x, 10, do_sample=True, top_k=1, generator=torch.Generator().manual_seed(0))
    assert one.tolist() == generate_fast(model, x, 10).tolist()  # top-1 sampling is greedy
    nucleus = generate_fast(model, x, 10, do_sample=True, top_p=1e-6, generator=torch.Generator().manual_seed(0))
    assert nucleus.tolist() == generate_fast(model, x, 10).tolist()  # a vanishing nucleus keeps only the argmax


def test_compiled_step_matches_eager_loop():
    model = tiny("sdpa_elementwise")
    x, am = left_padded()
    ref = generate_fast(model, x, 6, attention_mask=am)
    out = generate_fast(model, x, 6, attention_mask=am, compile_step=True)
    torch._dynamo.reset()
    assert out.tolist() == ref.tolist()


def test_errors_are_loud():
    model = tiny("sdpa_elementwise")
    x, am = left_padded()
    with pytest.raises(ValueError, match="LEFT padding"):
        generate_fast(model, x, 4, attention_mask=am.flip(1))
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate_fast(model, x, 0)
    with pytest.raises(ValueError, match="temperature"):
        generate_fast(model, x, 2, do_sample=True, temperature=0.0)
