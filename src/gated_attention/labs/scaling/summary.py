"""lab.json's measured figures for `gattn lab scaling`, from the tuning and confirm runs (pure: no training here).

Which runs feed which figure: the tuning runs give `best_lr`, `lr_basin` and the design's thresholds and nothing else;
every verdict figure (`deltas`, `multiplier`, `trend`/`trends`, `fits`, `verdict`) uses confirm seeds only. A confirm
run that failed (a non-finite validation loss, or the trainer's divergence flag) counts as its arm's failure: it is
listed in `failures` and enters Δ at ln(vocabulary), the loss of a model that predicts nothing, never dropped (a
dropped failure would favour the arm that failed).

Intervals: Δ at one size is a paired Student-t interval over that size's pairs (n - 1 df: the spread differs between
sizes, so it is not pooled); ln k is a bootstrap over confirm seeds within sizes, pairs kept together; the trend is one
weighted least squares over every pair of every size, its residual variance pooled across sizes (N - 2 df).
"""
from __future__ import annotations

import math
from pathlib import Path

from ...gates import canonical_name
from . import design as D
from . import verdict as V


def unit_name(variant: str, size: str, lr: float, seed: int, recipe: str = "current") -> str:
    """A unit's folder under OUT/runs: `_r-<recipe>` marks a recipe other than the base one (recipe_pilot.py)."""
    return f"{variant}_{size}_lr{lr:g}_s{seed}" + ("" if recipe == "current" else f"_r-{recipe}")


def tuned_losses(results: dict[tuple, dict], v: str, s: str, seeds) -> dict[float, float]:
    """{lr: mean val loss over the tuning seeds} of one (variant, size); a failed run's loss is infinite, so an LR
    where any tuning seed failed is never the best."""
    by_lr: dict[float, list[float]] = {}
    for (pv, ps, lr, k), r in results.items():
        if (pv, ps) == (v, s) and k in seeds:
            loss = r.get("val_loss")
            by_lr.setdefault(lr, []).append(loss if loss is not None and math.isfinite(loss) else math.inf)
    return {lr: sum(x) / len(x) for lr, x in by_lr.items()}


def failed(r: dict) -> bool:
    loss = r.get("val_loss")
    return loss is None or not math.isfinite(loss) or bool(r.get("diverged"))


def bits_per_byte(r: dict, bpt: dict[str, float], vocab: int) -> float | None:
    """The run's loss in bits per byte: the mean over domains of loss_d / (ln 2 x bytes per token_d) (a failed run at
    ln(vocab) in every domain)."""
    per = r.get("val_loss_per_domain") or {}
    doms = [d for d in per if bpt.get(d)] if not failed(r) else [d for d in bpt if bpt.get(d)]
    if not doms:
        return None
    loss = (lambda d: per[d]) if not failed(r) else (lambda d: math.log(vocab))
    return sum(loss(d) / (math.log(2) * bpt[d]) for d in doms) / len(doms)


def summarize(lab, sizes: list[dict], tuning: dict, confirm: dict, best: dict, lr_for: dict, base: str, design: dict,
              bpt: dict[str, float], vocab: int) -> dict:
    """lab.json's measured part (the contract's keys)."""
    names = [i["name"] for i in sizes]
    compute = {i["name"]: i["flops"] for i in sizes}
    imputed = math.log(vocab)
    runs = []
    for role, res in (("tuning", tuning), ("confirm", confirm)):
        for (v, s, lr, k), r in sorted(res.items(), key=lambda x: (x[0][1], x[0][0], x[0][2], x[0][3])):
            runs.append({"variant": v, "size": s, "lr": lr, "seed": k, "role": role, "tokens": r.get("tokens"),
                         "val_loss": r.get("val_loss"), "val_loss_per_domain": r.get("val_loss_per_domain"),
                         "bits_per_byte": bits_per_byte(r, bpt, vocab), "heldout_loss": r.get("heldout_loss"),
                         "diverged": r.get("diverged"), "failed": failed(r), "spikes": r.get("spikes"),
                         "cpu_s": r.get("cpu_s"), "curve": r.get("curve"),
                         "model_dir": str(Path("runs") / unit_name(v, s, lr, k, lab.recipe_name()) / "final")})
    conf = [r for r in runs if r["role"] == "confirm"]
    failures = [{k: r[k] for k in ("variant", "size", "lr", "seed", "val_loss", "diverged")} | {"counted_as": imputed}
                for r in conf if r["failed"]]
    eff = lambda r: imputed if r["failed"] else r["val_loss"]  # noqa: E731
    at = {v: {s: {r["seed"]: eff(r) for r in conf if r["variant"] == v and r["size"] == s
                  and r["lr"] == lr_for[v][s]} for s in names} for v in lab.variants}
    bpb = {v: {s: {r["seed"]: r["bits_per_byte"] for r in conf if r["variant"] == v and r["size"] == s
                   and r["lr"] == lr_for[v][s] and r["bits_per_byte"] is not None} for s in names}
           for v in lab.variants}
    gated = [v for v in lab.variants if v != base]
    try:
        mult = D.multiplier_fit(compute, at, base)
    except ValueError as exc:
        mult = {"error": str(exc), "overall": {}, "per_size": {}, "slope": {}, "fit": None}
    deltas, multiplier, trend, trends, curves = [], [], {}, {}, {}
    for v in gated:
        pts_d, pts_k = [], []
        for s in names:
            d = V.paired_delta(at[v][s], at[base][s])
            b = V.paired_delta(bpb[v][s], bpb[base][s])
            thr = design["target_se"][s] * D.POWER_FACTOR
            k = mult["per_size"].get(v, {}).get(s, {})
            row = {"variant": v, "size": s, "mean": d["mean"], "ci_low": d["ci_low"], "ci_high": d["ci_high"],
                   "n_seeds": d["n_seeds"], "std": d["std"], "per_seed": d["per_seed"],
                   "seeds": sorted(set(at[v][s]) & set(at[base][s])), "lr": {v: lr_for[v][s], base: lr_for[base][s]},
                   "verdict": V.judge(d["mean"], d["ci_low"], d["ci_high"]),
                   "seeds_needed": V.seeds_needed(d["mean"], d["std"]),
                   "pairs_needed": D.pairs_needed(d["mean"], d["std"], d["n_seeds"], thr),
                   "bits_per_byte": {"mean": b["mean"], "ci_low": b["ci_low"], "ci_high": b["ci_high"]},
                   "ln_k": k.get("ln_k"), "ln_k_ci": [k.get("ci_low"), k.get("ci_high")],
                   "multiplier_verdict": V.judge_multiplier(k.get("ln_k"), k.get("ci_low"), k.get("ci_high"))}
            deltas.append(row)
            multiplier.append({"variant": v, "size": s, "ln_k": k.get("ln_k"), "ci_low": k.get("ci_low"),
                               "ci_high": k.get("ci_high"), "verdict": row["multiplier_verdict"]})
            sd = (design.get("per_size", {}).get(s) or {}).get("sd_pair") or d["std"]
            w = 1.0 / sd ** 2 if sd else 0.0
            slope = mult["slope"].get(s)
            for k_seed in row["seeds"]:
                diff = at[v][s][k_seed] - at[base][s][k_seed]
                pts_d.append((math.log(compute[s]), diff, w))
                if slope:
                    pts_k.append((math.log(compute[s]), -diff / slope, w * slope ** 2))
            curves.setdefault(v, {})[s] = delta_curve(conf, v, base, s, lr_for)
        o = mult["overall"].get(v, {})
        multiplier.append({"variant": v, "size": "all", "ln_k": o.get("ln_k"), "ci_low": o.get("ci_low"),
                           "ci_high": o.get("ci_high"),
                           "verdict": V.judge_multiplier(o.get("ln_k"), o.get("ci_low"), o.get("ci_high"))})
        wd, wk = D.wls_trend(pts_d), D.wls_trend(pts_k)
        method = ("weighted least squares of every confirm pair's Δ on ln C (weights 1 / the size's registered pair "
                  "variance), Student-t on N - 2 df")
        trend[v] = {"slope": wd["slope"], "ci_low": wd["ci_low"], "ci_high": wd["ci_high"], "n": wd["n"],
                    "method": method, "ln_k": {"slope": wk["slope"], "ci_low": wk["ci_low"], "ci_high": wk["ci_high"]}}
        span = math.log(max(compute.values()) / min(compute.values()))
        ch = {k2: (wd[k1] * span if wd[k1] is not None else None)
              for k1, k2 in (("slope", "change"), ("ci_low", "ci_low"), ("ci_high", "ci_high"))}
        trends[v] = {**ch, "ln_span": span, "method": method,
                     "verdict": V.judge_trend(ch["change"], ch["ci_low"], ch["ci_high"])}
    fits = {}
    for v in lab.variants:
        try:
            fits[v] = V.fit_with_interval(compute, at[v])
        except ValueError as exc:
            fits[v] = {"E": None, "A": None, "alpha": None, "alpha_ci": None, "error": str(exc)}
    basins = {v: {s: V.lr_basin(tuned_losses(tuning, v, s, lab.tuning_seeds)) for s in names} for v in best}
    bias = []
    for v in best:
        for s in names:
            tuned = tuned_losses(tuning, v, s, lab.tuning_seeds).get(best[v][s])
            there = [eff(r) for r in conf if r["variant"] == v and r["size"] == s and r["lr"] == best[v][s]]
            bias.append({"variant": v, "size": s, "lr": best[v][s],
                         "value": tuned - sum(there) / len(there) if there and tuned is not None else None})
    heldout = {v: {s: _mean([r["heldout_loss"] for r in conf if r["variant"] == v and r["size"] == s
                             and r["lr"] == lr_for[v][s]]) for s in names} for v in lab.variants}
    top = names[-1]
    per_variant = {}
    for v in gated:
        d = next(x for x in deltas if x["variant"] == v and x["size"] == top)
        o = next(x for x in multiplier if x["variant"] == v and x["size"] == "all")
        per_variant[v] = {"size": top, "delta": d["mean"], "ci": [d["ci_low"], d["ci_high"]], "gain": d["verdict"],
                          "seeds_needed": d["seeds_needed"] if d["verdict"] == V.INCONCLUSIVE else None,
                          "bits_per_byte": d["bits_per_byte"], "ln_k": o["ln_k"], "ln_k_ci": [o["ci_low"], o["ci_high"]],
                          "multiplier": o["verdict"], "trend": trends[v]["verdict"],
                          "change_across_ladder": trends[v]["change"],
                          "undecided_by_budget": _undecided(o["verdict"], deltas, v, design)}
    confirm_seeds = sorted({r["seed"] for r in conf})
    return {"budget": lab.budget, "protocol": lab.protocol,
            "seeds": {"tuning": list(lab.tuning_seeds), "confirm": confirm_seeds},
            "thresholds": {k: [t.to_dict() for t in ts] for k, ts in V.THRESHOLDS.items()},
            "design": design, "sizes": sizes, "runs": runs, "failures": failures, "best_lr": best,
            "lr_basin": basins, "selection_bias": bias, "deltas": deltas, "multiplier": multiplier,
            "multiplier_fit": {k: mult.get(k) for k in ("fit", "slope", "n_boot", "E_at_bound_share", "error")},
            "fits": fits, "trend": trend, "trends": trends, "delta_curves": curves, "heldout_at_best": heldout,
            "bytes_per_token": bpt,
            "intervals": __doc__.split("Intervals: ", 1)[1].strip().replace("\n", " "),
            "verdict": {"rule": "ln k overall (the joint fit, confirm seeds) against the paper's k = 1.14-1.22; Δ at the "
                                "largest size against δ = 0.0128 nats beside it; trend: Δ's change across the ladder "
                                "(weighted least squares) against δ (verdict.py)",
                        "per_variant": per_variant, "text": verdict_text(per_variant)},
            "cpu_s_runs": sum(r.get("cpu_s") or 0.0 for r in runs)}


def _undecided(verdict: str, deltas: list[dict], v: str, design: dict) -> str | None:
    """What the budget could not decide: with an inconclusive multiplier, the sizes whose planned pairs hit the cap
    and the pairs their measured spread would need (80 % power)."""
    if verdict != V.INCONCLUSIVE:
        return None
    capped = [s for s, row in (design.get("per_size") or {}).items() if row.get("capped")]
    need = {d["size"]: (d.get("pairs_needed") or {}).get("n") for d in deltas if d["variant"] == v}
    parts = [f"{s} needs ~{need[s]} pairs" for s in need if need[s] and need[s] > (design["n_planned"].get(s) or 0)]
    head = f"capped at {design['n_cap']} pairs at {', '.join(capped)}" if capped else "not capped"
    return f"{head}; {'; '.join(parts) or 'the spread measured decides no size'}"


def _mean(vals):
    vals = [x for x in vals if x is not None and math.isfinite(x)]
    return sum(vals) / len(vals) if vals else None


def delta_curve(runs: list[dict], variant: str, base: str, size: str, lr_for: dict) -> dict:
    """Δ of the training-loss curve (gated - baseline, each at its protocol LR) against tokens, mean and range over the
    confirm seeds both have: where an early gain fades."""
    def curves(v):
        return {r["seed"]: r["curve"] for r in runs if r["variant"] == v and r["size"] == size
                and r["lr"] == lr_for[v][size] and r.get("curve") and r["curve"].get("loss")}
    g, b = curves(variant), curves(base)
    seeds = sorted(set(g) & set(b))
    if not seeds:
        return {"tokens": [], "mean": [], "low": [], "high": []}
    n = min(min(len(g[s]["loss"]), len(b[s]["loss"])) for s in seeds)
    diffs = [[g[s]["loss"][i] - b[s]["loss"][i] for s in seeds] for i in range(n)]
    return {"tokens": g[seeds[0]]["tokens"][:n], "mean": [sum(d) / len(d) for d in diffs],
            "low": [min(d) for d in diffs], "high": [max(d) for d in diffs], "seeds": len(seeds)}


def _fmt(x, digits=4):
    return "-" if x is None else f"{x:+.{digits}f}"


def verdict_text(per_variant: dict) -> str:
    parts = []
    for v, x in per_variant.items():
        k = x["ln_k_ci"]
        kci = f" [{_fmt(k[0], 3)}, {_fmt(k[1], 3)}]" if k[0] is not None else ""
        ci = x["ci"]
        iv = f" [{ci[0]:+.4f}, {ci[1]:+.4f}]" if ci[0] is not None else ""
        bpb = x["bits_per_byte"]["mean"]
        more = f" ({x['undecided_by_budget']})" if x.get("undecided_by_budget") else ""
        parts.append(f"{canonical_name(v)}: ln k {_fmt(x['ln_k'], 3)}{kci} — {x['multiplier']}{more}; at {x['size']} Δ "
                     f"{_fmt(x['delta'])}{iv} nats ({_fmt(bpb)} bits/byte) — {x['gain']}; across the ladder: "
                     f"{x['trend']}")
    return "; ".join(parts)
