"""Rendering of a `gattn compare` result: the Table-4 style table (the text `gattn compare` prints), the report's blocks
(report.md and the self-contained report.html through experiment.pages, like every job's) and the loss-curve plot.

The per-layer, attention-map and gate-histogram plots come from gated_attention.analysis.plots; only the loss-curve
plot (which needs the training logs) lives here.
"""
from __future__ import annotations

import math
from pathlib import Path

from ..experiment import pages
from ..experiment.pages import fmt
from ..util.io import save_png

# (column title, row key, decimals); the first seven are the paper's Table 4 columns that we can measure
TABLE4 = [("Variant", "variant", None), ("Params", "params", None), ("Avg PPL", "avg_ppl", 3),
          ("Mean gate", "gate_mean", 3), ("M-Act", "m_act", 1), ("F-Attn", "f_attn", 3), ("Loss spikes", "spikes", 0),
          ("F-Attn max layer", "f_attn_max_layer", 3), ("uniform F-Attn", "uniform_f_attn", 3),
          ("Sink rate", "sink_rate", 2)]


def _table4_cells(result: dict) -> tuple[list[str], list[list[str]]]:
    head = [t for t, _, _ in TABLE4]
    rows = [[fmt(r.get(k), d) if k != "variant" else r["variant"] for _, k, d in TABLE4]
            for r in result["rows"].values()]
    return head, rows


def _domain_cells(result: dict) -> tuple[list[str], list[list[str]]]:
    domains = []
    for r in result["rows"].values():
        for d in (r.get("val_ppl") or {}):
            if d not in domains:
                domains.append(d)
    head = ["Variant"] + domains + ["Avg PPL"]
    rows = [[r["variant"]] + [fmt((r.get("val_ppl") or {}).get(d), 2) for d in domains] + [fmt(r.get("avg_ppl"), 3)]
            for r in result["rows"].values()]
    return head, rows


def _extra_cells(result: dict) -> tuple[list[str], list[list[str]]]:
    cols = [("Variant", "variant", None), ("tokens", "tokens", 0), ("train s", "train_wall_time_s", 0),
            ("final loss", "final_loss_avg10", 3), ("max |attn out|", "max_abs_attn_output", 1),
            ("max |ffn out|", "max_abs_ffn_output", 1), ("mean |Y| pre gate", "mean_abs_y_pre_gate", 3),
            ("mean |Y| post gate", "mean_abs_y_post_gate", 3), ("|Y|<1e-2 pre", "sparsity_pre_gate_0.01", 3),
            ("|Y|<1e-2 post", "sparsity_post_gate_0.01", 3), ("|Y|<1e-2 pre×mean gate", "sparsity_pre_gate_x_mean_gate_0.01", 3),
            ("skipped steps", "skipped_steps", 0)]
    head = [c for c, _, _ in cols]
    rows = []
    for r in result["rows"].values():
        row = []
        for _, k, d in cols:
            v = r.get(k)
            row.append(r["variant"] if k == "variant" else fmt(int(v) if d == 0 and isinstance(v, float) else v, d))
        rows.append(row)
    return head, rows


def _layer_cells(result: dict) -> tuple[list[str], list[list[str]]]:
    n = max((len(r["per_layer"]["f_attn"]) for r in result["rows"].values()), default=0)
    head = ["Variant", "metric"] + [f"L{i}" for i in range(n)]
    rows = []
    for r in result["rows"].values():
        rows.append([r["variant"], "F-Attn"] + [fmt(v, 3) for v in r["per_layer"]["f_attn"]])
        rows.append([r["variant"], "M-Act"] + [fmt(v, 1) for v in r["per_layer"]["m_act"]])
    return head, rows


def render_table(result: dict) -> str:
    """The Table-4 style table as aligned text (what `gattn compare` prints)."""
    return pages.text_table(*_table4_cells(result))


def _lrs(result: dict) -> str:
    """Each variant's peak LR (one number when they share it) and where the LRs come from."""
    m = result.get("ppl_measure") or {}
    lrs = m.get("lr") or {}
    if not lrs:
        return f"{result['train_config']['lr']:g}"
    vals = set(lrs.values())
    text = f"{vals.pop():g}" if len(vals) == 1 else ", ".join(f"{v} {x:g}" for v, x in lrs.items())
    return text + (f" — {m['lr_source']}" if m.get("lr_source") else "")


def _intro(result: dict) -> list[str]:
    c = result["train_config"]
    mo = c.get("model_overrides") or {}
    shape = ", ".join(f"{k}={v}" for k, v in mo.items())
    a = result["analysis"]
    return [
        f"Budget `{result['budget']}`: model preset `{c['model']}` ({shape or 'preset shape'}), seq_len {c['seq_len']}, "
        f"batch {c['batch_size']}, {c['steps']} steps ({c['steps'] * c['batch_size'] * c['seq_len']:,} tokens per "
        f"variant and seed), peak LR {_lrs(result)} ({c['schedule']}, warm-up {c['warmup_steps']}), weight decay "
        f"{c['weight_decay']:g}, precision {c['precision']} -> {result.get('resolved_precision', c['precision'])}, "
        f"seeds {c['seed']}..{c['seed'] + result.get('seeds', 1) - 1}. Every variant sees the same batches in the same "
        f"order per seed; gated variants shrink the FFN to match the baseline's parameter count. The tables and plots "
        f"are seed {c['seed']}'s models; the perplexity row's Δ pairs every seed.",
        f"Analysis on {a['tokens']:,} held-out tokens ({a['batches']} batches of {a['batch_size']} x {a['seq_len']}, "
        f"each window starting with {a['first_token']}). F-Attn = attention probability on token 0, mean over heads, "
        f"queries and layers (\"uniform F-Attn\" is its value with uniform causal attention: no sink). M-Act = mean over "
        f"layers of the max |hidden state| a layer outputs. Mean gate = mean gate score over all entries and tokens. "
        f"Sink rate = share of heads whose mean attention on token 0 exceeds 0.3. Loss spikes: steps whose loss exceeds "
        f"the trailing {c['spike_window']}-step median by more than max({c['spike_delta']:g} nats, "
        f"{c.get('spike_noise_k', 0):g} robust sigmas of that window).",
        f"Wall time of this invocation: {result['wall_time_s']:.0f} s (reused runs cost nothing).",
    ]


_PLOT_TITLES = {"loss": "Training loss", "layers": "Per-layer F-Attn and M-Act", "gates": "Gate-score histograms"}


def _plot_title(key: str) -> str:
    if key.startswith("maps_"):
        return f"Attention maps (head average): {key[5:]}"
    return _PLOT_TITLES.get(key, key)


def _claims_cells(result: dict):
    from .claims import claims_cells

    return claims_cells(result.get("claims") or [])


_CLAIMS_NOTE = ("Each row: the paper's figure (Qiu et al. 2025; 15A2B MoE at 400B tokens unless stated), this run's "
                "figure, a verdict and its rule (gated_attention/compare/claims.py and the labs' verdict.py). 'not at "
                "this scale' = measured here without the paper's effect; 'not run here' names the command that "
                "measures it.")
_THRESHOLDS_NOTE = ("Every threshold was fixed before the runs it judges and none is fitted to this project's "
                    "measurements. Kind: paper = the paper's own figure (SPEC § = the section of the project's spec "
                    "that quotes it), published = another published result, chosen = an effect size chosen in "
                    "advance for what a user would notice.")


def _sink_lab_intro(result: dict) -> str:
    lab = result["sink_lab"]
    t, c = lab["task"], lab["config"]
    return (f"`gattn lab sinks` on the same variants (lab.json in {lab['dir']}/): Bigram-Backcopy, V={t['vocab']}, "
            f"k={t['triggers']} triggers, T={t['seq_len']}; {c['layers']} layer x {c['heads']} head, "
            f"d={c['hidden_size']}, {c['steps']} steps at lr {c['lr']:g}, {c['seeds']} seed(s). Attention on BOS "
            f"from dormant (non-trigger) queries is the sink; read it next to backcopy CE (the task's skill).")


def _streaming_intro(result: dict) -> str:
    st = result["streaming"]
    w = ", ".join(f"{src} models W={x}" for src, x in st["window"].items())
    return (f"`gattn lab streaming` on this run's models (lab.json in {st['dir']}/): next-token loss with full "
            f"attention vs a rolling KV window ({w}) that keeps the first K tokens (K = "
            f"{', '.join(map(str, st['sink_tokens']))}; K=0 = a plain window, the first token evicted), StreamingLLM "
            f"cache positions, on the positions past the window; Δ = window minus full.")


def _lab_sections(result: dict) -> list[tuple[str, str, list[str], list[list[str]], dict]]:
    """(title, intro, table head, rows, plots) of the labs compare ran: the sink lab, the streaming check."""
    out = []
    if result.get("sink_lab"):
        lab = result["sink_lab"]
        out.append(("Sink lab (Bigram-Backcopy)", _sink_lab_intro(result), lab["table"]["head"],
                    lab["table"]["rows"], lab.get("plots", {})))
    if result.get("streaming"):
        st = result["streaming"]
        out.append(("Streaming check (sliding window, with and without sink tokens)", _streaming_intro(result),
                    st["table"]["head"], st["table"]["rows"], st.get("plots", {})))
    return out


TITLE = "gattn compare: gated attention vs baseline"


def blocks(result: dict) -> list[tuple]:
    """The whole report as experiment.pages blocks: the claims table first, then Table 4 and its companions, the
    labs compare ran, and the plots."""
    out = []
    if result.get("claims"):
        from .claims import thresholds_cells

        out += [("h2", "Paper claims vs this run"), ("table", *_claims_cells(result)), ("p", _CLAIMS_NOTE),
                ("h3", "Thresholds and where they come from"), ("p", _THRESHOLDS_NOTE), ("table", *thresholds_cells())]
    out += [("p", p) for p in _intro(result)]
    out += [("h2", "Table 4 form"), ("table", *_table4_cells(result)),
            ("h2", "Per-domain perplexity (held-out)"), ("table", *_domain_cells(result)),
            ("h2", "Per-layer F-Attn and M-Act"), ("table", *_layer_cells(result)),
            ("h2", "More measurements"), ("table", *_extra_cells(result))]
    for title, intro, head, rows, plots in _lab_sections(result):
        out += [("h2", title), ("p", intro), ("table", head, rows)]
        out += [("img", f"{title.split(' (')[0]}: {key}", rel) for key, rel in plots.items()]
    out.append(("h2", "Plots"))
    out += [("img", _plot_title(key), rel) for key, rel in result.get("plots", {}).items()]
    return out


def write(out_dir: str | Path, result: dict) -> None:
    """report.md and the self-contained report.html into out_dir."""
    pages.write(out_dir, TITLE, blocks(result))


# ---------------------------------------------------------------- plots

def _smooth(ys: list[float], window: int) -> list[float]:
    """Trailing mean over `window` steps (raw per-step losses are too noisy to compare variants by eye)."""
    out, acc, q = [], 0.0, []
    for y in ys:
        q.append(y)
        acc += y
        if len(q) > window:
            acc -= q.pop(0)
        out.append(acc / len(q))
    return out


def plot_loss_curves(logs: dict[str, list[dict]], path) -> Path:
    """All variants' training loss on one chart (trailing mean), spikes marked."""

    fig, ax = pages.subplots(figsize=(8, 4.5))
    for label, recs in logs.items():
        recs = [r for r in recs if isinstance(r.get("loss"), float) and math.isfinite(r["loss"])]
        if not recs:
            continue
        xs = [r["step"] for r in recs]
        ys = _smooth([r["loss"] for r in recs], max(1, len(recs) // 50))
        line, = ax.plot(xs, ys, lw=1.2, label=label)
        sp = [r for r in recs if r.get("spike")]
        if sp:
            ax.scatter([r["step"] for r in sp], [r["loss"] for r in sp], s=12, color=line.get_color(), marker="x")
    ax.set(xlabel="step", ylabel="train loss (trailing mean)", title="training loss (x = loss spike)")
    lo = [r["loss"] for recs in logs.values() for r in recs[len(recs) // 5:]
          if isinstance(r.get("loss"), float) and math.isfinite(r["loss"])]
    if lo:  # zoom on the part of training where variants differ, not the first steps' drop
        ax.set_ylim(min(lo) - 0.05, max(lo) + 0.1)
    ax.legend(fontsize=9)
    return save_png(fig, path)


def make_plots(plot_dir, analyses: dict[str, dict], logs: dict[str, list[dict]]) -> dict[str, Path]:
    """Every plot of the report; returns {key: path}."""
    from gated_attention.analysis import plots as P

    plot_dir = Path(plot_dir)
    files = {"loss": plot_loss_curves(logs, plot_dir / "loss_curves.png"),
             "layers": P.plot_layer_curves(analyses, plot_dir / "layers_fattn_mact.png")}
    g = P.plot_gate_histograms(analyses, plot_dir / "gate_histograms.png")
    if g is not None:
        files["gates"] = g
    for name, a in analyses.items():
        files[f"maps_{name}"] = P.plot_attention_maps(a, plot_dir / f"attention_maps_{name}.png", title=name)
    return files
