"""Rendering of a stability-lab result (lab.json): plots (final loss vs LR per QK-norm setting, max attention logit
vs LR, training curves at the highest LR), report.md and a self-contained report.html (PNGs inlined as base64).
"""
from __future__ import annotations

from pathlib import Path

from ...experiment import report as page
from ...experiment.report import fmt, md_table
from ...gates import canonical_name
from ...util.io import save_png

_NAMES = {"baseline": "baseline", "none": "baseline (none)", "sdpa_elementwise": "G1 elementwise",
          "sdpa_headwise": "G1 headwise"}


def _name(v: str) -> str:
    return _NAMES.get(v, v)


def _qk(on: bool) -> str:
    return "on" if on else "off"


def _by_lr(rows: list[dict], key: str) -> tuple[list[float], list[float | None]]:
    """Seed-mean of `key` per LR (None where every seed's value is missing)."""
    acc: dict[float, list[float]] = {}
    for r in rows:
        acc.setdefault(r["lr"], [])
        if r.get(key) is not None:
            acc[r["lr"]].append(r[key])
    lrs = sorted(acc)
    return lrs, [sum(acc[x]) / len(acc[x]) if acc[x] else None for x in lrs]


def _settings(lab: dict) -> list[tuple[str, bool]]:
    seen = []
    for r in lab["runs"]:
        if (r["variant"], r["qk_norm"]) not in seen:
            seen.append((r["variant"], r["qk_norm"]))
    return seen


# ---------------------------------------------------------------- plots

def plot_loss_vs_lr(lab: dict, qk: bool, path) -> Path:

    fig, ax = page.subplots(figsize=(7, 4.5))
    inits = []
    for v, q in _settings(lab):
        if q is not qk:
            continue
        rows = [r for r in lab["runs"] if r["variant"] == v and r["qk_norm"] is qk]
        inits += [r["loss_at_init"] for r in rows if r.get("loss_at_init") is not None]
        # a diverged run is drawn at the loss at init (Wortsman's clip), marked x
        clipped = [{**r, "c": r["loss_at_init"] if r["final_loss"] is None else min(r["final_loss"], r["loss_at_init"])}
                   for r in rows]
        lrs, mean = _by_lr(clipped, "c")
        line, = ax.plot(lrs, mean, marker="o", lw=1.5, label=f"{_name(v)} (sens. "
                        f"{fmt(lab['lr_sensitivity'][v][_qk(qk)], 3)})")
        ax.scatter([r["lr"] for r in clipped], [r["c"] for r in clipped], s=10, color=line.get_color(), alpha=0.5)
        dv = [r for r in clipped if r["diverged"]]
        if dv:
            ax.scatter([r["lr"] for r in dv], [r["c"] for r in dv], s=50, marker="x", color=line.get_color())
    if inits:
        ax.axhline(sum(inits) / len(inits), color="grey", ls=":", lw=1, label="loss at init")
    ax.set_xscale("log")
    ax.set(xlabel="peak learning rate", ylabel="final validation loss (nats)",
           title=f"final loss vs LR, QK-norm {_qk(qk)} (x = diverged)")
    ax.legend(fontsize=9)
    return save_png(fig, path)


def plot_attn_logit_vs_lr(lab: dict, path) -> Path:

    fig, ax = page.subplots(figsize=(7, 4.5))
    colors = {}
    for v, qk in _settings(lab):
        rows = [r for r in lab["runs"] if r["variant"] == v and r["qk_norm"] is qk]
        lrs, mean = _by_lr(rows, "max_attention_logit")
        pts = [(x, y) for x, y in zip(lrs, mean) if y is not None and y > 0]
        if not pts:
            continue
        kw = {"color": colors[v]} if v in colors else {}
        line, = ax.plot(*zip(*pts), marker="o", ls="-" if not qk else "--", label=f"{_name(v)}, QK-norm {_qk(qk)}",
                        **kw)
        colors.setdefault(v, line.get_color())
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set(xlabel="peak learning rate", ylabel="max attention logit q.k/sqrt(d) over training",
           title="attention-logit growth")
    ax.legend(fontsize=8)
    return save_png(fig, path)


def plot_curves_at(lab: dict, lr: float, path) -> Path | None:
    """Training loss and max attention logit over steps at one LR, every setting (seed 0)."""

    fig, (a1, a2) = page.subplots(1, 2, figsize=(12, 4))
    drawn = False
    for v, qk in _settings(lab):
        row = next((r for r in lab["runs"] if (r["variant"], r["qk_norm"], r["lr"], r["seed"]) == (v, qk, lr, 0)), None)
        c = (lab.get("curves") or {}).get(Path(row["dir"]).name) if row else None  # curves are keyed by run folder
        if not c:
            continue
        ls = "-" if not qk else "--"
        pts = [(s, y) for s, y in zip(c["step"], c["loss"]) if y is not None]
        if pts:
            line, = a1.plot(*zip(*pts), ls=ls, lw=1.2, label=f"{_name(v)}, QK-norm {_qk(qk)}")
            pts2 = [(s, y) for s, y in zip(c["probe_step"], c["attention_logit"]) if y is not None and y > 0]
            if pts2:
                a2.plot(*zip(*pts2), ls=ls, lw=1.2, color=line.get_color())
            drawn = True
    if not drawn:
        import matplotlib.pyplot as plt

        plt.close(fig)
        return None
    a1.set(xlabel="step", ylabel="train loss", title=f"training loss at lr {lr:g}")
    a2.set(xlabel="step", ylabel="max attention logit", yscale="log", title=f"max attention logit at lr {lr:g}")
    a1.legend(fontsize=8)
    return save_png(fig, path)


def make_plots(lab: dict, plot_dir) -> dict[str, Path]:
    plot_dir = Path(plot_dir)
    files = {}
    for qk in (False, True):
        if any(r["qk_norm"] is qk for r in lab["runs"]):
            files[f"loss_vs_lr_qk_{_qk(qk)}"] = plot_loss_vs_lr(lab, qk, plot_dir / f"loss_vs_lr_qk_{_qk(qk)}.png")
    files["max_attention_logit_vs_lr"] = plot_attn_logit_vs_lr(lab, plot_dir / "max_attention_logit_vs_lr.png")
    if lab["runs"]:
        top = max(r["lr"] for r in lab["runs"])
        p = plot_curves_at(lab, top, plot_dir / "curves_highest_lr.png")
        if p is not None:
            files["curves_highest_lr"] = p
    return files


# ---------------------------------------------------------------- tables and text

def _sens_cells(lab: dict) -> tuple[list[str], list[list[str]]]:
    head = ["variant", "LR sensitivity, QK-norm off", "LR sensitivity, QK-norm on", "best loss off", "best loss on",
            "diverged runs off", "diverged runs on", "spikes off", "spikes on"]
    rows = []
    for v, s in lab["lr_sensitivity"].items():
        cells = [_name(v), fmt(s.get("off"), 3), fmt(s.get("on"), 3)]
        extra = {}
        for qk in (False, True):
            mine = [r for r in lab["runs"] if r["variant"] == v and r["qk_norm"] is qk]
            _, mean = _by_lr(mine, "final_loss")
            vals = [m for m in mean if m is not None]
            extra[qk] = (fmt(min(vals), 3) if vals else "–", f"{sum(r['diverged'] for r in mine)}/{len(mine)}",
                         str(sum(r["spikes"] for r in mine)))
        cells += [extra[False][0], extra[True][0], extra[False][1], extra[True][1], extra[False][2], extra[True][2]]
        rows.append(cells)
    return head, rows


def _run_cells(lab: dict) -> tuple[list[str], list[list[str]]]:
    head = ["variant", "QK-norm", "lr", "seed", "final loss", "loss at init", "diverged", "spikes", "max attn logit",
            "max |h|", "max |logit|"]
    rows = [[_name(r["variant"]), _qk(r["qk_norm"]), f"{r['lr']:g}", str(r["seed"]), fmt(r["final_loss"], 3),
             fmt(r["loss_at_init"], 3), "yes" if r["diverged"] else "no", str(r["spikes"]),
             _e(r["max_attention_logit"]), _e(r["max_hidden"]), _e(r["max_output_logit"])] for r in lab["runs"]]
    return head, rows


def _e(v) -> str:
    if v is None:
        return "–"
    return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.2e}"


def sensitivity_text(lab: dict) -> str:
    """What `gattn lab stability` prints: the LR-sensitivity table (markdown)."""
    return md_table(*_sens_cells(lab))


def findings(lab: dict) -> list[str]:
    """Plain statements read off the numbers (no verdict is assumed: the gate may or may not help)."""
    out = []
    inst = lab.get("instability") or {}
    if inst.get("checked"):
        what = ("reached" if inst["reached"] else "NOT reached")
        out.append(f"Instability {what}: the baseline without QK-norm "
                   f"{'diverged in at least one run' if inst['baseline_off_diverged'] else 'did not diverge'}; its "
                   f"final loss at the highest LR ({inst['highest_lr']:g}) is {fmt(inst['gap_at_highest_lr'], 2)} nats "
                   f"above its best (the bar: diverged, or >= {inst['margin']:g}).")
    sens = lab["lr_sensitivity"]
    base = next((v for v in sens if canonical_name(v) == "none"), None)
    for key, label in (("off", "without QK-norm"), ("on", "with QK-norm")):
        if base is None or sens[base].get(key) is None:
            continue
        b = sens[base][key]
        parts = []
        for v, s in sens.items():
            if v == base or s.get(key) is None:
                continue
            rel = "lower" if s[key] < b else ("higher" if s[key] > b else "equal")
            parts.append(f"{_name(v)} {fmt(s[key], 3)} ({rel})")
        if parts:
            out.append(f"LR sensitivity {label}: baseline {fmt(b, 3)}; " + "; ".join(parts) + ".")
    for v, s in sens.items():
        if s.get("on") is not None and s.get("off") is not None:
            out.append(f"QK-norm changes {_name(v)}'s LR sensitivity from {fmt(s['off'], 3)} (off) to "
                       f"{fmt(s['on'], 3)} (on).")
    return out


def _intro(lab: dict) -> list[str]:
    c, t = lab["config"], lab["train_config"]
    mo = t.get("model_overrides") or {}
    shape = ", ".join(f"{k}={v}" for k, v in mo.items() if k != "use_qk_norm")
    return [
        f"Budget `{lab['budget']}`: {len(c['lrs'])} peak LRs ({', '.join(f'{x:g}' for x in c['lrs'])}), "
        f"{c['steps']} steps per run of seq_len {t['seq_len']} x batch {t['batch_size']} "
        f"({c['steps'] * t['seq_len'] * t['batch_size']:,} tokens, the same batches for every run of a seed), "
        f"model `{t['model']}` with {shape}; AdamW (beta2 {t['beta2']:g}), warm-up {t['warmup_steps']} steps then "
        f"cosine to lr/100, weight decay {t['weight_decay']:g}, grad clip {t['grad_clip']:g}, {t['precision']}; "
        f"corpus {c['data_dir']}. Gated variants shrink the FFN to the baseline's parameter count.",
        f"Seed 0 runs at every LR; {c['seeds']} seed(s) at the LRs around each setting's edge of stability "
        f"({c['seed_lrs']}). Final loss = mean over domains of the held-out loss after training ({t['eval_batches']} "
        f"batches of {t['eval_batch_size']} per domain); loss at init = the same evaluation before the first step. "
        f"Diverged = the trainer stopped on non-finite steps, or the final loss is no better than at init. "
        f"LR sensitivity (Wortsman et al. 2023) = mean over the LRs of min(final loss, loss at init), seeds averaged, "
        f"minus the best of those; lower = trains well over a wider LR range. Spikes: the trainer's detector (a step "
        f"above the trailing {t['spike_window']}-step median by more than max({t['spike_delta']:g} nats, "
        f"{t.get('spike_noise_k', 0):g} robust sigmas)). Max attention logit = max of q.k/sqrt(d) over causal pairs, "
        f"max |h| = max |hidden state| at a layer output, max |logit| = max |output logit|, each over the trainer's "
        f"probe forwards every {t['stats_every']} steps.",
        f"Wall time of this invocation {lab['wall_time_s']:.0f} s; training {lab['cpu_s_runs'] / 60:.1f} core-minutes "
        f"in all runs (reused runs included).",
    ]


_TITLES = {"loss_vs_lr_qk_off": "Final loss vs LR, QK-norm off", "loss_vs_lr_qk_on": "Final loss vs LR, QK-norm on",
           "max_attention_logit_vs_lr": "Max attention logit vs LR",
           "curves_highest_lr": "Training curves at the highest LR"}


def blocks(lab: dict) -> list[tuple]:
    """The report as experiment.report blocks."""
    out = [("p", p) for p in _intro(lab)]
    out += [("h2", "Findings")] + [("p", f) for f in findings(lab)]
    out += [("h2", "LR sensitivity"), ("table", *_sens_cells(lab)), ("h2", "Every run"), ("table", *_run_cells(lab))]
    if lab.get("nonfinite"):
        out.append(("p", f"Non-finite values (null in lab.json): {', '.join(lab['nonfinite'])}"))
    out.append(("h2", "Plots"))
    out += [("img", _TITLES.get(k, k), rel) for k, rel in lab.get("plots", {}).items()]
    return out


def write(lab: dict, out_dir) -> None:
    """report.md and the self-contained report.html into out_dir."""
    page.write(Path(out_dir), "gattn lab stability: LR sweeps with and without the gate", blocks(lab))
