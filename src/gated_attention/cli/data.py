"""`gattn data prepare | info`: build (or reuse) the offline corpus, or print a prepared corpus' manifest."""
from __future__ import annotations

from ..util import errors as E  # argparse types: numbers and paths checked where they enter

import argparse
import json
import sys
from typing import Any

from ..data import SOURCES, Corpus, PrepareConfig, prepare


def configure_data(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    p = sub.add_parser("prepare", help="Build (or reuse) the corpus, tokenizer and token files in a data dir.")
    d = PrepareConfig()
    p.add_argument("--data-dir", default=d.data_dir,
                   help=f"where everything is written and cached (default {d.data_dir})")
    p.add_argument("--vocab-size", type=E.positive_int, default=d.vocab_size, help=f"BPE vocabulary size (default {d.vocab_size})")
    p.add_argument("--sources", nargs="*", default=None, choices=list(SOURCES), metavar="SOURCE",
                   help=f"built-in sources to include (default: {' '.join(d.sources)}, also beside --extra; opt-in "
                        f"large ones: {' '.join(s for s in SOURCES if s not in d.sources)}, installed by "
                        f"GATTN_LARGE_SOURCES=1 scripts/install_debian_deps.sh); `--sources` with no names: "
                        f"your --extra inputs only")
    p.add_argument("--extra", nargs="+", default=[], metavar="PATH",
                   help="your own inputs, each a domain named after it: text files or folders (a folder may mix "
                        "text, .jsonl and .parquet files), JSONL, Parquet, or a folder written by HF datasets' "
                        "save_to_disk; read offline and streamed (Parquet/datasets need the 'data' extra)")
    p.add_argument("--text-field", default=d.text_field, metavar="NAME",
                   help=f"the JSONL field / Parquet or datasets column holding the text (default {d.text_field})")
    p.add_argument("--workers", type=E.positive_int, default=d.workers,
                   help=f"tokenizing worker processes (default the cores here: {d.workers}); the token files are "
                        f"byte-identical for any number")
    p.add_argument("--tokenizer-sample-mb", type=float, default=d.tokenizer_sample_mb, metavar="MB",
                   help=f"train BPE on a uniform sample of at most this many MB of train chunks (default "
                        f"{d.tokenizer_sample_mb:g}; all of them when the corpus is smaller), so memory stays flat")
    p.add_argument("--val-fraction", type=float, default=d.val_fraction,
                   help=f"share of chunks per domain held out for validation (default {d.val_fraction})")
    p.add_argument("--seed", type=E.nonneg_int, default=d.seed, help=f"seed of the train/val split hash (default {d.seed})")
    p.add_argument("--chunk-chars", type=E.positive_int, default=d.chunk_chars,
                   help=f"documents are cut into chunks of about this many characters for the split "
                        f"(default {d.chunk_chars})")
    p.add_argument("--force", action="store_true", help="rebuild everything instead of reusing the cache")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="use this HF tokenizer (e.g. a pretrained Llama/Mistral/Qwen2 checkpoint dir) instead of "
                        "training a BPE one, so `gattn train --set init_from=...` fine-tunes on the model's own "
                        "vocabulary; --vocab-size is then ignored")
    i = sub.add_parser("info", help="Print the manifest of a prepared data dir as a table.")
    i.add_argument("--data-dir", default=d.data_dir, help=f"prepared data dir (default {d.data_dir})")
    i.add_argument("--verify", action="store_true", help="also recompute and check every sha256 in the manifest")
    i.add_argument("--json", action="store_true", help="print the raw manifest JSON instead of a table")


def format_manifest(manifest: dict[str, Any]) -> str:
    rows = [("domain", "MB", "docs", "chunks t/v", "train tok", "val tok", "licence")]
    tot_b = tot_t = tot_v = 0
    for name, e in manifest["domains"].items():
        rows.append((name, f"{e['bytes'] / 1e6:.2f}", str(e["documents"]),
                     f"{e['chunks']['train']}/{e['chunks']['val']}", f"{e['tokens']['train']:,}",
                     f"{e['tokens']['val']:,}", e["licence"][:48]))
        tot_b, tot_t, tot_v = tot_b + e["bytes"], tot_t + e["tokens"]["train"], tot_v + e["tokens"]["val"]
    rows.append(("TOTAL", f"{tot_b / 1e6:.2f}", "", "", f"{tot_t:,}", f"{tot_v:,}", ""))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) if c in (0, 6) else cell.rjust(w) for c, (cell, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    lines.append(f"vocab {manifest['vocab_size']} ({manifest['dtype']}), split seed {manifest['seed']}, "
                 f"val fraction {manifest['val_fraction']}, built in {manifest.get('build_seconds', '?')}s")
    for name, e in manifest["domains"].items():
        if e.get("replaced_chars"):
            lines.append(f"note: {name}: {e['replaced_chars']} invalid UTF-8 sequences were replaced with U+FFFD")
        if e.get("warning"):
            lines.append(f"warning: {name}: {e['warning']}")
        for f in e.get("skipped_files", []):
            lines.append(f"skipped file in {name}: {f}")
    for name, why in manifest.get("skipped", {}).items():
        lines.append(f"skipped {name}: {why}")
    return "\n".join(lines)


def sources_of(args: argparse.Namespace) -> tuple[str, ...]:
    """The built-in sources a prepare reads: those named, else the defaults, said on stderr when they would be mixed
    into the user's own --extra inputs (a corpus of "my text" that is mostly the built-in one is no one's intent)."""
    if args.sources is not None:
        return tuple(args.sources)
    default = PrepareConfig().sources
    if args.extra:
        print(f"gattn data prepare: note: the built-in sources ({' '.join(default)}) are mixed in with your --extra "
              "inputs; pass --sources with no names to prepare yours only", file=sys.stderr)
    return default


def run_data(args: argparse.Namespace) -> int:
    if args.action == "prepare":
        cfg = PrepareConfig(data_dir=args.data_dir, vocab_size=args.vocab_size, sources=sources_of(args),
                            extra=tuple(args.extra), val_fraction=args.val_fraction, seed=args.seed,
                            chunk_chars=args.chunk_chars, force=args.force,
                            tokenizer=args.tokenizer, workers=args.workers, text_field=args.text_field,
                            tokenizer_sample_mb=args.tokenizer_sample_mb)
        print(format_manifest(prepare(cfg)))
        return 0
    corpus = Corpus(args.data_dir)
    print(json.dumps(corpus.manifest, indent=2) if args.json else format_manifest(corpus.manifest))
    if args.verify:
        problems = corpus.verify()
        for p in problems:
            print(f"verify: {p}", file=sys.stderr)
        print("verify: all checksums match" if not problems else f"verify: {len(problems)} problem(s)")
        return 1 if problems else 0
    return 0
