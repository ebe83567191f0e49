"""`gattn lab scaling`: the verdict rules on both sides of each threshold, the t intervals and the seeds a spread needs,
the power-law fit on synthetic losses, the LR sweep's extension past an edge (on a stand-in unit whose loss is a known
function of the LR), the ladder's shape rule and sizes, bad input, and the whole lab on the quick budget with the
lab.json contract, its report rendered again from lab.json alone, and units stored under older figure names. The
SIGKILL + rerun of a unit is a row of tests/test_kill_resume.py."""
from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from gated_attention.labs.scaling import scaling_lab as sl
from gated_attention.labs.scaling import verdict as V

# one xdist worker runs this file whole: its module fixtures (a lab run) are built once (tests/conftest.py)
pytestmark = pytest.mark.xdist_group("lab_scaling")


D = V.DELTA.value
EPS = 1e-4


def test_delta_is_the_papers_dense_gain():
    assert D == pytest.approx(math.log(7.499 / 7.404), abs=1e-4)
    assert V.DELTA.kind == "paper" and "7.499" in V.DELTA.source


@pytest.mark.parametrize("mean,low,high,want", [
    (-D - EPS, -D - 3 * EPS, -EPS, V.REPRODUCED),        # upper < 0, mean just past -δ
    (-D + EPS, -D - 3 * EPS, -EPS, V.SMALLER),           # upper < 0, mean just short of -δ
    (-D - EPS, -D - 3 * EPS, +EPS, V.INCONCLUSIVE),      # the interval touches 0: not reproduced
    (0.0, -D + EPS, D - EPS, V.NO_EFFECT),               # inside ±δ
    (0.0, -D - EPS, D - EPS, V.INCONCLUSIVE),            # one end just outside
    (2 * EPS, EPS, D + EPS, V.WORSE),                    # lower > 0
    (0.0, -EPS, D + EPS, V.INCONCLUSIVE),                # lower just below 0 and past +δ
    (-0.5, None, None, V.INCONCLUSIVE),                  # one seed: no interval, no verdict
])
def test_gain_rule_on_both_sides_of_each_threshold(mean, low, high, want):
    assert V.judge(mean, low, high) == want


@pytest.mark.parametrize("change,low,high,want", [
    (-D - EPS, -D - 3 * EPS, -EPS, V.IMPROVES),
    (-D + EPS, -D - 3 * EPS, -EPS, V.INCONCLUSIVE),  # grows, by less than δ, interval past -δ
    (-D / 2, -D + EPS, -EPS, V.NO_CHANGE),           # grows by less than δ, interval inside ±δ
    (2 * EPS, EPS, D + EPS, V.FADES),
    (0.0, -D - EPS, D - EPS, V.INCONCLUSIVE),
])
def test_trend_rule_on_both_sides_of_each_threshold(change, low, high, want):
    assert V.judge_trend(change, low, high) == want


def test_paired_delta_is_a_t_interval_over_seed_pairs():
    d = V.paired_delta({0: 1.0, 1: 2.0, 2: 3.0, 5: 9.0}, {0: 0.0, 1: 0.0, 2: 0.0})  # seed 5 has no pair
    assert d["n_seeds"] == 3 and d["mean"] == pytest.approx(2.0)
    half = 4.303 * 1.0 / math.sqrt(3)
    assert (d["ci_low"], d["ci_high"]) == (pytest.approx(2 - half, abs=1e-3), pytest.approx(2 + half, abs=1e-3))
    one = V.paired_delta({0: 1.0}, {0: 0.5})
    assert one["mean"] == 0.5 and one["ci_low"] is None


def test_seeds_needed_is_the_first_n_with_80_percent_power():
    """n is the first pair count whose (t_0.975 + z_0.8) sd / sqrt(n) reaches the target: 80 % power, not the 50 % a
    bare half-width gives (that n is listed for contrast: about half as many)."""
    mean, std = -0.03, 0.04
    n = V.seeds_needed(mean, std)
    assert power_ok(n, std, abs(mean)) and not power_ok(n - 1, std, abs(mean))
    half50 = next(k for k in range(2, 100) if V.t975(k - 1) * std / math.sqrt(k) < abs(mean))
    assert n > 1.5 * half50
    small = V.seeds_needed(0.002, 0.01)  # |mean| < δ: needs the interval inside ±δ
    assert power_ok(small, 0.01, D - 0.002) and not power_ok(small - 1, 0.01, D - 0.002)
    assert V.seeds_needed(-0.03, None) is None


def power_ok(n, std, target):
    return n >= 2 and (V.t975(n - 1) + 0.841621) * std / math.sqrt(n) <= target


def test_fit_recovers_known_parameters_from_synthetic_losses():
    E, A, alpha = 1.8, 40.0, 0.12
    comp = {f"s{i}": c for i, c in enumerate((1e10, 4e10, 1.6e11, 6.4e11, 2.56e12))}
    law = lambda c: E + A * c ** -alpha
    f = V.fit_power_law(list(comp.values()), [law(c) for c in comp.values()], grid=2000)
    assert f["alpha"] == pytest.approx(alpha, rel=0.03) and f["E"] == pytest.approx(E, rel=0.02)
    assert f["A"] == pytest.approx(A, rel=0.15) and f["rms"] < 1e-3
    # seeds scattered around the law: the bootstrap interval of alpha holds the true value
    per_seed = {s: {k: law(c) + (0.004 if k == 0 else -0.004 if k == 1 else 0.0) for k in range(3)}
                for s, c in comp.items()}
    fi = V.fit_with_interval(comp, per_seed, n_boot=200)
    assert fi["alpha_ci"][0] <= alpha <= fi["alpha_ci"][1]
    with pytest.raises(ValueError, match="at least 3 sizes"):
        V.fit_power_law([1e10, 1e11], [3.0, 2.5])


def test_delta_trend_per_seed_slopes():
    comp = {"a": 1e10, "b": 2e10, "c": 4e10}  # log2 span 2
    # every seed's Δ falls by 0.02 nats per doubling: a change of -0.04 across the ladder, whatever the offset
    diffs = {s: {k: -0.02 * i + 0.003 * k for k in range(3)} for i, s in enumerate(comp)}
    t = V.delta_trend(comp, diffs)
    assert t["change"] == pytest.approx(-0.04) and t["ci_high"] == pytest.approx(-0.04)
    assert t["verdict"] == V.IMPROVES
    flat = V.delta_trend(comp, {s: {0: 0.001, 1: -0.001, 2: 0.0} for s in comp})
    assert flat["verdict"] == V.NO_CHANGE


def test_lr_basin_and_edge():
    b = V.lr_basin({1e-3: 3.01, 2e-3: 2.96, 4e-3: 2.95, 8e-3: 3.2})
    assert b["best_lr"] == 4e-3 and b["within"] == [2e-3, 4e-3] and b["octaves"] == pytest.approx(1.0)
    assert not b["at_edge"]
    assert V.extend_grid([1e-3, 2e-3], 2e-3) == 4e-3 and V.extend_grid([1e-3, 2e-3], 1e-3) == 5e-4
    assert V.extend_grid([1e-3, 2e-3, 4e-3], 2e-3) is None


def test_ladder_spans_eight_times_with_a_shape_rule():
    for name in ("quick", "default", "gpu"):
        b = sl.BUDGETS[name]
        info = [sl.size_info(b, s, b.vocab_size, b.tokens_per_param) for s in b.sizes]
        ne = [i["params_non_embedding"] for i in info]
        assert len(info) >= 4 and ne == sorted(ne) and ne[-1] / ne[0] >= 8, (name, ne)
        assert len(b.lrs) >= 4 and all(y / x == pytest.approx(2) for x, y in zip(b.lrs, b.lrs[1:]))
        assert len({s.hidden // s.heads for s in b.sizes}) == 1  # fixed head size
        for i in info:  # the tokens the ratio asks for (rounded up to whole steps)
            assert i["tokens"] >= b.tokens_per_param * i["params_non_embedding"] or i["steps"] == 20
    assert sl.BUDGETS["default"].tokens_per_param == 20 and sl.BUDGETS["default"].pilot_pairs >= 4


def test_gated_units_match_the_baselines_parameters():
    from gated_attention.presets import model_config, param_report

    b = sl.BUDGETS["default"]
    for s in b.sizes:
        base = param_report(model_config("small", gate="none", vocab_size=1024, **s.overrides(b.ffn_mult)))["total"]
        for g in ("sdpa_elementwise", "sdpa_headwise"):
            total = param_report(model_config("small", gate=g, vocab_size=1024, **s.overrides(b.ffn_mult)))["total"]
            assert abs(total - base) / base < 0.01, (s.name, g, total, base)


@pytest.mark.parametrize("kw,msg", [
    (dict(variants=("sdpa_elementwise",)), "must include baseline"),
    (dict(sets=("model.hidden_size=8",)), "the lab sets it"),
    (dict(sets=("lr=0.1",)), "the lab sets it"),
    (dict(heldout=("/no/such/file.txt",)), "no such file"),
    (dict(lrs=(1e-3,)), ">= 2 distinct"),
    (dict(budget="huge"), "unknown --budget"),
    (dict(sizes=("d99l9",)), "ladder.s sizes are"),
])
def test_bad_settings_fail_with_one_clear_line(kw, msg):
    with pytest.raises(ValueError, match=msg):
        sl.LabConfig().changed(**kw).validate()


def test_sweep_extends_past_an_edge_until_the_best_is_interior(tiny_corpus, tmp_path, monkeypatch):
    """A stand-in unit whose loss is smallest at lr 0.08 (beyond the grid's top, 0.04): the sweep adds 0.08 and then
    0.16, where the best is interior, and stops; under the shared-LR protocol only the baseline is swept and every arm's
    confirm seeds run at the baseline's 0.08."""
    ran = []

    def fake_unit(task):
        cfg, run_dir, *_ = task
        ran.append((cfg["gate"], cfg["lr"], cfg["seed"]))
        loss = 3.0 + (math.log2(cfg["lr"] / 0.08)) ** 2 * 0.01 + 0.001 * (cfg["seed"] % 7)
        return {"val_loss": loss, "val_loss_per_domain": {"a": loss}, "heldout_loss": None, "tokens": 1,
                "curve": {"tokens": [1], "loss": [loss]}}

    monkeypatch.setattr(sl, "train_unit", fake_unit)
    spec = replace(sl.BUDGETS["quick"], max_extensions=3)
    monkeypatch.setitem(sl.BUDGETS, "edge_test", spec)
    lab = sl.LabConfig().changed(out=str(tmp_path / "lab"), budget="edge_test",
                                 variants=("baseline", "sdpa_elementwise"), data_dir=str(tiny_corpus))
    res = sl.run_lab(lab, log=lambda m: None)
    lrs = sorted({lr for g, lr, s in ran if g == "baseline" and s == 0})
    assert lrs == [5e-3, 1e-2, 2e-2, 4e-2, 8e-2, 1.6e-1]  # two extensions, not three: 0.08 is interior then
    assert not {lr for g, lr, s in ran if g == "sdpa_elementwise" and s == 0}  # shared-lr sweeps the baseline only
    assert set(res["best_lr"]) == {"baseline"} and all(v == 0.08 for v in res["best_lr"]["baseline"].values())
    assert {lr for g, lr, s in ran if s >= sl.CONFIRM_FROM} == {0.08}
    assert all(b["at_edge"] is False for per in res["lr_basin"].values() for b in per.values())


QUICK = ["--budget", "quick", "--variants", "baseline", "sdpa_elementwise", "--lrs", "0.01", "0.02", "--max-pairs", "2",
         "--jobs", "1"]


@pytest.fixture(scope="module")
def quick_lab(tiny_corpus, tmp_path_factory):
    """The quick ladder (2 variants, the baseline's 2 LRs + extensions on seed 0, 2 pilot pairs, at most 2), with a
    held-out text, trained once."""
    from gated_attention.cli import main

    out = tmp_path_factory.mktemp("scaling") / "lab"
    held = out.parent / "held.txt"
    held.write_text("A held-out text about gardens, rivers and the weather in spring. " * 40)
    assert main(["lab", "scaling", *QUICK, "--data-dir", str(tiny_corpus), "--heldout", str(held),
                 "--out", str(out)]) == 0
    return out, held


def test_quick_lab_writes_the_contract(quick_lab):
    out, _ = quick_lab
    lab = json.loads((out / "lab.json").read_text())
    for key in ("config", "thresholds", "sizes", "runs", "best_lr", "deltas", "fits", "verdict", "seeds",
                "selection_bias", "protocol", "multiplier", "design", "trend", "provenance"):
        assert key in lab, key
    assert {"name", "params_total", "params_non_embedding", "tokens", "flops"} <= set(lab["sizes"][0])
    run = next(r for r in lab["runs"] if r["role"] == "confirm")
    assert {"variant", "size", "lr", "seed", "tokens", "val_loss", "val_loss_per_domain", "heldout_loss",
            "model_dir", "curve", "bits_per_byte"} <= set(run)
    assert run["heldout_loss"] > 0 and (out / run["model_dir"] / "config.json").exists()
    assert lab["protocol"] == "shared-lr" and set(lab["best_lr"]) == {"baseline"}
    d = lab["deltas"][0]
    assert {"variant", "size", "mean", "ci_low", "ci_high", "n_seeds", "verdict", "lr", "seeds"} <= set(d)
    assert d["n_seeds"] >= 2 and d["verdict"] in V.DELTA_VERDICTS
    assert {"E", "A", "alpha", "alpha_ci"} <= set(lab["fits"]["baseline"])
    assert lab["thresholds"]["gain at one size (paired over seeds)"][0]["value"] == D
    assert {"pilot_pairs", "target_se", "n_planned", "n_cap", "rule"} <= set(lab["design"])
    assert {"commit", "dirty", "cpu", "torch", "threads"} <= set(lab["provenance"])
    assert all({"variant", "size", "ln_k", "ci_low", "ci_high", "verdict"} <= set(m) for m in lab["multiplier"])
    assert {m["size"] for m in lab["multiplier"]} >= {"all"}
    assert set(lab["trend"]["sdpa_elementwise"]) >= {"slope", "ci_low", "ci_high", "method"}
    assert (out / "report.html").exists() and all((out / p).exists() for p in lab["plots"].values())
    # the confirm pairs ran at the baseline's tuned LR for both arms, on the planned number of seeds
    for d in lab["deltas"]:
        assert d["lr"]["sdpa_elementwise"] == d["lr"]["baseline"] == lab["best_lr"]["baseline"][d["size"]]
        assert d["n_seeds"] == lab["design"]["n_planned"][d["size"]] == len(d["seeds"])


def test_tuning_and_confirm_seeds_are_disjoint_in_every_verdict(quick_lab):
    """No figure a verdict reads comes from a tuning seed: Δ rows, the multiplier, the fits' and trend's inputs all use
    confirm seeds; the tuning seed appears only in tuning runs."""
    out, _ = quick_lab
    lab = json.loads((out / "lab.json").read_text())
    tuning, confirm = set(lab["seeds"]["tuning"]), set(lab["seeds"]["confirm"])
    assert tuning == {0} and confirm and not tuning & confirm
    for d in lab["deltas"]:
        assert set(d["seeds"]) <= confirm and len(d["per_seed"]) == len(d["seeds"])
    assert {r["seed"] for r in lab["runs"] if r["role"] == "tuning"} == tuning
    assert {r["seed"] for r in lab["runs"] if r["role"] == "confirm"} == confirm
    # the per-size Δ is recomputable from confirm runs alone
    for d in lab["deltas"]:
        loss = {(r["variant"], r["seed"]): r["val_loss"] for r in lab["runs"] if r["role"] == "confirm"
                and r["size"] == d["size"] and r["lr"] == d["lr"][r["variant"]]}
        diffs = [loss[(d["variant"], k)] - loss[("baseline", k)] for k in d["seeds"]]
        assert d["mean"] == pytest.approx(sum(diffs) / len(diffs), abs=1e-12)
    with pytest.raises(ValueError, match="both tuning and confirm"):
        sl.LabConfig().changed(tuning_seeds=(0, 100)).validate()
    with pytest.raises(ValueError, match="both tuning and confirm"):
        sl.LabConfig().changed(confirm_seeds=(5, 6, 0)).validate()


def test_rerun_reuses_units_and_refuses_other_settings(quick_lab, tiny_corpus, gattn_main):
    """A rerun trains nothing (every result.json untouched) and writes the same figures; a unit folder holding a
    run with other settings stops the lab with one line naming the setting (exit 2) instead of mixing runs."""
    out, held = quick_lab
    lab = json.loads((out / "lab.json").read_text())
    stamps = {r["model_dir"]: (out / r["model_dir"]).parent.joinpath("result.json").stat().st_mtime_ns
              for r in lab["runs"]}
    rc, _, err = gattn_main("lab", "scaling", *QUICK, "--data-dir", tiny_corpus, "--heldout", held, "--out", out)
    assert rc == 0, err
    assert all((out / d).parent.joinpath("result.json").stat().st_mtime_ns == t for d, t in stamps.items())
    again = json.loads((out / "lab.json").read_text())
    assert again["deltas"] == lab["deltas"] and again["best_lr"] == lab["best_lr"]
    assert again["design"] == lab["design"]
    rc, _, err = gattn_main("lab", "scaling", *QUICK, "--data-dir", tiny_corpus, "--heldout", held, "--out", out,
                            "--set", "beta2=0.99")
    assert rc == 2 and "beta2" in err and "delete" in err


def test_reuse_key_changes_with_the_training_code(quick_lab, tiny_corpus, gattn_main, monkeypatch):
    """A stored unit made by other training code is never reused silently: the lab stops naming `code`; with
    --accept-code-change it is reused and counted in provenance."""
    from gated_attention.experiment import provenance

    out, held = quick_lab
    monkeypatch.setattr(sl, "code_version", lambda: "0123456789abcdef")
    rc, _, err = gattn_main("lab", "scaling", *QUICK, "--data-dir", tiny_corpus, "--heldout", held, "--out", out)
    assert rc == 2 and "code: saved" in err and "0123456789abcdef" in err
    rc, _, err = gattn_main("lab", "scaling", *QUICK, "--data-dir", tiny_corpus, "--heldout", held, "--out", out,
                            "--accept-code-change")
    assert rc == 0, err
    lab = json.loads((out / "lab.json").read_text())
    assert lab["provenance"]["units_reused_from_other_code"] == len(lab["runs"])
    assert provenance.code_version() != "0123456789abcdef"


def test_report_only_renders_the_stored_lab_again(quick_lab, gattn_main, tmp_path):
    """--report-only writes the report and plots from lab.json alone (trains nothing, lab.json untouched): the same
    report.md as the lab wrote; a lab.json from before the registered design stops with one line (exit 2)."""
    out, _ = quick_lab
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("lab.json", "report.md"):
        (copy / name).write_bytes((out / name).read_bytes())
    rc, stdout, err = gattn_main("lab", "scaling", "--report-only", "--out", copy)
    assert rc == 0, err
    assert (copy / "report.md").read_text() == (out / "report.md").read_text()
    assert (copy / "lab.json").read_bytes() == (out / "lab.json").read_bytes() and not (copy / "runs").exists()
    lab = json.loads((out / "lab.json").read_text())
    assert all((copy / p).is_file() for p in lab["plots"].values()) and (copy / "report.html").is_file()
    del lab["design"]
    (copy / "lab.json").write_text(json.dumps(lab))
    rc, _, err = gattn_main("lab", "scaling", "--report-only", "--out", copy)
    assert rc == 2 and "design" in err and len(err.strip().splitlines()) == 1


def test_units_stored_with_the_older_time_names_are_read(quick_lab, tiny_corpus, gattn_main, tmp_path):
    """A unit whose result.json names its CPU and wall time as units did before the shared recorder
    (cpu_s_this_process, wall_s_this_process) is reused, its figures read under today's names."""
    import shutil

    out, held = quick_lab
    copy = tmp_path / "lab"
    shutil.copytree(out, copy)
    res = sorted(copy.glob("runs/*/result.json"))[0]
    stored = json.loads(res.read_text())
    assert stored["cpu_s"] > 0 and stored["wall_s"] > 0  # today's names, as the recorder gave them
    stored["cpu_s_this_process"], stored["wall_s_this_process"] = 12.5, 25.0
    del stored["cpu_s"], stored["wall_s"]
    res.write_text(json.dumps(stored))
    rc, _, err = gattn_main("lab", "scaling", *QUICK, "--data-dir", tiny_corpus, "--heldout", held, "--out", copy)
    assert rc == 0, err
    lab = json.loads((copy / "lab.json").read_text())
    run = next(r for r in lab["runs"] if r["model_dir"] == f"runs/{res.parent.name}/final")
    assert run["cpu_s"] == 12.5
    assert json.loads(res.read_text())["cpu_s_this_process"] == 12.5  # the stored unit is read, never rewritten
