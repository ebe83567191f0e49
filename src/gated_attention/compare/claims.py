"""The "Paper claims vs this run" table that opens `gattn compare`'s report: one row per claim of the paper, with the
paper's figure, this run's figure, a verdict (reproduced / partly / not at this scale / not run here + the command
that runs it) and the rule with its thresholds.

Inputs: the compare result (its rows: PPL, F-Attn, M-Act, gate, spikes), the sink lab it ran (lab.json content, or
None), a stability-lab lab.json found on disk (`settings`, `instability`, `runs`: labs/stability/verdict.py) and a
long-context report.json whose top-level `"claim"` object is `{"paper", "this_run", "verdict"}`, and the streaming
check compare ran (`result["streaming"]`: compare.streaming_summary; its rule is labs/streaming/verdict.py).

Every threshold is an experiment.verdicts.Threshold with its source beside it (the paper by its table or figure, a
cited published result, or an effect size chosen in advance for what a user would notice), fixed before the runs it
judges and never fitted to this project's measurements. `RULES` maps each claim to its rule text and thresholds; the
report prints them under the table and docs/usage.md lists them.
"""
from __future__ import annotations

import math

from pathlib import Path

from ..experiment.verdicts import Threshold
from ..experiment.verdicts import cells as threshold_table
from ..util.errors import UserError
from ..util.io import read_json_object

# the verdict words and the stability / streaming rules belong to their labs (each prints its own verdict); the
# same objects
from ..labs.stability.verdict import GATED, NOT_AT_SCALE, NOT_RUN, PARTLY, REPRODUCED, stability_verdict  # noqa: F401
from ..labs.stability import verdict as stability_rule
from ..labs.streaming import verdict as streaming_rule
from ..labs.scaling import verdict as scaling_rule
from ..labs.sinks.sink_lab import SKILL_CE
from ..longctx import longctx_report
from . import seeds as S

STABILITY_CMD = "gattn lab stability --budget default --out runs/lab/stability"
# the project's measured default-budget lab (lab.json + report), for a compare run that has no stability lab
STABILITY_DOC = "results/stability_lab.md (lab.json: --stability-lab results/stability_lab)"
LONGCTX_CMD = "gattn longctx --budget fair --out runs/longctx"
# where the project's own equal-skill Table 5 is written up, for a compare run that has no long-context run
LONGCTX_DOC = "results/long_context.md (Table 5 at equal skill)"
SINK_LAB_CMD = "gattn lab sinks --out runs/lab/sinks"

# ---------------------------------------------------------------- thresholds, each with its source

SINK_FORMED = Threshold(
    "sink: baseline F-Attn at least", 2.0, "x uniform", "chosen",
    "the first token gets twice what uniform causal attention gives it (1/(t+1) averaged over queries): a sink one "
    "sees in the attention map (the paper's baseline: 0.467 of all attention in 4096-token windows, the paper's Table 4)")
SINK_FORMING = Threshold(
    "partly: baseline F-Attn at least", 1.25, "x uniform", "chosen",
    "a quarter of a formed sink's excess over uniform (SINK_FORMED): the smallest first-token preference called a "
    "sink forming")
SINK_KEPT = Threshold(
    "removed: a G1 model's F-Attn excess over uniform at most", 0.25, "of the baseline's excess", "paper",
    "the paper's Table 4: the paper's G1 models keep 10 % (elementwise, 0.048) and 16 % (headwise, 0.073) of the baseline's "
    "0.467 on the first token; a quarter is the headwise share with room")
BOS_SINK = Threshold(
    "synthetic sink: baseline's dormant-query attention on BOS at least", 0.5, "share", "chosen",
    "BOS takes more of an idle query's attention than all other keys together")
BOS_SINK_PARTLY = Threshold(
    "partly: baseline's dormant-query attention on BOS at least", 0.3, "share", "published",
    "Gu et al. 2024 (When Attention Sink Emerges in Language Models, arXiv 2410.10781): a head has a sink when its "
    "mean attention on the first token exceeds epsilon = 0.3")
TASK_SKILL = Threshold(
    "skill: baseline backcopy CE at most", SKILL_CE, "nats", "chosen",
    "the sink lab's skill threshold: below ln 2 = 0.69 nats with room, i.e. surer of the copied token than a coin "
    "flip between two")
BOS_GATED = Threshold(
    "removed: a G1 model's dormant-query attention on BOS at most", 0.1, "share", "paper",
    "the paper's Table 4: the paper's G1 first-token attention, 0.048 (elementwise) / 0.073 (headwise), rounded up")
TASK_TOLERANCE = Threshold(
    "as skilled: a G1 model's backcopy CE above the baseline's at most", 0.05, "nats", "chosen",
    "a loss difference a user would notice (the streaming rule's noticeable cost)")
MACT_RATIO = Threshold(
    "reduced: a G1 model's M-Act at most", 0.5, "of the baseline's", "chosen",
    "halved: the smallest reduction called one, far short of the paper's /11 (1053 -> 94 / 98, the paper's Table 4)")
MACT_MASSIVE = Threshold(
    "massive: the baseline's M-Act at least", 100.0, "", "published",
    "Sun et al. 2024 (Massive Activations in Large Language Models, arXiv 2402.17762): an activation is massive when "
    "its magnitude exceeds 100 (and is about 1,000x its hidden state's median); below it there is nothing massive to "
    "reduce, and a model at its initial scale cannot pass")
GATE_SPARSE = Threshold(
    "sparse: mean gate score at most", 0.2, "", "paper",
    "Qiu et al. 2025, Table 4: the gates that remove the sink average 0.116 (SDPA elementwise) and 0.172 (SDPA "
    "headwise); every gate averaging 0.221 or more (v elementwise 0.221, head-shared 0.271, input-independent 0.335, "
    "NS-sigmoid 0.653) keeps one (F-Attn >= 0.297); 0.2 lies between. A gate starts at about 0.5 (sigmoid of a "
    "small-initialised projection), far above it")
GATE_QDEP = Threshold(
    "query-dependent: gate on dormant queries at most", 0.5, "of its value on trigger queries", "chosen",
    "the gate at least halves where the head has nothing to do")

NEAR_ZERO = 0.1  # a gate score this low is "near zero": the rows' gate_near_zero is the share of scores below it
_pct = lambda t: f"{100 * t.value:g} %"
# claim -> (the rule in words, its thresholds); the rows' "rule" and the report's thresholds table
RULES: dict[str, tuple[str, tuple[Threshold, ...]]] = {
    "Lower perplexity at parameter parity": (
        f"ln k = -Δ / (the baseline's loss drop per e-fold of compute), Δ = G1 elementwise - baseline val loss "
        f"(nats) paired over confirmation seeds (none used for tuning), 95 % interval: reproduced (lower > 0, ln k >= "
        f"ln {scaling_rule.K_LOW.value:g}), lower but smaller than the paper's (lower > 0), no effect of the paper's "
        f"size (inside ±ln {scaling_rule.K_LOW.value:g}), worse (upper < 0), else inconclusive; the nats rule (δ = "
        f"{scaling_rule.DELTA.value:g}) beside it; from the scaling lab (the paper's shared-LR protocol, 20 "
        f"tokens/param) when one is given, else from this run (labs/scaling/verdict.py)",
        (scaling_rule.K_PAPER, scaling_rule.K_LOW, scaling_rule.DELTA)),
    "Attention sink removed: real text": (
        f"reproduced: baseline F-Attn >= {SINK_FORMED.value:g}x uniform and every G1 excess over uniform <= "
        f"{SINK_KEPT.value:g} of the baseline's; partly: the same with the baseline >= {SINK_FORMING.value:g}x, or "
        f"every G1 lower than a formed sink",
        (SINK_FORMED, SINK_FORMING, SINK_KEPT)),
    "Attention sink removed: synthetic task (Bigram-Backcopy)": (
        f"reproduced: baseline BOS attention (dormant) >= {BOS_SINK.value:g} at backcopy CE <= {TASK_SKILL.value:g}, "
        f"every G1 <= {BOS_GATED.value:g} at CE <= the baseline's + {TASK_TOLERANCE.value:g}; partly: baseline >= "
        f"{BOS_SINK_PARTLY.value:g} and every G1 lower", (BOS_SINK, BOS_SINK_PARTLY, TASK_SKILL, BOS_GATED,
                                                          TASK_TOLERANCE)),
    "Massive activations reduced": (
        f"reproduced: the baseline's M-Act (mean over seeds) >= {MACT_MASSIVE.value:g} and every G1 M-Act <= "
        f"{MACT_RATIO.value:g}x it; partly: a massive baseline and every G1 lower, or every G1 <= "
        f"{MACT_RATIO.value:g}x a baseline that is not massive", (MACT_MASSIVE, MACT_RATIO)),
    "Sparse, query-dependent gate scores": (
        f"reproduced: every G1 mean gate (mean over seeds) <= {GATE_SPARSE.value:g} and, on the sink task, gate on "
        f"dormant queries <= {GATE_QDEP.value:g}x that on trigger queries; partly: one of the two; the share of "
        f"scores below {NEAR_ZERO:g} is shown beside the mean", (GATE_SPARSE, GATE_QDEP)),
    "Training stability (spikes, LR tolerance)": (
        "reproduced: the baseline fails in the grid (spike, divergence or a large loss at the highest LR) and, QK-norm "
        "on, every G1 variant's interval separates in its favour on >= 1 of max stable LR / LR sensitivity / spikes "
        "and against it on none (labs/stability/verdict.py)", stability_rule.THRESHOLDS),
    "Long context (YaRN ×4, no training)": (
        f"reproduced: gated ahead by >= {longctx_report.LEAD_POINTS.value:g} points beyond L after YaRN, at every "
        f"length, at equal skill at L; partly: ahead on average (longctx/longctx_report.py)", longctx_report.THRESHOLDS),
    "Streams with a plain window (no sink tokens)": (
        f"judged apart on each kind of model the check measured (the sink lab's, the text models), the row taking the "
        f"weakest: reproduced: in every model the baseline pays a plain-window cost that keeping the first tokens removes "
        f"(<= {streaming_rule.REMOVED_SHARE.value:g} left) and every G1 model <= {streaming_rule.G1_SHARE.value:g} "
        f"of it, the baseline's mean >= {streaming_rule.NOTICEABLE_NATS.value:g} nats or "
        f"{_pct(streaming_rule.NOTICEABLE_PPL)} ppl; partly: the same pattern, smaller (each baseline >= "
        f"{streaming_rule.FLOOR.value:g} nats) (labs/streaming/verdict.py)", streaming_rule.THRESHOLDS),
}


def thresholds_cells() -> tuple[list[str], list[list[str]]]:
    """The report's "Thresholds and where they come from" table: every threshold of every claim's rule."""
    return threshold_table({claim: ts for claim, (_, ts) in RULES.items()})


def _f(v, d=3) -> str:
    return "–" if v is None else f"{v:.{d}f}"


def _m(row: dict, key: str):
    """A row's figure as every rule reads it: the mean over the seeds it was measured on."""
    return S.mean(row, key)


def _short(v: str) -> str:
    return v.removeprefix("sdpa_")


def _iv(x: dict | None, d: int = 3) -> str:
    """'-0.045 [-0.172, +0.082]' (or the mean alone without an interval)."""
    if not x or x.get("mean") is None:
        return "–"
    iv = f" [{x['ci_low']:+.{d}f}, {x['ci_high']:+.{d}f}]" if x.get("ci_low") is not None else ""
    return f"{x['mean']:+.{d}f}{iv}"


def _gated(rows: dict) -> list[str]:
    return [v for v in GATED if v in rows]


def _with_base(d: dict) -> dict:
    """The ungated variant is "none" (its canonical name) or "baseline" (the alias compare uses by default)."""
    if "baseline" not in d and "none" in d:
        d = {**d, "baseline": d["none"]}
    return d


SCALING_CMD = "gattn lab scaling --budget default --out runs/lab/scaling"
PPL_PAPER = ("Avg PPL 6.026 → 5.761 (G1 elementwise) / 5.792 (headwise), 15A2B MoE, 400B tokens; dense 1.7B at equal "
             "parameters 7.499 → 7.404 (δ = 0.0128 nats), 3.5T tokens -0.8 %")


def ppl_measure(seed_losses: dict, lrs: dict, lr_tuned: dict, tokens_per_param: float | None,
                lr_source: str = "", protocol: str = "", seeds: list[int] | None = None,
                slope: tuple[float, str] | None = None, bytes_per_token: dict | None = None) -> dict:
    """The perplexity row's `measure` (compare.json): Δ = gated - baseline mean val loss in nats per G1 variant,
    paired over the seeds both ran ({variant: {seed: loss}}), with a 95 % t interval from 2 seeds on, judged by the
    scaling lab's nats rule; beside it Δ in bits per byte (the corpus's bytes per token, domains weighted as the loss
    weights them) and ln k = -Δ / slope (slope: the baseline's loss drop per e-fold of compute at this size, with its
    source) judged by the multiplier rule; the regime (tokens per non-embedding parameter, the seeds, each variant's
    LR, the protocol; `seeds_used_for_tuning`: the job's seeds that chose a setting — none)."""
    base = seed_losses.get("baseline") or seed_losses.get("none") or {}
    per_byte = [1.0 / b for b in (bytes_per_token or {}).values() if b]
    to_bpb = (sum(per_byte) / len(per_byte) / math.log(2)) if per_byte else None  # nats/token -> bits/byte
    deltas, bpb, ln_k = {}, {}, {}
    for v in GATED:
        if v in seed_losses:
            d = scaling_rule.paired_delta(seed_losses[v], base)
            deltas[v] = {"mean": d["mean"], "ci_low": d["ci_low"], "ci_high": d["ci_high"], "n_seeds": d["n_seeds"],
                         "per_seed": d["per_seed"], "verdict": scaling_rule.judge(d["mean"], d["ci_low"], d["ci_high"]),
                         "seeds_needed": scaling_rule.seeds_needed(d["mean"], d["std"])}
            scale = lambda x, f: None if x is None or f is None else x * f  # noqa: E731
            if to_bpb:
                bpb[v] = {k: scale(d[k], to_bpb) for k in ("mean", "ci_low", "ci_high")}
            if slope:
                ln_k[v] = {"mean": scale(d["mean"], -1 / slope[0]), "ci_low": scale(d["ci_high"], -1 / slope[0]),
                           "ci_high": scale(d["ci_low"], -1 / slope[0])}
                ln_k[v]["verdict"] = scaling_rule.judge_multiplier(ln_k[v]["mean"], ln_k[v]["ci_low"],
                                                                   ln_k[v]["ci_high"])
    return {"delta_nats": deltas, "delta_bits_per_byte": bpb, "ln_k": ln_k,
            "slope": {"nats_per_efold": slope[0], "source": slope[1]} if slope else None,
            "protocol": protocol, "seeds_used_for_tuning": [], "seed_list": seeds or [],
            "tokens_per_param": tokens_per_param,
            "params_counted": "non-embedding (baseline)", "seeds": max((len(x) for x in seed_losses.values()), default=0),
            "lr": lrs, "lr_tuned": lr_tuned, "lr_source": lr_source}


def _primary(deltas: dict) -> str | None:
    """The variant whose Δ decides the row: G1 elementwise (the paper's recommendation), else the first G1 run."""
    return next((v for v in GATED if v in deltas), None)


def _delta_text(v: str, d: dict, bpb: dict | None = None, ln_k: dict | None = None) -> str:
    iv = f" [{d['ci_low']:+.4f}, {d['ci_high']:+.4f}]" if d.get("ci_low") is not None else " (one seed: no interval)"
    more = f", ~{d['seeds_needed']} seeds would decide" if d.get("verdict") == scaling_rule.INCONCLUSIVE and \
        d.get("seeds_needed") else ""
    text = f"{v.removeprefix('sdpa_')} {d['mean']:+.4f}{iv} nats → {d['verdict']}{more}"
    if bpb and bpb.get("mean") is not None:
        text += f"; {bpb['mean']:+.4f} bits/byte"
    if ln_k and ln_k.get("mean") is not None:
        kv = f" [{ln_k['ci_low']:+.3f}, {ln_k['ci_high']:+.3f}]" if ln_k.get("ci_low") is not None else ""
        text += f"; ln k {ln_k['mean']:+.3f}{kv} → {ln_k['verdict']}"
    return text


def scaling_evidence(scaling_dir) -> dict | None:
    """The scaling lab's per-variant verdicts at its largest size, or None when there is no lab.json."""
    path = Path(scaling_dir) / "lab.json" if scaling_dir else None
    if path is None or not path.exists():
        return None
    lab = read_json_object(path, "scaling lab.json")
    return {"dir": str(path.parent), "per_variant": lab["verdict"]["per_variant"], "text": lab["verdict"]["text"],
            "tokens_per_param": lab["config"].get("tokens_per_param"),
            "seeds": (lab.get("seeds") or {}).get("confirm") or lab["config"].get("seeds")}


def ppl_claim(rows: dict, measure: dict | None = None, scaling_dir=None) -> dict:
    deltas = (measure or {}).get("delta_nats") or {}
    if "baseline" not in rows or not _gated(rows) or not deltas:
        return {"paper": PPL_PAPER, "this_run": "needs baseline and a G1 variant", "verdict": NOT_RUN,
                "command": "gattn compare"}
    m = dict(measure)  # the row's copy: verdict_source is the row's, not the run's measurement
    tuned = "each variant at its own tuned LR" if all(m["lr_tuned"].values()) else "LRs not tuned per variant"
    tpp = f"{m['tokens_per_param']:.1f}" if m.get("tokens_per_param") else "?"
    if m.get("protocol") == "shared-lr":
        tuned = "every arm at the baseline's tuned LR (the paper's protocol)"
    seeds = f"seeds {m['seed_list']}" if m.get("seed_list") else f"{m['seeds']} seed(s)"
    this = (f"Δ val loss ({seeds}, none used for tuning; {tpp} tokens per non-embedding parameter, {tuned}): "
            + "; ".join(_delta_text(v, d, (m.get("delta_bits_per_byte") or {}).get(v), (m.get("ln_k") or {}).get(v))
                        for v, d in deltas.items())
            + ". Val loss (mean over seeds) " + " → ".join(
                [_f(_m(rows["baseline"], "val_loss")), " / ".join(_f(_m(rows[v], "val_loss")) for v in _gated(rows))])
            + " nats")
    summary = "Δ val loss " + ", ".join(f"{_short(v)} {_iv(d)}" for v, d in deltas.items()) + " nats"
    bpb = m.get("delta_bits_per_byte") or {}
    if all(bpb.get(v) and bpb[v].get("mean") is not None for v in deltas):
        summary += " (" + " / ".join(f"{bpb[v]['mean']:+.3f}" for v in deltas) + " bits/byte)"
    if m.get("ln_k"):
        summary += "; ln k " + ", ".join(f"{_short(v)} {_iv(x, 2)}" for v, x in m["ln_k"].items())
    lab = scaling_evidence(scaling_dir)
    primary = _primary(deltas)
    if lab and primary in lab["per_variant"]:
        x = lab["per_variant"][primary]
        m["verdict_source"] = f"scaling lab {lab['dir']}"
        return {"paper": PPL_PAPER, "verdict": x.get("multiplier", x["gain"]), "measure": m, "summary": summary,
                "this_run": f"{this}. Verdict from the scaling ladder ({lab['dir']}: {lab['tokens_per_param']:g} "
                            f"tokens/param, confirm seeds {lab['seeds']}): {lab['text']}"}
    m["verdict_source"] = "this run"
    return {"paper": PPL_PAPER, "this_run": this + f"; no scaling lab at {scaling_dir}: the verdict is this run's",
            "summary": summary,
            "verdict": ((m.get("ln_k") or {}).get(primary) or deltas[primary])["verdict"], "measure": m,
            **({"command": SCALING_CMD} if not all(m["lr_tuned"].values()) else {})}


def _n_seeds(rows: dict) -> str:
    n = {S.n_analysed(r) for r in rows.values()}
    return f"{n.pop()} seed(s)" if len(n) == 1 else "seeds: " + ", ".join(f"{v} {S.n_analysed(r)}" for v, r in rows.items())


def text_sink_claim(rows: dict) -> dict:
    paper = "first-token attention (F-Attn) 0.467 → 0.048 (elementwise) / 0.073 (headwise)"
    b = rows.get("baseline", {})
    if _m(b, "f_attn") is None or not _gated(rows):
        return {"paper": paper, "this_run": "needs baseline and a G1 variant", "verdict": NOT_RUN,
                "command": "gattn compare"}
    u = _m(b, "uniform_f_attn") or _m(b, "f_attn")
    ratio = lambda r: _m(r, "f_attn") / u
    g = {v: rows[v] for v in _gated(rows)}
    this = (f"F-Attn (mean over {_n_seeds(rows)}) {_m(b, 'f_attn'):.3f} ({ratio(b):.2f}× uniform) → "
            + " / ".join(f"{_m(r, 'f_attn'):.3f} ({ratio(r):.2f}×)" for r in g.values())
            + f"; worst baseline layer {_f(_m(b, 'f_attn_max_layer'))}")
    excess = lambda r: ratio(r) - 1.0  # first-token attention above what uniform causal attention gives it
    kept = all(excess(r) <= SINK_KEPT.value * excess(b) for r in g.values())
    if ratio(b) >= SINK_FORMED.value and kept:
        verdict = REPRODUCED
    elif (ratio(b) >= SINK_FORMING.value and kept) or (
            ratio(b) >= SINK_FORMED.value and all(excess(r) < excess(b) for r in g.values())):
        verdict = PARTLY  # the same pattern on a sink only forming at this scale, or a formed sink the gate lowers
    else:
        verdict = NOT_AT_SCALE
    summary = (f"baseline F-Attn {ratio(b):.2f}× uniform" + (": no sink formed" if ratio(b) < SINK_FORMING.value else "")
               + " → " + " / ".join(f"{ratio(r):.2f}×" for r in g.values()))
    return {"paper": paper, "this_run": this, "verdict": verdict, "summary": summary}


def synthetic_sink_claim(lab: dict | None) -> dict:
    paper = ("idle heads need no sink with the gate (46.7 % → 4.8 % on token 0); on Bigram-Backcopy (Guo et al. "
             "2024) a softmax head parks dormant queries on BOS")
    if not lab or "baseline" not in lab.get("variants", {}) or not any(v in lab["variants"] for v in GATED):
        return {"paper": paper, "this_run": "sink lab not run", "verdict": NOT_RUN, "command": SINK_LAB_CMD}
    V = lab["variants"]
    m = lambda v, k: V[v]["mean"].get(k)
    g = [v for v in GATED if v in V]
    # a lab.json variant lists its seeds' results; compare.json's summary of it counts them
    n = V["baseline"].get("seeds") or len(V["baseline"].get("per_seed") or [])
    bos = f"{_f(m('baseline', 'bos_attention_dormant'))} → " + " / ".join(_f(m(v, "bos_attention_dormant")) for v in g)
    this = (f"BOS attention from dormant queries {bos} at backcopy CE {_f(m('baseline', 'backcopy_ce'))} → "
            + " / ".join(_f(m(v, "backcopy_ce")) for v in g) + f" ({n} seed(s))")
    b_sink, b_ce = m("baseline", "bos_attention_dormant") or 0.0, m("baseline", "backcopy_ce")
    skilled = lambda v: (m(v, "backcopy_ce") is not None and b_ce is not None
                         and m(v, "backcopy_ce") <= b_ce + TASK_TOLERANCE.value)
    if b_sink >= BOS_SINK.value and b_ce is not None and b_ce <= TASK_SKILL.value and all(
            (m(v, "bos_attention_dormant") or 1.0) <= BOS_GATED.value and skilled(v) for v in g):
        verdict = REPRODUCED  # a formed sink in a model that does the task; the gated models do it as well, sink-free
    elif all((m(v, "bos_attention_dormant") or 1.0) < b_sink for v in g) and b_sink >= BOS_SINK_PARTLY.value:
        verdict = PARTLY
    else:
        verdict = NOT_AT_SCALE
    return {"paper": paper, "this_run": this, "verdict": verdict,
            "summary": f"dormant queries' BOS attention {bos} ({n} seed(s))"}


def massive_activation_claim(rows: dict) -> dict:
    paper = "M-Act (mean per-layer max |hidden|) 1053 → 94 (elementwise) / 98 (headwise)"
    b = _m(rows.get("baseline", {}), "m_act")
    g = {v: _m(rows[v], "m_act") for v in _gated(rows)}
    if b is None or not g or None in g.values():
        return {"paper": paper, "this_run": "needs baseline and a G1 variant", "verdict": NOT_RUN,
                "command": "gattn compare"}
    digits = 0 if b >= 10 else 1  # a small model's activations are single digits: keep the decimal
    figs = f"{b:.{digits}f} → " + " / ".join(f"{x:.{digits}f}" for x in g.values())
    massive, halved = b >= MACT_MASSIVE.value, all(x <= MACT_RATIO.value * b for x in g.values())
    verdict = (REPRODUCED if massive and halved else PARTLY if halved or (massive and all(x < b for x in g.values()))
               else NOT_AT_SCALE)
    return {"paper": paper, "this_run": f"M-Act (mean over {_n_seeds(rows)}) {figs}", "verdict": verdict,
            "summary": f"M-Act {figs}"}


def gate_sparsity_claim(rows: dict, lab: dict | None) -> dict:
    paper = "mean gate score 0.116 (elementwise) / 0.172 (headwise): sparse and query-dependent"
    g = {v: _m(rows[v], "gate_mean") for v in _gated(rows) if _m(rows[v], "gate_mean") is not None}
    if not g:
        return {"paper": paper, "this_run": "no G1 variant", "verdict": NOT_RUN, "command": "gattn compare"}
    near = {v: _m(rows[v], "gate_near_zero") for v in g}
    figs = " / ".join(f"{x:.3f}" for x in g.values())
    if any(x is not None for x in near.values()):
        figs += f", share of scores below {NEAR_ZERO:g} " + " / ".join(
            "–" if x is None else f"{100 * x:.0f} %" for x in near.values())
    this = f"mean gate on text (mean over {_n_seeds({v: rows[v] for v in g})}) {figs}"
    summary = f"mean gate {figs} (paper 0.116 / 0.172)"
    qdep = None
    if lab:
        pairs = [(lab["variants"][v]["mean"].get("gate_dormant"), lab["variants"][v]["mean"].get("gate_active"))
                 for v in GATED if v in lab.get("variants", {})]
        pairs = [p for p in pairs if None not in p]
        if pairs:
            task = "sink task, dormant vs active queries " + ", ".join(f"{d:.2f} vs {a:.2f}" for d, a in pairs)
            this, summary = f"{this}; {task}", f"{summary}; {task}"
            qdep = all(d <= GATE_QDEP.value * a for d, a in pairs)  # the gate closes where the head idles
    sparse = all(x <= GATE_SPARSE.value for x in g.values())  # as sparse as the paper's sink-free gates
    verdict = REPRODUCED if sparse and qdep else PARTLY if sparse or qdep else NOT_AT_SCALE
    return {"paper": paper, "this_run": this, "verdict": verdict, "summary": summary}


STABILITY_PAPER = ("no loss spikes with the gate; the 48L baseline diverges at LR 8e-3 while the gated model trains "
                   "(PPL 7.078)")


EVIDENCE = {  # flag -> (file the folder must hold, keys it must have, the command that writes such a folder)
    "--stability-lab": ("lab.json", ("runs", "config"), "gattn lab stability --out DIR"),
    "--scaling-lab": ("lab.json", ("deltas", "verdict", "config"), "gattn lab scaling --out DIR"),
    "--longctx": ("report.json", ("claim",), "gattn longctx --out DIR"),
}


def require_evidence(flag: str, folder) -> None:
    """A folder the user named for a claims row (`gattn compare --stability-lab DIR` / `--longctx DIR`) must hold
    that command's output: one UserError (exit 2, before anything trains) otherwise, instead of a silent 'not run here'
    row. Only the defaults may be absent (then the row says 'not run here' and names the command)."""
    name, keys, cmd = EVIDENCE[flag]
    path = Path(folder) / name
    if not path.is_file():
        raise UserError(f"{flag} {folder}: no {name} there; give the output folder of `{cmd}` or leave {flag} out")
    data = read_json_object(path, f"{flag} {name}")
    missing = [k for k in keys if k not in data]
    if missing:
        raise UserError(f"{flag} {folder}: {name} has no {', '.join(map(repr, missing))} (not an output of "
                        f"`{cmd}`?); give such a folder or leave {flag} out")


def stability_claim(rows: dict, stability_dir) -> dict:
    """The claims-table row from the stability lab in `stability_dir` (its lab.json: `gattn compare --stability-lab`)."""
    counts = {v: (S.over_seeds(rows[v]).get("spikes") or {}).get("per_seed") for v in rows}
    spikes = ", ".join(f"{v} {'–' if c is None else int(sum(c))}" for v, c in counts.items())  # summed over seeds
    path = Path(stability_dir) / "lab.json" if stability_dir else None
    if path is None or not path.exists():
        return {"paper": STABILITY_PAPER, "this_run": f"loss spikes in this run: {spikes}; no stability lab at {path}; "
                f"the project's measured table: {STABILITY_DOC}", "verdict": NOT_RUN, "command": STABILITY_CMD,
                "summary": f"no stability lab given; the project's measured table: {STABILITY_DOC.split(' (')[0]}"}
    try:
        lab = read_json_object(path, "stability lab.json")
        claim = stability_verdict(lab)
    except (UserError, KeyError, TypeError, AttributeError) as exc:
        return {"paper": STABILITY_PAPER, "this_run": f"unreadable stability lab {path} ({exc})", "verdict": NOT_RUN,
                "command": STABILITY_CMD}
    out = {"paper": STABILITY_PAPER, "this_run": f"{claim['this_run']} ({path.parent})", "verdict": claim["verdict"],
           "precision": claim.get("precision")}  # what the evidence trained in (each run's resolved_precision)
    if claim["verdict"] == NOT_RUN:
        out["command"] = STABILITY_CMD
    return out


def longctx_claim(longctx_dir) -> dict:
    paper = "after YaRN ×4 without training, RULER at 128k 58.82 (gated) vs 31.65 (baseline)"
    path = Path(longctx_dir) / "report.json" if longctx_dir else None
    if path is None or not path.exists():
        return {"paper": paper, "this_run": f"no long-context report at {path}; the project's measured table: "
                f"{LONGCTX_DOC}", "verdict": NOT_RUN, "command": LONGCTX_CMD,
                "summary": f"no long-context run given; the project's measured table: {LONGCTX_DOC.split(' (')[0]}"}
    try:
        claim = read_json_object(path, "long-context report.json").get("claim")
    except UserError:
        claim = None
    if not isinstance(claim, dict) or not {"this_run", "verdict"} <= set(claim):
        return {"paper": paper, "this_run": f"{path} has no \"claim\" object (an older long-context run?)",
                "verdict": NOT_RUN, "command": LONGCTX_CMD}
    return {"paper": claim.get("paper") or paper, "this_run": f"{claim['this_run']} ({path.parent})",
            "verdict": str(claim["verdict"])}


STREAMING_CMD = "gattn lab streaming --models runs/lab/sinks --window 16 --sink-tokens 0 4 --out runs/lab/streaming"
STREAMING_PAPER = ("StreamingLLM (Xiao et al. 2023): a softmax LM with a first-token sink breaks under a sliding KV "
                   "window unless the first tokens stay (sink tokens); a sink-free model should stream with a plain "
                   "window")


_STRENGTH = (REPRODUCED, PARTLY, NOT_AT_SCALE)  # strongest first: the row takes the weakest of its model kinds


def _plain_costs(models: dict, kind: str) -> str:
    """'baseline +0.013, elementwise +0.015, headwise +0.016' (mean plain-window Δloss of each variant's models)."""
    costs, _ = streaming_rule.model_costs(models, kind)
    name = lambda v: "baseline" if v == "none" else _short(v)
    return ", ".join(f"{name(v)} {sum(m['plain'] for m in ms) / len(ms):+.3f}" for v, ms in costs.items())


def streaming_claim(stream: dict | None) -> dict:
    """The streaming row: labs/streaming/verdict.py's rule on every kind of model the check measured (the sink lab's,
    this run's text models), judged apart (different data); the row's verdict is the weakest of them, and the text
    gives each kind's figures and verdict."""
    if not stream:
        return {"paper": STREAMING_PAPER, "this_run": "no streaming check", "verdict": NOT_RUN,
                "command": STREAMING_CMD}
    models = stream.get("models") or {}
    by_kind = streaming_rule.lab_verdicts(models)  # sink-lab models first, then text
    if not by_kind:
        return {"paper": STREAMING_PAPER, "this_run": "needs baseline and a G1 model in the streaming check",
                "verdict": NOT_RUN, "command": STREAMING_CMD}
    windows = stream.get("window") if isinstance(stream.get("window"), dict) else {}
    label = lambda kind: {"sink_lab": "sink lab"}.get(kind, kind)
    this = ". ".join(f"{label(kind)} models, window {windows.get(label(kind), stream.get('window'))}: "
                     f"{v['this_run']} -> {v['verdict']}" for kind, v in by_kind.items())
    summary = "; ".join(f"{label(kind)} models {v['verdict']} (plain-window Δloss {_plain_costs(models, kind)} nats)"
                        for kind, v in by_kind.items())
    verdict = max((v["verdict"] for v in by_kind.values()), key=_STRENGTH.index)
    return {"paper": STREAMING_PAPER, "this_run": this, "verdict": verdict, "summary": summary}


def claims_table(result: dict, sink_lab: dict | None, stability_dir=None, longctx_dir=None,
                 scaling_dir=None) -> list[dict]:
    """The rows of "Paper claims vs this run", in the paper's order of claims."""
    rows = _with_base(result["rows"])
    if sink_lab:
        sink_lab = {**sink_lab, "variants": _with_base(sink_lab.get("variants", {}))}
    out = [("Lower perplexity at parameter parity", ppl_claim(rows, result.get("ppl_measure"), scaling_dir)),
           ("Attention sink removed: real text", text_sink_claim(rows)),
           ("Attention sink removed: synthetic task (Bigram-Backcopy)", synthetic_sink_claim(sink_lab)),
           ("Massive activations reduced", massive_activation_claim(rows)),
           ("Sparse, query-dependent gate scores", gate_sparsity_claim(rows, sink_lab)),
           ("Training stability (spikes, LR tolerance)", stability_claim(rows, stability_dir)),
           ("Long context (YaRN ×4, no training)", longctx_claim(longctx_dir)),
           ("Streams with a plain window (no sink tokens)", streaming_claim(result.get("streaming")))]
    return [{"claim": c, **r, "summary": r.get("summary") or r["this_run"], "rule": RULES[c][0],
             "thresholds": [t.to_dict() for t in RULES[c][1]]} for c, r in out]


def claims_cells(claims: list[dict]) -> tuple[list[str], list[list[str]]]:
    """The report's first table: each claim, the paper's figure, this run's in short, the verdict."""
    head = ["Claim", "Paper", "This run", "Verdict"]
    rows = []
    for c in claims:
        verdict = c["verdict"] + (f": run `{c['command']}`" if c.get("command") else "")
        rows.append([c["claim"], c["paper"], c.get("summary") or c["this_run"], verdict])
    return head, rows


def detail_cells(claims: list[dict]) -> tuple[list[str], list[list[str]]]:
    """Each claim's full figures and its rule (thresholds and sources: the thresholds table)."""
    return (["Claim", "This run, in full", "Rule"],
            [[c["claim"], c["this_run"], c.get("rule") or RULES.get(c["claim"], ("",))[0]] for c in claims])
