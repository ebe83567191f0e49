"""Rendering of a scaling-lab result (lab.json): plots (best-LR loss vs compute with each variant's fit, Δ per size
with its interval against ±δ, the LR basins, Δ of the training loss against tokens), report.md and a self-contained
report.html, and the text table `gattn lab scaling` prints.
"""
from __future__ import annotations

from pathlib import Path

from ...experiment import pages
from ...experiment.pages import fmt
from ...experiment.verdicts import cells
from ...util.io import save_png
from . import verdict as V

_NAMES = {"baseline": "baseline", "sdpa_elementwise": "G1 elementwise", "sdpa_headwise": "G1 headwise"}


def _name(v: str) -> str:
    return _NAMES.get(v, v)


def _best_loss(lab: dict, v: str, s: str) -> list[float]:
    lr = lab["best_lr"][v][s]
    return [r["val_loss"] for r in lab["runs"] if r["variant"] == v and r["size"] == s and r["lr"] == lr
            and r["val_loss"] is not None]


def plot_loss_vs_compute(lab: dict, path) -> Path:
    fig, ax = pages.subplots(figsize=(7, 4.5))
    comp = {s["name"]: s["flops"] for s in lab["sizes"]}
    for v in lab["best_lr"]:
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
    ax.set_xscale("log")
    ax.set(xlabel="training compute (FLOPs)", ylabel="val loss at the best LR (nats)",
           title="loss vs compute, each variant at its own best LR (dots: seeds)")
    ax.legend(fontsize=8)
    return save_png(fig, path)


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
    ax.set(xlabel="size", ylabel="Δ = gated - baseline (nats)", title="Δ val loss per size, 95 % t interval over seeds")
    ax.legend(fontsize=8)
    return save_png(fig, path)


def plot_basins(lab: dict, path) -> Path:
    names = [s["name"] for s in lab["sizes"]]
    fig, axes = pages.subplots(1, len(names), figsize=(3.2 * len(names), 3.6), squeeze=False)
    for ax, s in zip(axes[0], names):
        for v in lab["best_lr"]:
            rows = sorted((r["lr"], r["val_loss"]) for r in lab["runs"] if r["variant"] == v and r["size"] == s
                          and r["seed"] == 0 and r["val_loss"] is not None)
            ax.plot([x for x, _ in rows], [y for _, y in rows], marker="o", ms=3, lw=1, label=_name(v))
        ax.set_xscale("log")
        ax.set(title=s, xlabel="peak LR")
    axes[0][0].set_ylabel("val loss, seed 0 (nats)")
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
           title="Δ along training (gated - baseline at their best LRs; band: seed range)")
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
                       f"{fmt(b['low'], 3)}-{fmt(b['high'], 3)}")
        best.append(row)
    deltas = [["Variant", "Size", "Δ (nats)", "95 % interval", "Seeds", "Verdict", "Seeds needed"]] + [
        [_name(d["variant"]), d["size"], fmt(d["mean"], 4), _ci(d["ci_low"], d["ci_high"]), str(d["n_seeds"]),
         d["verdict"], "" if d["verdict"] != V.INCONCLUSIVE else str(d["seeds_needed"] or "-")] for d in lab["deltas"]]
    fits = [["Variant", "E", "A", "α", "α 95 % interval", "Δ change across the ladder", "interval", "trend"]]
    for v, f in lab["fits"].items():
        t = lab["trends"].get(v) or {}
        fits.append([_name(v), fmt(f.get("E"), 4), fmt(f.get("A"), 4), fmt(f.get("alpha"), 4),
                     _ci(*(f.get("alpha_ci") or (None, None))), fmt(t.get("change"), 4),
                     _ci(t.get("ci_low"), t.get("ci_high")), t.get("verdict", "(baseline)")])
    domains = sorted({d for r in lab["runs"] for d in (r.get("val_loss_per_domain") or {})})
    per_dom = [["Variant", "Size"] + domains + (["held-out"] if any(r.get("heldout_loss") is not None
                                                                     for r in lab["runs"]) else [])]
    for v in lab["best_lr"]:
        for s in names:
            rows = [r for r in lab["runs"] if r["variant"] == v and r["size"] == s and r["lr"] == lab["best_lr"][v][s]]
            cells_ = [fmt(_avg([(r["val_loss_per_domain"] or {}).get(d) for r in rows]), 4) for d in domains]
            if len(per_dom[0]) > len(domains) + 2:
                cells_.append(fmt(_avg([r.get("heldout_loss") for r in rows]), 4))
            per_dom.append([_name(v), s] + cells_)
    return {"sizes": (sizes[0], sizes[1:]), "best": (best[0], best[1:]), "deltas": (deltas[0], deltas[1:]),
            "fits": (fits[0], fits[1:]), "per_domain": (per_dom[0], per_dom[1:])}


def _avg(vals):
    vals = [x for x in vals if x is not None]
    return sum(vals) / len(vals) if vals else None


def text_table(lab: dict) -> str:
    head, rows = tables(lab)["deltas"]
    return pages.text_table(head, rows) + "\n" + lab["verdict"]["text"]


def write(lab: dict, out: Path) -> None:
    t = tables(lab)
    c = lab["config"]
    th = {k: tuple(V.Threshold(**x) for x in ts) for k, ts in lab["thresholds"].items()}
    blocks = [
        ("p", f"**Verdict** ({lab['verdict']['rule']}): {lab['verdict']['text']}"),
        ("p", f"Budget `{lab['budget']}`, {c['tokens_per_param']:g} tokens per {c['params_counted']} parameter, "
              f"{c['seeds']} seeds at each variant's own best LR (swept on seed 0 over {c['lrs']}, extended past an "
              f"edge), precision {c['resolved_precision']}, corpus `{c['data_dir']}`; {lab['cpu_s_runs']:.0f} CPU-s "
              f"in the units trained by this and earlier invocations' processes."),
        ("h2", "The ladder"), ("table", *t["sizes"]),
        ("h2", "Δ = gated − baseline at each variant's best LR"), ("table", *t["deltas"]),
        ("h2", "Loss vs compute"), ("table", *t["fits"]),
        ("h2", "Learning rates (seed 0): best, its seed-mean loss, the basin within 0.05 nats"), ("table", *t["best"]),
        ("h2", "Per domain at the best LR (seed mean)"), ("table", *t["per_domain"]),
        ("h2", "Thresholds"), ("table", *cells(th)),
        *pages.figures({k: p for k, p in lab.get("plots", {}).items()},
                       {"loss_vs_compute": "Loss vs compute with each variant's fit",
                        "deltas": "Δ per size with its 95 % interval; the band is ±δ",
                        "lr_basins": "Loss vs LR per size (seed 0)",
                        "delta_curves": "Δ of the training loss along training"}),
    ]
    pages.write(out, "gattn lab scaling: the gate at equal parameters, tuned LRs, over seeds", blocks)
