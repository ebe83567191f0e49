"""The stability lab's verdict on the paper's stability claim, read off a lab.json: the rule `gattn lab stability`
prints under its table and `gattn compare`'s "Paper claims vs this run" table shows in its stability row
(compare/claims.py imports it from here, with the verdict words, so both always say the same)."""
from __future__ import annotations

from ...experiment.report import fmt
from .stats import separated

REPRODUCED, PARTLY, NOT_AT_SCALE, NOT_RUN = "reproduced", "partly", "not at this scale", "not run here"
GATED = ("sdpa_elementwise", "sdpa_headwise")  # the paper's G1 variants, judged against the baseline


def _iv_text(x, iv, lr: bool = False) -> str:
    f = (lambda v: "–" if v is None else f"{v:g}") if lr else (lambda v: fmt(v, 2))
    return f(x) + (f" [{f(iv[0])}, {f(iv[1])}]" if iv else "")


def stability_verdict(lab: dict) -> dict:
    """The stability row from a stability-lab lab.json (dict). The rule, per QK-norm setting and G1 variant, on three
    measures with bootstrap intervals over seeds: max stable LR (higher = better), LR sensitivity (lower = better),
    loss spikes per run (lower = better). A measure counts for the gate when the gated interval lies entirely on the
    good side of the baseline's (no overlap), against it when entirely on the bad side.
      reproduced        : the baseline shows the failure in this grid (a spike, a divergence, or >= 0.5 nats lost at
                          the highest LR: lab.json "instability"), and with QK-norm on (the paper's models; QK-norm off
                          when only that was run) every G1 variant wins on at least one measure and loses on none;
      not at this scale : anything else (overlapping intervals, no failure of the baseline, or a lab.json from before
                          the intervals), with the numbers."""
    settings = lab.get("settings")
    base_name = next((v for v in (settings or {}) if v in ("baseline", "none")), None)
    if not settings or base_name is None:
        sens = lab.get("lr_sensitivity") or {}
        base = sens.get("baseline") or sens.get("none") or {}
        parts = [f"{v.removeprefix('sdpa_')} QK-norm {qk}: {g:.2f} vs {base[qk]:.2f}" for v in GATED
                 for qk in ("off", "on") if (g := (sens.get(v) or {}).get(qk)) is not None and base.get(qk) is not None]
        return {"verdict": NOT_AT_SCALE if parts else NOT_RUN,
                "this_run": f"LR sensitivity (gated vs baseline): {'; '.join(parts) or 'no comparable pair'}; no "
                            f"intervals over seeds in this lab.json (made before they existed): re-run the lab"}
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
    level = (lab.get("config", {}).get("bootstrap") or {}).get("level", 0.95)
    this = "; ".join(parts) + f" ({seeds} seeds, {100 * level:.0f} % bootstrap intervals over seeds)"
    if not failed:
        this += "; the baseline neither spiked nor diverged in this grid"
    if not wins:
        return {"verdict": NOT_RUN, "this_run": this or "no G1 variant next to the baseline"}
    ok = failed and all(won and not lost for won, lost in wins.values())
    return {"verdict": REPRODUCED if ok else NOT_AT_SCALE, "this_run": this}
