"""Tests of the sink lab: the Bigram-Backcopy generator, every metric on hand-built inputs with known answers, the
measurement wiring on a model with a known attention pattern, exact resume, and `gattn lab sinks --budget small`
end to end through the CLI (lab.json structure, report files, reuse, bad input)."""
from __future__ import annotations

import json
import math

import pytest
import torch

from gated_attention.labs.sinks import metrics as M
from gated_attention.labs.sinks.backcopy import BOS, BackcopyTask
from gated_attention.labs.sinks.stored import load_run
from gated_attention.experiment.stats import mean_std
from gated_attention.experiment.cache import StaleResult
from harness import build_lm, run_gattn

# one xdist worker runs this file whole: its module fixtures (a lab run) are built once (tests/conftest.py)
pytestmark = pytest.mark.xdist_group("labs_sinks")


SMALL = BackcopyTask(vocab=16, triggers=2, seq_len=32)


# ---------------------------------------------------------------- the task generator

def test_bos_first_and_backcopy_exactly_at_triggers():
    task = BackcopyTask(vocab=12, triggers=3, seq_len=64, seed=3)
    x = task.sample(200, seed=7)  # (B, T+1)
    assert x.shape == (200, 65)
    assert bool((x[:, 0] == BOS).all()) and bool((x[:, 1:] != BOS).all())  # BOS first, and only there
    assert bool((x[:, 1:] <= task.vocab).all())
    trig = task.is_trigger[x]
    assert not bool(trig[:, 1].any())  # x_1 has nothing before it to copy
    t_idx = trig[:, 1:-1].nonzero()  # (n, 2): (row, t-1) for trigger positions t = 1..T-1
    assert len(t_idx) > 500  # triggers are frequent tokens: plenty per batch
    b, t = t_idx[:, 0], t_idx[:, 1] + 1
    assert bool((x[b, t + 1] == x[b, t - 1]).all())  # every trigger is followed by the token before it


def test_transition_statistics_match_the_chain():
    task = BackcopyTask(vocab=8, triggers=2, seq_len=128, alpha=0.5, seed=1)
    x = task.sample(800, seed=0)  # ~100k transitions
    prev, nxt = x[:, 1:-1].flatten(), x[:, 2:].flatten()
    plain = ~task.is_trigger[prev]  # after a non-trigger the chain decides
    counts = torch.zeros(task.model_vocab, task.model_vocab, dtype=torch.float64)
    counts.index_put_((prev[plain], nxt[plain]), torch.ones(int(plain.sum()), dtype=torch.float64), accumulate=True)
    P = task.transition
    for i in range(1, task.model_vocab):
        if task.is_trigger[i]:
            continue
        n = counts[i].sum()
        assert n > 300  # every row is visited often enough for the check to have power
        emp = counts[i] / n
        # 5 standard errors of a multinomial frequency: fails for a wrong row, not for sampling noise
        tol = 5 * torch.sqrt(P[i] * (1 - P[i]) / n) + 1e-3
        assert bool(((emp - P[i]).abs() <= tol).all()), (i, emp, P[i])
    assert torch.allclose(P[1:, 1:].sum(1), torch.ones(task.vocab, dtype=torch.float64))
    pi = task.stationary
    assert torch.allclose(pi @ P, pi, atol=1e-10) and abs(float(pi.sum()) - 1) < 1e-12
    top = sorted(range(1, task.model_vocab), key=lambda i: -float(pi[i]))[: task.triggers]
    assert sorted(top) == task.trigger_ids.tolist()  # triggers = the most frequent tokens


def test_batches_are_a_function_of_seed_and_step():
    a, b = SMALL.train_batch(4, 0, 5), SMALL.train_batch(4, 0, 5)
    assert torch.equal(a, b)
    assert not torch.equal(a, SMALL.train_batch(4, 0, 6)) and not torch.equal(a, SMALL.train_batch(4, 1, 5))
    assert not torch.equal(SMALL.eval_set(4), SMALL.train_batch(4, 0, 0))
    with pytest.raises(ValueError, match="triggers"):
        BackcopyTask(vocab=4, triggers=4)


def test_masks_and_floor():
    task = BackcopyTask(vocab=5, triggers=1, seq_len=6)
    trig = int(task.trigger_ids[0])
    other = 1 if trig != 1 else 2
    x = torch.tensor([[BOS, other, trig, other, other, trig]])
    m = task.masks(x)
    assert m["active"].tolist() == [[False, False, True, False, False, True]]
    assert m["dormant"].tolist() == [[False, True, False, True, True, False]]
    ent = float(task.row_entropy[other])
    assert task.bigram_floor(x, m["dormant"]) == pytest.approx(ent)


# ---------------------------------------------------------------- metrics on hand-built inputs

def _uniform_causal(B, H, T):
    p = torch.tril(torch.ones(T, T))
    return (p / p.sum(-1, keepdim=True)).expand(B, H, T, T).clone()  # query t spreads 1/(t+1) over keys 0..t


def test_key_and_prev_attention():
    probs = _uniform_causal(2, 2, 5)
    probs[:, 1] = 0.0
    probs[:, 1, :, 0] = 1.0  # head 1: everything on BOS
    mask = torch.zeros(2, 5, dtype=torch.bool)
    mask[:, 2] = mask[:, 4] = True  # queries 2 and 4: uniform gives 1/3 and 1/5
    bos = M.key_attention(probs, mask)
    assert bos[0] == pytest.approx((1 / 3 + 1 / 5) / 2) and bos[1] == pytest.approx(1.0)
    prev = M.prev_token_attention(probs, mask)
    assert prev[0] == pytest.approx((1 / 3 + 1 / 5) / 2) and prev[1] == pytest.approx(0.0)
    shifted = torch.zeros(1, 1, 4, 4)
    shifted[0, 0, 0, 0] = 1.0
    for t in range(1, 4):
        shifted[0, 0, t, t - 1] = 1.0  # a perfect previous-token head
    assert M.prev_token_attention(shifted, torch.ones(1, 4, dtype=torch.bool)) == [pytest.approx(1.0)]
    assert M.key_attention(probs, torch.zeros(2, 5, dtype=torch.bool)) == [None, None]


def test_value_drain_and_residual_peak():
    v = torch.ones(2, 1, 5, 4)  # ||v_j|| = 2 everywhere
    v[:, 0, 0] = 0.5  # ||v_BOS|| = 1
    assert M.value_drain_ratio(v) == [pytest.approx(0.5)]
    h = torch.ones(3, 6, 4)
    h[:, 0] *= 10.0
    h[:, 1] *= 100.0  # one outlier among the others: the median ignores it
    assert M.residual_peak_ratio(h) == pytest.approx(10.0)


def test_masked_ce_gate_and_skill():
    V = 7
    logits = torch.zeros(2, 3, V)
    targets = torch.zeros(2, 3, dtype=torch.long)
    mask = torch.tensor([[True, False, True], [False, False, True]])
    assert M.masked_ce(logits, targets, mask) == pytest.approx(math.log(V))
    logits[..., 0] = 100.0
    assert M.masked_ce(logits, targets, mask) == pytest.approx(0.0, abs=1e-6)
    gate = torch.zeros(1, 3, 2, 4)
    gate[0, 0] = 0.2
    gate[0, 2, 0] = 0.8
    q = torch.tensor([[True, False, True]])
    assert M.gate_by_query(gate, q) == [pytest.approx(0.5), pytest.approx(0.1)]
    assert M.gate_by_query(gate[..., :1], q) == [pytest.approx(0.5), pytest.approx(0.1)]  # headwise shape
    assert M.steps_to_skill([0, 10, 20, 30], [2.0, None, 0.4, 0.1]) == 20
    assert M.steps_to_skill([0, 10], [2.0, 0.6]) is None
    assert M.trailing_mean([1.0, 3.0, float("nan"), 5.0], 2) == [1.0, 2.0, 3.0, 5.0]


def test_mean_std_over_seeds():
    mean, std = mean_std([{"a": 1.0, "b": None}, {"a": 3.0, "b": 2.0}, {"a": 5.0, "b": None}], ["a", "b", "c"])
    assert mean == {"a": 3.0, "b": 2.0, "c": None}
    assert std["a"] == pytest.approx(2.0) and std["b"] is None and std["c"] is None


# ---------------------------------------------------------------- measurement wiring on a known model

def test_measure_reads_the_model_through_capture():
    """q = k = 0 makes every head attend uniformly: BOS attention from query t is exactly 1/(t+1)."""
    from gated_attention.labs.sinks.sink_lab import budget_config, measure, model_config_for

    cfg = budget_config("small", variants=["sdpa_headwise"], layers=2, heads=2)
    task = BackcopyTask(**cfg.task)
    model = build_lm(model_config_for(cfg, "sdpa_headwise"), eval=False)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.zero_()
            layer.self_attn.k_proj.weight.zero_()
    seqs = task.eval_set(6)
    m = measure(model, task, seqs)
    masks = task.masks(seqs[:, :-1])
    inv = 1.0 / (torch.arange(task.seq_len, dtype=torch.float64) + 1)  # (T,)
    want_d = float((inv * masks["dormant"]).sum() / masks["dormant"].sum())
    want_a = float((inv * masks["active"]).sum() / masks["active"].sum())
    assert len(m["per_layer"]) == 2
    for e in m["per_layer"]:
        assert e["bos_attention_dormant"] == [pytest.approx(want_d, abs=1e-5)] * 2
        assert e["bos_attention_active"] == [pytest.approx(want_a, abs=1e-5)] * 2
        assert e["prev_attention_active"] == [pytest.approx(want_a, abs=1e-5)] * 2
        assert len(e["gate_dormant"]) == 2 and all(0 < g < 1 for g in e["gate_dormant"])
        assert e["null_attention_dormant"] == [pytest.approx(0.0, abs=1e-5)] * 2
    assert m["bos_attention_dormant"] == pytest.approx(want_d, abs=1e-5)
    logits = model(input_ids=seqs[:, :-1]).logits
    assert m["backcopy_ce"] == pytest.approx(M.masked_ce(logits, seqs[:, 1:], masks["active"]), rel=1e-5)
    assert m["residual_peak_ratio"] > 0 and len(m["attention_map"]) == min(40, task.seq_len)


def test_baseline_mechanisms_and_gate_init_build():
    from gated_attention.labs.sinks.sink_lab import SinkLabConfig, model_config_for, resolve_variant

    assert resolve_variant("g1") == ("sdpa_elementwise", "none")
    assert resolve_variant("sink_logits") == ("none", "sink_logits")
    with pytest.raises(ValueError, match="unknown variant"):
        resolve_variant("no_such_thing")
    cfg = SinkLabConfig().changed(gate_init="identity")
    assert model_config_for(cfg, "sdpa_headwise").gate_init == "identity"
    assert model_config_for(cfg, "bondarenko_gate").mechanism == "bondarenko_gate"


# ---------------------------------------------------------------- units: exact resume

def test_killed_unit_resumes_exactly(tmp_path, monkeypatch):
    from gated_attention.labs.sinks import sink_lab

    cfg = sink_lab.budget_config("small", variants=["sdpa_elementwise"], steps=40, ckpt_every=15, eval_every=20)
    job = lambda d: (cfg.settings(), "sdpa_elementwise", 0, str(d))
    whole = sink_lab.train_unit(job(tmp_path / "whole"))
    real = BackcopyTask.train_batch

    def dying(self, batch_size, seed, step):
        if step == 33:
            raise KeyboardInterrupt  # killed after the step-30 checkpoint
        return real(self, batch_size, seed, step)

    monkeypatch.setattr(BackcopyTask, "train_batch", dying)
    with pytest.raises(KeyboardInterrupt):
        sink_lab.train_unit(job(tmp_path / "killed"))
    from gated_attention.train.checkpoint import latest_checkpoint

    assert latest_checkpoint(tmp_path / "killed").name.endswith("30")  # the trainer's checkpoint (one resume policy)
    monkeypatch.setattr(BackcopyTask, "train_batch", real)
    # the reuse rule (experiment.cache): a half-trained unit is not resumed, nor silently restarted, under other
    # settings; a unit finished under other settings stops the job too
    other = (cfg.changed(lr=cfg.train.lr / 2).settings(), "sdpa_elementwise", 0, str(tmp_path / "killed"))
    with pytest.raises(StaleResult, match="lr: saved"):
        sink_lab.train_unit(other)
    with pytest.raises(StaleResult, match="lr: saved"):
        sink_lab.train_unit((other[0], "sdpa_elementwise", 0, str(tmp_path / "whole")))
    resumed = sink_lab.train_unit(job(tmp_path / "killed"))
    assert not (tmp_path / "killed" / "checkpoints").exists()  # a finished unit keeps its model, not its optimizer
    for k in sink_lab.METRICS:
        assert resumed[k] == whole[k], k
    assert [p["step"] for p in resumed["curve"]] == [0, 20, 40]
    assert resumed["curve"] == whole["curve"]  # the step hook's records rode in the checkpoint
    assert load_run(tmp_path / "killed").model.config.gate == "sdpa_elementwise"


# ---------------------------------------------------------------- end to end through the CLI

@pytest.fixture(scope="module")
def small_lab(tmp_path_factory):
    out = tmp_path_factory.mktemp("sinks")
    r = run_gattn("lab", "sinks", "--budget", "small", "--out", str(out), "--variants", "baseline", "sdpa_elementwise",
               "--jobs", "1")
    assert r.returncode == 0, r.stderr
    return out, r


def test_small_lab_writes_everything(small_lab):
    from gated_attention.labs.sinks.sink_lab import METRICS

    out, r = small_lab
    lab = json.loads((out / "lab.json").read_text())
    assert set(lab) >= {"task", "variants"}
    assert lab["task"]["vocab"] == 16 and lab["task"]["trigger_ids"]
    assert list(lab["variants"]) == ["baseline", "sdpa_elementwise"]
    for name, v in lab["variants"].items():
        assert set(v) >= {"per_seed", "mean", "std"}
        assert len(v["per_seed"]) == 2 and [s["seed"] for s in v["per_seed"]] == [0, 1]
        for k in METRICS:
            assert k in v["mean"] and k in v["std"] and all(k in s for s in v["per_seed"])
        assert v["per_seed"][0]["curve"] and v["per_seed"][0]["per_layer"]
        for k in ("bos_attention_dormant", "backcopy_ce", "bigram_ce", "value_drain_ratio", "residual_peak_ratio"):
            assert isinstance(v["mean"][k], float) and isinstance(v["std"][k], float)
    assert lab["variants"]["baseline"]["mean"]["gate_dormant"] is None  # no gate: null, not 0
    assert 0 < lab["variants"]["sdpa_elementwise"]["mean"]["gate_dormant"] < 1
    # same data and seeds: the floor is a property of the held-out set, identical for every variant
    assert lab["variants"]["baseline"]["mean"]["bigram_ce_floor"] == lab["variants"]["sdpa_elementwise"]["mean"][
        "bigram_ce_floor"]
    for f in ("report.md", "report.html", "plots/bos_attention_vs_step.png", "plots/attention_maps.png",
              "plots/gate_dormant_vs_active.png"):
        assert (out / f).stat().st_size > 0, f
    page = (out / "report.html").read_text()
    assert "data:image/png;base64," in page and 'src="plots/' not in page  # self-contained
    assert "sdpa_elementwise" in r.stdout and "BOS attn, dormant" in r.stdout


def test_rerun_reuses_and_changed_settings_fail(small_lab):
    out, _ = small_lab
    before = (out / "runs" / "baseline" / "seed0" / "result.json").read_text()
    r = run_gattn("lab", "sinks", "--budget", "small", "--out", str(out), "--variants", "baseline", "--seeds", "1",
               "--jobs", "1")
    assert r.returncode == 0, r.stderr
    assert "reusing 1 finished model" in r.stderr
    assert (out / "runs" / "baseline" / "seed0" / "result.json").read_text() == before
    r = run_gattn("lab", "sinks", "--budget", "small", "--out", str(out), "--variants", "baseline", "--lr", "5e-3",
               "--jobs", "1")
    assert r.returncode == 2 and "different settings" in r.stderr and "Traceback" not in r.stderr


def test_bad_input_is_one_line_exit_2(tmp_path):
    r = run_gattn("lab", "sinks", "--budget", "small", "--out", str(tmp_path), "--variants", "nope")
    assert r.returncode == 2 and "unknown variant 'nope'" in r.stderr and "Traceback" not in r.stderr
    r = run_gattn("lab", "sinks", "--budget", "small", "--out", str(tmp_path), "--layers", "4")
    assert r.returncode == 2 and "--layers" in r.stderr


@pytest.mark.slow  # 21 s: --report-only over a partial lab
def test_report_only_reports_the_finished_models(small_lab, tmp_path):
    import shutil

    out = tmp_path / "partial"
    shutil.copytree(small_lab[0], out)
    shutil.rmtree(out / "runs" / "sdpa_elementwise" / "seed1")  # as if the run was stopped before that model
    (out / "lab.json").unlink()
    r = run_gattn("lab", "sinks", "--budget", "small", "--out", str(out), "--variants", "baseline", "sdpa_elementwise",
               "--report-only")
    assert r.returncode == 0, r.stderr
    assert "left out: sdpa_elementwise seed 1" in r.stderr
    lab = json.loads((out / "lab.json").read_text())
    assert [len(v["per_seed"]) for v in lab["variants"].values()] == [2, 1]
    assert lab["variants"]["sdpa_elementwise"]["std"]["backcopy_ce"] is None  # one seed: no spread
    assert not (out / "runs" / "sdpa_elementwise" / "seed1").exists()  # nothing was trained


def test_finished_models_are_loadable_hf_folders(small_lab):
    """Every unit folder is a from_pretrained folder; load_run returns its model, task and settings, and the
    model measures exactly what result.json recorded (the saved weights are the final ones)."""
    from gated_attention.labs.sinks.sink_lab import measure
    from gated_attention.labs.sinks.stored import is_run_dir, load_run
    from gated_attention.modeling import GatedQwen3ForCausalLM

    out, _ = small_lab
    unit = out / "runs" / "baseline" / "seed1"
    assert is_run_dir(unit) and not is_run_dir(out) and not is_run_dir(out / "runs" / "baseline")
    run = load_run(unit)
    assert (run.variant, run.seed) == ("baseline", 1) and run.task == SMALL and run.config.model["hidden_size"] == 32
    assert not run.model.training
    m = measure(run.model, run.task, run.task.eval_set(run.config.eval_size))
    for k in ("bos_attention_dormant", "backcopy_ce", "bigram_ce"):
        assert m[k] == pytest.approx(run.result[k], rel=1e-6), k
    plain = GatedQwen3ForCausalLM.from_pretrained(out / "runs" / "sdpa_elementwise" / "seed0")
    assert plain.config.gate == "sdpa_elementwise"
    with pytest.raises(ValueError, match="not a finished sink-lab run"):
        load_run(out)


def test_optimizer_and_model_knobs_reach_the_unit(monkeypatch, tmp_path):
    """--qk-norm/--beta2/--adam-eps/--weight-decay/--decay-frac/--alpha land in the config, the model and AdamW."""
    import argparse

    from gated_attention.labs.sinks import sink_lab
    from gated_attention.labs.sinks.study import STUDY, sinks_config

    p = argparse.ArgumentParser()
    STUDY.configure(p)
    args = p.parse_args(["--budget", "small", "--qk-norm", "off", "--beta2", "0.99", "--adam-eps", "1e-6",
                         "--weight-decay", "0.5", "--decay-frac", "0", "--alpha", "0.2", "--variants", "baseline"])
    cfg = sinks_config(args)
    got = cfg.settings()
    assert (got["qk_norm"], got["beta2"], got["eps"], got["weight_decay"], got["wsd_decay_frac"]) == \
        (False, 0.99, 1e-6, 0.5, 0.0)
    assert (cfg.train.beta2, cfg.train.eps, cfg.model["use_qk_norm"]) == (0.99, 1e-6, False)  # where each lives
    assert cfg.task["alpha"] == 0.2 and cfg.task["vocab"] == 16  # the budget's task, one field changed
    assert sink_lab.model_config_for(cfg, "baseline").use_qk_norm is False
    seen = {}
    real = torch.optim.AdamW

    def spy(groups, **kw):
        seen.update(kw, wd=[g["weight_decay"] for g in groups])
        return real(groups, **kw)

    monkeypatch.setattr(torch.optim, "AdamW", spy)
    r = sink_lab.train_unit((cfg.changed(steps=3, eval_every=3).settings(), "baseline", 0, str(tmp_path / "u")))
    assert seen["betas"] == (0.9, 0.99) and seen["eps"] == 1e-6 and 0.5 in seen["wd"] and 0.0 in seen["wd"]
    assert r["key"]["qk_norm"] is False and r["key"]["wsd_decay_frac"] == 0.0
    with pytest.raises(ValueError, match="--decay-frac"):
        cfg.changed(wsd_decay_frac=1.5).validate()


def test_units_stored_under_the_old_knob_names_are_still_read(tmp_path):
    """A unit trained when the lab's knobs had their own names (decay_frac, adam_eps; now TrainConfig's
    wsd_decay_frac, eps) is reused under today's names, and one made with another value is still refused."""
    from gated_attention.experiment import cache
    from gated_attention.labs.sinks import sink_lab

    cfg = sink_lab.SinkLabConfig().changed(wsd_decay_frac=0.3, eps=1e-6)
    key = sink_lab._unit_key(cfg, "baseline", 0)
    old = {{"wsd_decay_frac": "decay_frac", "eps": "adam_eps"}.get(k, k): v for k, v in key.items()}
    assert sink_lab.RENAMED_KEYS == {"decay_frac": "wsd_decay_frac", "adam_eps": "eps"}
    cache.save(tmp_path / "result.json", old, {"ce": 1.0})
    got = sink_lab._stored_unit(tmp_path, cfg, "baseline", 0)
    assert got["ce"] == 1.0 and got["key"]["wsd_decay_frac"] == 0.3 and got["key"]["eps"] == 1e-6
    cache.save(tmp_path / "result.json", {**old, "decay_frac": 0.2}, {"ce": 1.0})
    with pytest.raises(cache.StaleResult, match="wsd_decay_frac"):
        sink_lab._stored_unit(tmp_path, cfg, "baseline", 0)


def test_help_states_the_budgets_true_defaults():
    import argparse

    from gated_attention.labs.sinks.sink_lab import budget_config
    from gated_attention.labs.sinks.study import STUDY

    p = argparse.ArgumentParser()
    STUDY.configure(p)
    helps = {a.dest: " ".join(a.help.split()) for a in p._actions if a.help}
    d = budget_config("default")
    assert f"{d.train.lr:g} with --budget default" in helps["lr"] or helps["lr"].endswith(f"(default {d.train.lr:g})")
    assert f"{d.train.steps} with --budget default" in helps["steps"]
    assert "on with --budget default" in helps["compile"] and "off with --budget small" in helps["compile"]
    assert helps["qk_norm"].endswith(f"(default {'on' if d.model['use_qk_norm'] else 'off'})")
    assert helps["eval_every"].endswith(f"{d.curve_every} with --budget default)")


def test_the_stored_names_are_one_table_that_round_trips():
    """Every stored name (the options', units' keys', lab.json's config) reads and writes the one setting it names:
    changing it by that name changes that setting and nothing else, and the stored form reads back the same config."""
    from gated_attention.labs.sinks import sink_lab

    base = sink_lab.budget_config("small")
    before = base.settings()
    assert list(before) == list(sink_lab.STORED)
    def another(name, value):
        if name in ("variants", "task"):
            return ["sdpa_headwise"] if name == "variants" else {**value, "alpha": 0.7}
        if isinstance(value, bool):
            return not value
        if isinstance(value, str):
            return {"gate_init": "identity", "schedule": "cosine", "precision": "fp32"}[name]
        return value + 1

    for name, value in before.items():
        other = another(name, value)
        after = base.changed(**{name: other}).settings()
        assert after == {**before, name: other}, name
    assert sink_lab.SinkLabConfig().changed(**before).settings() == before  # the stored form reads back
    with pytest.raises(ValueError, match="unknown sink-lab setting"):
        base.changed(adam_eps=1e-6)  # an old name is read through RENAMED_KEYS where a stored key is, not here
