"""Plots and report of the sink lab (lab.json in, PNGs + report.md + self-contained report.html out).

Plots: attention on BOS from dormant queries vs step (mean over seeds, band = min..max) next to backcopy CE vs step;
the backcopy head's attention map per variant (seed 0, trigger rows marked); gate score on dormant vs active queries.
"""
from __future__ import annotations

from pathlib import Path

from ...experiment import pages
from ...experiment.stats import seed_curves
from ...util.io import save_png

# (column title, metric key, decimals) of the main table
COLUMNS = [("BOS attn, dormant", "bos_attention_dormant", 3), ("BOS attn, active", "bos_attention_active", 3),
           ("prev-token attn, active", "prev_attention_active", 3), ("backcopy CE", "backcopy_ce", 3),
           ("bigram CE", "bigram_ce", 3), ("bigram floor", "bigram_ce_floor", 3),
           ("gate, dormant", "gate_dormant", 3), ("gate, active", "gate_active", 3),
           ("value drain", "value_drain_ratio", 2), ("residual peak", "residual_peak_ratio", 2),
           ("steps to skill", "steps_to_skill", 0)]


def table_cells(lab: dict) -> tuple[list[str], list[list[str]]]:
    head = ["Variant", "seeds"] + [c for c, _, _ in COLUMNS]
    rows = []
    for name, v in lab["variants"].items():
        n = len(v["per_seed"])
        row = [name, str(n)]
        for _, k, d in COLUMNS:
            cell = pages.fmt_mean_std(v["mean"].get(k), v["std"].get(k), d)
            if k == "steps_to_skill" and v.get("skilled_seeds", n) < n:
                cell += f" ({v.get('skilled_seeds', 0)}/{n} seeds)"
            row.append(cell)
        rows.append(row)
    return head, rows


def text_table(lab: dict) -> str:
    """The lab's table as aligned text (what `gattn lab sinks` prints)."""
    return pages.text_table(*table_cells(lab))


def make_plots(plot_dir, lab: dict) -> dict[str, Path]:

    plot_dir = Path(plot_dir)
    files = {}
    fig, (a1, a2) = pages.subplots(1, 2, figsize=(12, 4.2))
    for ax, key, ylabel in ((a1, "bos_attention_dormant", "attention on BOS from dormant queries"),
                            (a2, "backcopy_ce", "backcopy CE (nats)")):
        for name, (xs, ys, lo, hi) in seed_curves(lab["variants"], key).items():
            if not xs:
                continue
            line, = ax.plot(xs, ys, label=name, lw=1.5)
            ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.15, lw=0)
        ax.set(xlabel="step", ylabel=ylabel)
        ax.legend(fontsize=8)
    n = max((len(v["per_seed"]) for v in lab["variants"].values()), default=1)
    a1.set(ylim=(0, 1), title=f"sink formation (band: min..max over {n} seeds)" if n > 1 else
           "sink formation (1 seed: no band)")
    a2.axhline(0.5, ls="--", color="gray", lw=0.8)
    a2.set(title="backcopy skill (dashed: the 0.5 'skilled' line)", yscale="log")
    files["curves"] = save_png(fig, plot_dir / "bos_attention_vs_step.png")

    names = list(lab["variants"])
    fig, axes = pages.subplots(1, len(names), figsize=(3.4 * len(names), 3.5), squeeze=False)
    for ax, name in zip(axes[0], names):
        r = lab["variants"][name]["per_seed"][0]
        m = r.get("attention_map") or [[0.0]]
        im = ax.imshow(m, cmap="viridis", vmin=0, vmax=1)
        for t in r.get("map_active_rows", []):
            ax.annotate("", xy=(-0.5, t), xytext=(-3.5, t), arrowprops=dict(arrowstyle="->", color="red", lw=1.2),
                        annotation_clip=False)
        layer, head = r.get("backcopy_head", [0, 0])
        ax.set_title(f"{name}\nlayer {layer} head {head}, seed {r['seed']}", fontsize=9)
        ax.set(xlabel="key", ylabel="query (red: trigger = active)")
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8)
    files["maps"] = save_png(fig, plot_dir / "attention_maps.png")

    gated = [(n, v) for n, v in lab["variants"].items() if v["mean"].get("gate_dormant") is not None]
    if gated:
        fig, ax = pages.subplots(figsize=(1.6 + 1.4 * len(gated), 3.8))
        xs = range(len(gated))
        for off, key, label in ((-0.2, "gate_dormant", "dormant queries"), (0.2, "gate_active", "active (trigger)")):
            ys = [v["mean"][key] or 0.0 for _, v in gated]
            err = [v["std"][key] or 0.0 for _, v in gated]
            ax.bar([x + off for x in xs], ys, width=0.4, yerr=err, capsize=3, label=label)
        ax.set_xticks(list(xs), [n for n, _ in gated], fontsize=8, rotation=15)
        ax.set(ylabel="mean gate score (backcopy head)", ylim=(0, 1), title="gate on dormant vs active queries")
        ax.legend(fontsize=8)
        files["gates"] = save_png(fig, plot_dir / "gate_dormant_vs_active.png")
    return files


_TITLES = {"curves": "Attention on BOS and backcopy CE over training",
           "maps": "Backcopy head's attention map (first tokens of a held-out sequence)",
           "gates": "Gate score on dormant vs active queries"}


def blocks(lab: dict, heading: str = "h2") -> list[tuple]:
    """Report blocks (experiment.pages) of a lab: used by write() and by `gattn compare`'s report."""
    t = lab["task"]
    c = lab["config"]
    head, rows = table_cells(lab)
    out = [
        ("p", f"Task: Bigram-Backcopy (Guo et al. 2024), V={t['vocab']} normal tokens, k={t['triggers']} triggers "
              f"(ids {t['trigger_ids']}), T={t['seq_len']}, Dirichlet({t['alpha']:g}) transition rows, task seed "
              f"{t['seed']}; bigram CE floor (the chain's entropy) {t['bigram_ce_floor']:.3f} nats. Model: "
              f"{c['layers']} layer(s) x {c['heads']} head(s), d={c['hidden_size']}, FFN {c['intermediate_size']} "
              f"(gated variants shrink it to equal parameters), gate init {c['gate_init']}; {c['steps']} steps of "
              f"{c['batch_size']} sequences, AdamW lr {c['lr']:g} ({c['schedule']}, warm-up {c['warmup_steps']}), "
              f"weight decay {c['weight_decay']:g}, {c.get('resolved_precision', c['precision'])}; seeds 0..{c['seeds'] - 1} (the "
              f"seeds column: those finished per variant), the same for every variant (init and data order)."),
        ("p", "Columns (mean ± std over seeds, measured on held-out sequences at the end of training, for the "
              "backcopy head = the head with the most attention on the previous token from trigger queries): "
              "attention on BOS from dormant (non-trigger) and active (trigger) queries; attention on the previous "
              "token from trigger queries (the backcopy itself); cross-entropy on backcopy positions (ideal 0) and on "
              "bigram positions next to the chain's entropy (the floor); mean gate score on dormant vs active "
              "queries; value drain = ||v_BOS|| / mean ||v_other||; residual peak = ||h_BOS|| / median ||h_other|| "
              "(largest over layers); steps to skill = first step where the training batches' backcopy CE "
              "(trailing 50-step mean) falls below 0.5. A 'no sink' from a model without backcopy skill proves "
              "nothing: read BOS attention next to backcopy CE."),
        ("table", head, rows),
    ]
    return out


def write(out_dir, lab: dict) -> None:
    pages.write_lab(out_dir, "gattn lab sinks: attention sinks on the Bigram-Backcopy task", blocks(lab),
                    lab.get("plots", {}), _TITLES,
                    f"Wall time of this invocation: {lab['wall_time_s']:.0f} s (reused models cost nothing).")
