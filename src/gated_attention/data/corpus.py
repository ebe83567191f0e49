"""A prepared corpus on disk (`Corpus`: memory-mapped token files, tokenizer) and the pure-function batch sampler."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from .text import BOS, EOS, PAD, MANIFEST_VERSION, sha256_file
from .tokenizer import get_tokenizer

# ----------------------------------------------------------------------------------------------------------------
# Reading a prepared corpus, and the batch sampler
# ----------------------------------------------------------------------------------------------------------------

SPLITS = ("train", "val")


class TokenShards:
    """One (domain, split)'s token stream over its memory-mapped shard files, read like a 1-D array.

    `len`, `dtype`, integer and slice indexing (a slice that crosses a shard boundary is copied together) and
    `np.asarray` / `astype` (the whole stream: small corpora and tests only). Opening maps the files; nothing is read until
    indexed, so memory does not grow with the corpus.
    """

    def __init__(self, paths: Sequence[Path], sizes: Sequence[int], dtype: np.dtype):
        self.dtype = np.dtype(dtype)
        self.shards = [np.memmap(p, dtype=self.dtype, mode="r") for p, n in zip(paths, sizes) if n > 0]
        self.offsets = np.cumsum([0] + [len(a) for a in self.shards])  # (S+1,) first index of each shard
        if len(self.shards) and [len(a) for a in self.shards] != [n for n in sizes if n > 0]:
            raise ValueError(f"token shard sizes differ from the manifest ({paths[0].parent}); "
                             f"re-run `gattn data prepare`")

    def __len__(self) -> int:
        return int(self.offsets[-1])

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    def __getitem__(self, key):
        n = len(self)
        if isinstance(key, slice):
            start, stop, step = key.indices(n)
            if step != 1:
                return np.asarray(self)[key]
            if stop <= start:
                return np.zeros(0, dtype=self.dtype)
            first = int(np.searchsorted(self.offsets, start, side="right")) - 1
            parts, pos, s = [], start, first
            while pos < stop:
                lo = pos - int(self.offsets[s])
                take = min(stop, int(self.offsets[s + 1])) - pos
                parts.append(self.shards[s][lo:lo + take])
                pos += take
                s += 1
            return np.array(parts[0]) if len(parts) == 1 else np.concatenate(parts)
        i = int(key)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"token index {key} out of range for {n} tokens")
        s = int(np.searchsorted(self.offsets, i, side="right")) - 1
        return self.shards[s][i - int(self.offsets[s])]

    def astype(self, dtype) -> np.ndarray:
        return np.asarray(self).astype(dtype)

    def __array__(self, dtype=None, copy=None):
        arr = np.concatenate(self.shards) if self.shards else np.zeros(0, dtype=self.dtype)
        return arr.astype(dtype) if dtype is not None else arr


class Corpus:
    """A prepared data dir: `.domains`, `.tokens(domain, split)` (read-only np.memmap), `.vocab_size`, `.tokenizer`."""

    def __init__(self, data_dir: str | os.PathLike = "data"):
        self.data_dir = Path(data_dir)
        path = self.data_dir / "manifest.json"
        if not path.exists():
            raise FileNotFoundError(f"{path} not found; run `gattn data prepare --data-dir {data_dir}` first")
        from ..util.io import read_json_object

        self.manifest: dict[str, Any] = read_json_object(
            path, "corpus manifest", f"rerun `gattn data prepare --data-dir {data_dir}`")
        if self.manifest.get("version") != MANIFEST_VERSION:
            raise ValueError(f"{path} has manifest version {self.manifest.get('version')}, this code reads "
                             f"{MANIFEST_VERSION}; re-run `gattn data prepare --force`")
        self.domains: list[str] = list(self.manifest["domains"])
        self.vocab_size: int = int(self.manifest["vocab_size"])
        self.dtype = np.dtype(self.manifest["dtype"])
        special = self.manifest["special_tokens"]
        self.bos_id, self.eos_id, self.pad_id = special[BOS], special[EOS], special[PAD]
        self._arrays: dict[tuple[str, str], TokenShards] = {}
        self._tokenizer = None

    def _check(self, domain: str, split: str) -> None:
        if domain not in self.manifest["domains"]:
            from ..util.errors import UserKeyError

            raise UserKeyError(f"unknown domain {domain!r}; this corpus has: {', '.join(self.domains)}")
        if split not in SPLITS:
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")

    def tokens(self, domain: str, split: str) -> TokenShards:
        """The (domain, split) token stream over its memory-mapped shards (see TokenShards)."""
        self._check(domain, split)
        key = (domain, split)
        if key not in self._arrays:
            files = self.manifest["domains"][domain]["token_files"][split]
            self._arrays[key] = TokenShards([self.data_dir / f["path"] for f in files],
                                            [int(f["tokens"]) for f in files], self.dtype)
        return self._arrays[key]

    def num_tokens(self, domain: str, split: str) -> int:
        self._check(domain, split)
        return int(self.manifest["domains"][domain]["tokens"][split])

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = get_tokenizer(self.data_dir / self.manifest["tokenizer"]["dir"])
        return self._tokenizer

    def verify(self) -> list[str]:
        """Recompute every checksum in the manifest; returns the problems found (empty = all good)."""
        problems = []
        files = [(self.manifest["tokenizer"]["dir"] + "/tokenizer.json", self.manifest["tokenizer"]["sha256"])]
        for d, e in self.manifest["domains"].items():
            files.append((e["raw_file"], e["raw_sha256"]))
            files.extend((f["path"], f["sha256"]) for split in SPLITS for f in e["token_files"][split])
        for rel, want in files:
            p = self.data_dir / rel
            if not p.exists():
                problems.append(f"{rel}: missing")
            elif sha256_file(p) != want:
                problems.append(f"{rel}: sha256 mismatch (file changed since prepare)")
        return problems


_SPLIT_CODE = {"train": 0, "val": 1}


def _batch_rng(seed: int, step: int, split: str) -> np.random.Generator:
    if seed < 0 or step < 0:
        raise ValueError(f"seed and step must be >= 0 (got seed={seed}, step={step})")
    # PCG64 seeded through SeedSequence is stable across numpy versions, so batches survive upgrades.
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, step, _SPLIT_CODE[split]])))


def sample_batch(corpus: Corpus, split: str, batch_size: int, seq_len: int, seed: int, step: int,
                 domains: Sequence[str] | None = None, bos: bool = True, rows: slice | None = None) -> "torch.Tensor":
    """Random windows, a pure function of (corpus, split, batch_size, seq_len, seed, step, domains, bos).

    Returns a LongTensor (batch_size, seq_len + 1): inputs are [:, :-1], next-token targets [:, 1:]. Domains are
    drawn in proportion to their *train* token counts (whatever the split), then a uniform start within the domain.
    With bos=True column 0 is always <|bos|> followed by seq_len corpus tokens; else seq_len + 1 corpus tokens.
    rows=slice(a, b): only rows a..b-1 of that global batch (a rank's share): every window position is still drawn
    (a few random numbers per row), but only these rows' tokens are read from the shards.
    """
    import torch  # lazy: `gattn data info` should not pay for importing torch

    if split not in SPLITS:
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size and seq_len must be >= 1 (got {batch_size}, {seq_len})")
    names = list(domains) if domains is not None else corpus.domains
    for d in names:
        corpus._check(d, split)
    need = seq_len if bos else seq_len + 1
    weights = np.array([corpus.num_tokens(d, "train") if len(corpus.tokens(d, split)) >= need else 0
                        for d in names], dtype=np.float64)
    if weights.sum() == 0:
        raise ValueError(f"no domain among {names} has {need} {split} tokens for seq_len={seq_len}; "
                         f"use a shorter --seq-len or a bigger corpus")
    rng = _batch_rng(seed, step, split)
    which = rng.choice(len(names), size=batch_size, p=weights / weights.sum())
    starts = [int(rng.integers(0, len(corpus.tokens(names[d], split)) - need + 1)) for d in which]  # same draw order
    picked = range(batch_size)[rows] if rows is not None else range(batch_size)
    out = np.empty((len(picked), seq_len + 1), dtype=np.int64)  # (rows, T+1)
    for row, i in enumerate(picked):
        arr, start = corpus.tokens(names[which[i]], split), starts[i]
        if bos:
            out[row, 0] = corpus.bos_id
            out[row, 1:] = arr[start:start + need]
        else:
            out[row] = arr[start:start + need]
    return torch.from_numpy(out)


def eval_batches(corpus: Corpus, domain: str, seq_len: int, max_batches: int | None = None, batch_size: int = 8,
                 bos: bool = True, split: str = "val") -> Iterator["torch.Tensor"]:
    """Fixed, non-overlapping windows over one domain's val tokens, in order: LongTensors (b, seq_len + 1).

    Window i covers tokens [i*seq_len, (i+1)*seq_len) as targets; with bos=True it is <|bos|> + those seq_len tokens,
    else the one token before them is the first input (so targets never overlap). The tail shorter than a window is
    dropped; the last batch may have fewer rows. `max_batches=None` = the whole split.
    """
    import torch

    arr = corpus.tokens(domain, split)
    n_windows = len(arr) // seq_len if bos else max(0, (len(arr) - 1) // seq_len)
    starts = range(0, n_windows * seq_len, seq_len)
    n_batches = 0
    for b0 in range(0, len(starts), batch_size):
        if max_batches is not None and n_batches >= max_batches:
            return
        rows = starts[b0:b0 + batch_size]
        out = np.empty((len(rows), seq_len + 1), dtype=np.int64)  # (b, T+1)
        for r, s in enumerate(rows):
            if bos:
                out[r, 0] = corpus.bos_id
                out[r, 1:] = arr[s:s + seq_len]
            else:
                out[r] = arr[s:s + seq_len + 1]
        n_batches += 1
        yield torch.from_numpy(out)
