"""The epoch sampler: every window of the training split once per epoch, in a new seeded order each epoch.

`sample_batch` (corpus.py) draws windows with replacement, so after one epoch's worth of tokens ~1/e = 37 % of them
have never been seen. `EpochSampler` visits each window exactly once per epoch instead, and the batch at a step is
still a pure function of (seed, step): sample k of the run (row r of step s is k = s * B + r) is window
perm_e(k mod M) of epoch e = k // M, where M is the number of windows and perm_e a seeded permutation evaluated at
one index at a time (a Feistel network with cycle walking: no permutation is ever stored, so any corpus size costs
O(rows) per step). A rank computes only its rows; resuming needs nothing but the step; the order does not depend on
the world size, the micro-batching or the numpy version (the permutation and the offsets are this file's own
arithmetic over numpy's SeedSequence, whose output is fixed by its specification). A batch that spans the end of an
epoch takes the last windows of one epoch and the first of the next.

What a window is (per domain, over its train token stream):
  documents    the stream as `gattn data prepare` stores it: chunks of about chunk_chars characters of a source
               document (cut at paragraph boundaries), each followed by <|eos|>. The EOS-terminated chunk is the
               document unit the sampler can see (a source document's train chunks are adjacent in the stream).
  pack_documents=False (default)  windows of the stored stream: row = <|bos|> + T stream tokens, the same content
               kind as `sample_batch` (a window crosses chunk boundaries at their EOS). Windows start at o + i*T,
               i < n, so every stream token in [o, o + n*T) is a target exactly once per epoch.
  pack_documents=True   documents packed with BOS separators: the stream is read with <|bos|> inserted before every
               document (after each EOS, and at the start), and row = T + 1 tokens of that stream starting at
               o + i*T: consecutive windows share one token (the last input of one is the first of the next), so
               every token is a target exactly once. Column 0 is <|bos|> only where a row starts at a document;
               every document is preceded by its own <|bos|>. Attention is not masked between the documents of a
               row (the model has no document mask). Finding the documents scans the train tokens once (numpy, in
               blocks) and keeps one int64 per document; for a prepared corpus that index is cached beside it
               (DATA/index/docs-<domain>-<split>-<key>.npy, written atomically), keyed on the stream's token files
               (names, checksums, token counts, sizes, modification times) and the EOS id, so later starts and
               every rank read it instead of the corpus (a corpus folder that cannot be written is scanned at every
               start, as without the cache).
  offset o     n = (N - need) // T + 1 windows fit a stream of N tokens (need = T, or T + 1 packed); the slack
               N - need - (n - 1) * T < T tokens lets the window grid move each epoch: o is drawn per (seed, epoch,
               domain) in [0, slack], so window boundaries change between epochs while the count stays n.

Several domains: the epoch is the union of every selected domain's windows, permuted together. A domain therefore
takes its share of each epoch (and of every stretch of steps, in expectation) in proportion to its window count,
that is its train tokens - the proportion `sample_batch` draws domains in. A domain is not up- or down-weighted;
one epoch is exactly one pass over every selected domain.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)
_SPLIT_CODE = {"train": 0, "val": 1}
_ROUNDS = 6  # Feistel rounds: 4 already give a pseudo-random permutation; 6 for margin, still a few ns per index
_SCAN = 1 << 22  # tokens read per block while finding documents


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a bijective avalanche hash of uint64 values (wrapping arithmetic)."""
    x = x.astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return x


def _keys(seed: int, epoch: int, split: str, n: int) -> np.ndarray:
    """n uint64 keys of (seed, epoch, split): SeedSequence's mixing, fixed by its specification."""
    return np.random.SeedSequence([seed, epoch, _SPLIT_CODE[split], 0xE90C]).generate_state(n, np.uint64)


def permute(index: np.ndarray, size: int, keys: np.ndarray) -> np.ndarray:
    """A keyed bijection of [0, size), evaluated at `index` (ints in [0, size)).

    A balanced Feistel network over 2h bits (2^(2h) >= size, so < 4 * size) permutes [0, 2^(2h)); cycle walking
    (apply it again while the value is >= size) restricts it to a permutation of [0, size)."""
    if size <= 1:
        return np.zeros_like(np.asarray(index, dtype=np.int64))
    h = max(1, ((size - 1).bit_length() + 1) // 2)
    mask, sh = np.uint64((1 << h) - 1), np.uint64(h)

    def feistel(x: np.ndarray) -> np.ndarray:
        left, right = x >> sh, x & mask
        for k in keys:
            left, right = right, left ^ (_mix64(right ^ k) & mask)
        return (left << sh) | right

    y = feistel(np.asarray(index, dtype=np.uint64))
    out_of_range = y >= np.uint64(size)
    while out_of_range.any():  # ends: x < size lies on a cycle of the bijection that returns to x itself
        y[out_of_range] = feistel(y[out_of_range])
        out_of_range = y >= np.uint64(size)
    return y.astype(np.int64)


def _doc_starts(arr, eos_id: int) -> np.ndarray:
    """Start positions of the EOS-terminated documents of a token stream (int64, first = 0), scanned in blocks."""
    ends = [np.flatnonzero(np.asarray(arr[a:a + _SCAN]) == eos_id) + a for a in range(0, len(arr), _SCAN)]
    ends = np.concatenate(ends) if ends else np.zeros(0, dtype=np.int64)
    starts = np.concatenate([[0], ends + 1]).astype(np.int64)
    return starts[starts < len(arr)]  # the stream ends with an EOS: no document starts after it


_INDEX_VERSION = 1  # of the cached document index's layout: a change here names new files


def _index_path(corpus, name: str, split: str, eos_id: int):
    """Where the document index of (name, split) is cached beside a prepared corpus (`Corpus`: its data_dir and
    manifest), or None for any other token source. The name carries a digest of what the index depends on."""
    import hashlib
    import json
    import re
    from pathlib import Path

    data_dir, manifest = getattr(corpus, "data_dir", None), getattr(corpus, "manifest", None)
    if data_dir is None or not isinstance(manifest, dict):
        return None
    files = manifest["domains"][name]["token_files"][split]
    key = [_INDEX_VERSION, int(eos_id), manifest.get("dtype")]
    for f in files:
        st = (Path(data_dir) / f["path"]).stat()
        key.append([f["path"], f.get("sha256"), f.get("tokens"), st.st_size, st.st_mtime_ns])
    digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]
    return Path(data_dir) / "index" / f"docs-{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}-{split}-{digest}.npy"


def _read_index(path, length: int) -> np.ndarray | None:
    """The cached index at `path` if it reads back as one (int64 starts from 0, increasing, inside the stream)."""
    try:
        starts = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError):
        return None
    ok = (starts.dtype == np.int64 and starts.ndim == 1 and len(starts) > 0 and starts[0] == 0
          and starts[-1] < length and bool(np.all(np.diff(starts) > 0)))
    return starts if ok else None


def document_starts(corpus, name: str, split: str) -> np.ndarray:
    """Start positions of the documents of (name, split): from the index cached beside a prepared corpus when its
    key matches, else scanned (_doc_starts) and cached for the next start (see the module docstring)."""
    arr = corpus.tokens(name, split)
    path = _index_path(corpus, name, split, corpus.eos_id)
    cached = _read_index(path, len(arr)) if path is not None and path.is_file() else None
    if cached is not None:
        return cached
    starts = _doc_starts(arr, corpus.eos_id)
    if path is not None and len(starts):
        from ..util.io import atomic_write_with

        def write(tmp):
            with open(tmp, "wb") as fh:
                np.save(fh, starts, allow_pickle=False)

        try:
            atomic_write_with(path, write)  # concurrent writers (ranks) each rename a whole file into place
            prefix = path.name.rsplit("-", 1)[0] + "-"
            for old in path.parent.glob(prefix + "*.npy"):  # this stream's index of an older corpus
                if old != path and len(old.name) == len(path.name):  # (not "docs-a-train-train-..." of domain a-train)
                    old.unlink(missing_ok=True)
        except OSError:
            pass  # a read-only corpus: the scan above stands, as it would without the cache
    return starts


class _Domain:
    """One domain's windows: the stream read (stored, or with BOS before every document) and the window count."""

    def __init__(self, corpus, name: str, split: str, seq_len: int, pack: bool):
        self.name, self.arr, self.pack, self.T = name, corpus.tokens(name, split), pack, seq_len
        self.bos = corpus.bos_id
        self.need = seq_len + 1 if pack else seq_len
        if pack:
            starts = document_starts(corpus, name, split)
            self.bos_at = starts + np.arange(len(starts))  # packed position of each document's BOS
            self.length = len(self.arr) + len(starts)
        else:
            self.length = len(self.arr)
        self.windows = (self.length - self.need) // seq_len + 1 if self.length >= self.need else 0
        self.slack = self.length - self.need - (self.windows - 1) * seq_len if self.windows else 0

    def read(self, start: int) -> np.ndarray:
        """The row whose window starts at `start` (in this domain's stream): (T + 1,) int64."""
        if not self.pack:
            out = np.empty(self.T + 1, dtype=np.int64)
            out[0] = self.bos
            out[1:] = self.arr[start:start + self.T]
            return out
        d = int(np.searchsorted(self.bos_at, start, side="right")) - 1  # the document `start` falls in
        out, filled = np.empty(self.need, dtype=np.int64), 0
        pos = start - d - 1  # stored position of packed position `start` (when it is not a BOS)
        while filled < self.need:
            if d + 1 < len(self.bos_at) and start + filled == self.bos_at[d + 1]:
                d += 1
            if start + filled == self.bos_at[d]:
                out[filled] = self.bos
                filled, pos = filled + 1, self.bos_at[d] - d
                continue
            nxt = self.bos_at[d + 1] if d + 1 < len(self.bos_at) else self.length
            take = min(self.need - filled, int(nxt - (start + filled)))  # up to the next document's BOS
            out[filled:filled + take] = self.arr[pos:pos + take]
            filled, pos = filled + take, pos + take
        return out


class EpochSampler:
    """Batches of windows without replacement over (corpus, split, domains, seq_len, pack): see the module docstring.

    `batch(B, seed, step, rows)` is a pure function of its arguments; the sampler itself only caches the window
    counts (and, packed, the document starts) of its domains."""

    def __init__(self, corpus, split: str = "train", seq_len: int = 256, domains: Sequence[str] | None = None,
                 pack_documents: bool = False):
        if split not in _SPLIT_CODE:
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        names = list(domains) if domains is not None else list(corpus.domains)
        for d in names:
            corpus._check(d, split)
        self.split, self.seq_len, self.pack = split, seq_len, bool(pack_documents)
        self.domains = [_Domain(corpus, d, split, seq_len, self.pack) for d in names]
        self.counts = np.array([d.windows for d in self.domains], dtype=np.int64)
        self.first = np.concatenate([[0], np.cumsum(self.counts)])  # (D+1,) first global window of each domain
        self.size = int(self.first[-1])  # M: windows per epoch
        if self.size == 0:
            need = seq_len + 1 if self.pack else seq_len
            raise ValueError(f"no domain among {names} has {need} {split} tokens for seq_len={seq_len}; use a "
                             "shorter --seq-len or a bigger corpus")

    def offsets(self, seed: int, epoch: int) -> np.ndarray:
        """(D,) the window grid's offset of each domain in `epoch`: uniform in [0, slack]."""
        draws = _keys(seed, epoch, self.split, _ROUNDS + len(self.domains))[_ROUNDS:]
        return np.array([int(u % np.uint64(d.slack + 1)) for u, d in zip(draws, self.domains)], dtype=np.int64)

    def windows(self, seed: int, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(domain index, window start) of each run sample index k (epoch k // M, its permuted window)."""
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        samples = np.asarray(samples, dtype=np.int64)
        epochs, pos = samples // self.size, samples % self.size
        dom, start = np.empty_like(samples), np.empty_like(samples)
        for e in np.unique(epochs):  # a batch spans at most two epochs unless it is larger than one
            sel = epochs == e
            w = permute(pos[sel], self.size, _keys(seed, int(e), self.split, _ROUNDS))
            d = np.searchsorted(self.first, w, side="right") - 1
            dom[sel] = d
            start[sel] = self.offsets(seed, int(e))[d] + (w - self.first[d]) * self.seq_len
        return dom, start

    def batch(self, batch_size: int, seed: int, step: int, rows: slice | None = None) -> "torch.Tensor":
        """LongTensor (rows, T + 1) of step `step`'s global batch (all B rows, or `rows` of them: a rank's share)."""
        import torch

        if batch_size < 1 or step < 0:
            raise ValueError(f"batch_size must be >= 1 and step >= 0 (got {batch_size}, {step})")
        picked = np.arange(batch_size)[rows] if rows is not None else np.arange(batch_size)
        dom, start = self.windows(seed, step * batch_size + picked)
        out = np.empty((len(picked), self.seq_len + 1), dtype=np.int64)  # (rows, T+1)
        for r, (d, s) in enumerate(zip(dom, start)):
            out[r] = self.domains[d].read(int(s))
        return torch.from_numpy(out)

    def epoch_of(self, batch_size: int, step: int) -> float:
        """Epochs completed before step `step` (fractional): samples drawn / windows per epoch."""
        return step * batch_size / self.size
