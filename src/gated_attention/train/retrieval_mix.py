"""Retrieval mixing: training batches where a share of the rows are synthetic RULER retrieval samples.

Used by the trainer through TrainConfig.retrieval_mix (train/data_source.make_source) so a tiny model learns the
long-context task format at all (`gattn longctx`). Imports only the task generators (data/ruler_tasks.py).
"""
from __future__ import annotations

import numpy as np
# torch is imported inside the functions that build batches: DEFAULT_MIX_TASKS and the checks load without it

from ..data import ruler_tasks

# training tasks mixed in by default: the noise-haystack retrieval tasks a few-M-parameter model can learn in minutes
DEFAULT_MIX_TASKS = ("passkey", "niah_single_1", "niah_single_word")


class BosTokenizer:
    """A tokenizer view whose `encode` prepends <|bos|>, so RULER prompts are fed exactly like corpus windows.

    ruler_tasks.generate_sample counts tokens with `encode`, so a sample's `length` includes the bos token.
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
        if t not in ruler_tasks.TASKS:
            raise ValueError(f"retrieval task {t!r} is unknown; valid: {', '.join(ruler_tasks.TASKS)}")
        if t in ruler_tasks.NEEDS_CORPUS:
            raise ValueError(f"retrieval task {t!r} needs a corpus haystack, which training rows do not carry; "
                             f"use tasks among: {', '.join(ruler_tasks.NO_CORPUS_TASKS)}")
    return tasks


def mix_retrieval(batch: torch.Tensor, tokenizer, fraction: float, seed: int, step: int, tasks=None,
                  eos_id: int | None = None) -> torch.Tensor:
    """A copy of `batch` (B, T+1) with round(fraction * B) rows (at least one if fraction > 0) replaced.

    A pure function of (batch, fraction, seed, step, tasks): the rows and the samples are drawn from (seed, step), so
    resumed and multi-rank runs see identical batches. A replaced row is the sample's prompt + answer (tokenized by
    `tokenizer`, whose encode should add <|bos|>, see BosTokenizer), then <|eos|>, then the replaced corpus row's own
    tokens to fill the length, so every position stays an ordinary next-token target (no padding, no loss mask).
    """
    import torch

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
    samples = ruler_tasks.training_samples(tokenizer, k, max_len=T1 - 1, seed=seed * 1_000_000_000 + step, tasks=list(tasks))
    out = batch.clone()
    for row, s in zip(rows, samples):
        ids = ruler_tasks.encode(tokenizer, s["text"]) + [eos_id]
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

    def train_batch(self, batch_size: int, seq_len: int, seed: int, step: int, rows: slice | None = None
                    ) -> torch.Tensor:
        batch = self.source.train_batch(batch_size, seq_len, seed, step)  # (B, T+1): the mix picks rows globally
        batch = mix_retrieval(batch, self.mix_tokenizer, self.fraction, seed, step, self.tasks, self.eos_id)
        return batch if rows is None else batch[rows]

    def __getattr__(self, name):
        return getattr(self.source, name)
