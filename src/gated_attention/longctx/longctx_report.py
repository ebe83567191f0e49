"""`gattn longctx` report: Table 5 in small aggregated over seeds (mean ± spread, pooled 95 % intervals), the steps
each model needed to reach the retrieval skill, and the paper-vs-this-run claim that `gattn compare` quotes.

Input: per (model, seed, variant) the eval_stage dicts (scores by length, per-sample records, answer NLL, loss by
position) and per (model, seed) the training outcome (steps run, held-out skill checks). Output: report.json (every
number; written by the pipeline), report.png (score vs length, PPL vs position, skill over training), and report.md
with a self-contained report.html (the tables and the figure) through experiment.pages, like every job's report.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from ..experiment import pages
from ..experiment import verdicts as _verdicts
from ..experiment.stats import spread, wilson
from ..gates import get_gate
from ..util.io import json_dumps, save_png

VARIANTS = ("none", "yarn")

# the paper's Table 5 (paper map §3.5): RULER after YaRN x4 (training-free) beyond the 32k training length
PAPER_CLAIM = ("Table 5: after YaRN x4 without training (32k -> 128k), the SDPA-gated model keeps far more of its "
               "RULER score beyond the training length: 72.88 vs 37.94 at 32k (-6.9 vs -41.6 from the no-YaRN model) and "
               "58.82 vs 31.65 at 128k; within the trained length the two are equal (79.77 vs 79.50 at 32k).")
VERDICTS = _verdicts.VERDICTS
LEAD_POINTS = _verdicts.Threshold(
    "lead beyond L after YaRN: gated ahead by at least", 10.0, "points (passkey exact match %)", "chosen",
    "a lead no reader misses, about a third of the paper's smallest lead beyond the trained length (58.82 vs 31.65 "
    "= +27 points at 128k, the paper's Table 5)")
SKILL_AT_L = _verdicts.Threshold(
    "equal skill: both models at L without YaRN at least", 0.9, "exact match (the stopping rule's when one ran)",
    "chosen", "the comparison is at equal skill only when both models retrieve at their trained length first (the "
    "paper's models score 79.5 / 79.8 at 32k before extension, its Table 5)")
THRESHOLDS = (LEAD_POINTS, SKILL_AT_L)


def _ungated(gate: str) -> bool:
    return get_gate(gate) is None  # 'none' and its alias 'baseline'


def model_label(name: str) -> str:
    gate, _, init = name.partition(":")
    base = "Baseline" if _ungated(gate) else f"Gated ({gate})"
    return base + (f", {init} init" if init and init != "normal" else "")


def _fmt(v, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def _pm(s: dict, spec: str = ".1f") -> str:
    """mean ± std (n > 1) or the single value."""
    if s["mean"] is None:
        return "-"
    return format(s["mean"], spec) + (f" ± {format(s['std'], spec)}" if s["n"] > 1 else "")


def bucket_ppl(pos_loss: list[float], edges: list[int]) -> list[float]:
    """exp(mean loss) over each [edges[i], edges[i+1]) position range."""
    return [math.exp(sum(pos_loss[a:b]) / (b - a)) for a, b in zip(edges, edges[1:])]


def _hits(records: list[dict], length: int) -> tuple[int, int]:
    """Pooled successes and samples at one target length (a record scores 1.0 when its whole answer is found)."""
    got = [r["score"] for r in records if r["target_length"] == length]
    return sum(1 for s in got if s >= 1.0 - 1e-9), len(got)


def build_report(results: dict, training: dict, b, lengths: list[int], factor: int, models: list[str],
                 seeds: list[int], precision: str | None = None) -> dict:
    """results[(model, seed, variant)] = eval dict; training[(model, seed)] = dict(steps_run, steps_to_skill, ...);
    precision: what b.precision was decided to be (the pipeline's one decision; None: decided here).

    A partial report (--report-only while runs are unfinished) lacks some results: each row then averages the seeds
    it has (row["seeds"]), a model with none has no rows, and training entries may carry finished=False.
    With a stopping rule, a (model, seed) that never reached the skill at L is left out of the rows (extension is
    compared at equal skill) and listed in rep["excluded"] with its scores, so it is reported, not averaged in.
    """
    L = b.seq_len

    def skilled(m, s) -> bool:
        t = training.get((m, s))
        return t is None or not t.get("until_skill") or t.get("steps_to_skill") is not None

    evaluated = [(m, s) for m in models for s in seeds if (m, s, "none") in results and (m, s, "yarn") in results]
    excluded = [dict(model=m, seed=s, steps_run=training[(m, s)]["steps_run"],
                     last_check=(training[(m, s)].get("checks") or [None])[-1],
                     average={v: {n: results[(m, s, v)]["average"][str(n)] for n in lengths} for v in VARIANTS})
                for m, s in evaluated if not skilled(m, s)]
    edges = [0, L] + [L * 2 ** i for i in range(1, int(math.log2(factor)) + 1)]
    names = [f"{a}-{c}" for a, c in zip(edges, edges[1:])]
    rows = []
    for variant in VARIANTS:
        for m in models:
            have = [s for s in seeds if (m, s) in evaluated and skilled(m, s)]
            if not have:
                continue
            per = [results[(m, s, variant)] for s in have]
            avg = {n: spread([r["average"][str(n)] for r in per]) for n in lengths}
            ci = {}
            for n in lengths:
                k = sum(_hits(r["records"], n)[0] for r in per)
                tot = sum(_hits(r["records"], n)[1] for r in per)
                ci[n] = {"hits": k, "samples": tot, "wilson95": list(wilson(k, tot)) if tot else None}
            row = dict(model=m, seeds=have, gate=m.partition(":")[0], gate_init=m.partition(":")[2] or "normal", variant=variant,
                       average={n: avg[n]["mean"] for n in lengths}, average_std={n: avg[n]["std"] for n in lengths},
                       per_seed={str(s): {n: r["average"][str(n)] for n in lengths} for s, r in zip(have, per)},
                       pooled=ci,
                       drop_from_L={n: spread([None if r["average"][str(n)] is None or r["average"][str(L)] is None
                                                    else r["average"][str(n)] - r["average"][str(L)] for r in per])["mean"]
                                    for n in lengths if n > L},
                       tasks={t: {n: spread([r["scores"][t][str(n)] for r in per])["mean"] for n in lengths}
                              for t in per[0]["scores"]},
                       answer_nll={n: spread([r["average_answer_nll"][str(n)] for r in per])["mean"] for n in lengths},
                       answer_nll_std={n: spread([r["average_answer_nll"][str(n)] for r in per])["std"]
                                       for n in lengths},
                       ppl_buckets=dict(zip(names, np.mean([bucket_ppl(r["pos_loss"], edges) for r in per], 0).tolist())))
            if variant == "yarn":
                base = [results[(m, s, "none")] for s in have]
                row["delta"] = {n: spread([None if r["average"][str(n)] is None or q["average"][str(n)] is None
                                                else r["average"][str(n)] - q["average"][str(n)]
                                                for r, q in zip(per, base)])["mean"] for n in lengths}
            rows.append(row)
    train = {m: [dict(seed=s, **training[(m, s)]) for s in seeds if (m, s) in training] for m in models}
    skill = {m: spread([t["steps_to_skill"] for t in train[m]]) for m in models}
    done = {r["model"]: r["seeds"] for r in rows}
    rep = dict(train_length=L, factor=factor, lengths=lengths, gates=models, models=models, seeds=seeds,
               budget=_budget_dict(b, precision), rows=rows, training=train, steps_to_skill=skill, excluded=excluded,
               complete=all((m, s, v) in results for m in models for s in seeds for v in VARIANTS),
               pos_loss={f"{m}-{v}": np.mean([results[(m, s, v)]["pos_loss"] for s in have], 0).tolist()
                         for m, have in done.items() for v in VARIANTS})
    rep["claim"] = claim(rep)
    return rep


def _budget_dict(b, precision: str | None = None) -> dict:
    import dataclasses

    from gated_attention.util.precision import resolve

    return {**dataclasses.asdict(b), "resolved_precision": precision or resolve(b.precision, "cpu")}


def claim(rep: dict) -> dict:
    """{paper, this_run, verdict}: does the gated model keep more passkey retrieval after YaRN beyond L?

    Compared: the first baseline and the first normal-init gated model, YaRN rows, mean over seeds and over the lengths
    above L. reproduced: the gated model is ahead by >= LEAD_POINTS points there, at every such length, every model
    reached the skill at L (stopping rule) and both score >= the threshold (SKILL_AT_L without a rule) at L without
    YaRN; partly: ahead on average but not all of that; not at this scale: not ahead; not run here: no such pair.
    THRESHOLDS holds both numbers with their sources (experiment/verdicts.py).
    """
    L, rows = rep["train_length"], rep["rows"]
    yarn = {r["model"]: r for r in rows if r["variant"] == "yarn"}
    base = next((m for m in yarn if _ungated(m.partition(":")[0])), None)
    gated = next((m for m in yarn if not _ungated(m.partition(":")[0]) and ":" not in m), None)
    if gated is None:
        gated = next((m for m in yarn if not _ungated(m.partition(":")[0])), None)
    if base is None or gated is None:
        return dict(paper=PAPER_CLAIM, this_run="no baseline/gated pair in this run", verdict="not run here")
    longer = [n for n in rep["lengths"] if n > L]
    b_vals = [yarn[base]["average"][n] for n in longer]
    g_vals = [yarn[gated]["average"][n] for n in longer]
    if any(v is None for v in b_vals + g_vals):
        return dict(paper=PAPER_CLAIM, this_run="no score beyond L", verdict="not run here")
    diff = sum(g_vals) / len(g_vals) - sum(b_vals) / len(b_vals)
    seeds = len(yarn[gated]["seeds"]), len(yarn[base]["seeds"])
    seeds = str(seeds[0]) if seeds[0] == seeds[1] else f"{seeds[0]}/{seeds[1]}"
    unskilled = [f"{x['model']} seed {x['seed']}" for x in rep.get("excluded", [])]  # build_report's one rule
    fig = "; ".join(f"{n}: {_fmt(g)} vs {_fmt(b)}" for n, g, b in zip(longer, g_vals, b_vals))
    skill_at_L = [rep_row(rows, m, "none")["average"][L] for m in (gated, base)]
    # equal skill also when no stopping rule ran (a fixed step count): both retrieve at L before extension
    need = 100 * (rep.get("budget", {}).get("until_skill") or SKILL_AT_L.value)
    weak = [m for m, v in zip((gated, base), skill_at_L) if v is None or v < need]
    at_L = f"at L={L} without YaRN {_fmt(skill_at_L[0])} vs {_fmt(skill_at_L[1])}"
    this_run = (f"passkey exact match % after YaRN x{rep['factor']} (training-free), {gated} vs {base}, mean of "
                f"{seeds} seed(s): {fig} (difference {diff:+.1f} points); {at_L}"
                + (f"; left out, did not reach the skill at L: {', '.join(unskilled)}" if unskilled else "")
                + (f"; below {need:.0f} % at L without YaRN (not at equal skill): {', '.join(weak)}" if weak else ""))
    others = [m for m in yarn if m not in (base, gated) and all(yarn[m]["average"][n] is not None for n in longer)]
    if others:  # the identity-init and headwise models, for the reader: the verdict stays on the paper's pair
        this_run += "; other gated models, mean beyond L after YaRN: " + ", ".join(
            f"{m} {_fmt(sum(yarn[m]['average'][n] for n in longer) / len(longer))}" for m in others)
    if not rep.get("complete", True):
        this_run += " (partial: not every model and seed has finished)"
    if diff >= LEAD_POINTS.value and all(g > b for g, b in zip(g_vals, b_vals)) and not unskilled and not weak:
        verdict = "reproduced"
    elif diff > 0:
        verdict = "partly"
    else:
        verdict = "not at this scale"
    return dict(paper=PAPER_CLAIM, this_run=this_run, verdict=verdict)


def rep_row(rows: list[dict], model: str, variant: str) -> dict:
    return next(r for r in rows if r["model"] == model and r["variant"] == variant)


def title(rep: dict) -> str:
    return f"Table 5 in small: RULER average (%) by context length (trained at L={rep['train_length']})"


def blocks(rep: dict, plot: str | None = None) -> list[tuple]:
    """The report as experiment.pages blocks (report.md and the self-contained report.html); plot: the figure's path
    relative to the report folder, shown at the end when given."""
    L, factor, lengths, seeds = rep["train_length"], rep["factor"], rep["lengths"], rep["seeds"]
    b = rep["budget"]

    def name(row):
        label = model_label(row["model"]) + (f" [seed {', '.join(map(str, row['seeds']))} only]"
                                             if len(row["seeds"]) < len(seeds) else "")
        return f"{label} ({L} model)" if row["variant"] == "none" else f"{label} + YaRN -> {factor * L}"

    stop = (f"each model trained until its held-out {b['mix_tasks'][0]} exact match at L reached "
            f"{b['until_skill']:.0%} (checked every {b['skill_every']} steps on {b['skill_samples']} samples), at most "
            f"{b['steps']} steps" if b.get("until_skill") else f"{b['steps']} steps per model")
    by_length = ["Method"] + [str(n) for n in lengths]
    out = []
    if not rep.get("complete", True):
        out.append(("p", "**Partial report** (`--report-only` while runs are unfinished): rows average the seeds that "
                         "have finished; re-run the same command without `--report-only` to resume and complete it."))
    out.append(("p", f"Tasks {', '.join(b['mix_tasks'])}; {b['samples']} samples per task, length and seed; seeds "
                     f"{', '.join(map(str, seeds))}; {stop}; model preset {b['model']}"
                     f"{' ' + json_dumps(b['model_overrides']) if b['model_overrides'] else ''}, batch "
                     f"{b['batch_size']} x {L} tokens, lr {b['lr']}, "
                     f"{b.get('resolved_precision', b.get('precision', 'fp32'))}, retrieval mix {b['retrieval_mix']}. "
                     f"Cells: mean ± standard deviation over seeds; YaRN rows: in brackets the change against the same "
                     f"models without YaRN (the paper's deltas). Lengths above L are beyond the training length; '-' = "
                     f"the prompt does not fit."))
    out.append(("h2", "Steps to reach the skill at L" if b.get("until_skill") else
                "Training steps (a fixed count, no stopping rule: the skill at L is the score table's L column)"))
    rows = []
    for m, ts in rep["training"].items():
        cells = []
        by_seed = {t["seed"]: t for t in ts}
        for sd in seeds:
            t = by_seed.get(sd)
            if t is None:
                cells.append("not started")
            elif not t.get("finished", True):
                last = t["checks"][-1] if t["checks"] else None
                cells.append(f"running (step {t['steps_run']}" + (f", {100 * last['exact_match']:.0f} % at step "
                                                                   f"{last['step']})" if last else ")"))
            elif t.get("until_skill"):
                cells.append(str(t["steps_to_skill"]) if t["steps_to_skill"] is not None
                             else f"not reached in {t['steps_run']}")
            else:
                cells.append(f"{t['steps_run']} (fixed)")
        done = [t for t in ts if t.get("finished", True)]
        sk = rep["steps_to_skill"][m]
        ruled = any(t.get("until_skill") for t in done)  # fixed-step runs have no skill step to count
        mean = _pm(sk, ".0f") + (f" ({sk['n']} of {len(done)} reached)" if ruled and sk["n"] < len(done) else "")
        rows.append([model_label(m), *cells, mean])
    out.append(("table", ["Model"] + [f"seed {s}" for s in seeds] + ["mean ± std"], rows))
    for x in rep.get("excluded", []):
        last = x["last_check"]
        seen = f"; held-out {100 * last['exact_match']:.0f} % at its last check, step {last['step']}" if last else ""
        out.append(("p", f"Left out of the score tables (not at equal skill): {model_label(x['model'])} seed "
                         f"{x['seed']} did not reach the skill in {x['steps_run']} steps{seen}; its scores at "
                         + ", ".join(str(n) for n in lengths) + ": "
                         + " / ".join(_fmt(x["average"]["none"][n], ".0f") for n in lengths) + " without YaRN, "
                         + " / ".join(_fmt(x["average"]["yarn"][n], ".0f") for n in lengths) + " with YaRN."))
    if not rep["rows"]:
        out.append(("p", "No model has finished training and evaluation yet." if not rep.get("excluded") else
                         "No model has reached the skill at L yet."))
        return out + _claim_blocks(rep) + _plot_block(plot)
    rows = []
    for row in rep["rows"]:
        cells = []
        for n in lengths:
            c = _pm({"mean": row["average"][n], "std": row["average_std"][n], "n": len(row["seeds"])})
            if row["variant"] == "yarn" and row["delta"][n] is not None:
                c += f" ({row['delta'][n]:+.1f})"
            cells.append(c)
        rows.append([name(row), *cells])
    out += [("h2", "Score by length (mean ± std over seeds)"), ("table", by_length, rows)]
    rows = []
    for row in rep["rows"]:
        cells = []
        for n in lengths:
            p = row["pooled"][n]
            cells.append("-" if not p["samples"] else
                         f"{p['hits']}/{p['samples']} [{p['wilson95'][0]:.0f}, {p['wilson95'][1]:.0f}]")
        rows.append([name(row), *cells])
    out += [("h2", "Pooled over seeds: hits / samples [95 % Wilson interval, %]"), ("table", by_length, rows)]
    longer = [n for n in lengths if n > L]
    out += [("h2", f"Degradation beyond the training length: score at n minus score at L={L}"),
            ("table", ["Method"] + [str(n) for n in longer],
             [[name(row)] + [_fmt(row["drop_from_L"][n], "+.1f") for n in longer] for row in rep["rows"]])]
    out += [("h2", "Answer NLL (nats/token, teacher-forced, lower is better; mean ± std over seeds)"),
            ("table", by_length, [[name(row)] + [_pm({"mean": row["answer_nll"][n], "std": row["answer_nll_std"][n],
                                                      "n": len(row["seeds"])}, ".3f") for n in lengths]
                                  for row in rep["rows"]])]
    if any(len(r["tasks"]) > 1 for r in rep["rows"]):
        out += [("h2", "Per task (mean over seeds)"),
                ("table", ["Method", "Task"] + [str(n) for n in lengths],
                 [[name(row), t] + [_fmt(s[n]) for n in lengths] for row in rep["rows"] for t, s in row["tasks"].items()])]
    buckets = list(rep["rows"][0]["ppl_buckets"])
    out += [("h2", "Perplexity by position on corpus validation text (mean over seeds; beyond L is extrapolation)"),
            ("table", ["Method"] + [f"pos {k}" for k in buckets],
             [[name(row)] + [f"{row['ppl_buckets'][k]:.2f}" for k in buckets] for row in rep["rows"]])]
    return out + _claim_blocks(rep) + _plot_block(plot)


def _claim_blocks(rep: dict) -> list[tuple]:
    c = rep["claim"]
    return [("h2", "Paper claim vs this run"),
            ("ul", [f"Paper: {c['paper']}", f"This run: {c['this_run']}", f"Verdict: **{c['verdict']}**"])]


def _plot_block(plot: str | None) -> list[tuple]:
    return [("h2", "Plots"), ("img", "Score vs length, perplexity vs position, held-out skill over training", plot)] \
        if plot else []


def format_markdown(rep: dict) -> str:
    """report.md's text without the figure (what `gattn longctx` prints)."""
    return pages.render(title(rep), blocks(rep), ".")[0]


def write(out_dir: str | Path, rep: dict) -> None:
    """report.png, then report.md and the self-contained report.html (the figure embedded) into out_dir."""
    out_dir = Path(out_dir)
    plot_report(rep, out_dir / "report.png")
    pages.write(out_dir, title(rep), blocks(rep, "report.png" if (out_dir / "report.png").exists() else None))


def plot_report(rep: dict, path: Path) -> None:
    """report.png: score vs length and perplexity vs position (and the held-out skill checks over training when the
    stopping rule ran); nothing when no model has results yet."""
    L, lengths = rep["train_length"], rep["lengths"]
    if not rep["rows"]:
        return
    curves = {m: [t for t in ts if t.get("checks")] for m, ts in rep.get("training", {}).items()
              if any(t.get("checks") for t in ts)}
    # a third panel with the held-out skill checks over training when the run used the stopping rule
    fig, axes = pages.subplots(1, 3 if curves else 2, figsize=(18 if curves else 12, 4.5))
    ax1, ax2 = axes[0], axes[1]
    palette = ["tab:blue", "tab:red", "tab:green", "tab:purple", "tab:orange", "tab:brown"]
    colors = {m: c for m, c in zip(rep["models"], palette)}
    if curves:
        ax3 = axes[2]
        for m, ts in curves.items():
            for i, t in enumerate(ts):  # one line per seed: the jump happens at a different step per seed
                ax3.plot([c["step"] for c in t["checks"]], [100 * c["exact_match"] for c in t["checks"]],
                         color=colors.get(m, "black"), alpha=0.8, lw=1.2, label=model_label(m) if i == 0 else None)
        thr = next((t["until_skill"] for ts in curves.values() for t in ts if t.get("until_skill")), None)
        if thr:
            ax3.axhline(100 * thr, color="gray", lw=1, ls=":")
        ax3.set_xlabel("training step (one line per seed); dotted = the stopping threshold")
        ax3.set_ylabel(f"held-out exact match at L={L} (%)")
        ax3.set_ylim(-3, 103)
        ax3.grid(alpha=0.3)
        ax3.legend(fontsize=7)
    for row in rep["rows"]:
        ls = "-" if row["variant"] == "none" else "--"
        label = model_label(row["model"]) + (" + YaRN" if row["variant"] == "yarn" else "")
        mean = np.array([np.nan if row["average"][n] is None else row["average"][n] for n in lengths])
        std = np.array([np.nan if row["average_std"][n] is None else row["average_std"][n] for n in lengths])
        ax1.errorbar(lengths, mean, yerr=std, fmt=ls, marker="o", color=colors[row["model"]], label=label, capsize=3)
        pos = np.asarray(rep["pos_loss"][f"{row['model']}-{row['variant']}"])
        w = max(1, len(pos) // 64)  # average over windows of positions: single positions are noisy
        n = len(pos) // w
        ax2.plot(np.arange(n) * w + w / 2, np.exp(pos[:n * w].reshape(n, w).mean(1)), ls,
                 color=colors[row["model"]], label=label)
    for ax in (ax1, ax2):
        ax.axvline(L, color="gray", lw=1, ls=":")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    ax1.set_xscale("log", base=2)
    ax1.set_xticks(lengths, [str(n) for n in lengths])
    ax1.set_xlabel("context length (tokens); dotted = training length")
    ax1.set_ylabel("RULER average (%), mean ± std over seeds")
    ax1.set_ylim(-3, 103)
    ax2.set_xlabel("position (tokens)")
    ax2.set_ylabel("perplexity (corpus validation)")
    ax2.set_yscale("log")
    fig.tight_layout()
    save_png(fig, path)  # a unique temp file per write: parallel runs share OUT
