"""`gattn compare`, the main job: baseline vs gated variants on the same data, seed and parameter budget, measured and
reported in the form of the paper's Table 4.

job.py (budgets, train/reuse and analyse each variant, the sink lab and streaming check it runs, compare.json),
claims.py (the "Paper claims vs this run" table that opens the report, one verdict rule per claim), compare_report.py
(the tables, plots and report.md / report.html). The job's API is re-exported here: `from gated_attention import
compare; compare.run_compare("runs/compare", budget="small")`.
"""
from .job import (BUDGETS, DEFAULT_DATA_DIR, DEFAULT_VARIANTS, Budget, budget_config, check_variants, get_budget,
                  run_compare)

__all__ = ["BUDGETS", "DEFAULT_DATA_DIR", "DEFAULT_VARIANTS", "Budget", "budget_config", "check_variants", "get_budget",
           "run_compare"]
