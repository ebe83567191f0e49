"""The experiment toolkit on its own: the one reuse rule (cache.py), train_or_reuse / ensure_corpus / run_units
(runs.py), the report renderer (report.py) and the seed statistics (stats.py). The jobs' own tests show each job
handling a changed setting by the same rule."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from gated_attention.util.errors import UserError
from gated_attention.experiment import cache, pages, runs, stats


# ---------------------------------------------------------------- cache: the one reuse rule

def test_cached_computes_once_then_reuses(tmp_path):
    calls, lines = [], []
    path = tmp_path / "r.json"
    compute = lambda: calls.append(1) or {"value": 3.5}  # noqa: E731
    first = cache.cached(path, {"lr": 0.1, "shape": (2, 3)}, compute, lines.append, "[t]")
    again = cache.cached(path, {"lr": 0.1, "shape": [2, 3]}, compute, lines.append, "[t]")  # tuple == list
    assert calls == [1] and first == again == {"key": {"lr": 0.1, "shape": [2, 3]}, "value": 3.5}
    assert lines == [f"[t] reuse {path}"]
    assert json.loads(path.read_text()) == first  # strict JSON on disk, key included


def test_a_changed_setting_stops_before_any_work_and_names_it(tmp_path):
    path = tmp_path / "r.json"
    cache.cached(path, {"lr": 0.1, "steps": 5}, lambda: {"value": 1})
    before = path.read_bytes()
    with pytest.raises(cache.StaleResult) as err:
        cache.cached(path, {"lr": 0.2, "steps": 5}, lambda: pytest.fail("recomputed a stale result"))
    msg = str(err.value)
    assert "lr: saved 0.1 vs requested 0.2" in msg and "steps" not in msg
    assert "use a new --out, or delete" in msg and str(path) in msg
    assert path.read_bytes() == before  # nothing overwritten
    assert isinstance(err.value, UserError)  # the CLI prints it as one line and exits 2


def test_a_setting_added_later_counts_as_its_default(tmp_path):
    path = tmp_path / "r.json"
    cache.save(path, {"lr": 0.1}, {"value": 1})  # stored before `beta2` joined the key
    got = cache.load(path, {"lr": 0.1, "beta2": 0.95}, defaults={"beta2": 0.95})
    assert got["value"] == 1
    with pytest.raises(cache.StaleResult, match="beta2: saved 0.95 vs requested 0.9"):
        cache.load(path, {"lr": 0.1, "beta2": 0.9}, defaults={"beta2": 0.95})
    with pytest.raises(cache.StaleResult, match="beta2: saved null"):  # no default given: absent is not 0.95
        cache.load(path, {"lr": 0.1, "beta2": 0.95})


def test_a_changed_input_makes_the_result_obsolete_not_stale(tmp_path):
    path = tmp_path / "r.json"
    cache.cached(path, {"samples": 10, "model_mtime": 1.0}, lambda: {"v": 1}, inputs=("model_mtime",))
    lines = []
    got = cache.cached(path, {"samples": 10, "model_mtime": 2.0}, lambda: {"v": 2}, lines.append, "[t]",
                       inputs=("model_mtime",))  # the model was trained again: recompute, no question asked
    assert got["v"] == 2 and "earlier version of its input" in lines[0]
    with pytest.raises(cache.StaleResult, match="samples: saved 10 vs requested 20"):  # a setting still stops it
        cache.cached(path, {"samples": 20, "model_mtime": 3.0}, lambda: {"v": 3}, inputs=("model_mtime",))


def test_missing_or_unreadable_result_is_computed(tmp_path):
    path = tmp_path / "r.json"
    assert cache.load(path, {"a": 1}) is None
    path.write_text("{not json")  # a hand edit: writes are atomic, so nothing else makes one
    assert cache.load(path, {"a": 1}) is None
    assert cache.cached(path, {"a": 1}, lambda: {"v": 2})["v"] == 2


def test_check_takes_the_callers_own_differences(tmp_path):
    cache.check(tmp_path, {"a": 1}, {"a": 2}, diffs=[])  # the caller's comparison says: the same run
    with pytest.raises(cache.StaleResult, match=r"different settings \(gate: saved x vs requested y\)"):
        cache.check(tmp_path, {}, {}, diffs=["gate: saved x vs requested y"])


# ---------------------------------------------------------------- runs

def _finish(run_dir: Path, cfg, summary: dict) -> None:
    (run_dir / "final").mkdir(parents=True)
    (run_dir / "final" / "config.json").write_text("{}")
    (run_dir / "train_config.json").write_text(json.dumps(cfg.to_dict()))
    (run_dir / "summary.json").write_text(json.dumps(summary))


@pytest.fixture
def fake_trainer(monkeypatch):
    """trainer.train replaced by a recorder that writes a finished run; returns the list of calls."""
    from gated_attention.train import trainer

    calls = []

    def train(cfg, run_dir, resume=False, **kw):
        calls.append({"resume": resume, **kw})
        _finish(Path(run_dir), cfg, {"steps": cfg.steps, "trained": True})
        return {"steps": cfg.steps, "trained": True}

    monkeypatch.setattr(trainer, "train", train)
    return calls


def test_train_or_reuse_trains_then_reuses(tmp_path, fake_trainer):
    from gated_attention.train.train_presets import tiny

    cfg = tiny()
    lines = []
    assert runs.train_or_reuse(cfg, tmp_path / "run", lines.append, "[t]")["trained"]
    assert runs.train_or_reuse(cfg, tmp_path / "run", lines.append, "[t]")["trained"]
    assert fake_trainer == [{"resume": False, "overwrite": True}]
    assert lines[-1] == f"[t] {cfg.gate}: reuse finished run {tmp_path / 'run'}"


def test_train_or_reuse_resumes_an_interrupted_run(tmp_path, fake_trainer, monkeypatch):
    from gated_attention.train import checkpoint
    from gated_attention.train.train_presets import tiny

    cfg = tiny()
    run = tmp_path / "run"
    run.mkdir()
    (run / "train_config.json").write_text(json.dumps(cfg.to_dict()))
    monkeypatch.setattr(checkpoint, "latest_checkpoint", lambda d: Path(d) / "checkpoints" / "step_00000004")
    runs.train_or_reuse(cfg, run, lambda m: None, step_hook=print)
    assert fake_trainer == [{"resume": True, "overwrite": True, "step_hook": print}]


def test_train_or_reuse_refuses_other_settings(tmp_path, fake_trainer):
    from dataclasses import replace

    from gated_attention.train.train_presets import tiny

    cfg = tiny()
    _finish(tmp_path / "run", cfg, {"steps": cfg.steps})
    with pytest.raises(cache.StaleResult, match=rf"different settings \(steps: saved {cfg.steps} vs requested 99\)"):
        runs.train_or_reuse(replace(cfg, steps=99), tmp_path / "run")
    runs.train_or_reuse(replace(cfg, progress=not cfg.progress), tmp_path / "run")  # does not change the numbers
    runs.train_or_reuse(replace(cfg, gate="none" if cfg.gate == "baseline" else cfg.gate), tmp_path / "run")
    assert fake_trainer == []


def test_train_or_reuse_keys_the_run_on_the_callers_settings(tmp_path, fake_trainer):
    """A lab unit's run depends on more than its TrainConfig: `key` is stored beside it under the same rule (another
    setting stops the job before anything runs; an earlier input makes the run obsolete: it starts over)."""
    from gated_attention.train.train_presets import tiny

    cfg, run = tiny(), tmp_path / "run"
    key = {"task": {"vocab": 16}, "start": "mtime 1"}
    runs.train_or_reuse(cfg, run, lambda m: None, key=key, inputs=("start",))
    assert json.loads((run / "unit_key.json").read_text())["key"] == key
    runs.train_or_reuse(cfg, run, lambda m: None, key=key, inputs=("start",))  # reused
    assert len(fake_trainer) == 1
    with pytest.raises(cache.StaleResult, match=r"task: saved \{\"vocab\": 16\} vs requested \{\"vocab\": 8\}"):
        runs.train_or_reuse(cfg, run, lambda m: None, key={**key, "task": {"vocab": 8}}, inputs=("start",))
    (run / "stale_marker").write_text("x")
    lines = []
    runs.train_or_reuse(cfg, run, lines.append, "[t]", key={**key, "start": "mtime 2"}, inputs=("start",))
    assert len(fake_trainer) == 2 and not (run / "stale_marker").exists()  # trained again from scratch
    assert "earlier version of its input" in lines[0]
    assert json.loads((run / "unit_key.json").read_text())["key"]["start"] == "mtime 2"


def test_ensure_corpus_prepares_only_a_missing_corpus(tmp_path, monkeypatch):
    from gated_attention import data

    seen = []
    monkeypatch.setattr(data, "prepare", lambda cfg: seen.append((cfg.data_dir, cfg.vocab_size)))
    lines = []
    assert runs.ensure_corpus(tmp_path / "d", 1024, lines.append, "[t]") == tmp_path / "d"
    assert seen == [(str(tmp_path / "d"), 1024)] and "gattn data prepare" in lines[0]
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "manifest.json").write_text("{}")
    runs.ensure_corpus(tmp_path / "d", 1024, lines.append)
    assert len(seen) == 1


def test_run_units_in_process_keeps_order_and_checks_jobs():
    assert runs.run_units(math.factorial, [3, 0, 5], jobs=1) == [6, 1, 120]
    with pytest.raises(ValueError, match="--jobs must be >= 1"):
        runs.run_units(math.factorial, [1], jobs=0)
    assert 1 <= runs.default_jobs() <= 2 and runs.cores() >= 1


@pytest.mark.slow  # spawned workers import torch (~25 s on one core); the labs' and longctx's --jobs 2 tests run them too
def test_run_units_in_workers_keeps_order_and_reraises():
    assert runs.run_units(math.factorial, [4, 2, 3], jobs=2) == [24, 2, 6]
    lines = []
    with pytest.raises(ValueError, match="factorial"):
        runs.run_units(math.factorial, [3, -1], jobs=2, log=lines.append)
    assert any("a unit failed" in line for line in lines)


# ---------------------------------------------------------------- report

def test_report_renders_markdown_and_self_contained_html(tmp_path):
    import struct
    import zlib

    def png() -> bytes:  # a valid 1x1 PNG, no plotting library needed
        def chunk(kind, data):
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0))
                + chunk(b"IDAT", zlib.compress(b"\x00\xff\x00\x00")) + chunk(b"IEND", b""))

    (tmp_path / "plots").mkdir()
    (tmp_path / "plots" / "a.png").write_bytes(png())
    blocks = [("h2", "Results"), ("p", "Budget `small`, a < b, **reproduced**"), ("ul", ["one", "two"]),
              ("table", ["model", "loss"], [["base", "1.00"], ["<gated>", "0.90"]]), ("code", "x < 1"),
              ("img", "Loss", "plots/a.png")]
    md_path, html_path = pages.write(tmp_path, "Title & more", blocks)
    md, page = md_path.read_text(), html_path.read_text()
    assert md.startswith("# Title & more\n") and "| model | loss |\n|---|---|\n| base | 1.00 |" in md
    assert "- one\n- two" in md and "![Loss](plots/a.png)" in md and "**reproduced**" in md
    assert "<code>small</code>" in page and "<strong>reproduced</strong>" in page and "a &lt; b" in page
    assert "<td>&lt;gated&gt;</td>" in page and "<li>one</li>" in page and "src=\"data:image/png;base64," in page
    assert "plots/a.png" not in page  # nothing linked: the page is one file
    with pytest.raises(ValueError, match="unknown report block 'chart'"):
        pages.render("t", [("chart", 1)], tmp_path)
    plots = {"loss": "plots/a.png", "gates": "plots/b.png"}
    assert pages.figures(plots, "Curves") == [("img", "Curves", "plots/a.png"), ("img", "Curves", "plots/b.png")]
    assert pages.figures(plots, {"loss": "Loss"}) == [("img", "Loss", "plots/a.png"), ("img", "gates", "plots/b.png")]


def test_html_tables_read_text_from_the_left_and_figures_from_the_right():
    """A column of figures (numbers, intervals, per-seed lists, missing values) is right-aligned; a column with words
    in it reads from the left; a '|' inside a markdown cell stays inside it."""
    head = ["Variant", "F-Attn", "note", "seeds"]
    rows = [["baseline", "0.045 [0.040, 0.050]", "no sink", "100 / 101"],
            ["gated", "–", "a | b", "1.07×"]]
    assert pages.numeric_columns(rows) == [False, True, False, True]
    page = pages.html_table(head, rows)
    assert '<th class="num">F-Attn</th>' in page and "<td>baseline</td>" in page
    assert '<td class="num">0.045 [0.040, 0.050]</td>' in page and "<td>no sink</td>" in page
    assert "td" in pages.CSS and ".num{text-align:right" in pages.CSS and "text-align:left" in pages.CSS
    assert "| gated | – | a \\| b | 1.07× |" in pages.md_table(head, rows)


def test_number_formats_and_text_table():
    assert [pages.fmt(v, 2) for v in (None, True, 1234, 1.5, float("nan"))] == ["–", "True", "1234.00", "1.50", "nan"]
    assert pages.fmt(1234, 0) == "1,234"
    assert pages.fmt_mean_std(0.5, 0.01) == "0.500 ± 0.010" and pages.fmt_mean_std(0.5, None) == "0.500"
    assert pages.fmt_mean_std(None, None) == "–"
    assert pages.text_table(["a", "bb"], [["xyz", "1"]]).splitlines() == ["a    bb", "-------", "xyz   1"]


# ---------------------------------------------------------------- stats: one-seed convention

def test_one_seed_has_no_spread_and_missing_values_are_skipped():
    mean, std = stats.mean_std([{"a": 1.0, "b": None}, {"a": 3.0, "b": float("nan")}, {"a": None}], ["a", "b"])
    assert mean == {"a": 2.0, "b": None} and std["a"] == pytest.approx(math.sqrt(2)) and std["b"] is None
    one = stats.spread([0.7])
    assert one == {"mean": 0.7, "std": None, "min": 0.7, "max": 0.7, "n": 1}
    assert stats.spread([None])["n"] == 0 and stats.spread([])["mean"] is None


def test_seed_curves_average_each_step_over_the_seeds_that_measured_it():
    variants = {"a": {"per_seed": [{"curve": [{"step": 0, "x": 1.0}, {"step": 10, "x": 3.0}]},
                                   {"curve": [{"step": 0, "x": 2.0}, {"step": 10, "x": None}, {"step": 20, "x": 5.0}]},
                                   {}]},
                "b": {"per_seed": [{"curve": [{"step": 0, "y": 1.0}]}]}}
    curves = stats.seed_curves(variants, "x")
    assert curves["a"] == ([0, 10, 20], [1.5, 3.0, 5.0], [1.0, 3.0, 5.0], [2.0, 3.0, 5.0])
    assert curves["b"] == ([], [], [], [])  # no seed measured x: an empty curve, still one entry per variant


def test_wilson_interval_is_honest_at_the_edges():
    lo, hi = stats.wilson(0, 30)
    assert lo == 0.0 and 5 < hi < 15
    lo, hi = stats.wilson(30, 30)
    assert hi == 100.0 and 85 < lo < 95
    assert stats.wilson(0, 0) == (0.0, 100.0)
