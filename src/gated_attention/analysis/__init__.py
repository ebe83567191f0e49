"""Analysis toolkit: attention sinks (F-Attn, Sink_k^eps), massive activations (M-Act), gate statistics, SDPA-output
sparsity and loss by position, on our models (capture API) and on any local HF transformer (hooks).

Entry points: `analyze_model(model, batches, AnalysisConfig())` -> JSON-ready dict; `load_model(dir)`;
`gattn analyze` (gated_attention/cli/analyze.py); plots in plots.py.
"""
from .analyze import AnalysisConfig, analysis_schema, analyze_model, load_model, load_tokenizer, token_batches

__all__ = ["AnalysisConfig", "analysis_schema", "analyze_model", "load_model", "load_tokenizer", "token_batches"]
