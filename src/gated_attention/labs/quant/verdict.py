"""The quantization lab's rule, fixed before its first run (issue 39) and never fitted to this project's runs:
"gated models quantize like the baseline under policy P".

Per family of models (models.py), scheme s, policy P and gated arm g (a G1 variant; a retrofit recipe with a gate):

  D = Δ_g - Δ_baseline, where Δ = val loss of the quantized model - val loss of the same model unquantized (nats,
  mean over the corpus domains), paired by seed: the mean over seeds of the per-seed differences, with a two-sided
  95 % Student-t interval (n - 1 degrees of freedom; the scaling lab's `paired_delta`). With the margin
  δ = ln(7.499 / 7.404) = 0.01275 nats — the paper's own dense gain at equal parameters (SPEC §3.2, Table 1-2; the
  scaling lab's δ): a quantization that costs a gated model δ more than it costs the baseline takes away everything
  the gate gained —

    like the baseline      the interval inside (-δ, +δ)
    more sensitive         lower end > 0 (and not inside ±δ)
    less sensitive         upper end < 0 (and not inside ±δ)
    inconclusive           otherwise, or fewer than MIN_SEEDS paired seeds

  Under policy P the claim holds for a family when every (gated arm, scheme) measured is "like the baseline" or "less
  sensitive"; it fails when any is "more sensitive"; else it is inconclusive.

  Recommended policy for gated models (per family): the first of POLICY_COST's order (all: nothing kept apart;
  split-gate: the gate's own scales, a few bytes per row; keep-gate: the gate's projection in high precision, its
  weights at full size) under which the claim holds; when none holds, the policy with the most (arm, scheme) pairs
  "like" or "less sensitive" and, on a tie, the fewest "more sensitive", then the cheaper one.
"""
from __future__ import annotations

from ...experiment.verdicts import Threshold
from ..scaling.verdict import DELTA as _PAPER_DELTA
from ..scaling.verdict import paired_delta

MARGIN = Threshold(
    "δ, the margin of 'like the baseline'", _PAPER_DELTA.value, "nats", "paper",
    "the paper's dense gain at equal parameters, SPEC §3.2 / Table 1-2 (1.7B, 400B tokens: PPL 7.499 -> 7.404): "
    "ln(7.499/7.404), the scaling lab's δ; a quantization costing a gated model that much more than the baseline "
    "takes away the whole gain")
THRESHOLDS = {"gated vs baseline Δ from quantization (paired over seeds)": (MARGIN,)}
MIN_SEEDS = 3  # the "over >= 3 seeds of models"
LIKE, MORE, LESS, INCONCLUSIVE = "like the baseline", "more sensitive", "less sensitive", "inconclusive"
HOLDS, FAILS = "holds", "fails"
POLICY_COST = ("all", "split-gate", "keep-gate")  # cheapest first (the recommendation's tie-break)


def judge(mean: float | None, low: float | None, high: float | None, n: int, margin: float = MARGIN.value) -> str:
    """The rule of the module docstring on one paired interval of n seeds."""
    if mean is None or low is None or high is None or n < MIN_SEEDS:
        return INCONCLUSIVE
    if -margin < low and high < margin:
        return LIKE
    if low > 0:
        return MORE
    if high < 0:
        return LESS
    return INCONCLUSIVE


def comparisons(rows: list[dict]) -> list[dict]:
    """One entry per (family, gated arm, scheme, policy): D's mean, interval, per-seed values and the judgement.
    rows: lab.json's `results` (keys model, family, arm, variant, baseline, seed, scheme, policy, delta_nats)."""
    out = []
    groups: dict[tuple, dict[str, float]] = {}
    for r in rows:
        if r.get("delta_nats") is None:
            continue
        groups.setdefault((r["family"], r["arm"], r["scheme"], r["policy"]), {})[r["seed"]] = r["delta_nats"]
    base = {(r["family"], r["arm"]) for r in rows if r["baseline"]}
    gated = sorted({(r["family"], r["arm"]) for r in rows if not r["baseline"] and r["variant"] != "none"})
    for fam, arm in gated:
        b_arm = next((a for f, a in sorted(base) if f == fam), None)
        if b_arm is None:
            continue
        for (f, a, scheme, policy), per_seed in sorted(groups.items()):
            if (f, a) != (fam, arm):
                continue
            d = paired_delta(per_seed, groups.get((fam, b_arm, scheme, policy), {}))
            out.append({"family": fam, "arm": arm, "baseline_arm": b_arm, "scheme": scheme, "policy": policy,
                        "mean": d["mean"], "ci_low": d["ci_low"], "ci_high": d["ci_high"], "n_seeds": d["n_seeds"],
                        "per_seed": d["per_seed"],
                        "verdict": judge(d["mean"], d["ci_low"], d["ci_high"], d["n_seeds"])})
    return out


def policy_verdicts(comps: list[dict]) -> dict:
    """{family: {"per_policy": {policy: {"verdict", "like", "more", "inconclusive", "pairs"}}, "recommended",
    "why"}} from `comparisons`."""
    out = {}
    for fam in sorted({c["family"] for c in comps}):
        per = {}
        for policy in sorted({c["policy"] for c in comps if c["family"] == fam}, key=_cost):
            cs = [c for c in comps if c["family"] == fam and c["policy"] == policy]
            ok = sum(c["verdict"] in (LIKE, LESS) for c in cs)
            more = sum(c["verdict"] == MORE for c in cs)
            verdict = FAILS if more else HOLDS if ok == len(cs) else INCONCLUSIVE
            per[policy] = {"verdict": verdict, "like_or_less": ok, "more": more,
                           "inconclusive": len(cs) - ok - more, "pairs": len(cs)}
        holding = [p for p in per if per[p]["verdict"] == HOLDS]
        if holding:
            rec, why = holding[0], "the cheapest policy under which the claim holds"
        else:
            rec = sorted(per, key=lambda p: (-per[p]["like_or_less"], per[p]["more"], _cost(p)))[0]
            why = "no policy holds everywhere: the most (arm, scheme) pairs like the baseline or better"
        out[fam] = {"per_policy": per, "recommended": rec, "why": why}
    return out


def _cost(policy: str) -> int:
    return POLICY_COST.index(policy) if policy in POLICY_COST else len(POLICY_COST)


def verdict_text(pv: dict) -> str:
    parts = []
    for fam, v in pv.items():
        pols = ", ".join(f"{p}: {x['verdict']} ({x['like_or_less']}/{x['pairs']} like or better, {x['more']} worse)"
                         for p, x in v["per_policy"].items())
        parts.append(f"{fam} — {pols}; recommended for gated models: {v['recommended']} ({v['why']})")
    return "; ".join(parts) if parts else "no family with a baseline and a gated arm measured"
