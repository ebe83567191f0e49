"""RULER-style long-context evaluation (Hsieh et al. 2024): greedy decoding on the synthetic tasks, scored by length.

The tasks themselves (generators, vocabularies, scoring) live in the data layer, gated_attention/data/ruler_tasks.py,
and are re-exported here so `from gated_attention.longctx import ruler; ruler.generate_sample(...)` keeps working.
`format_table` / `plot_scores` render an `evaluate` result (`gattn ruler` writes them).
"""
from __future__ import annotations

from pathlib import Path

# torch is imported inside the functions that run a model: the task tables load without it

from gated_attention.data.ruler_tasks import *  # noqa: F401,F403  (the task API, re-exported)
from gated_attention.data.ruler_tasks import (METRICS, NEEDS_CORPUS, NO_CORPUS_TASKS, _fit, _spec, decode,  # noqa: F401
                                              encode, generate_sample, score)
from gated_attention.experiment.pages import subplots
from gated_attention.util.io import locks_output, save_png


# ---------------------------------------------------------------------------------------------------------------------
# Evaluation with greedy decoding
def _first_line(text: str) -> str:
    # the answer is the first line of the continuation: later lines are the model rambling into a new "document"
    return text.strip().split("\n")[0]


def predict(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    """Greedy continuation of `prompt` with the KV cache (model.generate), decoded without special tokens."""
    import torch

    ids = torch.tensor([encode(tokenizer, prompt)], device=next(model.parameters()).device)  # (1, T)
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        pad = getattr(tokenizer, "eos_token_id", None)
    if pad is None:
        pad = getattr(getattr(model, "generation_config", None), "eos_token_id", None) or 0
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, use_cache=True, pad_token_id=pad)  # (1, T + new)
    return decode(tokenizer, out[0, ids.shape[1]:].tolist())


def evaluate(model, tokenizer, tasks, lengths, samples: int = 10, max_new_tokens: int | None = None, seed: int = 0,
             corpus: str | None = None, metric: str = "all", progress=None) -> dict:
    """Score `model` on each task x length with `samples` samples (greedy decoding, KV cache, batch 1).

    max_new_tokens=None uses each task family's default. Returns dict(scores={task: {length: %}}, average={length: %},
    records=[per-sample dicts with prompt length, answers, prediction, score], config={...}).
    """
    tasks, lengths = list(tasks), [int(x) for x in lengths]
    for t in tasks:
        _spec(t)
        if t in NEEDS_CORPUS and not corpus:
            raise ValueError(f"task {t!r} needs corpus text for its haystack; pass corpus= or drop it "
                             f"(tasks without corpus: {', '.join(NO_CORPUS_TASKS)})")
    was_training = model.training
    model.eval()
    scores: dict[str, dict[int, float]] = {t: {} for t in tasks}
    records = []
    try:
        for task in tasks:
            for length in lengths:
                preds, refs = [], []
                for i in range(samples):
                    s = generate_sample(task, tokenizer, length, seed, i, corpus)
                    budget = max_new_tokens or s["max_new_tokens"]
                    pred = predict(model, tokenizer, s["prompt"], budget)
                    preds.append(_first_line(pred))
                    refs.append(s["answers"])
                    records.append(dict(task=task, target_length=length, length=s["length"], index=i,
                                        answers=s["answers"], prediction=pred,
                                        score=METRICS[metric](preds[-1], s["answers"])))
                scores[task][length] = score(preds, refs, metric)
                if progress is not None:
                    progress(task, length, scores[task][length])
    finally:
        model.train(was_training)
    average = {L: sum(scores[t][L] for t in tasks) / len(tasks) for L in lengths}
    return dict(scores=scores, average=average, records=records,
                config=dict(tasks=tasks, lengths=lengths, samples=samples, max_new_tokens=max_new_tokens,
                            seed=seed, metric=metric))


# ---------------------------------------------------------------------------------------------------------------------
# Rendering a result
def format_table(result: dict) -> str:
    lengths = result["config"]["lengths"]
    rows = list(result["scores"].items()) + [("average", result["average"])]
    width = max(len(name) for name, _ in rows)
    lines = [f"{'task':<{width}} " + " ".join(f"{L:>8}" for L in lengths)]
    for name, by_len in rows:
        lines.append(f"{name:<{width}} " + " ".join(f"{by_len[L]:8.1f}" for L in lengths))
    return "\n".join(lines)


def plot_scores(result: dict, path: Path) -> None:
    """Score vs length per task, plus the average (a PNG, written atomically)."""
    lengths = result["config"]["lengths"]
    fig, ax = subplots(figsize=(7, 4.5))
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
    save_png(fig, path, dpi=120)


@locks_output("out", "gattn ruler")  # one writer per output folder
def evaluate_folder(folder, out, tasks: list[str], lengths: list[int], samples: int = 10, seed: int = 0,
                    max_new_tokens: int | None = None, haystack_file: str | None = None, metric: str = "all",
                    device: str = "cpu", dtype: str = "float32", echo=print) -> dict:
    """`gattn ruler DIR`: RULER scores by task and length of an HF checkpoint folder (model + tokenizer), written to
    OUT/ruler.json and OUT/ruler.png; `echo` gets one line per scored cell. Returns the result."""
    import torch

    from transformers import AutoModelForCausalLM, AutoTokenizer

    import gated_attention.modeling  # noqa: F401  (registers the Auto classes)
    from gated_attention.data.tokenizer import check_vocab_fits
    from gated_attention.util.errors import UserError
    from gated_attention.util.io import atomic_write_json, check_hf_dir
    from gated_attention.util.progress import Progress

    check_hf_dir(folder)  # a folder, config.json parses, weights present and intact (else one line)
    corpus = Path(haystack_file).read_text(encoding="utf-8") if haystack_file else None
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as exc:  # no tokenizer files beside the weights (transformers' long message)
        raise UserError(f"{folder} holds no tokenizer ({type(exc).__name__}); save the model's tokenizer into it "
                        "(a run's final/ has it; `tokenizer.save_pretrained(DIR)`)") from None
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).to(device)
    check_vocab_fits(len(tokenizer), model.get_input_embeddings().num_embeddings, f"the tokenizer in {folder}",
                     str(folder))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    prog = Progress(len(tasks) * len(lengths), "ruler", "cell", heartbeat=True)

    def progress(task, length, value):
        echo(f"  {task} @ {length}: {value:.1f}")
        prog.update(1, task=task, length=length, score=round(value, 1))

    with prog:
        result = evaluate(model, tokenizer, tasks, lengths, samples, max_new_tokens, seed, corpus=corpus,
                          metric=metric, progress=progress)
    result["config"]["checkpoint"] = str(folder)
    result["config"]["rope_parameters"] = getattr(model.config, "rope_parameters", None)
    atomic_write_json(out / "ruler.json", result, indent=2)
    plot_scores(result, out / "ruler.png")
    return result
