"""The streaming verdict: does a softmax baseline need its first tokens to stream while a G1 model does not
(StreamingLLM's pattern, Xiao et al. 2023, arXiv 2309.17453)? The rule `gattn lab streaming` prints for the models it
measured and `gattn compare`'s "Streams with a plain window" row shows (compare/claims.py imports it from here).

Figures, per model, on the positions past the window (streaming_lab.py), both settings scoring the same sequences:
  plain cost  Δ0 = loss with a plain sliding window (K = 0: the first token evicted) - loss with full attention
  sink cost   ΔK = the same with the first K tokens kept, K = the largest sink-token count measured (K >= 1)
The rule, with THRESHOLDS fixed before anything was measured (experiment/verdicts.py; none fitted to this project's
runs), words defined here once:
  noticeable  the baseline models' mean Δ0 is >= NOTICEABLE_NATS nats, or costs >= NOTICEABLE_PPL of perplexity
              (exp(Δ0) - 1; 5 % = 0.0488 nats): what a user would notice
  removes     keeping the first K tokens leaves a baseline model at most REMOVED_SHARE of its plain cost: ΔK <= Δ0 / 4
  consistent  model by model, not only on the mean: every baseline model (every seed) pays Δ0 >= FLOOR nats and
              keeping the first tokens removes it, and every G1 model (every seed, elementwise and headwise) pays
              Δ0 <= G1_SHARE of the smallest baseline model's Δ0
  reproduced        = consistent and noticeable
  partly            = consistent, not noticeable (the same pattern, smaller than a user would notice)
  not at this scale = anything else (no baseline cost, one that sink tokens do not remove, a G1 model that pays
                      more than a quarter of it), with the figures
  not run here      = no baseline or no G1 model, or no plain window (K = 0) or no K >= 1 measured
"""
from __future__ import annotations

import math

from ...experiment.verdicts import GATED, NOT_AT_SCALE, NOT_RUN, PARTLY, REPRODUCED, Threshold

NOTICEABLE_NATS = Threshold(
    "noticeable cost", 0.05, "nats", "chosen",
    "a plain-window cost a user would notice (StreamingLLM's window attention loses far more: its "
    "perplexity explodes once the first tokens leave the cache, Xiao et al. 2023 Fig. 3)")
NOTICEABLE_PPL = Threshold(
    "noticeable cost, or in perplexity", 0.05, "relative perplexity", "chosen",
    "5 % perplexity (exp(Δ) - 1), the same size said in perplexity (ln 1.05 = 0.0488 nats)")
REMOVED_SHARE = Threshold(
    "removes: baseline cost left with the first K tokens kept", 0.25, "of its plain-window cost", "published",
    "StreamingLLM (Xiao et al. 2023) Table 1 and Fig. 3: keeping the first four tokens brings window attention back "
    "to the dense model's perplexity; here at most a quarter of the cost may remain (the share G1_SHARE allows)")
G1_SHARE = Threshold(
    "sink-free: a G1 model's plain-window cost", 0.25, "of the baseline's", "chosen",
    "every G1 model pays at most a quarter of the baseline's cost (the paper's G1 models keep 10 % and "
    "16 % of the baseline's first-token attention, the paper's Table 4)")
FLOOR = Threshold(
    "consistent: each baseline model's cost at least", 0.005, "nats", "chosen",
    "a tenth of the noticeable cost; below it a model's cost counts as none")
THRESHOLDS = (NOTICEABLE_NATS, NOTICEABLE_PPL, REMOVED_SHARE, G1_SHARE, FLOOR)


def _variant(name: str) -> str:
    """The canonical gate name ("none" for baseline/none), or the name as it is (a baseline mechanism)."""
    from gated_attention.gates import canonical_name

    try:
        return canonical_name(name)
    except ValueError:
        return name


def model_costs(models: dict, kind: str | None = None) -> tuple[dict[str, list[dict]], int | None]:
    """({variant: [{"label", "plain": Δ0, "sinks": ΔK}, ...]}, K) from lab.json's `models` (or compare.json's
    streaming.models): every model of `kind` ("sink_lab" / "text"; None = all) that measured K = 0, with K the
    largest sink-token count > 0 measured by all of them (None and {} when there is none)."""
    ms = {n: m for n, m in models.items() if (kind is None or m.get("kind") == kind) and "0" in m.get("window", {})}
    ks = [{int(k) for k in m["window"]} for m in ms.values()]
    common = set.intersection(*ks) - {0} if ks else set()
    if not common:
        return {}, None
    k = max(common)
    out: dict[str, list[dict]] = {}
    for label, m in ms.items():
        full = m["full"]["loss"]
        out.setdefault(_variant(m["variant"]), []).append(
            {"label": label, "plain": m["window"]["0"]["loss"] - full, "sinks": m["window"][str(k)]["loss"] - full})
    return out, k


def noticeable(cost: float) -> bool:
    return cost >= NOTICEABLE_NATS.value or math.expm1(cost) >= NOTICEABLE_PPL.value


def removes(plain: float, sinks: float) -> bool:
    return sinks <= REMOVED_SHARE.value * plain


def streaming_verdict(costs: dict[str, list[dict]], k: int | None) -> dict:
    """{"verdict", "this_run", "checks"} of the module's rule on model_costs' figures."""
    base = costs.get("none") or []
    gated = {v: costs[v] for v in GATED if costs.get(v)}
    if not base or not gated or k is None:
        return {"verdict": NOT_RUN, "checks": {},
                "this_run": "needs a baseline and a G1 model measured with a plain window (K=0) and K >= 1"}
    mean = lambda xs: sum(xs) / len(xs)
    b0, bk = mean([m["plain"] for m in base]), mean([m["sinks"] for m in base])
    least = min(m["plain"] for m in base)
    checks = {
        "noticeable": noticeable(b0),
        "removes": all(removes(m["plain"], m["sinks"]) for m in base),
        "baseline_pays": all(m["plain"] >= FLOOR.value for m in base),
        "g1_sink_free": all(m["plain"] <= G1_SHARE.value * least for ms in gated.values() for m in ms),
    }
    checks["consistent"] = checks["removes"] and checks["baseline_pays"] and checks["g1_sink_free"]
    n = lambda ms: f"{len(ms)} model{'s' if len(ms) > 1 else ''}"
    spread = lambda ms: (f" [{min(m['plain'] for m in ms):+.3f}, {max(m['plain'] for m in ms):+.3f}]"
                         if len(ms) > 1 else "")
    this = (f"plain-window Δloss (K=0), mean over models: baseline {b0:+.3f}{spread(base)} "
            f"({100 * math.expm1(b0):+.1f} % ppl; K={k}: {bk:+.3f}, {n(base)}) → "
            + ", ".join(f"{v.removeprefix('sdpa_')} {mean([m['plain'] for m in ms]):+.3f}{spread(ms)} ({n(ms)})"
                        for v, ms in gated.items())
            + f"; noticeable (≥ {NOTICEABLE_NATS.value:g} nats or {100 * NOTICEABLE_PPL.value:g} % ppl): "
            f"{'yes' if checks['noticeable'] else 'no'}; consistent in every model (baseline ≥ {FLOOR.value:g} "
            f"nats, K={k} leaves ≤ {REMOVED_SHARE.value:g} of it, G1 ≤ {G1_SHARE.value:g} of the smallest baseline "
            f"cost): {'yes' if checks['consistent'] else 'no'}")
    if not checks["consistent"]:
        failed = [w for w, c in (("a baseline model pays less than the floor", checks["baseline_pays"]),
                                 (f"K={k} does not remove a baseline model's cost", checks["removes"]),
                                 ("a G1 model pays more than its share", checks["g1_sink_free"])) if not c]
        this += f" ({'; '.join(failed)})"
    verdict = (REPRODUCED if checks["consistent"] and checks["noticeable"] else PARTLY if checks["consistent"]
               else NOT_AT_SCALE)
    return {"verdict": verdict, "this_run": this, "checks": checks}


def lab_verdicts(models: dict) -> dict:
    """{kind: {"verdict", "this_run", "checks", "k"}} for each kind of model a streaming lab measured (sink-lab
    models and text models are judged apart: different data), where a baseline and a G1 model are both there."""
    out = {}
    for kind in ("sink_lab", "text"):
        costs, k = model_costs(models, kind)
        if costs.get("none") and any(costs.get(v) for v in GATED) and k is not None:
            out[kind] = {**streaming_verdict(costs, k), "k": k}
    return out
