"""The stability lab's verdict on the paper's stability claim, read off a lab.json: the rule `gattn lab stability`
prints under its table and `gattn compare`'s "Paper claims vs this run" table shows in its stability row
(compare/claims.py imports it from here, so both always say the same). Its thresholds, each with its source, are
`THRESHOLDS` (experiment/verdicts.py: fixed before measuring, never fitted to this project's runs); the lab computes
with the same objects (lab.py's failure gap and convergence margin, stats.py's interval level)."""
from __future__ import annotations

from collections import Counter

from ...experiment.pages import fmt
from ...experiment.verdicts import GATED, NOT_AT_SCALE, NOT_RUN, PARTLY, REPRODUCED, Threshold  # noqa: F401
from . import stats as St
from .stats import separated

INTERVAL_LEVEL = Threshold(
    "interval level", St.LEVEL, "central probability", "chosen",
    "percentile bootstrap intervals over whole seeds; a measure counts for or against the gate only when the gated "
    "and the baseline intervals do not overlap: the usual 5 % error level, fixed before any grid ran")
FAILURE_GAP = Threshold(
    "baseline failure: loss lost at the highest LR", 0.5, "nats", "chosen",
    "the grid shows the failure the claim is about when a baseline run spikes or diverges, or the baseline's "
    "seed-mean final loss at the highest LR is this far above its best LR's (perplexity x1.65: a loss no user misses)")
CONVERGED_MARGIN = Threshold(
    "converged LR: within the best LR's loss", 0.1, "nats", "chosen",
    "max stable LR = the largest LR of the contiguous range from the best LR whose seed-mean final loss stays this "
    "close to the best (about 10 % perplexity) with no run diverged")
SPIKE_DELTA = Threshold(
    "loss spike: above the trailing 50-step median", 0.1, "nats", "paper",
    "docs/paper_map.md §1.8: the rule that counts 125 spikes on the official 1.7B baseline's published loss curve (Fig. 1-right) "
    "and 0 on the gated one; train/monitors.py raises it to 6 robust sigmas of the window where batch noise alone "
    "exceeds it")
THRESHOLDS = (INTERVAL_LEVEL, FAILURE_GAP, CONVERGED_MARGIN, SPIKE_DELTA)

# what each resolved precision means for the residual stream, the paper's numerical argument
PRECISION_WORDS = {
    "fp32": "fp32",
    "bf16": "bf16 autocast (fp32 parameters and residual stream, bf16 matmuls)",
    "bf16-params": "bf16 parameters and activations (fp32 master weights, reductions and optimizer state)",
}


def evidence_precision(lab: dict) -> str:
    """The precision(s) the lab's runs trained in: each run's `resolved_precision` (counted), else the lab's
    `config.resolved_precision` for every run; "unrecorded" when neither is there."""
    runs = lab.get("runs") or []
    per_run = Counter(r.get("resolved_precision") for r in runs if isinstance(r, dict))
    if per_run and None not in per_run:
        return ", ".join(f"{n} run(s) in {PRECISION_WORDS.get(p, p)}" for p, n in sorted(per_run.items()))
    p = (lab.get("config") or {}).get("resolved_precision")
    if p is None:
        return "precision unrecorded"
    return f"{len(runs) or 'all'} run(s) in {PRECISION_WORDS.get(p, p)} (the lab's setting)"


def _iv_text(x, iv, lr: bool = False) -> str:
    f = (lambda v: "–" if v is None else f"{v:g}") if lr else (lambda v: fmt(v, 2))
    return f(x) + (f" [{f(iv[0])}, {f(iv[1])}]" if iv else "")


def stability_verdict(lab: dict) -> dict:
    """The stability row from a stability-lab lab.json (dict). The rule, per QK-norm setting and G1 variant, on three
    measures with bootstrap intervals over seeds (INTERVAL_LEVEL): max stable LR (higher = better; CONVERGED_MARGIN),
    LR sensitivity (lower = better), loss spikes per run (lower = better; SPIKE_DELTA). A measure counts for the gate
    when the gated interval lies entirely on the good side of the baseline's (no overlap), against it when entirely
    on the bad side.
      reproduced        : the baseline shows the failure in this grid (a spike, a divergence, or FAILURE_GAP nats
                          lost at the highest LR: lab.json "instability"), and with QK-norm on (the paper's models;
                          QK-norm off when only that was run) every G1 variant wins on at least one measure and loses
                          on none, all computed with the thresholds above;
      not at this scale : anything else (overlapping intervals, no failure of the baseline, a lab.json from before
                          the intervals or computed with other thresholds), with the numbers.
    The row names the precision its evidence trained in (`evidence_precision`: each run's resolved_precision)."""
    precision = evidence_precision(lab)
    settings = lab.get("settings")
    base_name = next((v for v in (settings or {}) if v in ("baseline", "none")), None)
    if not settings or base_name is None:
        sens = lab.get("lr_sensitivity") or {}
        base = sens.get("baseline") or sens.get("none") or {}
        parts = [f"{v.removeprefix('sdpa_')} QK-norm {qk}: {g:.2f} vs {base[qk]:.2f}" for v in GATED
                 for qk in ("off", "on") if (g := (sens.get(v) or {}).get(qk)) is not None and base.get(qk) is not None]
        return {"verdict": NOT_AT_SCALE if parts else NOT_RUN, "precision": precision,
                "this_run": f"LR sensitivity (gated vs baseline): {'; '.join(parts) or 'no comparable pair'}; no "
                            f"intervals over seeds in this lab.json (made before they existed): re-run the lab; "
                            f"{precision}"}
    inst = lab.get("instability") or {}
    qks = [k for k in ("on", "off") if settings[base_name].get(k)]
    judged = qks[0] if qks else None
    parts, wins = [], {}
    for qk in qks:
        b = settings[base_name][qk]
        cells = []
        for v in GATED:
            g = (settings.get(v) or {}).get(qk)
            if not g:
                continue
            pairs = [("max stable LR", g["max_stable_lr"]["interval"], b["max_stable_lr"]["interval"], False),
                     ("LR sensitivity", g["lr_sensitivity_interval"], b["lr_sensitivity_interval"], True),
                     ("spikes/run", g["spikes"]["interval"], b["spikes"]["interval"], True)]
            won = [n for n, gi, bi, low in pairs if separated(gi, bi, low)]
            lost = [n for n, gi, bi, low in pairs if separated(bi, gi, low)]
            if qk == judged:
                wins[v] = (won, lost)
            msl = g["max_stable_lr"]
            cells.append(f"{v.removeprefix('sdpa_')} {_iv_text(msl['lr'], msl['interval'], True)}"
                         f" / {_iv_text(g['lr_sensitivity'], g['lr_sensitivity_interval'])}"
                         f" / {_iv_text(g['spikes']['per_run'], g['spikes']['interval'])}"
                         + (f" (separates: {', '.join(won)})" if won else "")
                         + (f" (worse, separates: {', '.join(lost)})" if lost else ""))
        parts.append(f"QK-norm {qk}: max stable LR / LR sensitivity / spikes per run, baseline "
                     f"{_iv_text(b['max_stable_lr']['lr'], b['max_stable_lr']['interval'], True)} / "
                     f"{_iv_text(b['lr_sensitivity'], b['lr_sensitivity_interval'])} / "
                     f"{_iv_text(b['spikes']['per_run'], b['spikes']['interval'])} vs " + ", ".join(cells))
    seeds = len(settings[base_name][judged]["seeds"]) if judged else 0
    failed = bool(inst.get("reached"))
    level = (lab.get("config", {}).get("bootstrap") or {}).get("level", INTERVAL_LEVEL.value)
    this = "; ".join(parts) + f" ({seeds} seeds, {100 * level:.0f} % bootstrap intervals over seeds; {precision})"
    recorded = {INTERVAL_LEVEL.name: level, FAILURE_GAP.name: inst.get("margin", FAILURE_GAP.value),
                CONVERGED_MARGIN.name: (lab.get("config") or {}).get("margin", CONVERGED_MARGIN.value)}
    other = [f"{n} {v:g} (the rule's: {t.value:g})" for t, (n, v) in
             zip((INTERVAL_LEVEL, FAILURE_GAP, CONVERGED_MARGIN), recorded.items()) if v != t.value]
    if other:  # a lab run with other settings: its figures are shown, but the rule's thresholds were not used
        this += "; computed with " + ", ".join(other)
    if not failed:
        this += "; the baseline neither spiked nor diverged in this grid"
    if not wins:
        return {"verdict": NOT_RUN, "precision": precision, "this_run": this or "no G1 variant next to the baseline"}
    ok = failed and all(won and not lost for won, lost in wins.values()) and not other
    return {"verdict": REPRODUCED if ok else NOT_AT_SCALE, "precision": precision, "this_run": this}
