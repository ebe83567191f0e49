"""bf16 GEMM emulation (util/bf16_emulation.py) against its reference, PyTorch's native bf16 kernels: forward and
gradients of every intercepted call, under plain bf16 and under CPU autocast; fp32 untouched; a tiny model's
bf16-params training step the same either way."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import harness
from gated_attention.util.bf16_emulation import emulated_bf16

BF = torch.bfloat16


def _close(a: torch.Tensor, b: torch.Tensor, ulps: float = 2.0) -> None:
    """Equal up to a couple of bf16 roundings of the output (the two differ only in the fp32 summation order)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    scale = b.float().abs().amax().clamp_min(1e-30)
    err = float((a.float() - b.float()).abs().amax() / scale)
    assert err <= ulps * 2.0 ** -8, f"max error {err:.2e} of the output scale"


def _leaves(*shapes, dtype=BF, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g).to(dtype).requires_grad_() for s in shapes]


def _run(fn, leaves, emulate: bool, autocast: bool = False):
    """fn(*leaves) and the gradients of a fixed random projection of it, natively or emulated."""
    for t in leaves:
        t.grad = None
    ctx = emulated_bf16() if emulate else torch.autocast("cpu", enabled=False)
    with ctx, torch.autocast("cpu", dtype=BF, enabled=autocast):
        out = fn(*leaves)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    (out.float() * w).sum().backward()
    return out.detach(), [t.grad.clone() for t in leaves]


CALLS = {
    "linear": (lambda x, w, b: F.linear(x, w, b), [(3, 5, 24), (16, 24), (16,)]),
    "linear_nobias": (lambda x, w: F.linear(x, w), [(7, 24), (16, 24)]),
    "matmul_op": (lambda a, b: a @ b, [(2, 3, 8, 16), (2, 3, 16, 8)]),
    "matmul_broadcast": (lambda a, b: torch.matmul(a, b), [(4, 8, 16), (16, 12)]),
    "bmm": (lambda a, b: torch.bmm(a, b), [(3, 8, 16), (3, 16, 4)]),
    "mm_method": (lambda a, b: a.mm(b), [(8, 16), (16, 4)]),
    "einsum": (lambda a, b: torch.einsum("btd,bsd->bts", a, b), [(2, 5, 16), (2, 7, 16)]),
    "addmm": (lambda c, a, b: torch.addmm(c, a, b), [(4,), (8, 16), (16, 4)]),
}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_emulated_gemm_matches_native_bf16(name):
    fn, shapes = CALLS[name]
    leaves = _leaves(*shapes)
    out_n, grads_n = _run(fn, leaves, emulate=False)
    out_e, grads_e = _run(fn, leaves, emulate=True)
    assert out_e.dtype == BF
    _close(out_e, out_n)
    for ge, gn in zip(grads_e, grads_n):
        _close(ge, gn)


@pytest.mark.parametrize("name", ["linear", "matmul_op", "bmm"])
def test_emulated_gemm_matches_native_autocast(name):
    """fp32 leaves under CPU bf16 autocast: same bf16 output and same fp32 gradients as autocast's own kernels."""
    fn, shapes = CALLS[name]
    leaves = _leaves(*shapes, dtype=torch.float32)
    out_n, grads_n = _run(fn, leaves, emulate=False, autocast=True)
    out_e, grads_e = _run(fn, leaves, emulate=True, autocast=True)
    assert out_n.dtype == out_e.dtype == BF
    _close(out_e, out_n)
    for ge, gn in zip(grads_e, grads_n):
        assert ge.dtype == torch.float32
        _close(ge, gn)


def test_fp32_and_no_grad_paths():
    a, b = _leaves((8, 16), (16, 4), dtype=torch.float32)
    with emulated_bf16():
        out = a @ b
    assert out.dtype == torch.float32 and torch.equal(out, a @ b)  # fp32 passes through bit for bit
    ab, bb = a.detach().to(BF), b.detach().to(BF)
    with torch.no_grad(), emulated_bf16():
        e = ab @ bb
    assert e.dtype == BF and not e.requires_grad
    assert torch.equal(e, (ab.float() @ bb.float()).to(BF))  # the definition: fp32 GEMM of the values, rounded


def test_tiny_model_bf16_training_step_matches_native():
    """A whole forward + backward of a bf16 model: the loss and every parameter gradient as the native kernels."""
    model_n = harness.tiny_lm("sdpa_elementwise", eval=False, perturbed=True).to(BF)
    model_e = harness.tiny_lm("sdpa_elementwise", eval=False, perturbed=True).to(BF)
    x = torch.randint(0, model_n.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))

    def step(model, emulate):
        with emulated_bf16() if emulate else torch.autocast("cpu", enabled=False):
            logits = model(input_ids=x[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        return loss.detach()

    ln, le = step(model_n, False), step(model_e, True)
    assert abs(float(ln - le)) < 2e-2 * float(ln.abs())
    for (name, pn), (_, pe) in zip(model_n.named_parameters(), model_e.named_parameters()):
        gn, ge = pn.grad.float(), pe.grad.float()
        rel = float((gn - ge).norm() / gn.norm().clamp_min(1e-12))
        assert rel < 0.05, f"{name}: gradient differs by {rel:.3f} (relative norm)"
