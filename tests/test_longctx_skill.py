"""`gattn longctx` at equal skill: the stopping rule (fake scorer), the trainer's step_hook, seed aggregation, the
paper-claim object and GATE:INIT model specs (the two-seed until-skill pipeline run is in test_longctx_pipeline.py)."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest

from gated_attention.experiment import stats
from gated_attention.longctx import pipeline as P
from gated_attention.longctx import longctx_report
from gated_attention.longctx import skill as S


class FakeScorer:
    """Scores from a list, one per call; records the steps it was asked at through the stopper."""

    def __init__(self, values):
        self.values = list(values)
        self.calls = 0

    def __call__(self, model):
        v = self.values[min(self.calls, len(self.values) - 1)]
        self.calls += 1
        return {"exact_match": v, "answer_nll": 1.0 - v}


class _Model:
    training = True

    def train(self, mode=True):
        self.training = mode


def test_skill_stop_checks_every_n_and_stops_at_threshold(tmp_path):
    scorer = FakeScorer([0.0, 0.5, 0.89, 0.9, 1.0])
    logs = []
    stop = S.SkillStop(scorer, every=10, threshold=0.9, log_path=tmp_path / "skill.jsonl", log=logs.append)
    reasons = {}
    for step in range(1, 51):  # as the trainer calls it: after every step, until it answers a stop reason
        reasons[step] = stop(step, _Model())
        if reasons[step]:
            break
    assert scorer.calls == 4  # steps 10, 20, 30, 40
    assert [s for s, r in reasons.items() if r] == [40]  # 0.89 at step 30 is not >= 0.9
    assert "0.900" in reasons[40] and "step 40" in reasons[40]
    assert len(logs) == 4 and "held-out skill 89%" in logs[2]
    checks = S.read_skill_log(tmp_path / "skill.jsonl")
    assert [(c["step"], c["exact_match"]) for c in checks] == [(10, 0.0), (20, 0.5), (30, 0.89), (40, 0.9)]
    assert S.steps_to_skill(checks, 0.9) == 40
    assert S.steps_to_skill(checks, 0.5) == 20
    assert S.steps_to_skill(checks, 0.5, steps_run=10) is None  # checks after the run's end do not count
    assert S.steps_to_skill(checks, 0.95) is None
    with pytest.raises(ValueError, match="until-skill"):
        S.SkillStop(scorer, 10, 1.5)
    with pytest.raises(ValueError, match=">= 1"):
        S.SkillStop(scorer, 0, 0.9)


def test_skill_log_after_resume_keeps_last_record_per_step_and_skips_torn_lines(tmp_path):
    p = tmp_path / "skill.jsonl"
    p.write_text('{"step": 10, "exact_match": 0.1}\n{"step": 20, "exact_match": 0.2}\n'
                 '{"step": 20, "exact_match": 0.95}\n{"step": 30, "exa')
    checks = S.read_skill_log(p)
    assert [(c["step"], c["exact_match"]) for c in checks] == [(10, 0.1), (20, 0.95)]
    assert S.read_skill_log(tmp_path / "missing.jsonl") == []


def test_report_spread_and_wilson():
    """The report aggregates seeds with the toolkit's convention (experiment.stats): one seed has no spread."""
    s = stats.spread([80.0, 100.0, None])
    assert s["mean"] == 90.0 and s["n"] == 2 and s["std"] == pytest.approx(math.sqrt(200.0))
    assert stats.spread([None])["mean"] is None
    assert stats.spread([5.0]) == {"mean": 5.0, "std": None, "min": 5.0, "max": 5.0, "n": 1}
    lo, hi = stats.wilson(30, 30)
    assert hi == pytest.approx(100.0) and 85 < lo < 92  # 30/30 is not certainty
    lo, hi = stats.wilson(15, 30)
    assert lo < 50 < hi and hi - lo == pytest.approx(2 * 17.0, abs=1.5)  # ~ +-17 points at n=30


def test_model_specs():
    assert P.parse_model("sdpa_elementwise:identity") == ("sdpa_elementwise", "identity")
    assert P.canonical_model("sdpa_elementwise:normal") == "sdpa_elementwise"
    assert P.model_dir_name("sdpa_elementwise:identity") == "sdpa_elementwise.identity"
    for bad, msg in (("baseline:identity", "no gate"), ("sdpa_elementwise:zeros", "unknown gate init"),
                     ("nogate", "nogate")):
        with pytest.raises(ValueError, match=msg):
            P.parse_model(bad)
    tc = P.train_config_for(P.BUDGETS["small"], "sdpa_elementwise", "data", 3, "identity")
    assert tc.model_overrides["gate_init"] == "identity" and tc.seed == 3
    assert "gate_init" not in P.train_config_for(P.BUDGETS["small"], "sdpa_elementwise", "data", 0).model_overrides
    fair = P.BUDGETS["fair"]
    assert fair.until_skill == 0.9 and fair.seeds >= 2 and fair.samples >= 30
    assert {"baseline", "sdpa_elementwise", "sdpa_elementwise:identity"} <= set(fair.models)


def _eval(avgs: dict, hits: dict, n_samples: int = 4):
    """A fake eval_stage result with average scores by length and `hits[length]` successes of n_samples."""
    recs = [dict(target_length=n, score=1.0 if i < hits[n] else 0.0) for n in avgs for i in range(n_samples)]
    return dict(average={str(n): v for n, v in avgs.items()}, scores={"passkey": {str(n): v for n, v in avgs.items()}},
                average_answer_nll={str(n): 0.5 for n in avgs}, records=recs, pos_loss=[1.0] * 1024)


def _fake_report(yarn_gated: float, yarn_base: float, reached=True, models=("baseline", "sdpa_elementwise")):
    b = dataclasses.replace(P.BUDGETS["small"], until_skill=0.9, seeds=2)
    lengths, models, seeds = [128, 256, 512, 1024], list(models), [0, 1]
    results, training = {}, {}
    for m in models:
        for s in seeds:
            y = yarn_gated if m != "baseline" else yarn_base
            results[(m, s, "none")] = _eval({128: 100.0, 256: 100.0, 512: 0.0, 1024: 0.0},
                                            {128: 4, 256: 4, 512: 0, 1024: 0})
            results[(m, s, "yarn")] = _eval({128: 50.0, 256: 100.0, 512: y + 25 * s, 1024: y},
                                            {128: 2, 256: 4, 512: 1, 1024: 0})
            training[(m, s)] = dict(steps_run=300 + 100 * s, until_skill=0.9,
                                    steps_to_skill=300 + 100 * s if reached or m == "baseline" or s == 0 else None,
                                    checks=[{"step": 300 + 100 * s, "exact_match": 0.5, "answer_nll": 0.7}])
    return longctx_report.build_report(results, training, b, lengths, 4, models, seeds)


def test_report_aggregates_seeds_and_pools_intervals():
    rep = _fake_report(25.0, 50.0)
    row = longctx_report.rep_row(rep["rows"], "sdpa_elementwise", "yarn")
    assert row["average"][512] == 37.5 and row["average_std"][512] == pytest.approx(math.sqrt(2 * 12.5 ** 2))
    assert row["per_seed"]["1"][512] == 50.0
    assert row["delta"][512] == 37.5 and row["delta"][128] == -50.0
    assert row["pooled"][256]["hits"] == 8 and row["pooled"][256]["samples"] == 8
    assert row["pooled"][512]["hits"] == 2 and row["pooled"][512]["wilson95"][0] < 25 < row["pooled"][512]["wilson95"][1]
    assert rep["steps_to_skill"]["baseline"]["mean"] == 350 and rep["steps_to_skill"]["baseline"]["n"] == 2
    md = longctx_report.format_markdown(rep)
    assert "## Steps to reach the skill at L" in md and "| Baseline | 300 | 400 | 350 ± 71 |" in md
    assert "8/8 [" in md and "37.5 ± 17.7 (+37.5)" in md
    fixed = dict(rep, budget={**rep["budget"], "until_skill": None},  # a fixed step count: no skill step to count
                 training={m: [dict(t, until_skill=None, steps_to_skill=None) for t in ts]
                           for m, ts in rep["training"].items()},
                 steps_to_skill={m: stats.spread([]) for m in rep["training"]})
    md = longctx_report.format_markdown(fixed)
    assert "## Training steps (a fixed count" in md and "| Baseline | 300 (fixed) | 400 (fixed) | - |" in md
    json.dumps(rep)  # every number serialises


def test_claim_verdicts():
    seen = set()  # every verdict the rule gives below
    c = _fake_report(60.0, 20.0)["claim"]
    seen.add(c["verdict"])
    assert set(c) == {"paper", "this_run", "verdict"} and "58.82" in c["paper"]
    assert c["verdict"] == "reproduced" and "sdpa_elementwise vs baseline" in c["this_run"]
    assert _fake_report(22.0, 20.0)["claim"]["verdict"] == "partly"  # ahead by 2 points only
    weak = _fake_report(60.0, 20.0)  # ahead, but the gated model scores below the threshold at L without YaRN
    longctx_report.rep_row(weak["rows"], "sdpa_elementwise", "none")["average"][256] = 80.0
    c = longctx_report.claim(weak)
    seen.add(c["verdict"])
    assert c["verdict"] == "partly" and "below 90 % at L without YaRN (not at equal skill): sdpa_elementwise" in c["this_run"]
    c = _fake_report(10.0, 20.0)["claim"]
    seen.add(c["verdict"])
    assert c["verdict"] == "not at this scale"
    rep = _fake_report(60.0, 20.0, reached=False)  # gated seed 1 never reached the skill: left out, reported
    c = rep["claim"]
    assert c["verdict"] == "partly" and "left out, did not reach the skill at L: sdpa_elementwise seed 1" in c["this_run"]
    assert longctx_report.rep_row(rep["rows"], "sdpa_elementwise", "yarn")["seeds"] == [0]
    assert longctx_report.rep_row(rep["rows"], "sdpa_elementwise", "yarn")["average"][1024] == 60.0  # seed 0 alone
    assert [(x["model"], x["seed"]) for x in rep["excluded"]] == [("sdpa_elementwise", 1)]
    assert rep["excluded"][0]["average"]["yarn"][512] == 85.0
    md = longctx_report.format_markdown(rep)
    assert ("Left out of the score tables (not at equal skill): Gated (sdpa_elementwise) seed 1 did not reach the "
            "skill in 400 steps; held-out 50 % at its last check, step 400") in md
    assert "| Gated (sdpa_elementwise) [seed 0 only] + YaRN -> 1024 |" in md
    # other gated models are listed for the reader; the verdict stays on the baseline vs normal-init pair
    c = _fake_report(10.0, 20.0, models=("baseline", "sdpa_elementwise", "sdpa_elementwise:identity"))["claim"]
    assert c["verdict"] == "not at this scale" and "sdpa_elementwise vs baseline" in c["this_run"]
    assert "other gated models, mean beyond L after YaRN: sdpa_elementwise:identity 16.2" in c["this_run"]  # (22.5 + 10) / 2
    rep = _fake_report(60.0, 20.0)
    rep["rows"] = [r for r in rep["rows"] if r["model"] == "baseline"]
    c = longctx_report.claim(rep)
    seen.add(c["verdict"])
    assert c["verdict"] == "not run here"
    # the rule speaks the verdict words every claim shares (experiment/verdicts.py), and each of them is reachable
    assert seen == set(longctx_report.VERDICTS), (seen, longctx_report.VERDICTS)


def test_plot_has_a_skill_panel_only_when_checks_exist(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = []
    real = plt.subplots
    monkeypatch.setattr(plt, "subplots", lambda *a, **k: (panels.append(a[1]), real(*a, **k))[1])
    rep = _fake_report(25.0, 50.0)
    for ts in rep["training"].values():  # no checks (no stopping rule): score and PPL panels
        for t in ts:
            t["checks"] = []
    longctx_report.plot_report(rep, tmp_path / "a.png")
    for ts in rep["training"].values():
        for t in ts:
            t["checks"] = [{"step": 50, "exact_match": 0.0, "answer_nll": 2.0},
                           {"step": 100, "exact_match": 0.95, "answer_nll": 0.1}]
    longctx_report.plot_report(rep, tmp_path / "b.png")
    assert panels == [2, 3] and (tmp_path / "a.png").stat().st_size > 0 and (tmp_path / "b.png").stat().st_size > 0
