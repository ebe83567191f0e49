"""The comparison-mechanism registry (mechanisms.py): every runtime mechanism x {eager, sdpa} through the model harness (finite forward/backward,
backend agreement incl. gradients, KV-cache generation, left padding, save/load), the parameter formulas against
built models and the paper's columns, and each mechanism against its formula written out with plain ops."""
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

import gated_attention.modeling  # noqa: F401  (registers the Auto classes)
from gated_attention.mechanisms import MECHANISMS, expanded_config, get_mechanism
from gated_attention.presets import added_params, mechanism_config, model_config, paper_report
from harness import build_lm, perturb, tiny_lm

RUNTIME = [n for n, s in MECHANISMS.items() if s.runtime]
BACKENDS = ["eager", "sdpa"]


def tiny_model(mechanism="none", backend="sdpa", seed=0, gate="none", **kw):
    return tiny_lm(gate, backend, seed, mechanism=mechanism, **kw)


# --- the harness -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", RUNTIME)
def test_forward_backward_finite_and_backends_agree(name):
    x = torch.randint(0, 128, (2, 9))
    grads = {}
    for backend in BACKENDS:
        model = perturb(tiny_model(name, backend)).train()
        out = model(x, labels=x)
        assert torch.isfinite(out.loss)
        out.loss.backward()
        grads[backend] = {n: p.grad for n, p in model.named_parameters()}
        assert all(g is not None and torch.isfinite(g).all() for g in grads[backend].values()), name
        extra = [n for n in grads[backend] if ".mechanism." in n or "output_transform" in n]
        assert all(grads[backend][n].abs().sum() > 0 for n in extra), f"{name}: a mechanism parameter gets no gradient"
        grads[backend]["logits"] = out.logits.detach()
    for n in grads["eager"]:
        torch.testing.assert_close(grads["eager"][n], grads["sdpa"][n], atol=2e-5, rtol=1e-4, msg=f"{name}: {n}")


@pytest.mark.parametrize("name", RUNTIME)
@pytest.mark.parametrize("backend", BACKENDS)
def test_cached_generation_equals_uncached(name, backend):
    model = perturb(tiny_model(name, backend))
    prompt = torch.randint(0, 128, (1, 5))
    out = model.generate(prompt, max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True,
                         pad_token_id=0)
    full = model(out.sequences).logits
    for i, step_logits in enumerate(out.logits):
        torch.testing.assert_close(step_logits[0], full[0, prompt.shape[1] - 1 + i], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["sink_logits", "forgetting", "clipped_softmax", "switch_kv_4top4"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_left_padded_row_equals_the_row_alone(name, backend):
    model = perturb(tiny_model(name, backend))
    b = torch.randint(1, 128, (1, 4))
    batch = torch.cat([torch.randint(1, 128, (1, 7)), torch.cat([torch.zeros(1, 3, dtype=torch.long), b], 1)])
    mask = torch.cat([torch.ones(1, 7), torch.cat([torch.zeros(1, 3), torch.ones(1, 4)], 1)]).long()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(batch, attention_mask=mask, position_ids=pos).logits
    torch.testing.assert_close(logits[1, 3:], model(b).logits[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", RUNTIME)
def test_save_load_round_trip(tmp_path, name):
    model = perturb(tiny_model(name))
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.mechanism == name
    x = torch.randint(0, 128, (2, 8))
    torch.testing.assert_close(loaded(x).logits, model(x).logits, atol=0, rtol=0)


# --- parameter counts ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", [n for n in MECHANISMS if n != "none"])
def test_added_params_equal_the_built_model(name):
    preset = "tiny-moe" if name == "more_experts" else "tiny"
    base = model_config(preset, match_params=False)
    n0 = sum(p.numel() for p in build_lm(base).parameters())
    n1 = sum(p.numel() for p in build_lm(mechanism_config(preset, name)).parameters())
    assert n1 - n0 == added_params(name, base)


def test_15a2b_added_params_formulas_and_paper_columns():
    cfg = model_config("15a2b")
    L, d, H, KV, D = 24, 2048, 32, 4, 128
    rows = {r["name"]: r for r in paper_report(cfg)}
    # expansions: the paper's 50 M and 201 M follow from the shape; +4 experts is 453 M by the formula vs 400 M printed
    assert rows["more_kv_heads"]["added"] == L * 2 * d * KV * D
    assert round(rows["more_kv_heads"]["added"] / 1e6) == 50
    assert round(rows["more_q_heads"]["added"] / 1e6) == 201 == rows["more_q_heads"]["paper_added_m"]
    assert rows["more_experts"]["added"] == L * 4 * (3 * d * 768 + d)
    # switch heads: (E-1) extra d x D experts per KV head per switched projection, plus one d -> KV*E selector
    assert rows["switch_v_1top1"]["added"] == L * d * KV  # = the v headwise gate's 0.2 M; the paper prints 3 M
    assert rows["switch_v_8top2"]["added"] == L * (7 * KV * D * d + d * KV * 8)
    assert rows["switch_kv_8top8"]["added"] == L * (2 * 7 * KV * D * d + d * KV * 8)
    assert [rows[n]["paper_added_m"] for n in ("switch_kv_8top8", "switch_kv_4top4", "switch_v_4top4", "switch_v_8top2",
                                               "switch_v_1top1")] == [38, 13, 13, 25, 3]
    assert rows["bondarenko_gate"]["added"] is None  # d=2048 != H*D=4096: not applicable to this shape


def test_expanded_config_shapes_and_errors():
    cfg = model_config("15a2b")
    assert expanded_config(cfg, "more_kv_heads").num_key_value_heads == 8
    assert expanded_config(cfg, "more_q_heads").num_attention_heads == 48
    more = expanded_config(cfg, "more_experts")
    assert (more.num_experts, more.num_experts_per_tok) == (132, 12)
    with pytest.raises(ValueError, match="needs an MoE model"):
        expanded_config(model_config("tiny"), "more_experts")
    with pytest.raises(ValueError, match="changes the model shape"):
        model_config("tiny", mechanism="more_kv_heads")


def test_invalid_names_and_settings_fail_clearly():
    with pytest.raises(ValueError, match="unknown mechanism"):
        model_config("tiny", mechanism="switch_q_4top4")
    with pytest.raises(ValueError, match="top_k"):
        get_mechanism("switch_v_2top3")
    with pytest.raises(ValueError, match="only used by mechanism='clipped_softmax'"):
        model_config("tiny", softmax_gamma=-0.1)
    with pytest.raises(ValueError, match="zeta >= 1"):
        model_config("tiny", mechanism="clipped_softmax", softmax_zeta=0.5)
    with pytest.raises(ValueError, match="hidden_size == num_attention_heads"):
        model_config("tiny", mechanism="bondarenko_gate", head_dim=16)
    with pytest.raises(ValueError, match="eager and sdpa"):
        tiny_model("sink_logits").model.layers[0].self_attn.mechanism.wrap(None, "flash_attention_2")
    assert get_mechanism("switch_v_16top4").experts == 16 and get_mechanism("output_clip_50").clip == 50.0


# --- each mechanism against its formula ---------------------------------------------------------------------------

def _layer_inputs(model, t=6, seed=3):
    torch.manual_seed(seed)
    x = torch.randn(1, t, model.config.hidden_size)
    cos, sin = model.model.rotary_emb(x, torch.arange(t)[None])
    return x, cos, sin


def _plain_attention(attn, x, cos, sin, *, k=None, v=None, rope=True, logit_bias=None, sink=None, clip=None,
                     head_gate=None, out_gate=None):
    """One attention layer written out: q/k/v, QK-norm, RoPE, causal softmax with the optional mechanism terms;
    out_gate (1, T, H, D or 1) multiplies the (1, T, H, D) output before o_proj (the G1 gate)."""
    _, t, _ = x.shape
    H, KV, D = attn.num_heads, attn.num_kv_heads, attn.head_dim
    q = attn.q_norm(attn.q_proj(x).view(1, t, H, D)).transpose(1, 2)  # (1, H, T, D)
    k = attn.k_proj(x).view(1, t, KV, D) if k is None else k
    v = attn.v_proj(x).view(1, t, KV, D) if v is None else v
    k, v = attn.k_norm(k).transpose(1, 2), v.transpose(1, 2)  # (1, KV, T, D)

    def rot(z):
        z1, z2 = z[..., : D // 2], z[..., D // 2:]
        return z * cos[:, None] + torch.cat((-z2, z1), -1) * sin[:, None]

    if rope:
        q, k = rot(q), rot(k)
    k, v = k.repeat_interleave(H // KV, 1), v.repeat_interleave(H // KV, 1)
    z = (q @ k.transpose(-1, -2)) / math.sqrt(D)  # (1, H, T, T)
    if logit_bias is not None:
        z = z + logit_bias
    z = z.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), -math.inf)
    e = z.exp()
    denom = e.sum(-1, keepdim=True)
    if sink is not None:
        denom = denom + sink.exp().view(1, H, 1, 1)  # the sink's exp joins the denominator, its value is zero
    p = e / denom
    if clip is not None:
        zeta, gamma = clip
        p = torch.clamp((zeta - gamma) * p + gamma, 0, 1)
    y = (p @ v).transpose(1, 2)  # (1, T, H, D)
    if head_gate is not None:
        y = y * head_gate[..., None]
    if out_gate is not None:
        y = y * out_gate
    return attn.o_proj(y.reshape(1, t, H * D))


def _check(name, make_reference, **kw):
    for backend in BACKENDS:
        model = perturb(tiny_model(name, backend, **kw))
        attn = model.model.layers[0].self_attn
        x, cos, sin = _layer_inputs(model)
        out, _ = attn(x, (cos, sin), None)
        torch.testing.assert_close(out, make_reference(attn, x, cos, sin), atol=1e-5, rtol=1e-4, msg=backend)


def test_sink_logits_formula():
    _check("sink_logits", lambda a, x, c, s: _plain_attention(a, x, c, s, sink=a.mechanism.sinks))


def test_clipped_softmax_formula_and_exact_zeros():
    _check("clipped_softmax", lambda a, x, c, s: _plain_attention(a, x, c, s, clip=(1.05, -0.1)),
           softmax_zeta=1.05, softmax_gamma=-0.1)
    model = tiny_model("clipped_softmax", "eager", softmax_gamma=-0.2)
    from gated_attention.capture import Recorder, capture

    with capture(model, Recorder(["attn_probs"], wants_probs=True)) as rec:
        model(torch.randint(0, 128, (1, 12)))
    probs = rec.get(0, "attn_probs")
    assert (probs[..., 6:, :] == 0).float().mean() > 0.3  # gamma < 0 reaches exact zeros (unmasked entries too)


def _forgetting_reference(rope: bool):
    def make(a, x, c, s):
        t = x.shape[1]
        logf = torch.nn.functional.logsigmoid(x @ a.mechanism.proj.weight.T + a.mechanism.proj.bias)  # (1, T, H)
        bias = torch.zeros(1, a.num_heads, t, t)
        for i in range(t):
            for j in range(i + 1):
                bias[0, :, i, j] = logf[0, j + 1: i + 1].sum(0)  # sum_{l=j+1..i} log f_l
        return _plain_attention(a, x, c, s, rope=rope, logit_bias=bias)
    return make


def test_forgetting_formula_with_and_without_rope():
    _check("forgetting", _forgetting_reference(True))
    _check("forgetting_nope", _forgetting_reference(False))


def test_bondarenko_gate_formula_and_init():
    def ref(a, x, c, s):
        H, D = a.num_heads, a.head_dim
        gate = torch.stack([torch.sigmoid(x[..., h * D:(h + 1) * D] @ a.mechanism.weight[h] + a.mechanism.bias[h])
                            for h in range(H)], -1)  # (1, T, H): head h reads only its own slice of x
        return _plain_attention(a, x, c, s, head_gate=gate)

    _check("bondarenko_gate", ref)
    fresh = tiny_model("bondarenko_gate").model.layers[1].self_attn.mechanism
    torch.testing.assert_close(torch.sigmoid(fresh.bias), torch.full((4,), 0.25))


def _switch_reference(name: str):
    spec = get_mechanism(name)

    def ref(a, x, c, s):
        sw, t, KV, D, E = a.mechanism, x.shape[1], a.num_kv_heads, a.head_dim, spec.experts
        W_s = sw.router.weight.view(KV, E, -1)  # (KV, E, d)

        def expert(proj, extra, g, e):  # expert e of KV head g: (1, T, D)
            if e == 0:
                return proj(x).view(1, t, KV, D)[:, :, g]
            rows = slice(((e - 1) * KV + g) * D, ((e - 1) * KV + g + 1) * D)
            return x @ extra.weight[rows].T + (extra.bias[rows] if extra.bias is not None else 0)

        ks, vs = [], []
        for g in range(KV):
            score = torch.sigmoid(x @ W_s[g].T)  # (1, T, E), non-competitive
            chosen = score.argsort(-1, descending=True)[..., : spec.top_k]  # (1, T, k)
            w = torch.zeros_like(score).scatter(-1, chosen, score.gather(-1, chosen))
            vs.append(sum(w[..., e: e + 1] * expert(a.v_proj, sw.v_experts, g, e) for e in range(E)))
            ks.append(sum(w[..., e: e + 1] * expert(a.k_proj, sw.k_experts, g, e) for e in range(E))
                      if spec.switch_keys else a.k_proj(x).view(1, t, KV, D)[:, :, g])
        return _plain_attention(a, x, c, s, k=torch.stack(ks, 2), v=torch.stack(vs, 2))
    return ref


@pytest.mark.parametrize("name", ["switch_v_8top2", "switch_kv_4top4", "switch_v_1top1"])
def test_switch_heads_formula(name):
    _check(name, _switch_reference(name))


def test_switch_v_1top1_is_the_value_headwise_gate():
    gate_model = tiny_model(gate="value_headwise")
    switch = tiny_model("switch_v_1top1")
    sd = {k.replace("self_attn.gate.proj", "self_attn.mechanism.router"): v for k, v in gate_model.state_dict().items()}
    switch.load_state_dict(sd)
    x = torch.randint(0, 128, (2, 9))
    torch.testing.assert_close(switch(x).logits, gate_model(x).logits, atol=1e-6, rtol=1e-5)


def _rms(z, w, eps):
    return z / torch.sqrt(z.pow(2).mean(-1, keepdim=True) + eps) * w


def _check_branch_transforms(name, **kw):
    model = perturb(tiny_model(name, **kw))
    layer = model.model.layers[0]
    x, cos, sin = _layer_inputs(model)
    eps = model.config.rms_norm_eps
    a = layer.self_attn(_rms(x, layer.input_layernorm.weight, eps), (cos, sin), None)[0]
    if name == "sandwich_norm":
        post = lambda z, which: _rms(z, getattr(layer, f"{which}_output_transform").weight, eps)  # noqa: E731
    else:
        assert (a.abs() > 0.02).any(), "the clip must be active for this test to mean anything"
        post = lambda z, which: z.clamp(-0.02, 0.02)  # noqa: E731
    h = x + post(a, "attn")
    out = h + post(layer.mlp(_rms(h, layer.post_attention_layernorm.weight, eps)), "ffn")
    torch.testing.assert_close(layer(x, position_embeddings=(cos, sin)), out, atol=1e-5, rtol=1e-4)
    return model


@pytest.mark.parametrize("name", ["sandwich_norm", "output_clip_0.02"])
def test_branch_transforms_formula(name):
    _check_branch_transforms(name)


@pytest.mark.parametrize("name,gate,clip", [("sink_logits", "sdpa_elementwise", None),
                                            ("clipped_softmax", "sdpa_headwise", (1.0, -0.03))])
def test_mechanism_combined_with_a_gate_follows_both_formulas(name, gate, clip):
    """A mechanism and a G1 gate in one layer: the mechanism's softmax, then the gate sigma(X W) on the (B, T, H, D)
    output before o_proj (each dropped, or applied in the other's place, breaks it)."""
    def ref(a, x, c, s):
        H = a.num_heads
        score = torch.sigmoid(a.gate.proj(x)).view(1, x.shape[1], H, -1)  # (1, T, H, D) elementwise, (1, T, H, 1) headwise
        sink = a.mechanism.sinks if name == "sink_logits" else None
        return _plain_attention(a, x, c, s, sink=sink, clip=clip, out_gate=score)

    _check(name, ref, gate=gate)


def test_forget_decay_is_exact_when_queries_are_not_the_last_keys():
    """A static cache's prefill: 3 queries at key slots 2..4 of 8, slots 5..7 empty (masked)."""
    fox = tiny_model("forgetting").model.layers[0].self_attn.mechanism
    H, KV, D, S = 4, 2, 8, 8
    logf = -torch.rand(1, H, S)  # (1, H, S)
    k_ext = torch.cat([torch.randn(1, KV, S, D), logf.view(1, KV, 2, S).transpose(2, 3)], -1)  # (1, KV, S, D + 2)
    rows = torch.tensor([2, 3, 4])
    mask = torch.where(torch.arange(S)[None] <= rows[:, None], 0.0, torch.finfo(torch.float32).min)[None, None]
    bias = fox.decay_bias(k_ext, mask)  # (1, H, 3, S)
    for r, i in enumerate(rows.tolist()):
        for j in range(i + 1):
            torch.testing.assert_close(bias[0, :, r, j], logf[0, :, j + 1: i + 1].sum(-1))


@pytest.mark.parametrize("name", ["forgetting", "sink_logits", "clipped_softmax", "switch_v_8top2"])
def test_static_cache_generation_equals_uncached(name):
    model = perturb(tiny_model(name, "sdpa"))
    prompt = torch.randint(0, 128, (1, 5))
    out = model.generate(prompt, max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True,
                         pad_token_id=0, cache_implementation="static")
    full = model(out.sequences).logits
    for i, step_logits in enumerate(out.logits):
        torch.testing.assert_close(step_logits[0], full[0, 4 + i], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["sandwich_norm", "switch_kv_4top4", "forgetting"])
def test_mechanisms_on_the_tiny_moe_follow_their_formulas(name):
    """On the MoE model (every layer a SparseMoeBlock) each mechanism still computes its formula (the branch transforms
    around the MoE FFN, the attention mechanisms inside the layer) and trains: its parameters get a gradient through
    the LM loss, and the router's load-balancing loss is there."""
    if name == "sandwich_norm":
        model = _check_branch_transforms(name, preset="tiny-moe")
    else:
        _check(name, _switch_reference(name) if name.startswith("switch") else _forgetting_reference(True),
               preset="tiny-moe")
        model = perturb(tiny_model(name, preset="tiny-moe"))
    assert model.config.is_moe_layer(0)
    model.train()
    x = torch.randint(0, 128, (2, 9))
    out = model(x, labels=x)
    assert out.aux_loss > 0
    out.loss.backward()
    extra = {n: p.grad for n, p in model.named_parameters() if ".mechanism." in n or "output_transform" in n}
    assert extra and all(g is not None and g.abs().sum() > 0 for g in extra.values()), name
