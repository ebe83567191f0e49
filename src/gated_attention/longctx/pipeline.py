"""`gattn longctx`: the paper's Table 5 in small (the stages; the report is longctx/report.py, the retrieval mixing
that makes it measurable at small scale is training-data code, train/retrieval_mix.py).

Table 5 (paper map §3.5): models trained at one length are extended 4x with YaRN and no training; the gated model keeps far
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

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gated_attention import experiment
from gated_attention.io import atomic_write_json, atomic_write_text
from gated_attention.longctx import ruler
from gated_attention.longctx.report import build_report, format_markdown, plot_report
# retrieval mixing is training-data code; re-exported here for callers of the pipeline's former home
from gated_attention.train.retrieval_mix import (DEFAULT_MIX_TASKS, BosTokenizer, RetrievalMixSource,  # noqa: F401
                                                 check_mix_tasks, mix_retrieval)

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


def lengths_for(b: Budget, factor: int) -> list[int]:
    """L/2, L, 2L, ... up to factor*L."""
    out, L = [b.seq_len // 2], b.seq_len
    while L <= factor * b.seq_len:
        out.append(L)
        L *= 2
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Stages
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
    """Train (or reuse, or resume) one model (experiment.train_or_reuse); returns its final/ checkpoint directory."""
    summary = experiment.train_or_reuse(cfg, run_dir, log, "[longctx]")
    if summary.get("diverged"):
        raise ValueError(f"training {cfg.gate} diverged ({summary.get('stop_reason')}); lower the learning rate")
    return run_dir / "final"


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


def eval_stage(model_dir: Path, out_json: Path, b: Budget, lengths: list[int], data_dir: str, seed: int,
               log=print) -> dict:
    """RULER scores by length and PPL by position of one checkpoint (cached in out_json)."""
    settings = dict(model=str(model_dir), tasks=list(b.mix_tasks), lengths=lengths, samples=b.samples,
                    max_new_tokens=b.max_new_tokens, seed=seed, ppl_batches=b.ppl_batches,
                    ppl_batch_size=b.ppl_batch_size, answer_nll=True, mtime=(model_dir / "model.safetensors").stat().st_mtime)
    return experiment.cached(out_json, settings, lambda: _evaluate(model_dir, b, lengths, data_dir, seed, log), log,
                             "[longctx]", indent=2)


def _evaluate(model_dir: Path, b: Budget, lengths: list[int], data_dir: str, seed: int, log) -> dict:
    import gated_attention  # noqa: F401  (registers the model classes)
    from gated_attention.data import Corpus
    from gated_attention.modeling import GatedQwen3ForCausalLM

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
    return dict(scores=scores, average=average, answer_nll=nll, average_answer_nll=average_nll, records=records,
                pos_loss=pos, rope_parameters=model.config.rope_parameters)


# ---------------------------------------------------------------------------------------------------------------------
# The pipeline
def ensure_corpus(data_dir: str, vocab_size: int, log=print) -> str:
    """Prepare the default corpus in `data_dir` with `vocab_size` if it has no manifest yet (experiment.ensure_corpus)."""
    return str(experiment.ensure_corpus(data_dir, vocab_size, log, "[longctx]"))


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
    atomic_write_json(out / "report.json", rep, indent=2)  # int length keys become strings, as JSON has them
    atomic_write_text(out / "report.md", md)  # unique temp file per write: one-gate runs in parallel share OUT
    plot_report(rep, out / "report.png")
    log(md)
    log(f"[longctx] wrote {out / 'report.md'}, {out / 'report.json'}, {out / 'report.png'}")
    return rep
