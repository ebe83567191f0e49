"""`prepare`: sources -> raw chunks -> train/val split -> tokenizer -> token files -> manifest (all cached)."""
from __future__ import annotations

import hashlib
import io
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..util.io import atomic_write_bytes, atomic_write_json
from ..util.progress import Progress
from .sources import DEFAULT_SOURCES, SOURCES, Documents, SourceUnavailable, read_extra
from .text import BOS, EOS, SPECIAL_TOKENS, MANIFEST_VERSION, sha256_file, _warn_replaced
from .tokenizer import external_tokenizer, get_tokenizer, save_tokenizer, token_dtype, train_tokenizer


@dataclass
class PrepareConfig:
    data_dir: str = "data"
    vocab_size: int = 8192  # small vocab: the default corpus is ~40 MB and models are CPU-sized
    sources: tuple[str, ...] = DEFAULT_SOURCES
    extra: tuple[str, ...] = ()  # user text/JSONL files or folders, one domain each
    val_fraction: float = 0.05  # share of chunks held out per domain
    seed: int = 0  # drives the split hash and nothing else (BPE training is deterministic by itself)
    chunk_chars: int = 16384  # ~4k tokens: long enough for seq_len 2048 windows, short enough for a balanced split
    min_frequency: int = 2  # BPE merges seen once are noise on a corpus this size
    force: bool = False  # rebuild everything, ignoring the cache
    tokenizer: str | None = None  # an existing HF tokenizer dir (a pretrained checkpoint's) instead of training BPE


# ----------------------------------------------------------------------------------------------------------------
# Chunking and the split
# ----------------------------------------------------------------------------------------------------------------

def chunk_text(text: str, chunk_chars: int) -> list[str]:
    """Cut text into pieces of about chunk_chars at blank lines (hard cut at a line end past 2x). ''.join == text."""
    chunks: list[str] = []
    cur: list[str] = []
    size = 0
    for line in text.splitlines(keepends=True):
        cur.append(line)
        size += len(line)
        if (size >= chunk_chars and not line.strip()) or size >= 2 * chunk_chars:
            chunks.append("".join(cur))
            cur, size = [], 0
    if cur:
        chunks.append("".join(cur))
    return [c for c in chunks if c]


def _hash_u(seed: int, domain: str, doc: str, chunk: int) -> float:
    """A uniform number in [0, 1) per chunk: a hash, so stable across runs and independent of the other chunks."""
    h = hashlib.sha256(f"{seed}\x00{domain}\x00{doc}\x00{chunk}".encode("utf-8")).digest()
    return int.from_bytes(h[:8], "big") / 2.0 ** 64


def read_raw(path: str | os.PathLike) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def assign_splits(records: list[dict[str, Any]], domain: str, seed: int, val_fraction: float) -> list[str]:
    """Split label per chunk record; a domain with >= 2 chunks always gets >= 1 val and >= 1 train chunk."""
    us = [_hash_u(seed, domain, r["doc"], r["chunk"]) for r in records]
    labels = ["val" if u < val_fraction else "train" for u in us]
    if len(records) >= 2 and val_fraction > 0:
        order = sorted(range(len(us)), key=lambda i: us[i])
        if "val" not in labels:
            labels[order[0]] = "val"  # the chunk whose hash is smallest: still a pure function of the inputs
        if "train" not in labels:
            labels[order[-1]] = "train"
    return labels


# ----------------------------------------------------------------------------------------------------------------
# prepare: sources -> raw chunks -> tokenizer -> token files -> manifest
# ----------------------------------------------------------------------------------------------------------------

def _log(msg: str) -> None:
    print(f"[data] {msg}", file=sys.stderr, flush=True)


def _load_manifest(data_dir: Path) -> dict[str, Any]:
    path = data_dir / "manifest.json"
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        return {}  # a damaged manifest only costs a rebuild (writes are atomic, so this means hand editing)


def _write_raw(path: Path, docs: Documents, chunk_chars: int) -> tuple[int, int]:
    """Write chunk records; returns (utf-8 bytes of text, number of chunks)."""
    buf = io.StringIO()
    nbytes = nchunks = 0
    for doc_id, text in docs:
        for i, chunk in enumerate(chunk_text(text, chunk_chars)):
            buf.write(json.dumps({"doc": doc_id, "chunk": i, "text": chunk}, ensure_ascii=False) + "\n")
            nbytes += len(chunk.encode("utf-8"))
            nchunks += 1
    atomic_write_bytes(path, buf.getvalue().encode("utf-8"))
    return nbytes, nchunks


def _key(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode("utf-8")).hexdigest()


def prepare(cfg: PrepareConfig) -> dict[str, Any]:
    """Build (or reuse) the corpus in cfg.data_dir and return the manifest. See the module docstring."""
    t0 = time.time()
    unknown = [s for s in cfg.sources if s not in SOURCES]
    if unknown:
        raise ValueError(f"unknown source(s) {unknown}; valid: {', '.join(SOURCES)}")
    if not 0.0 < cfg.val_fraction < 1.0:
        raise ValueError(f"--val-fraction {cfg.val_fraction} must be in (0, 1)")
    from ..util.errors import check_number

    check_number("--vocab-size", cfg.vocab_size, kind=int, min=1)
    check_number("--chunk-chars", cfg.chunk_chars, kind=int, min=1)
    check_number("--seed", cfg.seed, kind=int, min=0)
    for q in (Path(cfg.data_dir), *Path(cfg.data_dir).parents):
        if q.exists():
            if not q.is_dir():
                raise ValueError(f"--data-dir {cfg.data_dir}: {q} is a file; pass a folder (it is created if missing)")
            break
    data_dir = Path(cfg.data_dir)
    (data_dir / "raw").mkdir(parents=True, exist_ok=True)
    (data_dir / "tokens").mkdir(parents=True, exist_ok=True)
    cache_dir = data_dir / "cache"
    cache_dir.mkdir(parents=True, exist_ok=True)
    old = {} if cfg.force else _load_manifest(data_dir)
    old_domains: dict[str, Any] = old.get("domains", {})

    # 1. sources -> raw chunk files (built-in sources reused while the raw file still matches the manifest)
    entries: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}
    jobs: list[tuple[str, Callable[[], tuple[str, Documents, dict[str, Any]]]]] = []
    for name in cfg.sources:
        jobs.append((name, lambda name=name: (name, *SOURCES[name](cache_dir))))
    for path in cfg.extra:
        jobs.append((str(path), lambda path=path: read_extra(path)))
    # reading, the tokenizer, then one token-file stage per domain (the total is fixed once skips are known)
    prog = Progress(2 * len(jobs) + 1, "data prepare", "stage", heartbeat=True)
    for label, job in jobs:
        prog.update(1, stage=label)
        t = time.time()
        prev = old_domains.get(label)
        raw_path = data_dir / "raw" / f"{label}.jsonl"
        if (label in SOURCES and prev and raw_path.exists() and old.get("chunk_chars") == cfg.chunk_chars
                and prev.get("raw_sha256") == sha256_file(raw_path)):
            entries[label] = {k: prev[k] for k in ("source", "licence", "bytes", "documents", "replaced_chars",
                                                   "raw_file", "raw_sha256")}
            _log(f"{label}: reusing {raw_path}")
            continue
        try:
            domain, docs, info = job()
        except SourceUnavailable as exc:
            skipped[label] = str(exc)
            _log(f"{label}: SKIPPED: {exc}")
            continue
        if domain in entries:
            raise ValueError(f"two sources both make domain {domain!r}; rename one of the --extra paths")
        _warn_replaced(info["replaced_chars"], domain)
        raw_path = data_dir / "raw" / f"{domain}.jsonl"
        nbytes, nchunks = _write_raw(raw_path, docs, cfg.chunk_chars)
        entries[domain] = {**info, "bytes": nbytes, "documents": len(docs), "raw_file": f"raw/{domain}.jsonl",
                           "raw_sha256": sha256_file(raw_path)}
        _log(f"{domain}: {len(docs)} documents, {nchunks} chunks, {nbytes / 1e6:.2f} MB ({time.time() - t:.1f}s)")
    prog.total = len(jobs) + 1 + len(entries)
    if not entries:
        prog.close()
        raise ValueError("no corpus source could be read (see the SKIPPED lines above); install the Debian packages "
                         "with scripts/install_debian_deps.sh or pass --extra PATH")

    # 2. splits
    records: dict[str, list[dict[str, Any]]] = {}
    labels: dict[str, list[str]] = {}
    for domain, e in entries.items():
        records[domain] = read_raw(data_dir / e["raw_file"])
        labels[domain] = assign_splits(records[domain], domain, cfg.seed, cfg.val_fraction)
        e["chunks"] = {s: labels[domain].count(s) for s in ("train", "val")}
        empty = [s for s in ("train", "val") if e["chunks"][s] == 0]
        if empty:  # too small to split: said on stderr and recorded, not discovered later as an empty eval
            e["warning"] = (f"only {len(labels[domain])} chunk(s), so no {' or '.join(empty)} split; add more text "
                            f"or lower --chunk-chars (now {cfg.chunk_chars})")
            _log(f"{domain}: warning: {e['warning']}")

    # 3. tokenizer, trained on the train chunks of every domain (domain order fixed by the source list)
    tok_dir = data_dir / "tokenizer"
    tok_key = _key("tokenizer", cfg.vocab_size, cfg.min_frequency, cfg.seed, cfg.val_fraction,
                   [(d, e["raw_sha256"]) for d, e in entries.items()])
    ids = None
    if cfg.tokenizer:  # a pretrained model's own tokenizer: fine-tuning data must speak the model's vocabulary
        tok, ids = external_tokenizer(cfg.tokenizer)
        save_tokenizer(tok, tok_dir)
        tok_key = _key("external-tokenizer", sha256_file(tok_dir / "tokenizer.json"))  # never reused as a BPE one
        _log(f"tokenizer: {cfg.tokenizer} (vocab {len(tok)}; bos {ids[BOS]}, eos {ids[EOS]})")
    elif old.get("tokenizer", {}).get("key") == tok_key and (tok_dir / "tokenizer.json").exists() \
            and sha256_file(tok_dir / "tokenizer.json") == old["tokenizer"].get("sha256"):
        tok = get_tokenizer(tok_dir)
        _log(f"tokenizer: reusing {tok_dir}")
    else:
        t = time.time()
        train_texts = [r["text"] for d in entries for r, s in zip(records[d], labels[d]) if s == "train"]
        tok = train_tokenizer(train_texts, cfg.vocab_size, cfg.min_frequency)
        save_tokenizer(tok, tok_dir)
        _log(f"tokenizer: trained byte-level BPE, vocab {len(tok)} ({time.time() - t:.1f}s)")
    prog.update(1, stage="tokenizer")
    tok_sha = sha256_file(tok_dir / "tokenizer.json")
    ids = ids or {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    dtype = token_dtype(len(tok))

    # 4. token files: each chunk's ids then eos, per (domain, split)
    backend = tok.backend_tokenizer
    for domain, e in entries.items():
        prev = old_domains.get(domain, {})
        tkey = _key("tokens", tok_sha, e["raw_sha256"], cfg.seed, cfg.val_fraction, dtype.str)
        e["tokens"], e["token_files"] = {}, {}
        t = time.time()
        for split in ("train", "val"):
            rel = f"tokens/{domain}.{split}.bin"
            path = data_dir / rel
            pf = prev.get("token_files", {}).get(split, {})
            if prev.get("tokens_key") == tkey and path.exists() and pf.get("sha256") == sha256_file(path):
                e["tokens"][split], e["token_files"][split] = prev["tokens"][split], pf
                continue
            texts = [r["text"] for r, s in zip(records[domain], labels[domain]) if s == split]
            parts = [np.asarray(enc.ids + [ids[EOS]], dtype=dtype)
                     for enc in backend.encode_batch(texts, add_special_tokens=False)]
            arr = np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)
            atomic_write_bytes(path, arr.tobytes())
            e["tokens"][split] = int(arr.size)
            e["token_files"][split] = {"path": rel, "sha256": sha256_file(path)}
        e["tokens_key"] = tkey
        prog.update(1, tokens=e["tokens"]["train"] + e["tokens"]["val"], stage=domain)
        _log(f"{domain}: {e['tokens']['train']:,} train / {e['tokens']['val']:,} val tokens ({time.time() - t:.1f}s)")

    prog.close()
    manifest = {
        "version": MANIFEST_VERSION,
        "vocab_size": len(tok),
        "dtype": dtype.name,
        "special_tokens": ids,
        "seed": cfg.seed,
        "val_fraction": cfg.val_fraction,
        "chunk_chars": cfg.chunk_chars,
        "tokenizer": {"dir": "tokenizer", "key": tok_key, "sha256": tok_sha, "min_frequency": cfg.min_frequency, "external": cfg.tokenizer,
                      "requested_vocab_size": cfg.vocab_size},
        "domains": entries,
        "skipped": skipped,
        "build_seconds": round(time.time() - t0, 2),
    }
    atomic_write_json(data_dir / "manifest.json", manifest, indent=2, sort_keys=True, ensure_ascii=False, newline=True)
    _log(f"done in {manifest['build_seconds']:.1f}s: {len(entries)} domains, {len(skipped)} skipped -> "
         f"{data_dir / 'manifest.json'}")
    return manifest
