"""`gattn lab streaming`'s declaration: its options (each with its help, here only) and how the command runs the
lab (streaming_lab.run_streaming); cli/lab.py builds the subcommand from STUDY without importing torch. The lab
trains nothing: it measures the models it is given."""
from __future__ import annotations

import sys
from pathlib import Path

from ...experiment.study import Option, Study


def _options() -> list[Option]:
    from . import DEFAULT_SINK_TOKENS

    return [
        Option(("--models",), "model folders (required unless --report-only): a sink-lab run OUT/runs/<variant>/seed<k> "
               "(or a whole sink-lab OUT), a `gattn compare` OUT (its runs/<variant>/final), a trainer run folder "
               "(final/) or any folder with config.json", {"nargs": "+", "metavar": "DIR"}),
        Option(("--window",), "recent tokens the rolling KV cache keeps (the current one included)",
               {"type": int, "required": True, "metavar": "W"}),
        Option(("--sink-tokens",), "first tokens kept forever, one measurement per K; 0 = a plain sliding window "
               f"(default: {' '.join(map(str, DEFAULT_SINK_TOKENS))})",
               {"type": int, "nargs": "+", "default": list(DEFAULT_SINK_TOKENS), "metavar": "K"}),
        Option(("--out",), "output folder: lab.json, report.md, report.html, plots/ (default runs/lab/streaming)",
               {"default": "runs/lab/streaming"}),
        Option(("--seq-len",), "tokens per held-out sequence (default: the length each model was trained on)",
               {"type": int, "default": None}),
        Option(("--sequences",), "held-out sequences per model (default 32)", {"type": int, "default": 32}),
        Option(("--text",), "score windows of this UTF-8 text file instead of the corpus (text models only)",
               {"default": None, "metavar": "FILE"}),
        Option(("--data-dir",), "corpus of model folders whose train_config.json does not name one (default: the "
               "corpus each run trained on)", {"default": None}),
    ]


def _run(args) -> int:
    from . import streaming_lab, streaming_report

    cfg = streaming_lab.StreamingConfig(models=args.models, window=args.window, sink_tokens=args.sink_tokens,
                                        seq_len=args.seq_len, sequences=args.sequences, text=args.text,
                                        data_dir=args.data_dir)
    lab = streaming_lab.run_streaming(cfg, args.out, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(streaming_report.text_table(lab))
    print(f"report: {Path(args.out) / 'report.html'}  ({lab['wall_time_s']:.0f}s)")
    return 0


STUDY = Study("streaming", "Sliding-window decoding with and without sink tokens (StreamingLLM): loss of full "
              "attention vs a rolling KV window keeping the first K tokens, per model and position.", _options, _run)
