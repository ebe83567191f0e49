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
from gated_attention.progress import Progress


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
    fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(tmp, path)


def configure(parser) -> None:
    parser.add_argument("dir", help="HF checkpoint directory (model + tokenizer)")
    parser.add_argument("--lengths", type=int, nargs="+", required=True, help="target prompt lengths in tokens")
    parser.add_argument("--tasks", nargs="+", default=list(ruler.NO_CORPUS_TASKS), choices=list(ruler.TASKS),
                        metavar="TASK", help=f"tasks (default: all that need no corpus). Valid: {', '.join(ruler.TASKS)}")
    parser.add_argument("--samples", type=int, default=10, help="samples per task and length (default: 10)")
    parser.add_argument("--out", required=True, help="output directory for ruler.json and ruler.png")
    parser.add_argument("--seed", type=int, default=0, help="sample seed (same seed = same prompts)")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="generation budget; default: per task family (niah 64, vt 32, cwe 96, fwe 40, passkey 16)")
    parser.add_argument("--haystack-file", default=None,
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

    corpus = Path(args.haystack_file).read_text() if args.haystack_file else None
    tokenizer = AutoTokenizer.from_pretrained(args.dir)
    model = AutoModelForCausalLM.from_pretrained(args.dir, dtype=getattr(torch, args.dtype)).to(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    prog = Progress(len(args.tasks) * len(args.lengths), "ruler", "cell", heartbeat=True)

    def progress(task, length, value):
        print(f"  {task} @ {length}: {value:.1f}", flush=True)
        prog.update(1, task=task, length=length, score=round(value, 1))

    with prog:
        result = ruler.evaluate(model, tokenizer, args.tasks, args.lengths, args.samples, args.max_new_tokens,
                                args.seed, corpus=corpus, metric=args.metric, progress=progress)
    result["config"]["checkpoint"] = str(args.dir)
    result["config"]["rope_parameters"] = getattr(model.config, "rope_parameters", None)
    write_json(result, out / "ruler.json")
    plot(result, out / "ruler.png")
    print(format_table(result))
    print(f"wrote {out / 'ruler.json'} and {out / 'ruler.png'}")
    return 0
