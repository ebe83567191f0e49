"""PNG plots of an analysis dict (matplotlib Agg, no display): per-layer F-Attn and M-Act curves, head-averaged
attention maps of chosen layers, gate-score histograms. Each function takes one or more labelled analysis dicts so
`gattn compare` can overlay variants; every file is written atomically (temp file + rename).
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from ..util.io import save_png  # noqa: E402


def _figure(*args, **kwargs):
    """A figure whose panels' titles, labels and ticks each get their own room (constrained layout)."""
    return plt.subplots(*args, layout="constrained", **kwargs)


def _series(a: dict, key: str):
    xs, ys = [], []
    for e in a["layers"]:
        if e.get(key) is not None:
            xs.append(e["layer"])
            ys.append(e[key])
    return xs, ys


def plot_layer_curves(analyses: dict[str, dict], path) -> Path:
    """Two panels: per-layer F-Attn (with the uniform-attention reference) and per-layer M-Act (log scale)."""
    fig, (a1, a2) = _figure(1, 2, figsize=(11, 4))
    for label, a in analyses.items():
        xs, ys = _series(a, "first_token_attention")
        a1.plot(xs, ys, marker="o", label=f"{label} (mean {a['first_token_attention']:.3f})")
        xs, ys = _series(a, "max_abs_hidden")
        if ys:
            a2.plot(xs, ys, marker="o", label=f"{label} (mean {a['max_abs_hidden']:.1f})")
    first = next(iter(analyses.values()))
    xs, ys = _series(first, "uniform_first_token_attention")
    if ys:
        a1.plot(xs, ys, ls="--", color="gray", label="uniform attention")
    # from 0 to a little above the highest line, not to 1: near-uniform attention would be a flat line at the bottom
    a1.set(xlabel="layer", ylabel="attention on first token", title="F-Attn per layer", ylim=(0, None))
    a2.set(xlabel="layer", ylabel="max |hidden state|", title="M-Act per layer", yscale="log")
    for ax in (a1, a2):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # layers are whole numbers
    a1.legend(fontsize=8)
    a2.legend(fontsize=8)
    return save_png(fig, path)


def plot_activation_breakdown(analysis: dict, path, title: str = "") -> Path:
    """Per-layer maxima of attention output, post-attention residual, FFN output, post-FFN residual (Fig. 6 style)."""
    fig, ax = _figure(figsize=(6, 4))
    for key in ("max_abs_attn_output", "max_abs_attn_residual", "max_abs_ffn_output", "max_abs_ffn_residual",
                "max_abs_hidden"):
        xs, ys = _series(analysis, key)
        if ys and not (key == "max_abs_hidden" and _series(analysis, "max_abs_ffn_residual")[1]):
            ax.plot(xs, ys, marker=".", label=key.removeprefix("max_abs_"))
    ax.set(xlabel="layer", ylabel="max |value|", yscale="log", title=title or "massive activations by sub-block")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize=8)
    return save_png(fig, path)


def plot_attention_maps(analysis: dict, path, title: str = "") -> Path:
    """Head-averaged attention maps of the chosen layers (batch element 0, first n tokens)."""
    maps = analysis.get("attention_maps") or {}
    n = max(1, len(maps))
    fig, axes = _figure(1, n, figsize=(3.2 * n + 0.8, 3.4), squeeze=False)
    for ax, (layer, m) in zip(axes[0], sorted(maps.items(), key=lambda kv: int(kv[0]))):
        im = ax.imshow(m, cmap="viridis", vmin=0, vmax=1)
        first = sum(r[0] for r in m) / max(len(m), 1)
        ax.set_title(f"layer {layer}: {first:.0%} on token 0", fontsize=9)
        ax.set_xlabel("key")
        ax.set_ylabel("query")
    if maps:
        fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8)
    if title:
        fig.suptitle(title)
    return save_png(fig, path)


def plot_gate_histograms(analyses: dict[str, dict], path) -> Path | None:
    """Gate-score histograms summed over layers, one line per gated analysis (Fig. 3 style); None without gates."""
    fig, ax = _figure(figsize=(6, 4))
    drawn = False
    for label, a in analyses.items():
        hs = [e["gate_histogram"] for e in a["layers"] if e.get("gate_histogram")]
        if not hs:
            continue
        edges = hs[0]["edges"]
        counts = [sum(h["counts"][i] for h in hs) for i in range(len(edges) - 1)]
        total = max(sum(counts), 1)
        ax.stairs([c / total for c in counts], edges, label=f"{label} (mean {a['gate_mean']:.3f})")
        drawn = True
    if not drawn:
        plt.close(fig)
        return None
    # finite values only: a NaN gate (reported in analysis.json) must not make the axis limits NaN
    lo = min((a["gate_min"] for a in analyses.values() if _finite(a.get("gate_min"))), default=0.0)
    hi = max((a["gate_max"] for a in analyses.values() if _finite(a.get("gate_max"))), default=1.0)
    ax.set(xlabel="gate score", ylabel="share of gate entries", title="gate score distribution",
           xlim=(min(0.0, lo), max(1.0, hi)))
    ax.legend(fontsize=8)
    return save_png(fig, path)


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and v == v and abs(v) != float("inf")


def plot_all(analysis: dict, out_dir, label: str = "model") -> list[Path]:
    """Every plot for one analysis into out_dir; returns the written files."""
    out = Path(out_dir)
    files = [plot_layer_curves({label: analysis}, out / "layers_fattn_mact.png"),
             plot_activation_breakdown(analysis, out / "activations_by_block.png"),
             plot_attention_maps(analysis, out / "attention_maps.png")]
    g = plot_gate_histograms({label: analysis}, out / "gate_histogram.png")
    return files + ([g] if g else [])
