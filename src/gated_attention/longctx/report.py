"""The `gattn longctx` report: Table 5 in small from the cached stage results (report.md tables, report.json, report.png).

Pure functions of the results dict that longctx/pipeline.py collects; nothing here trains or evaluates.
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np

from gated_attention.gates import get_gate
from gated_attention.io import atomic_save_figure

def bucket_ppl(pos_loss: list[float], edges: list[int]) -> list[float]:
    """exp(mean loss) over each [edges[i], edges[i+1]) position range."""
    return [math.exp(sum(pos_loss[a:b]) / (b - a)) for a, b in zip(edges, edges[1:])]


VARIANTS = ("none", "yarn")


def _label(gate: str) -> str:
    return "Baseline" if get_gate(gate) is None else f"Gated ({gate})"


def _sub(a, b):
    return None if a is None or b is None else a - b


def _fmt(v, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def build_report(results: dict, b, lengths: list[int], factor: int, gates: list[str]) -> dict:
    L = b.seq_len
    edges = [0, L] + [L * 2 ** i for i in range(1, int(math.log2(factor)) + 1)]
    rows = []
    for variant in VARIANTS:
        for gate in gates:
            r = results[(gate, variant)]
            avg = {int(k): v for k, v in r["average"].items()}
            row = dict(gate=gate, variant=variant, average=avg,
                       drop_from_L={n: _sub(avg[n], avg[L]) for n in lengths if n > L},  # extrapolation loss
                       tasks={t: {int(k): v for k, v in s.items()} for t, s in r["scores"].items()},
                       answer_nll={int(k): v for k, v in r["average_answer_nll"].items()},
                       ppl_buckets=dict(zip([f"{a}-{c}" for a, c in zip(edges, edges[1:])],
                                            bucket_ppl(r["pos_loss"], edges))))
            if variant == "yarn":
                base = {int(k): v for k, v in results[(gate, "none")]["average"].items()}
                row["delta"] = {n: _sub(avg[n], base[n]) for n in lengths}
            rows.append(row)
    return dict(train_length=L, factor=factor, lengths=lengths, gates=gates, budget=dataclasses.asdict(b),
                rows=rows, pos_loss={f"{g}-{v}": results[(g, v)]["pos_loss"] for g in gates for v in VARIANTS})


def format_markdown(rep: dict) -> str:
    L, factor, lengths = rep["train_length"], rep["factor"], rep["lengths"]
    b = rep["budget"]

    def name(row):
        label = _label(row["gate"])
        return f"{label} ({L} model)" if row["variant"] == "none" else f"{label} + YaRN -> {factor * L}"

    out = [f"# Table 5 in small: RULER average (%) by context length (trained at L={L})", "",
           f"Tasks {', '.join(b['mix_tasks'])}; {b['samples']} samples per task and length; model preset "
           f"{b['model']}{' ' + json.dumps(b['model_overrides']) if b['model_overrides'] else ''}, {b['steps']} steps x {b['batch_size']} x {L} tokens, "
           f"retrieval mix {b['retrieval_mix']}. YaRN rows: in brackets the change against the same model without "
           f"YaRN at that length (the paper's deltas). Lengths above L are beyond the training length. Averages are over "
           f"the tasks whose prompt fits the length; '-' = none fits.", "",
           "| Method | " + " | ".join(str(n) for n in lengths) + " |",
           "|---|" + "---|" * len(lengths)]
    for row in rep["rows"]:
        cells = []
        for n in lengths:
            c = _fmt(row["average"][n])
            if row["variant"] == "yarn" and row["delta"][n] is not None:
                c += f" ({row['delta'][n]:+.1f})"
            cells.append(c)
        out.append(f"| {name(row)} | " + " | ".join(cells) + " |")
    longer = [n for n in lengths if n > L]
    out += ["", f"## Degradation beyond the training length: score at n minus score at L={L}", "",
            "| Method | " + " | ".join(str(n) for n in longer) + " |", "|---|" + "---|" * len(longer)]
    for row in rep["rows"]:
        out.append(f"| {name(row)} | " + " | ".join(_fmt(row['drop_from_L'][n], "+.1f") for n in longer) + " |")
    out += ["", "## Answer NLL (nats/token, teacher-forced, lower is better): recall that string match cannot see",
            "", "| Method | " + " | ".join(str(n) for n in lengths) + " |", "|---|" + "---|" * len(lengths)]
    for row in rep["rows"]:
        out.append(f"| {name(row)} | " + " | ".join(_fmt(row['answer_nll'][n], ".3f") for n in lengths) + " |")
    out += ["", "## Per task", "", "| Method | Task | " + " | ".join(str(n) for n in lengths) + " |",
            "|---|---|" + "---|" * len(lengths)]
    for row in rep["rows"]:
        for t, s in row["tasks"].items():
            out.append(f"| {name(row)} | {t} | " + " | ".join(_fmt(s[n]) for n in lengths) + " |")
    buckets = list(rep["rows"][0]["ppl_buckets"])
    out += ["", "## Perplexity by position on corpus validation text (positions beyond L are extrapolation)", "",
            "| Method | " + " | ".join(f"pos {k}" for k in buckets) + " |", "|---|" + "---|" * len(buckets)]
    for row in rep["rows"]:
        out.append(f"| {name(row)} | " + " | ".join(f"{row['ppl_buckets'][k]:.2f}" for k in buckets) + " |")
    return "\n".join(out) + "\n"


def plot_report(rep: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # headless
    import matplotlib.pyplot as plt

    L, lengths = rep["train_length"], rep["lengths"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = {g: c for g, c in zip(rep["gates"], ["tab:blue", "tab:red", "tab:green", "tab:purple"])}
    for row in rep["rows"]:
        ls = "-" if row["variant"] == "none" else "--"
        label = _label(row["gate"]) + (" + YaRN" if row["variant"] == "yarn" else "")
        ax1.plot(lengths, [np.nan if row["average"][n] is None else row["average"][n] for n in lengths], ls, marker="o", color=colors[row["gate"]], label=label)
        pos = np.asarray(rep["pos_loss"][f"{row['gate']}-{row['variant']}"])
        w = max(1, len(pos) // 64)  # average over windows of positions: single positions are noisy
        n = len(pos) // w
        ax2.plot(np.arange(n) * w + w / 2, np.exp(pos[:n * w].reshape(n, w).mean(1)), ls,
                 color=colors[row["gate"]], label=label)
    for ax in (ax1, ax2):
        ax.axvline(L, color="gray", lw=1, ls=":")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax1.set_xscale("log", base=2)
    ax1.set_xticks(lengths, [str(n) for n in lengths])
    ax1.set_xlabel("context length (tokens); dotted = training length")
    ax1.set_ylabel("RULER average (%)")
    ax1.set_ylim(-3, 103)
    ax2.set_xlabel("position (tokens)")
    ax2.set_ylabel("perplexity (corpus validation)")
    ax2.set_yscale("log")
    fig.tight_layout()
    atomic_save_figure(fig, path, dpi=110)
    plt.close(fig)
