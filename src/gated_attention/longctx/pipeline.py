"""`gattn longctx`: the paper's Table 5 in small, plus the retrieval mixing that makes it measurable at small scale.

Table 5 (SPEC 3.5): models trained at one length are extended 4x with YaRN and no training; the gated model keeps far
more of its RULER score. At CPU scale:
  1. train a baseline and a gated (sdpa_elementwise) model at length L on the corpus, with a fraction of every batch
     replaced by synthetic retrieval samples (ruler.training_samples, within L) so a tiny model learns the task
     format at all (a model trained on literature alone scores 0 at every length, which measures nothing);
  2. extend each checkpoint 4x with YaRN (extend.extend_checkpoint, original length L), training-free;
  3. score RULER tasks at L/2, L, 2L, 4L with and without YaRN (greedy, KV cache), and perplexity by position up to
     4L on the corpus validation text;
  4. write OUT/report.md (tables), OUT/report.json (every number) and OUT/report.png (score vs length, PPL vs
     position).
Every stage is cached under OUT (runs/<gate>/, runs/<gate>/yarn<factor>/, eval/<gate>-<variant>.json) and reused on a
re-run when its settings match; a half-finished training run resumes from its last checkpoint.

Prompts and retrieval rows both start with the corpus' <|bos|>: corpus windows always do (data.sample_batch), and the
baseline's attention sink forms on that fixed first token, so evaluation must feed it too (`BosTokenizer`).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from gated_attention.io import json_dumps
from gated_attention.longctx import ruler

# training tasks mixed in by default: the noise-haystack retrieval tasks a few-M-parameter model can learn in minutes
DEFAULT_MIX_TASKS = ("passkey", "niah_single_1", "niah_single_word")


# ---------------------------------------------------------------------------------------------------------------------
# Retrieval mixing (used by the trainer through TrainConfig.retrieval_mix, see train/data_source.make_source)
class BosTokenizer:
    """A tokenizer view whose `encode` prepends <|bos|>, so RULER prompts are fed exactly like corpus windows.

    ruler.generate_sample counts tokens with `encode`, so a sample's `length` includes the bos token.
    """

    def __init__(self, tokenizer, bos_id: int):
        self.tokenizer = tokenizer
        self.bos_id = int(bos_id)

    def encode(self, text: str) -> list[int]:
        return [self.bos_id] + list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def __getattr__(self, name):  # pad_token_id, eos_token_id, ...
        return getattr(self.tokenizer, name)


def check_mix_tasks(tasks) -> tuple[str, ...]:
    tasks = tuple(tasks) if tasks else DEFAULT_MIX_TASKS
    for t in tasks:
        if t not in ruler.TASKS:
            raise ValueError(f"retrieval task {t!r} is unknown; valid: {', '.join(ruler.TASKS)}")
        if t in ruler.NEEDS_CORPUS:
            raise ValueError(f"retrieval task {t!r} needs a corpus haystack, which training rows do not carry; "
                             f"use tasks among: {', '.join(ruler.NO_CORPUS_TASKS)}")
    return tasks


def mix_retrieval(batch: torch.Tensor, tokenizer, fraction: float, seed: int, step: int, tasks=None,
                  eos_id: int | None = None) -> torch.Tensor:
    """A copy of `batch` (B, T+1) with round(fraction * B) rows (at least one if fraction > 0) replaced.

    A pure function of (batch, fraction, seed, step, tasks): the rows and the samples are drawn from (seed, step), so
    resumed and multi-rank runs see identical batches. A replaced row is the sample's prompt + answer (tokenized by
    `tokenizer`, whose encode should add <|bos|>, see BosTokenizer), then <|eos|>, then the replaced corpus row's own
    tokens to fill the length, so every position stays an ordinary next-token target (no padding, no loss mask).
    """
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"retrieval fraction {fraction} must be in [0, 1]")
    B, T1 = batch.shape
    k = min(B, max(1, round(fraction * B))) if fraction > 0 else 0
    if k == 0:
        return batch
    tasks = check_mix_tasks(tasks)
    if eos_id is None:
        eos_id = tokenizer.eos_token_id
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, step, 0x52554C])))  # salt "RUL"
    rows = sorted(int(r) for r in rng.choice(B, size=k, replace=False))
    # a per-(seed, step) sample seed; collision-free while step < 1e9
    samples = ruler.training_samples(tokenizer, k, max_len=T1 - 1, seed=seed * 1_000_000_000 + step, tasks=list(tasks))
    out = batch.clone()
    for row, s in zip(rows, samples):
        ids = ruler.encode(tokenizer, s["text"]) + [eos_id]
        ids = ids[:T1]
        filler = batch[row, 1:1 + T1 - len(ids)]  # corpus tokens after the row's own bos
        out[row] = torch.cat([torch.tensor(ids, dtype=batch.dtype), filler])  # (T+1,)
    return out


class RetrievalMixSource:
    """Wraps a corpus training source: every train batch gets `fraction` of its rows replaced (mix_retrieval).

    Everything else (eval batches, domains, tokenizer, vocab size) is the wrapped source's, so validation perplexity
    stays pure corpus text.
    """

    def __init__(self, source, fraction: float, tasks=None):
        corpus = getattr(source, "corpus", None)
        if getattr(source, "tokenizer", None) is None or corpus is None:
            raise ValueError("retrieval_mix needs the prepared corpus (data='corpus'): synthetic tokens have no "
                             "tokenizer to write retrieval samples with")
        self.source = source
        self.fraction = float(fraction)
        self.tasks = check_mix_tasks(tasks)
        self.eos_id = corpus.eos_id
        self.mix_tokenizer = BosTokenizer(source.tokenizer, corpus.bos_id)

    def train_batch(self, batch_size: int, seq_len: int, seed: int, step: int) -> torch.Tensor:
        batch = self.source.train_batch(batch_size, seq_len, seed, step)  # (B, T+1)
        return mix_retrieval(batch, self.mix_tokenizer, self.fraction, seed, step, self.tasks, self.eos_id)

    def __getattr__(self, name):
        return getattr(self.source, name)


# ---------------------------------------------------------------------------------------------------------------------
# Budgets
@dataclass(frozen=True)
class Budget:
    """Everything that sets the cost of a pipeline run; OUT caches are keyed on these values."""
    model: str = "small"  # model preset (gated_attention.presets)
    model_overrides: dict = field(default_factory=dict)  # preset fields to change (narrower = faster on a CPU)
    seq_len: int = 256  # the training length L; evaluation runs at L/2, L, 2L, 4L
    steps: int = 600  # optimizer steps per model
    batch_size: int = 16
    lr: float = 3e-3
    warmup_steps: int = 40
    retrieval_mix: float = 0.5  # share of rows that are retrieval samples: high, so a tiny model learns the format fast
    mix_tasks: tuple = DEFAULT_MIX_TASKS  # trained on and evaluated
    samples: int = 10  # RULER samples per task and length
    max_new_tokens: int = 12  # every default answer (a 5-7 digit number, an adjective-noun pair) fits
    ppl_batches: int = 2  # validation batches per domain for PPL by position (windows of 4L)
    ppl_batch_size: int = 4
    data_dir: str = "data"  # corpus used when --data-dir is not given; prepared (gattn data prepare) if missing
    vocab_size: int = 8192  # BPE vocabulary that corpus is prepared with when missing (1024: one token per digit)


BUDGETS = {
    # seconds to a few minutes: the test and smoke budget (tiny model, a handful of steps, one task)
    "small": Budget(model="tiny", seq_len=256, steps=8, batch_size=4, warmup_steps=2, mix_tasks=("passkey",),
                    samples=1, max_new_tokens=6, ppl_batches=1, ppl_batch_size=2),
    # ~30-40 minutes on two busy shared cores, the two models trained in parallel: passkey only, every training row a
    # retrieval sample (the copy signal is ~10 tokens per row, so it needs every row and thousands of steps), a
    # 1024-token BPE corpus (each digit one token, lm_head 8x cheaper than at 8k), 3 layers x 4 heads of width 128
    "default": Budget(model="small", model_overrides={"hidden_size": 128, "intermediate_size": 384, "head_dim": 32,
                                                      "num_hidden_layers": 3, "num_attention_heads": 4,
                                                      "num_key_value_heads": 2},
                      seq_len=256, steps=2400, batch_size=16, lr=6e-3, warmup_steps=50, retrieval_mix=1.0,
                      mix_tasks=("passkey",), samples=10, max_new_tokens=10, data_dir="data_v1k", vocab_size=1024),
}


def budget_from_args(args) -> Budget:
    if args.budget not in BUDGETS:
        raise ValueError(f"unknown budget {args.budget!r}; valid: {', '.join(BUDGETS)}")
    b = BUDGETS[args.budget]
    changes = {k: getattr(args, k) for k in ("seq_len", "steps", "samples") if getattr(args, k, None) is not None}
    if getattr(args, "tasks", None):
        changes["mix_tasks"] = tuple(args.tasks)
    if getattr(args, "retrieval_mix", None) is not None:
        changes["retrieval_mix"] = args.retrieval_mix
    b = dataclasses.replace(b, **changes)
    check_mix_tasks(b.mix_tasks)
    if b.seq_len < 2 or b.seq_len % 2:
        raise ValueError(f"--seq-len {b.seq_len} must be an even number (evaluation starts at L/2)")
    return b


def lengths_for(b: Budget, factor: int) -> list[int]:
    """L/2, L, 2L, ... up to factor*L."""
    out, L = [b.seq_len // 2], b.seq_len
    while L <= factor * b.seq_len:
        out.append(L)
        L *= 2
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Stages
def _write_json(obj, path: Path) -> None:
    from gated_attention.longctx.ruler_cli import write_json

    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(obj, path)


def train_config_for(b: Budget, gate: str, data_dir: str, seed: int):
    from gated_attention.train.config import TrainConfig

    over = {**b.model_overrides, "max_position_embeddings": b.seq_len}  # the config states the trained length
    # fp32: CPU bf16 autocast is no faster at these widths, and fp32 keeps CPU runs bitwise repeatable
    return TrainConfig(model=b.model, gate=gate, model_overrides=over, data="corpus", data_dir=str(data_dir),
                       seq_len=b.seq_len, batch_size=b.batch_size, steps=b.steps, lr=b.lr, min_lr=b.lr / 100,
                       warmup_steps=b.warmup_steps, retrieval_mix=b.retrieval_mix, precision="fp32",
                       retrieval_tasks=list(b.mix_tasks), seed=seed, eval_every=0, eval_batches=2,
                       eval_batch_size=4, stats_every=0, ckpt_every=max(1, b.steps // 4), keep_checkpoints=1,
                       progress=False, tensorboard=False).validate()


def train_stage(cfg, run_dir: Path, log=print) -> Path:
    """Train (or reuse, or resume) one model; returns its final/ checkpoint directory."""
    from gated_attention.train.checkpoint import latest_checkpoint
    from gated_attention.train.trainer import train

    final = run_dir / "final"
    saved = run_dir / "train_config.json"
    if saved.exists():
        old = json.loads(saved.read_text())
        new = cfg.to_dict()
        defaults = type(cfg)().to_dict()  # a field added to TrainConfig after the run counts as its default
        diff = sorted(k for k in new if old.get(k, defaults[k]) != new[k])
        if diff:
            raise ValueError(f"{run_dir} holds a run with other settings ({', '.join(diff)}); "
                             f"use another --out or delete that folder")
        if (run_dir / "summary.json").exists() and (final / "config.json").exists():
            log(f"[longctx] reuse {run_dir}")
            return final
    resume = latest_checkpoint(run_dir) is not None if run_dir.exists() else False
    log(f"[longctx] train {cfg.gate} at L={cfg.seq_len} for {cfg.steps} steps -> {run_dir}"
        + (" (resuming)" if resume else ""))
    summary = train(cfg, run_dir, resume=resume)
    if summary.get("diverged"):
        raise ValueError(f"training {cfg.gate} diverged ({summary.get('stop_reason')}); lower the learning rate")
    return final


def extend_stage(final: Path, dst: Path, seq_len: int, factor: int, log=print) -> Path:
    from gated_attention.longctx.extend import extend_checkpoint, extended_config

    want = extended_config(json.loads((final / "config.json").read_text()), "yarn", float(factor),
                           original_max_position_embeddings=seq_len)["rope_parameters"]
    cfg_path = dst / "config.json"
    if cfg_path.exists() and json.loads(cfg_path.read_text()).get("rope_parameters") == want \
            and (dst / "model.safetensors").stat().st_mtime >= (final / "model.safetensors").stat().st_mtime:
        log(f"[longctx] reuse {dst}")
        return dst
    extend_checkpoint(final, dst, "yarn", float(factor), original_max_position_embeddings=seq_len, overwrite=True)
    log(f"[longctx] extended {final} -> {dst} (YaRN x{factor} over {seq_len})")
    return dst


def ppl_by_position(model, data_dir: str, length: int, batches: int, batch_size: int, device) -> list[float]:
    """Mean next-token loss at each position 0..length-1 over corpus validation windows (every domain)."""
    from gated_attention.train.data_source import CorpusSource
    from gated_attention.train.evaluate import domain_losses

    source = CorpusSource(data_dir, None)
    res = domain_losses(model, source, seq_len=length, max_batches=batches, batch_size=batch_size, device=device,
                        precision="fp32", positions=True)
    if "pos_loss" not in res:
        raise ValueError(f"no corpus domain in {data_dir} has a validation split of {length} tokens for PPL by "
                         f"position; use a bigger corpus or a shorter --seq-len")
    return res["pos_loss"]


@torch.no_grad()
def answer_nll(model, tokenizer, sample: dict) -> float:
    """Mean NLL (nats/token) of the sample's answer (ruler.completion) after its prompt, teacher-forced.

    A continuous companion to the string-match score: a small model that never gets a key exactly right still shows
    how much of the answer it can recall, and how that recall degrades with length.
    """
    prompt = ruler.encode(tokenizer, sample["prompt"])
    answer = list(tokenizer.tokenizer.encode(ruler.completion(sample), add_special_tokens=False))
    ids = torch.tensor([prompt + answer], device=next(model.parameters()).device)  # (1, T)
    logits = model(input_ids=ids[:, :-1], logits_to_keep=len(answer)).logits[0]  # (A, V)
    return float(torch.nn.functional.cross_entropy(logits.float(), ids[0, -len(answer):]))


def bucket_ppl(pos_loss: list[float], edges: list[int]) -> list[float]:
    """exp(mean loss) over each [edges[i], edges[i+1]) position range."""
    return [math.exp(sum(pos_loss[a:b]) / (b - a)) for a, b in zip(edges, edges[1:])]


def eval_stage(model_dir: Path, out_json: Path, b: Budget, lengths: list[int], data_dir: str, seed: int,
               log=print) -> dict:
    """RULER scores by length and PPL by position of one checkpoint (cached in out_json)."""
    import gated_attention  # noqa: F401  (registers the model classes)
    from gated_attention.data import Corpus
    from gated_attention.modeling import GatedQwen3ForCausalLM

    settings = dict(model=str(model_dir), tasks=list(b.mix_tasks), lengths=lengths, samples=b.samples,
                    max_new_tokens=b.max_new_tokens, seed=seed, ppl_batches=b.ppl_batches,
                    ppl_batch_size=b.ppl_batch_size, answer_nll=True, mtime=(model_dir / "model.safetensors").stat().st_mtime)
    if out_json.exists():
        cached = json.loads(out_json.read_text())
        if cached.get("settings") == settings:
            log(f"[longctx] reuse {out_json}")
            return cached
    corpus = Corpus(data_dir)
    tok = BosTokenizer(corpus.tokenizer, corpus.bos_id)
    device = torch.device("cpu")
    model = GatedQwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    model.generation_config.eos_token_id = corpus.eos_id
    name = f"{model_dir.parent.name}/{model_dir.name}"
    scores: dict[str, dict[str, float | None]] = {t: {} for t in b.mix_tasks}
    nll: dict[str, dict[str, float | None]] = {t: {} for t in b.mix_tasks}
    records = []
    for task in b.mix_tasks:
        for n in lengths:
            try:
                res = ruler.evaluate(model, tok, [task], [n], b.samples, b.max_new_tokens, seed)
            except ValueError as exc:
                # the bare prompt of this task is longer than n (L/2 with a short L): no score, shown as "-"
                if "empty haystack" not in str(exc):
                    raise
                log(f"  {name} {task} @ {n}: the prompt does not fit, no score")
                scores[task][str(n)] = nll[task][str(n)] = None
                continue
            scores[task][str(n)] = res["scores"][task][n]
            for rec in res["records"]:
                sample = ruler.generate_sample(task, tok, n, seed, rec["index"])
                rec["answer_nll"] = answer_nll(model, tok, sample)
            nll[task][str(n)] = sum(r["answer_nll"] for r in res["records"]) / len(res["records"])
            records += res["records"]
            log(f"  {name} {task} @ {n}: {scores[task][str(n)]:.1f}")
    average, average_nll = {}, {}
    for n in lengths:  # over the tasks that fit at n
        got = [scores[t][str(n)] for t in b.mix_tasks if scores[t][str(n)] is not None]
        average[str(n)] = sum(got) / len(got) if got else None
        got = [nll[t][str(n)] for t in b.mix_tasks if nll[t][str(n)] is not None]
        average_nll[str(n)] = sum(got) / len(got) if got else None
    pos = ppl_by_position(model, data_dir, max(lengths), b.ppl_batches, b.ppl_batch_size, device)
    out = dict(settings=settings, scores=scores, average=average, answer_nll=nll, average_answer_nll=average_nll,
               records=records, pos_loss=pos,
               rope_parameters=model.config.rope_parameters)
    _write_json(out, out_json)
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Report
VARIANTS = ("none", "yarn")


def _label(gate: str) -> str:
    return "Baseline" if gate == "baseline" else f"Gated ({gate})"


def _sub(a, b):
    return None if a is None or b is None else a - b


def _fmt(v, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def build_report(results: dict, b: Budget, lengths: list[int], factor: int, gates: list[str]) -> dict:
    L = b.seq_len
    edges = [0, L] + [L * 2 ** i for i in range(1, int(math.log2(factor)) + 1)]
    rows = []
    for variant in VARIANTS:
        for gate in gates:
            r = results[(gate, variant)]
            avg = {int(k): v for k, v in r["average"].items()}
            row = dict(gate=gate, variant=variant, average=avg,
                       drop_from_L={n: _sub(avg[n], avg[L]) for n in lengths if n > L},  # extrapolation loss
                       tasks={t: {int(k): v for k, v in s.items()} for t, s in r["scores"].items()},
                       answer_nll={int(k): v for k, v in r["average_answer_nll"].items()},
                       ppl_buckets=dict(zip([f"{a}-{c}" for a, c in zip(edges, edges[1:])],
                                            bucket_ppl(r["pos_loss"], edges))))
            if variant == "yarn":
                base = {int(k): v for k, v in results[(gate, "none")]["average"].items()}
                row["delta"] = {n: _sub(avg[n], base[n]) for n in lengths}
            rows.append(row)
    return dict(train_length=L, factor=factor, lengths=lengths, gates=gates, budget=dataclasses.asdict(b),
                rows=rows, pos_loss={f"{g}-{v}": results[(g, v)]["pos_loss"] for g in gates for v in VARIANTS})


def format_markdown(rep: dict) -> str:
    L, factor, lengths = rep["train_length"], rep["factor"], rep["lengths"]
    b = rep["budget"]

    def name(row):
        label = _label(row["gate"])
        return f"{label} ({L} model)" if row["variant"] == "none" else f"{label} + YaRN -> {factor * L}"

    out = [f"# Table 5 in small: RULER average (%) by context length (trained at L={L})", "",
           f"Tasks {', '.join(b['mix_tasks'])}; {b['samples']} samples per task and length; model preset "
           f"{b['model']}{' ' + json.dumps(b['model_overrides']) if b['model_overrides'] else ''}, {b['steps']} steps x {b['batch_size']} x {L} tokens, "
           f"retrieval mix {b['retrieval_mix']}. YaRN rows: in brackets the change against the same model without "
           f"YaRN at that length (the paper's deltas). Lengths above L are beyond the training length. Averages are over "
           f"the tasks whose prompt fits the length; '-' = none fits.", "",
           "| Method | " + " | ".join(str(n) for n in lengths) + " |",
           "|---|" + "---|" * len(lengths)]
    for row in rep["rows"]:
        cells = []
        for n in lengths:
            c = _fmt(row["average"][n])
            if row["variant"] == "yarn" and row["delta"][n] is not None:
                c += f" ({row['delta'][n]:+.1f})"
            cells.append(c)
        out.append(f"| {name(row)} | " + " | ".join(cells) + " |")
    longer = [n for n in lengths if n > L]
    out += ["", f"## Degradation beyond the training length: score at n minus score at L={L}", "",
            "| Method | " + " | ".join(str(n) for n in longer) + " |", "|---|" + "---|" * len(longer)]
    for row in rep["rows"]:
        out.append(f"| {name(row)} | " + " | ".join(_fmt(row['drop_from_L'][n], "+.1f") for n in longer) + " |")
    out += ["", "## Answer NLL (nats/token, teacher-forced, lower is better): recall that string match cannot see",
            "", "| Method | " + " | ".join(str(n) for n in lengths) + " |", "|---|" + "---|" * len(lengths)]
    for row in rep["rows"]:
        out.append(f"| {name(row)} | " + " | ".join(_fmt(row['answer_nll'][n], ".3f") for n in lengths) + " |")
    out += ["", "## Per task", "", "| Method | Task | " + " | ".join(str(n) for n in lengths) + " |",
            "|---|---|" + "---|" * len(lengths)]
    for row in rep["rows"]:
        for t, s in row["tasks"].items():
            out.append(f"| {name(row)} | {t} | " + " | ".join(_fmt(s[n]) for n in lengths) + " |")
    buckets = list(rep["rows"][0]["ppl_buckets"])
    out += ["", "## Perplexity by position on corpus validation text (positions beyond L are extrapolation)", "",
            "| Method | " + " | ".join(f"pos {k}" for k in buckets) + " |", "|---|" + "---|" * len(buckets)]
    for row in rep["rows"]:
        out.append(f"| {name(row)} | " + " | ".join(f"{row['ppl_buckets'][k]:.2f}" for k in buckets) + " |")
    return "\n".join(out) + "\n"


def plot_report(rep: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # headless
    import matplotlib.pyplot as plt

    L, lengths = rep["train_length"], rep["lengths"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = {g: c for g, c in zip(rep["gates"], ["tab:blue", "tab:red", "tab:green", "tab:purple"])}
    for row in rep["rows"]:
        ls = "-" if row["variant"] == "none" else "--"
        label = _label(row["gate"]) + (" + YaRN" if row["variant"] == "yarn" else "")
        ax1.plot(lengths, [np.nan if row["average"][n] is None else row["average"][n] for n in lengths], ls, marker="o", color=colors[row["gate"]], label=label)
        pos = np.asarray(rep["pos_loss"][f"{row['gate']}-{row['variant']}"])
        w = max(1, len(pos) // 64)  # average over windows of positions: single positions are noisy
        n = len(pos) // w
        ax2.plot(np.arange(n) * w + w / 2, np.exp(pos[:n * w].reshape(n, w).mean(1)), ls,
                 color=colors[row["gate"]], label=label)
    for ax in (ax1, ax2):
        ax.axvline(L, color="gray", lw=1, ls=":")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax1.set_xscale("log", base=2)
    ax1.set_xticks(lengths, [str(n) for n in lengths])
    ax1.set_xlabel("context length (tokens); dotted = training length")
    ax1.set_ylabel("RULER average (%)")
    ax1.set_ylim(-3, 103)
    ax2.set_xlabel("position (tokens)")
    ax2.set_ylabel("perplexity (corpus validation)")
    ax2.set_yscale("log")
    fig.tight_layout()
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp.png")  # per process, as the markdown's
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------------------------------
# The pipeline
def ensure_corpus(data_dir: str, vocab_size: int, log=print) -> str:
    """Prepare the default corpus in `data_dir` with `vocab_size` if it has no manifest yet (cached by the data module)."""
    from gated_attention import data

    if not (Path(data_dir) / "manifest.json").exists():
        log(f"[longctx] {data_dir} is not prepared: running `gattn data prepare --data-dir {data_dir} "
            f"--vocab-size {vocab_size}` first")
        data.prepare(data.PrepareConfig(data_dir=str(data_dir), vocab_size=vocab_size))
    return str(data_dir)


def run_pipeline(out_dir, b: Budget, data_dir: str | None = None, gates=("baseline", "sdpa_elementwise"),
                 factor: int = 4, seed: int = 0, log=print) -> dict:
    """Train, extend, evaluate and report (see the module docstring); returns the report dict.

    data_dir=None uses the budget's corpus (b.data_dir, prepared with b.vocab_size if missing).
    """
    if factor < 2 or factor & (factor - 1):
        raise ValueError(f"--factor {factor} must be a power of two >= 2 (lengths double from L to factor*L)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lengths = lengths_for(b, factor)
    gates = list(gates)
    from gated_attention.data import Corpus

    data_dir = ensure_corpus(b.data_dir, b.vocab_size, log) if data_dir is None else str(data_dir)
    corpus = Corpus(data_dir)
    tok = BosTokenizer(corpus.tokenizer, corpus.bos_id)
    for task in b.mix_tasks:  # fail now, not after training, if a task cannot even be posed at L
        try:
            ruler.generate_sample(task, tok, b.seq_len, seed)
        except ValueError as exc:
            raise ValueError(f"task {task!r} does not fit the training length {b.seq_len} ({exc}); "
                             f"use a longer --seq-len or other --tasks") from None
    results = {}
    for gate in gates:
        run_dir = out / "runs" / gate
        final = train_stage(train_config_for(b, gate, data_dir, seed), run_dir, log)
        yarn = extend_stage(final, run_dir / f"yarn{factor}", b.seq_len, factor, log)
        for variant, model_dir in (("none", final), ("yarn", yarn)):
            results[(gate, variant)] = eval_stage(model_dir, out / "eval" / f"{gate}-{variant}.json", b, lengths,
                                                  data_dir, seed, log)
    rep = build_report(results, b, lengths, factor, gates)
    md = format_markdown(rep)
    _write_json(json.loads(json_dumps(rep)), out / "report.json")  # int length keys become strings, as JSON has them
    tmp = out / f".report.md.{os.getpid()}.tmp"  # per process: one-gate runs in parallel share OUT
    tmp.write_text(md)
    os.replace(tmp, out / "report.md")
    plot_report(rep, out / "report.png")
    log(md)
    log(f"[longctx] wrote {out / 'report.md'}, {out / 'report.json'}, {out / 'report.png'}")
    return rep


def configure(parser) -> None:
    from gated_attention import errors as E  # argparse types: numbers/paths checked where they enter

    parser.add_argument("--budget", choices=list(BUDGETS), default="default",
                        help="cost preset: small (tiny model, seconds-minutes, for tests) or default (3-layer model on "
                             "a 1k-vocab corpus, 2400 steps per model: ~35-50 min per model on a busy 2-core CPU; "
                             "run one --gates per process in parallel into the same --out, then once with both to "
                             "combine the cached stages)")
    parser.add_argument("--out", type=E.out_dir, default="runs/longctx", help="output folder; finished stages in it are reused")
    parser.add_argument("--data-dir", type=E.existing_dir, default=None,
                        help="prepared corpus (gattn data prepare); default: the budget's (prepared if missing)")
    parser.add_argument("--gates", nargs="+", default=["baseline", "sdpa_elementwise"],
                        help="gate variants to compare (default: baseline sdpa_elementwise)")
    parser.add_argument("--factor", type=E.positive_int, default=4, help="YaRN extension factor, a power of two (default 4)")
    parser.add_argument("--seq-len", type=E.positive_int, default=None, help="training length L (default: the budget's)")
    parser.add_argument("--steps", type=E.positive_int, default=None, help="training steps per model (default: the budget's)")
    parser.add_argument("--samples", type=E.positive_int, default=None, help="RULER samples per task and length")
    parser.add_argument("--tasks", nargs="+", default=None, metavar="TASK",
                        help=f"RULER tasks trained on and scored (no-corpus ones: {', '.join(ruler.NO_CORPUS_TASKS)})")
    parser.add_argument("--retrieval-mix", type=E.nonneg_float, default=None,
                        help="fraction of training rows replaced by retrieval samples (default: the budget's)")
    parser.add_argument("--seed", type=E.nonneg_int, default=0, help="training and sample seed")


def run(args) -> int:
    from gated_attention.io import lock_dir

    with lock_dir(args.out, "gattn longctx"):  # one writer per output folder
        run_pipeline(args.out, budget_from_args(args), args.data_dir, args.gates, args.factor, args.seed)
    return 0
