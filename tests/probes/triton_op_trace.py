"""Run by tests/test_triton_op.py in a process without TRITON_INTERPRET: AOT autograd's forward and backward graphs of
the `triton_gated` op as a GPU sees them, traced on fake CPU tensors without a GPU. Prints one JSON line: per graph, the
Triton kernels launched (name, and the tensors the launch writes, from torch's analysis of the kernel's Triton IR).

    python tests/probes/triton_op_trace.py GATE    (GATE: elementwise | headwise | none)

torch's analysis of what a launch writes builds each kernel's Triton IR, which needs a compile target, not a GPU: the
driver is told sm_90 (as kernels/triton_attention.compile_for_gpu does), the one thing the analysis asks of it.
"""
from __future__ import annotations

import json
import sys


class _Hopper:
    """The active Triton driver as far as torch's kernel-mutation analysis asks: its compile target."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)


def main(gate: str) -> None:
    import torch
    import triton
    from torch._functorch.aot_autograd import aot_function
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    from torch._subclasses.fake_tensor import FakeTensorMode

    from gated_attention.kernels.triton_attention import interpreted

    triton.runtime.driver.set_active(_Hopper())
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm

    b, h, kv, t, d = 1, 4, 2, 40, 64
    width = {"elementwise": d, "headwise": 1, "none": None}[gate]
    with FakeTensorMode():
        q, k, v = (torch.randn(b, n, t, d, requires_grad=True) for n in (h, kv, kv))
        g = None if width is None else torch.randn(b, t, h, width, requires_grad=True)
        leaves = [x for x in (q, k, v, g) if x is not None]

        def attention(*xs):
            q, k, v, g = (*xs, None)[:4]
            return torch.ops.gated_attention.flash_attention(q, k, v, g, None, None, True, 0, d ** -0.5, 1.0, None)[0]

        aot_function(attention, fw_compiler=capture, bw_compiler=capture)(*leaves).sum().backward()
    found = []
    for gm in graphs:
        nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
        found.append({
            "launches": [[kernel_side_table.get_kernel(n.kwargs["kernel_idx"]).fn.__name__,
                          sorted(n.kwargs["tensors_to_clone"])] for n in nodes
                         if "triton_kernel_wrapper" in str(n.target)],
            "ops": sorted({str(n.target) for n in nodes if "gated_attention" in str(n.target)})})
    print(json.dumps({"interpreted": interpreted(), "graphs": found}))


if __name__ == "__main__":
    main(sys.argv[1])
