"""Tests of `gattn lab stability`: the LR-sensitivity formula, the per-run metrics, the edge-of-stability choice and
the instability bar on hand-built inputs with known answers; the max-attention-logit probe against a direct
computation (and that it only fires on the trainer's probe forwards); and an end-to-end `--budget small` run on a
tiny corpus (lab.json keys, strict JSON, report files, reuse of finished runs, retraining of an interrupted one)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from gated_attention.labs.stability import stability_lab
from gated_attention.labs.stability.probe import StabilityProbe, max_attention_logit

# one xdist worker runs this file whole: its module fixtures (a lab run) are built once (tests/conftest.py)
pytestmark = pytest.mark.xdist_group("lab_stability")


NAN = float("nan")


def _run(lr, loss, init=5.0, seed=0):
    return {"lr": lr, "final_loss": loss, "loss_at_init": init, "seed": seed}


# ---------------------------------------------------------------- formulas on hand-built inputs

def test_lr_sensitivity_known_answer():
    # clipped losses 3, 2, 4, 5 (a diverged NaN counts as the init loss), 5 (6 > init is clipped): mean 3.8, best 2
    runs = [_run(1e-3, 3.0), _run(1e-2, 2.0), _run(1e-1, 4.0), _run(1.0, NAN), _run(3.0, 6.0)]
    assert stability_lab.lr_sensitivity(runs) == pytest.approx((3 + 2 + 4 + 5 + 5) / 5 - 2)
    # None (a diverged run serialised as null) is the same as NaN
    assert stability_lab.lr_sensitivity([_run(1e-3, 3.0), _run(1.0, None)]) == pytest.approx((3 + 5) / 2 - 3)


def test_lr_sensitivity_averages_seeds_per_lr_first():
    # lr 1e-2 has two seeds (2 and 3 -> 2.5); the grid mean weighs each LR once: (3 + 2.5) / 2 - 2.5
    runs = [_run(1e-3, 3.0), _run(1e-2, 2.0, seed=0), _run(1e-2, 3.0, seed=1)]
    assert stability_lab.lr_sensitivity(runs) == pytest.approx(0.25)
    # each seed is clipped at its own init loss
    runs = [_run(1e-3, 3.0, init=4.0), _run(1e-3, 9.0, init=6.0, seed=1), _run(1e-2, 2.0)]
    assert stability_lab.lr_sensitivity(runs) == pytest.approx(((3 + 6) / 2 + 2) / 2 - 2)
    assert stability_lab.lr_sensitivity([_run(1e-3, 2.0)]) == 0.0
    assert math.isnan(stability_lab.lr_sensitivity([]))


def test_run_metrics_known_answer():
    summary = {"val_losses": {"a": 2.0, "b": 4.0}, "diverged": False, "spikes": 3, "skipped_steps": 1,
               "final_loss_avg10": 2.9, "steps": 100, "tokens": 6400}
    log = [{"step": 0, "loss": 6.0, "max_act": [1.0, 7.5]}, {"step": 1, "loss": 5.0},
           {"step": 10, "loss": 4.0, "max_act": [3.0, 2.0]}]
    probes = [{"attn_logit": [1.5, 12.0], "output_logit": 4.0}, {"attn_logit": [-2.0, 3.0], "output_logit": 9.0}]
    m = stability_lab.run_metrics(summary, log, probes, init_loss=6.9)
    assert m["final_loss"] == 3.0 and m["loss_at_init"] == 6.9 and m["diverged"] is False
    assert m["spikes"] == 3 and m["skipped_steps"] == 1
    assert m["max_hidden"] == 7.5 and m["max_attention_logit"] == 12.0 and m["max_output_logit"] == 9.0
    # no better than at init -> diverged; the trainer giving up -> diverged and no final loss
    assert stability_lab.run_metrics({**summary, "val_losses": {"a": 7.0}}, log, probes, 6.9)["diverged"] is True
    stopped = stability_lab.run_metrics({**summary, "diverged": True}, log, probes, 6.9)
    assert stopped["diverged"] is True and math.isnan(stopped["final_loss"])
    empty = stability_lab.run_metrics(summary, [], [], 6.9)
    assert math.isnan(empty["max_attention_logit"]) and math.isnan(empty["max_hidden"])
    # the per-layer series: lists over layers of lists over the probe steps (a log from before lost updates: none)
    assert m["probe_steps"] == [0, 10] and m["max_hidden_per_layer"] == [[1.0, 3.0], [7.5, 2.0]]
    assert m["lost_update_share"] == [] and m["mean_lost_update_share"] is None
    log[0]["lost_update_share"], log[2]["lost_update_share"] = [0.0, 0.25], [0.123456, NAN]
    m = stability_lab.run_metrics({**summary, "resolved_precision": "fp32"}, log, probes, init_loss=6.9)
    assert m["lost_update_share"] == [[0.0, 0.1235], [0.25, m["lost_update_share"][1][1]]]
    assert math.isnan(m["lost_update_share"][1][1])
    assert m["mean_lost_update_share"] == pytest.approx((0.0 + 0.1235 + 0.25) / 3)
    assert m["resolved_precision"] == "fp32"


def test_edge_lrs():
    grid = (1e-3, 1e-2, 1e-1, 1.0, 10.0)
    # best at 1e-2; 1e-1 is within 0.1 nats, 1.0 is the first past the edge -> 1e-1 (last stable) and 1.0
    runs = [_run(1e-3, 3.0), _run(1e-2, 2.0), _run(1e-1, 2.05), _run(1.0, 2.5), _run(10.0, NAN)]
    assert stability_lab.edge_lrs(runs, grid) == [1e-1, 1.0]
    # a diverged run (NaN = the loss at init) is past the edge; a loss below the best's is not
    runs = [_run(1e-3, 3.0), _run(1e-2, 2.0), _run(1e-1, 1.9), _run(1.0, 1.95), _run(10.0, NAN)]
    assert stability_lab.edge_lrs(runs, grid) == [1.0, 10.0]
    # the best LR is the smallest and the next one is already past the edge
    runs = [_run(1e-3, 2.0), _run(1e-2, 2.2), _run(1e-1, 3.0), _run(1.0, 4.0), _run(10.0, NAN)]
    assert stability_lab.edge_lrs(runs, grid) == [1e-3, 1e-2]
    # never past the edge: the two largest
    runs = [_run(x, 2.0) for x in grid]
    assert stability_lab.edge_lrs(runs, grid) == [1.0, 10.0]


def test_instability_check():
    rows = [{"variant": "baseline", "qk_norm": False, "lr": lr, "seed": 0, "final_loss": loss, "loss_at_init": 7.0,
             "diverged": False, "spikes": 0} for lr, loss in ((1e-3, 5.0), (1e-2, 4.0), (1.0, 4.6))]
    res = stability_lab.instability_check(rows)
    assert res["off"]["gap_at_highest_lr"] == pytest.approx(0.6) and res["reached"] is True and "on" not in res
    rows[-1]["final_loss"] = 4.3
    assert stability_lab.instability_check(rows)["reached"] is False
    rows[0]["diverged"] = True
    assert stability_lab.instability_check(rows)["reached"] is True and stability_lab.instability_check(rows)["off"]["diverged"] == 1
    rows[0]["diverged"] = False
    rows[1]["spikes"] = 2  # one spike anywhere in a baseline run is the failure the lab looks for
    res = stability_lab.instability_check(rows)
    assert res["reached"] is True and res["off"]["spikes"] == 2 and res["off"]["runs_with_spikes"] == 1
    # QK-norm on is checked on its own; gated runs never count
    on = [{**r, "qk_norm": True, "spikes": 0} for r in rows]
    res = stability_lab.instability_check(on + [{**r, "variant": "sdpa_elementwise", "spikes": 9} for r in rows])
    assert res["reached"] is False and res["on"]["spikes"] == 0 and "off" not in res
    assert stability_lab.instability_check([{**r, "variant": "sdpa_headwise"} for r in rows])["checked"] is False


def test_strict_json_through_io():
    """The lab writes strict JSON through io, the one convention: a non-finite value is null and the dict holding it
    names it; lab.json's top-level "nonfinite" lists the paths."""
    from gated_attention.util.io import json_dumps, nonfinite_paths, to_strict

    obj = {"a": 1.0, "b": NAN, "c": [float("inf"), 2], "d": {"e": -float("inf")}}
    assert nonfinite_paths(obj) == ["b", "c[0]", "d.e"]
    assert to_strict(obj) == {"a": 1.0, "b": None, "c": [None, 2], "d": {"e": None, "nonfinite": {"e": "-inf"}},
                              "nonfinite": {"b": "nan", "c": "inf"}}
    json.loads(json_dumps(obj))


# ---------------------------------------------------------------- the probe

def _direct_max_logit(q, k, scale):
    """Loop over every (batch, head, query, key <= query) pair: the definition, no vectorisation."""
    b, h, t, d = q.shape
    n_rep = h // k.shape[1]
    best = -math.inf
    for bi in range(b):
        for hi in range(h):
            for i in range(t):
                for j in range(i + 1):
                    best = max(best, float((q[bi, hi, i] * k[bi, hi // n_rep, j]).sum()) * scale)
    return best


def test_max_attention_logit_matches_direct_computation():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 6, 8, generator=g)
    k = torch.randn(2, 2, 6, 8, generator=g)  # GQA: 2 query heads per KV head
    assert max_attention_logit(q, k, 8 ** -0.5) == pytest.approx(_direct_max_logit(q, k, 8 ** -0.5), rel=1e-5)
    # a huge logit at a future (masked) position is not seen
    q2, k2 = q.clone(), k.clone()
    k2[:, :, -1] = 100 * q[:, ::2, 0]  # key 5 matches query 0 of each group, which cannot attend to it
    q2[:, :, -1] = 0.0  # and the only query that sees key 5 gives it logit 0
    assert max_attention_logit(q2, k2, 1.0) == pytest.approx(_direct_max_logit(q2, k2, 1.0), rel=1e-5)
    assert max_attention_logit(q2, k2, 1.0) < 50 < float((q2[:, ::2, 0] * k2[:, :, -1]).sum(-1).max())


def _tiny_model(qk_norm: bool):
    from harness import tiny_lm

    return tiny_lm("sdpa_elementwise", backend=None, match_params=None, use_qk_norm=qk_norm)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_probe_on_the_trainers_probe_forward(qk_norm):
    from gated_attention.capture import Recorder, capture

    model = _tiny_model(qk_norm)
    x = torch.randint(0, 128, (2, 12))
    with torch.no_grad(), capture(model, Recorder(names=("q", "k", "scale"))) as rec:
        logits = model(input_ids=x).logits
    want = [_direct_max_logit(rec.get(i, "q"), rec.get(i, "k"), rec.get(i, "scale"))
            for i in range(model.config.num_hidden_layers)]
    probe = StabilityProbe(model).attach()
    model.train()
    model(input_ids=x)  # a training forward (grad on): ignored
    model.eval()
    with torch.no_grad():
        model(input_ids=x)  # evaluation forward: ignored
    assert probe.records == []
    model.train()
    with torch.no_grad():
        model(input_ids=x)  # the trainer's stats probe: train mode, no grad
    assert len(probe.records) == 1
    assert probe.records[0]["attn_logit"] == pytest.approx(want, rel=1e-5)
    assert probe.records[0]["output_logit"] == pytest.approx(float(logits.abs().max()), rel=1e-5)
    probe.detach()
    with torch.no_grad():
        model(input_ids=x)
    assert len(probe.records) == 1 and all(getattr(m, "capture", None) is None for m in model.modules())


def test_probe_follows_a_copy_of_its_model():
    """bf16-params trains a bf16 copy of the model the lab attached its probe to (train/mixed_precision.py): the
    copy's probe forwards land in the same records, the original's own forwards still count, evaluation does not."""
    import copy

    model = _tiny_model(True)
    probe = StabilityProbe(model).attach()
    twin = copy.deepcopy(model).to(torch.bfloat16)
    x = torch.randint(0, 128, (2, 12))
    twin.train()
    with torch.no_grad():
        twin(input_ids=x)  # the trainer's probe forward on the copy
        twin.eval()
        twin(input_ids=x)  # the copy's evaluation: ignored
    assert len(probe.records) == 1 and len(probe.records[0]["attn_logit"]) == model.config.num_hidden_layers
    model.train()
    with torch.no_grad():
        model(input_ids=x)
    assert len(probe.records) == 2


# ---------------------------------------------------------------- end to end (on conftest's session tiny_corpus)

def _cli(argv: list[str]) -> int:
    from gated_attention import cli

    return cli.main(["lab", "stability", *argv])


def _strict_load(path: Path):
    def refuse(name):
        raise AssertionError(f"non-strict JSON constant {name} in {path}")

    return json.loads(path.read_text(), parse_constant=refuse)


@pytest.fixture(scope="module")
def small_lab(tiny_corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("lab") / "out"
    rc = _cli(["--budget", "small", "--data-dir", str(tiny_corpus), "--out", str(out), "--variants", "baseline",
               "sdpa_elementwise", "--lrs", "1e-3", "1", "--seeds", "2", "--qk-norm", "both", "--jobs", "2"])
    assert rc == 0
    return out


def test_small_budget_end_to_end(small_lab):
    out = small_lab
    lab = _strict_load(out / "lab.json")
    assert set(lab["lr_sensitivity"]) == {"baseline", "sdpa_elementwise"}
    for v, s in lab["lr_sensitivity"].items():
        assert set(s) == {"on", "off"} and all(x is None or x >= 0 for x in s.values())
    keys = {"variant", "qk_norm", "lr", "seed", "final_loss", "diverged", "spikes", "max_attention_logit",
            "max_hidden", "max_output_logit", "spike_steps", "peak_train_loss", "resolved_precision", "probe_steps",
            "lost_update_share", "max_hidden_per_layer", "mean_lost_update_share"}
    runs = lab["runs"]
    # every seed at every LR (the budget's seed_lrs "all"), seed-major
    assert {(r["variant"], r["qk_norm"], r["lr"], r["seed"]) for r in runs} == {
        (v, q, lr, s) for v in ("baseline", "sdpa_elementwise") for q in (False, True) for lr in (1e-3, 1.0)
        for s in (0, 1)}
    assert lab["config"]["seed_lrs"] == "all" and lab["edge_lrs"] == {}
    for r in runs:
        assert keys <= set(r)
        assert isinstance(r["diverged"], bool) and isinstance(r["spikes"], int)
        assert len(r["spike_steps"]) == r["spikes"]
        assert r["tokens"] == 30 * 8 * 32  # same tokens per run
        for k in ("max_attention_logit", "max_hidden", "max_output_logit"):
            assert r[k] is None or (k in r["nonfinite"]) is False
        assert r["final_loss"] is None or r["final_loss"] > 0
        assert r["resolved_precision"] == lab["config"]["resolved_precision"]
        # per layer (the small budget's 1 layer), at the trainer's stats steps 0, 10, 20
        assert r["probe_steps"] == [0, 10, 20]
        assert [len(x) for x in r["lost_update_share"]] == [len(x) for x in r["max_hidden_per_layer"]] == [3]
        assert all(0 <= x <= 1 for x in r["lost_update_share"][0])
        assert max(r["max_hidden_per_layer"][0]) == pytest.approx(r["max_hidden"], rel=1e-3)
    # the per-setting aggregates: the formulas of labs/stability/stats.py applied to the runs, with intervals over 2 seeds
    margin = lab["config"]["margin"]
    for v in ("baseline", "sdpa_elementwise"):
        for key, qk in (("on", True), ("off", False)):
            mine = [r for r in runs if r["variant"] == v and r["qk_norm"] is qk]
            msl = lab["max_stable_lr"][v][key]
            want = St.max_stable_lr(mine, margin)
            assert (msl["lr"] is None and math.isnan(want)) or msl["lr"] == want
            assert msl["margin"] == margin and len(msl["per_seed"]) == 2
            iv = lab["lr_sensitivity_interval"][v][key]
            assert iv is not None and iv[0] <= lab["lr_sensitivity"][v][key] + 1e-9 and iv[0] <= iv[1]
            sp = lab["spikes"][v][key]
            assert sp["total"] == sum(r["spikes"] for r in mine) and sp["runs"] == len(mine) == 4
            assert sorted(sp["by_lr"]) == ["0.001", "1"] and all(len(x) == 2 for x in sp["by_lr"].values())
            assert lab["settings"][v][key]["max_stable_lr"] == msl
    # the sensitivity in lab.json is the formula applied to its runs
    for v in ("baseline", "sdpa_elementwise"):
        mine = [r for r in runs if r["variant"] == v and r["qk_norm"] is False]
        assert lab["lr_sensitivity"][v]["off"] == pytest.approx(stability_lab.lr_sensitivity(mine))
    assert lab["instability"]["checked"] is True and {"on", "off"} <= set(lab["instability"])
    # the verdict is the claims-table rule applied to this lab's own numbers, recomputed here from runs and intervals
    # (the rule on hand-made labs, every branch: tests/test_compare_claims.py)
    from gated_attention.compare import claims
    from gated_attention.labs.stability import verdict as V

    def apart(good, bad, lower_is_better):  # two intervals that do not touch, `good` wholly on the good side
        return bool(good and bad) and (good[1] < bad[0] if lower_is_better else good[0] > bad[1])

    failed = any(r["spikes"] or r["diverged"] for r in runs if r["variant"] == "baseline") or any(
        lab["instability"][k]["gap_at_highest_lr"] >= V.FAILURE_GAP.value for k in ("on", "off"))
    assert lab["instability"]["reached"] is failed
    b, g = lab["settings"]["baseline"]["on"], lab["settings"]["sdpa_elementwise"]["on"]  # QK-norm on: the paper's
    measures = [(g["max_stable_lr"]["interval"], b["max_stable_lr"]["interval"], False),
                (g["lr_sensitivity_interval"], b["lr_sensitivity_interval"], True),
                (g["spikes"]["interval"], b["spikes"]["interval"], True)]
    won = any(apart(gi, bi, low) for gi, bi, low in measures)
    lost = any(apart(bi, gi, low) for gi, bi, low in measures)
    rule_thresholds = (margin == V.CONVERGED_MARGIN.value and lab["instability"]["margin"] == V.FAILURE_GAP.value
                       and lab["config"]["bootstrap"]["level"] == V.INTERVAL_LEVEL.value)
    want = claims.REPRODUCED if failed and won and not lost and rule_thresholds else claims.NOT_AT_SCALE
    assert claims.stability_verdict(lab)["verdict"] == want, (failed, won, lost, rule_thresholds)
    for f in ("report.md", "report.html", "plots/loss_vs_lr_qk_on.png", "plots/loss_vs_lr_qk_off.png",
              "plots/max_attention_logit_vs_lr.png"):
        assert (out / f).stat().st_size > 0, f
    page = (out / "report.html").read_text()
    assert "data:image/png;base64," in page and 'src="plots/' not in page  # self-contained
    md = (out / "report.md").read_text()
    assert "LR sensitivity" in md and "max stable LR" in md and "Verdict (the claims-table rule)" in md
    assert "smaller than half a bf16 ulp" in md and "Per layer at lr 1:" in md
    # checkpoints and exported weights of finished runs are removed; the numbers stay
    one = out / runs[0]["dir"]
    assert (one / "result.json").exists() and not (one / "checkpoints").exists() and not (one / "final").exists()


def test_rerun_reuses_finished_runs_and_refuses_other_settings(small_lab, tiny_corpus, capsys):
    """Finished runs are reused untouched; a run folder left without result.json and without a checkpoint (killed
    before its first one: only a temp folder of the write) trains again from step 0. A kill after a checkpoint
    resumes there: tests/test_kill_resume.py."""
    out = small_lab
    lab = _strict_load(out / "lab.json")
    dirs = [out / r["dir"] for r in lab["runs"]]
    stamps = {d: (d / "result.json").stat().st_mtime_ns for d in dirs}
    victim = dirs[1]
    (victim / "result.json").unlink()
    (victim / "checkpoints" / ".tmp-step_00000010").mkdir(parents=True)  # a write the kill cut short
    rc = _cli(["--budget", "small", "--data-dir", str(tiny_corpus), "--out", str(out), "--variants", "baseline",
               "sdpa_elementwise", "--lrs", "1e-3", "1", "--seeds", "2"])
    assert rc == 0
    for d in dirs:
        if d != victim:
            assert (d / "result.json").stat().st_mtime_ns == stamps[d], d
    assert (victim / "result.json").exists()
    again = _strict_load(out / "lab.json")
    assert len(again["runs"]) == len(lab["runs"])
    # different settings for the same folder fail loudly (one line, exit 2) instead of mixing runs
    capsys.readouterr()
    rc = _cli(["--budget", "small", "--data-dir", str(tiny_corpus), "--out", str(out), "--variants", "baseline",
               "--lrs", "1e-3", "--steps", "31", "--qk-norm", "off"])
    err = capsys.readouterr().err
    assert rc == 2 and "different settings (steps: saved 30 vs requested 31" in err and "delete" in err


def test_reuse_key_keeps_precisions_apart(small_lab, tiny_corpus, capsys):
    """A lab folder made in one precision refuses another one (nothing is trained or mixed): the run's key holds the
    resolved precision."""
    out = small_lab
    saved = _strict_load(out / "lab.json")["config"]["resolved_precision"]
    other = "fp32" if saved != "fp32" else "bf16"
    capsys.readouterr()
    rc = _cli(["--budget", "small", "--data-dir", str(tiny_corpus), "--out", str(out), "--variants", "baseline",
               "sdpa_elementwise", "--lrs", "1e-3", "1", "--seeds", "2", "--precision", other])
    err = capsys.readouterr().err
    assert rc == 2 and f"precision: saved '{saved}'" in err and f"requested '{other}'" in err


def test_bf16_params_lab_records_its_precision_and_probes(tiny_corpus, tmp_path):
    """`--precision bf16-params` trains through the trainer's precision path (bf16 compute twin, fp32 masters):
    lab.json and every run record it, and the probes (attention logits, per-layer series) ride on the bf16 copy."""
    out = tmp_path / "bp"
    assert _cli(["--budget", "small", "--data-dir", str(tiny_corpus), "--out", str(out), "--variants", "baseline",
                 "--qk-norm", "on", "--lrs", "1e-2", "--steps", "12", "--precision", "bf16-params", "--jobs", "1"]) == 0
    lab = _strict_load(out / "lab.json")
    assert lab["config"]["resolved_precision"] == "bf16-params" and lab["train_config"]["precision"] == "bf16-params"
    (run,) = lab["runs"]
    assert run["resolved_precision"] == "bf16-params" and run["probe_steps"] == [0, 10]
    assert run["max_attention_logit"] is not None and len(lab["curves"][Path(run["dir"]).name]["attention_logit"]) == 2
    assert [len(x) for x in run["lost_update_share"]] == [2]


def test_edge_seeds_run_at_the_edge_lrs(tiny_corpus, tmp_path):
    out = tmp_path / "edge"
    assert _cli(["--budget", "small", "--data-dir", str(tiny_corpus), "--out", str(out), "--variants", "baseline",
                 "--qk-norm", "off", "--seeds", "2", "--seed-lrs", "edge", "--jobs", "1"]) == 0
    lab = _strict_load(out / "lab.json")
    edge = lab["edge_lrs"]["baseline/off"]
    assert lab["config"]["seed_lrs"] == "edge" and len(edge) == 2
    assert sorted(r["lr"] for r in lab["runs"] if r["seed"] == 1) == sorted(edge)
    assert len([r for r in lab["runs"] if r["seed"] == 0]) == 3


def test_set_overrides_reach_every_run_and_lab_settings_are_refused(tiny_corpus, tmp_path, capsys):
    out = tmp_path / "set"
    assert _cli(["--budget", "small", "--data-dir", str(tiny_corpus), "--out", str(out), "--variants", "baseline",
                 "--qk-norm", "on", "--lrs", "1e-2", "--steps", "4", "--set", "beta2=0.99",
                 "--set", "model.num_hidden_layers=2", "--jobs", "1"]) == 0
    cfg = json.loads((out / "runs" / "baseline_qkon_lr0.01_s0" / "train_config.json").read_text())
    assert cfg["beta2"] == 0.99 and cfg["model_overrides"]["num_hidden_layers"] == 2
    assert cfg["model_overrides"]["use_qk_norm"] is True
    # the depth setting reaches the per-layer series: 2 layers, probes at steps 0 (stats_every 10 > 4 steps)
    run = _strict_load(out / "lab.json")["runs"][0]
    assert len(run["lost_update_share"]) == len(run["max_hidden_per_layer"]) == 2 and run["probe_steps"] == [0]
    capsys.readouterr()
    assert _cli(["--budget", "small", "--out", str(out), "--set", "lr=3"]) == 2
    assert "--set lr: the lab sets it per run; use --lrs" in capsys.readouterr().err


def test_runs_are_eager_unless_compile_is_set(tiny_corpus):
    """A grid's numbers must not depend on the machine's load: compile=auto decides from a timing and compiled bf16
    kernels round differently, so the lab pins eager; --set compile=true still reaches the runs."""
    S = stability_lab
    lab = S.LabConfig(budget="small", variants=("baseline",), qk_norm="on", lrs=(1e-2,), train={"steps": 4})
    assert S.train_config(lab, str(tiny_corpus), "baseline", True, 1e-2, 0, "fp32").compile == "false"
    lab = S.LabConfig(budget="small", variants=("baseline",), qk_norm="on", lrs=(1e-2,), train={"steps": 4},
                      sets=("compile=true",))
    assert S.train_config(lab, str(tiny_corpus), "baseline", True, 1e-2, 0, "fp32").compile == "true"


def test_bad_input_is_refused(tmp_path):
    for kw, msg in ((dict(variants=("nope",)), "unknown variant"), (dict(lrs=(1e-3, -1.0)), "positive"),
                    (dict(qk_norm="maybe"), "qk-norm"), (dict(train={"steps": 0}), "steps"), (dict(jobs=0), "jobs"),
                    (dict(budget="huge"), "budget"), (dict(sets=("model.use_qk_norm=false",)), "--qk-norm"),
                    (dict(seed_lrs="some"), "seed-lrs"), (dict(train={"lr": 1.0}), "unknown stability-lab")):
        with pytest.raises(ValueError, match=msg):
            stability_lab.LabConfig(out=str(tmp_path), **kw).validate()


# ---------------------------------------------------------------- statistics with intervals (labs/stability/stats.py)

from gated_attention.labs.stability import stats as St  # noqa: E402


def _grid(curves: dict[int, dict[float, float]], diverged=(), spikes=None) -> list[dict]:
    """Runs from {seed: {lr: final loss}} (init 7.0); `diverged` = {(seed, lr)}; spikes = {(seed, lr): n}."""
    return [{"lr": lr, "seed": s, "final_loss": loss, "loss_at_init": 7.0, "diverged": (s, lr) in diverged,
             "spikes": (spikes or {}).get((s, lr), 0)} for s, c in curves.items() for lr, loss in c.items()]


def test_max_stable_lr_known_answers():
    # best at 1e-2 (4.0); 3e-2 within 0.1 (4.05); 1e-1 is 0.2 worse: the edge is 3e-2
    runs = _grid({0: {1e-3: 5.0, 1e-2: 4.0, 3e-2: 4.05, 1e-1: 4.2, 1.0: 6.0}})
    assert St.max_stable_lr(runs, 0.1) == 3e-2
    assert St.max_stable_lr(runs, 0.25) == 1e-1
    # a diverged run at an LR breaks the range even when the seed mean is fine
    two = _grid({0: {1e-2: 4.0, 3e-2: 4.0, 1e-1: 4.0}, 1: {1e-2: 4.0, 3e-2: 4.0, 1e-1: 4.0}}, diverged={(1, 1e-1)})
    assert St.max_stable_lr(two, 0.1) == 3e-2
    # contiguous from the best LR: a lucky LR above a failed one does not count
    gap = _grid({0: {1e-2: 4.0, 3e-2: 5.0, 1e-1: 4.05}})
    assert St.max_stable_lr(gap, 0.1) == 1e-2
    # a NaN final loss counts as the loss at init (7.0), never as the best
    nan = _grid({0: {1e-2: 4.0, 3e-2: NAN}})
    assert St.max_stable_lr(nan, 0.1) == 1e-2 and St.lr_curve(nan)[3e-2] == 7.0
    assert math.isnan(St.max_stable_lr([], 0.1))


def test_bootstrap_over_seeds():
    # three seeds with identical curves: every resample gives the same value, the interval is a point
    same = _grid({s: {1e-2: 4.0, 1e-1: 5.0} for s in range(3)})
    assert St.bootstrap(same, St.lr_sensitivity) == pytest.approx([0.5, 0.5])
    # seeds that differ: the interval spans the values of the resamples (all seeds 0 .. all seeds 2)
    spread = _grid({0: {1e-2: 4.0, 1e-1: 4.2}, 1: {1e-2: 4.0, 1e-1: 4.6}, 2: {1e-2: 4.0, 1e-1: 5.0}})
    lo, hi = St.bootstrap(spread, St.lr_sensitivity, n=4000)
    assert 0.1 - 1e-9 <= lo < St.lr_sensitivity(spread) < hi <= 0.5 + 1e-9
    # deterministic: the same runs give the same interval
    assert St.bootstrap(spread, St.lr_sensitivity, n=4000) == [lo, hi]
    # one seed says nothing about the spread
    assert St.bootstrap(_grid({0: {1e-2: 4.0}}), St.lr_sensitivity) is None
    # LRs on a log scale: the interval ends are grid LRs
    msl = _grid({0: {1e-2: 4.0, 1e-1: 4.05}, 1: {1e-2: 4.0, 1e-1: 4.5}, 2: {1e-2: 4.0, 1e-1: 4.02}})
    iv = St.bootstrap(msl, lambda rs: St.max_stable_lr(rs, 0.1), log_scale=True)
    assert iv == pytest.approx([1e-2, 1e-1])
    # spikes per run resampled by seed: seed 1 spiked 4 times at one LR
    sp = _grid({s: {1e-2: 4.0, 1e-1: 4.0} for s in range(3)}, spikes={(1, 1e-1): 4})
    assert St.spikes_per_run(sp) == pytest.approx(4 / 6)
    assert St.bootstrap(sp, St.spikes_per_run) == pytest.approx([0.0, 2.0])


def test_separated():
    assert St.separated([0.1, 0.2], [0.3, 0.4], lower_is_better=True)
    assert not St.separated([0.1, 0.3], [0.3, 0.4], lower_is_better=True)  # touching is not separated
    assert St.separated([0.3, 1.0], [0.01, 0.1], lower_is_better=False)
    assert not St.separated(None, [0.3, 0.4], lower_is_better=True)


def test_seeds_to_separate_hand_computed():
    # half-widths 0.1 + 0.1 = 0.2 at 3 seeds, difference 0.1: separate at 3 (0.2 / 0.1)^2 = 12 seeds
    assert St.seeds_to_separate(4.0, [3.9, 4.1], 4.1, [4.0, 4.2], 3) == 12
    # difference 0.4 > 0.2: already separated, so the seeds run are enough
    assert St.seeds_to_separate(4.0, [3.9, 4.1], 4.4, [4.3, 4.5], 3) == 3
    # overlapping but nearly separate: never fewer than one more seed
    assert St.seeds_to_separate(4.0, [3.9, 4.1], 4.19, [4.09, 4.29], 3) == 4
    # no difference, or no interval (one seed): nothing to scale from
    assert St.seeds_to_separate(4.0, [3.9, 4.1], 4.0, [3.9, 4.1], 3) is None
    assert St.seeds_to_separate(4.0, None, 4.1, [4.0, 4.2], 1) is None
    # the same answer with the roles swapped
    assert St.seeds_to_separate(4.1, [4.0, 4.2], 4.0, [3.9, 4.1], 3) == 12


def test_power_table_in_the_report():
    from gated_attention.labs.stability.stability_report import power_cells

    runs = [dict(_run(lr, base + d * (v != "baseline") + 0.05 * s, seed=s), variant=v, qk_norm=True)
            for v in ("baseline", "sdpa_elementwise") for s in range(3) for lr, base, d in ((1e-2, 4.0, -0.02),)]
    iv = lambda x: [x - 0.05, x + 0.05]  # noqa: E731
    settings = {v: {"on": {"seeds": [0, 1, 2], "lr_sensitivity": x, "lr_sensitivity_interval": iv(x)}}
                for v, x in (("baseline", 0.30), ("sdpa_elementwise", 0.25))}
    head, rows = power_cells({"runs": runs, "settings": settings, "config": {}})
    assert rows[0][:3] == ["on", "G1 elementwise", "3"]
    assert rows[0][3] == "-0.050 (12)"  # (0.1 / 0.05)^2 * 3
    # final loss at lr 0.01: difference -0.02, each bootstrap half-width 0.05 (seeds 0.05 apart): 3 (0.1/0.02)^2 = 75
    assert rows[0][4] == "-0.020 (75)"
