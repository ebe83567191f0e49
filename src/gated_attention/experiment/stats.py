"""Aggregation over seeds, one convention for every job: the mean and the sample standard deviation (n - 1) of the
values a seed measured (a missing or non-finite value is left out); one value has no spread, so its std is None
(reports then show the mean alone), and nothing measured is None in both. `seed_curves` is the same over the learning
curves the labs record per seed (the sink and retrofit labs' plots).
"""
from __future__ import annotations

import math
import statistics
from typing import Iterable


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def spread(values: Iterable) -> dict:
    """{"mean", "std", "min", "max", "n"} of the finite values (std None for n = 1; all None for n = 0)."""
    vals = [float(v) for v in values if _finite(v)]
    if not vals:
        return {"mean": None, "std": None, "min": None, "max": None, "n": 0}
    return {"mean": statistics.fmean(vals), "std": statistics.stdev(vals) if len(vals) > 1 else None,
            "min": min(vals), "max": max(vals), "n": len(vals)}


def mean_std(per_seed: list[dict], keys: Iterable[str]) -> tuple[dict, dict]:
    """Mean and std (the convention above) of each scalar key over per-seed result dicts: two dicts keyed like
    `keys`, the `mean` / `std` objects of a lab.json variant."""
    mean, std = {}, {}
    for k in keys:
        s = spread(r.get(k) for r in per_seed)
        mean[k], std[k] = s["mean"], s["std"]
    return mean, std


def seed_curves(variants: dict, key: str) -> dict[str, tuple[list, list, list, list]]:
    """{name: (steps, mean, lo, hi)} of one curve metric over seeds: `variants` maps a name to {"per_seed": [result,
    ...]} (a lab.json's "variants"), each result holding "curve", a list of {"step", key, ...} points. A step's mean
    and its min..max band are over the seeds that measured `key` there (None values left out)."""
    out = {}
    for name, v in variants.items():
        by_step: dict[int, list[float]] = {}
        for r in v["per_seed"]:
            for p in r.get("curve", []):
                if p.get(key) is not None:
                    by_step.setdefault(p["step"], []).append(p[key])
        steps = sorted(by_step)
        out[name] = (steps, [sum(by_step[s]) / len(by_step[s]) for s in steps], [min(by_step[s]) for s in steps],
                     [max(by_step[s]) for s in steps])
    return out


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95 % Wilson score interval of a proportion, in %: honest at 0 % and 100 %, where the normal one collapses."""
    if n <= 0:
        return (0.0, 100.0)
    p = successes / n
    den = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return (100 * max(0.0, centre - half), 100 * min(1.0, centre + half))
