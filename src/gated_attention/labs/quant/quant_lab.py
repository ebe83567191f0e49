"""`gattn lab quant`: do gated models survive quantization like the baseline, and how should the gate be treated?

For every model (--models, resolved by models.py), every scheme (--schemes: gated_attention.quant.SCHEMES) and every
policy (--policies: all / keep-gate / split-gate), the model is fake-quantized (`quant.quantize_model`, fp32
arithmetic on the scheme's grid; the model itself never changes) and measured on fixed held-out data, next to the
same measurement of the unquantized model:

  val loss per domain (text: the corpus's validation windows, BOS first; sink-lab task: its held-out sequences,
  with the backcopy and bigram CE apart) and its mean, Δ in nats against the unquantized model; the gate after
  quantization (mean score over every entry, token and layer; share of scores below NEAR_ZERO); whether the sink
  comes back (F-Attn: attention on the first token, mean over layers, heads and queries — analysis.analyze_model;
  sink-lab models also the backcopy head's BOS attention from dormant queries — labs.sinks.sink_lab.measure).
An ungated model (no gate projection) is the same model under every policy: it is quantized once per scheme and its
row repeated per policy (`policy_applies` false). verdict.py holds the rule (fixed before any run).

Layout of OUT: rows/<model>/reference.json (the unquantized model), rows/<model>/<scheme>[__<policy>].json (one row
each, stored with its key: every setting it depends on; the model's weight files as its input), lab.json, report.md,
report.html, plots/. A re-run reuses every stored row and measures only the missing ones (a killed run loses at most
the row in progress); a row stored with other settings stops the lab naming them (experiment.cache). `report_only`
judges a lab.json's stored rows again (the rule of verdict.py) without measuring anything.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ...experiment import cache
from ...experiment.study import begin, save_lab
from ...util.io import locks_output
from . import models as M

NEAR_ZERO = 0.01  # a gate score below this shuts its entry: the analysis' sparsity threshold (analysis.metrics)
GATE_BINS = 100  # gate histogram on [0, 1] in bins of NEAR_ZERO: bin 0 counts the near-zero scores
FORMAT = 1  # bump when a row's measurement changes meaning


@dataclass
class QuantLabConfig:
    """Everything `gattn lab quant` was asked for (CLI flags map 1:1)."""

    models: list  # folders (models.py's list)
    schemes: list = field(default_factory=lambda: scheme_names())
    policies: list = field(default_factory=lambda: policy_names())
    data_dir: str | None = None  # corpus of text models whose train_config.json names none (overrides it if given)
    eval_windows: int = 128  # validation windows per domain (text) / held-out sequences (sink task)
    calibration_windows: int = 64  # awq-int4's calibration windows (training split / training stream)

    def validate(self) -> "QuantLabConfig":
        from gated_attention.quant import POLICIES, SCHEMES

        if not self.models:
            raise ValueError("--models needs at least one folder")
        for what, given, valid in (("--schemes", self.schemes, SCHEMES), ("--policies", self.policies, POLICIES)):
            bad = [x for x in given if x not in valid]
            if bad or not given:
                raise ValueError(f"{what} {' '.join(bad) or '(none)'}: valid: {' '.join(valid)}")
            if len(set(given)) != len(given):
                raise ValueError(f"{what} lists a value twice: {' '.join(given)}")
        if self.eval_windows < 1 or self.calibration_windows < 1:
            raise ValueError("--eval-windows and --calibration-windows must be >= 1")
        if self.data_dir is not None and not (Path(self.data_dir) / "manifest.json").is_file():
            raise ValueError(f"--data-dir {self.data_dir}: not a prepared corpus (no manifest.json); prepare it with "
                             f"`gattn data prepare --data-dir {self.data_dir}`")
        return self


def scheme_names() -> list:
    from gated_attention.quant import SCHEMES

    return list(SCHEMES)


def policy_names() -> list:
    from gated_attention.quant import POLICIES

    return list(POLICIES)


# ---------------------------------------------------------------- measurement

def _analysis_config():
    from gated_attention.analysis.analyze import AnalysisConfig

    return AnalysisConfig(map_layers=(), gate_hist_range=(0.0, 1.0), gate_hist_bins=GATE_BINS)


def _gate_counts(analysis: dict) -> tuple[float, float, float]:
    """(near-zero count, total count, sum of scores) of the gate scores over the analysis' layers."""
    near = total = 0.0
    for e in analysis["layers"]:
        h = e.get("gate_histogram")
        if h:
            near += h["counts"][0]
            total += sum(h["counts"])
    return near, total, (analysis["gate_mean"] or 0.0) * total


def measure(model, qm: M.QuantModel, data: dict) -> dict:
    """The measurement of one (possibly quantized) model on its data: val loss (mean over domains) and per domain,
    gate mean and near-zero share, F-Attn; sink-lab models also BOS attention and the task's two CEs."""
    import torch

    from gated_attention.analysis.analyze import analyze_model

    per_domain, f_attn, near, total, gsum = {}, [], 0.0, 0.0, 0.0
    with torch.no_grad():
        for domain, batches in data["eval"].items():
            a = analyze_model(model, batches, _analysis_config(), kind="causal")
            per_domain[domain] = a["loss"]
            f_attn.append(a["first_token_attention"])
            n, t, s = _gate_counts(a)
            near, total, gsum = near + n, total + t, gsum + s
        out = {"val_loss": sum(per_domain.values()) / len(per_domain), "val_loss_per_domain": per_domain,
               "gate_mean": gsum / total if total else None, "gate_near_zero": near / total if total else None,
               "f_attn": sum(f_attn) / len(f_attn) if None not in f_attn else None}
        if qm.kind == "sink_lab":
            from ..sinks.backcopy import BackcopyTask
            from ..sinks.sink_lab import measure as sink_measure

            s = sink_measure(model, BackcopyTask(**qm.task), data["seqs"])
            out.update({"bos_attention": s["bos_attention_dormant"], "backcopy_ce": s["backcopy_ce"],
                        "bigram_ce": s["bigram_ce"]})
    return out


def load_data(qm: M.QuantModel, cfg: QuantLabConfig) -> dict:
    """{"eval": {domain: [batches]}, "calibration": [ids], "seqs": sink task's (B, T+1) or None}."""
    if qm.kind == "sink_lab":
        seqs = M.task_eval(qm.task, cfg.eval_windows)
        return {"eval": {"task": [seqs]}, "seqs": seqs,
                "calibration": M.task_calibration(qm.task, cfg.calibration_windows)}
    if not (Path(qm.data_dir) / "manifest.json").is_file():
        raise ValueError(f"{qm.path}: its corpus {qm.data_dir!r} is not a prepared corpus from here (a relative path "
                         "is read from the current folder); pass --data-dir")
    return {"eval": M.text_eval(qm.data_dir, qm.seq_len, cfg.eval_windows), "seqs": None,
            "calibration": M.text_calibration(qm.data_dir, qm.seq_len, cfg.calibration_windows)}


def _fingerprint(path: str) -> list:
    from gated_attention.util.io import hf_weight_files

    return [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in hf_weight_files(path)]


def row_key(qm: M.QuantModel, cfg: QuantLabConfig, scheme: str | None, policy: str | None) -> dict:
    """Every setting one stored row depends on; `model` and `fingerprint` (its folder and weight files) are its inputs:
    a model trained again (or read from another folder) is measured again, not refused."""
    key = {"model": qm.path, "kind": qm.kind, "data_dir": qm.data_dir, "seq_len": qm.seq_len, "task": qm.task,
           "eval_windows": cfg.eval_windows, "scheme": scheme, "policy": policy, "format": FORMAT,
           "fingerprint": _fingerprint(qm.path)}
    if scheme == "awq-int4":
        key["calibration_windows"] = cfg.calibration_windows
    return key


def measure_model(qm: M.QuantModel, cfg: QuantLabConfig, out: Path, log) -> list[dict]:
    """Every row of one model (reference first), stored one by one under OUT/rows/<model>/."""
    from gated_attention.analysis import load_model
    from gated_attention.quant import quantize_model

    folder = out / "rows" / qm.label.replace("/", "__").replace(":", "_")
    state: dict = {}

    def model_and_data():
        if not state:
            state["model"] = load_model(qm.path)[0].eval()
            state["data"] = load_data(qm, cfg)
        return state["model"], state["data"]

    def compute(scheme=None, policy=None):
        def run() -> dict:
            model, data = model_and_data()
            c0 = time.process_time()
            if scheme is not None:
                calib = data["calibration"] if scheme == "awq-int4" else None
                model = quantize_model(model, scheme, policy or "all", calibration=calib)
            return {**measure(model, qm, data), "cpu_s": time.process_time() - c0}
        return run

    ref = cache.cached(folder / "reference.json", row_key(qm, cfg, None, None), compute(), log, "[quant]",
                       inputs=("model", "fingerprint"))
    gated = _gated_model(qm)
    rows = []
    for scheme in cfg.schemes:
        for policy in (cfg.policies if gated else [None]):
            name = scheme if policy is None else f"{scheme}__{policy}"
            got = cache.cached(folder / f"{name}.json", row_key(qm, cfg, scheme, policy), compute(scheme, policy),
                               log, "[quant]", inputs=("model", "fingerprint"))
            for p in (cfg.policies if policy is None else [policy]):
                rows.append(_row(qm, scheme, p, got, ref, policy_applies=gated))
            log(f"[quant] {qm.label} {name}: Δ {rows[-1]['delta_nats']:+.4f} nats, gate "
                f"{_f(rows[-1]['gate_mean'])}, F-Attn {_f(rows[-1]['f_attn'])}")
    return [{**_row(qm, None, None, ref, ref, gated), "scheme": "none", "policy": "none"}] + rows


def _gated_model(qm: M.QuantModel) -> bool:
    """Does the model have a gate projection (else every policy is the same model)? Read from its weights' names."""
    from gated_attention.quant.policies import GATE_SUFFIX
    from gated_attention.util.io import hf_weight_files

    from safetensors import safe_open

    for f in hf_weight_files(qm.path):
        with safe_open(str(f), "pt") as st:
            if any(k.endswith(GATE_SUFFIX + ".weight") for k in st.keys()):
                return True
    return False


def _f(v) -> str:
    return "-" if v is None else f"{v:.3f}"


def _row(qm: M.QuantModel, scheme, policy, got: dict, ref: dict, policy_applies: bool) -> dict:
    def minus(a, b):
        return a - b if a is not None and b is not None and math.isfinite(a) and math.isfinite(b) else None

    per = got["val_loss_per_domain"]
    return {"model": qm.label, "scheme": scheme, "policy": policy, "val_loss": got["val_loss"],
            "delta_nats": minus(got["val_loss"], ref["val_loss"]), "gate_mean": got["gate_mean"],
            "gate_near_zero": got["gate_near_zero"], "f_attn": got["f_attn"],
            "bos_attention": got.get("bos_attention"), "backcopy_ce": got.get("backcopy_ce"),
            "bigram_ce": got.get("bigram_ce"), "val_loss_per_domain": per,
            "delta_per_domain": {d: minus(v, ref["val_loss_per_domain"].get(d)) for d, v in per.items()},
            "variant": qm.variant, "arm": qm.arm, "family": qm.family, "seed": qm.seed, "baseline": qm.baseline,
            "kind": qm.kind, "policy_applies": policy_applies, "cpu_s": got.get("cpu_s")}


# ---------------------------------------------------------------- the lab

@locks_output("out", "gattn lab quant")
def run_lab(cfg: QuantLabConfig, out: str | Path, log=print) -> dict:
    """Measure every (model, scheme, policy) and write lab.json, report.md, report.html and plots into out."""
    from gated_attention.util.io import to_strict

    out, clock = begin(cfg, out)
    qms = M.resolve_models(cfg.models, cfg.data_dir)
    log(f"[quant] {len(qms)} model(s) x {len(cfg.schemes)} scheme(s) x {len(cfg.policies)} polic(ies) -> {out}")
    rows = []
    for qm in qms:
        rows += measure_model(qm, cfg, out, log)
    results = [r for r in rows if r["scheme"] != "none"]
    lab = {"config": {**asdict(cfg), "models": [str(m) for m in cfg.models]},
           "models": {qm.label: qm.to_dict() for qm in qms},
           "reference": {r["model"]: {k: r[k] for k in ("val_loss", "val_loss_per_domain", "gate_mean",
                                                         "gate_near_zero", "f_attn", "bos_attention")}
                         for r in rows if r["scheme"] == "none"},
           "results": results, **judgement(results), "near_zero_gate": NEAR_ZERO, "report_only": False,
           **clock.times()}
    return _write(to_strict(lab), out)


def judgement(results: list[dict]) -> dict:
    """lab.json's judged parts from its `results` rows alone (verdict.py's rule): comparisons, policy_comparisons,
    thresholds, verdict."""
    from . import verdict as V

    comps, pcomps = V.comparisons(results), V.policy_comparisons(results)
    pv = V.policy_verdicts(comps, pcomps)
    return {"comparisons": comps, "policy_comparisons": pcomps,
            "thresholds": {k: [t.to_dict() for t in ts] for k, ts in V.THRESHOLDS.items()},
            "verdict": {"rule": "gated vs baseline: D = mean Δ_gated − mean Δ_baseline over ≥ 3 models per arm, "
                                "95 % Welch interval; policy vs policy: D = Δ(cheaper) − Δ(dearer) paired by model; "
                                f"both against the paper's δ = {V.MARGIN.value} nats; a policy is recommended only "
                                "when its claim holds and the paired D prefers it over every other (verdict.py)",
                        "per_family": pv, "text": V.verdict_text(pv)}}


def _write(lab: dict, out: Path) -> dict:
    from . import quant_report

    return save_lab(out, lab, lambda d: quant_report.make_plots(lab, d), lambda: quant_report.write(lab, out))


@locks_output("out", "gattn lab quant --report-only")
def report_only(out: str | Path) -> dict:
    """Judge OUT/lab.json's stored `results` again with the current rule and rewrite lab.json, report and plots;
    measures nothing (every other key is kept as it was)."""
    from gated_attention.util.io import read_json_object, to_strict

    out = Path(out)
    lab = read_json_object(out / "lab.json", "quantization lab result",
                           "run `gattn lab quant --models ... --out` into this folder first")
    if not isinstance(lab.get("results"), list):
        raise ValueError(f"{out / 'lab.json'}: not a quantization-lab result (no `results` list); point --out at a "
                         "`gattn lab quant` OUT")
    return _write(to_strict({**lab, **judgement(lab["results"]), "report_only": True}), out)
