"""The scaling lab's confirmatory design and estimators (labs/scaling/design.py, summary.py, verdict.py), each against
an oracle that is not the code under test: the multiplier fit recovering a known k from synthetic losses, the
weighted trend against the normal equations solved with numpy, the planned pairs from a known variance, the multiplier
rule on both sides of each threshold, the contiguous LR basin, and a diverged run counted as its arm's failure."""
from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest

from gated_attention.labs.scaling import design as Dz
from gated_attention.labs.scaling import scaling_lab as sl
from gated_attention.labs.scaling import verdict as V

pytestmark = pytest.mark.xdist_group("lab_scaling")

C = {"a": 1e10, "b": 4e10, "c": 1.6e11, "d": 6.4e11}


def synthetic(k: dict[str, float], noise: float, seeds=range(100, 108), e=2.0, a=40.0, alpha=0.15, rng_seed=1):
    rng = random.Random(rng_seed)
    arms = {"baseline": 1.0, **k}
    return {arm: {s: {sd: e + a * (kk * c) ** -alpha + rng.gauss(0, noise) for sd in seeds} for s, c in C.items()}
            for arm, kk in arms.items()}


def test_multiplier_fit_recovers_a_known_k():
    """Losses made from L = E + A (k C)^-alpha with k = 1.3 and 0.85 and a little noise: the joint fit gives ln k
    within 0.03 and intervals that cover the truth and exclude 0; per size too."""
    losses = synthetic({"g_up": 1.3, "g_down": 0.85}, noise=0.002)
    res = Dz.multiplier_fit(C, losses, "baseline", n_boot=300)
    for arm, k in (("g_up", 1.3), ("g_down", 0.85)):
        o = res["overall"][arm]
        assert o["ln_k"] == pytest.approx(math.log(k), abs=0.03)
        assert o["ci_low"] - 0.01 < math.log(k) < o["ci_high"] + 0.01  # a percentile bootstrap over 8 seeds
        for s in C:
            assert res["per_size"][arm][s]["ln_k"] == pytest.approx(math.log(k), abs=0.08)
    assert res["overall"]["g_up"]["ci_low"] > 0 > res["overall"]["g_down"]["ci_high"]
    assert res["fit"]["alpha"] == pytest.approx(0.15, abs=0.03)
    # noiseless: exact
    exact = Dz.multiplier_fit(C, synthetic({"g": 1.17}, noise=0.0), "baseline", n_boot=0)
    assert exact["overall"]["g"]["ln_k"] == pytest.approx(math.log(1.17), abs=0.005)


def test_local_slope_is_the_baselines_drop_per_e_fold():
    fit = {"E": 2.0, "A": 40.0, "alpha": 0.15}
    c = 1e11
    loss = lambda x: fit["E"] + fit["A"] * x ** -fit["alpha"]  # noqa: E731
    numeric = (loss(c * math.exp(-1e-4)) - loss(c * math.exp(1e-4))) / 2e-4
    assert Dz.local_slope(fit, c) == pytest.approx(numeric, rel=1e-6)


def test_wls_trend_matches_the_normal_equations():
    """The slope, its standard error and interval against (X' W X)^-1 X' W y solved with numpy, sigma^2 from the
    weighted residuals over N - 2."""
    rng = np.random.default_rng(3)
    x = np.repeat(np.log([1e10, 4e10, 1.6e11, 6.4e11]), [6, 4, 4, 3])
    w = np.repeat([4.0, 2.0, 1.0, 0.5], [6, 4, 4, 3])
    y = -0.1 + 0.02 * (x - x.mean()) + rng.normal(0, 0.03, len(x)) / np.sqrt(w)
    got = Dz.wls_trend(list(zip(x.tolist(), y.tolist(), w.tolist())))
    X = np.stack([np.ones_like(x), x], 1)
    W = np.diag(w)
    beta = np.linalg.solve(X.T @ W @ X, X.T @ W @ y)
    r = y - X @ beta
    s2 = float(r @ W @ r) / (len(x) - 2)
    se = math.sqrt(s2 * np.linalg.inv(X.T @ W @ X)[1, 1])
    assert got["slope"] == pytest.approx(beta[1], rel=1e-9)
    assert got["se"] == pytest.approx(se, rel=1e-9)
    from scipy import stats
    half = stats.t.ppf(0.975, len(x) - 2) * se
    assert got["ci_low"] == pytest.approx(beta[1] - half, rel=1e-3)
    assert got["df"] == len(x) - 2


def test_planned_pairs_from_a_known_variance():
    """Pilot values with a within-arm sd of exactly 0.05 (both arms): the pair sd is sqrt(2) x 0.05 and n is the
    smallest with SE <= threshold / 2.80; the smallest of >2 sizes doubles its n; the cap and the pilot bound it."""
    vals = [1.0 - 0.05 * math.sqrt(1.5), 1.0, 1.0, 1.0 + 0.05 * math.sqrt(1.5)]  # sd exactly 0.05 (n - 1 = 3)
    assert np.std(vals, ddof=1) == pytest.approx(0.05)
    pilot = {s: {"baseline": vals, "g": [v + 0.3 for v in vals]} for s in ("s1", "s2", "s3")}
    thr = {"s1": 0.06, "s2": 0.06, "s3": 0.03}
    plan = Dz.plan_pairs(pilot, thr, n_min=4, cap=40)
    want = math.ceil((math.sqrt(2) * 0.05 * (1.959964 + 0.841621) / 0.06) ** 2)  # 11
    assert plan["s2"]["n_power"] == want and plan["s2"]["n_planned"] == want
    assert plan["s2"]["sd_within"] == pytest.approx(0.05) and plan["s2"]["df"] == 6
    assert plan["s1"]["n_planned"] == 2 * want  # the cheap end of the ladder
    assert plan["s3"]["n_power"] == math.ceil((math.sqrt(2) * 0.05 * 2.801585 / 0.03) ** 2)
    capped = Dz.plan_pairs(pilot, thr, n_min=4, cap=10)
    assert capped["s3"]["n_planned"] == 10 and capped["s3"]["capped"]
    # the plan is blind to Δ: shifting one arm's pilot by any constant changes nothing
    shifted = {s: {"baseline": vals, "g": [v - 0.7 for v in vals]} for s in pilot}
    assert {s: r["n_planned"] for s, r in Dz.plan_pairs(shifted, thr, 4, 40).items()} == \
        {s: r["n_planned"] for s, r in plan.items()}


def test_pairs_needed_is_at_80_percent_power_with_a_range():
    got = Dz.pairs_needed(-0.05, 0.06, 4, 0.02)
    n = got["n"]
    assert (V.t975(n - 1) + V.Z_80) * 0.06 / math.sqrt(n) <= 0.05 < (V.t975(n - 2) + V.Z_80) * 0.06 / math.sqrt(n - 1)
    assert got["low"] <= n <= got["high"] and got["low"] < got["high"]
    assert Dz.chi2_quantile(0.975, 3) == pytest.approx(9.348, rel=0.02)  # the chi-square table


K = V.LN_K_BAR


@pytest.mark.parametrize("ln_k,low,high,want", [
    (K + 1e-3, 1e-3, 0.5, V.REPRODUCED),
    (K - 1e-3, 1e-3, 0.5, V.SMALLER),
    (0.0, -K + 1e-3, K - 1e-3, V.NO_EFFECT),
    (0.0, -K - 1e-3, K - 1e-3, V.INCONCLUSIVE),
    (-0.2, -0.4, -1e-3, V.WORSE),
    (0.2, -1e-3, 0.4, V.INCONCLUSIVE),
])
def test_multiplier_rule_on_both_sides_of_each_threshold(ln_k, low, high, want):
    assert V.judge_multiplier(ln_k, low, high) == want


def test_k_paper_is_the_derivation_from_chinchillas_slopes():
    assert V.K_PAPER.kind == "paper" and V.K_PAPER.value == pytest.approx(math.exp(0.0128 / 0.083), abs=0.01)
    assert V.K_LOW.value == pytest.approx(math.exp(0.0128 / 0.100), abs=0.01)


def test_lr_basin_is_contiguous_around_the_best():
    """An LR within the margin past a worse one is a hole, not part of the basin; a diverged LR ends it."""
    b = V.lr_basin({0.004: 3.00, 0.008: 3.30, 0.016: 2.99, 0.032: 3.02, 0.064: 3.5})
    assert (b["best_lr"], b["low"], b["high"]) == (0.016, 0.016, 0.032) and b["holes"] == [0.004]
    b = V.lr_basin({0.004: 3.01, 0.008: float("nan"), 0.016: 3.0})
    assert (b["low"], b["high"]) == (0.016, 0.016)


def test_a_diverged_run_counts_as_its_arms_failure(tiny_corpus, tmp_path, monkeypatch):
    """A stand-in unit: the gated arm's confirm seed 101 returns a non-finite loss at d12. It is listed in failures,
    enters Δ at ln(vocab) (the gated arm loses that pair), and the pair count is unchanged."""
    def fake_unit(task):
        cfg, *_ = task
        size = cfg["model_overrides"]["hidden_size"]
        loss = 5.0 - 0.3 * math.log(size) + 0.002 * (cfg["seed"] % 5) - 0.01 * (cfg["gate"] == "sdpa_elementwise")
        if cfg["gate"] == "sdpa_elementwise" and cfg["seed"] == 101 and size == 12:
            loss = float("nan")
        return {"val_loss": loss, "val_loss_per_domain": {"prose": loss, "code": loss}, "heldout_loss": None,
                "tokens": 1, "diverged": not math.isfinite(loss), "curve": {"tokens": [1], "loss": [loss]}}

    monkeypatch.setattr(sl, "train_unit", fake_unit)
    lab = sl.LabConfig().changed(out=str(tmp_path / "lab"), budget="quick", variants=("baseline", "sdpa_elementwise"),
                                 data_dir=str(tiny_corpus), seeds=3)
    res = sl.run_lab(lab, log=lambda m: None)
    assert [(f["size"], f["seed"]) for f in res["failures"]] == [("d12l1", 101)]
    vocab = json.loads((tiny_corpus / "manifest.json").read_text())["vocab_size"]
    d = next(x for x in res["deltas"] if x["size"] == "d12l1")
    assert d["n_seeds"] == 3
    base = {r["seed"]: r["val_loss"] for r in res["runs"] if r["role"] == "confirm" and r["size"] == "d12l1"
            and r["variant"] == "baseline"}
    assert d["per_seed"][1] == pytest.approx(math.log(vocab) - base[101])
    assert d["mean"] > 0  # the failure dominates: the arm that failed is not flattered
