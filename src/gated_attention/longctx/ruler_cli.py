"""`gattn ruler DIR --lengths ... --tasks ... --samples N --out OUT`: RULER-style scores of a checkpoint by length.

Writes OUT/ruler.json (scores, per-length average, per-sample records, settings), prints a task x length table and
saves OUT/ruler.png (score vs length per task, plus the average). Any HF causal LM directory loads (`import
gated_attention` first registers the gated models with the Auto classes).
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from gated_attention.longctx import ruler


def format_table(result: dict) -> str:
    lengths = result["config"]["lengths"]
    rows = list(result["scores"].items()) + [("average", result["average"])]
    width = max(len(name) for name, _ in rows)
    lines = [f"{'task':<{width}} " + " ".join(f"{L:>8}" for L in lengths)]
    for name, by_len in rows:
        lines.append(f"{name:<{width}} " + " ".join(f"{by_len[L]:8.1f}" for L in lengths))
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # headless: no display on training machines
    import matplotlib.pyplot as plt

    lengths = result["config"]["lengths"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for task, by_len in result["scores"].items():
        ax.plot(lengths, [by_len[L] for L in lengths], marker="o", label=task, alpha=0.8)
    ax.plot(lengths, [result["average"][L] for L in lengths], marker="s", color="black", lw=2.5, label="average")
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [str(L) for L in lengths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel(f"score (string match {result['config']['metric']}, %)")
    ax.set_ylim(-3, 103)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, path)


def write_json(obj, path: Path) -> None:
    from gated_attention.io import atomic_write_json

    atomic_write_json(path, obj, indent=2)  # strict JSON: a NaN score is null + "nonfinite"


def configure(parser) -> None:
    from gated_attention import errors as E  # argparse types: numbers/paths checked where they enter

    parser.add_argument("dir", type=E.existing_dir, help="HF checkpoint directory (model + tokenizer)")
    parser.add_argument("--lengths", type=E.positive_int, nargs="+", required=True, help="target prompt lengths in tokens")
    parser.add_argument("--tasks", nargs="+", default=list(ruler.NO_CORPUS_TASKS), choices=list(ruler.TASKS),
                        metavar="TASK", help=f"tasks (default: all that need no corpus). Valid: {', '.join(ruler.TASKS)}")
    parser.add_argument("--samples", type=E.positive_int, default=10, help="samples per task and length (default: 10)")
    parser.add_argument("--out", type=E.out_dir, required=True, help="output directory for ruler.json and ruler.png")
    parser.add_argument("--seed", type=E.nonneg_int, default=0, help="sample seed (same seed = same prompts)")
    parser.add_argument("--max-new-tokens", type=E.positive_int, default=None,
                        help="generation budget; default: per task family (niah 64, vt 32, cwe 96, fwe 40, passkey 16)")
    parser.add_argument("--haystack-file", type=E.existing_file, default=None,
                        help="text file used as the haystack of the corpus tasks (niah_single_2/3, multikey_1, ...)")
    parser.add_argument("--metric", choices=list(ruler.METRICS), default="all",
                        help="string match: all = fraction of answers found (RULER default), part = any found")
    parser.add_argument("--device", default="cpu", help="torch device for the model (default: cpu)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                        help="model dtype (default: float32)")


def run(args) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import gated_attention  # noqa: F401  (registers the gated model classes with the Auto factories)

    from gated_attention.io import check_hf_dir

    check_hf_dir(args.dir)
    corpus = Path(args.haystack_file).read_text(encoding="utf-8") if args.haystack_file else None
    tokenizer = AutoTokenizer.from_pretrained(args.dir)
    model = AutoModelForCausalLM.from_pretrained(args.dir, dtype=getattr(torch, args.dtype)).to(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def progress(task, length, value):
        print(f"  {task} @ {length}: {value:.1f}", flush=True)

    result = ruler.evaluate(model, tokenizer, args.tasks, args.lengths, args.samples, args.max_new_tokens,
                            args.seed, corpus=corpus, metric=args.metric, progress=progress)
    result["config"]["checkpoint"] = str(args.dir)
    result["config"]["rope_parameters"] = getattr(model.config, "rope_parameters", None)
    write_json(result, out / "ruler.json")
    plot(result, out / "ruler.png")
    print(format_table(result))
    print(f"wrote {out / 'ruler.json'} and {out / 'ruler.png'}")
    return 0
