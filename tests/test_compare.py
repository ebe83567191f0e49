"""Tests of `gattn compare`: the CI-sized budget end to end on a tiny corpus built from text files in tmp, reuse of
finished runs, resume of a half-finished one, refusal to mix settings, and automatic data preparation."""
from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest

from gated_attention import cli
from gated_attention.compare import job as C

# one xdist worker runs this file whole: its module fixtures (a lab run) are built once (tests/conftest.py)
pytestmark = pytest.mark.xdist_group("compare")


@pytest.fixture(scope="module")
def small_run(tiny_corpus, tmp_path_factory):
    """`gattn compare --budget small` through the CLI, with the default three variants."""
    out = tmp_path_factory.mktemp("cmp") / "out"
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(out.parent)  # the default --stability-lab / --longctx folders (relative, absent here): 'not run here'
        rc = cli.main(["compare", "--budget", "small", "--data-dir", str(tiny_corpus), "--out", str(out),
                       "--jobs", "1"])
    assert rc == 0
    return out


def test_small_budget_writes_report(small_run, tiny_corpus):
    out = small_run
    res = json.loads((out / "compare.json").read_text())
    assert res["variants"] == list(C.DEFAULT_VARIANTS)
    rows = res["rows"]
    base = rows["baseline"]["params"]
    for v, r in rows.items():
        # identical budget and data: same steps and tokens; parameter parity within 0.1 % (FFN shrink)
        assert r["tokens"] == res["train_config"]["steps"] * res["train_config"]["batch_size"] * res["train_config"]["seq_len"]
        # parity up to rounding the shrunk FFN width to whole units (3 * hidden * layers parameters per unit)
        shape = res["train_config"]["model_overrides"]
        assert abs(r["params"] - base) <= 3 * shape["hidden_size"] * shape["num_hidden_layers"] / 2
        assert 0.0 < r["f_attn"] < 1.0 and r["m_act"] > 0
        assert r["avg_ppl"] > 1.0 and set(r["val_ppl"]) == {"prose", "code"}
        assert r["avg_ppl"] == pytest.approx(sum(r["val_ppl"].values()) / 2)
        assert len(r["per_layer"]["f_attn"]) == 2
    assert rows["baseline"]["gate_mean"] is None
    for v in ("sdpa_elementwise", "sdpa_headwise"):
        assert 0.0 < rows[v]["gate_mean"] < 1.0
    # every variant starts untrained: its first logged loss (the forward on batch 0, before any update) is the
    # uniform prediction's ln(vocab) moved by the spread of a fresh model's logits z = W h:
    # W ~ N(0, initializer_range^2) and |h|^2 = hidden after the final RMSNorm give z a variance
    # s^2 = initializer_range^2 * hidden, which moves the cross-entropy by about s^2 / 2 (logsumexp's second order);
    # the bound allows s^2 (measured: within 0.005 nats of ln(300) here, s^2 = 0.0256). Each variant logs every step
    # once, on batches of the same size (its token count grows by batch_size x seq_len a step).
    tc = res["train_config"]
    per_step = tc["batch_size"] * tc["seq_len"]
    for v in rows:
        log = [json.loads(l) for l in (out / "runs" / v / "log.jsonl").read_text().splitlines()]
        mc = json.loads((out / "runs" / v / "final" / "config.json").read_text())
        s2 = mc["initializer_range"] ** 2 * mc["hidden_size"]
        assert abs(log[0]["loss"] - math.log(mc["vocab_size"])) < s2, (v, log[0]["loss"], mc["vocab_size"], s2)
        assert [r["step"] for r in log] == list(range(tc["steps"])), v
        assert [r["tokens"] for r in log] == [(s + 1) * per_step for s in range(tc["steps"])], v

    md = (out / "report.md").read_text()
    assert "| Variant | Params | Avg PPL | Mean gate | M-Act | F-Attn | Loss spikes |" in md
    for v in rows:
        assert f"| {v} |" in md
    html = (out / "report.html").read_text()
    imgs = re.findall(r'<img [^>]*src="([^"]+)"', html)
    # loss, layers, gates, one map per variant; then the sink lab's curves, maps and gate plots
    assert len(imgs) == len(res["plots"]) + len(res["sink_lab"]["plots"]) + len(res["streaming"]["plots"]) and \
        len(res["plots"]) >= 5 and len(res["streaming"]["plots"]) == 2
    assert all(s.startswith("data:image/png;base64,") for s in imgs)  # self-contained
    assert all((out / p).stat().st_size > 1000 for p in [*res["plots"].values(), *res["sink_lab"]["plots"].values(),
                                                         *res["streaming"]["plots"].values()])
    # the report opens with the claims table, one row per claim; stability / long context were not run here
    assert md.index("## Paper claims vs this run") < md.index("## Table 4 form")
    assert html.index("Paper claims vs this run") < html.index("Table 4 form")
    assert [c["claim"] for c in res["claims"]][0] == "Lower perplexity at parameter parity" and len(res["claims"]) == 8
    assert "gattn lab stability --budget default --out runs/lab/stability" in md
    assert "gattn longctx --budget fair --out runs/longctx" in md
    lab = json.loads((out / "sink_lab" / "lab.json").read_text())
    assert list(lab["variants"]) == list(C.DEFAULT_VARIANTS) and "## Sink lab (Bigram-Backcopy)" in md
    assert set(res["sink_lab"]["variants"]["sdpa_elementwise"]["mean"]) >= {"bos_attention_dormant", "backcopy_ce"}
    assert "prose" in html and "code" in html
    # the streaming check: every text model and every sink-lab model, full vs K=0 / K=4, and its claims row
    st = res["streaming"]
    assert set(st["models"]) == set(C.DEFAULT_VARIANTS) | {f"{v}/seed0" for v in C.DEFAULT_VARIANTS}
    assert st["window"] == {"text": 16, "sink lab": 8} and st["sink_tokens"] == [0, 4]
    for m in st["models"].values():
        assert set(m["window"]) == {"0", "4"} and m["full"]["loss"] > 0 and "per_position" not in m["full"]
    streaming_lab = json.loads((out / "streaming" / "text" / "lab.json").read_text())
    assert streaming_lab["models"]["baseline"]["window"]["0"]["loss"] == st["models"]["baseline"]["window"]["0"]["loss"]
    row = res["claims"][-1]
    assert row["claim"] == "Streams with a plain window (no sink tokens)" and row["verdict"] in (
        "reproduced", "partly", "not at this scale") and "K=4" in row["this_run"]
    assert "## Streaming check" in md


def _unit_files(out: Path) -> dict[str, int]:
    """Every file of every unit compare trained or measured (the LM runs with their analysis.json, the sink lab's
    units, the streaming check's per-model measurements): {path under out: mtime_ns}."""
    files = [*(out / "runs").rglob("*"), *(out / "sink_lab" / "runs").rglob("*"),
             *(out / "streaming").rglob("models/*")]
    return {f.relative_to(out).as_posix(): f.stat().st_mtime_ns for f in files
            if f.is_file() and not f.name.endswith(".gattn-lock")}  # the folder locks: taken anew by every run


def test_rerun_reuses_finished_runs(small_run, tiny_corpus, monkeypatch):
    """A rerun over a finished OUT trains nothing and rewrites no unit: every file of every LM run, sink-lab unit and
    streaming measurement is the one the first run wrote (same paths, same mtimes), and the figures are the same."""
    import gated_attention.train.trainer as T

    before = json.loads((small_run / "compare.json").read_text())
    files = _unit_files(small_run)
    assert {f.split("/")[1] for f in files if f.startswith("runs/")} == set(before["variants"])
    assert sum(f.startswith("sink_lab/runs/") and f.endswith("/result.json") for f in files) == \
        len(before["variants"]) * before["sink_lab"]["config"]["seeds"]
    assert any(f.startswith("streaming/") for f in files)

    def no_training(*a, **k):
        raise AssertionError("a finished run was retrained")

    monkeypatch.setattr(T, "train", no_training)
    res = C.run_compare(small_run, tiny_corpus, "small", log=lambda m: None)
    assert _unit_files(small_run) == files
    for v, r in res["rows"].items():
        for k in ("avg_ppl", "f_attn", "m_act", "gate_mean", "params", "spikes"):
            assert r[k] == before["rows"][v][k]


def test_half_finished_run_resumes(small_run, tiny_corpus, monkeypatch, tmp_path):
    import gated_attention.train.trainer as T

    out = tmp_path / "out"
    shutil.copytree(small_run, out)
    run = out / "runs" / "sdpa_headwise"
    # pretend the process died after the step-30 checkpoint: no summary, no final model, no later checkpoint
    (run / "summary.json").unlink()
    shutil.rmtree(run / "final")
    for ck in (run / "checkpoints").glob("step_*"):
        if int(ck.name.split("_")[1]) > 30:
            shutil.rmtree(ck)
    calls = []
    real = T.train

    def spy(cfg, out_dir, resume=False, **k):
        calls.append((cfg.gate, resume))
        return real(cfg, out_dir, resume=resume, **k)

    monkeypatch.setattr(T, "train", spy)
    res = C.run_compare(out, tiny_corpus, "small", log=lambda m: None)
    assert calls == [("sdpa_headwise", True)]
    old = json.loads((small_run / "runs" / "sdpa_headwise" / "summary.json").read_text())
    new = json.loads((run / "summary.json").read_text())
    assert new["steps"] == old["steps"]
    assert new["final_loss"] == pytest.approx(old["final_loss"], rel=1e-4)  # exact resume: the same last loss
    assert res["rows"]["sdpa_headwise"]["avg_ppl"] == pytest.approx(old["avg_ppl"], rel=1e-3)


def test_changed_settings_fail_loudly(small_run, tiny_corpus):
    with pytest.raises(ValueError, match=r"different settings \(lr: saved"):
        C.run_compare(small_run, tiny_corpus, "small", variants=["baseline"], sets=["lr=1e-3"], log=lambda m: None)


def test_bad_arguments(tiny_corpus, tmp_path, capsys):
    with pytest.raises(ValueError, match="unknown variant"):
        C.check_variants(["baseline", "nope"])
    with pytest.raises(ValueError, match="unknown --budget 'huge'; valid: small, quick"):
        C.get_budget("huge")
    with pytest.raises(ValueError, match="--variants"):
        C.budget_config(C.BUDGETS["small"], str(tiny_corpus), ["gate=sdpa_headwise"])
    assert cli.main(["compare", "--data-dir", str(tiny_corpus), "--out", str(tmp_path), "--variants", "nope"]) == 2
    assert "unknown variant" in capsys.readouterr().err


@pytest.mark.parametrize("flag, name", [("--stability-lab", "lab.json"), ("--longctx", "report.json"),
                                        ("--scaling-lab", "lab.json")])
def test_named_evidence_folder_without_its_output_stops_before_training(flag, name, tiny_corpus, tmp_path, capsys):
    """A --stability-lab / --longctx DIR the user names must hold that lab's output: one line, exit 2, nothing trained
    (it used to run and report 'not run here')."""
    empty, out = tmp_path / "empty", tmp_path / "out"
    empty.mkdir()
    argv = ["compare", "--budget", "small", "--data-dir", str(tiny_corpus), "--out", str(out), "--jobs", "1"]
    assert cli.main(argv + [flag, str(empty)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{flag} {empty}: no {name} there" in err[0] and "leave" in err[0]
    assert not out.exists()  # stopped before anything was trained or written
    (empty / name).write_text('{"something": "else"}')  # a JSON object that is not that lab's output
    assert cli.main(argv + [flag, str(empty)]) == 2
    assert "not an output of" in capsys.readouterr().err


def test_named_evidence_folders_of_the_shipped_tables_are_accepted():
    from gated_attention.compare import claims

    docs = Path(__file__).resolve().parents[1] / "results"
    claims.require_evidence("--stability-lab", docs / "stability_lab")
    claims.require_evidence("--longctx", docs / "long_context_fixed")


def test_new_data_dir_is_prepared_there(tmp_path, tiny_corpus, monkeypatch):
    """`gattn compare --data-dir NEW` prepares the corpus in NEW (as its help says) with the budget's vocabulary."""
    from gated_attention import data

    seen = []

    def fake_prepare(cfg):  # the real build takes minutes: copy the tiny corpus where it was asked for
        seen.append((cfg.data_dir, cfg.vocab_size))
        shutil.copytree(tiny_corpus, cfg.data_dir, dirs_exist_ok=True)

    monkeypatch.setattr(data, "prepare", fake_prepare)
    new = tmp_path / "brand" / "new"
    monkeypatch.chdir(tmp_path)  # the default evidence folders are relative: absent here
    rc = cli.main(["compare", "--budget", "small", "--data-dir", str(new), "--out", str(tmp_path / "out"),
                   "--variants", "baseline", "--set", "steps=4", "--no-sink-lab", "--no-streaming"])
    assert rc == 0 and seen == [(str(new), C.BUDGETS["small"].vocab_size)]
    assert (new / "manifest.json").exists()


def test_long_budget_prepares_its_own_small_vocabulary_corpus():
    # experiment.ensure_corpus prepares a missing corpus with the budget's vocabulary (test_experiment.py, and
    # test_new_data_dir_is_prepared_there above through the CLI); the sink budgets were measured on the
    # 1k-vocabulary corpus; quick/small use the default 8k corpus
    assert {C.BUDGETS[b].vocab_size for b in ("default", "long")} == {1024}
    assert C.BUDGETS["quick"].data_dir != C.BUDGETS["default"].data_dir and C.BUDGETS["quick"].vocab_size == 8192


def test_budgets_are_valid_configs(tiny_corpus):
    for b in C.BUDGETS.values():
        cfg = C.budget_config(b, str(tiny_corpus))
        assert cfg.gate == "baseline" and cfg.data == "corpus" and cfg.data_dir == str(tiny_corpus)
    small = C.BUDGETS["small"]
    assert C.budget_config(small, str(tiny_corpus), ["steps=7"]).steps == 7
    # a config is a copy: changing it leaves the (shared) budget tables alone
    C.budget_config(C.BUDGETS["long"], str(tiny_corpus)).model_overrides["hidden_size"] = 1
    assert C.BUDGETS["text"].train["model_overrides"]["hidden_size"] == 128


@pytest.mark.slow
def test_small_budget_on_default_corpus(tmp_path):
    """The CI command on the real default corpus (prepared into ./data if missing; a couple of minutes)."""
    out = tmp_path / "out"
    assert cli.main(["compare", "--budget", "small", "--out", str(out)]) == 0
    res = json.loads((out / "compare.json").read_text())
    assert set(res["rows"]) == set(C.DEFAULT_VARIANTS)
    assert (out / "report.html").exists() and (out / "report.md").exists()


def test_units_are_scheduled_longest_first_and_finished_ones_skipped(small_run, tiny_corpus, tmp_path):
    """compare's layout: the LM variants to train first (each unit also analyses its model), then the sink lab's
    pending units, which fill the second worker while the last LM variant trains; finished models get no worker."""
    from dataclasses import replace

    from gated_attention.labs import sinks

    b = C.BUDGETS["small"]
    base = C.budget_config(b, str(tiny_corpus))
    cfgs = {v: replace(base, gate=v).validate() for v in C.DEFAULT_VARIANTS}
    sink_cfg = C.sink_lab_config(b, list(C.DEFAULT_VARIANTS), precision=base.precision)
    fresh = C.schedule_units(tmp_path / "new", cfgs, b, "fp32",
                             sinks.unit_jobs(sink_cfg, tmp_path / "new" / "sink_lab", "fp32"))
    assert [t[0] for t in fresh] == ["lm"] * 3 + ["sink"] * 3 * sink_cfg.seeds
    assert [t[1][0].gate for t in fresh[:3]] == list(C.DEFAULT_VARIANTS)
    assert [t[1][1] for t in fresh[3:6]] == list(C.DEFAULT_VARIANTS)  # (cfg, variant, seed, dir): seed-major
    done = json.loads((small_run / "compare.json").read_text())["resolved_precision"]  # what its units trained in
    assert C.schedule_units(small_run, cfgs, b, done, sinks.unit_jobs(sink_cfg, small_run / "sink_lab", done)) == []
    assert len(C.schedule_units(tmp_path / "new", {"baseline": cfgs["baseline"]}, b, "fp32")) == 1  # --no-sink-lab
    assert fresh[0][1][3] == "fp32" and fresh[3][1][0]["precision"] == "fp32"  # every unit carries the decision
    assert cfgs["baseline"] == fresh[0][1][0]


def test_parallel_workers_reproduce_the_in_process_run(small_run, tiny_corpus, tmp_path):
    """The default layout (LM variants and sink-lab units in 2 worker processes, one thread each) trains the same
    models as one after another in-process (--jobs 1): same data, seeds and steps; float sums may differ with the
    thread count, so the figures agree to rounding."""
    res = C.run_compare(tmp_path / "par", tiny_corpus, "small", log=lambda m: None, jobs=2, streaming=False,
                        stability_lab=None, longctx=None)
    ref = json.loads((small_run / "compare.json").read_text())
    assert res["layout"] == {"jobs": 2, "threads_per_job": 1, "trained": 3 + 3}  # 3 LM variants + 3 sink units
    for v, r in res["rows"].items():
        for k in ("avg_ppl", "m_act", "final_loss_avg10"):
            assert r[k] == pytest.approx(ref["rows"][v][k], rel=2e-3), (v, k)
    for v, x in res["sink_lab"]["variants"].items():
        assert x["mean"]["backcopy_ce"] == pytest.approx(ref["sink_lab"]["variants"][v]["mean"]["backcopy_ce"],
                                                         rel=2e-3, abs=1e-4)
    assert set(res["timings_s"]) == {"setup", "models", "sink_lab_report", "streaming", "report"}


def test_seeds_give_the_perplexity_row_its_measure(tiny_corpus, tmp_path):
    """--seeds 2: every variant trains seeds 0 and 1 (runs/<v>, runs/<v>_seed1; the same batches per seed), and the
    perplexity row carries the measure (Δ in nats paired over seeds with its interval, tokens per parameter, seeds,
    LRs and whether they were tuned), judged by the 0.0128-nat rule on this run (no scaling lab here)."""
    out = tmp_path / "out"
    argv = ["compare", "--budget", "small", "--data-dir", str(tiny_corpus), "--out", str(out), "--jobs", "1",
            "--variants", "baseline", "sdpa_elementwise", "--seeds", "2", "--no-sink-lab", "--no-streaming",
            "--scaling-lab", str(tmp_path / "none")]
    from gated_attention.labs.scaling import verdict as V

    with pytest.raises(ValueError, match="--seeds"):  # no seeds: refused before anything trains
        C.run_compare(out, tiny_corpus, "small", ["baseline"], seeds=0)
    (tmp_path / "none").mkdir()
    (tmp_path / "none" / "lab.json").write_text(json.dumps({"deltas": [], "config": {}, "verdict": {
        "per_variant": {}, "text": ""}}))  # a lab without this variant: the row falls back to this run's verdict
    assert cli.main(argv) == 0
    res = json.loads((out / "compare.json").read_text())
    for v in ("baseline", "sdpa_elementwise"):
        assert (out / "runs" / v / "final").exists() and (out / "runs" / f"{v}_seed1" / "final").exists()
        assert set(res["rows"][v]["val_loss_by_seed"]) == {"0", "1"}
        # every seed's model is analysed; the report's figures are their means (compare/seeds.py)
        by = res["rows"][v]["by_seed"]
        assert set(by) == {"0", "1"} and all(0.0 < by[k]["f_attn"] < 1.0 for k in by)
        assert res["rows"][v]["over_seeds"]["f_attn"]["mean"] == pytest.approx((by["0"]["f_attn"] + by["1"]["f_attn"]) / 2)
        assert res["rows"][v]["over_seeds"]["f_attn"]["per_seed"] == [by["0"]["f_attn"], by["1"]["f_attn"]]
    assert set(res["plot_data"]["loss"]["baseline"]) == {"0", "1"} and "sdpa_elementwise" in res["plot_data"]["gates"]
    cfg0 = json.loads((out / "runs" / "baseline" / "train_config.json").read_text())
    cfg1 = json.loads((out / "runs" / "baseline_seed1" / "train_config.json").read_text())
    assert cfg1["seed"] == cfg0["seed"] + 1
    row = res["claims"][0]
    m = row["measure"]
    d = m["delta_nats"]["sdpa_elementwise"]
    by = {v: res["rows"][v]["val_loss_by_seed"] for v in ("baseline", "sdpa_elementwise")}
    diffs = [by["sdpa_elementwise"][k] - by["baseline"][k] for k in ("0", "1")]
    assert d["mean"] == pytest.approx(sum(diffs) / 2) and d["ci_low"] < d["mean"] < d["ci_high"]
    assert m["seeds"] == 2 and m["tokens_per_param"] > 0 and m["lr_tuned"] == {"baseline": False,
                                                                               "sdpa_elementwise": False}
    assert m["lr"]["baseline"] == res["train_config"]["lr"] and m["verdict_source"] == "this run"
    assert row["verdict"] == V.judge(d["mean"], d["ci_low"], d["ci_high"])
