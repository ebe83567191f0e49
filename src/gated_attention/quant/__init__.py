"""Quantization as functions applied to a built model (the `quant` extra, torchao): the schemes' fake-quant math
(schemes.py) and how a scheme meets the gate (policies.py: all / keep-gate / split-gate). The model never changes."""
from .policies import POLICIES, quantize_model
from .schemes import SCHEMES, awq_scales, quantize_activation, quantize_weight

__all__ = ["SCHEMES", "POLICIES", "quantize_model", "quantize_weight", "quantize_activation", "awq_scales"]
