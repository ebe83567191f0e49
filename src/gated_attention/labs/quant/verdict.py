"""The quantization lab's rule: "gated models quantize like the baseline under policy P", and which policy to use.

Δ = val loss of a quantized model - val loss of the same model unquantized (nats, mean over the corpus domains). The
margin δ = ln(7.499 / 7.404) = 0.01275 nats is the paper's own dense gain at equal parameters (the paper's Table 1-2;
the scaling lab's δ): a quantization that costs a gated model δ more than it costs the baseline takes away everything
the gate gained. Every interval is two-sided 95 % Student-t, judged the same way (`judge`):

    like                   the interval inside (-δ, +δ)
    more (sensitive)       lower end > 0 (and not inside ±δ)
    less (sensitive)       upper end < 0 (and not inside ±δ)
    inconclusive           otherwise, or fewer than MIN_SEEDS models in an arm

1. Gated vs baseline, per family (models.py), scheme s, policy P and gated arm g (a G1 variant; a retrofit recipe with a
   gate): D = mean Δ_g - mean Δ_baseline. The two arms are different models (gated seed k and baseline seed k share
   only a seed number, or at most a starting checkpoint), so nothing pairs them: Welch's interval (unequal variances,
   Welch-Satterthwaite df; experiment.stats.welch). The claim holds under P for a family when every (arm, scheme) is
   like the baseline or less sensitive; it fails when any is more sensitive; else it is inconclusive.

2. Policy vs policy, per family, gated arm, scheme and pair of policies (Q cheaper than P in POLICY_COST's order):
   D = Δ(Q) - Δ(P) of the SAME trained model quantized both ways, paired by model (the scaling lab's `paired_delta`).
   Q is preferred over P when every (arm, scheme) D is like or less (Q costs no more than δ over P); P over Q when any
   D is more (Q measurably costs more); otherwise the pair is undecided.

3. Recommended policy for gated models (per family): the policy P under which the claim holds and which the paired
   D prefers over every other measured policy (over each cheaper one because that one costs more, over each dearer
   one because it buys nothing of δ's size). There is at most one such P. When there is none — no policy holds, or
   the paired D cannot tell a holding policy from another — there is NO recommendation, and the verdict says what
   would decide it: the models per arm the measured spread needs (`models_needed`), or the comparison that is
   missing.

POLICY_COST: all (nothing kept apart) < split-gate (the gate's own scales, a few bytes per row) < keep-gate (the
gate's projection in high precision, its weights at full size).
"""
from __future__ import annotations

import math

from ...experiment.stats import t_quantile, welch
from ...experiment.verdicts import Threshold
from ..scaling.verdict import DELTA as _PAPER_DELTA
from ..scaling.verdict import paired_delta, seeds_needed

MARGIN = Threshold(
    "δ, the margin of 'like the baseline'", _PAPER_DELTA.value, "nats", "paper",
    "the paper's dense gain at equal parameters, the paper's Table 1-2 (1.7B, 400B tokens: PPL 7.499 -> 7.404): "
    "ln(7.499/7.404), the scaling lab's δ; a quantization costing a gated model that much more than the baseline "
    "takes away the whole gain")
THRESHOLDS = {"gated vs baseline Δ from quantization (Welch over models)": (MARGIN,),
              "policy vs policy Δ on the same models (paired by model)": (MARGIN,)}
MIN_SEEDS = 3  # models per arm: the "over >= 3 seeds of models"
LIKE, MORE, LESS, INCONCLUSIVE = "like the baseline", "more sensitive", "less sensitive", "inconclusive"
SAME, COSTS_MORE, COSTS_LESS = "within δ", "costs more", "costs less"  # a policy's Δ against another's
HOLDS, FAILS = "holds", "fails"
CHEAPER_PREFERRED, DEARER_PREFERRED, UNDECIDED = "cheaper preferred", "dearer preferred", "undecided"
POLICY_COST = ("all", "split-gate", "keep-gate")  # cheapest first
CAP = 1000  # models_needed above this: reported as CAP + 1


def judge(mean: float | None, low: float | None, high: float | None, n: int, margin: float = MARGIN.value,
          labels: tuple[str, str, str] = (LIKE, MORE, LESS)) -> str:
    """The rule of the module docstring on one interval over n models per arm; labels: (like, more, less)."""
    like, more, less = labels
    if mean is None or low is None or high is None or n < MIN_SEEDS:
        return INCONCLUSIVE
    if -margin < low and high < margin:
        return like
    if low > 0:
        return more
    if high < 0:
        return less
    return INCONCLUSIVE


def welch_models_needed(mean: float | None, std_a: float | None, std_b: float | None,
                        margin: float = MARGIN.value) -> int | None:
    """Models per arm (the same number in both) at which a Welch interval of these spreads would decide: its
    half-width below |mean| (to exclude 0) when |mean| >= δ, else below δ - |mean| (to fit inside ±δ). None without a
    spread; CAP + 1 when more than CAP."""
    if mean is None or std_a is None or std_b is None:
        return None
    target = abs(mean) if abs(mean) >= margin else margin - abs(mean)
    va, vb = std_a ** 2, std_b ** 2
    if va + vb == 0:
        return MIN_SEEDS
    for n in range(MIN_SEEDS, CAP + 1):
        df = (n - 1) * (va + vb) ** 2 / (va * va + vb * vb)  # Welch-Satterthwaite at n per arm
        if t_quantile(0.975, df) * math.sqrt((va + vb) / n) < target:
            return n
    return CAP + 1


def _by_arm(rows: list[dict]) -> dict[tuple, dict[str, float]]:
    """{(family, arm, scheme, policy): {seed: Δ}} over the rows with a finite Δ."""
    out: dict[tuple, dict[str, float]] = {}
    for r in rows:
        if r.get("delta_nats") is not None and math.isfinite(r["delta_nats"]):
            out.setdefault((r["family"], r["arm"], r["scheme"], r["policy"]), {})[r["seed"]] = r["delta_nats"]
    return out


def _gated_arms(rows: list[dict]) -> list[tuple[str, str]]:
    return sorted({(r["family"], r["arm"]) for r in rows if not r["baseline"] and r["variant"] != "none"})


def comparisons(rows: list[dict]) -> list[dict]:
    """Gated vs baseline (part 1), one entry per (family, gated arm, scheme, policy): D's mean, Welch interval, the
    two arms' Δ per model, the judgement and the models per arm its spread needs. rows: lab.json's `results` (keys
    model, family, arm, variant, baseline, seed, scheme, policy, delta_nats). `per_seed` lists Δ_g - Δ_baseline of
    equal seed labels for reading only: those models are not pairs, and the interval does not use them."""
    out = []
    groups = _by_arm(rows)
    base = {(r["family"], r["arm"]) for r in rows if r["baseline"]}
    for fam, arm in _gated_arms(rows):
        b_arm = next((a for f, a in sorted(base) if f == fam), None)
        if b_arm is None:
            continue
        for (f, a, scheme, policy), g in sorted(groups.items()):
            if (f, a) != (fam, arm):
                continue
            b = groups.get((fam, b_arm, scheme, policy), {})
            w = welch(g.values(), b.values())
            n = min(w["n_a"], w["n_b"])
            verdict = judge(w["mean"], w["ci_low"], w["ci_high"], n)
            out.append({"family": fam, "arm": arm, "baseline_arm": b_arm, "scheme": scheme, "policy": policy,
                        "mean": w["mean"], "ci_low": w["ci_low"], "ci_high": w["ci_high"], "n_seeds": n,
                        "per_seed": [g[s] - b[s] for s in sorted(set(g) & set(b))],
                        "interval": "welch", "df": w["df"], "n_gated": w["n_a"], "n_baseline": w["n_b"],
                        "gated_deltas": dict(sorted(g.items())), "baseline_deltas": dict(sorted(b.items())),
                        "verdict": verdict,
                        "models_needed": None if verdict != INCONCLUSIVE else
                        welch_models_needed(w["mean"], w["std_a"], w["std_b"])})
    return out


def policy_comparisons(rows: list[dict]) -> list[dict]:
    """Policy vs policy (part 2), one entry per (family, gated arm, scheme, cheaper policy, dearer policy): D =
    Δ(policy) - Δ(against) over the models measured under both, paired by model, with its t interval, judgement and
    the models its spread needs."""
    groups = _by_arm(rows)
    out = []
    for fam, arm in _gated_arms(rows):
        for scheme in sorted({k[2] for k in groups if k[:2] == (fam, arm)}):
            pols = sorted((k[3] for k in groups if k[:3] == (fam, arm, scheme)), key=_cost)
            for i, q in enumerate(pols):
                for p in pols[i + 1:]:
                    d = paired_delta(groups[(fam, arm, scheme, q)], groups[(fam, arm, scheme, p)])
                    seeds = sorted(set(groups[(fam, arm, scheme, q)]) & set(groups[(fam, arm, scheme, p)]))
                    verdict = judge(d["mean"], d["ci_low"], d["ci_high"], d["n_seeds"],
                                    labels=(SAME, COSTS_MORE, COSTS_LESS))
                    need = (seeds_needed(d["mean"], d["std"], MARGIN.value, CAP) if verdict == INCONCLUSIVE
                            else None)
                    out.append({"family": fam, "arm": arm, "scheme": scheme, "policy": q, "against": p,
                                "mean": d["mean"], "ci_low": d["ci_low"], "ci_high": d["ci_high"],
                                "n_models": d["n_seeds"], "per_model": dict(zip(seeds, d["per_seed"])),
                                "interval": "paired", "verdict": verdict,
                                "models_needed": None if need is None else max(need, MIN_SEEDS)})
    return out


def _need(cs: list[dict], key: str = "models_needed") -> str:
    """'~N models per arm' over the inconclusive entries of cs (the largest need), or the fewer-than-3 case."""
    short = [c for c in cs if c.get("n_seeds", c.get("n_models", 0)) < MIN_SEEDS]
    needs = [c[key] for c in cs if c.get(key) is not None]
    if short or not needs:
        return f"at least {MIN_SEEDS} models per arm (the rule's minimum)"
    n = max(needs)
    return f"more than {CAP} models per arm" if n > CAP else f"about {n} models per arm at the measured spread"


def _pair_summary(fam: str, pcs: list[dict], policies: list[str]) -> dict:
    """{"Q vs P": {"policy", "against", "verdict", "within_or_less", "costs_more", "inconclusive", "pairs",
    "to_decide"}} per pair of the family's policies, Q the cheaper."""
    out = {}
    for i, q in enumerate(policies):
        for p in policies[i + 1:]:
            cs = [c for c in pcs if c["family"] == fam and (c["policy"], c["against"]) == (q, p)]
            more = sum(c["verdict"] == COSTS_MORE for c in cs)
            ok = sum(c["verdict"] in (SAME, COSTS_LESS) for c in cs)
            verdict = (DEARER_PREFERRED if more else CHEAPER_PREFERRED if cs and ok == len(cs) else UNDECIDED)
            out[f"{q} vs {p}"] = {"policy": q, "against": p, "verdict": verdict, "within_or_less": ok,
                                  "costs_more": more, "inconclusive": len(cs) - ok - more, "pairs": len(cs),
                                  "to_decide": None if verdict != UNDECIDED else
                                  ("no gated model measured under both" if not cs else
                                   _need([c for c in cs if c["verdict"] == INCONCLUSIVE]))}
    return out


def _preferred(pairs: dict, p: str, other: str) -> bool | None:
    """Does the paired D prefer p over other (True), other over p (False), or neither (None)?"""
    x = pairs.get(f"{p} vs {other}") or pairs.get(f"{other} vs {p}")
    if x["verdict"] == UNDECIDED:
        return None
    cheaper_wins = x["verdict"] == CHEAPER_PREFERRED
    return cheaper_wins == (x["policy"] == p)


def policy_verdicts(comps: list[dict], pcomps: list[dict]) -> dict:
    """{family: {"per_policy": {policy: {"verdict", "like_or_less", "more", "inconclusive", "pairs",
    "to_decide"}}, "policy_pairs": _pair_summary, "recommended": policy or None, "why", "to_decide": [...]}} from
    `comparisons` and `policy_comparisons` (part 3 of the module docstring)."""
    out = {}
    for fam in sorted({c["family"] for c in comps}):
        per = {}
        for policy in sorted({c["policy"] for c in comps if c["family"] == fam}, key=_cost):
            cs = [c for c in comps if c["family"] == fam and c["policy"] == policy]
            ok = sum(c["verdict"] in (LIKE, LESS) for c in cs)
            more = sum(c["verdict"] == MORE for c in cs)
            verdict = FAILS if more else HOLDS if ok == len(cs) else INCONCLUSIVE
            per[policy] = {"verdict": verdict, "like_or_less": ok, "more": more,
                           "inconclusive": len(cs) - ok - more, "pairs": len(cs),
                           "to_decide": None if verdict != INCONCLUSIVE else
                           _need([c for c in cs if c["verdict"] == INCONCLUSIVE])}
        pols = list(per)
        pairs = _pair_summary(fam, pcomps, pols)
        rec, why, todo = None, "", []
        for p in pols:
            if per[p]["verdict"] != HOLDS:
                continue
            prefs = {q: _preferred(pairs, p, q) for q in pols if q != p}
            if all(prefs.values()):
                rec = p
                why = ("the claim holds under it" + ("; the only policy measured" if not prefs else ", and on the same "
                       "models the paired difference prefers it over " + ", ".join(prefs)))
                break
            for q, v in prefs.items():
                x = pairs.get(f"{p} vs {q}") or pairs[f"{q} vs {p}"]
                if v is None:
                    todo.append(f"{p} holds, but on the same models {p} vs {q} is undecided: {x['to_decide']}")
                elif v is False:
                    how = ("is within δ of it on the same models (and cheaper)" if _cost(q) < _cost(p) else
                           "costs measurably less on the same models")
                    todo.append(f"{p} holds, but {q} {how}, while {q}'s own comparison with the baseline is "
                                f"{per[q]['verdict']}" + (f": {per[q]['to_decide']}" if per[q]["to_decide"] else ""))
        if rec is not None:
            todo = []
        elif not any(x["verdict"] == HOLDS for x in per.values()):
            why = "no policy holds: " + ", ".join(f"{p} {x['verdict']}" for p, x in per.items())
            todo = [f"{p}: {x['inconclusive']} of {x['pairs']} (arm, scheme) comparisons with the baseline "
                    f"inconclusive; {x['to_decide']}" for p, x in per.items() if x["verdict"] == INCONCLUSIVE]
            todo += [f"{p}: fails ({x['more']} more sensitive)" for p, x in per.items() if x["verdict"] == FAILS]
        else:
            why = "the policies that hold are not told apart from the others on the same models"
        out[fam] = {"per_policy": per, "policy_pairs": pairs, "recommended": rec, "why": why, "to_decide": todo}
    return out


def _cost(policy: str) -> int:
    return POLICY_COST.index(policy) if policy in POLICY_COST else len(POLICY_COST)


def verdict_text(pv: dict) -> str:
    parts = []
    for fam, v in pv.items():
        pols = ", ".join(f"{p}: {x['verdict']} ({x['like_or_less']}/{x['pairs']} like or better, {x['more']} worse)"
                         for p, x in v["per_policy"].items())
        rec = (f"recommended for gated models: {v['recommended']} ({v['why']})" if v["recommended"] else
               f"no recommendation ({v['why']}); to decide: " + "; ".join(v["to_decide"]))
        parts.append(f"{fam} — {pols}; {rec}")
    return "; ".join(parts) if parts else "no family with a baseline and a gated arm measured"
