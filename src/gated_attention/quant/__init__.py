"""Quantization as functions applied to a built model (the `quant` extra, torchao): the schemes' fake-quant math
(schemes.py) and how a scheme meets the gate (policies.py: all / keep-gate / split-gate). The model never changes."""
from ..util.lazy import lazy_exports

HOMES = {**dict.fromkeys(("POLICIES", "quantize_model"), "policies"),
         **dict.fromkeys(("SCHEMES", "awq_scales", "quantize_activation", "quantize_weight"), "schemes")}
__all__ = list(HOMES)
__getattr__, __dir__ = lazy_exports(__name__, HOMES)  # the names load on first use; the tables need no torch
