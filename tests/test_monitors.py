"""The trainer's residual-stream probe (train/monitors.py): the lost-update share against a hand-computed case and
against real bf16 rounding, and `residual_stream_stats` on a model against the same formula applied to the stream
and updates captured directly from the decoder layers."""
from __future__ import annotations

import math

import pytest
import torch

from gated_attention.train.monitors import (bf16_half_ulp, decoder_layers, lost_update_counts, lost_update_share,
                                            residual_stream_stats)
from harness import tiny_lm

INF, NAN = float("inf"), float("nan")

# (stream value, update, lost?) with half an ulp = 2^(floor(log2|x|) - 8):
#   1.0 and 1.5 -> 2^-8 = 0.00390625; -3.0 -> 2^-7 = 0.0078125; 1e4 (2^13 <= 1e4 < 2^14) -> 2^5 = 32
HAND = [
    (1.0, 0.003, True),
    (1.0, 0.00390625, False),  # exactly half an ulp: a tie, not "smaller than"
    (1.0, 0.004, False),
    (1.5, -0.003, True),  # negative update
    (-3.0, 0.0078, True),  # negative stream
    (-3.0, -0.008, False),
    (1e4, 31.9, True),
    (1e4, -32.0, False),  # exactly half an ulp
    (1e4, 33.0, False),
    (0.0, 1e-30, False),  # a zero stream value: the update becomes the value
    (5.0, 0.0, False),  # a zero update is not lost (nothing to lose) but counted
]


def test_half_ulp_known_values():
    x = torch.tensor([1.0, 1.5, 1.99, 2.0, -3.0, 1e4, 0.5, 0.0, INF, NAN, 2.0 ** -130])
    want = [2 ** -8, 2 ** -8, 2 ** -8, 2 ** -7, 2 ** -7, 2 ** 5, 2 ** -9, 0.0, 0.0, 0.0, 2.0 ** -138]
    assert bf16_half_ulp(x).tolist() == want
    assert bf16_half_ulp(x.to(torch.bfloat16)[:7]).tolist() == want[:7]  # a bf16 stream: the same (exact upcast)


def test_lost_update_share_hand_computed():
    stream = torch.tensor([s for s, _, _ in HAND] + [INF, 2.0])
    update = torch.tensor([u for _, u, _ in HAND] + [1.0, NAN])  # the last two pairs are not finite: not counted
    lost = sum(flag for _, _, flag in HAND)
    assert lost == 4
    assert lost_update_counts(stream, update) == (4, len(HAND))
    assert lost_update_share(stream, update) == pytest.approx(4 / 11)
    # any shape, any dtype: the same pairs as (B, T, d) and as a bf16 update of an fp32 stream
    assert lost_update_counts(stream[:12].reshape(2, 3, 2), update[:12].reshape(2, 3, 2)) == (4, 11)
    assert lost_update_counts(torch.full((4,), 1e4), torch.tensor([31.0, 16.0, 40.0, 64.0]).bfloat16()) == (2, 4)
    assert math.isnan(lost_update_share(torch.tensor([INF]), torch.tensor([1.0])))


def test_lost_means_rounded_away_in_bf16():
    """Away from ties and powers of two (where the spacing below is finer), an update is lost by the definition
    exactly when adding it to a bf16 value and rounding to bf16 gives back that value."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(20000, generator=g) * 10 ** torch.randint(-3, 5, (20000,), generator=g)).bfloat16().float()
    half = bf16_half_ulp(x)
    u = half * torch.empty(20000).uniform_(-3, 3, generator=g)
    # no zeros, no near-ties, no powers of two
    keep = (x != 0) & (u != 0) & ((u.abs() / half - 1).abs() > 0.01) & ((x.abs().log2() % 1) != 0)
    x, u = x[keep], u[keep]
    rounded_away = (x.double() + u.double()).float().bfloat16().float() == x
    lost = (u.abs() < bf16_half_ulp(x)) & (u != 0)
    assert torch.equal(lost, rounded_away)
    assert 0.2 < float(lost.float().mean()) < 0.5  # both kinds are present


def test_residual_stream_stats_matches_captured_stream():
    from gated_attention.capture import Recorder, capture

    model = tiny_lm("sdpa_elementwise", backend=None, eval=False, perturbed=True)
    x = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(300.0)  # a large stream: some updates fall below half an ulp
        with capture(model, Recorder(names=("attn_output", "attn_residual", "ffn_output", "ffn_residual"))) as rec:
            model(input_ids=x)
        emb = model.model.embed_tokens(x)
    n = model.config.num_hidden_layers
    want, acts = [], []
    stream = emb
    for i in range(n):
        h1, r1 = rec.get(i, "attn_output"), rec.get(i, "attn_residual")
        h2, r2 = rec.get(i, "ffn_output"), rec.get(i, "ffn_residual")
        a, b = lost_update_counts(stream, h1), lost_update_counts(r1, h2)
        want.append((a[0] + b[0]) / (a[1] + b[1]))
        acts.append(float(r2.abs().max()))
        stream = r2
    layers = decoder_layers(model)
    with torch.no_grad():
        got = residual_stream_stats(layers, lambda: model(input_ids=x))
    assert got["lost_update_share"] == pytest.approx(want, abs=0) and 0 < max(want) < 1
    assert got["max_act"] == pytest.approx(acts, rel=1e-6)
    # the hooks are gone afterwards
    assert all(not layer._forward_hooks and not layer._forward_pre_hooks for layer in layers)


def test_stand_in_layers_have_no_lost_update_share():
    layers = [torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)]
    x = torch.ones(1, 4)
    got = residual_stream_stats(layers, lambda: layers[1](layers[0](x)))
    assert got["lost_update_share"] == [None, None] and len(got["max_act"]) == 2
