"""experiment/study.py on its own: a lab's generated options (each budget's value stated in the help), the shared
step-hook Recorder (curve every N steps and at the last, trailing windows, CPU and wall time carried over a resume
through its state), stored settings and their changes (by where they live or by stored name), an invocation's begin and
save_lab, finish_unit and Units. The labs' own tests run each lab through it end to end."""
from __future__ import annotations

import argparse
import json

import pytest

from gated_attention.experiment import cache, study
from gated_attention.experiment.study import Budget, Option, Recorder, Study, options


def _parser(opts, budgets=None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    Study("x", "a lab", lambda: opts, lambda a: 0, (lambda: budgets) if budgets else None).configure(p)
    return p


def test_options_state_each_budgets_value_in_the_help():
    budgets = {"small": Budget("tiny", {"steps": 60, "compile": False, "lr": 0.01}),
               "default": Budget("full", {"steps": 800, "compile": True, "lr": 0.01})}
    opts = [options.budget(budgets),
            Option(("--steps",), "steps per unit", {"type": int, "default": None}, lambda b: b.changes["steps"]),
            Option(("--compile",), "compile", {"action": argparse.BooleanOptionalAction, "default": None},
                   lambda b: b.changes["compile"]),
            Option(("--lr",), "peak LR", {"type": float, "default": None}, lambda b: b.changes["lr"]),
            Option(("--plain",), "no budget sets it", {"default": None})]
    helps = {a.dest: a.help for a in _parser(opts, budgets)._actions}
    assert helps["steps"] == "steps per unit (default: 60 with --budget small; 800 with --budget default)"
    assert helps["compile"] == "compile (default: off with --budget small; on with --budget default)"
    assert helps["lr"] == "peak LR (default 0.01)"  # one value in every budget: stated once
    assert helps["plain"] == "no budget sets it"
    assert "small: tiny; default: full (default: default)" == helps["budget"]


def test_shared_options_parse_as_the_labs_document_them():
    p = _parser([options.out("runs/lab/x", "lab.json"), options.seeds("seeds"), options.jobs(),
                 options.sets("gate is the lab's"), options.variants("gates", ("baseline", "g1")),
                 options.precision("auto"), options.report_only("report only")])
    a = p.parse_args([])
    assert (a.out, a.seeds, a.jobs, a.sets, a.variants, a.precision, a.report_only) == \
        ("runs/lab/x", None, None, [], ["baseline", "g1"], "auto", False)
    a = p.parse_args(["--set", "lr=1", "--set", "model.x=2", "--seeds", "3", "--jobs", "2", "--variants", "g1",
                      "--precision", "fp32", "--report-only"])
    assert (a.sets, a.seeds, a.jobs, a.variants, a.precision, a.report_only) == \
        (["lr=1", "model.x=2"], 3, 2, ["g1"], "fp32", True)


class _Count(Recorder):
    """A curve point is the model's value at that step; every step's value also goes to a trailing window."""

    def point(self, step, model):
        return {"step": step, "value": model["v"]}

    def after_step(self, steps_done, model):
        self.trail("recent", model["v"], keep=3)
        return "stop" if model["v"] < 0 else None


def _train(rec: Recorder, steps: range, model: dict) -> list:
    reasons = []
    for s in steps:
        model["v"] = s * 10
        reasons.append(rec(s, model))
    return reasons


def test_recorder_curve_windows_and_a_resume_from_its_state():
    whole = _Count(every=4, steps=10)
    whole.begin({"v": 0})
    assert _train(whole, range(1, 11), {}) == [None] * 10
    assert [p["step"] for p in whole.state["curve"]] == [0, 4, 8, 10]  # every 4 steps, and the last one
    assert whole.state["recent"] == [80, 90, 100]

    first = _Count(every=4, steps=10)  # killed after step 5: a fresh recorder resumes from its state
    first.begin({"v": 0})
    _train(first, range(1, 6), {})
    saved = json.loads(json.dumps(first.state_dict()))  # the state as the checkpoint stores it
    resumed = _Count(every=4, steps=10)
    resumed.load_state_dict(saved)
    _train(resumed, range(6, 11), {})
    assert resumed.state["curve"] == whole.state["curve"] and resumed.state["recent"] == whole.state["recent"]
    assert resumed.cpu_s() >= saved["cpu"] and resumed.wall_s() >= saved["wall"]  # time carried over the resume
    assert _Count(every=0, steps=3)(1, {"v": -1}) == "stop"  # after_step's reason reaches the trainer
    none = _Count(every=0, steps=3)
    none.begin({"v": 1})
    _train(none, range(1, 4), {})
    assert none.state["curve"] == []  # every=0: no curve


def test_finish_unit_stores_the_result_and_drops_the_trainer_folders(tmp_path):
    for d in ("checkpoints/step_1", "final"):
        (tmp_path / d).mkdir(parents=True)
    out = study.finish_unit(tmp_path, {"lr": 0.1, "shape": (2,)}, {"loss": 1.5})
    assert out == {"key": {"lr": 0.1, "shape": [2]}, "loss": 1.5}
    assert cache.load(tmp_path / "result.json", {"lr": 0.1, "shape": [2]}) == out
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "final").exists()


def test_units_train_only_the_unfinished_ones_and_keep_unit_order():
    ran = []
    units = study.Units(lambda u: ran.append(u) or u * 2, [1, 2, 3, 4], [None, "kept", None, "kept too"])
    assert units.pending() == [1, 3]
    assert units.run(1, print) == [2, "kept", 6, "kept too"] and ran == [1, 3]
    assert units.results(["a", "b"]) == ["a", "kept", "b", "kept too"]  # fresh results from another job's pool
    with pytest.raises(ValueError, match="more fresh results"):
        units.results(["a", "b", "c"])


def test_stored_settings_and_changes_reach_the_axis_the_model_and_the_train_config():
    """One table maps stored names to a lab axis, a model-config field or a TrainConfig field: settings are read from
    where they live, a change lands there (on a copy), and a name that is none of the three fails naming the lab."""
    from dataclasses import dataclass, field

    from gated_attention.train.config import TrainConfig

    @dataclass
    class Lab:
        seeds: int = 2
        model: dict = field(default_factory=lambda: {"hidden_size": 32})
        train: TrainConfig = field(default_factory=lambda: TrainConfig(steps=10, lr=1e-3))

    table = {"seeds": "seeds", "width": "model.hidden_size", "steps": "steps", "peak": "lr"}
    lab = Lab()
    assert study.stored_settings(lab, table) == {"seeds": 2, "width": 32, "steps": 10, "peak": 1e-3}
    new = study.with_changes(lab, {"seeds": 3, "model.hidden_size": 64, "lr": 2e-3, "beta2": 0.9}, "toy")
    assert study.stored_settings(new, table) == {"seeds": 3, "width": 64, "steps": 10, "peak": 2e-3}
    assert new.train.beta2 == 0.9 and lab.train.beta2 != 0.9 and lab.model["hidden_size"] == 32  # lab untouched
    with pytest.raises(ValueError, match=r"unknown toy setting 'nope'.*seeds"):
        study.with_changes(lab, {"nope": 1}, "toy")
    # by stored names: each lands where the table says; a name outside the table fails naming the valid ones
    by_name = study.with_stored(lab, {"width": 48, "peak": 5e-3}, table, "toy")
    assert study.stored_settings(by_name, table) == {"seeds": 2, "width": 48, "steps": 10, "peak": 5e-3}
    with pytest.raises(ValueError, match=r"unknown toy setting\(s\) \['lr'\]; valid: seeds, width, steps, peak"):
        study.with_stored(lab, {"lr": 1.0}, table, "toy")


def test_begin_validates_before_writing_and_save_lab_writes_plots_lab_json_and_report(tmp_path):
    """begin: a config that fails validation leaves no OUT behind; save_lab: lab.json names the plots relative to OUT
    and the report is written after lab.json (it may read it)."""
    class Bad:
        def validate(self):
            raise ValueError("bad setting")

    class Good:
        def validate(self):
            return self

    with pytest.raises(ValueError, match="bad setting"):
        study.begin(Bad(), tmp_path / "bad")
    assert not (tmp_path / "bad").exists()
    out, clock = study.begin(Good(), tmp_path / "lab")
    assert out.is_dir() and set(clock.times()) == {"wall_time_s", "cpu_time_s"}

    def plots(folder):
        folder.mkdir()
        (folder / "a.png").write_bytes(b"png")
        return {"a": folder / "a.png"}

    seen = []
    lab = study.save_lab(out, {"x": 1}, plots, lambda: seen.append(json.loads((out / "lab.json").read_text())))
    assert lab == {"x": 1, "plots": {"a": "plots/a.png"}} and seen == [lab]
