"""Rendering of a scaling-lab result (lab.json): plots (the confirm runs' loss vs compute with each variant's fit, Δ
per size with its interval against ±δ, the tuning sweeps' LR basins, Δ of the training loss against tokens),
report.md and a self-contained report.html, and the text table `gattn lab scaling` prints.
"""
from __future__ import annotations

import math
from pathlib import Path

from ...experiment import pages
from ...experiment.pages import fmt
from ...experiment.verdicts import cells
from ...util.io import save_png
from . import verdict as V

_PROTOCOL = {"shared-lr": "every arm at the baseline's tuned LR, the paper's protocol",
             "tuned": "every variant at its own tuned LR, the LR-tolerance question"}
_NAMES = {"baseline": "baseline", "sdpa_elementwise": "G1 elementwise", "sdpa_headwise": "G1 headwise"}


def _name(v: str) -> str:
    return _NAMES.get(v, v)


def _arms(lab: dict) -> list[str]:
    return list(lab["design"]["lr"])


def _best_loss(lab: dict, v: str, s: str) -> list[float]:
    """The confirm runs' losses of (variant, size) at the protocol's LR (failed runs left out of the plots; the
    figures count them)."""
    lr = lab["design"]["lr"][v][s]
    return [r["val_loss"] for r in lab["runs"] if r["variant"] == v and r["size"] == s and r["lr"] == lr
            and r.get("role", "confirm") == "confirm" and r["val_loss"] is not None and not r.get("failed")]


def plot_loss_vs_compute(lab: dict, path) -> Path:
    fig, ax = pages.subplots(figsize=(7, 4.5))
    comp = {s["name"]: s["flops"] for s in lab["sizes"]}
    for v in _arms(lab):
        xs = [comp[s] for s in comp]
        means = [sum(x) / len(x) if (x := _best_loss(lab, v, s)) else None for s in comp]
        line, = ax.plot(xs, means, marker="o", lw=0, label=_name(v))
        for s in comp:
            pts = _best_loss(lab, v, s)
            ax.scatter([comp[s]] * len(pts), pts, s=8, color=line.get_color(), alpha=0.4)
        f = lab["fits"].get(v) or {}
        if f.get("alpha") is not None:
            lo, hi = min(xs), max(xs)
            grid = [lo * (hi / lo) ** (i / 40) for i in range(41)]
            ax.plot(grid, [f["E"] + f["A"] * c ** -f["alpha"] for c in grid], color=line.get_color(), lw=1,
                    label=f"  fit: α {f['alpha']:.3f}" + (f" [{f['alpha_ci'][0]:.3f}, {f['alpha_ci'][1]:.3f}]"
                                                            if f.get("alpha_ci") else ""))
    return pages.finish(fig, ax, path, xscale="log", xlabel="training compute (FLOPs)",
                        ylabel="val loss, confirm seeds (nats)",
                        title=f"loss vs compute at the {lab['protocol']} protocol's LRs (dots: confirm seeds)")


def plot_deltas(lab: dict, path) -> Path:
    fig, ax = pages.subplots(figsize=(7, 4.5))
    names = [s["name"] for s in lab["sizes"]]
    for j, v in enumerate(sorted({d["variant"] for d in lab["deltas"]})):
        ds = [next(d for d in lab["deltas"] if d["variant"] == v and d["size"] == s) for s in names]
        xs = [i + 0.1 * j for i in range(len(names))]
        ys = [d["mean"] for d in ds]
        err = [[(d["mean"] - d["ci_low"]) if d["ci_low"] is not None else 0 for d in ds],
               [(d["ci_high"] - d["mean"]) if d["ci_high"] is not None else 0 for d in ds]]
        ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, lw=1, label=_name(v))
    d = lab["thresholds"]["gain at one size (paired over seeds)"][0]["value"]
    ax.axhspan(-d, d, color="grey", alpha=0.15, label=f"±δ = {d} nats (the paper's gain)")
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xticks(range(len(names)), names)
    return pages.finish(fig, ax, path, xlabel="size", ylabel="Δ = gated - baseline (nats)",
                        title="Δ val loss per size, 95 % t interval over seeds")


def plot_basins(lab: dict, path) -> Path:
    names = [s["name"] for s in lab["sizes"]]
    fig, axes = pages.subplots(1, len(names), figsize=(3.2 * len(names), 3.6), squeeze=False)
    for ax, s in zip(axes[0], names):
        for v in lab["best_lr"]:
            rows = sorted((r["lr"], r["val_loss"]) for r in lab["runs"] if r["variant"] == v and r["size"] == s
                          and r.get("role") == "tuning" and r["val_loss"] is not None and not r.get("failed"))
            ax.plot([x for x, _ in rows], [y for _, y in rows], marker="o", ms=3, lw=1, label=_name(v))
        ax.set_xscale("log")
        ax.set(title=s, xlabel="peak LR")
    axes[0][0].set_ylabel("val loss, tuning seeds (nats)")
    axes[0][0].legend(fontsize=7)
    return save_png(fig, path)


def plot_delta_curves(lab: dict, path) -> Path:
    fig, ax = pages.subplots(figsize=(7, 4.5))
    for v, per_size in lab["delta_curves"].items():
        for s, c in per_size.items():
            if c["tokens"]:
                line, = ax.plot(c["tokens"], c["mean"], lw=1, label=f"{_name(v)} {s}")
                ax.fill_between(c["tokens"], c["low"], c["high"], color=line.get_color(), alpha=0.12)
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xscale("log")
    ax.set(xlabel="tokens seen", ylabel="Δ training loss (nats)",
           title="Δ along training (gated - baseline, confirm seeds; band: seed range)")
    ax.legend(fontsize=6, ncol=2)
    return save_png(fig, path)


def make_plots(lab: dict, plot_dir: Path) -> dict[str, Path]:
    plot_dir.mkdir(parents=True, exist_ok=True)
    return {"loss_vs_compute": plot_loss_vs_compute(lab, plot_dir / "loss_vs_compute.png"),
            "deltas": plot_deltas(lab, plot_dir / "deltas.png"),
            "lr_basins": plot_basins(lab, plot_dir / "lr_basins.png"),
            "delta_curves": plot_delta_curves(lab, plot_dir / "delta_curves.png")}


def _ci(lo, hi, digits=4) -> str:
    return "-" if lo is None else f"[{lo:+.{digits}f}, {hi:+.{digits}f}]"


def tables(lab: dict) -> dict[str, tuple[list[str], list[list[str]]]]:
    sizes = [["Size", "Params (total)", "Params (non-emb.)", "Tokens", "Tokens / non-emb. param", "FLOPs"]] + [
        [s["name"], f"{s['params_total']:,}", f"{s['params_non_embedding']:,}", f"{s['tokens']:,}",
         f"{s['tokens'] / s['params_non_embedding']:.1f}", f"{s['flops']:.3g}"] for s in lab["sizes"]]
    names = [s["name"] for s in lab["sizes"]]
    best = [["Variant"] + [f"{s}: best LR / loss / basin" for s in names]]
    for v in lab["best_lr"]:
        row = [_name(v)]
        for s in names:
            b = lab["lr_basin"][v][s]
            ls = _best_loss(lab, v, s)
            edge = " (edge)" if b.get("at_edge") else ""
            row.append(f"{fmt(b['best_lr'], 3)}{edge} / {fmt(sum(ls) / len(ls) if ls else None, 4)} (n={len(ls)}) / "
                       f"{fmt(b['low'], 3)}-{fmt(b['high'], 3)}"
                       + (f"; also within it, past a worse LR: {', '.join(fmt(x, 3) for x in b['holes'])}"
                          if b.get("holes") else ""))
        best.append(row)
    deltas = [["Variant", "Size", "LR (gated / baseline)", "Δ (nats)", "95 % interval", "Δ (bits/byte)", "Pairs",
               "Verdict (nats)", "ln k", "ln k 95 % interval", "Verdict (multiplier)", "Pairs for 80 % power"]] + [
        [_name(d["variant"]), d["size"], f"{fmt(d['lr'][d['variant']], 3)} / "
         f"{fmt([x for k, x in d['lr'].items() if k != d['variant']][0], 3)}", fmt(d["mean"], 4),
         _ci(d["ci_low"], d["ci_high"]), fmt(d["bits_per_byte"]["mean"], 4), str(d["n_seeds"]), d["verdict"],
         fmt(d["ln_k"], 3), _ci(*d["ln_k_ci"], digits=3), d["multiplier_verdict"],
         "-" if not d.get("pairs_needed") else
         f"{d['pairs_needed']['n']} ({d['pairs_needed']['low']}-{d['pairs_needed']['high']})"] for d in lab["deltas"]]
    overall = [["Variant", "ln k (all sizes)", "95 % interval", "k", "Verdict", "Trend of Δ (nats per e-fold)",
                "interval", "Trend of ln k", "interval"]]
    for m in lab["multiplier"]:
        if m["size"] != "all":
            continue
        t = lab["trend"][m["variant"]]
        overall.append([_name(m["variant"]), fmt(m["ln_k"], 3), _ci(m["ci_low"], m["ci_high"], 3),
                        "-" if m["ln_k"] is None else f"{math.exp(m['ln_k']):.2f}", m["verdict"], fmt(t["slope"], 4),
                        _ci(t["ci_low"], t["ci_high"]), fmt(t["ln_k"]["slope"], 3),
                        _ci(t["ln_k"]["ci_low"], t["ln_k"]["ci_high"], 3)])
    dz = lab["design"]
    design = [["Size", "Pilot within-arm sd (nats)", "df", "Threshold (nats)", "Target SE", "Pairs for 80 % power",
               "Planned", "Capped"]]
    for s_, row in dz["per_size"].items():
        design.append([s_, fmt(row.get("sd_within"), 4), str(row.get("df", "-")), fmt(row.get("threshold"), 4),
                       fmt(dz["target_se"][s_], 4), str(row.get("n_power", "-")), str(row["n_planned"]),
                       str(row.get("capped", "-"))])
    bias = [["Variant", "Size", "Chosen LR", "Tuning seed's loss - confirm mean there (nats)"]] + [
        [_name(b["variant"]), b["size"], fmt(b["lr"], 3), fmt(b["value"], 4)] for b in lab["selection_bias"]]
    fits = [["Variant", "E", "A", "α", "α 95 % interval", "Δ change across the ladder", "interval", "trend"]]
    for v, f in lab["fits"].items():
        t = lab["trends"].get(v) or {}
        fits.append([_name(v), fmt(f.get("E"), 4), fmt(f.get("A"), 4), fmt(f.get("alpha"), 4),
                     _ci(*(f.get("alpha_ci") or (None, None))), fmt(t.get("change"), 4),
                     _ci(t.get("ci_low"), t.get("ci_high")), t.get("verdict", "(baseline)")])
    domains = sorted({d for r in lab["runs"] for d in (r.get("val_loss_per_domain") or {})})
    per_dom = [["Variant", "Size"] + domains + (["held-out"] if any(r.get("heldout_loss") is not None
                                                                     for r in lab["runs"]) else [])]
    for v in _arms(lab):
        for s in names:
            rows = [r for r in lab["runs"] if r["variant"] == v and r["size"] == s and r.get("role") == "confirm"
                    and r["lr"] == lab["design"]["lr"][v][s] and not r.get("failed")]
            cells_ = [fmt(_avg([(r["val_loss_per_domain"] or {}).get(d) for r in rows]), 4) for d in domains]
            if len(per_dom[0]) > len(domains) + 2:
                cells_.append(fmt(_avg([r.get("heldout_loss") for r in rows]), 4))
            per_dom.append([_name(v), s] + cells_)
    return {"sizes": (sizes[0], sizes[1:]), "best": (best[0], best[1:]), "deltas": (deltas[0], deltas[1:]),
            "fits": (fits[0], fits[1:]), "per_domain": (per_dom[0], per_dom[1:]), "overall": (overall[0], overall[1:]),
            "design": (design[0], design[1:]), "bias": (bias[0], bias[1:])}


def _avg(vals):
    vals = [x for x in vals if x is not None]
    return sum(vals) / len(vals) if vals else None


def text_table(lab: dict) -> str:
    head, rows = tables(lab)["deltas"]
    keep = [0, 1, 3, 4, 6, 7, 8, 9, 10]
    return (pages.text_table([head[i] for i in keep], [[r[i] for i in keep] for r in rows]) + "\n"
            + lab["verdict"]["text"])


def write(lab: dict, out: Path) -> None:
    t = tables(lab)
    c = lab["config"]
    th = {k: tuple(V.Threshold(**x) for x in ts) for k, ts in lab["thresholds"].items()}
    blocks = [
        ("p", f"**Verdict** ({lab['verdict']['rule']}): {lab['verdict']['text']}"),
        ("p", f"Budget `{lab['budget']}`, {c['tokens_per_param']:g} tokens per {c['params_counted']} parameter, "
              f"protocol **{lab['protocol']}** ({_PROTOCOL[lab['protocol']]}); tuning seeds {lab['seeds']['tuning']} "
              f"(LR sweep over {c['lrs']}, extended past an edge), confirm seeds {lab['seeds']['confirm']} (never a "
              f"tuning seed), recipe `{c.get('recipe_name') or c.get('recipe', {}).get('recipe', 'current')}`, "
              f"precision {c['resolved_precision']}, corpus `{c['data_dir']}`; {lab['cpu_s_runs']:.0f} "
              f"CPU-s in the units trained by this and earlier invocations' processes; commit "
              f"{(lab.get('provenance') or {}).get('commit')}, {(lab.get('provenance') or {}).get('cpu')}."),
        ("p", f"Failures (counted at ln(vocabulary), never dropped): {len(lab['failures'])}."),
        ("h2", "The ladder"), ("table", *t["sizes"]),
        ("h2", "The compute multiplier and the trend (confirm seeds)"), ("table", *t["overall"]),
        ("h2", "Δ = gated − baseline per size (confirm seeds)"), ("table", *t["deltas"]),
        ("h2", "The registered design (from the pilot's within-arm spread, blind to Δ)"), ("table", *t["design"]),
        ("p", f"Rule: {lab['design']['rule']}. Threshold: {lab['design']['threshold_source']}."),
        ("h2", "Loss vs compute, per variant"), ("table", *t["fits"]),
        ("h2", "Learning rates (tuning seeds): best, confirm-mean loss at the protocol's LR, the contiguous basin "
               "within 0.05 nats"), ("table", *t["best"]),
        ("h2", "Selection bias: what picking the LR on the tuning seed would have added"), ("table", *t["bias"]),
        ("h2", "Per domain (confirm mean)"), ("table", *t["per_domain"]),
        ("h2", "Thresholds"), ("table", *cells(th)),
        *pages.figures({k: p for k, p in lab.get("plots", {}).items()},
                       {"loss_vs_compute": "Loss vs compute with each variant's fit",
                        "deltas": "Δ per size with its 95 % interval; the band is ±δ",
                        "lr_basins": "Loss vs LR per size (tuning seeds)",
                        "delta_curves": "Δ of the training loss along training"}),
    ]
    pages.write(out, "gattn lab scaling: the gate at equal parameters, decided on confirm seeds", blocks)
