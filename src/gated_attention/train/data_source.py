"""Where training batches come from: the prepared corpus (gated_attention.data) or built-in synthetic tokens.

Both give the batch at a step as a pure function of (seed, step), so data order needs no state beyond the step and
resuming, or changing the number of ranks, sees exactly the same global batches: the data position in a checkpoint
is its step. The corpus has two samplers (TrainConfig.sampler): "random" windows drawn with replacement
(data.sample_batch, the default every recorded result used) and "epoch", every window once per epoch in a seeded
order, optionally over documents packed with BOS separators (data/epoch.py). `train_batch(..., rows=slice)` returns only those rows of the global batch (a rank's share); the corpus
reads only their tokens from the memory-mapped shards.

Synthetic data is a fixed random first-order Markov chain (each token has 4 successors, one of them likely), so a
model can learn it quickly; tests and smoke runs use it so they need no prepared corpus.
"""
from __future__ import annotations

import torch


class SyntheticSource:
    domains = ["synthetic"]
    tokenizer = None
    _SPLIT_SALT = {"train": 0, "val": 1_000_003}

    def __init__(self, vocab_size: int, chain_seed: int = 1234):
        g = torch.Generator().manual_seed(chain_seed)
        self.vocab_size = vocab_size
        self.successors = torch.randint(0, vocab_size, (vocab_size, 4), generator=g)  # (V, 4)
        self.probs = torch.tensor([0.7, 0.1, 0.1, 0.1])

    def _sample(self, batch_size: int, seq_len: int, seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        out = torch.empty(batch_size, seq_len + 1, dtype=torch.long)  # (B, T+1)
        out[:, 0] = torch.randint(0, self.vocab_size, (batch_size,), generator=g)
        choice = torch.multinomial(self.probs.expand(batch_size, 4), seq_len, replacement=True, generator=g)  # (B, T)
        for t in range(seq_len):
            out[:, t + 1] = self.successors[out[:, t], choice[:, t]]
        return out

    def train_batch(self, batch_size: int, seq_len: int, seed: int, step: int, rows: slice | None = None
                    ) -> torch.Tensor:
        batch = self._sample(batch_size, seq_len, seed * 1_000_000_007 + step)  # (B, T+1): rows are drawn jointly
        return batch if rows is None else batch[rows]

    def eval_batches(self, domain: str, seq_len: int, max_batches: int, batch_size: int):
        for i in range(max_batches):
            yield self._sample(batch_size, seq_len, self._SPLIT_SALT["val"] + i)


class CorpusSource:
    """Adapter over gated_attention.data (Corpus, sample_batch or EpochSampler, eval_batches, get_tokenizer)."""

    def __init__(self, data_dir: str | None, domains: list[str] | None, sampler: str = "random",
                 pack_documents: bool = False):
        from gated_attention import data

        self._data = data
        self.corpus = data.Corpus(data_dir) if data_dir is not None else data.Corpus()  # default: ./data
        self.tokenizer = self.corpus.tokenizer
        self.vocab_size = self.corpus.vocab_size
        available = list(self.corpus.domains)
        if domains:
            missing = [d for d in domains if d not in available]
            if missing:
                raise ValueError(f"domains {missing} are not in the corpus; available: {', '.join(available)}")
        self.train_domains = domains
        self.domains = list(domains) if domains else available
        if sampler not in ("random", "epoch") or (pack_documents and sampler != "epoch"):
            raise ValueError(f"sampler={sampler!r}, pack_documents={pack_documents}: use sampler 'random' or "
                             "'epoch'; pack_documents needs 'epoch'")
        self.sampler, self.pack_documents = sampler, pack_documents
        self._epoch: dict[int, object] = {}  # seq_len -> EpochSampler (its window counts and document index)

    def epoch_sampler(self, seq_len: int):
        if seq_len not in self._epoch:
            from gated_attention.data.epoch import EpochSampler

            self._epoch[seq_len] = EpochSampler(self.corpus, "train", seq_len, self.train_domains,
                                                self.pack_documents)
        return self._epoch[seq_len]

    def train_batch(self, batch_size: int, seq_len: int, seed: int, step: int, rows: slice | None = None
                    ) -> torch.Tensor:
        if self.sampler == "epoch":
            return self.epoch_sampler(seq_len).batch(batch_size, seed, step, rows=rows)
        return self._data.sample_batch(self.corpus, "train", batch_size, seq_len, seed, step,
                                       domains=self.train_domains, rows=rows)

    def eval_batches(self, domain: str, seq_len: int, max_batches: int, batch_size: int):
        return self._data.eval_batches(self.corpus, domain, seq_len, max_batches, batch_size)


def make_source(cfg, model_vocab_size: int | None = None):
    if cfg.data == "synthetic":
        return SyntheticSource(model_vocab_size or 256)
    source = CorpusSource(cfg.data_dir, cfg.domains, cfg.sampler, cfg.pack_documents)
    if getattr(cfg, "retrieval_mix", 0.0) > 0:  # longctx: some rows become synthetic retrieval samples
        from .retrieval_mix import RetrievalMixSource

        source = RetrievalMixSource(source, cfg.retrieval_mix, cfg.retrieval_tasks)
    return source


# a budget past this many passes over the training tokens mostly memorises them: `gattn train` says so
MANY_EPOCHS = 4.0


def epochs_note(cfg, source) -> str | None:
    """One line when the run's token budget (steps x batch x seq_len) is more than MANY_EPOCHS passes over the
    training tokens of `source`'s corpus (the domains it trains on), else None (also for sources without a corpus)."""
    corpus = getattr(source, "corpus", None)
    if corpus is None:
        return None
    domains = getattr(source, "train_domains", None) or corpus.domains
    have = sum(corpus.num_tokens(d, "train") for d in domains)
    budget = cfg.steps * cfg.batch_size * cfg.seq_len
    if have <= 0 or budget <= MANY_EPOCHS * have:
        return None
    return (f"warning: the run's {budget:,} training tokens are {budget / have:.1f} epochs of the corpus's {have:,} "
            f"({corpus.data_dir}): the model will mostly memorise it; pass --data-dir with a larger corpus (`gattn "
            "data prepare --extra ...`) or fewer --set steps=")
