"""The scaling lab's numbers and rules, pure functions over its runs: paired gated-minus-baseline differences with
t intervals over seeds, the verdict of a difference against the paper's equal-parameter gain, the seeds a measured
spread needs, the loss-vs-compute fit L = E + A * C^-alpha with bootstrap intervals over seeds, the trend of the
difference with compute ("improves scaling properties"), and the LR basin.

Both rules were fixed before the first `default` ladder ran and are never fitted to this project's runs:

  the gain at one size: Δ = G1 - baseline, mean over seeds of the paired per-seed differences of the validation
  loss (nats), with a two-sided 95 % Student-t interval. With δ = ln(7.499 / 7.404) = 0.0128 nats, the paper's
  dense gain at equal parameters (SPEC: 1.7B dense, 400B tokens, PPL 7.499 -> 7.404):
    reproduced                        upper < 0 and mean <= -δ
    lower, smaller than the paper's   upper < 0 and mean > -δ
    no effect of the paper's size     the interval inside (-δ, +δ)
    worse                             lower > 0
    inconclusive                      otherwise (with the seeds the measured spread needs)

  the trend with compute: per seed, the least-squares slope of its Δ at every size against log2 of the size's
  training compute, times log2(C_max / C_min): how much the gain changes across the ladder; the mean over seeds with
  a 95 % Student-t interval. Judged by the same δ: the paper reports the gain
  shrinking slightly with more tokens (1.3 % at 400B -> 0.8 % at 3.5T), so a change smaller than its gain is no change
  of scaling "of the paper's size":
    improves with scale               upper < 0 and change <= -δ (the gain grows with compute)
    no change of the paper's size     the interval inside (-δ, +δ)
    fades with scale                  lower > 0 (the gain shrinks with compute)
    inconclusive                      otherwise

  the compute multiplier (the scale-free form of the gain): ln k of the joint fit L = E + A (k_arm C)^-alpha (design.py),
  overall and per size, with a 95 % bootstrap interval over confirm seeds, against the paper's k estimated from
  Chinchilla's fit at 1.7B parameters and 400B tokens: k_paper = 1.17, range 1.14-1.22 (the lower end is the bar):
    reproduced                        low > 0 and ln k >= ln 1.14
    lower, smaller than the paper's   low > 0 and ln k < ln 1.14
    no effect of the paper's size     the interval inside (-ln 1.14, +ln 1.14)
    worse                             high < 0
    inconclusive                      otherwise

Every figure these rules judge comes from confirm seeds only: a seed that picked an LR never counts (the lab's
protocol, scaling_lab.py).
"""
from __future__ import annotations

import math
import random
import statistics

from ...experiment.verdicts import Threshold

DELTA = Threshold(
    "δ, the paper's equal-parameter gain", round(math.log(7.499 / 7.404), 5), "nats", "paper",
    "the paper's Table 1-2 (dense 1.7B at equal parameters, 400B tokens: PPL 7.499 -> 7.404): ln(7.499/7.404)")
BASIN = Threshold(
    "LR basin", 0.05, "nats", "chosen",
    "the lab's definition of the basin, fixed before the first ladder ran (the LRs within 0.05 nats of the best); "
    "~4 δ, a loss change a run-to-run comparison at these sizes resolves with one seed")
K_PAPER = Threshold(
    "k, the paper's compute multiplier", 1.17, "x compute", "paper",
    "the compute-multiplier rule in docs/usage.md: Qiu et al. 2025 dense 1.7B at 400B tokens (0.0128 nats) over the loss slopes of Chinchilla's fit (Hoffmann et "
    "al. 2022, approach 3) at N = 1.7e9, D = 4e11: 0.0128 / 0.083 nats per e-fold split evenly = ln 1.17; all on "
    "tokens 1.22, all on parameters 1.14")
K_LOW = Threshold(
    "k's lower end (the bar)", 1.14, "x compute", "paper",
    "the compute-multiplier rule in docs/usage.md: the paper's Table 1-2 dense gain by the same derivation, the extra compute spent on parameters only: 0.0128 / 0.100 = ln 1.14")
LN_K_BAR = math.log(K_LOW.value)
THRESHOLDS = {"gain at one size (paired over seeds)": (DELTA,), "trend with compute": (DELTA,),
              "compute multiplier (ln k, overall and per size)": (K_PAPER, K_LOW),
              "LR basin": (BASIN,)}

REPRODUCED, SMALLER, NO_EFFECT, WORSE, INCONCLUSIVE = (
    "reproduced", "lower, smaller than the paper's", "no effect of the paper's size", "worse", "inconclusive")
DELTA_VERDICTS = (REPRODUCED, SMALLER, NO_EFFECT, WORSE, INCONCLUSIVE)
IMPROVES, NO_CHANGE, FADES = "improves with scale", "no change of the paper's size", "fades with scale"
TREND_VERDICTS = (IMPROVES, NO_CHANGE, FADES, INCONCLUSIVE)
LEVEL = 0.95
N_BOOT = 2000

# two-sided 95 % Student-t quantiles t_{0.975, df} (df 1..30); beyond 30 the normal quantile with a 1/df correction
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t975(df: int) -> float:
    if df < 1:
        raise ValueError("a t interval needs at least 2 values")
    return _T975[df - 1] if df <= 30 else 1.960 + 2.4 / df


def paired_delta(gated: dict[int, float], base: dict[int, float]) -> dict:
    """Δ = gated - baseline over the seeds both have ({seed: loss}): mean, the per-seed differences, std, the 95 % t
    interval (None with one seed) and n."""
    seeds = sorted(set(gated) & set(base))
    diffs = [gated[s] - base[s] for s in seeds if math.isfinite(gated[s]) and math.isfinite(base[s])]
    if not diffs:
        return {"mean": None, "ci_low": None, "ci_high": None, "std": None, "n_seeds": 0, "per_seed": []}
    mean = statistics.fmean(diffs)
    if len(diffs) < 2:
        return {"mean": mean, "ci_low": None, "ci_high": None, "std": None, "n_seeds": 1, "per_seed": diffs}
    sd = statistics.stdev(diffs)
    half = t975(len(diffs) - 1) * sd / math.sqrt(len(diffs))
    return {"mean": mean, "ci_low": mean - half, "ci_high": mean + half, "std": sd, "n_seeds": len(diffs),
            "per_seed": diffs}


def judge(mean: float | None, low: float | None, high: float | None, delta: float = DELTA.value,
          labels: tuple[str, str, str, str] = (REPRODUCED, SMALLER, NO_EFFECT, WORSE)) -> str:
    """The rule of the module doc on one interval; labels: (reproduced/improves, smaller, no effect, worse/fades)."""
    good, smaller, none, bad = labels
    if mean is None or low is None or high is None:
        return INCONCLUSIVE
    if high < 0:
        return good if mean <= -delta else smaller
    if low > 0:
        return bad
    if -delta < low and high < delta:
        return none
    return INCONCLUSIVE


def judge_multiplier(ln_k: float | None, low: float | None, high: float | None, bar: float = LN_K_BAR) -> str:
    """The multiplier rule of the module doc on one ln k interval."""
    if ln_k is None or low is None or high is None:
        return INCONCLUSIVE
    if low > 0:
        return REPRODUCED if ln_k >= bar else SMALLER
    if high < 0:
        return WORSE
    if -bar < low and high < bar:
        return NO_EFFECT
    return INCONCLUSIVE


Z_80 = 0.841621  # the standard normal quantile of 80 % power


def seeds_needed(mean: float, std: float | None, delta: float = DELTA.value, cap: int = 1000) -> int | None:
    """Pairs at which this spread decides with 80 % power: the smallest n with (t_0.975,n-1 + z_0.8) sd / sqrt(n) <=
    target, the target being |mean| (to exclude 0) when |mean| >= δ, else δ - |mean| (to fit inside ±δ). None without
    a spread; cap + 1 when more than cap. (design.pairs_needed adds the range from the sd's own interval.)"""
    if std is None or mean is None:
        return None
    target = abs(mean) if abs(mean) >= delta else delta - abs(mean)
    if std == 0:
        return 2
    for n in range(2, cap + 1):
        if (t975(n - 1) + Z_80) * std / math.sqrt(n) <= target:
            return n
    return cap + 1


# ---------------------------------------------------------------- the loss-vs-compute fit

def fit_power_law(compute: list[float], loss: list[float], grid: int = 400) -> dict:
    """L = E + A * C^-alpha by least squares in L: for each E on a grid below min(L), log(L - E) = log A - alpha log C
    is a line (closed form); the E with the smallest squared error in L wins. Needs >= 3 sizes. Returns E, A, alpha
    and the residual rms."""
    pts = [(c, l) for c, l in zip(compute, loss) if c and c > 0 and l is not None and math.isfinite(l)]
    if len(pts) < 3:
        raise ValueError(f"a power-law fit needs at least 3 sizes with a loss, got {len(pts)}")
    xs = [math.log(c) for c, _ in pts]
    lo = min(l for _, l in pts)
    best = None
    for i in range(grid):
        e = lo * i / grid  # E in [0, min L)
        ys = [math.log(l - e) for _, l in pts]
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
        a = math.exp(my - slope * mx)
        sse = sum((l - (e + a * math.exp(slope * x))) ** 2 for x, (_, l) in zip(xs, pts))
        if best is None or sse < best[0]:
            best = (sse, e, a, -slope)
    sse, e, a, alpha = best
    return {"E": e, "A": a, "alpha": alpha, "rms": math.sqrt(sse / len(pts))}


def _percentile(vals: list[float], q: float) -> float:
    vals = sorted(vals)
    k = (len(vals) - 1) * q
    f, c = math.floor(k), math.ceil(k)
    return vals[f] + (vals[c] - vals[f]) * (k - f)


def fit_with_interval(compute: dict[str, float], per_seed: dict[str, dict[int, float]], n_boot: int = N_BOOT,
                      seed: int = 0) -> dict:
    """The fit of the seed-mean loss per size ({size: C}, {size: {seed: loss}}) and a 95 % bootstrap interval of
    alpha (seeds resampled with replacement within each size); alpha_ci None with one seed per size."""
    sizes = [s for s in compute if per_seed.get(s)]
    mean = lambda d: statistics.fmean(d.values())
    fit = fit_power_law([compute[s] for s in sizes], [mean(per_seed[s]) for s in sizes])
    rng = random.Random(seed)
    alphas = []
    if all(len(per_seed[s]) > 1 for s in sizes):
        for _ in range(n_boot):
            ls = [statistics.fmean(rng.choices(list(per_seed[s].values()), k=len(per_seed[s]))) for s in sizes]
            alphas.append(fit_power_law([compute[s] for s in sizes], ls, grid=100)["alpha"])
    fit["alpha_ci"] = ([_percentile(alphas, (1 - LEVEL) / 2), _percentile(alphas, (1 + LEVEL) / 2)]
                       if alphas else None)
    return fit


# ---------------------------------------------------------------- the trend of Δ with compute

def _slope(points: list[tuple[float, float]]) -> float:
    mx = statistics.fmean(x for x, _ in points)
    my = statistics.fmean(y for _, y in points)
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / sxx


def delta_trend(compute: dict[str, float], diffs: dict[str, dict[int, float]]) -> dict:
    """The change of Δ across the ladder: per seed, the least-squares slope of its differences ({size: {seed: Δ}})
    against log2 C times log2(C_max / C_min); the mean over the seeds present at every size, with a 95 % t interval
    (n - 1 degrees of freedom: an honest width at 2-3 seeds, where a bootstrap has few distinct resamples), and the
    trend verdict."""
    sizes = [s for s in compute if diffs.get(s)]
    seeds = sorted(set.intersection(*(set(diffs[s]) for s in sizes))) if sizes else []
    if len(sizes) < 2 or not seeds:
        return {"change": None, "ci_low": None, "ci_high": None, "per_seed": [], "verdict": INCONCLUSIVE}
    span = math.log2(max(compute[s] for s in sizes) / min(compute[s] for s in sizes))
    changes = [_slope([(math.log2(compute[s]), diffs[s][k]) for s in sizes]) * span for k in seeds]
    mean = statistics.fmean(changes)
    lo = hi = None
    if len(changes) > 1:
        half = t975(len(changes) - 1) * statistics.stdev(changes) / math.sqrt(len(changes))
        lo, hi = mean - half, mean + half
    return {"change": mean, "ci_low": lo, "ci_high": hi, "per_seed": changes, "log2_span": span,
            "verdict": judge_trend(mean, lo, hi)}


def judge_trend(change: float | None, low: float | None, high: float | None, delta: float = DELTA.value) -> str:
    """The trend rule of the module doc."""
    if change is None or low is None or high is None:
        return INCONCLUSIVE
    if high < 0 and change <= -delta:
        return IMPROVES
    if low > 0:
        return FADES
    if -delta < low and high < delta:
        return NO_CHANGE
    return INCONCLUSIVE


# ---------------------------------------------------------------- the LR basin

def lr_basin(losses: dict[float, float], margin: float = BASIN.value) -> dict:
    """{lr: loss} of one (variant, size) on its tuning seeds -> the best LR, its loss, the LRs within `margin` nats of
    it (`within`), the basin: the contiguous run of tried LRs around the best that stay within the margin (`low`,
    `high`, `contiguous`; an LR between them off by more is a hole, so it ends the run), its width in factors of 2,
    the LRs within the margin outside it (`holes` beyond a worse LR); `at_edge`: the best LR is the smallest or largest
    one tried. A diverged LR (non-finite loss) ends the basin."""
    ok = {lr: l for lr, l in losses.items() if l is not None and math.isfinite(l)}
    if not ok:
        return {"best_lr": None, "best_loss": None, "within": [], "low": None, "high": None, "octaves": None,
                "at_edge": None}
    best = min(ok, key=ok.get)
    within = sorted(lr for lr, l in ok.items() if l <= ok[best] + margin)
    lrs = sorted(losses)
    i = j = lrs.index(best)  # the basin: the contiguous run of tried LRs around the best, all within the margin
    while i > 0 and lrs[i - 1] in ok and ok[lrs[i - 1]] <= ok[best] + margin:
        i -= 1
    while j < len(lrs) - 1 and lrs[j + 1] in ok and ok[lrs[j + 1]] <= ok[best] + margin:
        j += 1
    return {"best_lr": best, "best_loss": ok[best], "within": within, "low": lrs[i], "high": lrs[j],
            "octaves": math.log2(lrs[j] / lrs[i]), "contiguous": lrs[i:j + 1],
            "holes": [lr for lr in within if not lrs[i] <= lr <= lrs[j]], "at_edge": best in (lrs[0], lrs[-1])}


def extend_grid(lrs: list[float], best: float, factor: float = 2.0) -> float | None:
    """The next LR to try when the best of a sweep is at an edge of the LRs tried (factor beyond it), else None."""
    lrs = sorted(lrs)
    if best == lrs[0]:
        return lrs[0] / factor
    if best == lrs[-1]:
        return lrs[-1] * factor
    return None
