"""Rendering of a stability-lab result (lab.json): plots (final loss vs LR per QK-norm setting, max attention logit
vs LR, training curves at the highest LR and where the baseline spiked most), report.md and a self-contained
report.html (PNGs inlined as base64). The verdict line is verdict.stability_verdict's, the rule compare's claims row
uses (one rule, two places).
"""
from __future__ import annotations

from pathlib import Path

from ...experiment import pages
from ...experiment.pages import fmt, md_table
from ...gates import canonical_name
from ...util.io import save_png
from . import stats as St

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
    """Final loss (clipped at the loss at init) vs LR per variant at one QK-norm setting; x marks a diverged run."""
    fig, ax = pages.subplots(figsize=(7, 4.5))
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
    return pages.finish(fig, ax, path, legend=9, xscale="log", xlabel="peak learning rate",
                        ylabel="final validation loss (nats)",
                        title=f"final loss vs LR, QK-norm {_qk(qk)} (x = diverged)")


def plot_attn_logit_vs_lr(lab: dict, path) -> Path:
    """Seed-mean max attention logit vs LR, every setting (QK-norm on dashed)."""
    fig, ax = pages.subplots(figsize=(7, 4.5))
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
    return pages.finish(fig, ax, path, xscale="log", yscale="log", xlabel="peak learning rate",
                        ylabel="max attention logit q.k/sqrt(d) over training", title="attention-logit growth")


def plot_curves_at(lab: dict, lr: float, path) -> Path | None:
    """Training loss, max attention logit and max |hidden state| over steps at one LR, every setting (seed 0)."""
    fig, (a1, a2, a3) = pages.subplots(1, 3, figsize=(16, 4))
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
            hidden = zip(c.get("hidden_step", []), c.get("max_hidden", []))
            pts3 = [(s, y) for s, y in hidden if y is not None and y > 0]
            if pts3:
                a3.plot(*zip(*pts3), ls=ls, lw=1.2, color=line.get_color())
            drawn = True
    if not drawn:
        import matplotlib.pyplot as plt

        plt.close(fig)
        return None
    a1.set(xlabel="step", ylabel="train loss", title=f"training loss at lr {lr:g}")
    a2.set(xlabel="step", ylabel="max attention logit", yscale="log", title=f"max attention logit at lr {lr:g}")
    a3.set(xlabel="step", ylabel="max |hidden state|", yscale="log", title=f"max |hidden state| at lr {lr:g}")
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
        lr = spikiest_baseline_lr(lab)
        if lr is not None and lr != top:
            p = plot_curves_at(lab, lr, plot_dir / "curves_most_baseline_spikes.png")
            if p is not None:
                files["curves_most_baseline_spikes"] = p
    return files


def spikiest_baseline_lr(lab: dict) -> float | None:
    """The LR at which the baseline's seed-0 runs had the most loss spikes (None when it never spiked)."""
    counts: dict[float, int] = {}
    for r in lab["runs"]:
        if canonical_name(r["variant"]) == "none" and r["seed"] == 0:
            counts[r["lr"]] = counts.get(r["lr"], 0) + int(r.get("spikes") or 0)
    if not counts or max(counts.values()) == 0:
        return None
    return max(counts, key=lambda lr: (counts[lr], lr))


# ---------------------------------------------------------------- tables and text

def _iv(x, iv, digits: int = 3, lr: bool = False) -> str:
    """'0.324 [0.290, 0.351]' (or LRs in %g)."""
    f = (lambda v: "–" if v is None else f"{v:g}") if lr else (lambda v: fmt(v, digits))
    return f(x) + (f" [{f(iv[0])}, {f(iv[1])}]" if iv else "")


def _setting_cells(lab: dict) -> tuple[list[str], list[list[str]]]:
    """One row per (variant, QK-norm): skill, max stable LR, LR sensitivity, spikes, divergence, with intervals."""
    level = int(round(100 * lab["config"].get("bootstrap", {}).get("level", 0.95)))
    head = ["variant", "QK-norm", "seeds", "best loss (LR)", f"max stable LR [{level} % CI]",
            f"LR sensitivity [{level} % CI]", f"spikes per run [{level} % CI]", "runs with spikes", "diverged runs"]
    rows = []
    for v, per in (lab.get("settings") or {}).items():
        for qk in ("off", "on"):
            st = per.get(qk)
            if not st:
                continue
            msl, sp = st["max_stable_lr"], st["spikes"]
            rows.append([_name(v), qk, str(len(st["seeds"])), f"{fmt(st['best_loss'], 3)} ({st['best_lr']:g})",
                         _iv(msl["lr"], msl["interval"], lr=True),
                         _iv(st["lr_sensitivity"], st["lr_sensitivity_interval"]),
                         _iv(sp["per_run"], sp["interval"], 2), f"{sp['runs_with_spikes']}/{sp['runs']}",
                         f"{st['diverged']}/{sp['runs']}"])
    return head, rows


def _sens_cells(lab: dict) -> tuple[list[str], list[list[str]]]:
    """The pre-interval summary (a lab.json without `settings`): LR sensitivity, best loss, divergence, spikes."""
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


def power_cells(lab: dict) -> tuple[list[str], list[list[str]]] | None:
    """Per QK-norm setting and G1 variant vs the baseline: the observed difference in LR sensitivity and in the
    seed-mean final loss at each LR, each with the seeds per variant that would separate the two bootstrap intervals
    if that difference were the true one (stats.seeds_to_separate); None without intervals (a pre-interval lab.json)."""
    settings = lab.get("settings") or {}
    base = next((v for v in settings if v in ("baseline", "none")), None)
    if base is None:
        return None
    lrs = sorted({r["lr"] for r in lab["runs"]})
    head = ["QK-norm", "variant", "seeds", "LR sensitivity: gated - baseline (seeds to separate)"] + [
        f"final loss at lr {x:g}: gated - baseline (seeds)" for x in lrs]
    level = lab["config"].get("bootstrap", {}).get("level", St.LEVEL)

    def at(v, qk, x):
        mine = [r for r in lab["runs"] if r["variant"] == v and r["qk_norm"] is (qk == "on") and r["lr"] == x]
        return (St.mean_final_loss(mine), St.bootstrap(mine, St.mean_final_loss, level=level)) if mine else None

    def cell(g, giv, b, biv, n):
        need = St.seeds_to_separate(g, giv, b, biv, n)
        sep = need is not None and need == n
        return f"{g - b:+.3f} ({'separate' if sep else '–' if need is None else need})"

    rows = []
    for qk in ("off", "on"):
        b = (settings.get(base) or {}).get(qk)
        if not b:
            continue
        for v, per in settings.items():
            g = per.get(qk)
            if v == base or not g:
                continue
            n = len(g["seeds"])
            cells = [qk, _name(v), str(n), cell(g["lr_sensitivity"], g["lr_sensitivity_interval"],
                                                b["lr_sensitivity"], b["lr_sensitivity_interval"], n)]
            for x in lrs:
                ga, ba = at(v, qk, x), at(base, qk, x)
                cells.append(cell(*ga, *ba, n) if ga and ba else "")
            rows.append(cells)
    return (head, rows) if rows else None


def _summary_cells(lab: dict) -> tuple[list[str], list[list[str]]]:
    return _setting_cells(lab) if lab.get("settings") else _sens_cells(lab)


def _per_lr_cells(lab: dict, key: str, fmt_one) -> tuple[list[str], list[list[str]]]:
    """variant x QK-norm rows, one column per LR: the seed values of `key` (seed mean for floats)."""
    lrs = sorted({r["lr"] for r in lab["runs"]})
    head = ["variant", "QK-norm"] + [f"{x:g}" for x in lrs]
    rows = []
    for v, qk in _settings(lab):
        mine = [r for r in lab["runs"] if r["variant"] == v and r["qk_norm"] is qk]
        cells = [_name(v), _qk(qk)]
        for x in lrs:
            vals = [r.get(key) for r in sorted(mine, key=lambda r: r["seed"]) if r["lr"] == x]
            cells.append(fmt_one(vals) if vals else "")
        rows.append(cells)
    return head, rows


def _mean_sd(vals: list) -> str:
    """'5.123 ± 0.040' over seeds (± sample sd), 'D' marks for runs that diverged (null loss)."""
    got = [v for v in vals if v is not None]
    if not got:
        return "D" * len(vals)
    m = sum(got) / len(got)
    sd = (sum((v - m) ** 2 for v in got) / (len(got) - 1)) ** 0.5 if len(got) > 1 else None
    return f"{m:.3f}" + (f" ± {sd:.3f}" if sd is not None else "") + (" D" if len(got) < len(vals) else "")


def _seed_max(vals: list) -> str:
    got = [v for v in vals if v is not None]
    return _e(max(got)) if got else "–"


def _seed_list(vals: list) -> str:
    return "/".join(str(int(v or 0)) for v in vals)


def _share_mean(vals: list) -> str:
    """Seed mean of a lost-update share, as a percentage ('–' where no run measured it)."""
    got = [v for v in vals if v is not None]
    return f"{100 * sum(got) / len(got):.3g} %" if got else "–"


def _layer_cells(lab: dict, lr: float) -> tuple[list[str], list[list[str]]] | None:
    """Rows = decoder layers, one column per setting at one LR: the lost-update share (mean over the probe steps,
    seed mean) and the max |hidden state| over training (max over seeds) of each layer; None without the series."""
    cols, data = [], []
    for v, qk in _settings(lab):
        rows = [r for r in lab["runs"] if r["variant"] == v and r["qk_norm"] is qk and r["lr"] == lr
                and r.get("lost_update_share")]
        if rows:
            cols.append(f"{_name(v)}, QK-norm {_qk(qk)}")
            data.append(rows)
    if not cols:
        return None
    n = max(len(r["lost_update_share"]) for rows in data for r in rows)

    def cell(rows, i):
        shares, acts = [], []
        for r in rows:
            if i < len(r["lost_update_share"]):
                got = [x for x in r["lost_update_share"][i] if x is not None]
                shares += [sum(got) / len(got)] if got else []
                acts += [x for x in r["max_hidden_per_layer"][i] if x is not None]
        return f"{_share_mean(shares)} / {_e(max(acts)) if acts else '–'}"

    return ["layer"] + cols, [[str(i)] + [cell(rows, i) for rows in data] for i in range(n)]


def _run_cells(lab: dict) -> tuple[list[str], list[list[str]]]:
    head = ["variant", "QK-norm", "lr", "seed", "final loss", "loss at init", "peak train loss", "diverged",
            "spikes (steps)", "max attn logit", "max |h|", "max |logit|"]
    rows = [[_name(r["variant"]), _qk(r["qk_norm"]), f"{r['lr']:g}", str(r["seed"]), fmt(r["final_loss"], 3),
             fmt(r["loss_at_init"], 3), fmt(r.get("peak_train_loss"), 2), "yes" if r["diverged"] else "no",
             str(r["spikes"]) + _steps(r.get("spike_steps")),
             _e(r["max_attention_logit"]), _e(r["max_hidden"]), _e(r["max_output_logit"])] for r in lab["runs"]]
    return head, rows


def _steps(steps) -> str:
    """' (211, 212, …)': the first spike steps of a run (nothing without spikes)."""
    if not steps:
        return ""
    return f" ({', '.join(map(str, steps[:8]))}{', …' if len(steps) > 8 else ''})"


def _e(v) -> str:
    if v is None:
        return "–"
    return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.2e}"


def sensitivity_text(lab: dict) -> str:
    """What `gattn lab stability` prints: the per-setting summary table (markdown) and the verdict line."""
    return md_table(*_summary_cells(lab)) + "\n\n" + verdict_line(lab)


def verdict_line(lab: dict) -> str:
    """The claims table's stability verdict for this lab (verdict.stability_verdict, as compare's claims row)."""
    from .verdict import stability_verdict

    c = stability_verdict(lab)
    return f"Verdict (the claims-table rule): {c['verdict']} - {c['this_run']}"


def findings(lab: dict) -> list[str]:
    """Plain statements read off the numbers (no verdict is assumed: the gate may or may not help)."""
    out = []
    inst = lab.get("instability") or {}
    if inst.get("checked"):
        parts = [f"QK-norm {k}: {x['spikes']} spike(s) in {x['runs_with_spikes']}/{x['runs']} runs, {x['diverged']} "
                 f"diverged, final loss at the highest LR ({x['highest_lr']:g}) {fmt(x['gap_at_highest_lr'], 2)} nats "
                 f"above its best" for k in ("off", "on") if (x := inst.get(k))]
        out.append(f"Instability {'reached' if inst['reached'] else 'NOT reached'} by the baseline (the bar: a spike, "
                   f"a divergence, or >= {inst['margin']:g} nats at the highest LR): " + "; ".join(parts) + ".")
    settings = lab.get("settings") or {}
    base = next((v for v in settings if canonical_name(v) == "none"), None)
    for key, label in (("on", "with QK-norm"), ("off", "without QK-norm")):
        if base is None or not settings[base].get(key):
            continue
        parts = []
        for v, per in settings.items():
            st = per.get(key)
            if not st:
                continue
            msl = st["max_stable_lr"]
            parts.append(f"{_name(v)}: max stable LR {_iv(msl['lr'], msl['interval'], lr=True)}, sensitivity "
                         f"{_iv(st['lr_sensitivity'], st['lr_sensitivity_interval'])}, "
                         f"{fmt(st['spikes']['per_run'], 2)} spikes/run, best loss {fmt(st['best_loss'], 3)}")
        out.append(f"{label[0].upper()}{label[1:]}: " + "; ".join(parts) + ".")
    if lab.get("settings"):
        out.append(verdict_line(lab))
    return out


def _intro(lab: dict) -> list[str]:
    c, t = lab["config"], lab["train_config"]
    mo = t.get("model_overrides") or {}
    shape = ", ".join(f"{k}={v}" for k, v in mo.items() if k != "use_qk_norm")
    sched = (f"cosine to lr x {c.get('min_lr_frac', 0.01):g}" if t["schedule"] == "cosine"
             else f"WSD (decay over the last {100 * t['wsd_decay_frac']:.0f} %)")
    boot = c.get("bootstrap") or {}
    seeds = (f"{c['seeds']} seed(s) at every LR" if c.get("seed_lrs") == "all" else
             f"seed 0 at every LR, {c['seeds']} seed(s) at the LRs around each setting's edge of stability")
    return [
        f"Budget `{lab['budget']}`: {len(c['lrs'])} peak LRs ({', '.join(f'{x:g}' for x in c['lrs'])}), "
        f"{c['steps']} steps per run of seq_len {t['seq_len']} x batch {t['batch_size']} "
        f"({c['steps'] * t['seq_len'] * t['batch_size']:,} tokens, the same batches for every run of a seed), "
        f"model `{t['model']}` with {shape}; AdamW (beta2 {t['beta2']:g}), warm-up {t['warmup_steps']} steps then "
        f"{sched}, weight decay {t['weight_decay']:g}, grad clip {t['grad_clip']:g}, no z-loss, {t['precision']}; "
        f"corpus {c['data_dir']}; {seeds}. Gated variants shrink the FFN to the baseline's parameter count.",
        f"Final loss = mean over domains of the held-out loss after training ({t['eval_batches']} batches of "
        f"{t['eval_batch_size']} per domain); loss at init = the same evaluation before the first step. Diverged = the "
        f"trainer stopped on non-finite steps, or the final loss is no better than at init. Max stable LR = the "
        f"largest LR of the contiguous range, starting at the best LR, whose seed-mean final loss is within "
        f"{c.get('margin', 0.1):g} nats of the best and where no run diverged. LR sensitivity (Wortsman et al. 2023) "
        f"= mean over the LRs of min(final loss, loss at init), seeds averaged, minus the best of those; lower = "
        f"trains well over a wider LR range. Intervals: {100 * boot.get('level', 0.95):.0f} % percentile bootstrap "
        f"over whole seeds ({boot.get('resamples', 2000)} resamples; with 3 seeds only 10 distinct resamples exist, "
        f"so the intervals are coarse). Spikes: the trainer's detector (a step above the trailing "
        f"{t['spike_window']}-step median by more than max({t['spike_delta']:g} nats, "
        f"{t.get('spike_noise_k', 0):g} robust sigmas = 1.4826 x MAD of that window)). Max attention logit = max of "
        f"q.k/sqrt(d) over causal pairs, max |h| = max |hidden state| at a layer output, max |logit| = max |output "
        f"logit|, each over the trainer's probe forwards every {t['stats_every']} steps. Lost-update share (same "
        f"probes) = the share of a layer's residual-stream updates (its attention and FFN outputs added to the "
        f"stream) smaller than half a bf16 ulp of the value they are added to: lost to rounding in a bf16 stream "
        f"(bf16-params), the share that would be lost in an fp32 stream (fp32, bf16 autocast).",
        f"Wall time of this invocation {lab['wall_time_s']:.0f} s; training {lab['cpu_s_runs'] / 60:.1f} core-minutes "
        f"in all runs (reused runs included).",
    ]


_TITLES = {"loss_vs_lr_qk_off": "Final loss vs LR, QK-norm off", "loss_vs_lr_qk_on": "Final loss vs LR, QK-norm on",
           "max_attention_logit_vs_lr": "Max attention logit vs LR",
           "curves_highest_lr": "Training curves at the highest LR (seed 0)",
           "curves_most_baseline_spikes": "Training curves where the baseline spiked most (seed 0)"}


def blocks(lab: dict) -> list[tuple]:
    """The report as experiment.pages blocks."""
    out = [("p", p) for p in _intro(lab)]
    out += [("h2", "Findings")] + [("p", f) for f in findings(lab)]
    out += [("h2", "Per setting"), ("table", *_summary_cells(lab)),
            ("h2", "Final validation loss per LR (seed mean ± sd; D = a diverged run)"),
            ("table", *_per_lr_cells(lab, "final_loss", _mean_sd)),
            ("h2", "Loss spikes per LR (per seed)"), ("table", *_per_lr_cells(lab, "spikes", _seed_list)),
            ("h2", "Max attention logit per LR (max over seeds)"),
            ("table", *_per_lr_cells(lab, "max_attention_logit", _seed_max)),
            ("h2", "Max |hidden state| per LR (max over seeds)"),
            ("table", *_per_lr_cells(lab, "max_hidden", _seed_max)),
            ("h2", "Max |output logit| per LR (max over seeds)"),
            ("table", *_per_lr_cells(lab, "max_output_logit", _seed_max))]
    power = power_cells(lab)
    if power:
        out += [("h2", "Seeds that would separate the observed differences (a power estimate from the measured "
                       "spread: intervals shrink as 1/sqrt(seeds); 'separate' = already separated)"),
                ("table", *power)]
    if any(r.get("mean_lost_update_share") is not None for r in lab["runs"]):
        top = max(r["lr"] for r in lab["runs"])
        out += [("h2", "Residual-stream updates smaller than half a bf16 ulp of the stream (mean over layers and "
                       "probe steps, seed mean)"),
                ("table", *_per_lr_cells(lab, "mean_lost_update_share", _share_mean))]
        layers = _layer_cells(lab, top)
        if layers:
            out += [("h2", f"Per layer at lr {top:g}: lost-update share (mean over probe steps, seed mean) / max "
                           "|hidden state| (over training and seeds)"), ("table", *layers)]
    out += [
            ("h2", "Every run"), ("table", *_run_cells(lab))]
    if lab.get("nonfinite"):
        out.append(("p", f"Non-finite values (null in lab.json): {', '.join(lab['nonfinite'])}"))
    out.append(("h2", "Plots"))
    out += [("img", _TITLES.get(k, k), rel) for k, rel in lab.get("plots", {}).items()]
    return out


def write(lab: dict, out_dir) -> None:
    """report.md and the self-contained report.html into out_dir."""
    pages.write(Path(out_dir), "gattn lab stability: LR sweeps with and without the gate", blocks(lab))
