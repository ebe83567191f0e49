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
        self._arrays: dict[tuple[str, str], np.ndarray] = {}
        self._tokenizer = None

    def _check(self, domain: str, split: str) -> None:
        if domain not in self.manifest["domains"]:
            from ..util.errors import UserKeyError

            raise UserKeyError(f"unknown domain {domain!r}; this corpus has: {', '.join(self.domains)}")
        if split not in SPLITS:
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")

    def tokens(self, domain: str, split: str) -> np.ndarray:
        self._check(domain, split)
        key = (domain, split)
        if key not in self._arrays:
            path = self.data_dir / self.manifest["domains"][domain]["token_files"][split]["path"]
            if path.stat().st_size == 0:  # np.memmap refuses empty files
                self._arrays[key] = np.zeros(0, dtype=self.dtype)
            else:
                self._arrays[key] = np.memmap(path, dtype=self.dtype, mode="r")
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
            files.extend((f["path"], f["sha256"]) for f in e["token_files"].values())
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
                 domains: Sequence[str] | None = None, bos: bool = True) -> "torch.Tensor":
    """Random windows, a pure function of (corpus, split, batch_size, seq_len, seed, step, domains, bos).

    Returns a LongTensor (batch_size, seq_len + 1): inputs are [:, :-1], next-token targets [:, 1:]. Domains are
    drawn in proportion to their *train* token counts (whatever the split), then a uniform start within the domain.
    With bos=True column 0 is always <|bos|> followed by seq_len corpus tokens; else seq_len + 1 corpus tokens.
    Distributed training: every rank draws the same global batch and keeps its own rows.
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
    out = np.empty((batch_size, seq_len + 1), dtype=np.int64)  # (B, T+1)
    for row, d in enumerate(which):
        arr = corpus.tokens(names[d], split)
        start = int(rng.integers(0, len(arr) - need + 1))
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
