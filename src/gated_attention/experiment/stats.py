"""Aggregation over seeds, one convention for every job: the mean and the sample standard deviation (n - 1) of the
values a seed measured (a missing or non-finite value is left out); one value has no spread, so its std is None
(reports then show the mean alone), and nothing measured is None in both. `seed_curves` is the same over the learning
curves the labs record per seed (the sink and retrofit labs' plots). `welch` is the interval of a difference of two
means whose samples are different models (no pairing), with `t_quantile` the Student-t quantile at any real df.
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


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularized incomplete beta function (modified Lentz)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        m2 = 2 * m
        for num in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """I_x(a, b), the regularized incomplete beta function."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_quantile(p: float, df: float) -> float:
    """The p quantile (0.5 <= p < 1) of Student's t with df > 0 degrees of freedom (any real df: Welch's are not
    whole), by bisection on the CDF 1 - I_{df/(df+t^2)}(df/2, 1/2) / 2."""
    if not 0.5 <= p < 1 or not df > 0:
        raise ValueError(f"t_quantile needs 0.5 <= p < 1 and df > 0, got p={p}, df={df}")
    lo, hi = 0.0, 1.0
    while 1.0 - 0.5 * _betainc(df / 2, 0.5, df / (df + hi * hi)) < p:
        hi *= 2.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if 1.0 - 0.5 * _betainc(df / 2, 0.5, df / (df + mid * mid)) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12 * hi:
            break
    return (lo + hi) / 2


def welch(a: Iterable, b: Iterable, level: float = 0.95) -> dict:
    """mean(a) - mean(b) of two independent samples (different models: nothing pairs them) with its two-sided
    Student-t interval at Welch-Satterthwaite degrees of freedom (unequal variances). Non-finite values are left out;
    the interval is None unless each sample has >= 2 values. Keys: mean, ci_low, ci_high, df, se, n_a, n_b, std_a,
    std_b."""
    sa, sb = spread(a), spread(b)
    out = {"mean": None, "ci_low": None, "ci_high": None, "df": None, "se": None, "n_a": sa["n"], "n_b": sb["n"],
           "std_a": sa["std"], "std_b": sb["std"]}
    if sa["n"] and sb["n"]:
        out["mean"] = sa["mean"] - sb["mean"]
    if sa["std"] is None or sb["std"] is None:
        return out
    va, vb = sa["std"] ** 2 / sa["n"], sb["std"] ** 2 / sb["n"]
    se = math.sqrt(va + vb)
    out["se"] = se
    if se == 0:  # both samples constant: the difference is known exactly
        out["ci_low"] = out["ci_high"] = out["mean"]
        return out
    df = (va + vb) ** 2 / (va * va / (sa["n"] - 1) + vb * vb / (sb["n"] - 1))
    half = t_quantile(0.5 + level / 2, df) * se
    out.update(df=df, ci_low=out["mean"] - half, ci_high=out["mean"] + half)
    return out
