"""Rendering of a `gattn compare` result: the report (report.md and the self-contained report.html through
experiment.pages, like every job's), its plots, the Table-4 style table `gattn compare` prints and the README's
excerpt of the claims, all from compare.json alone (`rerender`: `gattn compare --report-only`).

The report leads with what was found: one paragraph of findings (each claim's verdict and figure) and the setup
(model, tokens, seeds, precision, CPU), then the claims table. Every per-variant figure is over all seeds (the mean
and its 95 % t interval, compare/seeds.py; the per-seed values in their own table and in compare.json).
"""
from __future__ import annotations

import math
from pathlib import Path

from . import seeds
from ..experiment import pages
from ..experiment.pages import fmt
from ..util.io import atomic_write_text, json_dumps, read_json_object, save_png

# (column title, over-seeds key, decimals); the paper's Table 4 columns that we can measure first
TABLE4 = [("Params", "params", None), ("Avg PPL", "avg_ppl", 2), ("Mean gate", "gate_mean", 3),
          ("M-Act", "m_act", 2), ("F-Attn", "f_attn", 3), ("Loss spikes", "spikes", 1),
          ("Val loss (nats)", "val_loss", 3), ("Gate < 0.1", "gate_near_zero", 2),
          ("F-Attn max layer", "f_attn_max_layer", 3), ("uniform F-Attn", "uniform_f_attn", 3),
          ("Sink rate", "sink_rate", 2)]
MORE = [("tokens", "tokens", 0), ("train s", "train_wall_time_s", 0), ("final loss", "final_loss_avg10", 3),
        ("max |attn out|", "max_abs_attn_output", 2), ("max |ffn out|", "max_abs_ffn_output", 2),
        ("mean |Y| pre gate", "mean_abs_y_pre_gate", 3), ("mean |Y| post gate", "mean_abs_y_post_gate", 3),
        ("|Y|<1e-2 pre", "sparsity_pre_gate_0.01", 3), ("|Y|<1e-2 post", "sparsity_post_gate_0.01", 3),
        ("|Y|<1e-2 pre×mean gate", "sparsity_pre_gate_x_mean_gate_0.01", 3), ("skipped steps", "skipped_steps", 0)]
PER_SEED = [("val loss", "val_loss", 4), ("Avg PPL", "avg_ppl", 2), ("F-Attn", "f_attn", 3), ("M-Act", "m_act", 2),
            ("Mean gate", "gate_mean", 3), ("Gate < 0.1", "gate_near_zero", 2), ("spikes", "spikes", 0)]


def cell(s: dict | None, digits: int | None = 3) -> str:
    """'0.405 [0.391, 0.419]' over seeds, the value alone from one seed, '–' when not measured."""
    if not s:
        return "–"
    f = "{:,.0f}" if digits in (None, 0) else f"{{:.{digits}f}}"  # counts and seconds: whole, with separators
    text = f.format(s["mean"])
    return text if s.get("ci_low") is None else f"{text} [{f.format(s['ci_low'])}, {f.format(s['ci_high'])}]"


def _over(result: dict) -> dict[str, dict]:
    return {v: seeds.over_seeds(r) for v, r in result["rows"].items()}


def _seed_numbers(result: dict) -> list[int]:
    """The seeds' numbers (the first seed + index: seed index k trained with seed first + k)."""
    first = result["train_config"]["seed"]
    return [first + k for k in range(result.get("seeds", 1))]


def _analysed(result: dict) -> int:
    return min(seeds.n_analysed(r) for r in result["rows"].values())


def _scope(result: dict) -> str:
    """What the figures of the tables cover: every seed, or (a compare.json from before every seed was analysed) the
    first seed's models with val loss over every seed."""
    n, total = _analysed(result), result.get("seeds", 1)
    if n >= total:
        return f"mean over {total} seed(s), 95 % t interval in brackets"
    return (f"the analysis figures are seed {_seed_numbers(result)[0]}'s models alone (this compare.json was written "
            f"before every seed was analysed: rerun `gattn compare` to fill them); Val loss is the mean over all "
            f"{total} seeds with its 95 % t interval")


def _table4_cells(result: dict) -> tuple[list[str], list[list[str]]]:
    over = _over(result)
    head = ["Variant"] + [t for t, _, _ in TABLE4]
    rows = [[v] + [fmt(result["rows"][v].get("params"), None) if k == "params" else cell(o.get(k), d)
                   for _, k, d in TABLE4] for v, o in over.items()]
    return head, rows


def _per_seed_cells(result: dict) -> tuple[list[str], list[list[str]]]:
    head = ["Variant", "seed"] + [t for t, _, _ in PER_SEED]
    numbers = _seed_numbers(result)
    rows = []
    for v, r in result["rows"].items():
        by = seeds.seed_rows(r)
        for k, n in enumerate(numbers):
            row = by.get(str(k)) or {}
            vals = {**row, "val_loss": (r.get("val_loss_by_seed") or {}).get(str(k))}
            rows.append([v, str(n)] + [fmt(vals.get(key), d) if vals.get(key) is not None else "–"
                                       for _, key, d in PER_SEED])
    return head, rows


def _domain_cells(result: dict) -> tuple[list[str], list[list[str]]]:
    over = _over(result)
    domains = list(dict.fromkeys(d for o in over.values() for d in o["val_ppl"]))
    head = ["Variant"] + domains + ["Avg PPL"]
    rows = [[v] + [cell(o["val_ppl"].get(d), 2) for d in domains] + [cell(o.get("avg_ppl"), 2)]
            for v, o in over.items()]
    return head, rows


def _extra_cells(result: dict) -> tuple[list[str], list[list[str]]]:
    over = _over(result)
    head = ["Variant"] + [t for t, _, _ in MORE]
    return head, [[v] + [cell(o.get(k), d) for _, k, d in MORE] for v, o in over.items()]


def _layer_cells(result: dict) -> tuple[list[str], list[list[str]]]:
    over = _over(result)
    n = max((len(o["per_layer"]["f_attn"]) for o in over.values()), default=0)
    head = ["Variant", "metric"] + [f"L{i}" for i in range(n)]
    rows = []
    for v, o in over.items():
        rows.append([v, "F-Attn"] + [cell(x, 3) for x in o["per_layer"]["f_attn"]])
        rows.append([v, "M-Act"] + [cell(x, 2) for x in o["per_layer"]["m_act"]])
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


def _shape(result: dict) -> str:
    """'2 layers, d=48, 6 heads of 8, 60,177 non-embedding parameters (109,328 with embeddings)'."""
    c, mo = result["train_config"], result["train_config"].get("model_overrides") or {}
    base = next(iter(result["rows"].values()))
    m = result.get("ppl_measure") or {}
    non_emb = (f"{base['tokens'] / m['tokens_per_param']:,.0f} non-embedding parameters ("
               if m.get("tokens_per_param") and base.get("tokens") else "(")
    layers = mo.get("num_hidden_layers")
    shape = (f"{layers} layers, d={mo.get('hidden_size')}, {mo.get('num_attention_heads')} heads of "
             f"{mo.get('head_dim')}, " if layers else f"preset `{c['model']}`, ")
    return f"{shape}{non_emb}{fmt(base.get('params'), None)} in all)"


def _cpu(result: dict) -> str:
    p = result.get("provenance") or {}
    if not p.get("cpu"):
        return "CPU not recorded"
    return f"{p['cpu']}, {p.get('threads', '?')} thread(s) on {p.get('cores', '?')} core(s)"


def _setup(result: dict) -> str:
    c = result["train_config"]
    tokens = c["steps"] * c["batch_size"] * c["seq_len"]
    tpp = (result.get("ppl_measure") or {}).get("tokens_per_param")
    numbers = _seed_numbers(result)
    return (f"**Setup.** Model: {_shape(result)}, variants {', '.join(result['variants'])} at equal parameter counts "
            f"(the gated ones shrink the FFN). Tokens: {tokens:,} per run ({c['steps']} steps × {c['batch_size']} × "
            f"{c['seq_len']}" + (f", {tpp:.0f} per non-embedding parameter" if tpp else "") + "). Seeds: "
            f"{', '.join(map(str, numbers))} ({len(numbers)}, paired: the same batches per seed, none used for tuning). "
            f"Precision: {result.get('resolved_precision', c['precision'])}. CPU: {_cpu(result)}. Wall time: "
            f"{result['wall_time_s']:.0f} s (reused runs cost nothing).")


def _findings(result: dict) -> str:
    """One paragraph: each claim's verdict with its figure, in the paper's order."""
    claims = result.get("claims") or []
    if not claims:
        return "**Findings.** No claims table (an older compare.json: rerender it with `gattn compare --report-only`)."
    parts = [f"{c['claim']} — **{c['verdict']}**: {c.get('summary') or c['this_run']}" for c in claims]
    return "**Findings** (each claim's verdict by its rule; figures are means over seeds). " + ". ".join(parts) + "."


def _details(result: dict) -> list[str]:
    c, a = result["train_config"], result["analysis"]
    return [
        f"Budget `{result['budget']}`: peak LR {_lrs(result)} ({c['schedule']}, warm-up {c['warmup_steps']}), weight "
        f"decay {c['weight_decay']:g}, batch {c['batch_size']} × {c['seq_len']}, precision {c['precision']} -> "
        f"{result.get('resolved_precision', c['precision'])}. Every variant sees the same batches in the same order "
        f"per seed.",
        f"Analysis on {a['tokens']:,} held-out tokens per model ({a['batches']} batches of {a['batch_size']} x "
        f"{a['seq_len']}, each window starting with {a['first_token']}). F-Attn = attention probability on token 0, "
        f"mean over heads, queries and layers (\"uniform F-Attn\" is its value with uniform causal attention: no "
        f"sink). M-Act = mean over layers of the max |hidden state| a layer outputs. Mean gate = mean gate score over "
        f"all entries and tokens; Gate < 0.1 = the share of scores below 0.1. Sink rate = share of heads whose mean "
        f"attention on token 0 exceeds 0.3. Loss spikes: steps whose loss exceeds the trailing {c['spike_window']}-"
        f"step median by more than max({c['spike_delta']:g} nats, {c.get('spike_noise_k', 0):g} robust sigmas of "
        f"that window).",
    ]


_PLOT_TITLES = {"loss": "Training loss", "layers": "Per-layer F-Attn and M-Act", "gates": "Gate-score histograms"}


def _plot_title(key: str) -> str:
    if key.startswith("maps_"):
        return f"Attention maps (head average): {key[5:]}"
    return _PLOT_TITLES.get(key, key)


_CLAIMS_NOTE = ("Each row: the paper's figure (Qiu et al. 2025; 15A2B MoE at 400B tokens unless stated), this run's "
                "in short, and the verdict by the claim's rule; each rule, this run's figures in full and every "
                "threshold with its source follow the tables. 'not at this scale' = measured here without the "
                "paper's effect; 'not run here' names the command that measures it.")
_THRESHOLDS_NOTE = ("Every threshold was fixed before the runs it judges and none is fitted to this project's "
                    "measurements. Kind: paper = the paper's own figure, published = another published result, "
                    "chosen = an effect size chosen in advance for what a user would notice.")


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
    return (f"`gattn lab streaming` on this run's models, every seed (lab.json in {st['dir']}/): next-token loss with "
            f"full attention vs a rolling KV window ({w}) that keeps the first K tokens (K = "
            f"{', '.join(map(str, st['sink_tokens']))}; K=0 = a plain window, the first token evicted), StreamingLLM "
            f"cache positions, on the positions past the window; Δ = window minus full. The claims row judges each "
            f"kind of model apart and takes the weaker verdict.")


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
    """The whole report as experiment.pages blocks: findings and setup, the claims table, the per-variant tables over
    seeds, the labs compare ran, the plots, then each claim's rule and the thresholds."""
    from .claims import claims_cells, detail_cells, thresholds_cells

    claims = result.get("claims") or []
    out = [("lead", _findings(result)), ("lead", _setup(result))]
    if claims:
        out += [("h2", "Paper claims vs this run"), ("table", *claims_cells(claims)), ("p", _CLAIMS_NOTE)]
    scope = _scope(result)
    out += [("h2", "Table 4 form"), ("p", f"Each figure: {scope}."), ("table", *_table4_cells(result)),
            ("h2", "Per seed"), ("p", "Each seed's model (the tables above summarise these)."),
            ("table", *_per_seed_cells(result)),
            ("h2", "Per-domain perplexity (held-out)"), ("p", f"Each figure: {scope}."),
            ("table", *_domain_cells(result)),
            ("h2", "Per-layer F-Attn and M-Act"), ("table", *_layer_cells(result)),
            ("h2", "More measurements"), ("table", *_extra_cells(result))]
    for title, intro, head, rows, plots in _lab_sections(result):
        out += [("h2", title), ("p", intro), ("table", head, rows)]
        out += [("img", f"{title.split(' (')[0]}: {key}", rel) for key, rel in plots.items()]
    out.append(("h2", "Plots"))
    out += [("img", _plot_title(key), rel) for key, rel in result.get("plots", {}).items()]
    out += [("p", p) for p in _details(result)]
    if claims:
        out += [("h2", "Each claim's rule and this run's figures in full"), ("table", *detail_cells(claims)),
                ("h3", "Thresholds and where they come from"), ("p", _THRESHOLDS_NOTE),
                ("table", *thresholds_cells())]
    return out


def write(out_dir: str | Path, result: dict) -> None:
    """report.md and the self-contained report.html into out_dir (images whose file is missing are left out)."""
    out_dir = Path(out_dir)
    bs = [b for b in blocks(result) if b[0] != "img" or (out_dir / b[2]).is_file()]
    pages.write(out_dir, TITLE, bs)


# ---------------------------------------------------------------- the README's excerpt

def readme_excerpt(result: dict) -> str:
    """The claims table as the README quotes it (claim, this run in short, verdict), from a compare.json."""
    rows = [[c["claim"], c.get("summary") or c["this_run"], c["verdict"]] for c in result.get("claims") or []]
    return pages.md_table(["Claim", "This run", "Verdict"], rows)


# the README's excerpt sits between these lines; the first names the compare.json it is generated from
EXCERPT_BEGIN = "<!-- claims excerpt, generated from {path} (python scripts/readme_excerpt.py rewrites it) -->"
EXCERPT_END = "<!-- end of the claims excerpt -->"


def splice_excerpt(readme: str, root: str | Path) -> str:
    """The README's text with its claims excerpt regenerated from the compare.json its begin line names (a path
    relative to the repository root `root`); unchanged text when the excerpt is current."""
    import re

    pattern = re.escape(EXCERPT_BEGIN).replace(re.escape("{path}"), "(?P<path>[^ ]+)")
    m = re.search(pattern + r"\n(?P<body>.*?)\n" + re.escape(EXCERPT_END), readme, flags=re.S)
    if m is None:
        raise ValueError(f"no claims excerpt in the README (a line {EXCERPT_BEGIN!r} ... {EXCERPT_END!r})")
    table = readme_excerpt(read_json_object(Path(root) / m["path"], "compare.json"))
    return readme[:m.start("body")] + table + readme[m.end("body"):]


# ---------------------------------------------------------------- re-rendering from compare.json

def rerender(out: str | Path, stability_lab=None, longctx=None, scaling_lab=None) -> dict:
    """`gattn compare --report-only`: the claims table (today's rules on the stored figures and the given evidence
    folders), the plots whose data compare.json holds and report.md / report.html, from OUT/compare.json alone;
    nothing trains. compare.json is rewritten with the new claims and plot paths, its measurements untouched. A plot
    whose data it lacks (a compare.json from before `plot_data`) keeps the run's PNG when it is there."""
    from ..util.errors import UserError
    from . import claims

    out = Path(out)
    path = out / "compare.json"
    if not path.is_file():
        raise UserError(f"--report-only: no compare.json in {out}; give the --out folder of a `gattn compare` run")
    result = read_json_object(path, "compare.json")
    for r in result["rows"].values():
        r.setdefault("over_seeds", seeds.summarize(r))
    lab_json = out / (result.get("sink_lab") or {}).get("dir", "sink_lab") / "lab.json"
    lab = read_json_object(lab_json, "sink lab.json") if lab_json.is_file() else result.get("sink_lab")
    result["claims"] = claims.claims_table(result, lab, stability_lab, longctx, scaling_lab)
    kept = {k: p for k, p in (result.get("plots") or {}).items() if (out / p).is_file()}
    result["plots"] = {**kept, **{k: str(p.relative_to(out)) for k, p in make_plots(out / "plots", result).items()}}
    atomic_write_text(path, json_dumps(result, indent=1))
    shown = dict(result)
    if not shown.get("provenance") and (out / "provenance.json").is_file():  # where the machine was written down
        shown["provenance"] = read_json_object(out / "provenance.json", "provenance.json")
    write(out, shown)
    return result


# ---------------------------------------------------------------- plots

CURVE_POINTS = 300  # points kept of each run's smoothed loss curve in compare.json (a plot's resolution)


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


def _curve(recs: list[dict]) -> dict:
    """One run's loss curve as compare.json keeps it: the trailing mean at CURVE_POINTS steps, and its spikes."""
    recs = [r for r in recs if isinstance(r.get("loss"), float) and math.isfinite(r["loss"])]
    ys = _smooth([r["loss"] for r in recs], max(1, len(recs) // 50))
    every = max(1, math.ceil(len(recs) / CURVE_POINTS))
    keep = list(range(0, len(recs), every)) + ([len(recs) - 1] if recs and (len(recs) - 1) % every else [])
    return {"step": [recs[i]["step"] for i in keep], "loss": [round(ys[i], 5) for i in keep],
            "spikes": [[r["step"], round(r["loss"], 5)] for r in recs if r.get("spike")]}


def _pooled_histogram(analyses: dict) -> dict | None:
    """Every layer's and seed's gate histogram summed into one ({edges, counts}); None without gates."""
    hs = [e["gate_histogram"] for a in analyses.values() if a for e in a.get("layers", []) if e.get("gate_histogram")]
    if not hs:
        return None
    return {"edges": hs[0]["edges"], "counts": [sum(h["counts"][i] for h in hs) for i in range(len(hs[0]["counts"]))]}


def plot_data(analyses: dict[str, dict], logs: dict[str, dict]) -> dict:
    """What the plots draw, kept in compare.json so that the report re-renders without the runs: every run's loss
    curve ({variant: {seed index: curve}}), each variant's gate histogram pooled over layers and seeds, and the
    first seed's head-averaged attention maps (3 decimals)."""
    first = lambda d: d[min(d)]  # noqa: E731  (the first seed: the maps illustrate, the tables measure)
    return {"loss": {v: {str(k): _curve(recs) for k, recs in by.items()} for v, by in logs.items()},
            "gates": {v: h for v, by in analyses.items() if (h := _pooled_histogram(by))},
            "maps": {v: {layer: [[round(x, 3) for x in row] for row in m]
                         for layer, m in (first(by).get("attention_maps") or {}).items()}
                     for v, by in analyses.items() if by and first(by)},
            "map_seed": 0}


def plot_loss_curves(curves: dict[str, dict], path) -> Path:
    """Every variant's training loss (trailing mean) over its seeds: the mean line, the min..max band of the seeds
    when there are several, spikes marked; the first steps' drop is cut off the axis, and the title says so."""
    fig, ax = pages.subplots(figsize=(8, 4.5))
    lo_all, hi_all, n_seeds = [], [], 1
    for label, by in curves.items():
        runs = [c for c in by.values() if c["step"]]
        if not runs:
            continue
        n_seeds = max(n_seeds, len(runs))
        steps = runs[0]["step"]
        cols = [[c["loss"][i] for c in runs if i < len(c["loss"])] for i in range(len(steps))]
        mean = [sum(c) / len(c) for c in cols]
        line, = ax.plot(steps, mean, lw=1.2, label=f"{label} ({len(runs)} seed{'s' if len(runs) > 1 else ''})")
        if len(runs) > 1:
            ax.fill_between(steps, [min(c) for c in cols], [max(c) for c in cols], color=line.get_color(), alpha=0.15,
                            lw=0)
        sp = [p for c in runs for p in c["spikes"]]
        if sp:
            ax.scatter([p[0] for p in sp], [p[1] for p in sp], s=12, color=line.get_color(), marker="x")
        tail = len(mean) // 5
        lo_all += [min(c) for c in cols[tail:]]
        hi_all += [max(c) for c in cols[tail:]]
    band = f"; band: min..max over {n_seeds} seeds" if n_seeds > 1 else ""
    title = f"training loss, trailing mean (x = loss spike{band})"
    if lo_all:  # zoom on the part of training where variants differ, not the first steps' drop
        top = max(hi_all) + 0.1
        ax.set_ylim(min(lo_all) - 0.05, top)
        cut = [s for by in curves.values() for c in by.values() for s, y in zip(c["step"], c["loss"]) if y > top]
        if cut:
            title += f"\nthe first {max(cut) + 1} steps' higher loss is above the axis"
    ax.set(xlabel="step", ylabel="train loss (trailing mean)", title=title)
    ax.legend(fontsize=9)
    return save_png(fig, path)


def plot_layers(result: dict, path) -> Path:
    """Per-layer F-Attn (with the uniform-attention level: no sink) and M-Act of every variant, mean over seeds with
    its 95 % interval as error bars; whole-number layer ticks."""
    fig, (a1, a2) = pages.subplots(1, 2, figsize=(11, 4))
    over = _over(result)
    n = _analysed(result)
    for i, (label, o) in enumerate(over.items()):
        off = 0.06 * (i - (len(over) - 1) / 2)  # a small sideways shift: overlapping error bars stay readable
        for ax, key, digits in ((a1, "f_attn", 3), (a2, "m_act", 2)):
            ss = [x for x in o["per_layer"][key] if x]
            if not ss:
                continue
            xs = [j + off for j in range(len(ss))]
            err = [[x["mean"] - (x["ci_low"] if x["ci_low"] is not None else x["mean"]) for x in ss],
                   [(x["ci_high"] if x["ci_high"] is not None else x["mean"]) - x["mean"] for x in ss]]
            mean = (o.get(key) or {}).get("mean")
            ax.errorbar(xs, [x["mean"] for x in ss], yerr=err, marker="o", capsize=3,
                        label=f"{label} (mean {fmt(mean, digits)})")
    u = next(iter(result["rows"].values())).get("uniform_f_attn")
    if u:
        a1.axhline(u, ls="--", color="gray", lw=1, label=f"uniform attention ({u:.3f})")
    seeds_text = f"mean over {n} seeds, 95 % interval" if n > 1 else "one seed"
    a1.set(xlabel="layer", ylabel="attention on first token", title=f"F-Attn per layer ({seeds_text})")
    a1.set_ylim(0, max(0.05, a1.get_ylim()[1] * 1.15))  # room above the highest point, not a 0..1 axis
    a2.set(xlabel="layer", ylabel="max |hidden state|", title=f"M-Act per layer ({seeds_text})")
    for ax in (a1, a2):
        pages.integer_ticks(ax, "x")
        ax.legend(fontsize=8)
    return save_png(fig, path)


def make_plots(plot_dir, result: dict) -> dict[str, Path]:
    """Every plot of the report that compare.json holds the data of: the per-layer figures always; the loss curves,
    gate histograms and attention maps from its `plot_data`. Returns {key: path}."""
    from gated_attention.analysis import plots as P

    plot_dir = Path(plot_dir)
    data = result.get("plot_data") or {}
    files = {}
    if data.get("loss"):
        files["loss"] = plot_loss_curves(data["loss"], plot_dir / "loss_curves.png")
    files["layers"] = plot_layers(result, plot_dir / "layers_fattn_mact.png")
    over = _over(result)
    gates = {v: {"layers": [{"gate_histogram": h}], "gate_mean": (over[v].get("gate_mean") or {}).get("mean")}
             for v, h in (data.get("gates") or {}).items()}
    if gates:
        g = P.plot_gate_histograms(gates, plot_dir / "gate_histograms.png")
        if g is not None:
            files["gates"] = g
    seed = _seed_numbers(result)[data.get("map_seed", 0)] if data.get("maps") else None
    for name, maps in (data.get("maps") or {}).items():
        files[f"maps_{name}"] = P.plot_attention_maps({"attention_maps": maps}, plot_dir / f"attention_maps_{name}.png",
                                                      title=f"{name} (seed {seed})")
    return files
