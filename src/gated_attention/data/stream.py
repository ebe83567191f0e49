"""Streaming corpus building with flat memory: chunks to a raw file, a bounded tokenizer sample, sharded token files.

Three passes per domain, none of which holds more than a batch of chunks (or the tokenizer sample) in memory:

1. `write_raw`: documents -> chunks (`chunk_lines`, cut at blank lines) -> DATA/raw/<domain>.jsonl, while counting the
   split (a chunk is val when its hash `split_u` < val_fraction) and offering train chunks to the `TokenizerSample`.
2. the tokenizer is trained on that sample (bounded bytes; the whole train set when it fits, as before).
3. `tokenize_domain`: the raw file is cut into shards of `SHARD_CHUNKS` chunks; batches of chunks go to worker
   processes and come back IN ORDER (a bounded window of pending tasks), so the token files are byte-identical for any
   number of workers. Each finished shard writes tokens/<domain>/<split>-<k>.bin plus a sidecar with its sha256s; a
   killed prepare re-uses every finished shard whose sidecar key still matches.
"""
from __future__ import annotations

import collections
import contextlib
import hashlib
import heapq
import json
import multiprocessing as mp
import os
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

from ..util.io import atomic_write_json
from .text import sha256_file

SHARD_CHUNKS = 4096  # chunks per shard (~64 MB of text at the default 16k chunk_chars): resume granularity
BATCH_CHUNKS = 64  # chunks per worker task (~1 MB of text): small enough to keep the pipeline's memory flat


def split_u(seed: int, domain: str, doc: str, chunk: int) -> float:
    """A uniform number in [0, 1) per chunk: a hash, so stable across runs and independent of the other chunks."""
    h = hashlib.sha256(f"{seed}\x00{domain}\x00{doc}\x00{chunk}".encode("utf-8")).digest()
    return int.from_bytes(h[:8], "big") / 2.0 ** 64


def chunk_lines(lines: Iterable[str], chunk_chars: int) -> Iterator[str]:
    """Cut lines (keepends) into pieces of about chunk_chars at blank lines (hard cut at a line end past 2x)."""
    cur: list[str] = []
    size = 0
    for line in lines:
        cur.append(line)
        size += len(line)
        if (size >= chunk_chars and not line.strip()) or size >= 2 * chunk_chars:
            yield "".join(cur)
            cur, size = [], 0
    if cur:
        text = "".join(cur)
        if text:
            yield text


def doc_lines(text: str | Iterable[str]) -> Iterable[str]:
    """A document is a str or an iterable of its lines (a large file streamed); both give str.splitlines lines."""
    return text.splitlines(keepends=True) if isinstance(text, str) else text


# ----------------------------------------------------------------------------------------------------------------
# Pass 1: raw chunks, the split counts and the tokenizer sample
# ----------------------------------------------------------------------------------------------------------------

class TokenizerSample:
    """The train chunks with the smallest split hashes whose text fits in `max_bytes` (a uniform, order-free sample).

    Returned in (domain, chunk) order, so when everything fits it is exactly the train set in corpus order.
    """

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._heap: list[tuple[float, int, int, str]] = []  # (-u, domain index, chunk index, text): largest u on top
        self._bytes = 0

    def offer(self, u: float, domain_index: int, chunk_index: int, text: str) -> None:
        n = len(text.encode("utf-8"))
        if self._heap and self._bytes + n > self.max_bytes and -self._heap[0][0] <= u:
            return  # would be evicted at once
        heapq.heappush(self._heap, (-u, domain_index, chunk_index, text))
        self._bytes += n
        while self._bytes > self.max_bytes and len(self._heap) > 1:
            self._bytes -= len(heapq.heappop(self._heap)[3].encode("utf-8"))

    def texts(self) -> list[str]:
        return [t for _, _, _, t in sorted(self._heap, key=lambda e: (e[1], e[2]))]

    @property
    def nbytes(self) -> int:
        return self._bytes


@contextlib.contextmanager
def _removed_on_error(path: Path):
    """A half-written file is deleted when its writer fails (a source that turns out unreadable, a kill)."""
    try:
        yield
    except BaseException:
        path.unlink(missing_ok=True)
        raise


def write_raw(path: Path, docs: Iterable[tuple[str, Any]], chunk_chars: int, domain: str, seed: int,
              val_fraction: float, sample: TokenizerSample | None, domain_index: int) -> dict[str, Any]:
    """Stream documents into raw chunk records; returns counts, the sha256 and the split's forced labels."""
    tmp = path.with_name(path.name + ".tmp")
    h = hashlib.sha256()
    nbytes = nchunks = ndocs = nval = 0
    lo = hi = None  # (u, chunk index) of the smallest / largest hash: the forced val / train chunk if one split is empty
    hi_text = ""
    with open(tmp, "wb") as f, _removed_on_error(tmp):
        for doc_id, text in docs:
            ndocs += 1
            for i, chunk in enumerate(chunk_lines(doc_lines(text), chunk_chars)):
                line = (json.dumps({"doc": doc_id, "chunk": i, "text": chunk}, ensure_ascii=False) + "\n").encode()
                f.write(line)
                h.update(line)
                nbytes += len(chunk.encode("utf-8"))
                u = split_u(seed, domain, doc_id, i)
                if lo is None or u < lo[0]:
                    lo = (u, nchunks)
                if hi is None or u > hi[0]:
                    hi, hi_text = (u, nchunks), chunk
                if u < val_fraction:
                    nval += 1
                elif sample is not None:
                    sample.offer(u, domain_index, nchunks, chunk)
                nchunks += 1
    os.replace(tmp, path)
    force: dict[str, int] = {}
    if nchunks >= 2 and val_fraction > 0:
        if nval == 0:
            force["val"] = lo[1]  # the chunk whose hash is smallest: still a pure function of the inputs
            nval = 1
        if nval == nchunks:
            force["train"] = hi[1]
            nval -= 1
            if sample is not None:
                sample.offer(hi[0], domain_index, hi[1], hi_text)
    return {"bytes": nbytes, "documents": ndocs, "n_chunks": nchunks, "raw_sha256": h.hexdigest(),
            "chunks": {"train": nchunks - nval, "val": nval}, "forced": force}


def read_raw_lines(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                yield line


# ----------------------------------------------------------------------------------------------------------------
# Pass 3: tokenizing in worker processes, in order, into shards
# ----------------------------------------------------------------------------------------------------------------

_W: dict[str, Any] = {}  # the worker's tokenizer and split settings (set once per process by _init_worker)


def _init_worker(tokenizer_json: str, settings: dict[str, Any]) -> None:
    from tokenizers import Tokenizer

    _W["tok"] = Tokenizer.from_file(tokenizer_json)
    _W.update(settings)


def _encode_task(task: tuple[int, list[bytes]]) -> tuple[int, bytes, bytes, int, int]:
    """(first chunk index, raw JSON lines) -> (that index, train token bytes, val token bytes, #train, #val tokens)."""
    start, lines = task
    recs = [json.loads(line) for line in lines]
    force_val, force_train = _W["forced"].get("val"), _W["forced"].get("train")
    labels = []
    for j, r in enumerate(recs):
        i = start + j
        val = split_u(_W["seed"], _W["domain"], r["doc"], r["chunk"]) < _W["val_fraction"]
        labels.append((val or i == force_val) and i != force_train)
    dtype, eos = np.dtype(_W["dtype"]), _W["eos"]
    out: dict[bool, list[np.ndarray]] = {False: [], True: []}
    for enc, val in zip(_W["tok"].encode_batch([r["text"] for r in recs], add_special_tokens=False), labels):
        out[val].append(np.asarray(enc.ids + [eos], dtype=dtype))
    arrs = {v: np.concatenate(p) if p else np.zeros(0, dtype=dtype) for v, p in out.items()}
    return start, arrs[False].tobytes(), arrs[True].tobytes(), int(arrs[False].size), int(arrs[True].size)


@contextlib.contextmanager
def _serial_tokenizers():
    """TOKENIZERS_PARALLELISM=false inside (one core per worker: --workers is the parallelism), restored after."""
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


def ordered_map(fn, tasks: Iterable, workers: int, initializer, initargs) -> Iterator:
    """fn over tasks, results in task order; at most 2*workers tasks in flight, so memory stays flat.

    (Pool.imap would read the whole task iterator ahead into its queue.) workers == 1 runs in this process.
    """
    if workers <= 1:  # one core: encode_batch's own threads off here too (restored when the stream ends)
        with _serial_tokenizers():
            initializer(*initargs)
            yield from map(fn, tasks)
        return
    # fork (Linux): a caller's unguarded script is not re-run as with spawn. The workers only use `tokenizers`, with
    # its thread pool off (set before the fork, so the children never inherit a half-used one); restored after.
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    with _serial_tokenizers():
        pool = ctx.Pool(workers, initializer=initializer, initargs=initargs)
    with pool:
        pending: collections.deque = collections.deque()
        for t in tasks:
            pending.append(pool.apply_async(fn, (t,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def _shard_paths(tok_root: Path, domain: str, k: int) -> dict[str, Path]:
    d = tok_root / domain
    return {"train": d / f"train-{k:05d}.bin", "val": d / f"val-{k:05d}.bin", "meta": d / f"shard-{k:05d}.json"}


def _finished_shard(tok_root: Path, domain: str, k: int, key: str) -> dict[str, Any] | None:
    p = _shard_paths(tok_root, domain, k)
    try:
        meta = json.loads(p["meta"].read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    if meta.get("key") != key:
        return None
    for split in ("train", "val"):
        if not p[split].exists() or sha256_file(p[split]) != meta[split]["sha256"]:
            return None
    return meta


def tokenize_domain(data_dir: Path, domain: str, raw_info: dict[str, Any], key: str, tokenizer_json: Path,
                    settings: dict[str, Any], workers: int, progress=None) -> dict[str, Any]:
    """Token shards for one domain (reusing finished ones); returns {"tokens", "token_files", "shards_reused"}.

    progress(k, tokens): called as each shard k is finished here, with its token count (train + val)."""
    tok_root = data_dir / "tokens"
    (tok_root / domain).mkdir(parents=True, exist_ok=True)
    n_shards = max(1, -(-raw_info["n_chunks"] // SHARD_CHUNKS))
    done = {k: m for k in range(n_shards) if (m := _finished_shard(tok_root, domain, k, key)) is not None}

    def tasks() -> Iterator[tuple[int, list[bytes]]]:
        batch: list[bytes] = []
        start = 0
        for i, line in enumerate(read_raw_lines(data_dir / raw_info["raw_file"])):
            if i // SHARD_CHUNKS in done:
                continue  # finished shard: its lines are skipped, not tokenized again
            if not batch:
                start = i
            batch.append(line)
            if len(batch) == BATCH_CHUNKS or (i + 1) % SHARD_CHUNKS == 0:
                yield start, batch
                batch = []
        if batch:
            yield start, batch

    todo = [k for k in range(n_shards) if k not in done]
    writers: dict[str, Any] = {}
    hashes: dict[str, Any] = {}
    counts = {"train": 0, "val": 0}
    cur = None
    results = ordered_map(_encode_task, tasks(), workers, _init_worker,
                          (str(tokenizer_json), {**settings, "forced": raw_info["forced"]}))

    def finish(k: int) -> None:
        p = _shard_paths(tok_root, domain, k)
        meta: dict[str, Any] = {"key": key, "index": k}
        for split in ("train", "val"):
            writers[split].close()
            os.replace(p[split].with_name(p[split].name + ".tmp"), p[split])
            meta[split] = {"path": p[split].relative_to(data_dir).as_posix(), "sha256": hashes[split].hexdigest(),
                           "tokens": counts[split]}
        atomic_write_json(p["meta"], meta, indent=1)  # written last: the shard counts as finished only now
        done[k] = meta
        if progress is not None:
            progress(k, meta["train"]["tokens"] + meta["val"]["tokens"])

    def open_shard(k: int) -> None:
        p = _shard_paths(tok_root, domain, k)
        for split in ("train", "val"):
            writers[split] = open(p[split].with_name(p[split].name + ".tmp"), "wb")
            hashes[split] = hashlib.sha256()
            counts[split] = 0

    for start, tr, va, ntr, nva in results:
        k = start // SHARD_CHUNKS
        if cur != k:
            if cur is not None:
                finish(cur)
            open_shard(k)
            cur = k
        for split, data, n in (("train", tr, ntr), ("val", va, nva)):
            writers[split].write(data)
            hashes[split].update(data)
            counts[split] += n
    if cur is not None:
        finish(cur)
    for k in todo:
        if k not in done:  # a shard without chunks (an empty domain): empty files, still checksummed
            open_shard(k)
            finish(k)
    for stale in sorted((tok_root / domain).iterdir()):  # shards of an earlier, longer version of this domain
        stem = stale.name.split(".")[0]
        if stem.rsplit("-", 1)[-1].isdigit() and int(stem.rsplit("-", 1)[-1]) >= n_shards:
            stale.unlink()
    files = {s: [{kk: done[k][s][kk] for kk in ("path", "sha256", "tokens")} for k in range(n_shards)]
             for s in ("train", "val")}
    return {"tokens": {s: sum(f["tokens"] for f in files[s]) for s in files}, "token_files": files,
            "shards_reused": n_shards - len(todo)}
