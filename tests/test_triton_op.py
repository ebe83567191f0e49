"""The fused gated attention kernel as a registered torch op (`gated_attention::flash_attention` and its backward,
kernels/triton_attention.py) in the torch subsystems that see ops: torch.library.opcheck, torch.compile (the attention
layer traced without a graph break, compiled forward and gradients against the plain sdpa layer) and selective
activation checkpointing (the kernel's output kept, so the recompute does not run the kernel again).

Run as tests/test_triton_attention.py is: under Triton's CPU interpreter (TRITON_INTERPRET=1, CPU tensors, tiny
shapes), or on a CUDA GPU with TRITON_INTERPRET=0. Under the interpreter the compiled graph holds the op as one node
(its kernels are plain Python, which AOT autograd cannot trace into); on a GPU it holds the kernel launches."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is first imported (see test_triton_attention.py)

import copy  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from _extras import need  # noqa: E402

need("triton", "pip install -e '.[dev]' (Triton's CPU interpreter runs these tests; Linux only)")

import gated_attention.kernels.triton_attention as ta  # noqa: E402
from gated_attention.kernels import FLASH_ATTENTION_OP  # noqa: E402
from gated_attention.train import fastpath  # noqa: E402
from gated_attention.train.activation_checkpoint import apply_activation_checkpointing  # noqa: E402
from gated_attention.train.monitors import decoder_layers  # noqa: E402
from harness import assert_modules_match, tiny_lm  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = torch.device("cpu" if INTERPRET or not torch.cuda.is_available() else "cuda")
pytestmark = pytest.mark.skipif(not INTERPRET and DEV.type != "cuda",
                                reason="TRITON_INTERPRET is not 1 and there is no CUDA GPU: the kernel cannot run")


def _op_samples():
    """(args, kwargs) of flash_attention: ungated causal GQA, elementwise gate + key/left padding, headwise gate +
    dense (packed) mask, each with every floating input requiring grad."""
    torch.manual_seed(0)
    b, h, kv, t, d = 2, 2, 1, 9, 16

    def leaf(*shape):
        return torch.randn(*shape).to(DEV).requires_grad_()

    key_valid = torch.ones(b, t, dtype=torch.uint8, device=DEV)
    key_valid[1, :3] = 0
    dense = torch.ones(t, t, dtype=torch.bool).tril()
    dense[5:, :5] = False  # two sequences packed in one row
    dense = dense[None, None].to(DEV, torch.uint8)  # (1, 1, T, T)
    samples = []
    for gate, kvalid, dmask, causal in ((None, None, None, True), (d, key_valid, None, True), (1, None, dense, False)):
        q, k, v = leaf(b, h, t, d), leaf(b, kv, t, d), leaf(b, kv, t, d)
        g = None if gate is None else leaf(b, t, h, gate)
        samples.append(((q, k, v, g, kvalid, dmask, causal, 0, d ** -0.5, 1.0, [16, 16]), {}))
    return samples


def test_the_kernel_is_a_registered_op_that_passes_opcheck():
    """torch.ops.gated_attention.flash_attention exists, and opcheck passes on it (schema, autograd registration,
    fake tensors against the real kernel's shapes, dtypes and strides, AOT dispatch with static and dynamic shapes,
    whose forward and gradients it compares with eager) and on its backward op (fed the forward's own outputs)."""
    namespace, name = FLASH_ATTENTION_OP.split("::")
    fwd = getattr(getattr(torch.ops, namespace), name)
    bwd = getattr(getattr(torch.ops, namespace), f"{name}_backward")
    assert fwd.default.name() == FLASH_ATTENTION_OP
    for args, kwargs in _op_samples():
        torch.library.opcheck(fwd.default, args, kwargs)
        out, lse = fwd(*args)
        dout = torch.randn_like(out)
        q, k, v, g, kvalid, dmask, *rest = (a.detach() if isinstance(a, torch.Tensor) else a for a in args)
        torch.library.opcheck(bwd.default, (dout, q, k, v, g, out.detach(), lse, kvalid, dmask, *rest))


def _layer_inputs(model, b=2, t=13):
    x = torch.randn(b, t, model.config.hidden_size, device=DEV)
    pos = torch.arange(t, device=DEV)[None].expand(b, t)
    mask = torch.ones(b, 1, t, t, dtype=torch.bool).tril()
    mask[1, :, :, :4] = False  # left padding of the second row
    return x, model.model.rotary_emb(x, pos), mask.to(DEV)


@pytest.mark.parametrize("masked", [False, True])
def test_attention_layer_traces_without_a_graph_break(masked, monkeypatch):
    """torch._dynamo.explain over the G1-gated attention layer with the triton_gated backend, without a mask (what
    training passes) and with a left-padding mask: one graph, no break, the op in it. Control: the same layer with the
    kernel call behind torch.compiler.disable (how the backend ran before it was an op) reports a break."""
    model = tiny_lm("sdpa_elementwise", backend="triton_gated", eval=False, perturbed=True).to(DEV)
    attn = model.model.layers[0].self_attn
    x, pe, mask = _layer_inputs(model)

    def layer(x):
        return attn(x, pe, attention_mask=mask if masked else None)[0]

    torch._dynamo.reset()
    explained = torch._dynamo.explain(layer)(x)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
    targets = [n.target for n in explained.graphs[0].graph.nodes if n.op == "call_function"]
    assert torch.ops.gated_attention.flash_attention.default in targets

    monkeypatch.setattr(ta, "gated_flash_attention", torch.compiler.disable(ta.gated_flash_attention))
    torch._dynamo.reset()
    assert torch._dynamo.explain(layer)(x).graph_break_count >= 1


@pytest.mark.parametrize("gate,masked", [("sdpa_elementwise", False), ("sdpa_headwise", True)])
def test_compiled_layer_matches_the_plain_sdpa_layer(gate, masked):
    """The triton_gated attention layer compiled whole (fullgraph=True, aot_eager: AOT autograd's joint graph through
    the op's registered backward) against the same layer on sdpa with the gate outside, uncompiled: output, the input's
    gradient and every parameter's (padded query rows excluded: 0 in the kernel, noise in sdpa)."""
    ref = tiny_lm(gate, backend="sdpa", eval=False, perturbed=True).to(DEV)
    fast = copy.deepcopy(ref)
    fast.set_attn_implementation("triton_gated")
    x, pe, mask = _layer_inputs(ref)
    m = mask if masked else None
    rows = mask[:, 0].any(-1) if masked else torch.ones(mask.shape[0], mask.shape[2], dtype=torch.bool, device=DEV)
    fast_attn, ref_attn = fast.model.layers[0].self_attn, ref.model.layers[0].self_attn
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: fast_attn(x, pe, attention_mask=m)[0], backend="aot_eager", fullgraph=True)

    def run(attn, x):
        y = (compiled(x) if attn is fast_attn else attn(x, pe, attention_mask=m)[0])[rows]  # (real rows, d)
        return y, (y * torch.linspace(-1, 1, y.numel(), device=DEV).view_as(y)).sum()

    assert_modules_match(fast_attn, ref_attn, run, [x], rtol=1e-4, atol=1e-5, grad_rtol=1e-4, grad_atol=1e-6)


def _kernel_launches(monkeypatch) -> list[str]:
    """Every Triton kernel the ops launch from now on, by name (the ops launch through torch.library.wrap_triton)."""
    launches, real = [], torch.library.wrap_triton

    def counting(kernel):
        launches.append(getattr(kernel, "__name__", None) or kernel.fn.__name__)
        return real(kernel)

    monkeypatch.setattr(torch.library, "wrap_triton", counting)
    return launches


def _train_step(mode: str, compiled: bool, monkeypatch):
    """One forward/backward of the tiny 2-layer triton_gated model the trainer's way (fast path, `mode` checkpointing,
    the layer forward compiled with aot_eager when `compiled`): (forward kernel launches in forward, in backward,
    {parameter: gradient})."""
    torch._dynamo.reset()
    model = tiny_lm("sdpa_elementwise", backend="triton_gated", eval=False, seed=0).to(DEV)
    model.train()
    layers = decoder_layers(model)
    plan = fastpath.prepare(type("C", (), {"fast": True, "compile": "false"})(), model, layers, DEV)
    if compiled:
        plan.backend = "aot_eager"
        plan._enable("compile=true")
    apply_activation_checkpointing(layers, mode)
    ids = torch.randint(0, model.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1)).to(DEV)
    launches = _kernel_launches(monkeypatch)
    with plan.training_forward():
        loss = model(input_ids=ids[:, :-1], shift_labels=ids[:, 1:], fused_loss=True, use_cache=False).loss
    in_forward = launches.count("_fwd_kernel")
    loss.backward()
    in_backward = launches.count("_fwd_kernel") - in_forward
    assert launches.count("_bwd_dq") == len(layers)  # the backward ran once per layer
    return in_forward, in_backward, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("compiled", [False, True])
def test_selective_checkpointing_keeps_the_kernel_output(compiled, monkeypatch):
    """Under `selective` the recompute hands back the kernel's kept output: its forward kernel runs once per layer, in
    forward only, as without checkpointing; under `full` (the control) the recompute runs it again in backward. The
    gradients equal `none`'s in both modes. Eager, and the trainer's compiled layer (the policy traced into its graph)."""
    launched, grads = {}, {}
    for mode in ("none", "selective", "full"):
        fwd, bwd, grads[mode] = _train_step(mode, compiled, monkeypatch)
        launched[mode] = (fwd, bwd)
    assert launched["none"] == (2, 0)
    assert launched["selective"] == (2, 0)
    assert launched["full"] == (2, 2)  # the control: the layer's recompute does run the kernel when nothing keeps it
    for mode in ("selective", "full"):
        for name, g in grads["none"].items():
            torch.testing.assert_close(grads[mode][name], g, rtol=1e-6, atol=1e-7, msg=f"{mode} {name}")


@pytest.mark.parametrize("interpret", ["0", "1"])
def test_aot_graphs_hold_the_kernel_launches_on_a_gpu_and_the_op_under_the_interpreter(interpret):
    """AOT autograd's forward and backward graphs of the op (tests/probes/triton_op_trace.py, its own process, fake
    tensors). Without the interpreter -- the GPU's path, traced here without a GPU -- the op is replaced by its kernel
    launches (wrap_triton), each writing only its own outputs (torch's analysis of the Triton IR for sm_90): forward
    the one forward kernel, backward the three backward kernels; the gate's gradient only when gated. Under the
    interpreter the graphs hold the ops whole (its kernels cannot be traced into)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_INTERPRET"] = interpret
    probe = Path(__file__).parent / "probes" / "triton_op_trace.py"
    for gate in ("elementwise", "none"):
        res = subprocess.run([sys.executable, str(probe), gate], capture_output=True, text=True, env=env, timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
        found = json.loads(res.stdout.splitlines()[-1])
        assert found["interpreted"] == (interpret == "1")
        forward, backward = found["graphs"]
        if interpret == "1":
            assert (forward, backward) == ({"launches": [], "ops": ["gated_attention.flash_attention.default"]},
                                           {"launches": [], "ops": ["gated_attention.flash_attention_backward.default"]})
            continue
        assert forward == {"launches": [["_fwd_kernel", ["Lse", "Out"]]], "ops": []}
        pre = ["DG", "DOE", "Delta"] if gate != "none" else ["Delta"]
        assert backward == {"launches": [["_bwd_preprocess", pre], ["_bwd_dkdv", ["DK", "DV"]], ["_bwd_dq", ["DQ"]]],
                            "ops": []}
