"""`gattn compare`'s report from a compare.json, no training: it leads with the findings and the setup, every
per-variant figure is the mean over seeds with its interval (per-seed values beside), `--report-only` re-renders the
committed result, the README's excerpt is generated from that result, and the plots' texts collide nowhere (checked
with the renderer's own boxes; a slow test renders the html in headless Chromium)."""
from __future__ import annotations

import copy
import json
import math
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from gated_attention import cli
from gated_attention.compare import claims as C
from gated_attention.compare import compare_report as R
from gated_attention.compare import seeds as S
from gated_attention.experiment import pages

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "results" / "main_job_shared_lr"
T975_2 = 4.302653  # Student's t, 97.5 % quantile, 2 degrees of freedom (printed tables): the oracle of 3-seed intervals


def _committed() -> dict:
    return json.loads((COMMITTED / "compare.json").read_text(encoding="utf-8"))


def _three_seeds(result: dict) -> dict:
    """The committed result as a run that analysed every seed: seed k's figures are seed 0's plus k x a step, and the
    plot data a run writes (two-layer maps, a gate histogram, loss curves per seed)."""
    res = copy.deepcopy(result)
    for i, (v, row) in enumerate(res["rows"].items()):
        by = {}
        for k in range(3):
            r = {key: x for key, x in row.items() if key not in ("by_seed", "over_seeds")}
            r["f_attn"] = 0.04 + 0.01 * k
            r["m_act"] = 2.0 + k
            r["gate_near_zero"] = None if v == "baseline" else 0.1 * (k + 1)
            r["val_ppl"] = {d: p + k for d, p in row["val_ppl"].items()}
            r["per_layer"] = {"f_attn": [0.04 + 0.01 * k, 0.05], "m_act": [1.0 + k, 2.0], "gate_mean": [None, None]}
            by[str(k)] = r
        row.update(by["0"], by_seed=by)
        row["over_seeds"] = S.summarize(row)
    n, edges = 64, [-0.5 + 0.02 * i for i in range(126)]
    tri = [[(1.0 / (q + 1) if k <= q else 0.0) for k in range(n)] for q in range(n)]
    curve = lambda k: {"step": list(range(0, 1176, 4)), "loss": [4 + 3 * math.exp(-s / 80) + 0.01 * k
                                                                  for s in range(0, 1176, 4)], "spikes": []}
    res["plot_data"] = {"loss": {v: {str(k): curve(k) for k in range(3)} for v in res["rows"]},
                        "gates": {v: {"edges": edges, "counts": [i % 7 for i in range(125)]}
                                  for v in res["rows"] if v != "baseline"},
                        "maps": {v: {"0": tri, "1": tri} for v in res["rows"]}, "map_seed": 0}
    res["provenance"] = {"cpu": "Test CPU (AMX)", "threads": 2, "cores": 2}
    return res


def test_every_figure_is_the_mean_over_seeds_with_its_interval():
    res = _three_seeds(_committed())
    head, rows = R._table4_cells(res)
    fa = rows[0][head.index("F-Attn")]
    half = T975_2 * statistics.stdev([0.04, 0.05, 0.06]) / math.sqrt(3)
    assert fa == f"0.050 [{0.05 - half:.3f}, {0.05 + half:.3f}]" == "0.050 [0.025, 0.075]"
    val = _committed()["rows"]["baseline"]["val_loss_by_seed"].values()
    m, h = statistics.fmean(val), T975_2 * statistics.stdev(val) / math.sqrt(3)
    assert rows[0][head.index("Val loss (nats)")] == f"{m:.3f} [{m - h:.3f}, {m + h:.3f}]"
    # the per-seed table lists what the means summarise, seed by seed, under the seeds' own numbers
    head, rows = R._per_seed_cells(res)
    assert [r[1] for r in rows[:3]] == ["100", "101", "102"]
    assert [r[head.index("F-Attn")] for r in rows[:3]] == ["0.040", "0.050", "0.060"]
    # per domain and per layer too; the claims read the means (M-Act 3.0 for every variant: nothing reduced)
    head, rows = R._domain_cells(res)
    assert "[" in rows[0][1] and R._layer_cells(res)[1][0][2] == "0.050 [0.025, 0.075]"
    row = {c["claim"]: c for c in C.claims_table(res, None)}["Massive activations reduced"]
    assert "M-Act (mean over 3 seed(s)) 3.0 → 3.0 / 3.0" in row["this_run"] and row["verdict"] == C.NOT_AT_SCALE


def test_a_compare_json_from_before_every_seed_was_analysed_says_so():
    res = _committed()
    scope = R._scope(res)
    assert "seed 100's models alone" in scope and "all 3 seeds" in scope
    head, rows = R._per_seed_cells(res)
    assert rows[1][head.index("F-Attn")] == "–" and rows[1][head.index("val loss")] != "–"  # seed 101: loss only


def test_report_leads_with_findings_and_setup():
    res = _three_seeds(_committed())
    res["claims"] = C.claims_table(res, res["sink_lab"])
    b = R.blocks(res)
    assert [x[0] for x in b[:3]] == ["lead", "lead", "h2"] and b[2][1] == "Paper claims vs this run"
    findings, setup = b[0][1], b[1][1]
    for c in res["claims"]:
        assert f"{c['claim']} — **{c['verdict']}**" in findings
    for text in ("2 layers, d=48", "60,176 non-embedding parameters", "1,204,224 per run", "100, 101, 102",
                 "Precision: fp32", "Test CPU (AMX), 2 thread(s) on 2 core(s)"):
        assert text in setup, text
    # the thresholds come last, after the plots
    kinds = [x[1] for x in b if x[0] in ("h2", "h3")]
    assert kinds.index("Plots") < kinds.index("Thresholds and where they come from")


def test_report_only_rerenders_the_committed_result_without_training(tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    shutil.copytree(COMMITTED, out)
    shutil.rmtree(out / "plots")
    (out / "report.md").unlink()
    before = json.loads((out / "compare.json").read_text())
    monkeypatch.chdir(tmp_path)  # the default evidence folders (absent here)
    monkeypatch.setattr("gated_attention.experiment.train_or_reuse", lambda *a, **k: pytest.fail("trained"))
    assert cli.main(["compare", "--report-only", "--out", str(out)]) == 0
    after = json.loads((out / "compare.json").read_text())
    for v, row in before["rows"].items():  # measurements untouched, the claims recomputed by today's rules
        measured = lambda r: {k: x for k, x in r.items() if k != "over_seeds"}  # noqa: E731  (derived, rewritten)
        assert measured(after["rows"][v]) == measured(row)
    assert {c["claim"]: c["verdict"] for c in after["claims"]}["Sparse, query-dependent gate scores"] == C.PARTLY
    md = (out / "report.md").read_text()
    assert md.index("**Findings**") < md.index("**Setup.**") < md.index("## Paper claims vs this run")
    assert "Intel(R) Xeon(R) Processor (AMX)" in md  # the machine from provenance.json beside compare.json
    # the per-layer plot is drawn from compare.json; the loss curve needs the run's logs: neither file nor link
    assert (out / "plots" / "layers_fattn_mact.png").is_file() and "loss_curves.png" not in md
    # with the plot data a run now stores, every plot is drawn from compare.json alone
    (out / "compare.json").write_text(json.dumps(_three_seeds(after)))
    assert cli.main(["compare", "--report-only", "--out", str(out)]) == 0
    plots = json.loads((out / "compare.json").read_text())["plots"]
    assert set(plots) >= {"loss", "layers", "gates", "maps_baseline", "maps_sdpa_headwise"}
    assert all((out / p).is_file() for p in plots.values())
    capsys.readouterr()
    assert cli.main(["compare", "--report-only", "--out", str(tmp_path / "none")]) == 2
    assert "no compare.json" in capsys.readouterr().err


def test_readme_excerpt_is_generated_from_the_committed_compare_json(tmp_path):
    import re

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert R.splice_excerpt(readme, ROOT) == readme, "README's claims excerpt is stale: python scripts/readme_excerpt.py"
    source = re.search(re.escape(R.EXCERPT_BEGIN).replace(re.escape("{path}"), "(.+?)"), readme).group(1)
    res = json.loads((ROOT / source).read_text(encoding="utf-8"))  # the compare.json the excerpt names
    for c in res["claims"]:
        assert f"| {c['claim']} | {c['summary'].replace('|', chr(92) + '|')} | {c['verdict']} |" in readme
    # the check can fail: another verdict in the result gives another excerpt
    other = (tmp_path / source).parent
    other.mkdir(parents=True)
    res["claims"][0]["verdict"] = "no effect of the paper's size"
    (other / "compare.json").write_text(json.dumps(res))
    assert R.splice_excerpt(readme, tmp_path) != readme


def _checked_save(monkeypatch, seen: dict):
    """save_png in the plotting modules, recording each figure's text collisions and its layer axes' ticks first."""
    from gated_attention.util import io

    def check(fig, path, **k):
        layers = [ax for ax in fig.axes if ax.get_xlabel() == "layer"]
        seen[Path(path).name] = (pages.text_overlaps(fig), [list(ax.get_xticks()) for ax in layers])
        return io.save_png(fig, path, **k)

    from gated_attention.analysis import plots as P
    from gated_attention.labs.sinks import sink_report
    from gated_attention.labs.streaming import streaming_report

    for mod in (R, P, sink_report, streaming_report):
        monkeypatch.setattr(mod, "save_png", check)


def test_plots_have_no_colliding_text_and_whole_layer_ticks(tmp_path, monkeypatch):
    seen = {}
    _checked_save(monkeypatch, seen)
    res = _three_seeds(_committed())
    R.make_plots(tmp_path, res)
    assert set(seen) == {"loss_curves.png", "layers_fattn_mact.png", "gate_histograms.png",
                         *(f"attention_maps_{v}.png" for v in res["rows"])}
    for name, (overlaps, ticks) in seen.items():
        assert overlaps == [], (name, overlaps)
        assert all(float(t).is_integer() for axis in ticks for t in axis), (name, ticks)
    assert seen["layers_fattn_mact.png"][1] and len(seen["layers_fattn_mact.png"][1]) == 2
    # the streaming check's 3 x 3 grid of models (titles over the row below) and the sink lab's maps and curves
    from gated_attention.labs.sinks import sink_report
    from gated_attention.labs.streaming import streaming_report

    pp = lambda c: [c + 0.1 * math.sin(t) for t in range(64)]  # noqa: E731
    models = {f"{v}_seed{k}": {"full": {"per_position": pp(3)}, "window": {"0": {"per_position": pp(3.1)},
                                                                          "4": {"per_position": pp(3.0)}}}
              for v in res["rows"] for k in range(3)}
    streaming_report.make_plots(tmp_path, {"models": models, "config": {"window": 16}})
    one = lambda g: {"seed": 0, "attention_map": [[1.0 / (q + 1) if k <= q else 0 for k in range(32)]  # noqa: E731
                                                  for q in range(32)], "map_active_rows": [5, 9],
                     "backcopy_head": [0, 0], "curve": [{"step": s, "bos_attention_dormant": 0.5,
                                                         "backcopy_ce": 1.0 / (s + 1)} for s in range(0, 800, 100)]}
    lab = {"variants": {v: {"per_seed": [one(v)], "mean": {"gate_dormant": 0.1 if v != "baseline" else None,
                                                           "gate_active": 0.6}, "std": {"gate_dormant": None,
                                                                                        "gate_active": None}}
                        for v in res["rows"]}}
    sink_report.make_plots(tmp_path, lab)
    for name in ("per_position_loss.png", "bos_attention_vs_step.png", "attention_maps.png",
                 "gate_dormant_vs_active.png"):
        assert seen[name][0] == [], (name, seen[name][0])


def test_the_collision_check_sees_a_label_over_the_next_panel():
    """Positive control: two attention maps side by side without layout room put the right one's y label over the left
    one's image, which is what the check reports; the same figure laid out by pages.subplots is clean."""
    import matplotlib.pyplot as plt

    tri = [[1.0 / (q + 1) if k <= q else 0.0 for k in range(64)] for q in range(64)]

    def maps(fig, axes):
        for ax in axes[0]:
            ax.imshow(tri)
            ax.set(title="layer: 7% on token 0", xlabel="key", ylabel="query")
        fig.colorbar(axes[0][0].images[0], ax=axes[0].tolist(), shrink=0.8)
        return pages.text_overlaps(fig)

    bad = maps(*plt.subplots(1, 2, figsize=(6.4, 3.2), squeeze=False))
    assert bad and all("'query' / the plotting area" in x for x in bad)
    assert maps(*pages.subplots(1, 2, figsize=(6.4, 3.2), squeeze=False)) == []
    plt.close("all")


@pytest.mark.slow
def test_report_renders_in_a_browser(tmp_path):
    """The committed result re-rendered and laid out by headless Chromium at 1400 px: no sideways scrolling, every
    figure loaded and inside the page, text left and figures right, findings, setup and claims on the first screen
    (scripts/check_report_render.py); a page with a table too wide for the window fails it."""
    script = ROOT / "scripts" / "check_report_render.py"
    if shutil.which("chromium") is None and shutil.which("chromium-browser") is None:
        pytest.skip("no chromium (apt-get install chromium)")
    out = tmp_path / "out"
    shutil.copytree(COMMITTED, out)
    (out / "compare.json").write_text(json.dumps(_three_seeds(_committed())))
    R.rerender(out)
    run = lambda html: subprocess.run([sys.executable, str(script), str(html), "--out", str(tmp_path / "png")],
                                      capture_output=True, text=True, timeout=300)
    r = run(out / "report.html")
    assert r.returncode == 0, r.stdout + r.stderr
    from PIL import Image

    assert Image.open(tmp_path / "png" / "render_first_screen.png").size == (1400, 900)
    wide = out / "wide.html"
    cells = "".join(f"<td style='white-space:nowrap'>{'x' * 40}</td>" for _ in range(8))
    wide.write_text((out / "report.html").read_text().replace("<body>", f"<body><table><tr>{cells}</tr></table>", 1))
    r = run(wide)
    assert r.returncode == 1 and "scrolls sideways" in r.stdout
