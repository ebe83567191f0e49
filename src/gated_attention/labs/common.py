"""What the labs share beyond the experiment toolkit. Caching units, aggregating seeds, parallel units and report
pages are the toolkit's (gated_attention.experiment: cache, stats, runs, report), the same for every job; the names
that lived here answer for one release with a DeprecationWarning pointing at their new home.
"""
from __future__ import annotations

from ..util.deprecation import renamed_attributes

__getattr__ = renamed_attributes(__name__, globals(), {
    "load_unit": "gated_attention.experiment.cache:load", "save_unit": "gated_attention.experiment.cache:save",
    "mean_std": "gated_attention.experiment.stats:mean_std",
    "fmt_mean_std": "gated_attention.experiment.report:fmt_mean_std",
    "md_table": "gated_attention.experiment.report:md_table", "html_table": "gated_attention.experiment.report:html_table",
    "render_report": "gated_attention.experiment.report:render", "write_report": "gated_attention.experiment.report:write",
    "run_units": "gated_attention.experiment.runs:run_units", "default_jobs": "gated_attention.experiment.runs:default_jobs",
})
