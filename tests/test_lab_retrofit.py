"""Tests of the retrofit lab (`gattn lab retrofit`, issue 21) on tiny models: every recipe moves what it trains and
nothing else, the first-token penalty and the gate-sparsity term equal their plain references in value and gradient,
the control and the recipes see the same batches, the streaming loss equals a position-by-position reference,
starting points resolve (sink-lab runs, training runs, HF folders) or fail clearly, and the lab writes the JSON
contract, reuses finished units, resumes a killed one exactly and refuses other settings."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from _extras import need

from gated_attention.labs.retrofit import retrofit_lab
from gated_attention.labs.retrofit import recipes as R
from gated_attention.labs.retrofit import starts as S
from gated_attention.labs.sinks.backcopy import BackcopyTask
from harness import build_lm, stock_lm

# one xdist worker runs this file whole: its module fixtures (a lab run) are built once (tests/conftest.py)
pytestmark = pytest.mark.xdist_group("lab_retrofit")


TASK = BackcopyTask(vocab=16, triggers=2, seq_len=32)


def _sink_start(root, seed: int = 0, steps: int = 40, model: bool = True, variant: str = "baseline"):
    """A sink-lab unit folder (result.json + the model's HF files, as `gattn lab sinks` keeps it) holding a tiny
    random model on TASK."""
    from gated_attention.labs.sinks import budget_config, model_config_for

    cfg = budget_config("small", steps=steps, variants=[variant])
    unit = root / "runs" / variant / f"seed{seed}"
    unit.mkdir(parents=True)
    if model:
        build_lm(model_config_for(cfg, variant), seed=seed).save_pretrained(unit)
    key = {**cfg.settings(), "variant": variant, "seed": seed, "format": 1}
    (unit / "result.json").write_text(json.dumps({"key": key, "variant": variant, "seed": seed}))
    return unit


@pytest.fixture(scope="module")
def sink_start(tmp_path_factory):
    return _sink_start(tmp_path_factory.mktemp("sinklab"))


def _cfg(start, **kw) -> retrofit_lab.RetrofitLabConfig:
    base = dict(starts=[str(start)], steps=6, eval_every=3, eval_size=8, stream_window=8, batch_size=4,
                ckpt_every=0, keep_models=True)
    return retrofit_lab.RetrofitLabConfig().changed(**{**base, **kw}).validate()


def _job(cfg, start, name, unit_dir, seed=0):
    s = S.resolve_starts(cfg.starts, cfg.train.data_dir, cfg.train.seq_len)[0]
    return (cfg.settings(), s.to_dict(), name, R.get_recipe(name).to_dict(), seed, str(unit_dir))


def _weights(folder) -> dict:
    from gated_attention.util.io import load_hf_state

    return load_hf_state(folder)


# ---------------------------------------------------------------- recipes: what moves, what does not

@pytest.mark.parametrize("name", list(R.RECIPES))
def test_each_recipe_trains_what_it_says(sink_start, tmp_path, name):
    recipe = R.get_recipe(name)
    cfg = _cfg(sink_start)
    res = retrofit_lab.train_unit(_job(cfg, sink_start, name, tmp_path / name))
    before = _weights(sink_start)
    after = _weights(tmp_path / name / "model")
    gate_keys = [k for k in after if R.is_gate_param(k)]
    assert bool(gate_keys) == (recipe.gate is not None)
    assert set(after) - set(gate_keys) == set(before)  # the retrofitted model = the start + the gate
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    if recipe.rest_lr == 0:
        assert not moved, f"frozen parameters moved: {sorted(moved)[:3]}"
    else:
        assert moved == set(before), f"some trained parameters did not move: {sorted(set(before) - moved)[:3]}"
    if recipe.gate is not None:
        init = "identity" if recipe.init == "identity" else "random"
        assert all(not torch.equal(after[k], torch.zeros_like(after[k])) for k in gate_keys if k.endswith("weight"))
        assert json.loads((tmp_path / name / "model" / "config.json").read_text())["gate_init"] == (
            "identity" if init == "identity" else "normal")
    assert res["steps"] == 6 and [p["step"] for p in res["curve"]] == [0, 3, 6]
    for k in ("sink_after", "skill_after", "backcopy_ce_after", "bigram_ce_after", "streaming_loss_after"):
        assert isinstance(res[k], float), k
    assert (res["gate_dormant"] is None) == (recipe.gate is None)
    if recipe.uses_tap:  # the extra terms are logged along the curve
        assert any(k in res["curve"][-1] for k in ("first_token_attention", "gate_score"))


def test_gates_first_phase_freezes_the_rest(sink_start, tmp_path, monkeypatch):
    """warmup-penalty: only the gates train in the first 25 % of the steps; the checkpoint at that point proves it."""
    cfg = _cfg(sink_start, steps=8, ckpt_every=2)
    real = S.SinkData.train_batch

    def dying(self, seed, step):
        if step == 3:
            raise KeyboardInterrupt  # killed after the step-2 checkpoint (= the end of the gates-only phase)
        return real(self, seed, step)

    monkeypatch.setattr(S.SinkData, "train_batch", dying)
    with pytest.raises(KeyboardInterrupt):
        retrofit_lab.train_unit(_job(cfg, sink_start, "warmup-penalty", tmp_path / "u"))
    from gated_attention.train.checkpoint import latest_checkpoint, load_files

    shared, meta, _ = load_files(latest_checkpoint(tmp_path / "u"), 0)  # the trainer's checkpoint after step 2
    saved = shared["model"]
    assert meta["state"]["step"] == 2
    before = _weights(sink_start)
    gates = [k for k in saved if R.is_gate_param(k)]
    assert all(torch.equal(saved[k], before[k]) for k in before)
    assert any(not torch.equal(saved[k], torch.zeros_like(saved[k])) for k in gates)


def test_param_groups_split_gates_and_rest_with_the_decay_rule(sink_start):
    model = S.build_model(str(sink_start), "sdpa_elementwise", "identity", 0)
    groups = R.param_groups(model, R.get_recipe("bos-penalty"), lr=1e-2, weight_decay=0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    for g in groups:
        kinds = {R.is_gate_param(names[id(p)]) for p in g["params"]}
        assert len(kinds) == 1
        assert g["lr"] == pytest.approx(1e-2 * (1.0 if kinds == {True} else R.REST_LR))
        for p in g["params"]:
            assert (g["weight_decay"] > 0) == (p.ndim >= 2 and "embed" not in names[id(p)])
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
    frozen = R.param_groups(model, R.get_recipe("identity-gates"), lr=1e-2, weight_decay=0.1)
    assert all(R.is_gate_param(names[id(p)]) for g in frozen for p in g["params"])


def test_bad_recipes_fail_clearly():
    with pytest.raises(ValueError, match="unknown recipe 'nope'"):
        R.get_recipe("nope")
    with pytest.raises(ValueError, match="trains nothing"):
        R.Recipe("x", rest_lr=0.0, gate_lr=0.0).validate("x")
    with pytest.raises(ValueError, match="need a gate"):
        R.Recipe("x", gate=None, rest_lr=0.1, gate_l1=0.1).validate("x")
    with pytest.raises(ValueError, match="share of the steps"):
        R.Recipe("x", gates_first=1.5).validate("x")


# ---------------------------------------------------------------- the extra loss terms against plain references

def _tiny_gated(seed=0):
    from gated_attention.presets import model_config

    cfg = model_config("tiny", gate="sdpa_elementwise", num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2)
    return build_lm(cfg, seed=seed, eval=False).float()


def _assert_grads_close(g_fast, g_ref, **tol) -> int:
    """Both gradient lists reach the same parameters and agree there; returns how many of them are non-zero."""
    n = 0
    for a, b in zip(g_fast, g_ref):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, **tol)
            n += int(b.abs().sum() > 0)
    return n


def test_first_token_penalty_matches_eager_attention_in_value_and_gradient():
    from gated_attention.capture import capture

    model = _tiny_gated()
    ids = torch.randint(1, 128, (3, 20), generator=torch.Generator().manual_seed(0))

    tap = R.GradTap()
    with capture(model, tap):
        model(input_ids=ids)
    fast = R.first_token_attention(tap)
    g_fast = torch.autograd.grad(fast, list(model.parameters()), allow_unused=True)

    model.set_attn_implementation("eager")  # the plain reference: full softmax maps through output_attentions
    out = model(input_ids=ids, output_attentions=True)
    ref = torch.stack([a[:, :, 1:, 0].float().mean() for a in out.attentions]).mean()
    g_ref = torch.autograd.grad(ref, list(model.parameters()), allow_unused=True)

    assert float(fast.detach()) == pytest.approx(float(ref.detach()), rel=1e-5)
    n = _assert_grads_close(g_fast, g_ref, rtol=1e-4, atol=1e-7)
    assert n >= 4  # q/k projections, norms and embeddings receive the penalty's gradient


def test_gate_sparsity_term_matches_the_gate_modules_scores():
    from gated_attention.capture import capture

    model = _tiny_gated(1)
    ids = torch.randint(1, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    tap = R.GradTap()
    with capture(model, tap):
        model(input_ids=ids)
    fast = R.mean_gate_score(tap)
    g_fast = torch.autograd.grad(fast, list(model.parameters()), allow_unused=True)

    scores, hooks = [], []
    for layer in model.model.layers:  # reference: the score the gate module returns, read by a forward hook
        hooks.append(layer.self_attn.gate.register_forward_hook(lambda m, a, o: scores.append(o[1])))
    model(input_ids=ids)
    for h in hooks:
        h.remove()
    ref = torch.stack([s.float().mean() for s in scores]).mean()
    g_ref = torch.autograd.grad(ref, list(model.parameters()), allow_unused=True)
    assert float(fast.detach()) == pytest.approx(float(ref.detach()), rel=1e-6)
    _assert_grads_close(g_fast, g_ref)


def test_penalty_gradient_matches_a_finite_difference():
    """One scalar direction: d penalty / d eps of q_proj.weight + eps * D, central difference (float64 model; the
    penalty's softmax runs in fp32, hence eps 1e-4 and a 0.2 % tolerance: a wrong gradient is off by far more)."""
    from gated_attention.capture import capture

    model = _tiny_gated(2).double()
    ids = torch.randint(1, 128, (2, 10), generator=torch.Generator().manual_seed(2))
    w = model.model.layers[0].self_attn.q_proj.weight
    d = torch.randn(w.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)

    def pen():
        tap = R.GradTap()
        with capture(model, tap):
            model(input_ids=ids)
        return R.first_token_attention(tap)

    (g,) = torch.autograd.grad(pen(), [w])
    eps = 1e-4
    with torch.no_grad():
        w.add_(eps * d)
        hi = float(pen())
        w.sub_(2 * eps * d)
        lo = float(pen())
        w.add_(eps * d)
    assert float((g * d).sum()) == pytest.approx((hi - lo) / (2 * eps), rel=2e-3)


# ---------------------------------------------------------------- same batches, streaming, intervals

def test_control_and_recipes_see_the_same_batches(sink_start, tmp_path, monkeypatch):
    seen: dict[str, list] = {}
    real = S.SinkData.train_batch
    current = {}

    def spy(self, seed, step):
        b = real(self, seed, step)
        seen.setdefault(current["name"], []).append((step, b.clone()))
        return b

    monkeypatch.setattr(S.SinkData, "train_batch", spy)
    cfg = _cfg(sink_start, keep_models=False)
    for name in ("control", "bos-penalty", "identity-gates"):
        current["name"] = name
        retrofit_lab.train_unit(_job(cfg, sink_start, name, tmp_path / name))
    ref = seen["control"]
    assert [s for s, _ in ref] == list(range(6))
    for name in ("bos-penalty", "identity-gates"):
        assert len(seen[name]) == len(ref) and all(torch.equal(a, b) for (_, a), (_, b) in zip(seen[name], ref))
    current["name"] = "seed1"
    retrofit_lab.train_unit(_job(cfg, sink_start, "control", tmp_path / "s1", seed=1))
    assert not torch.equal(seen["seed1"][0][1], ref[0][1])  # another seed: another data order


def test_streaming_losses_read_the_streaming_lab():
    """K=0 evicts the first token, K=1 keeps it, full attention is the reference; all on the positions t >= W."""
    from gated_attention.decode import stream_nll

    model = _tiny_gated(3).eval()
    seqs = torch.randint(1, 128, (2, 15), generator=torch.Generator().manual_seed(4))  # (B, T+1)
    got = S.streaming_losses(model, seqs, 5)
    assert got["streaming_loss"] == pytest.approx(float(stream_nll(model, seqs, 5, 0)[:, 5:].mean()), rel=1e-6)
    assert got["streaming_loss_kept"] == pytest.approx(float(stream_nll(model, seqs, 5, 1)[:, 5:].mean()), rel=1e-6)
    assert got["window_full_loss"] == pytest.approx(float(stream_nll(model, seqs, None)[:, 5:].mean()), rel=1e-6)
    assert got["streaming_loss"] != got["window_full_loss"]


def test_target_check_at_its_thresholds():
    """Issue 21's target on hand-made records placed on both sides of each threshold (the values from THRESHOLDS)."""
    sink, margin, share = (t.value for t in retrofit_lab.THRESHOLDS)

    def entry(sinks, shares, bc, bg):
        recs = [{"sink_after": a, "step_share": b} for a, b in zip(sinks, shares)]
        return {"per_seed": recs, "mean": {"backcopy_ce_after": bc, "bigram_ce_after": bg}}

    control = entry([0.9], [share], 0.10, 3.20)
    ok = retrofit_lab.target_check(entry([sink, sink - 0.1], [share, share], 0.10 + margin, 3.20), control, "sink")
    assert ok["met"] and ok["sink_after_max"] == sink
    assert not retrofit_lab.target_check(entry([sink + 1e-3, 0.0], [share] * 2, 0.1, 3.2), control, "sink")["met"]
    assert not retrofit_lab.target_check(entry([0.0], [share + 0.01], 0.1, 3.2), control, "sink")["met"]
    worse = retrofit_lab.target_check(entry([0.0], [share], 0.1, 3.20 + margin + 1e-3), control, "sink")
    assert not worse["met"] and not worse["bigram_ce_after_within_margin"]
    assert not retrofit_lab.target_check(entry([0.0], [share], 0.1, 3.2), control, "text")["met"]  # sink lab only


# the stored form units' keys and lab.json "config" have always held (every option's name and default): a stored
# unit is reused only while its key reads the same
STORED_DEFAULTS = {"starts": [], "recipes": list(R.DEFAULT_RECIPES), "steps": None, "step_share": 0.25, "seeds": 1,
                   "lr": None, "batch_size": None, "warmup_frac": 0.05, "min_lr_frac": 0.1, "weight_decay": None,
                   "grad_clip": 1.0, "precision": "auto", "eval_every": None, "eval_size": 64,
                   "stream_window": None, "ckpt_every": 250, "keep_models": True, "data_dir": None, "seq_len": None}


def test_stored_form_reads_stored_units_and_sets_the_train_config():
    """The lab's settings under their stored names are those of units stored before (keys and defaults, in order);
    a stored form reads back into the same config; training settings land in the TrainConfig a unit trains with."""
    cfg = retrofit_lab.RetrofitLabConfig()
    assert list(cfg.settings().items()) == list(STORED_DEFAULTS.items())
    stored = {**STORED_DEFAULTS, "starts": ["a"], "steps": 7, "lr": 2e-3, "batch_size": 3, "weight_decay": 0.0,
              "grad_clip": 0.5, "precision": "fp32", "eval_every": 2, "ckpt_every": 4, "seq_len": 16}
    back = cfg.changed(**stored)
    assert back.settings() == stored and cfg.settings() == STORED_DEFAULTS  # a copy: the default is untouched
    plan = retrofit_lab.Plan(steps=7, lr=2e-3, batch_size=3, weight_decay=0.0, eval_every=2, window=4)
    t = retrofit_lab.unit_train_config(back, plan, R.get_recipe("identity-gates"), 16, 5, "fp32")
    assert (t.steps, t.lr, t.batch_size, t.weight_decay, t.grad_clip, t.ckpt_every, t.seq_len, t.seed, t.gate) == (
        7, 2e-3, 3, 0.0, 0.5, 4, 16, 5, R.get_recipe("identity-gates").gate)
    assert t.min_lr == pytest.approx(2e-4) and t.warmup_steps == 1 and t.eval_every == 0 and t.data_dir is None
    with pytest.raises(ValueError, match="unknown retrofit-lab setting"):
        cfg.changed(beta2=0.9)


def test_interval_uses_student_t():
    i = retrofit_lab.interval([1.0, 2.0, 3.0])
    assert i["mean"] == 2.0 and i["std"] == pytest.approx(1.0) and i["ci95"] == pytest.approx(4.303 / 3 ** 0.5,
                                                                                                rel=1e-4)
    assert retrofit_lab.interval([0.5])["ci95"] is None and retrofit_lab.interval([])["mean"] is None
    scipy_stats = need("scipy.stats", "pip install -e '.[dev]' (the Student-t table is checked against SciPy)")
    for n in (2, 5, 21):
        assert retrofit_lab.T95[n - 2] == pytest.approx(scipy_stats.t.ppf(0.975, n - 1), abs=2e-3)


def test_gate_split_on_hand_built_masks():
    g = torch.tensor([[[[0.1, 0.9], [0.2, 0.8], [0.3, 0.7], [0.4, 0.6]]]])  # (L=1, B=1, T=4, H=2)
    m = torch.tensor([[[[-1, 1, 0, 0], [-1, 0, 1, -1]]]], dtype=torch.int8)  # (L, B, H, T); -1: left out
    d, a = S._gate_split([g], [m])
    assert d == pytest.approx((0.2 + 0.7) / 2) and a == pytest.approx((0.3 + 0.4 + 0.8) / 3)


def test_start_masks_mark_parking_queries():
    """q = 0: uniform attention, 1/(t+1) on token 0: queries t < 3 are left out, every later one is active."""
    model = _tiny_gated(4).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.zero_()
    seqs = torch.randint(1, 128, (2, 9), generator=torch.Generator().manual_seed(5))
    (m,) = S.start_masks(model, [("d", seqs)])
    assert m.shape == (2, 2, 4, 8)  # (L, B, H, T)
    assert bool((m[..., :3] == -1).all()) and bool((m[..., 3:] == 0).all())


# ---------------------------------------------------------------- starting points

def test_start_resolution_and_clear_errors(sink_start, tmp_path, tiny_corpus):
    (s,) = S.resolve_starts([sink_start])
    assert s.kind == "sink" and s.label == "baseline_seed0" and s.trained_steps == 40 and s.task["vocab"] == 16
    assert s.model_dir == str(sink_start) and s.train_lr and s.batch_size
    bare = _sink_start(tmp_path / "old", model=False)
    with pytest.raises(ValueError, match="kept no model"):
        S.resolve_starts([bare])
    hf = tmp_path / "hf"
    import shutil

    shutil.copytree(sink_start, hf)
    (hf / "result.json").unlink()  # a plain HF folder now
    with pytest.raises(ValueError, match="needs --data-dir"):
        S.resolve_starts([hf])
    (t,) = S.resolve_starts([hf], data_dir=str(tiny_corpus))
    assert t.kind == "text" and t.source == "HF checkpoint" and t.seq_len == 256 and t.trained_steps is None
    with pytest.raises(ValueError, match="mixes"):
        S.resolve_starts([sink_start, hf], data_dir=str(tiny_corpus))
    two = S.resolve_starts([sink_start, sink_start])
    assert [x.label for x in two] == ["baseline_seed0", "baseline_seed0-2"]
    with pytest.raises(ValueError, match="not a folder"):
        S.resolve_starts([tmp_path / "missing"])
    # a whole sink-lab OUT: its ungated units only
    out = tmp_path / "lab"
    for seed in (0, 1):
        _sink_start(out, seed=seed)
        _sink_start(out, seed=seed, variant="sdpa_elementwise")
    logged = []
    assert [x.label for x in S.resolve_starts([out], log=logged.append)] == ["baseline_seed0", "baseline_seed1"]
    assert "2 ungated model(s) of 4" in logged[0]


def test_gated_start_is_refused(tmp_path):
    _tiny_gated().save_pretrained(tmp_path / "g")
    with pytest.raises(ValueError, match="already has gate"):
        S.build_model(str(tmp_path / "g"), None, "identity", 0)


# ---------------------------------------------------------------- the lab: JSON contract, reuse, resume

@pytest.fixture(scope="module")
def small_lab(sink_start, tmp_path_factory):
    root = sink_start.parent.parent.parent
    second = _sink_start(root, seed=1)
    out = tmp_path_factory.mktemp("retrofit_lab")
    cfg = _cfg(sink_start, starts=[str(sink_start), str(second)], recipes=["identity-gates", "bos-penalty"], seeds=2,
               keep_models=False)
    return out, cfg, retrofit_lab.run_lab(cfg, out, jobs=1, log=lambda m: None)


def test_lab_json_contract(small_lab):
    out, cfg, lab = small_lab
    disk = json.loads((out / "lab.json").read_text())
    assert disk["recipes"].keys() == lab["recipes"].keys() == {"identity-gates", "bos-penalty"}
    assert set(disk["start"]) == {"baseline_seed0", "baseline_seed1"}
    assert disk["start"]["baseline_seed0"]["before"]["sink"] is not None
    for entry in [disk["control"], *disk["recipes"].values()]:
        assert set(entry) >= {"per_seed", "mean", "std"}
        assert len(entry["per_seed"]) == 4  # 2 starts x 2 seeds
        assert sorted((r["start"], r["seed"]) for r in entry["per_seed"]) == [
            ("baseline_seed0", 0), ("baseline_seed0", 1), ("baseline_seed1", 0), ("baseline_seed1", 1)]
        for k in retrofit_lab.KEYS:
            assert k in entry["mean"] and k in entry["std"] and all(k in r for r in entry["per_seed"]), k
        assert entry["mean"]["steps"] == 6 and entry["per_seed"][0]["curve"]
        assert "steps_to_sink_target" in entry["mean"]
    assert disk["control"]["mean"]["gate_dormant"] is None  # no gate: null, not 0
    assert disk["recipes"]["identity-gates"]["mean"]["gate_dormant"] is not None
    r = disk["recipes"]["bos-penalty"]
    assert set(r["vs_control"]) == set(retrofit_lab.PAIRED) and r["vs_control"]["sink_after"]["n"] == 4
    assert set(r["target"]) >= {"sink_le_target", "steps_le_target", "met"}
    assert [t["name"] for t in disk["thresholds"]] == [t.name for t in retrofit_lab.THRESHOLDS]
    assert all(t["kind"] in ("paper", "published", "chosen") and t["source"] for t in disk["thresholds"])
    assert "Thresholds and where they come from" in (out / "report.md").read_text()
    assert r["per_seed"][0]["step_share"] == pytest.approx(6 / 40)
    from gated_attention.util.precision import resolve

    assert disk["config"]["precision"] == "auto" and disk["config"]["resolved_precision"] == resolve("auto", "cpu")
    assert disk["kind"] == "sink"
    # the sink before a gates-only retrofit cannot move: attention depends on frozen weights only
    for rec in disk["recipes"]["identity-gates"]["per_seed"]:
        assert rec["sink_after"] == pytest.approx(rec["sink_before"], abs=1e-6)
    for f in ("report.md", "report.html", "plots/learning_curves.png"):
        assert (out / f).stat().st_size > 0
    assert "data:image/png;base64," in (out / "report.html").read_text()


def test_rerun_reuses_and_other_settings_fail(small_lab, monkeypatch):
    out, cfg, lab = small_lab
    before = (out / "runs" / "baseline_seed0" / "control" / "seed0" / "result.json").read_text()
    monkeypatch.setattr(S, "build_model", lambda *a, **k: pytest.fail("a finished unit was retrained"))
    again = retrofit_lab.run_lab(cfg, out, jobs=1, log=lambda m: None)
    assert again["recipes"]["bos-penalty"]["mean"] == lab["recipes"]["bos-penalty"]["mean"]
    assert (out / "runs" / "baseline_seed0" / "control" / "seed0" / "result.json").read_text() == before
    with pytest.raises(ValueError, match="different settings"):
        retrofit_lab.run_lab(cfg.changed(lr=5e-3), out, jobs=1, log=lambda m: None)


def test_killed_unit_resumes_exactly(sink_start, tmp_path, monkeypatch):
    cfg = _cfg(sink_start, steps=8, ckpt_every=3, eval_every=4, keep_models=False)
    whole = retrofit_lab.train_unit(_job(cfg, sink_start, "warmup-penalty", tmp_path / "whole"))
    real = S.SinkData.train_batch

    def dying(self, seed, step):
        if step == 7:
            raise KeyboardInterrupt  # killed after the step-6 checkpoint
        return real(self, seed, step)

    monkeypatch.setattr(S.SinkData, "train_batch", dying)
    with pytest.raises(KeyboardInterrupt):
        retrofit_lab.train_unit(_job(cfg, sink_start, "warmup-penalty", tmp_path / "killed"))
    monkeypatch.setattr(S.SinkData, "train_batch", real)
    resumed = retrofit_lab.train_unit(_job(cfg, sink_start, "warmup-penalty", tmp_path / "killed"))
    assert not (tmp_path / "killed" / "checkpoints").exists()
    for k in ("sink_after", "skill_after", "gate_dormant", "gate_active", "streaming_loss_after", "final_train_loss"):
        assert resumed[k] == whole[k], k
    assert [p["step"] for p in resumed["curve"]] == [0, 4, 8]
    assert resumed["curve"] == whole["curve"]  # the recorder's state rode in the trainer's checkpoint


# ---------------------------------------------------------------- text starting points and the CLI

def test_text_start_from_a_training_run(tmp_path, tiny_corpus):
    """A training-run folder (train_config.json + final/): per-domain PPL, F-Attn, gate split from the start's
    attention; the gate's identity init leaves the skill unchanged at step 0."""
    from gated_attention.presets import model_config

    run = tmp_path / "run"
    build_lm(model_config("tiny", vocab_size=300)).save_pretrained(run / "final")
    (run / "train_config.json").write_text(json.dumps({"data": "corpus", "data_dir": str(tiny_corpus), "steps": 24,
                                                       "lr": 3e-3, "batch_size": 4, "seq_len": 32}))
    out = tmp_path / "lab"
    cfg = retrofit_lab.RetrofitLabConfig().changed(starts=[str(run / "final")], recipes=["identity-gates"],
                                                   eval_size=32, eval_every=3, keep_models=False,
                                                   ckpt_every=0).validate()
    lab = retrofit_lab.run_lab(cfg, out, jobs=1, log=lambda m: None)
    assert lab["kind"] == "text" and lab["config"]["plans"]["run"]["steps"] == 6  # 25 % of 24
    rec = lab["recipes"]["identity-gates"]["per_seed"][0]
    assert set(rec["ppl_after"]) == {"prose", "code"} and rec["skill_after"] == pytest.approx(
        sum(rec["ppl_after"].values()) / 2)
    assert rec["curve"][0]["skill"] == pytest.approx(rec["skill_before"], rel=1e-5)  # identity: unchanged at step 0
    assert rec["gate_dormant_start"] == pytest.approx(1.0) and rec["gate_active_start"] == pytest.approx(1.0)
    assert rec["sink_after"] == pytest.approx(rec["f_attn_after"]) and rec["streaming_loss_after"] > 0


def test_stock_llama_start_with_its_own_corpus(tmp_path, tiny_corpus):
    """The "bring your own checkpoint" path: a stock Llama folder + --data-dir; identity keeps its logits (the step-0
    skill equals the start's), the kept model is a native gated checkpoint."""
    import transformers

    from gated_attention.modeling import GatedQwen3ForCausalLM

    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    stock_lm(cfg).save_pretrained(tmp_path / "llama")
    with pytest.raises(ValueError, match="trained for are unknown; give --steps"):
        retrofit_lab.run_lab(retrofit_lab.RetrofitLabConfig().changed(
            starts=[str(tmp_path / "llama")], data_dir=str(tiny_corpus), seq_len=32, lr=1e-2), tmp_path / "x",
            log=lambda m: None)
    lab = retrofit_lab.run_lab(retrofit_lab.RetrofitLabConfig().changed(
        starts=[str(tmp_path / "llama")], recipes=["identity-gates"], steps=2, lr=1e-2, batch_size=2, eval_size=32,
        data_dir=str(tiny_corpus), seq_len=32, ckpt_every=0).validate(), tmp_path / "lab", log=lambda m: None)
    assert lab["start"]["llama"]["source"] == "HF checkpoint"
    rec = lab["recipes"]["identity-gates"]["per_seed"][0]
    assert rec["curve"][0]["skill"] == pytest.approx(rec["skill_before"], rel=1e-5)
    model = GatedQwen3ForCausalLM.from_pretrained(tmp_path / "lab" / "runs" / "llama" / "identity-gates" / "seed0" /
                                                  "model")
    assert model.config.gate == "sdpa_elementwise" and model.config.gate_init == "identity"


def test_cli_end_to_end_and_bad_input(sink_start, tmp_path, gattn_main):
    rc, out, err = gattn_main("lab", "retrofit", "--from", sink_start, "--recipes", "identity-gates", "--steps", "2",
                              "--eval-size", "4", "--stream-window", "8", "--batch-size", "2", "--jobs", "1",
                              "--no-keep-models", "--out", tmp_path / "o")
    assert rc == 0, err
    assert "identity-gates" in out and "control" in out and (tmp_path / "o" / "lab.json").exists()
    rc, out, err = gattn_main("lab", "retrofit", "--from", tmp_path / "nowhere", "--out", tmp_path / "o2")
    assert rc == 2 and "not a folder" in err and "Traceback" not in err
    rc, out, err = gattn_main("lab", "retrofit", "--from", sink_start, "--recipes", "nope", "--out", tmp_path / "o3")
    assert rc == 2 and "unknown recipe 'nope'" in err
