"""Rendering of a quantization-lab result (lab.json in): the plots (Δ per scheme and policy for every arm; the
gated-minus-baseline D with its Welch interval against ±δ), report.md and a self-contained report.html, and the text table
`gattn lab quant` prints."""
from __future__ import annotations

from pathlib import Path

from ...experiment import pages
from ...experiment.pages import fmt
from ...experiment.stats import spread
from ...experiment.verdicts import Threshold, cells
from ...util.io import save_png


def _order(lab: dict, key: str) -> list[str]:
    return list(dict.fromkeys(lab["config"][key]))


def arm_summary(lab: dict) -> list[dict]:
    """Mean over seeds per (family, arm, scheme, policy): Δ, gate mean / near-zero share, F-Attn, BOS attention,
    and the same of the unquantized models."""
    groups: dict[tuple, list[dict]] = {}
    for r in lab["results"]:
        groups.setdefault((r["family"], r["arm"], r["scheme"], r["policy"]), []).append(r)
    ref = lab["reference"]
    out = []
    for (fam, arm, scheme, policy), rs in groups.items():
        refs = [ref[r["model"]] for r in rs]
        e = {"family": fam, "arm": arm, "scheme": scheme, "policy": policy, "seeds": len(rs),
             "baseline": rs[0]["baseline"], "policy_applies": rs[0]["policy_applies"]}
        for k in ("delta_nats", "val_loss", "gate_mean", "gate_near_zero", "f_attn", "bos_attention"):
            s = spread(r.get(k) for r in rs)
            e[k], e[k + "_std"], e[k + "_min"], e[k + "_max"] = s["mean"], s["std"], s["min"], s["max"]
            e[k + "_ref"] = spread(x.get(k) for x in refs)["mean"]
        domains = sorted({d for r in rs for d in r["delta_per_domain"]})
        e["delta_per_domain"] = {d: spread(r["delta_per_domain"].get(d) for r in rs)["mean"] for d in domains}
        out.append(e)
    return out


def _label(e: dict) -> str:
    return e["arm"] + (" (baseline)" if e["baseline"] else "")


def plot_deltas(lab: dict, path) -> Path:
    """Δ (quantized - unquantized, nats; mean over seeds, bars: seed range) per scheme, one panel per policy."""
    schemes, policies = _order(lab, "schemes"), _order(lab, "policies")
    summ = arm_summary(lab)
    fig, axes = pages.subplots(1, len(policies), figsize=(4.2 * len(policies), 4.2), squeeze=False, sharey=True)
    series = list(dict.fromkeys((e["family"], e["arm"]) for e in summ))
    for ax, policy in zip(axes[0], policies):
        for j, (fam, arm) in enumerate(series):
            es = {e["scheme"]: e for e in summ if (e["family"], e["arm"], e["policy"]) == (fam, arm, policy)
                  and e["delta_nats"] is not None}  # a quantization that made the loss non-finite: no point
            xs = [i + 0.08 * (j - len(series) / 2) for i, s in enumerate(schemes) if s in es]
            ys = [es[s]["delta_nats"] for s in schemes if s in es]
            lo = [es[s]["delta_nats"] - es[s]["delta_nats_min"] for s in schemes if s in es]
            hi = [es[s]["delta_nats_max"] - es[s]["delta_nats"] for s in schemes if s in es]
            first = next(iter(es.values()), None)
            name = _label(first) if first else arm
            if len({f for f, _ in series}) > 1:
                name = f"{fam}: {name}"
            ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", ms=4, lw=0, elinewidth=1, capsize=2, label=name)
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_yscale("symlog", linthresh=1e-3)
        ax.set_xticks(range(len(schemes)), schemes, rotation=40, ha="right", fontsize=8)
        ax.set(title=f"policy {policy}")
    axes[0][0].set_ylabel("Δ val loss from quantization (nats)")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    return save_png(fig, path)


def plot_comparisons(lab: dict, path) -> Path:
    """D = Δ_gated - Δ_baseline per scheme with its 95 % Welch interval, one panel per policy; the band is ±δ."""
    schemes, policies = _order(lab, "schemes"), _order(lab, "policies")
    comps = lab["comparisons"]
    fig, axes = pages.subplots(1, len(policies), figsize=(4.2 * len(policies), 4.2), squeeze=False, sharey=True)
    d = lab["thresholds"][next(iter(lab["thresholds"]))][0]["value"]
    series = list(dict.fromkeys((c["family"], c["arm"]) for c in comps))
    for ax, policy in zip(axes[0], policies):
        for j, (fam, arm) in enumerate(series):
            cs = {c["scheme"]: c for c in comps if (c["family"], c["arm"], c["policy"]) == (fam, arm, policy)}
            pts = [(i + 0.1 * (j - len(series) / 2), cs[s]) for i, s in enumerate(schemes) if s in cs
                   and cs[s]["mean"] is not None]
            err = [[c["mean"] - c["ci_low"] if c["ci_low"] is not None else 0 for _, c in pts],
                   [c["ci_high"] - c["mean"] if c["ci_high"] is not None else 0 for _, c in pts]]
            name = arm if len({f for f, _ in series}) == 1 else f"{fam}: {arm}"
            ax.errorbar([x for x, _ in pts], [c["mean"] for _, c in pts], yerr=err, marker="o", ms=4, lw=0,
                        elinewidth=1, capsize=2, label=name)
        ax.axhspan(-d, d, color="grey", alpha=0.15)
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_yscale("symlog", linthresh=d)
        ax.set_xticks(range(len(schemes)), schemes, rotation=40, ha="right", fontsize=8)
        ax.set(title=f"policy {policy} (band: ±δ = {d:g})")
    axes[0][0].set_ylabel("D = Δ_gated − Δ_baseline (nats), 95 % Welch interval")
    if series:
        axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    return save_png(fig, path)


def make_plots(lab: dict, plot_dir: Path) -> dict[str, Path]:
    plot_dir.mkdir(parents=True, exist_ok=True)
    return {"deltas": plot_deltas(lab, plot_dir / "deltas.png"),
            "comparisons": plot_comparisons(lab, plot_dir / "comparisons.png")}


def _n(need) -> str:
    return "–" if need is None else str(need)


def _ci(lo, hi) -> str:
    return "–" if lo is None else f"[{lo:+.4f}, {hi:+.4f}]"


def _pm(mean, std, digits=4, sign=True) -> str:
    if mean is None:
        return "–"
    s = f"{mean:+.{digits}f}" if sign else f"{mean:.{digits}f}"
    return s if std is None else f"{s} ± {std:.{digits}f}"


def _sort_key(lab: dict):
    """Rows in the order the user asked for schemes and policies (baseline arm first within a family)."""
    schemes, policies = _order(lab, "schemes"), _order(lab, "policies")
    return lambda e: (e["family"], not e.get("baseline", False), e["arm"], schemes.index(e["scheme"]),
                      policies.index(e["policy"]))


def tables(lab: dict) -> dict[str, tuple[list[str], list[list[str]]]]:
    summ = sorted(arm_summary(lab), key=_sort_key(lab))
    comps = sorted(lab["comparisons"], key=_sort_key(lab))
    sink = any(e["bos_attention"] is not None for e in summ)
    head = ["Family", "Arm", "Scheme", "Policy", "Seeds", "Δ (nats)", "gate mean (fp32 → q)", "gate < 0.01",
            "F-Attn (fp32 → q)"] + (["BOS attn (fp32 → q)"] if sink else [])
    rows = []
    for e in summ:
        pol = e["policy"] if e["policy_applies"] else f"{e['policy']} (no gate: the same model)"
        row = [e["family"], _label(e), e["scheme"], pol, str(e["seeds"]), _pm(e["delta_nats"], e["delta_nats_std"]),
               f"{fmt(e['gate_mean_ref'])} → {fmt(e['gate_mean'])}", fmt(e["gate_near_zero"]),
               f"{fmt(e['f_attn_ref'])} → {fmt(e['f_attn'])}"]
        if sink:
            row.append(f"{fmt(e['bos_attention_ref'])} → {fmt(e['bos_attention'])}")
        rows.append(row)
    comp = [[c["family"], c["arm"], c["scheme"], c["policy"],
             f"{c.get('n_gated', c['n_seeds'])} / {c.get('n_baseline', c['n_seeds'])}", fmt(c["mean"], 4),
             _ci(c["ci_low"], c["ci_high"]), fmt(c.get("df"), 1), c["verdict"], _n(c.get("models_needed"))]
            for c in comps]
    pcomp = [[c["family"], c["arm"], c["scheme"], f"{c['policy']} − {c['against']}", str(c["n_models"]),
              fmt(c["mean"], 4), _ci(c["ci_low"], c["ci_high"]), c["verdict"], _n(c["models_needed"])]
             for c in sorted(lab.get("policy_comparisons", []), key=_sort_key(lab))]
    pol, pairs = [], []
    for fam, v in lab["verdict"]["per_family"].items():
        for p, x in v["per_policy"].items():
            pol.append([fam, p, x["verdict"], f"{x['like_or_less']}/{x['pairs']}", str(x["more"]),
                        "**recommended**" if p == v["recommended"] else ""])
        for x in v.get("policy_pairs", {}).values():
            pairs.append([fam, f"{x['policy']} vs {x['against']}", x["verdict"], f"{x['within_or_less']}/{x['pairs']}",
                          str(x["costs_more"]), x["to_decide"] or ""])
    domains = sorted({d for e in summ for d in e["delta_per_domain"]})
    dom = [[e["family"], _label(e), e["scheme"], e["policy"]] + [fmt(e["delta_per_domain"].get(d), 4)
                                                                  for d in domains] for e in summ]
    return {"arms": (head, rows),
            "comparisons": (["Family", "Gated arm", "Scheme", "Policy", "Models (gated / baseline)", "D (nats)",
                             "95 % Welch interval", "df", "Verdict", "Models per arm to decide"], comp),
            "policy_comparisons": (["Family", "Gated arm", "Scheme", "D = Δ(policy) − Δ(against)", "Models",
                                    "D (nats)", "95 % paired interval", "Verdict", "Models to decide"], pcomp),
            "policies": (["Family", "Policy", "Claim", "like or better", "more sensitive", ""], pol),
            "policy_pairs": (["Family", "Pair (cheaper vs dearer)", "Paired verdict", "within δ or less",
                              "cheaper costs more", "To decide"], pairs),
            "domains": (["Family", "Arm", "Scheme", "Policy"] + domains, dom)}


def text_table(lab: dict) -> str:
    head, rows = tables(lab)["comparisons"]
    return pages.text_table(head, rows) + "\n" + lab["verdict"]["text"]


def _to_decide(lab: dict) -> list[tuple]:
    """A paragraph per family without a recommendation: why, and what would decide it."""
    out = []
    for fam, v in lab["verdict"]["per_family"].items():
        if v["recommended"] is None:
            out.append(("p", f"**{fam}: no recommendation** ({v['why']}). What would decide it: "
                             + "; ".join(v.get("to_decide") or ["a comparison this lab did not measure"]) + "."))
    return out


def write(lab: dict, out: Path) -> None:
    t = tables(lab)
    c = lab["config"]
    th = {k: tuple(Threshold(**x) for x in ts) for k, ts in lab["thresholds"].items()}
    n = len(lab["models"])
    blocks = [
        ("p", f"**Verdict** ({lab['verdict']['rule']}): {lab['verdict']['text']}"),
        ("p", f"{n} model(s), schemes {', '.join(c['schemes'])}, policies {', '.join(c['policies'])}; "
              f"{c['eval_windows']} held-out windows per domain, {c['calibration_windows']} calibration windows "
              f"(awq-int4); fake-quantized in fp32 (gated_attention.quant); {lab['cpu_time_s']:.0f} CPU-s in the "
              f"measuring invocation" + ("; judged again from the stored rows by `--report-only`." if
                                         lab.get("report_only") else ".")),
        ("h2", "Is the gated model more sensitive than the baseline? (D = mean Δ_gated − mean Δ_baseline, Welch: "
               "the two arms are different models)"),
        ("table", *t["comparisons"]),
        ("h2", "Policy against policy on the same models (D = Δ(policy) − Δ(against), paired by model)"),
        ("table", *t["policy_comparisons"]),
        ("h2", "The claim per policy, and the recommended policy"), ("table", *t["policies"]),
        ("table", *t["policy_pairs"]),
        *_to_decide(lab),
        ("h2", "Per arm (mean ± std over seeds)"), ("table", *t["arms"]),
        ("h2", "Δ per domain (mean over seeds, nats)"), ("table", *t["domains"]),
        ("h2", "Thresholds"), ("table", *cells(th)),
        *pages.figures(lab.get("plots", {}), {"deltas": "Δ from quantization per scheme and policy (bars: seed range)",
                                              "comparisons": "D = Δ_gated − Δ_baseline with its 95 % Welch "
                                                             "interval; band ±δ"}),
    ]
    pages.write(out, "gattn lab quant: gated models under quantization, gate policies compared", blocks)
