"""`gattn lab quant` (issue 39 item 1): the lab.json contract on tiny models built here (a compare-shaped OUT of
baseline and G1 models over 3 seeds, and sink-lab units), a row's numbers against a by-hand quantize-then-score, the
verdict rule on both sides of its margin with synthetic numbers (Welch intervals against SciPy, the paired
policy-vs-policy difference deciding the recommendation, no recommendation when no policy holds), --report-only
re-judging stored rows, resume after an interruption (only the missing rows
are measured, the result equals an uninterrupted run's), refusal of changed settings, and bad input."""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict

import pytest
import torch
import torch.nn.functional as F

from _extras import need
from harness import perturb, tiny_lm

need("torchao", "pip install -e '.[quant]'")

from gated_attention.labs.quant import QuantLabConfig, resolve_models, run_lab  # noqa: E402
from gated_attention.labs.quant import verdict as V  # noqa: E402

# one xdist worker runs this file whole: its module fixtures (a lab run) are built once (tests/conftest.py)
pytestmark = pytest.mark.xdist_group("lab_quant")


SEQ = 32
SCHEMES = ["w8a8-tensor", "awq-int4"]
SMALL = dict(eval_windows=6, calibration_windows=4)


def _save(out, name, gate, seed, data_dir):
    m = perturb(tiny_lm(gate, vocab_size=320, hidden_size=64, head_dim=16, intermediate_size=128, seed=seed),
                seed=seed + 1, std=0.05)
    run = out / "runs" / name
    m.save_pretrained(run / "final")
    (run / "train_config.json").write_text(json.dumps({"gate": gate, "data_dir": str(data_dir), "seq_len": SEQ,
                                                       "seed": seed}))


@pytest.fixture(scope="module")
def compare_out(tmp_path_factory, tiny_corpus):
    """A compare-shaped OUT: runs/<variant>[_seed<k>]/final for baseline and G1 elementwise, seeds 0-2."""
    out = tmp_path_factory.mktemp("cmp")
    for gate in ("baseline", "sdpa_elementwise"):
        for k in range(3):
            _save(out, gate if k == 0 else f"{gate}_seed{k}", gate, k, tiny_corpus)
    return out


@pytest.fixture(scope="module")
def lab(compare_out, tmp_path_factory):
    out = tmp_path_factory.mktemp("quant")
    cfg = QuantLabConfig(models=[str(compare_out)], schemes=SCHEMES, **SMALL)
    return run_lab(cfg, out, log=lambda m: None), out, cfg


def test_resolution_reads_gate_and_seed_from_the_run(compare_out):
    ms = {m.label: m for m in resolve_models([compare_out])}
    assert set(ms) == {"baseline", "baseline_seed1", "baseline_seed2", "sdpa_elementwise", "sdpa_elementwise_seed1",
                       "sdpa_elementwise_seed2"}
    assert ms["sdpa_elementwise_seed2"].variant == "sdpa_elementwise" and ms["sdpa_elementwise_seed2"].seed == "2"
    assert ms["baseline_seed1"].variant == "none" and ms["baseline_seed1"].baseline
    assert not ms["sdpa_elementwise"].baseline
    assert len({m.family for m in ms.values()}) == 1  # same shape and corpus: compared with each other


def test_contract_rows_and_keys(lab):
    res, out, cfg = lab
    on_disk = json.loads((out / "lab.json").read_text())
    rows = on_disk["results"]
    assert len(rows) == 6 * len(SCHEMES) * 3  # every (model, scheme, policy)
    for r in rows:
        assert {"model", "scheme", "policy", "val_loss", "delta_nats", "gate_mean", "gate_near_zero", "f_attn",
                "val_loss_per_domain", "delta_per_domain"} <= set(r)
        assert set(r["val_loss_per_domain"]) == {"prose", "code"}
        ref = on_disk["reference"][r["model"]]
        assert r["delta_nats"] == pytest.approx(r["val_loss"] - ref["val_loss"], abs=1e-9)
        for d, v in r["delta_per_domain"].items():
            assert v == pytest.approx(r["val_loss_per_domain"][d] - ref["val_loss_per_domain"][d], abs=1e-9)
        assert 0 < r["f_attn"] < 1
    base = [r for r in rows if r["model"] == "baseline" and r["scheme"] == "w8a8-tensor"]
    assert {r["policy"] for r in base} == {"all", "keep-gate", "split-gate"}
    assert all(r["gate_mean"] is None and not r["policy_applies"] for r in base)
    assert len({r["val_loss"] for r in base}) == 1  # no gate: one model under every policy
    g = {r["policy"]: r for r in rows if r["model"] == "sdpa_elementwise" and r["scheme"] == "w8a8-tensor"}
    assert all(0 < r["gate_mean"] < 1 and 0 <= r["gate_near_zero"] <= 1 for r in g.values())
    assert g["all"]["val_loss"] != g["keep-gate"]["val_loss"]  # the policy reaches the gate
    # paired comparisons: one per (gated arm, scheme, policy), 3 seeds each
    assert len(on_disk["comparisons"]) == len(SCHEMES) * 3
    assert all(c["n_seeds"] == 3 and c["verdict"] in (V.LIKE, V.MORE, V.LESS, V.INCONCLUSIVE)
               for c in on_disk["comparisons"])
    assert all(c["interval"] == "welch" and c["n_gated"] == c["n_baseline"] == 3 for c in on_disk["comparisons"])
    # policy vs policy on the same models: one per (gated arm, scheme, pair of policies), 3 models each
    pcs = on_disk["policy_comparisons"]
    assert len(pcs) == len(SCHEMES) * 3
    assert {(c["policy"], c["against"]) for c in pcs} == {("all", "split-gate"), ("all", "keep-gate"),
                                                          ("split-gate", "keep-gate")}
    assert all(c["interval"] == "paired" and c["n_models"] == 3 for c in pcs)
    fam = next(iter(on_disk["verdict"]["per_family"].values()))
    assert fam["recommended"] in ("all", "keep-gate", "split-gate", None)
    assert set(fam["policy_pairs"]) == {"all vs split-gate", "all vs keep-gate", "split-gate vs keep-gate"}
    for f in ("report.md", "report.html", "plots/deltas.png", "plots/comparisons.png"):
        assert (out / f).stat().st_size > 0
    report = (out / "report.md").read_text()
    assert ("recommended" in report) if fam["recommended"] else ("no recommendation" in report and fam["to_decide"])


def test_a_row_equals_quantize_then_score_by_hand(lab, compare_out, tiny_corpus):
    from gated_attention import data
    from gated_attention.modeling import GatedQwen3ForCausalLM
    from gated_attention.quant import quantize_model

    res, _, cfg = lab
    model = GatedQwen3ForCausalLM.from_pretrained(compare_out / "runs" / "sdpa_elementwise_seed1" / "final").eval()
    q = quantize_model(model, "w8a8-tensor", "split-gate")
    corpus = data.Corpus(tiny_corpus)
    per = {}
    for d in corpus.domains:
        x = torch.cat(list(data.eval_batches(corpus, d, SEQ, None, 32)))[: cfg.eval_windows]  # (n, T+1)
        with torch.no_grad():
            logits = q(input_ids=x[:, :-1]).logits
        per[d] = float(F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()))
    row = next(r for r in res["results"] if r["model"] == "sdpa_elementwise_seed1" and r["scheme"] == "w8a8-tensor"
               and r["policy"] == "split-gate")
    for d in per:
        assert row["val_loss_per_domain"][d] == pytest.approx(per[d], rel=1e-5)
    assert row["val_loss"] == pytest.approx(sum(per.values()) / len(per), rel=1e-5)


def test_resume_measures_only_missing_rows_and_refuses_changed_settings(compare_out, lab, tmp_path, monkeypatch):
    from gated_attention.experiment.cache import StaleResult
    from gated_attention.labs.quant import quant_lab

    full, _, cfg = lab
    real, calls = quant_lab.measure, []

    def dying(*a, **k):  # the run is killed at its 10th measurement
        calls.append(1)
        if len(calls) == 10:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(quant_lab, "measure", dying)
    with pytest.raises(KeyboardInterrupt):
        run_lab(cfg, tmp_path, log=lambda m: None)
    stored = len(list((tmp_path / "rows").glob("*/*.json")))
    assert stored == 9
    monkeypatch.setattr(quant_lab, "measure", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    calls.clear()
    again = run_lab(cfg, tmp_path, log=lambda m: None)
    # per model: reference + per scheme (1 row ungated, 3 gated): 3 x 3 + 3 x 7 = 30 measurements in all
    assert len(calls) == 30 - stored
    strip = lambda rs: [{k: v for k, v in r.items() if k != "cpu_s"} for r in rs]
    assert strip(again["results"]) == strip(full["results"])
    with pytest.raises(StaleResult, match="eval_windows: saved 6 vs requested 5"):
        run_lab(QuantLabConfig(**{**asdict(cfg), "eval_windows": 5}), tmp_path, log=lambda m: None)


def test_verdict_rule_on_both_sides_of_the_margin():
    d = V.MARGIN.value
    assert d == pytest.approx(0.01275, abs=1e-5)

    def rows(shift, seeds=(0, 1, 2), jitter=1e-4, policy="all"):
        out = []
        for k in seeds:
            base = 0.02 + 0.001 * k
            out.append({"family": "f", "arm": "none", "variant": "none", "baseline": True, "seed": str(k),
                        "scheme": "int4-weight", "policy": policy, "delta_nats": base})
            out.append({"family": "f", "arm": "g1", "variant": "sdpa_elementwise", "baseline": False,
                        "seed": str(k), "scheme": "int4-weight", "policy": policy,
                        "delta_nats": base + shift + jitter * (k - 1)})
        return out

    verdict = lambda rs: V.comparisons(rs)[0]["verdict"]
    assert verdict(rows(0.8 * d)) == V.LIKE  # inside the margin
    assert verdict(rows(1.2 * d)) == V.MORE  # past it
    assert verdict(rows(-1.2 * d)) == V.LESS
    assert verdict(rows(0.8 * d, jitter=0.01)) == V.INCONCLUSIVE  # the interval reaches past +δ and below 0
    assert verdict(rows(0.0, seeds=(0, 1))) == V.INCONCLUSIVE  # fewer than 3 seeds
    # `all` fails, split-gate and keep-gate hold; on the same models split-gate is within δ of keep-gate and `all`
    # costs 1.1 δ more than split-gate: split-gate is recommended
    rs = rows(1.2 * d) + rows(0.1 * d, policy="split-gate") + rows(0.0, policy="keep-gate")
    pv = V.policy_verdicts(V.comparisons(rs), V.policy_comparisons(rs))["f"]
    assert pv["per_policy"]["all"]["verdict"] == V.FAILS and pv["per_policy"]["split-gate"]["verdict"] == V.HOLDS
    assert pv["recommended"] == "split-gate"


def _arm_rows(family, arm, policy, scheme, deltas, baseline=False):
    return [{"family": family, "arm": arm, "variant": "none" if baseline else "sdpa_elementwise", "baseline": baseline,
             "seed": str(k), "scheme": scheme, "policy": policy, "delta_nats": v} for k, v in enumerate(deltas)]


def test_no_recommendation_when_no_policy_holds():
    """Every policy inconclusive (wide spreads across models): no recommendation, and the verdict names what would
    decide it — the models per arm at which a Welch interval of the measured spreads decides (checked against SciPy's
    t quantile at that n and the one below). keep-gate has the most comparisons "like", which the old fallback
    recommended."""
    scipy_stats = need("scipy.stats", "pip install -e '.[dev]'")
    d = V.MARGIN.value
    rows = []
    for policy in ("all", "split-gate", "keep-gate"):
        rows += _arm_rows("f", "none", policy, "int4-weight", [0.020, 0.026, 0.032], baseline=True)
        rows += _arm_rows("f", "none", policy, "nvfp4", [0.020, 0.021, 0.022], baseline=True)
        rows += _arm_rows("f", "g1", policy, "int4-weight", [0.020, 0.034, 0.044])  # wide: inconclusive
        rows += _arm_rows("f", "g1", policy, "nvfp4", [0.021, 0.0215, 0.022] if policy == "keep-gate"
                          else [0.020, 0.034, 0.044])
    comps = V.comparisons(rows)
    pv = V.policy_verdicts(comps, V.policy_comparisons(rows))["f"]
    assert [x["verdict"] for x in pv["per_policy"].values()] == [V.INCONCLUSIVE] * 3
    assert pv["per_policy"]["keep-gate"]["like_or_less"] == 1 and pv["per_policy"]["all"]["like_or_less"] == 0
    assert pv["recommended"] is None
    assert "no recommendation" in V.verdict_text({"f": pv}) and len(pv["to_decide"]) == 3
    c = max((c for c in comps if c["policy"] == "all"), key=lambda c: c["models_needed"])  # the hardest to decide
    n = c["models_needed"]
    assert f"about {n} models per arm" in pv["to_decide"][0]
    sa, sb = statistics.stdev(c["gated_deltas"].values()), statistics.stdev(c["baseline_deltas"].values())
    target = d - abs(c["mean"])  # |D| < δ here: the interval must fit inside ±δ

    def half(m):  # Welch half-width with m models per arm at the measured spreads
        va, vb = sa ** 2 / m, sb ** 2 / m
        df = (va + vb) ** 2 / (va ** 2 / (m - 1) + vb ** 2 / (m - 1))
        return scipy_stats.t.ppf(0.975, df) * math.sqrt(va + vb)

    assert half(n) < target <= half(n - 1)


def test_paired_policy_difference_decides_the_recommendation():
    """Both policies hold against the baseline, so the old rule recommended the cheaper, `all`. On the same models
    `all` costs 1.3 δ more than `keep-gate` (paired D, tight): keep-gate is recommended over it; within δ, `all` is.
    When instead the paired D is wide (the two quantizations of each model disagree), nothing is recommended."""
    d = V.MARGIN.value
    base, noise = [0.030, 0.031, 0.032], [0.0, 0.0006, -0.0006]

    def lab(all_shift, keep_shift, anti):  # anti: per model, added under `all` and taken off under keep-gate
        rows = []
        for policy, shift, sign in (("all", all_shift, 1), ("keep-gate", keep_shift, -1)):
            rows += _arm_rows("f", "none", policy, "int4-weight", base, baseline=True)
            rows += _arm_rows("f", "g1", policy, "int4-weight",
                              [b + shift + n + sign * a for b, n, a in zip(base, noise, anti)])
        return V.policy_verdicts(V.comparisons(rows), V.policy_comparisons(rows))["f"]

    tight = [-0.0003, 0.0, 0.0003]
    pv = lab(0.35 * d, -0.95 * d, tight)
    assert pv["per_policy"]["all"]["verdict"] == pv["per_policy"]["keep-gate"]["verdict"] == V.HOLDS
    assert pv["policy_pairs"]["all vs keep-gate"]["verdict"] == V.DEARER_PREFERRED
    assert pv["recommended"] == "keep-gate"
    pv = lab(0.35 * d, 0.15 * d, tight)  # the same, with `all` within δ of keep-gate: the cheaper one
    assert pv["policy_pairs"]["all vs keep-gate"]["verdict"] == V.CHEAPER_PREFERRED and pv["recommended"] == "all"
    pv = lab(0.0, 0.0, [-0.003, 0.0, 0.003])  # each policy still holds, the paired D is ±0.015 wide
    assert pv["per_policy"]["all"]["verdict"] == pv["per_policy"]["keep-gate"]["verdict"] == V.HOLDS
    assert pv["policy_pairs"]["all vs keep-gate"]["verdict"] == V.UNDECIDED
    assert pv["recommended"] is None and "undecided" in pv["to_decide"][0]


def test_welch_interval_equals_scipys():
    """Gated vs baseline models are different models: the interval is Welch's (unequal variances, Welch-Satterthwaite
    df), equal to SciPy's Welch t-test interval, and relabelling the baseline's seeds (a nominal pairing) changes
    nothing — a paired interval would change."""
    scipy_stats = need("scipy.stats", "pip install -e '.[dev]'")
    from gated_attention.experiment.stats import t_quantile, welch

    for df in (1.0, 2.3, 3.7, 11.5, 250.0):
        assert t_quantile(0.975, df) == pytest.approx(scipy_stats.t.ppf(0.975, df), rel=1e-9)
    g, b = [0.031, 0.024, 0.047, 0.029], [0.020, 0.0215, 0.019]
    ref = scipy_stats.ttest_ind(g, b, equal_var=False)
    lo, hi = ref.confidence_interval(0.95)
    w = welch(g, b)
    assert (w["ci_low"], w["ci_high"], w["df"]) == pytest.approx((lo, hi, ref.df), rel=1e-9)
    rows = _arm_rows("f", "none", "all", "int4-weight", b, baseline=True) + _arm_rows("f", "g1", "all",
                                                                                         "int4-weight", g)
    c = V.comparisons(rows)[0]
    assert (c["ci_low"], c["ci_high"], c["df"]) == pytest.approx((lo, hi, ref.df), rel=1e-9)
    for r, k in zip([r for r in rows if r["baseline"]], ("2", "0", "1")):
        r["seed"] = k
    assert V.comparisons(rows)[0]["ci_low"] == pytest.approx(lo, rel=1e-9)


def test_report_only_judges_stored_results_again(lab, tmp_path, gattn_main):
    """--report-only re-derives every judged key of lab.json from its stored rows alone, measuring nothing."""
    import shutil

    full, out, _ = lab
    dst = tmp_path / "copy"
    shutil.copytree(out, dst, ignore=shutil.ignore_patterns("rows"))  # no stored rows: nothing could be measured
    stale = json.loads((dst / "lab.json").read_text())
    for k in ("comparisons", "policy_comparisons", "verdict"):
        stale[k] = None
    (dst / "lab.json").write_text(json.dumps(stale))
    rc, stdout, _ = gattn_main("lab", "quant", "--report-only", "--out", dst)
    assert rc == 0 and "report:" in stdout
    again = json.loads((dst / "lab.json").read_text())
    for k in ("comparisons", "policy_comparisons", "verdict", "results"):
        assert again[k] == json.loads(json.dumps(full[k])), k


def test_sink_lab_models_report_bos_attention(tmp_path_factory, tmp_path):
    from gated_attention.labs.sinks import sink_lab

    units = tmp_path_factory.mktemp("sinklab")
    cfg = sink_lab.budget_config("small", steps=10, eval_every=10, variants=["baseline", "sdpa_elementwise"], seeds=1)
    for v in cfg.variants:
        sink_lab.train_unit((cfg.settings(), v, 0, str(units / "runs" / v / "seed0")))
    res = run_lab(QuantLabConfig(models=[str(units)], schemes=["int8-weight"], policies=["all", "keep-gate"],
                                 eval_windows=8, calibration_windows=4), tmp_path, log=lambda m: None)
    assert {r["model"] for r in res["results"]} == {"baseline/seed0", "sdpa_elementwise/seed0"}
    for r in res["results"]:
        assert 0 <= r["bos_attention"] <= 1 and r["backcopy_ce"] is not None and set(r["val_loss_per_domain"]) == {
            "task"}
    assert res["reference"]["baseline/seed0"]["bos_attention"] is not None
    assert res["comparisons"][0]["verdict"] == V.INCONCLUSIVE  # one seed: no verdict


def test_bad_input_is_one_clear_error(tmp_path, gattn_main):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("not a model")
    rc, _, err = gattn_main("lab", "quant", "--models", tmp_path / "notes", "--out", tmp_path / "o")
    assert rc == 2 and "holds no model" in err and len(err.strip().splitlines()) == 1
    rc, _, err = gattn_main("lab", "quant", "--models", tmp_path / "notes", "--schemes", "int3", "--out",
                            tmp_path / "o")
    assert rc == 2 and "int3" in err
    rc, _, err = gattn_main("lab", "quant", "--out", tmp_path / "o")
    assert rc == 2 and "--models is required" in err and len(err.strip().splitlines()) == 1
    rc, _, err = gattn_main("lab", "quant", "--report-only", "--out", tmp_path / "notes")
    assert rc == 2 and "lab.json" in err and len(err.strip().splitlines()) == 1
