"""`gattn lab streaming`: model-folder resolution (sink-lab unit / sink-lab OUT / compare OUT / HF folder), the JSON
contract (models.NAME.full.{loss, ppl}, models.NAME.window.{K}.{loss, ppl}), its numbers against decode.stream_nll
computed by hand, a window that holds the whole sequence equals full attention, the report, and bad input."""
from __future__ import annotations

import json
import math

import pytest
import torch

from harness import tiny_lm


@pytest.fixture(scope="session")  # built once per worker (tests/conftest.py: scheduling)
def sink_units(tmp_path_factory):
    """A sink-lab OUT with two tiny finished units (baseline, G1 elementwise), trained for a few steps."""
    from gated_attention.labs.sinks import sink_lab

    out = tmp_path_factory.mktemp("sinklab")
    cfg = sink_lab.budget_config("small", steps=20, eval_every=20, variants=["baseline", "sdpa_elementwise"], seeds=1)
    for v in cfg.variants:
        sink_lab.train_unit((cfg.settings(), v, 0, str(out / "runs" / v / "seed0")))
    return out


@pytest.fixture(scope="session")  # built once per worker (tests/conftest.py: scheduling)
def compare_like(tmp_path_factory, tiny_corpus):
    """A compare-shaped OUT: runs/<variant>/final (a tiny LM over the corpus vocabulary) + train_config.json."""
    out = tmp_path_factory.mktemp("cmp")
    for v, gate in (("baseline", "baseline"), ("sdpa_elementwise", "sdpa_elementwise")):
        m = tiny_lm(gate, vocab_size=320, seed=1)
        m.save_pretrained(out / "runs" / v / "final")
        (out / "runs" / v / "train_config.json").write_text(json.dumps({"gate": v, "data_dir": str(tiny_corpus),
                                                                         "seq_len": 40}))
    return out


def test_resolution_and_labels(sink_units, compare_like):
    from gated_attention.labs.streaming.streaming_lab import resolve_models

    e = resolve_models([sink_units])
    assert [x.label for x in e] == ["baseline/seed0", "sdpa_elementwise/seed0"] and e[0].kind == "sink_lab"
    assert [x.label for x in resolve_models([sink_units / "runs" / "baseline" / "seed0"])] == ["baseline/seed0"]
    c = resolve_models([compare_like])
    assert [(x.label, x.kind, x.train_len) for x in c] == [("baseline", "text", 40), ("sdpa_elementwise", "text", 40)]
    assert [x.label for x in resolve_models([compare_like / "runs" / "baseline"])] == ["baseline"]
    assert [x.label for x in resolve_models([compare_like / "runs" / "baseline" / "final"])] == ["baseline"]
    with pytest.raises(ValueError, match="holds no model"):
        resolve_models([compare_like / "runs"])


def test_sink_lab_models_json_contract_and_numbers(sink_units, tmp_path):
    from gated_attention.decode import stream_nll
    from gated_attention.labs.sinks.stored import load_run
    from gated_attention.labs.streaming.streaming_lab import StreamingConfig, run_streaming, sink_lab_data

    W = 8
    cfg = StreamingConfig(models=[str(sink_units)], window=W, sink_tokens=[0, 2, 40], sequences=6)
    lab = run_streaming(cfg, tmp_path, log=lambda m: None)
    on_disk = json.loads((tmp_path / "lab.json").read_text())
    assert set(on_disk["models"]) == {"baseline/seed0", "sdpa_elementwise/seed0"}
    m = on_disk["models"]["baseline/seed0"]
    assert set(m["full"]) >= {"loss", "ppl", "per_position", "backcopy_ce", "bigram_ce"}
    assert set(m["window"]) == {"0", "2", "40"} and set(m["window"]["0"]) >= {"loss", "ppl", "per_position"}
    assert m["full"]["ppl"] == pytest.approx(math.exp(m["full"]["loss"]))
    # by hand: the same sequences, the same scored positions
    run = load_run(sink_units / "runs" / "baseline" / "seed0")
    seqs = sink_lab_data(run.task, 6, run.task.seq_len)
    want = float(stream_nll(run.model, seqs, W, 0)[:, W:].mean())
    assert m["window"]["0"]["loss"] == pytest.approx(want, rel=1e-6)
    assert len(m["window"]["0"]["per_position"]) == run.task.seq_len
    # K + W >= the sequence: nothing is ever evicted, so the window is full attention
    assert m["window"]["40"]["loss"] == pytest.approx(m["full"]["loss"], abs=1e-5)
    assert m["window"]["0"]["loss"] != pytest.approx(m["full"]["loss"], abs=1e-6)
    assert on_disk["by_variant"]["baseline"]["seeds"] == 1
    # the claims-table rule on the sink-lab models (labs/streaming/verdict.py), in lab.json and under the table
    from gated_attention.labs.streaming.verdict import model_costs, streaming_verdict

    costs, k = model_costs(on_disk["models"], "sink_lab")
    assert k == 40 and set(costs) == {"none", "sdpa_elementwise"} and set(on_disk["verdicts"]) == {"sink_lab"}
    assert on_disk["verdicts"]["sink_lab"]["verdict"] == streaming_verdict(costs, k)["verdict"]
    assert on_disk["verdicts"]["sink_lab"]["k"] == 40
    for f in ("report.md", "report.html", "plots/per_position_loss.png"):
        assert (tmp_path / f).stat().st_size > 0
    # the reuse rule (experiment.cache): a re-run reuses each model's measurement, another window stops the job
    lines = []
    again = run_streaming(cfg, tmp_path, log=lines.append)
    assert sum("reuse" in line for line in lines) == 2 and again["models"] == lab["models"]
    from gated_attention.experiment.cache import StaleResult

    with pytest.raises(StaleResult, match="window: saved 8 vs requested 9"):
        run_streaming(StreamingConfig(models=[str(sink_units)], window=9, sink_tokens=[0, 2, 40], sequences=6),
                      tmp_path, log=lambda m: None)
    assert "baseline/seed0" in (tmp_path / "report.md").read_text()
    assert "Verdict (the claims-table rule" in (tmp_path / "report.md").read_text()


def test_text_models_via_cli(compare_like, tmp_path, gattn_main):
    rc, out, err = gattn_main("lab", "streaming", "--models", compare_like, "--window", 10, "--sink-tokens", 0, 4,
                              "--sequences", 4, "--out", tmp_path)
    assert rc == 0, err
    lab = json.loads((tmp_path / "lab.json").read_text())
    assert set(lab["models"]) == {"baseline", "sdpa_elementwise"}
    m = lab["models"]["baseline"]
    assert m["seq_len"] == 40 and m["sequences"] == 4 and set(m["window"]) == {"0", "4"}
    assert "backcopy_ce" not in m["full"]
    assert "K=4" in out


def test_text_file(compare_like, tmp_path, tiny_corpus, gattn_main):
    text = tmp_path / "t.txt"
    text.write_text("the first of them and the other one was there when he said so " * 40)
    rc, _, err = gattn_main("lab", "streaming", "--models", compare_like / "runs" / "baseline", "--window", 6,
                            "--text", text, "--seq-len", 24, "--data-dir", tiny_corpus, "--out", tmp_path / "o")
    assert rc == 0, err
    lab = json.loads((tmp_path / "o" / "lab.json").read_text())
    assert lab["models"]["baseline"]["seq_len"] == 24


def test_bad_input(sink_units, tmp_path, gattn_main):
    rc, _, err = gattn_main("lab", "streaming", "--models", tmp_path, "--window", 4, "--out", tmp_path / "o")
    assert rc == 2 and "holds no model" in err
    rc, _, err = gattn_main("lab", "streaming", "--models", sink_units, "--window", 40, "--out", tmp_path / "o")
    assert rc == 2 and "no position past the window" in err
    rc, _, err = gattn_main("lab", "streaming", "--models", sink_units, "--window", 4, "--sink-tokens", 1, 1,
                            "--out", tmp_path / "o")
    assert rc == 2 and "distinct" in err
