"""`gattn lab stability`: LR sweeps with and without QK-norm, the paper's Table 2 claim at small scale, with the
proxies of Wortsman et al. 2023.

lab.py (the grid: budgets, one run per grid point on the trainer, LR sensitivity, lab.json), probe.py (max attention
logit and output logit on the trainer's probe forwards), report.py (plots and the report). The lab's API is
re-exported here: `from gated_attention.labs import stability; stability.run_lab(stability.LabConfig())`.
"""
from .stability_lab import BUDGETS, DEFAULT_VARIANTS, QK_SETTINGS, LabConfig, budget_settings, lr_sensitivity, run_lab

__all__ = ["BUDGETS", "DEFAULT_VARIANTS", "QK_SETTINGS", "LabConfig", "budget_settings", "lr_sensitivity", "run_lab"]
