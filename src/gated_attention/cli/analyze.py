"""`gattn analyze`: measure attention sinks, massive activations and gate statistics of a local model checkpoint.

Writes OUT/analysis.json (schema: analysis.analyze.analysis_schema(), also in docs/usage.md) and PNG plots; --json also prints the JSON.
"""
from __future__ import annotations

from ..util import errors as E  # argparse types: numbers and paths checked where they enter

import argparse
import sys
from pathlib import Path

from ..util.io import json_dumps


def configure_analyze(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_dir", type=E.existing_dir, help="local model directory (ours or any HF transformer with config.json)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", type=E.existing_file, help="a UTF-8 text file to analyse on")
    src.add_argument("--domain", help="analyse on validation tokens of this corpus domain (needs --data-dir)")
    p.add_argument("--data-dir", type=E.existing_dir, help="prepared corpus directory (for --domain, or the tokenizer when the model "
                                      "directory has none)")
    p.add_argument("--seq-len", type=E.positive_int, default=512, help="tokens per window (default 512)")
    p.add_argument("--batches", type=E.positive_int, default=4, help="number of batches to analyse (default 4)")
    p.add_argument("--batch-size", type=E.positive_int, default=2, help="windows per batch (default 2)")
    p.add_argument("--no-bos", action="store_true",
                   help="do not start each window with the tokenizer's BOS/CLS token (default: do, as in training)")
    p.add_argument("--layers-to-plot", type=E.nonneg_int, nargs="+",
                   help="layers whose head-averaged attention maps are plotted (default: 0, ~L/4, ~3L/4, last)")
    p.add_argument("--map-len", type=E.positive_int, default=64, help="tokens shown in each attention map (default 64)")
    p.add_argument("--sink-eps", type=E.positive_float, default=0.3, help="threshold for Sink_k^eps (default 0.3)")
    p.add_argument("--attn-implementation", default="sdpa", choices=["sdpa", "eager"],
                   help="attention backend to load the model with (default sdpa; results agree)")
    p.add_argument("--out", type=E.out_dir, required=True, help="output directory for analysis.json and the PNG plots")
    p.add_argument("--json", action="store_true", help="also print analysis.json to stdout")


def run_analyze(args) -> int:
    from ..analysis.analyze import analyze_folder

    result = analyze_folder(args.model_dir, args.out, text=args.text, domain=args.domain, data_dir=args.data_dir,
                            seq_len=args.seq_len, batches=args.batches, batch_size=args.batch_size, bos=not args.no_bos,
                            layers_to_plot=args.layers_to_plot, map_len=args.map_len, sink_eps=args.sink_eps,
                            attn_implementation=args.attn_implementation)
    bad = result.get("nonfinite_metrics") or []
    if bad:  # reported, not hidden: the JSON holds null + "nonfinite", stderr says where
        print(f"gattn analyze: warning: {len(bad)} non-finite metric(s) (the model produced NaN/Inf): "
              f"{', '.join(bad[:8])}{' ...' if len(bad) > 8 else ''}", file=sys.stderr)
    if args.json:
        print(json_dumps(result, indent=1))  # strict JSON, as the file
    else:
        g = result["gate_mean"]
        print(f"F-Attn {result['first_token_attention']:.4f} (uniform {result['uniform_first_token_attention']:.4f})  "
              f"M-Act {result['max_abs_hidden']:.2f}  gate mean {'n/a' if g is None else f'{g:.4f}'}  "
              f"-> {Path(args.out) / 'analysis.json'}", file=sys.stderr)
    return 0
