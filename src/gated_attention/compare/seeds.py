"""Every per-variant figure of `gattn compare` over all its seeds: the mean, a 95 % t interval and the per-seed values,
the form in which the report's tables, plots and claims rows read a figure.

A compare.json row (`rows[variant]`) holds its first seed's figures at the top level, each seed's under `by_seed`
({seed index: the same row}) and val_loss_by_seed ({seed index: mean val loss}); `summarize` turns them into
`over_seeds` ({key: stat}, stat = {"mean", "ci_low", "ci_high", "n", "per_seed"}). A compare.json written before
every seed was analysed has no `by_seed`: its analysis figures are then the first seed's alone (n = 1, no interval)
while the val loss still covers every seed.
"""
from __future__ import annotations

import math
import statistics

from ..experiment.stats import t_quantile

# the scalar figures of a row summarised over seeds (Table 4's and "More measurements"' columns)
SCALARS = ("avg_ppl", "gate_mean", "gate_near_zero", "m_act", "f_attn", "f_attn_max_layer", "spikes",
           "uniform_f_attn", "sink_rate", "final_loss_avg10", "skipped_steps", "tokens", "train_wall_time_s",
           "max_abs_attn_output", "max_abs_ffn_output", "mean_abs_y_pre_gate", "mean_abs_y_post_gate",
           "sparsity_pre_gate_0.01", "sparsity_post_gate_0.01", "sparsity_pre_gate_x_mean_gate_0.01")


def stat(per_seed: list) -> dict | None:
    """{"mean", "ci_low", "ci_high", "n", "per_seed"} of the finite values (interval None below 2 seeds); None when
    no seed measured it."""
    xs = [float(x) for x in per_seed if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)]
    if not xs:
        return None
    mean = statistics.fmean(xs)
    if len(xs) < 2:
        return {"mean": mean, "ci_low": None, "ci_high": None, "n": 1, "per_seed": xs}
    half = t_quantile(0.975, len(xs) - 1) * statistics.stdev(xs) / math.sqrt(len(xs))
    return {"mean": mean, "ci_low": mean - half, "ci_high": mean + half, "n": len(xs), "per_seed": xs}


def seed_rows(row: dict) -> dict[str, dict]:
    """{seed index: row} of every analysed seed (the first seed's row alone for a compare.json without by_seed)."""
    return row.get("by_seed") or {"0": row}


def summarize(row: dict) -> dict:
    """The row's figures over its seeds: each scalar, `val_loss` (every trained seed), `val_ppl` ({domain: stat}) and
    `per_layer` ({metric: [stat per layer]})."""
    runs = list(seed_rows(row).values())
    out = {k: stat([r.get(k) for r in runs]) for k in SCALARS}
    out["val_loss"] = stat(list((row.get("val_loss_by_seed") or {}).values()))
    domains = list(dict.fromkeys(d for r in runs for d in (r.get("val_ppl") or {})))
    out["val_ppl"] = {d: stat([(r.get("val_ppl") or {}).get(d) for r in runs]) for d in domains}
    layers = {}
    for metric in ("f_attn", "m_act", "gate_mean"):
        n = max((len((r.get("per_layer") or {}).get(metric) or []) for r in runs), default=0)
        layers[metric] = [stat([((r.get("per_layer") or {}).get(metric) or [None] * n)[i] for r in runs])
                          for i in range(n)]
    out["per_layer"] = layers
    return out


def over_seeds(row: dict) -> dict:
    """The row's stored `over_seeds`, or one computed now (a compare.json from before they were stored)."""
    return row.get("over_seeds") or summarize(row)


def mean(row: dict, key: str):
    """A scalar figure's mean over the row's seeds (None when not measured)."""
    s = over_seeds(row).get(key)
    return s["mean"] if s else None


def n_analysed(row: dict) -> int:
    """How many seeds' models the row's analysis figures cover."""
    return len(seed_rows(row))
