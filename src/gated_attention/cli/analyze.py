"""`gattn analyze`: measure attention sinks, massive activations and gate statistics of a local model checkpoint.

Writes OUT/analysis.json (schema: analyze.SCHEMA, also in the README) and PNG plots; --json also prints the JSON.
"""
from __future__ import annotations

from ..util import errors as E  # argparse types: numbers and paths checked where they enter

import argparse
import json
import sys
from pathlib import Path

from ..util.io import atomic_write_text
from ..analysis.analyze import AnalysisConfig, analyze_model, bos_id, load_model, load_tokenizer, token_batches


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


def _tokens(args, tok):
    if args.text:
        text = Path(args.text).read_text(encoding="utf-8", errors="replace")
        return tok(text, add_special_tokens=False)["input_ids"]
    if not args.data_dir:
        raise ValueError("--domain needs --data-dir (the prepared corpus directory)")
    from ..data import Corpus

    return Corpus(args.data_dir).tokens(args.domain, "val")


def run_analyze(args) -> int:
    for name in ("seq_len", "batches", "batch_size", "map_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    model, kind = load_model(args.model_dir, attn_implementation=args.attn_implementation)
    max_pos = getattr(model.config, "max_position_embeddings", None)
    if max_pos and args.seq_len > max_pos:
        raise ValueError(f"--seq-len {args.seq_len} exceeds the model's max_position_embeddings {max_pos}")
    tok = load_tokenizer(args.model_dir, args.data_dir)
    first = None if args.no_bos else bos_id(tok)
    batches = token_batches(_tokens(args, tok), args.seq_len, args.batch_size, args.batches, first)
    cfg = AnalysisConfig(sink_eps=args.sink_eps, map_len=args.map_len,
                         map_layers=tuple(args.layers_to_plot) if args.layers_to_plot else None)
    n_layers = getattr(model.config, "num_hidden_layers", None)
    if args.layers_to_plot and n_layers and any(not 0 <= i < n_layers for i in args.layers_to_plot):
        raise ValueError(f"--layers-to-plot must be in 0..{n_layers - 1}")
    result = {"model": str(args.model_dir), **analyze_model(model, batches, cfg, kind)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from ..util.io import json_dumps, nonfinite_paths

    bad = nonfinite_paths({k: v for k, v in result.items() if k != "attention_maps"})
    if bad:  # reported, not hidden: the JSON holds null + "nonfinite", stderr says where
        result["nonfinite_metrics"] = bad
        print(f"gattn analyze: warning: {len(bad)} non-finite metric(s) (the model produced NaN/Inf): "
              f"{', '.join(bad[:8])}{' ...' if len(bad) > 8 else ''}", file=sys.stderr)
    text = json_dumps(result, indent=1)  # strict JSON: a NaN metric is null + "nonfinite", never a bare NaN
    atomic_write_text(out / "analysis.json", text)
    from ..analysis.plots import plot_all
    plot_all(result, out, label=Path(args.model_dir).name)
    if args.json:
        print(text)
    else:
        g = result["gate_mean"]
        print(f"F-Attn {result['first_token_attention']:.4f} (uniform {result['uniform_first_token_attention']:.4f})  "
              f"M-Act {result['max_abs_hidden']:.2f}  gate mean {'n/a' if g is None else f'{g:.4f}'}  "
              f"-> {out / 'analysis.json'}", file=sys.stderr)
    return 0
