"""Tables, plot and report of `gattn lab streaming` (lab.json in; report.md, self-contained report.html and
plots/per_position_loss.png out)."""
from __future__ import annotations

from pathlib import Path

from ...experiment import pages
from ...experiment.stats import mean_std
from ...util.io import save_png

TASK_KEYS = ("backcopy_ce", "bigram_ce")  # sink-lab models also report the task's two kinds of positions


def _ks(models: dict) -> list[str]:
    first = next(iter(models.values()))
    return list(first["window"])


def _scalars(m: dict) -> dict:
    """Flat scalars of one model: full_loss, K{k}_loss, K{k}_ppl, and the task CEs per setting."""
    out = {"full_loss": m["full"]["loss"], "full_ppl": m["full"]["ppl"]}
    for t in TASK_KEYS:
        out[f"full_{t}"] = m["full"].get(t)
    for k, w in m["window"].items():
        out[f"K{k}_loss"], out[f"K{k}_ppl"] = w["loss"], w["ppl"]
        out[f"K{k}_dloss"] = w["loss"] - m["full"]["loss"]
        for t in TASK_KEYS:
            out[f"K{k}_{t}"] = w.get(t)
    return out


def by_variant(models: dict) -> dict:
    """Mean/std over seeds of sink-lab models of one variant (labels <variant>/seed<k>); text models as they are."""
    groups: dict[str, list[dict]] = {}
    for m in models.values():
        groups.setdefault(m["variant"] if m["kind"] == "sink_lab" else None, []).append(m)
    out = {}
    for v, ms in groups.items():
        if v is None:
            continue
        per = [_scalars(m) for m in ms]
        keys = list(per[0])
        mean, std = mean_std(per, keys)
        out[v] = {"seeds": len(ms), "mean": mean, "std": std}
    return out


def table(lab: dict) -> tuple[list[str], list[list[str]]]:
    """One row per model: full loss (ppl), each K's loss and its change from full; task CEs for sink-lab models."""
    models = lab["models"]
    ks = _ks(models)
    task = any(m["kind"] == "sink_lab" for m in models.values())
    head = ["model", "full loss (ppl)"] + [f"K={k}: loss (Δ)" for k in ks]
    if task:
        head += ["backcopy CE full → " + " / ".join(f"K={k}" for k in ks),
                 "bigram CE full → " + " / ".join(f"K={k}" for k in ks)]
    rows = []
    for name, m in models.items():
        f = m["full"]
        row = [name, f"{f['loss']:.3f} ({f['ppl']:.2f})"]
        row += [f"{m['window'][k]['loss']:.3f} ({m['window'][k]['loss'] - f['loss']:+.3f})" for k in ks]
        if task:
            for t in TASK_KEYS:
                vals = [f.get(t)] + [m["window"][k].get(t) for k in ks]
                row.append(" / ".join("–" if v is None else f"{v:.3f}" for v in vals))
        rows.append(row)
    return head, rows


def variant_table(lab: dict) -> tuple[list[str], list[list[str]]] | None:
    bv = lab.get("by_variant") or {}
    if not bv:
        return None
    ks = _ks(lab["models"])
    head = ["variant", "seeds", "full loss"] + [f"K={k}: Δloss" for k in ks] + \
        ["backcopy CE full"] + [f"backcopy CE K={k}" for k in ks] + ["bigram CE full"] + [f"bigram CE K={k}" for k in ks]
    rows = []
    for v, e in bv.items():
        c = lambda key, d=3: pages.fmt_mean_std(e["mean"].get(key), e["std"].get(key), d)
        rows.append([v, str(e["seeds"]), c("full_loss")] + [c(f"K{k}_dloss") for k in ks] + [c("full_backcopy_ce")]
                    + [c(f"K{k}_backcopy_ce") for k in ks] + [c("full_bigram_ce")] + [c(f"K{k}_bigram_ce") for k in ks])
    return head, rows


KIND_WORDS = {"sink_lab": "sink-lab models", "text": "text models"}


def verdict_lines(lab: dict) -> list[str]:
    """The claims-table rule's verdict (verdict.py) on each kind of model measured, one line each."""
    w = lab["config"]["window"]
    return [f"Verdict (the claims-table rule, verdict.py), {KIND_WORDS.get(kind, kind)}, window {w}: {v['verdict']} - "
            f"{v['this_run']}" for kind, v in (lab.get("verdicts") or {}).items()]


def text_table(lab: dict) -> str:
    head, rows = table(lab)
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    line = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(head), "-" * len(line(head))] + [line(r) for r in rows] + verdict_lines(lab))


def make_plots(plot_dir, lab: dict) -> dict[str, Path]:
    """Per-position loss (mean over sequences) per model: full attention and each K, the window edge marked."""

    models = lab["models"]
    n = len(models)
    cols = min(3, n)
    rows = (n + cols - 1) // cols
    fig, axes = pages.subplots(rows, cols, figsize=(4.6 * cols, 3.4 * rows), squeeze=False)
    W = lab["config"]["window"]
    for ax, (name, m) in zip(axes.flat, models.items()):
        ax.plot(m["full"]["per_position"], color="black", lw=1.2, label="full attention")
        for k, w in m["window"].items():
            ax.plot(w["per_position"], lw=1.0, alpha=0.85, label=f"window {W}, K={k} sink token(s)")
        ax.axvline(W, ls="--", color="gray", lw=0.8)
        ax.set_title(name, fontsize=9)
        ax.set(xlabel="query position t (predicts t + 1)", ylabel="loss (nats)")
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    return {"per_position": save_png(fig, Path(plot_dir) / "per_position_loss.png")}


def blocks(lab: dict) -> list[tuple]:
    c = lab["config"]
    head, rows = table(lab)
    out = [("p", f"Window W={c['window']} recent tokens (the current one included) plus K sink tokens (the first K of "
                 f"the sequence, kept forever; K=0 = a plain sliding window that has evicted the first token), "
                 f"StreamingLLM cache positions; loss in nats over {lab['scored_positions']}; Δ = windowed minus "
                 f"full attention on the same positions. {c['sequences']} held-out sequences per model."),
           ("table", head, rows)]
    vt = variant_table(lab)
    if vt:
        out += [("p", "Sink-lab models by variant (mean ± std over seeds): the loss change of each window against "
                      "full attention, and the task's two kinds of positions (backcopy: trigger queries, whose target "
                      "is the token before the trigger; bigram: every other query)."), ("table", *vt)]
    out += [("p", line) for line in verdict_lines(lab)]
    return out


def write(out_dir, lab: dict) -> None:
    pages.write_lab(out_dir, "gattn lab streaming: sliding-window decoding with and without sink tokens", blocks(lab),
                    lab.get("plots", {}), "Loss per position: full attention vs the rolling window",
                    f"CPU time {lab['cpu_time_s']:.0f} s, wall {lab['wall_time_s']:.0f} s.")
