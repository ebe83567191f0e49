"""Plots and report of the retrofit lab (lab.json in, PNGs + report.md + self-contained report.html out).

Plots: learning curves per recipe and the control (mean over starts x seeds, band = min..max): the sink, the skill
(backcopy CE on the sink task, validation loss on text), and the gate score on dormant vs active queries.
"""
from __future__ import annotations

from pathlib import Path

from ...experiment import pages
from ...experiment.pages import fmt_mean_std
from ...experiment.stats import seed_curves
from ...experiment.verdicts import Threshold
from ...experiment.verdicts import cells as threshold_table
from ...util.io import save_png
from .recipes import CONTROL

# (column title, lab.json key, decimals) of the main table; *_before / *_after pairs print as "before -> after"
COLUMNS = [("sink", "sink", 3), ("skill", "skill", 3), ("backcopy CE", "backcopy_ce", 3), ("bigram CE", "bigram_ce", 3),
           ("heads > 0.3", "sink_rate", 2), ("M-Act", "m_act", 1), ("gate dormant", "gate_dormant", 3),
           ("gate active", "gate_active", 3), ("streaming loss, BOS evicted", "streaming_loss_after", 3),
           ("BOS kept", "streaming_loss_kept_after", 3), ("steps", "steps", 0),
           ("steps to sink ≤ 0.2", "steps_to_sink_target", 0)]
_SKILL = {"sink": "task CE (nats)", "text": "Avg PPL"}


def _entries(lab: dict) -> dict[str, dict]:
    return {CONTROL: lab["control"], **lab["recipes"]}


def _cell(e: dict, key: str, d: int) -> str:
    m, s = e["mean"], e["std"]
    if f"{key}_after" in m:
        return f"{fmt_mean_std(m.get(key + '_before'), s.get(key + '_before'), d)} → " \
               f"{fmt_mean_std(m.get(key + '_after'), s.get(key + '_after'), d)}"
    return fmt_mean_std(m.get(key), s.get(key), d)


def table_cells(lab: dict) -> tuple[list[str], list[list[str]]]:
    # backcopy/bigram CE and steps to sink <= 0.2 are the sink task's (a text model's F-Attn is far below 0.2 already)
    cols = [c for c in COLUMNS if lab["kind"] == "sink" or c[1] not in ("backcopy_ce", "bigram_ce",
                                                                         "steps_to_sink_target")]
    head = ["recipe", "n"] + [("skill: " + _SKILL[lab["kind"]]) if k == "skill" else t for t, k, _ in cols]
    rows = [[name, str(len(e["per_seed"]))] + [_cell(e, k, d) for _, k, d in cols] for name, e in _entries(lab).items()]
    return head, rows


def paired_cells(lab: dict) -> tuple[list[str], list[list[str]]]:
    keys = ["sink_after", "skill_after"] + (["backcopy_ce_after", "bigram_ce_after"] if lab["kind"] == "sink" else []) \
        + ["streaming_loss_after"]
    head = ["recipe − control"] + [k.replace("_after", "") for k in keys]
    rows = []
    for name, e in lab["recipes"].items():
        row = [name]
        for k in keys:
            i = e["vs_control"][k]
            if i["mean"] is None:
                row.append("–")
            elif i["ci95"] is None:
                row.append(f"{i['mean']:+.3f} (n={i['n']})")
            else:
                row.append(f"{i['mean']:+.3f} ± {i['ci95']:.3f}")
        rows.append(row)
    return head, rows


def target_cells(lab: dict) -> tuple[list[str], list[list[str]]]:
    t = lab["targets"]
    head = ["recipe", f"sink ≤ {t['sink_after_le']:g} (max over seeds)", "backcopy CE − control",
            "bigram CE − control", f"steps ≤ {t['step_share_le']:.0%} of training", "target met"]
    rows = []
    for name, e in lab["recipes"].items():
        c = e["target"]
        rows.append([name, f"{'yes' if c['sink_le_target'] else 'no'} ({c['sink_after_max']:.3f})"
                     if c["sink_after_max"] is not None else "–",
                     _signed(c.get("backcopy_ce_after_vs_control")), _signed(c.get("bigram_ce_after_vs_control")),
                     "yes" if c["steps_le_target"] else "no", "**yes**" if c["met"] else "no"])
    return head, rows


def _signed(v) -> str:
    return "–" if v is None else f"{v:+.3f}"


def text_table(lab: dict) -> str:
    return pages.text_table(*table_cells(lab))


def make_plots(plot_dir, lab: dict) -> dict[str, Path]:
    import matplotlib.pyplot as plt

    plot_dir = Path(plot_dir)
    entries = _entries(lab)  # {recipe: {"per_seed": [...]}}
    colors = {n: plt.get_cmap("tab20")(i % 20) for i, n in enumerate(entries)}  # one colour per recipe
    skill_key, skill_label = (("backcopy_ce", "backcopy CE (nats)") if lab["kind"] == "sink"
                              else ("val_loss", "validation loss (nats)"))
    sink_label = "BOS attention, dormant queries" if lab["kind"] == "sink" else "F-Attn (attention on token 0)"
    fig, axes = pages.subplots(1, 3, figsize=(17, 4.4))
    for ax, key, ylabel in ((axes[0], "sink", sink_label), (axes[1], skill_key, skill_label),
                            (axes[2], "gate_dormant", "gate score, dormant (solid) / active (dashed)")):
        for name, (xs, ys, lo, hi) in seed_curves(entries, key).items():
            if not xs:
                continue
            ax.plot(xs, ys, label=name, lw=1.5, color=colors[name])
            ax.fill_between(xs, lo, hi, color=colors[name], alpha=0.12, lw=0)
            if key == "gate_dormant":
                xa, ya, _, _ = seed_curves({name: entries[name]}, "gate_active")[name]
                ax.plot(xa, ya, ls="--", color=colors[name], lw=1.2)
        ax.set(xlabel="retrofit step", ylabel=ylabel)
    axes[0].set(title="the sink (band: min..max over starts x seeds)")
    if lab["kind"] == "sink":
        axes[0].axhline(lab["targets"]["sink_after_le"], ls=":", color="gray", lw=0.8)
        axes[1].set(yscale="log")
    axes[1].set(title="skill")
    axes[2].set(title="gate scores")
    handles = [plt.Line2D([], [], color=colors[n], lw=2) for n in entries]
    fig.legend(handles, list(entries), loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    fig.tight_layout()
    return {"curves": save_png(fig, plot_dir / "learning_curves.png")}


def blocks(lab: dict) -> list[tuple]:
    c = lab["config"]
    starts = "; ".join(f"{k} ({v['source']}, {v['model_dir']}, trained {v.get('trained_steps') or '?'} steps)"
                       for k, v in lab["start"].items())
    plans = "; ".join(f"{k}: {p['steps']} steps of {p['batch_size']} at lr {p['lr']:g}, weight decay "
                      f"{p['weight_decay']:g}, streaming window {p['window']}" for k, p in c["plans"].items())
    head, rows = table_cells(lab)
    out = [
        ("p", f"Question: can a gate added to a trained ungated model remove its attention sink, and at what cost? "
              f"Starting models ({lab['kind']}): {starts}. Retrofit: {plans}; {c['seeds']} seed(s) per start; "
              f"precision {c['resolved_precision']}. Every recipe and the control see the same batches."),
        ("p", "Columns: mean ± std over starts × seeds, 'before → after' where both exist (before = the starting "
              "model as trained). Sink: " + ("attention on BOS from dormant (non-trigger) queries at the backcopy "
                                            "head" if lab["kind"] == "sink" else "F-Attn") +
              "; heads > 0.3 = share of heads whose mean attention on token 0 exceeds Gu et al.'s 0.3; M-Act = max "
              "|hidden state| (mean over layers); gate = mean gate score on dormant vs active queries (identity init "
              "starts at 1.0 on a 0..2 scale, the official init near 0.5 on 0..1); streaming loss = next-token CE "
              "with a sliding window and the first token evicted (BOS kept: StreamingLLM's fix), positions past the "
              "window."),
        ("table", head, rows),
        ("h2", "Each recipe against the control (paired by start and seed: mean difference ± 95 % interval)"),
        ("table", *paired_cells(lab)),
    ]
    if lab["kind"] == "sink":
        out += [("h2", "The lab's target on the sink lab"), ("table", *target_cells(lab))]
        if lab.get("thresholds"):  # labs written before the thresholds were recorded have only "targets"
            out += [("p", "Thresholds and where they come from (fixed before the lab ran):"),
                    ("table", *threshold_table({"target": [Threshold(**t) for t in lab["thresholds"]]}))]
    out += [("h2", "Recipes (LRs as multiples of the lab's peak LR; penalties stop at the given share of the steps)"),
            ("table", ["recipe", "gate", "init", "gate LR", "rest LR", "gates alone first", "BOS penalty", "gate L1",
                       "penalties until", "what it is"],
             [[n, s["gate"] or "–", s["init"] if s["gate"] else "–", f"{s['gate_lr']:g}" if s["gate"] else "–",
               f"{s['rest_lr']:g}", f"{s['gates_first']:.0%}", f"{s['bos_penalty']:g}", f"{s['gate_l1']:g}",
               f"{s['penalty_until']:.0%}", s["help"]] for n, s in lab["recipe_settings"].items()])]
    return out


def write(out_dir, lab: dict) -> None:
    pages.write_lab(out_dir, "gattn lab retrofit: can gates added to a trained model remove its sink?", blocks(lab),
                    lab.get("plots", {}), "Learning curves (mean over starts × seeds; band min..max)",
                    f"Wall time of this invocation: {lab['wall_time_s']:.0f} s (reused units cost nothing).")
