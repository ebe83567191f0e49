"""The scaling lab's recipe pilot: each candidate recipe changes what it says (measured on the built config and model),
the adoption rule on both sides of its bar, the pilot's seeds apart from the tuning and confirm seeds, and a decision
that is blind to Δ (shifting one arm's losses changes nothing). The pilot's flow runs on a stand-in unit whose
seed-to-seed spread is a known function of the recipe."""
from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from gated_attention.labs.scaling import recipe_pilot as rp
from gated_attention.labs.scaling import scaling_lab as sl


def _unit_cfg(tiny_corpus, recipe="current", lr=0.01, seed=200):
    lab = sl.LabConfig().changed(budget="quick", data_dir=str(tiny_corpus))
    size = lab.spec.sizes[-1]
    info = sl.size_info(lab.spec, size, 1024, lab.tpp())
    return sl.train_config(lab, "baseline", size, info, lr, seed, recipe), size


def test_each_recipe_changes_what_it_says(tiny_corpus):
    cfg, size = _unit_cfg(tiny_corpus)
    b2, _ = _unit_cfg(tiny_corpus, "beta2-0.99")
    assert b2.beta2 == 0.99 and b2.to_dict() | {"beta2": cfg.beta2} == cfg.to_dict()
    wu, _ = _unit_cfg(tiny_corpus, "warmup-10")
    assert wu.warmup_steps == max(5, round(0.10 * cfg.steps)) and wu.steps == cfg.steps
    big, _ = _unit_cfg(tiny_corpus, "batch-x2")
    assert big.batch_size == 2 * cfg.batch_size
    assert abs(big.steps * big.batch_size - cfg.steps * cfg.batch_size) <= big.batch_size  # the same tokens
    assert big.lr == pytest.approx(cfg.lr * math.sqrt(2)) and big.min_lr == pytest.approx(cfg.min_lr * math.sqrt(2))
    fan, _ = _unit_cfg(tiny_corpus, "init-fan-in")
    assert fan.to_dict() | {"model_overrides": cfg.model_overrides} == cfg.to_dict()


def test_the_budgets_recipe_reaches_every_unit(tiny_corpus):
    """The default ladder trains under the recipe its pilot adopted, the quick one under the base recipe; --recipe
    overrides either, and the unit's folder names the recipe."""
    assert sl.BUDGETS["default"].recipe == "init-fan-in" and sl.BUDGETS["quick"].recipe == "current"
    lab = sl.LabConfig().changed(budget="quick", data_dir=str(tiny_corpus), recipe="init-fan-in").validate()
    size = lab.spec.sizes[0]
    cfg = sl.train_config(lab, "baseline", size, sl.size_info(lab.spec, size, 1024, 2.0), 0.01, 100)
    assert cfg.model_overrides["initializer_range"] == pytest.approx(1 / math.sqrt(size.hidden))
    assert sl.unit_name("baseline", "d8l1", 0.01, 100, lab.recipe_name()).endswith("_s100_r-init-fan-in")
    with pytest.raises(ValueError, match="unknown --recipe"):
        sl.LabConfig().changed(recipe="bigger").validate()


def test_fan_in_init_sets_the_weights_std(tiny_corpus):
    """The built model's projection weights have std ~ 1/sqrt(hidden) under init-fan-in and ~ 0.02 under the current
    recipe: measured on the model, not read from the config."""
    import torch
    from harness import build_lm

    from gated_attention.presets import model_config

    stds = {}
    for name in ("current", "init-fan-in"):
        c, size = _unit_cfg(tiny_corpus, name)
        model = build_lm(model_config(c.model, gate="none", vocab_size=1024, **c.model_overrides))
        w = torch.cat([p.detach().flatten() for n, p in model.named_parameters() if n.endswith("proj.weight")])
        stds[name] = float(w.std())
    assert stds["current"] == pytest.approx(0.02, rel=0.1)
    assert stds["init-fan-in"] == pytest.approx(1 / math.sqrt(size.hidden), rel=0.1)


@pytest.mark.parametrize("sd,want", [
    ({"current": 0.10, "a": 0.050, "b": 0.08}, "a"),        # exactly half: adopted
    ({"current": 0.10, "a": 0.051, "b": 0.08}, None),       # just short of half: kept
    ({"current": 0.10, "a": 0.040, "b": 0.030}, "b"),       # two pass: the smaller spread
    ({"current": None, "a": 0.01}, None),                   # no reference: no decision
])
def test_adoption_rule_on_both_sides_of_its_bar(sd, want):
    assert rp.judge(sd)[0] == want


def _pilot(tiny_corpus, tmp_path, monkeypatch, offset=0.0):
    """The pilot on a stand-in unit: loss = 3 + a bowl in log LR + seed noise x spread(recipe), + offset for the gated
    arm. beta2 0.99 has 0.4x the spread, every other recipe 1x."""
    ran = []

    def fake_unit(task):
        cfg, run_dir, *_ = task
        ran.append((cfg["gate"], cfg["lr"], cfg["seed"], run_dir))
        spread = 0.4 if cfg["beta2"] == 0.99 else 1.0
        noise = [0.03, -0.02, 0.05, -0.04][cfg["seed"] % 4] * spread
        loss = 3.0 + math.log2(cfg["lr"] / 0.02) ** 2 * 0.01 + noise + (offset if cfg["gate"] != "none" else 0)
        return {"val_loss": loss, "val_loss_per_domain": {"a": loss}, "cpu_s": 1.0}

    monkeypatch.setattr(sl, "train_unit", fake_unit)
    lab = sl.LabConfig().changed(out=str(tmp_path / "lab"), budget="quick", variants=("baseline", "sdpa_elementwise"),
                                 data_dir=str(tiny_corpus), pilot_pairs=4, max_pairs=4)
    return sl.recipe_pilot(lab, "d16l1", log=lambda m: None), ran


def test_pilot_adopts_the_recipe_that_halves_the_spread_on_its_own_seeds(tiny_corpus, tmp_path, monkeypatch):
    res, ran = _pilot(tiny_corpus, tmp_path, monkeypatch)
    assert res["adopted"] == "beta2-0.99" and res["seeds"] == [200, 201, 202, 203]
    assert set(res["seeds"]).isdisjoint(res["tuning_seeds"]) and set(res["seeds"]).isdisjoint(range(100, 104))
    pilot = [r for r in ran if r[2] >= rp.PILOT_FROM]
    assert {r[1] for r in pilot if "batch-x2" not in r[3]} == {0.02}  # every arm at the baseline's tuned LR
    assert {r[2] for r in ran if r[2] < rp.PILOT_FROM} == {0}  # the tuning sweep, baseline only
    assert len(pilot) == len(rp.RECIPES) * 2 * 4 and any(r[3].endswith("_r-beta2-0.99") for r in pilot)
    row = {r["name"]: r for r in res["recipes"]}
    assert row["beta2-0.99"]["ratio_to_current"] == pytest.approx(0.4)
    assert json.loads((tmp_path / "lab" / "recipe_pilot.json").read_text())["adopted"] == "beta2-0.99"


def test_pilot_decision_is_blind_to_delta(tiny_corpus, tmp_path, monkeypatch):
    """Moving the gated arm's losses by 0.5 nats (a huge Δ) leaves every recipe's spread and the decision alone."""
    a, _ = _pilot(tiny_corpus, tmp_path / "a", monkeypatch)
    b, _ = _pilot(tiny_corpus, tmp_path / "b", monkeypatch, offset=0.5)
    assert a["decision"] == b["decision"]
    assert [r["within_sd"] for r in a["recipes"]] == pytest.approx([r["within_sd"] for r in b["recipes"]])


def test_pilot_refuses_seeds_that_tune_or_confirm(tiny_corpus, tmp_path):
    lab = sl.LabConfig().changed(out=str(tmp_path / "lab"), budget="quick", data_dir=str(tiny_corpus),
                                 confirm_seeds=(200, 201, 202))
    with pytest.raises(ValueError, match="also tuning or confirm seeds"):
        sl.recipe_pilot(replace(lab, variants=("baseline",)), "d8l1", log=lambda m: None)
