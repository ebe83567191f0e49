"""gated-attention: gated softmax attention for LMs (Qiu et al. 2025)."""
__version__ = "0.1.0"
