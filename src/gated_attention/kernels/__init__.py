"""GPU kernels of the model (core layer): the fused gated flash-attention behind attn_implementation="triton_gated".

triton_attention.py (launch, masks, autograd: the registered ops; imported only when that backend runs), triton_jit.py
(the `@triton.jit` code, imported on first use: importing Triton costs seconds). Interpreter-tested on CPU
(TRITON_INTERPRET=1); every kernel has a plain reference in the tests.
"""

TRITON_PIN = "triton==3.7.1"  # the release torch==2.13.0's CUDA wheels pair with

# The fused kernel's forward as a registered torch op (triton_attention.py registers it when the backend is first
# used: registering imports Triton). Selective activation checkpointing keeps its outputs by this name.
FLASH_ATTENTION_OP = "gated_attention::flash_attention"
