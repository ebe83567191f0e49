"""The experiment layer: one toolkit for runs, cached results and reports, shared by every multi-run job
(`gattn compare`, `gattn longctx` and each `gattn lab`). A job states what differs (its budget, what
it measures, its tables); the plumbing lives here once:

  runs.py    ensure_corpus, train_or_reuse (one trainer run per folder: reuse, resume or train), run_units (one
             model per unit, in-process or in --jobs worker processes), default_jobs / cores
  cache.py   THE reuse rule: a result is stored with its key (every setting that changes it, the resolved precision
             included); the same key is reused, a missing result is computed, and a different key stops the job
             with the differing settings named (a new --out, or delete that result). load / save / cached / check.
  pages.py   the one renderer: report.md + a self-contained report.html from blocks (tables, paragraphs, figures,
             one CSS), number formats, aligned text tables
  study.py   what every lab that trains shares, declared once: its budgets, its command-line options (each help in one
             place; cli/lab.py builds `gattn lab NAME` from a lab's STUDY), the one step-hook Recorder of a unit
             (curve, trailing windows, CPU and wall time, state in the checkpoints), finish_unit, Units (a
             study's planned units, trained alone or in another job's pool)
  stats.py   aggregation over seeds (mean, sample std; one seed has std None), Wilson intervals

A job, in full (the labs and compare read like this):

    data_dir = runs.ensure_corpus(budget.data_dir, budget.vocab_size, log, "[lab x]")
    for gate in gates:
        run_dir = out / "runs" / gate
        summary = runs.train_or_reuse(replace(base, gate=gate), run_dir, log, "[lab x]")
        key = {"measure": settings, "model": run_key}       # every setting the measurement depends on
        result = cache.cached(run_dir / "x.json", key, lambda: measure(run_dir / "final"), log, "[lab x]")
    report.write(out, "gattn lab x", blocks)

Layering: above train/, data/ and analysis/ (it drives them), below the jobs and labs (they call it). Jobs pass
`log` (a callable taking one line) and a `tag` such as "[compare]" that prefixes each line.
"""
from .cache import StaleResult, cached
from .runs import cores, default_jobs, ensure_corpus, is_finished, run_units, train_or_reuse

__all__ = ["StaleResult", "cached", "cores", "default_jobs", "ensure_corpus", "is_finished", "run_units",
           "train_or_reuse"]
