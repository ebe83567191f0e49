"""The stability lab's statistics over a grid of runs (pure functions on run dicts; no torch, no files).

A run dict has at least `lr`, `seed`, `final_loss` (None/NaN when the trainer gave up), `loss_at_init`, `diverged`;
`spikes` where spike statistics are asked for. One (variant, QK-norm) setting's runs form an LR curve per seed.

- `lr_sensitivity`: Wortsman et al. 2023's E_lr[min(loss(lr), loss at init)] - min_lr loss(lr), with loss(lr) the
  seed mean of the clipped final loss at that LR (a diverged run counts as the loss at init).
- `max_stable_lr`: the largest LR of the contiguous run of converged LRs that starts at the best LR; an LR converges
  when its seed-mean clipped loss is within `margin` nats of the best LR's and no run at it diverged.
- `bootstrap`: a percentile interval of any of these statistics, resampling whole seeds (a seed = one init and one
  data order, run at every LR) with replacement, so the interval carries the seed-to-seed noise of the whole curve.
  With 3 seeds there are only 10 distinct resamples: the interval is coarse, and two intervals that separate are
  strong evidence, two that overlap are not evidence of no effect.
"""
from __future__ import annotations

import math
import random
from typing import Callable

LEVEL = 0.95  # central probability of the bootstrap intervals (verdict.INTERVAL_LEVEL: its source)
N_BOOT = 2000  # bootstrap resamples (fixed RNG seed: the same runs give the same interval)


def clip(loss, init_loss: float) -> float:
    """min(loss, loss at init), with a missing or non-finite loss (a diverged run) counted as the loss at init."""
    if loss is None or not math.isfinite(loss):
        return init_loss
    return min(loss, init_loss)


def lr_curve(runs: list[dict]) -> dict[float, float]:
    """LR -> seed mean of the clipped final loss, in LR order."""
    by_lr: dict[float, list[float]] = {}
    for r in runs:
        by_lr.setdefault(float(r["lr"]), []).append(clip(r["final_loss"], r["loss_at_init"]))
    return {lr: sum(v) / len(v) for lr, v in sorted(by_lr.items())}


def lr_sensitivity(runs: list[dict]) -> float:
    """Wortsman's LR sensitivity of one setting (see module doc); NaN without runs."""
    per_lr = list(lr_curve(runs).values())
    if not per_lr:
        return math.nan
    return sum(per_lr) / len(per_lr) - min(per_lr)


def converged_lrs(runs: list[dict], margin: float) -> dict[float, bool]:
    """LR -> converged: seed-mean clipped loss <= best + margin and no run at that LR diverged."""
    curve = lr_curve(runs)
    if not curve:
        return {}
    best = min(curve.values())
    bad = {float(r["lr"]) for r in runs if r.get("diverged")}
    return {lr: (loss <= best + margin and lr not in bad) for lr, loss in curve.items()}


def max_stable_lr(runs: list[dict], margin: float) -> float:
    """The largest LR of the contiguous converged range that starts at the best LR (see module doc); NaN when the
    best LR itself has a diverged run (nothing converges)."""
    conv = converged_lrs(runs, margin)
    if not conv:
        return math.nan
    curve = lr_curve(runs)
    lrs = list(curve)
    i = min(range(len(lrs)), key=lambda j: curve[lrs[j]])
    if not conv[lrs[i]]:
        return math.nan
    while i + 1 < len(lrs) and conv[lrs[i + 1]]:
        i += 1
    return lrs[i]


def spikes_per_run(runs: list[dict]) -> float:
    """Mean loss-spike count per run."""
    vals = [int(r.get("spikes") or 0) for r in runs]
    return sum(vals) / len(vals) if vals else math.nan


def bootstrap(runs: list[dict], stat: Callable[[list[dict]], float], n: int = N_BOOT, level: float = LEVEL,
              seed: int = 0, log_scale: bool = False) -> list[float] | None:
    """[lo, hi]: the central `level` percentile interval of stat over resamples of whole seeds (see module doc).
    A resample that draws a seed twice counts its runs twice. log_scale: percentiles of log(stat) (for LRs on a
    log grid). Resamples where stat is non-finite are dropped; None when fewer than half remain or there is one seed
    only (one seed says nothing about the spread)."""
    seeds = sorted({r["seed"] for r in runs})
    if len(seeds) < 2:
        return None
    by_seed = {s: [r for r in runs if r["seed"] == s] for s in seeds}
    rng = random.Random(seed)
    vals = []
    for _ in range(n):
        draw = [r for s in (rng.choice(seeds) for _ in seeds) for r in by_seed[s]]
        v = stat(draw)
        if v is not None and math.isfinite(v):
            vals.append(math.log(v) if log_scale else v)
    if len(vals) < n / 2:
        return None
    vals.sort()
    a = (1 - level) / 2
    lo, hi = vals[int(a * (len(vals) - 1))], vals[int(math.ceil((1 - a) * (len(vals) - 1)))]
    return [math.exp(lo), math.exp(hi)] if log_scale else [lo, hi]


def separated(better: list[float] | None, worse: list[float] | None, lower_is_better: bool) -> bool:
    """True when interval `better` lies entirely on the good side of interval `worse` (no overlap, not touching)."""
    if not better or not worse:
        return False
    return better[1] < worse[0] if lower_is_better else better[0] > worse[1]


def mean_final_loss(runs: list[dict]) -> float:
    """Seed mean of the clipped final loss (a diverged run counts as the loss at init), over the runs given."""
    vals = [clip(r.get("final_loss"), r["loss_at_init"]) for r in runs]
    return sum(vals) / len(vals) if vals else math.nan


def seeds_to_separate(gated: float, gated_iv: list[float] | None, base: float, base_iv: list[float] | None,
                      seeds: int) -> int | None:
    """A power estimate from the measured spread: how many seeds per variant would make the two intervals separate
    (`separated`) if the observed difference were the true one. An interval's half-width shrinks as 1/sqrt(seeds),
    so intervals of half-widths h_g, h_b at n seeds separate at n' = n ((h_g + h_b) / |gated - base|)^2 seeds
    (rounded up; at least n + 1 when they overlap at n, n when they already separate). None when there is no
    difference or no interval (one seed) to scale from. A rough estimate: the observed difference is itself noisy,
    so about half of the labs run with n' seeds would separate."""
    if gated_iv is None or base_iv is None or seeds < 2:
        return None
    d = abs(gated - base)
    h = (gated_iv[1] - gated_iv[0]) / 2 + (base_iv[1] - base_iv[0]) / 2
    if not (math.isfinite(d) and math.isfinite(h)) or d == 0:
        return None
    if separated(gated_iv, base_iv, gated < base) or separated(base_iv, gated_iv, base < gated):
        return seeds
    return max(seeds + 1, math.ceil(seeds * (h / d) ** 2 - 1e-9))
