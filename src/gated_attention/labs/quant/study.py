"""`gattn lab quant`'s declaration: its options (each with its help, here only) and how the command runs the lab
(quant_lab.run_lab); cli/lab.py builds the subcommand from STUDY without importing torch. The lab trains nothing: it
measures the models it is given, quantized and not."""
from __future__ import annotations

import sys
from pathlib import Path

from ...experiment.study import Option, Study, options
from ...util import errors as E


def _options() -> list[Option]:
    from .quant_lab import QuantLabConfig, policy_names, scheme_names

    d = QuantLabConfig(models=[])
    return [
        Option(("--models",), "model folders (required unless --report-only): a `gattn compare` OUT (every "
               "runs/<run>/final), a scaling-lab OUT (every unit at its variant's best LR), a sink-lab or retrofit-lab "
               "OUT or one of their units, a trainer run folder (final/) or any folder with config.json. Each model's "
               "gate is read from its config.json and its seed from its run; gated models are compared with the "
               "baseline of the same shape and data", {"nargs": "+", "metavar": "DIR"}),
        Option(("--schemes",), "quantization schemes (gated_attention.quant; default all): " + " ".join(scheme_names()),
               {"nargs": "+", "default": scheme_names(), "metavar": "NAME"}),
        Option(("--policies",), "how the gate is quantized (default all three): all (the gate fused with q_proj as one "
               "tensor, as the official / Qwen3-Next layouts hold it), keep-gate (the gate's projection left in full "
               "precision), split-gate (the gate with its own scales)",
               {"nargs": "+", "default": policy_names(), "metavar": "NAME"}),
        Option(("--data-dir",), "prepared corpus of text models (default: the corpus each run's train_config.json "
               "names; required for a folder that names none)", {"default": None}),
        Option(("--eval-windows",), "held-out windows per corpus domain (sink-lab task: held-out sequences) every "
               f"model is measured on, quantized or not (default {d.eval_windows})",
               {"type": E.positive_int, "default": d.eval_windows}),
        Option(("--calibration-windows",), "training windows of awq-int4's calibration pass (default "
               f"{d.calibration_windows})", {"type": E.positive_int, "default": d.calibration_windows}),
        Option(("--out",), "output folder: rows/<model>/*.json (one stored row each), lab.json, report.md, "
               "report.html, plots/ (default runs/lab/quant; a re-run measures only the missing rows)",
               {"type": E.out_dir, "default": "runs/lab/quant"}),
        options.report_only("judge OUT/lab.json's stored results again with the current rule and rewrite lab.json, "
                            "the report and the plots; measures nothing and needs no --models"),
    ]


def _run(args) -> int:
    from . import QuantLabConfig, quant_report
    from . import run_lab as run_quant_lab
    from .quant_lab import report_only

    if args.report_only:
        lab = report_only(args.out)
        print(quant_report.text_table(lab))
        print(f"report: {Path(args.out) / 'report.html'}")
        return 0
    if not args.models:
        raise E.UserError("--models is required (the model folders to measure); or pass --report-only to judge an "
                          "existing OUT again")
    cfg = QuantLabConfig(models=list(args.models), schemes=list(args.schemes), policies=list(args.policies),
                         data_dir=args.data_dir, eval_windows=args.eval_windows,
                         calibration_windows=args.calibration_windows).validate()
    lab = run_quant_lab(cfg, args.out, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(quant_report.text_table(lab))
    print(f"report: {Path(args.out) / 'report.html'}  ({lab['wall_time_s']:.0f}s)")
    return 0


STUDY = Study("quant", "Gated models under quantization: 7 schemes x 3 gate policies (all / keep-gate / split-gate), "
              "Δ loss per domain vs the unquantized model, the gate and the sink after quantization, gated vs baseline "
              "(Welch) and policy vs policy (paired on the same models) against the paper's δ, and a recommended "
              "policy where the evidence decides one.", _options, _run)
