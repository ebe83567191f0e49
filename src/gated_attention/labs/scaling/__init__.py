"""`gattn lab scaling`: a ladder of model sizes, every variant at its own best LR, over seeds (scaling_lab.py); the
rules and fits (verdict.py); the report (scaling_report.py)."""
from .scaling_lab import BUDGETS, LabConfig, run_lab

__all__ = ["BUDGETS", "LabConfig", "run_lab"]
