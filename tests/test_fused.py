"""Fast paths (gated_attention/fused.py) against their plain references: forward AND gradients, checkpoint names,
static KV cache generation and whole-model torch.compile without graph breaks. Tiny models only."""
import contextlib
import copy

import pytest
import torch

import gated_attention.modeling  # noqa: F401  (registers the Auto classes)
from gated_attention import GatedQwen3ForCausalLM
from gated_attention.fused import (LOSS_CHUNK_BYTES, FusedGatedAttention, chunked_lm_loss, fuse_qkv, fused_sigmoid_mul,
                                   loss_chunk_tokens, reference_lm_loss, unfuse_qkv)
from harness import tiny_lm

# G1 gates (folded into the GEMM; sigmoid ones take the fused multiply), a non-G1 gate (keeps its own projection),
# a parameter-free transform and the baseline.
GATES = ["baseline", "sdpa_elementwise", "sdpa_headwise", "sdpa_headshared", "sdpa_additive_silu", "value_elementwise",
         "sdpa_rmsnorm", "sdpa_input_independent"]


def tiny(gate, seed=0, **kw):
    # parameters off their init so the state-dict mapping of every tensor is exercised; train mode, as the original
    return tiny_lm(gate, backend=None, seed=seed, eval=False, perturbed=True, **kw)


def grads_by_plain_name(model):
    """Parameter gradients keyed by the plain model's names (fused q/k/v/gate gradient split back)."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = p.grad
    for mod_name, mod in model.named_modules():
        if isinstance(mod, FusedGatedAttention):
            for kind in ("weight", "bias"):
                key = f"{mod_name}.qkvg_proj.{kind}"
                if key in out:
                    g = out.pop(key)
                    for part, chunk in zip(mod._part_names, g.split(mod.splits, dim=0)):
                        out[f"{mod_name}.{part}.{kind}"] = chunk
    return out


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("separate", [False, True])  # True: the trainer's layout (plain Parameters, cat per forward)
def test_fuse_qkv_matches_plain_forward_and_grads(gate, bias, separate):
    ref = tiny(gate, attention_bias=bias).train()
    fast = fuse_qkv(copy.deepcopy(ref), separate_params=separate)
    assert any(isinstance(m, FusedGatedAttention) for m in fast.modules())
    if separate:  # same parameters under the same names, in the same order (optimizer state lines up)
        assert [n for n, _ in fast.named_parameters()] == [n for n, _ in ref.named_parameters()]
    x = torch.randint(0, 128, (2, 11))
    out_r, out_f = ref(x, labels=x), fast(x, labels=x)
    torch.testing.assert_close(out_f.logits, out_r.logits, rtol=1e-5, atol=1e-6)
    out_r.loss.backward()
    out_f.loss.backward()
    gr, gf = grads_by_plain_name(ref), grads_by_plain_name(fast)
    assert set(gr) == set(gf)
    for name in gr:
        torch.testing.assert_close(gf[name], gr[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("gate", ["sdpa_elementwise", "sdpa_headwise", "value_elementwise"])
def test_fused_state_dict_keeps_separate_names_and_round_trips(gate, tmp_path):
    ref = tiny(gate)
    fast = fuse_qkv(copy.deepcopy(ref))
    sd_r, sd_f = ref.state_dict(), fast.state_dict()
    assert set(sd_f) == set(sd_r), set(sd_f) ^ set(sd_r)
    for k in sd_r:
        torch.testing.assert_close(sd_f[k], sd_r[k], rtol=0, atol=0)
    other = fuse_qkv(tiny(gate, seed=1))  # different weights, fused: loading the plain names must fill qkvg_proj
    other.load_state_dict(sd_r)
    x = torch.randint(0, 128, (1, 7))
    torch.testing.assert_close(other.eval()(x).logits, ref.eval()(x).logits)
    fast.save_pretrained(tmp_path)  # the HF checkpoint path too
    loaded = GatedQwen3ForCausalLM.from_pretrained(tmp_path).eval()
    assert not any(isinstance(m, FusedGatedAttention) for m in loaded.modules())
    torch.testing.assert_close(loaded(x).logits, ref(x).logits)
    back = unfuse_qkv(fast).eval()
    assert not any(isinstance(m, FusedGatedAttention) for m in back.modules())
    torch.testing.assert_close(back(x).logits, ref(x).logits)


def test_fuse_qkv_fails_loudly_when_nothing_to_fuse():
    model = fuse_qkv(tiny("sdpa_elementwise"))
    with pytest.raises(ValueError, match="no plain GatedAttention"):
        fuse_qkv(model)


@pytest.mark.parametrize("headwise", [False, True])
@pytest.mark.parametrize("scale", [1.0, 2.0])
def test_fused_sigmoid_mul_matches_reference(headwise, scale, check_reference):
    torch.manual_seed(0)
    y = torch.randn(2, 5, 3, 4, dtype=torch.float64, requires_grad=True)
    logits = torch.randn(2, 5, 3, 1 if headwise else 4, dtype=torch.float64, requires_grad=True)
    g = torch.randn(2, 5, 3, 4, dtype=torch.float64)
    check_reference(lambda a, b: fused_sigmoid_mul(a, b, scale), lambda a, b: a * (torch.sigmoid(b) * scale),
                    (y, logits), upstream=g)
    assert torch.autograd.gradcheck(lambda a, b: fused_sigmoid_mul(a, b, scale), (y, logits))


def test_fused_sigmoid_mul_bf16_close_to_fp32():
    torch.manual_seed(0)
    y = torch.randn(4, 8, 2, 16)
    logits = torch.randn(4, 8, 2, 16)
    g = torch.randn_like(y)
    yb, lb = y.bfloat16().requires_grad_(), logits.bfloat16().requires_grad_()
    out = fused_sigmoid_mul(yb, lb)
    gy, gl = torch.autograd.grad(out, (yb, lb), g.bfloat16())
    yr, lr = y.clone().requires_grad_(), logits.clone().requires_grad_()
    ref = yr * torch.sigmoid(lr)
    gyr, glr = torch.autograd.grad(ref, (yr, lr), g)
    assert out.dtype == gy.dtype == gl.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(gy.float(), gyr, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(gl.float(), glr, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("gate", ["baseline", "sdpa_elementwise"])
@pytest.mark.parametrize("fused", [False, True])
def test_static_cache_generate_matches_uncached(gate, fused):
    model = tiny(gate).eval()
    if fused:
        fuse_qkv(model)
    x = torch.randint(0, 128, (2, 6))
    ref = model.generate(x, max_new_tokens=8, do_sample=False, use_cache=False)
    static = model.generate(x, max_new_tokens=8, do_sample=False, cache_implementation="static")
    dynamic = model.generate(x, max_new_tokens=8, do_sample=False)
    assert static.tolist() == ref.tolist()
    assert dynamic.tolist() == ref.tolist()


@pytest.mark.parametrize("fused", [False, True])
def test_whole_model_compiles_without_graph_breaks(fused):
    model = tiny("sdpa_elementwise").train()
    if fused:
        fuse_qkv(model)
    x = torch.randint(0, 128, (2, 9))
    explanation = torch._dynamo.explain(model)(x, labels=x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    torch._dynamo.reset()
    # fullgraph + aot_eager traces forward AND backward (incl. the custom autograd node) without inductor's cost
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    out_c = compiled(x, labels=x)
    grads_c = torch.autograd.grad(out_c.loss, list(model.parameters()))
    out_e = model(x, labels=x)
    grads_e = torch.autograd.grad(out_e.loss, list(model.parameters()))
    torch.testing.assert_close(out_c.loss, out_e.loss)
    for a, b in zip(grads_c, grads_e):
        torch.testing.assert_close(a, b)
    torch._dynamo.reset()


# ---- chunked / fused lm_head + cross-entropy (fast.chunked_lm_loss) vs the plain full-logits loss ----

@pytest.mark.parametrize("chunk", [7, 1000])  # a chunk that does not divide N, and one chunk for everything
@pytest.mark.parametrize("num_items", [None, 50])
def test_chunked_lm_loss_matches_reference_loss_and_grads(chunk, num_items, check_reference):
    torch.manual_seed(0)
    h = torch.randn(3, 13, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(40, 16, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 40, (3, 13))
    t[0, :4] = -100  # ignored positions contribute neither loss nor gradient
    _, ga = check_reference(lambda h_, w_: chunked_lm_loss(h_, w_, t, num_items_in_batch=num_items, chunk_tokens=chunk),
                            lambda h_, w_: reference_lm_loss(h_, w_, t, num_items_in_batch=num_items),
                            (h, w), upstream=3.0)  # a non-unit upstream gradient
    assert ga[0][0, :4].abs().max() == 0


def test_chunked_lm_loss_bf16_autocast_close_to_reference():
    torch.manual_seed(0)
    h = torch.randn(64, 32, requires_grad=True)
    w = (0.2 * torch.randn(300, 32)).requires_grad_()
    t = torch.randint(0, 300, (64,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a = chunked_lm_loss(h, w, t, chunk_tokens=16)
        b = reference_lm_loss(h, w, t)  # lm_head in bf16, fp32 cross-entropy: what the plain model does
    ga, gb = torch.autograd.grad(a, [h, w]), torch.autograd.grad(b, [h, w])
    assert a.dtype == torch.float32 and ga[1].dtype == torch.float32
    torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y, rtol=2e-2, atol=2e-3)


class _Allocations(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the shape and dtype of every tensor an op allocates (returns in memory none of its inputs hold: an
    in-place op or a view is not an allocation)."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[tuple[int, ...], torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        held = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
                if isinstance(a, torch.Tensor)}
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in held:
                self.shapes.append((tuple(t.shape), t.dtype))
        return out


def test_loss_chunk_is_chosen_by_bytes():
    """The default chunk fills a byte budget of (c, V) temporaries: at Qwen3's 151,936-token vocabulary 294 tokens in
    bf16 (14 chunks per 4,096 tokens) and 441 in fp32, never more than the budget, never 0 tokens."""
    V = 151_936
    assert loss_chunk_tokens(V, torch.bfloat16) == LOSS_CHUNK_BYTES // (V * 6) == 294
    assert loss_chunk_tokens(V, torch.float32) == LOSS_CHUNK_BYTES // (V * 4) == 441
    assert loss_chunk_tokens(V, torch.bfloat16, chunk_bytes=1) == 1


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_chunked_loss_never_allocates_the_logits_and_matches_the_plain_loss(autocast):
    """Watching every tensor the loss's forward and backward allocate: none is a (B, T, V) / (N, V) logits tensor or
    larger than the chunk the byte budget gives, and in fp32 the weight gradient is accumulated in place (the one
    (V, d) tensor is the gradient itself; it was one (V, d) temporary per chunk). Loss and gradients equal the plain
    full-logits loss."""
    torch.manual_seed(0)
    B, T, d, V = 4, 24, 16, 500
    h = torch.randn(B, T, d, requires_grad=True)
    w = (0.3 * torch.randn(V, d)).requires_grad_()
    t = torch.randint(0, V, (B, T))
    dtype = torch.bfloat16 if autocast else torch.float32
    budget = 20 * V * 6  # 20 tokens per chunk in bf16, 30 in fp32: 5 or 4 chunks of the 96 tokens
    chunk = loss_chunk_tokens(V, dtype, budget)
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with _Allocations() as seen, ctx:
        loss = chunked_lm_loss(h, w, t, chunk_bytes=budget)
        gh, gw = torch.autograd.grad(loss, [h, w])
    rows = [shape[0] for shape, _ in seen.shapes if len(shape) == 2 and shape[-1] == V]  # (c, V) tensors
    assert rows and max(rows) == chunk and not any(len(s) == 3 and s[-1] == V for s, _ in seen.shapes)
    weight_sized = [s for s in seen.shapes if s[0] == (V, d)]
    if not autocast:
        assert len(weight_sized) == 2, weight_sized  # the fp32 accumulator and the gradient scaled in backward
    with ctx:
        ref = reference_lm_loss(h, w, t)
    rh, rw = torch.autograd.grad(ref, [h, w])
    tol = dict(rtol=2e-2, atol=2e-3) if autocast else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, ref, **tol)
    torch.testing.assert_close(gh, rh, **tol)
    torch.testing.assert_close(gw, rw, **tol)


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])  # C++ builds
def test_compiled_loss_math_matches_the_eager_chunked_loss(backend):
    """The trainer's compiled step runs each chunk's math after its GEMM through torch.compile of
    fused._ce_and_grad (use_compiled_math): loss and gradients equal the eager in-place passes, in fp32 (to float
    rounding) and under bf16 autocast (to bf16's), with a last chunk of another size, and the compiled function is
    what ran (counted)."""
    from gated_attention.fused import _ce_and_grad, use_compiled_math

    torch._dynamo.reset()
    calls = []
    compiled = torch.compile(_ce_and_grad, backend=backend, dynamic=False)

    def counted(*a):
        calls.append(a[0].shape)
        return compiled(*a)

    torch.manual_seed(0)
    h = torch.randn(2, 21, 16, requires_grad=True)
    w = (0.3 * torch.randn(300, 16)).requires_grad_()
    t = torch.randint(0, 300, (2, 21))
    t[1, :5] = -100
    for autocast in (False, True):
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
        with ctx:
            eager = chunked_lm_loss(h, w, t, chunk_tokens=16)
            ge = torch.autograd.grad(eager, [h, w])
            with use_compiled_math(counted):
                comp = chunked_lm_loss(h, w, t, chunk_tokens=16)
                gc = torch.autograd.grad(comp, [h, w])
        tol = dict(rtol=1e-2, atol=1e-3) if autocast else dict(rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(comp, eager, **tol)
        for a, b in zip(gc, ge):
            torch.testing.assert_close(a, b, **tol)
    assert calls == [(16, 300), (16, 300), (10, 300)] * 2  # 42 tokens: chunks of 16, 16 and 10, per dtype
    torch._dynamo.reset()


def test_chunked_lm_loss_errors_and_no_grad():
    h, w = torch.randn(2, 5, 8), torch.randn(20, 8, requires_grad=True)
    with pytest.raises(ValueError, match="targets"):
        chunked_lm_loss(h, w, torch.zeros(2, 4, dtype=torch.long))
    with torch.no_grad():
        loss = chunked_lm_loss(h, w, torch.zeros(2, 5, dtype=torch.long))
    assert not loss.requires_grad


@pytest.mark.parametrize("gate,fused", [("baseline", False), ("sdpa_elementwise", True), ("sdpa_headwise", False)])
def test_model_fused_loss_matches_plain_loss_and_grads(gate, fused):
    model = tiny(gate).double()
    if fused:
        fuse_qkv(model)
    x = torch.randint(0, 128, (2, 11))
    labels = x.clone()
    labels[1, :3] = -100
    plain = model(x, labels=labels)
    g_plain = torch.autograd.grad(plain.loss, list(model.parameters()))
    out = model(x, labels=labels, fused_loss=True)
    assert out.logits is None
    g_fused = torch.autograd.grad(out.loss, list(model.parameters()))
    torch.testing.assert_close(out.loss, plain.loss)
    for a, b in zip(g_fused, g_plain):
        torch.testing.assert_close(a, b)
    # shift_labels (already aligned, T targets for T positions: the trainer's layout) == HF-shifted labels
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    torch.testing.assert_close(model(x, shift_labels=shifted, fused_loss=True).loss, plain.loss)
    with pytest.raises(ValueError, match="logits_to_keep"):
        model(x, labels=labels, fused_loss=True, logits_to_keep=1)


def test_moe_model_fused_loss_keeps_aux_loss():
    # fp32, not float64: the grouped expert GEMM has no float64 kernel
    model = tiny_lm("sdpa_elementwise", backend=None, preset="tiny-moe", eval=False)
    x = torch.randint(0, 128, (2, 9))
    plain = model(x, labels=x)
    fused = model(x, labels=x, fused_loss=True)
    assert plain.aux_loss is not None and float(plain.aux_loss) > 0
    torch.testing.assert_close(fused.loss, plain.loss)


@pytest.mark.parametrize("fused", [False, True])
def test_training_step_compiles_without_graph_breaks_under_autocast(fused):
    """The bench's train step: train mode, bf16 autocast, fused loss; forward and backward traced as one graph."""
    model = tiny("sdpa_elementwise").train()
    if fused:
        fuse_qkv(model)
    x = torch.randint(0, 128, (2, 9))

    def loss_fn(ids):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(ids, labels=ids, fused_loss=True).loss

    explanation = torch._dynamo.explain(loss_fn)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")
    grads_c = torch.autograd.grad(compiled(x), list(model.parameters()))
    grads_e = torch.autograd.grad(loss_fn(x), list(model.parameters()))
    # compiled, the fused gate is plain ops (its backward rounds differently in bf16 than the eager custom node):
    # within a few bf16 ulps of each gradient's own scale (measured worst: 0.6 % of the tensor's largest entry)
    for a, b in zip(grads_c, grads_e):
        tol = dict(rtol=2e-2, atol=1e-2 * float(b.abs().max())) if fused else {}
        torch.testing.assert_close(a, b, **tol)
    torch._dynamo.reset()


@pytest.mark.parametrize("headwise", [False, True])
def test_gate_is_plain_ops_under_compile(headwise, monkeypatch):
    """Inductor can fuse the G1 gate only if it sees plain ops: under torch.compile fused_sigmoid_mul must not trace
    as a custom autograd.Function (the graph-capturing backend would show an autograd_function_apply node)."""
    import gated_attention.fused as fused_mod

    def fn(y, logits):
        return fused_sigmoid_mul(y, logits, 2.0).sum()

    def opaque_nodes():
        seen = []

        def backend(gm, example_inputs):
            seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
            return gm.forward

        torch._dynamo.reset()
        y = torch.randn(2, 3, 4, 8, requires_grad=True)
        logits = torch.randn(2, 3, 4, 1 if headwise else 8, requires_grad=True)
        out = torch.compile(fn, backend=backend, fullgraph=True)(y, logits)
        g = torch.autograd.grad(out, (y, logits))
        ref = torch.autograd.grad(fn(y, logits), (y, logits))
        for a, b in zip(g, ref):
            torch.testing.assert_close(a, b)
        torch._dynamo.reset()
        return [t for t in seen if "autograd_function_apply" in t]

    assert opaque_nodes() == []
    monkeypatch.setattr(fused_mod, "OPAQUE_GATE_UNDER_COMPILE", True)  # the pre-fix path, so this test can fail
    assert opaque_nodes() != []


@pytest.mark.parametrize("mask", [None, "bool", "additive"])
def test_cpu_bf16_sdpa_computes_in_fp32(mask):
    """On a CPU, bf16 q/k/v (bf16 autocast) go through SDPA in fp32 (faster there, and an fp32 softmax): output and
    gradients are the fp32 kernel's on the same bf16 inputs, rounded to bf16; a float mask is upcast with them."""
    from gated_attention.attention import sdpa_attention

    class _M:
        training = False

    torch.manual_seed(0)
    leaves = [torch.randn(2, h, 19, 16).bfloat16().requires_grad_() for h in (4, 2, 2)]  # q (B, H, T, D), k, v
    m = None
    if mask is not None:
        keep = torch.ones(2, 1, 19, 19, dtype=torch.bool).tril()
        keep[1, ..., :3] = False  # left padding of row 1
        keep[1, :, :3, 0] = True  # (every query sees a key)
        m = keep if mask == "bool" else torch.zeros(keep.shape, dtype=torch.bfloat16).masked_fill(~keep, -1e4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = sdpa_attention(_M(), *leaves, m, 0.25)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 19, 4, 16) and out.is_contiguous()
    ref_in = [x.detach().float().requires_grad_() for x in leaves]
    ref = torch.nn.functional.scaled_dot_product_attention(
        *ref_in, attn_mask=None if m is None else (m if m.dtype == torch.bool else m.float()), is_causal=m is None,
        scale=0.25, enable_gqa=True).transpose(1, 2)  # (B, T, H, D) fp32
    torch.testing.assert_close(out, ref.bfloat16(), rtol=0, atol=0)
    go = torch.randn_like(out)
    got = torch.autograd.grad(out, leaves, go)
    want = torch.autograd.grad(ref, ref_in, go.float())
    for g, w in zip(got, want):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g, w.bfloat16(), rtol=1e-2, atol=1e-3)
