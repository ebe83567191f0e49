"""The fused gated flash-attention kernel (triton_attention.py) against the eager reference: forward output and the
gradients of q, k, v and the gate logits on causal / GQA / padded / cached / packed shapes with sequence lengths that
are not multiples of the block size, plus the whole model with attn_implementation="triton_gated" against sdpa.

Two modes, chosen by TRITON_INTERPRET when the file is imported:
  TRITON_INTERPRET=1 (the default here and in conftest.py): Triton's CPU interpreter, CPU tensors; shapes are tiny,
      the interpreter costs ~0.1 s per program. bf16 cannot be checked (its tl.dot lacks bf16).
  TRITON_INTERPRET=0 on a machine with a CUDA GPU: the same tests on the GPU with the compiled kernels, plus the bf16
      checks (bench/gpu_check.sh runs this). Without a GPU the file is skipped in that mode."""
import os

# Triton reads TRITON_INTERPRET when a function is decorated: triton.language's own on its first import (which
# torch.compile may do during collection: hence tests/conftest.py sets it first), our kernels when
# gated_attention.kernels.triton_jit is first imported. This line covers running this file without the conftest.
os.environ.setdefault("TRITON_INTERPRET", "1")

import copy  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from _extras import need  # noqa: E402

need("triton", "pip install -e '.[dev]' (Triton's CPU interpreter runs these tests; Linux only)")

from gated_attention.attention import eager_attention  # noqa: E402
from gated_attention.fused import fuse_qkv  # noqa: E402
from gated_attention.kernels.triton_attention import gated_flash_attention, interpreted, plan_mask  # noqa: E402
from harness import assert_matches_reference, assert_modules_match  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = torch.device("cpu" if INTERPRET or not torch.cuda.is_available() else "cuda")  # where the kernel runs
pytestmark = pytest.mark.skipif(not INTERPRET and DEV.type != "cuda",
                                reason="TRITON_INTERPRET is not 1 and there is no CUDA GPU: the kernel cannot run")
gpu_only = pytest.mark.skipif(DEV.type != "cuda", reason="needs a CUDA GPU (TRITON_INTERPRET=0): bf16 tl.dot")


def leaf(*shape, dtype=torch.float32) -> torch.Tensor:
    """A random leaf tensor on the kernel's device (drawn on the CPU, so both modes see the same numbers)."""
    return torch.randn(*shape).to(DEV, dtype).requires_grad_()


class _Module:  # what eager_attention reads from the layer
    training = False
    is_causal = True


def reference(q, k, v, mask, scale, logits, gate_scale):
    """eager kernel + the registry's gate: Y * gate_scale * sigmoid(logits)."""
    y, _ = eager_attention(_Module(), q, k, v, mask, scale)  # (B, T, H, D)
    return y if logits is None else y * (torch.sigmoid(logits) * gate_scale)


def padding_mask(lens_pad, t, s, offset):
    """transformers-style 4-D bool mask: left padding of lens_pad[b] keys, causal with query i at key i + offset."""
    i = torch.arange(t)[:, None]
    j = torch.arange(s)[None, :]
    rows = [((j <= i + offset) & (j >= p)) for p in lens_pad]
    return torch.stack(rows)[:, None]  # (B, 1, T, S)


def packed_mask(t, starts):
    """Block-diagonal causal mask of sequences packed in one row (what position_ids resets produce)."""
    seg = torch.zeros(t, dtype=torch.long)
    for s0 in starts:
        seg[s0:] += 1
    i = torch.arange(t)
    m = (seg[:, None] == seg[None, :]) & (i[None, :] <= i[:, None])
    return m[None, None]  # (1, 1, T, T)


# (B, H, KV, T, S, D, gate, mask kind, blocks, gate_scale)
CASES = {
    "causal-mha-d16-elem": (1, 2, 2, 23, 23, 16, "elementwise", None, (16, 16), 1.0),
    "causal-gqa2-d32-head": (1, 4, 2, 37, 37, 32, "headwise", None, (16, 32), 1.0),
    "causal-gqa4-d64-elem-scale2": (1, 4, 1, 19, 19, 64, "elementwise", None, (32, 16), 2.0),
    "pad-gqa2-d32-elem": (2, 2, 1, 21, 21, 32, "elementwise", "pad", (16, 16), 1.0),
    "pad-mha-d16-head": (2, 2, 2, 18, 18, 16, "headwise", "pad", (16, 16), 1.0),
    "pad-gqa2-d64-ungated": (2, 2, 1, 20, 20, 64, None, "pad", (16, 16), 1.0),
    "cache-chunk-gqa2-d32-elem": (2, 4, 2, 7, 30, 32, "elementwise", "pad", (16, 16), 1.0),
    "decode-gqa2-d16-head": (2, 4, 2, 1, 25, 16, "headwise", "pad", (16, 16), 1.0),
    "packed-mha-d32-head": (1, 2, 2, 26, 26, 32, "headwise", "packed", (16, 16), 1.0),
    "causal-gqa2-d24-elem": (1, 2, 1, 17, 17, 24, "elementwise", None, (16, 16), 1.0),  # head_dim padded to 32
}


@pytest.mark.parametrize("case", list(CASES))
def test_forward_and_all_gradients_match_eager(case):
    b, h, kv, t, s, d, gate, mask_kind, blocks, gate_scale = CASES[case]
    torch.manual_seed(list(CASES).index(case))
    q = leaf(b, h, t, d)
    k = leaf(b, kv, s, d)
    v = leaf(b, kv, s, d)
    logits = None
    if gate is not None:
        logits = leaf(b, t, h, d if gate == "elementwise" else 1)
    mask = None
    if mask_kind == "pad":
        mask = padding_mask([0, 5][:b], t, s, offset=s - t).to(DEV)
    elif mask_kind == "packed":
        mask = packed_mask(t, [9, 17]).to(DEV)
    scale = d ** -0.5
    # rows that see no key (left-padding queries) output 0 in the kernel, noise in eager: the reference's are zeroed,
    # so they compare equal to the kernel's and get no upstream gradient in either
    seen = torch.ones(b, t, dtype=torch.bool, device=DEV) if mask is None else mask[:, 0].any(-1).expand(b, t)  # (B, T)
    if mask_kind == "pad" and s == t:
        assert not seen.all()  # the case does exercise empty rows
    keep = seen[:, :, None, None]  # (B, T, 1, 1)
    out, grads = assert_matches_reference(
        lambda q, k, v, g=None: gated_flash_attention(q, k, v, mask, scale, g, gate_scale, blocks=blocks),
        lambda q, k, v, g=None: reference(q, k, v, mask, scale, g, gate_scale) * keep,
        [q, k, v] + ([logits] if logits is not None else []), rtol=1e-5, atol=2e-6, grad_rtol=1e-4, grad_atol=1e-5)
    assert out.shape == (b, t, h, d)
    assert all(torch.isfinite(g).all() for g in grads)


def test_noncontiguous_layouts():
    """The model's layouts: q/k/v as transposed views of (B, T, heads, D) slices of one fused projection, the gate
    logits a strided view of the same GEMM output; gradients land in the right places."""
    torch.manual_seed(1)
    b, h, kv, t, d = 1, 4, 2, 20, 16

    def views(qkvg):  # (B, T, width) -> q (B, H, T, D), k/v (B, KV, T, D) transposed views, logits (B, T, H, D) strided
        qf, kf, vf, gf = qkvg.split([h * d, kv * d, kv * d, h * d], dim=-1)
        q = qf.view(b, t, h, d).transpose(1, 2)
        k, v = (z.view(b, t, kv, d).transpose(1, 2) for z in (kf, vf))
        return q, k, v, gf.view(b, t, h, d)

    def fast(qkvg):
        q, k, v, g = views(qkvg)
        return gated_flash_attention(q, k, v, None, d ** -0.5, g, 1.0, blocks=(16, 16))

    def ref(qkvg):
        q, k, v, g = views(qkvg)
        return reference(q, k, v, None, d ** -0.5, g, 1.0)

    qkvg = leaf(b, t, h * d + 2 * kv * d + h * d)  # one fused projection's output
    assert_matches_reference(fast, ref, [qkvg], rtol=1e-5, atol=2e-6, grad_rtol=1e-4, grad_atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs(dtype):
    """fp16 / bf16 storage (fp32 softmax and accumulators inside) against the fp32 reference. bf16 -- what GPU
    training uses -- runs the bf16 kernel only on a GPU: Triton's interpreter computes bf16 tl.dot wrongly
    (triton-lang/triton#11584), so there the kernel runs in fp32 on the bf16 values (the dtypes at the boundary are
    what this checks on a CPU)."""
    torch.manual_seed(2)
    b, h, kv, t, d = 1, 2, 1, 20, 32
    tol = {torch.float16: (1e-2, 5e-3, 2e-2, 1e-2), torch.bfloat16: (5e-2, 4e-2, 1e-1, 8e-2)}[dtype]
    leaves = [leaf(*shape, dtype=dtype) for shape in
              ((b, h, t, d), (b, kv, t, d), (b, kv, t, d), (b, t, h, 1))]
    out, grads = assert_matches_reference(  # the reference computes in fp32 from the same half-precision leaves
        lambda q, k, v, g: gated_flash_attention(q, k, v, None, d ** -0.5, g, 1.0, blocks=(16, 16)),
        lambda q, k, v, g: reference(q.float(), k.float(), v.float(), None, d ** -0.5, g.float(), 1.0),
        leaves, rtol=tol[0], atol=tol[1], grad_rtol=tol[2], grad_atol=tol[3])
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads)


@gpu_only
@pytest.mark.parametrize("gate", ["elementwise", "headwise", None])
def test_gpu_launch_config_bf16_long(gate):
    """The GPU's own tiles (no `blocks` override: 128x64 forward tiles, 8 warps at head_dim 128), bf16, GQA, 1000
    tokens (not a multiple of any tile): the kernel's error against the fp32 reference is no worse than twice that of
    PyTorch's bf16 SDPA + gate (the flash-attention test convention: bf16 rounding is the yardstick)."""
    torch.manual_seed(3)
    b, h, kv, t, d = 2, 8, 2, 1000, 128
    x = [leaf(b, h, t, d, dtype=torch.bfloat16), leaf(b, kv, t, d, dtype=torch.bfloat16),
         leaf(b, kv, t, d, dtype=torch.bfloat16)]
    logits = None if gate is None else leaf(b, t, h, d if gate == "elementwise" else 1, dtype=torch.bfloat16)
    leaves = x + ([logits] if logits is not None else [])
    scale = d ** -0.5

    def sdpa_gate(q, k, v, g):
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                             enable_gqa=True).transpose(1, 2)  # (B, T, H, D)
        return y if g is None else y * torch.sigmoid(g)

    out = gated_flash_attention(*x, None, scale, logits)
    ref_in = [t_.detach().float().requires_grad_() for t_ in leaves]
    ref = sdpa_gate(*ref_in[:3], ref_in[3] if logits is not None else None)
    low = sdpa_gate(*leaves[:3], logits)  # PyTorch's bf16 result: the rounding yardstick
    go = torch.randn_like(ref)
    assert (out.float() - ref).abs().max() <= 2 * (low.float() - ref).abs().max() + 1e-3
    got = torch.autograd.grad(out, leaves, go.bfloat16())
    yard = torch.autograd.grad(low, leaves, go.bfloat16())
    want = torch.autograd.grad(ref, ref_in, go)
    for name, g, y, w in zip(["dq", "dk", "dv", "dgate"], got, yard, want):
        err, base = (g.float() - w).abs().max(), (y.float() - w).abs().max()
        assert err <= 2 * base + 1e-3, f"{gate} {name}: kernel error {err:.3g} vs bf16 SDPA's {base:.3g}"


def test_mask_plans():
    """Padding / cache masks become a per-key vector with causal skipping; anything else is read as a dense mask."""
    assert interpreted() == INTERPRET
    p = plan_mask(None, 2, 4, 9, 9)
    assert p.causal and p.offset == 0 and p.key_valid is None and p.dense is None
    p = plan_mask(padding_mask([0, 3], 9, 9, 0), 2, 4, 9, 9)
    assert p.causal and p.offset == 0 and p.key_valid.tolist()[1] == [0, 0, 0] + [1] * 6 and p.dense is None
    p = plan_mask(padding_mask([0, 3], 4, 12, 8), 2, 4, 4, 12)  # chunk of 4 after 8 cached tokens: bottom-right
    assert p.causal and p.offset == 8 and p.dense is None
    p = plan_mask(padding_mask([0, 0], 9, 9, 0), 2, 4, 9, 9)  # no padding at all: no vector to read
    assert p.causal and p.key_valid is None and p.dense is None
    p = plan_mask(packed_mask(12, [5]), 1, 4, 12, 12)
    assert not p.causal and p.dense is not None and p.key_valid is None
    additive = torch.zeros(1, 1, 3, 3).masked_fill(~torch.ones(3, 3, dtype=torch.bool).tril(), float("-inf"))
    p = plan_mask(additive, 1, 4, 3, 3)
    assert p.causal and p.dense is None
    with pytest.raises(ValueError, match="ALiBi"):
        plan_mask(torch.randn(1, 1, 3, 3), 1, 4, 3, 3)
    with pytest.raises(ValueError, match="does not broadcast"):
        plan_mask(torch.ones(2, 1, 3, 4, dtype=torch.bool), 2, 4, 3, 3)


@pytest.mark.parametrize("gate,fused_qkv", [("sdpa_elementwise", False), ("sdpa_headwise", True),
                                            ("none", False), ("value_elementwise", False)])
def test_model_with_triton_gated_matches_sdpa(gate, fused_qkv, monkeypatch, tiny_model):
    """Whole model, left-padded batch: logits on real tokens and every parameter gradient. G1 sigmoid gates run in the
    kernel's epilogue; the ungated model and other gates run the ungated kernel with the gate outside."""
    ref = tiny_model(gate, backend="sdpa", eval=False, perturbed=True).to(DEV)
    fast = copy.deepcopy(ref)
    fast.set_attn_implementation("triton_gated")
    assert fast.config._attn_implementation == "triton_gated"
    if fused_qkv:
        ref, fast = fuse_qkv(ref), fuse_qkv(fast)
    ids = torch.randint(0, 128, (2, 13)).to(DEV)
    attn = torch.ones(2, 13, dtype=torch.long, device=DEV)
    attn[1, :4] = 0  # left padding
    labels = ids.masked_fill(attn == 0, -100)
    calls = []
    layer = fast.model.layers[0].self_attn
    import gated_attention.kernels.triton_attention as ta

    real = ta.gated_flash_attention

    def spy(*a, **kw):
        calls.append(a[5] if len(a) > 5 else kw.get("gate_logits"))
        return real(*a, **kw)

    monkeypatch.setattr(ta, "gated_flash_attention", spy)

    def run(model):  # logits on real tokens (padding rows differ: 0 in the kernel) and the loss
        out = model(ids, attention_mask=attn, labels=labels)
        return (out.logits[attn.bool()], out.loss), out.loss

    assert_modules_match(fast, ref, run, rtol=1e-4, atol=1e-5, grad_rtol=1e-4, grad_atol=1e-6)
    assert len(calls) == 2  # both layers ran the kernel...
    fused_gate = layer.gate is not None and layer.gate.spec.fusable_in_kernel
    assert all((c is not None) == fused_gate for c in calls)  # ...with the gate in it exactly for G1 sigmoid gates


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


@pytest.mark.skipif(DEV.type != "cpu", reason="CPU autocast with the interpreter (the GPU runs it in gpu_check.sh)")
def test_mixed_dtypes_under_bf16_autocast_match_the_reference():
    """Under bf16 autocast q and k arrive in fp32 (QK-norm's weight is fp32) and v in bf16: the kernel casts them to
    the autocast dtype (it raised 'q, k, v dtypes differ' before); output and the gradient of each input, in its own
    dtype, against the fp32 reference on the same bf16-rounded values."""
    torch.manual_seed(4)
    b, h, kv, t, d = 1, 2, 1, 20, 32
    q, k = leaf(b, h, t, d), leaf(b, kv, t, d)  # fp32
    v, g = leaf(b, kv, t, d, dtype=torch.bfloat16), leaf(b, t, h, d, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = gated_flash_attention(q, k, v, None, d ** -0.5, g, 1.0, blocks=(16, 16))
    assert out.dtype == torch.bfloat16
    w = torch.randn(out.shape)
    (out.float() * w).sum().backward()
    fast = [x.grad for x in (q, k, v, g)]
    assert [x.dtype for x in fast] == [torch.float32, torch.float32, torch.bfloat16, torch.bfloat16]
    leaves = [x.detach().to(torch.bfloat16).float().requires_grad_() for x in (q, k, v, g)]
    ref = reference(*leaves[:3], None, d ** -0.5, leaves[3], 1.0)
    (ref * w).sum().backward()
    assert _rel_err(out, ref) < 1e-2
    for name, a, r in zip("qkvg", fast, leaves):
        assert _rel_err(a, r.grad) < 3e-2, name


@pytest.mark.skipif(DEV.type != "cpu", reason="CPU autocast with the interpreter (the GPU runs it in gpu_check.sh)")
@pytest.mark.parametrize("gate", ["sdpa_elementwise", "sdpa_headwise"])
def test_model_with_triton_gated_under_bf16_autocast_matches_sdpa(gate, tiny_model):
    """The whole model under bf16 autocast (what precision=auto picks on a GPU; QK-norm makes q, k fp32): the loss and
    every parameter's gradient against the sdpa model, the plain path, under the same autocast."""
    ref = tiny_model(gate, backend="sdpa", eval=False, perturbed=True).to(DEV)
    fast = copy.deepcopy(ref)
    fast.set_attn_implementation("triton_gated")
    ids = torch.randint(0, 128, (2, 13)).to(DEV)
    results = []
    for model in (fast, ref):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(ids, labels=ids)
        out.loss.backward()
        results.append((out.logits.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (logits_f, grads_f), (logits_r, grads_r) = results
    assert _rel_err(logits_f, logits_r) < 2e-2
    assert grads_f.keys() == grads_r.keys() and all(grads_f[n] is not None for n in grads_r)
    for name, g in grads_r.items():
        assert _rel_err(grads_f[name], g) < 5e-2, name


def test_generate_with_kv_cache_matches_sdpa(tiny_model):
    """Left-padded batch generation: prefill (causal + padding) then single-token decode steps against the cache
    (bottom-right masks), greedy tokens identical to sdpa's."""
    model = tiny_model("sdpa_headwise").to(DEV)
    ids = torch.randint(0, 128, (2, 6)).to(DEV)
    attn = torch.ones(2, 6, dtype=torch.long, device=DEV)
    attn[0, :2] = 0
    kw = dict(attention_mask=attn, max_new_tokens=3, do_sample=False, pad_token_id=0)
    model.set_attn_implementation("sdpa")
    want = model.generate(ids, **kw)
    model.set_attn_implementation("triton_gated")
    got = model.generate(ids, **kw)
    assert got.tolist() == want.tolist()


def test_refuses_dropout_clearly():
    q = torch.randn(1, 2, 4, 16)
    from gated_attention.kernels.triton_attention import triton_gated_kernel

    with pytest.raises(ValueError, match="dropout"):
        triton_gated_kernel(_Module(), q, q, q, None, 0.25, dropout=0.1)


def test_clear_error_without_gpu(monkeypatch):
    """Outside the interpreter the kernel refuses CPU tensors, naming the alternatives."""
    import gated_attention.kernels.triton_attention as ta

    monkeypatch.setattr(ta, "interpreted", lambda: False)  # as if Triton had compiled the kernels for a GPU
    q = torch.randn(1, 2, 4, 16)
    with pytest.raises(RuntimeError, match="needs a CUDA GPU.*sdpa.*TRITON_INTERPRET=1"):
        gated_flash_attention(q, q, q)


def test_clear_error_without_triton(monkeypatch):
    import gated_attention.kernels
    import gated_attention.kernels.triton_jit  # noqa: F401  (so that monkeypatch can restore it)

    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` now raises ImportError
    monkeypatch.delitem(sys.modules, "gated_attention.kernels.triton_jit")
    monkeypatch.delattr(gated_attention.kernels, "triton_jit")
    q = torch.randn(1, 2, 4, 16)
    with pytest.raises(RuntimeError, match=r"needs Triton.*pip install 'triton==3\.7\.1'"):
        gated_flash_attention(q, q, q)


HOPPER_SMEM = 232448  # bytes of shared memory one block may use on H100/H200 (227 KiB)


@pytest.mark.slow
@pytest.mark.parametrize("head_dim,dtype", [(128, "bfloat16"), (128, "float32")])
def test_kernels_compile_for_hopper(head_dim, dtype):
    """Without a GPU: every kernel variant, with the GPU launch config, compiles to an sm_90 cubin (Triton ships
    ptxas) and fits Hopper's shared memory -- the GPU code path, which the interpreter never builds. Minutes."""
    script = ("import torch; from gated_attention.kernels.triton_attention import compile_for_gpu; "
              f"r = compile_for_gpu(90, {head_dim}, torch.{dtype}); "
              "[print(v, k) for k, v in r.items()]")
    env = {k: val for k, val in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=3600)
    assert res.returncode == 0, res.stderr[-3000:]
    shared = {ln.split(" ", 1)[1]: int(ln.split(" ", 1)[0]) for ln in res.stdout.splitlines() if ln.strip()}
    assert len(shared) == 24  # 3 gate modes x 3 mask kinds x (fwd, pre) + 3 mask kinds x (dkdv, dq)
    too_big = {k: v for k, v in shared.items() if v > HOPPER_SMEM}
    assert not too_big, too_big
