"""`gattn lab streaming`: does a model stream with a plain sliding KV window, or does it need sink tokens?

streaming_lab.py (models to measure, held-out data per model kind, full attention vs a rolling window keeping K first
tokens, lab.json), streaming_report.py (the per-position plot and the report). The lab's API is re-exported here.
"""
from .streaming_lab import DEFAULT_SINK_TOKENS, StreamingConfig, resolve_models, run_streaming

__all__ = ["DEFAULT_SINK_TOKENS", "StreamingConfig", "resolve_models", "run_streaming"]
