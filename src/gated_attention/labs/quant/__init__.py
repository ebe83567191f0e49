"""`gattn lab quant`: gated models under quantization.

models.py (the models to measure and their data: variant, arm, family, seed), quant_lab.py (every (model, scheme,
policy) fake-quantized with gated_attention.quant and measured: val loss per domain and Δ, the gate, the sink;
lab.json), verdict.py (the rule: gated vs baseline Δ by Welch intervals and policy vs policy Δ paired on the same
models, against the paper's δ; the recommended policy, or none), quant_report.py (tables, plots, report). The lab's API is re-exported here.
"""
from .models import QuantModel, resolve_models
from .quant_lab import QuantLabConfig, run_lab

__all__ = ["QuantLabConfig", "QuantModel", "resolve_models", "run_lab"]
