"""The scaling lab's confirmatory design and its estimators, pure functions over losses (no training here).

- **Planned pairs** (`plan_pairs`): an internal pilot (Wittes & Brittain 1990) gives each arm's spread of the final
  loss over its first seeds; the pooled *within-arm* variance (never the pairs' differences, so the plan is blind to
  Δ) gives the sd of a pair's Δ as sqrt(2) x the pooled sd (independent arms: conservative when the shared data order
  correlates them); n pairs give SE sd/sqrt(n), and excluding 0 at the rule's threshold with 80 % power at a two-sided
  5 % level needs SE <= threshold / (z_0.975 + z_0.8) = threshold / 2.80.
- **The compute multiplier** (`multiplier_fit`): a joint fit L = E + A * (k_arm * C)^-alpha, E, A and alpha shared by
  every arm, k = 1 for the baseline. For fixed E, ln(L - E) = ln A - alpha ln C - alpha ln k_arm is linear in
  (ln A, alpha, alpha ln k_arm), so each E of a grid below the smallest loss is a closed-form least squares with one
  indicator column per gated arm; the E with the smallest squared error in L wins. Per size, ln k = -Δ / s with
  s = alpha * A * C^-alpha, the baseline curve's loss drop per e-fold of compute at that size (so the per-size figure
  needs no constant-k assumption). Intervals: a bootstrap over confirm seeds, each resample drawing seed indices per
  size and applying them to every arm (pairs stay pairs).
- **The trend** (`wls_trend`): one weighted least squares of every confirm pair's Δ (or ln k) on ln C, each pair
  weighted by 1 / (its size's planned pair variance), with a Student-t interval on N - 2 degrees of freedom from the
  weighted residuals.
"""
from __future__ import annotations

import math
import random
import statistics

from .verdict import seeds_needed, t975

Z_975, Z_80 = 1.959964, 0.841621  # standard normal quantiles: two-sided 5 % level, 80 % power
POWER_FACTOR = Z_975 + Z_80  # 2.80: the SE a decision at the threshold needs is threshold / 2.80


def pooled_within_sd(per_arm: dict[str, list[float]]) -> tuple[float | None, int]:
    """The pooled sample sd of the final loss within arms ({arm: [loss per pilot seed]}) and its degrees of freedom:
    sum of squared deviations from each arm's own mean over sum(n_arm - 1)."""
    ss = df = 0
    for vals in per_arm.values():
        vals = [v for v in vals if v is not None and math.isfinite(v)]
        if len(vals) > 1:
            m = statistics.fmean(vals)
            ss += sum((v - m) ** 2 for v in vals)
            df += len(vals) - 1
    return (math.sqrt(ss / df) if df else None), df


def pairs_for(sd_pair: float, threshold: float) -> int:
    """Pairs whose SE sd_pair / sqrt(n) is at most threshold / 2.80 (80 % power to exclude 0 at the threshold)."""
    return max(2, math.ceil((sd_pair * POWER_FACTOR / threshold) ** 2))


def plan_pairs(pilot: dict[str, dict[str, list[float]]], thresholds: dict[str, float], n_min: int, cap: int,
               cheap_extra: float = 2.0) -> dict:
    """The registered plan per size. pilot: {size: {arm: [loss, ...]}}; thresholds: {size: the rule's threshold in
    nats there}; n_min: the pilot's pairs (already run, so never fewer); cap: --max-pairs. The smallest size, the
    cheapest and one end of the trend's lever arm, plans `cheap_extra` x its n. Returns {size: {sd_within, df,
    sd_pair, threshold, target_se, n_power, n_planned, capped}}."""
    sizes = list(pilot)
    out = {}
    for i, s in enumerate(sizes):
        sd, df = pooled_within_sd(pilot[s])
        row = {"sd_within": sd, "df": df, "threshold": thresholds[s], "target_se": thresholds[s] / POWER_FACTOR}
        if sd is None:
            row.update(sd_pair=None, n_power=None, n_planned=cap, capped=True)
        else:
            n = pairs_for(math.sqrt(2) * sd, thresholds[s])
            want = math.ceil(n * cheap_extra) if i == 0 and len(sizes) > 2 else n
            row.update(sd_pair=math.sqrt(2) * sd, n_power=n, n_planned=min(cap, max(n_min, want)), capped=want > cap)
        out[s] = row
    return out


def chi2_quantile(p: float, df: int) -> float:
    """The chi-square quantile: exact for df 1 and 2, Wilson-Hilferty's approximation from df 3 (within ~1 %)."""
    if df == 1:
        return statistics.NormalDist().inv_cdf((1 + p) / 2) ** 2
    if df == 2:
        return -2 * math.log(1 - p)
    z = statistics.NormalDist().inv_cdf(p)
    h = 2.0 / (9 * df)
    return df * (1 - h + z * math.sqrt(h)) ** 3


def pairs_needed(mean: float | None, sd: float | None, n: int, threshold: float) -> dict | None:
    """Pairs for 80 % power to decide this cell at its measured spread (verdict.seeds_needed: exclude 0 when |mean|
    is at least the threshold, else fit inside ±threshold), with its range from the sd's 95 % chi-square interval
    (n - 1 df). None without a spread."""
    if sd is None or mean is None or n < 2:
        return None
    df = n - 1
    lo_sd = sd * math.sqrt(df / chi2_quantile(0.975, df))
    hi_sd = sd * math.sqrt(df / chi2_quantile(0.025, df))
    return {"n": seeds_needed(mean, sd, threshold), "low": seeds_needed(mean, lo_sd, threshold),
            "high": seeds_needed(mean, hi_sd, threshold), "power": 0.8}


# ---------------------------------------------------------------- the joint multiplier fit

def joint_fit(points: list[tuple[str, float, float]], base: str, grid: int = 200, refine: int = 3) -> dict:
    """L = E + A (k_arm C)^-alpha over points (arm, C, mean loss); k_base = 1. For each E of a grid on [0, min L) the
    log-linear least squares is one matrix product (the design matrix does not depend on E); the grid is refined
    `refine` times around the best E. Returns E, A, alpha, ln_k {arm}, rms, and E_at_bound (the best E is 0)."""
    import numpy as np

    arms = sorted({a for a, _, _ in points if a != base})
    if len({c for _, c, _ in points}) < 3:
        raise ValueError("the multiplier fit needs at least 3 sizes")
    x = np.array([[1.0, math.log(c)] + [1.0 if a == g else 0.0 for g in arms] for a, c, _ in points])  # (n, 2 + arms)
    loss = np.array([l for _, _, l in points])  # (n,)
    pinv = np.linalg.pinv(x)  # (2 + arms, n)
    lo, hi = 0.0, float(loss.min())
    best = None
    for level in range(refine + 1):
        es = np.linspace(lo, hi, grid, endpoint=False)  # (G,)
        coef = pinv @ np.log(loss[:, None] - es[None, :])  # (2 + arms, G)
        pred = es[None, :] + np.exp(x @ coef)  # (n, G)
        sse = ((loss[:, None] - pred) ** 2).sum(0)
        sse[coef[1] >= 0] = np.inf  # alpha must be positive: a decreasing law
        i = int(np.argmin(sse))
        if not np.isfinite(sse[i]):
            break
        best = (float(sse[i]), float(es[i]), coef[:, i], level == 0 and i == 0)
        step = (hi - lo) / grid
        lo, hi = max(0.0, es[i] - step), min(float(loss.min()) - 1e-12, es[i] + step)
    if best is None:
        raise ValueError("the multiplier fit found no decreasing power law")
    sse, e, coef, at_bound = best
    alpha = -float(coef[1])
    return {"E": e, "A": math.exp(float(coef[0])), "alpha": alpha,
            "ln_k": {g: -float(coef[2 + j]) / alpha for j, g in enumerate(arms)},
            "rms": math.sqrt(sse / len(points)), "E_at_bound": bool(at_bound)}


def local_slope(fit: dict, c: float) -> float:
    """The fitted baseline's loss drop per e-fold of compute at C (positive nats): alpha * A * C^-alpha."""
    return fit["alpha"] * fit["A"] * c ** -fit["alpha"]


def _mean(xs):
    return statistics.fmean(xs)


def multiplier_fit(compute: dict[str, float], losses: dict[str, dict[str, dict[int, float]]], base: str,
                   n_boot: int = 1000, seed: int = 0, level: float = 0.95) -> dict:
    """ln k per gated arm overall (the joint fit) and per size (-Δ / local slope), each with a bootstrap interval.
    losses: {arm: {size: {seed: loss}}} over confirm seeds (the seeds all arms have at a size are used).
    Returns {"fit": ..., "overall": {arm: {ln_k, ci_low, ci_high}}, "per_size": {arm: {size: {...}}},
    "slope": {size: s}, "E_at_bound_share"}."""
    sizes = [s for s in compute if all(losses[a].get(s) for a in losses)]
    seeds = {s: sorted(set.intersection(*(set(losses[a][s]) for a in losses))) for s in sizes}
    sizes = [s for s in sizes if seeds[s]]
    arms = [a for a in losses if a != base]

    def estimate(pick: dict[str, list[int]]) -> tuple[dict, dict, dict]:
        pts = [(a, compute[s], _mean([losses[a][s][k] for k in pick[s]])) for a in losses for s in sizes]
        fit = joint_fit(pts, base)
        per = {a: {s: -(_mean([losses[a][s][k] - losses[base][s][k] for k in pick[s]]))
                   / local_slope(fit, compute[s]) for s in sizes} for a in arms}
        return fit, per, {s: local_slope(fit, compute[s]) for s in sizes}

    fit, per, slope = estimate(seeds)
    rng = random.Random(seed)
    boots_all = {a: [] for a in arms}
    boots_size = {a: {s: [] for s in sizes} for a in arms}
    at_bound = 0
    if all(len(seeds[s]) > 1 for s in sizes):
        for _ in range(n_boot):
            pick = {s: rng.choices(seeds[s], k=len(seeds[s])) for s in sizes}
            try:
                f, p, _ = estimate(pick)
            except ValueError:
                continue
            at_bound += f["E_at_bound"]
            for a in arms:
                boots_all[a].append(f["ln_k"][a])
                for s in sizes:
                    boots_size[a][s].append(p[a][s])
    q = ((1 - level) / 2, (1 + level) / 2)

    def interval(vals):
        return (percentile(vals, q[0]), percentile(vals, q[1])) if len(vals) > 1 else (None, None)

    overall = {a: dict(zip(("ci_low", "ci_high"), interval(boots_all[a])), ln_k=fit["ln_k"][a]) for a in arms}
    per_size = {a: {s: dict(zip(("ci_low", "ci_high"), interval(boots_size[a][s])), ln_k=per[a][s]) for s in sizes}
                for a in arms}
    n_b = len(next(iter(boots_all.values()), []))
    return {"fit": fit, "overall": overall, "per_size": per_size, "slope": slope, "n_boot": n_b,
            "E_at_bound_share": at_bound / n_b if n_b else None}


def percentile(vals: list[float], q: float) -> float:
    vals = sorted(vals)
    k = (len(vals) - 1) * q
    f, c = math.floor(k), math.ceil(k)
    return vals[f] + (vals[c] - vals[f]) * (k - f)


# ---------------------------------------------------------------- the weighted trend

def wls_trend(points: list[tuple[float, float, float]]) -> dict:
    """Weighted least squares y = a + b x over (x, y, weight): the slope b, its standard error from the weighted
    residuals (sigma^2 = sum w r^2 / (N - 2)), and a two-sided 95 % Student-t interval on N - 2 df."""
    pts = [(x, y, w) for x, y, w in points if math.isfinite(y) and w > 0]
    if len(pts) < 3 or len({x for x, _, _ in pts}) < 2:
        return {"slope": None, "ci_low": None, "ci_high": None, "se": None, "n": len(pts)}
    sw = sum(w for _, _, w in pts)
    mx = sum(w * x for x, _, w in pts) / sw
    my = sum(w * y for _, y, w in pts) / sw
    sxx = sum(w * (x - mx) ** 2 for x, _, w in pts)
    b = sum(w * (x - mx) * (y - my) for x, y, w in pts) / sxx
    a = my - b * mx
    s2 = sum(w * (y - a - b * x) ** 2 for x, y, w in pts) / (len(pts) - 2)
    se = math.sqrt(s2 / sxx)
    half = t975(len(pts) - 2) * se
    return {"slope": b, "intercept": a, "se": se, "ci_low": b - half, "ci_high": b + half, "n": len(pts),
            "df": len(pts) - 2}
