"""`gattn lab sinks`: attention sinks on the Bigram-Backcopy task, baseline vs gates, over seeds.

sink_lab.py (the lab: config and budgets, one unit = a variant x seed trained and measured, the aggregate lab.json),
stored.py (finished unit folders: is_run_dir, load_run_meta, load_run),
backcopy.py (the task), metrics.py (its pure metric functions), sink_report.py (plots and the report). The lab's API is
re-exported here: `from gated_attention.labs import sinks; sinks.run_lab(sinks.SinkLabConfig(), "runs/lab/sinks")`.
"""
from .sink_lab import (BUDGETS, DEFAULT_VARIANTS, METRICS, STORED, SinkLabConfig, budget_config, measure, model_config_for, resolve_variant, run_lab, train_unit,
                       unit_jobs, write_lab)
from .stored import SinkRun, is_run_dir, load_run, load_run_meta

__all__ = ["BUDGETS", "DEFAULT_VARIANTS", "METRICS", "STORED", "SinkLabConfig", "SinkRun", "budget_config",
           "is_run_dir", "load_run", "load_run_meta", "measure", "model_config_for", "resolve_variant", "run_lab", "train_unit",
           "unit_jobs", "write_lab"]
