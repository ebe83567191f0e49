"""`prepare`: sources -> raw chunks -> train/val split -> tokenizer -> token files -> manifest (all cached)."""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..util.io import atomic_write_json
from ..util.progress import Progress
from .formats import iter_extra
from .sources import DEFAULT_SOURCES, SOURCES, SourceUnavailable
from . import stream
from .stream import TokenizerSample, chunk_lines, read_raw_lines, split_u, tokenize_domain, write_raw
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
    workers: int = os.cpu_count() or 1  # tokenizing processes; the token files are identical for any number
    text_field: str = "text"  # the JSONL field / Parquet or datasets column holding the text of --extra inputs
    tokenizer_sample_mb: float = 100.0  # BPE trains on at most this much train text (all of it when smaller)


# ----------------------------------------------------------------------------------------------------------------
# Chunking and the split (the streaming build in stream.py uses the same rules)
# ----------------------------------------------------------------------------------------------------------------

def chunk_text(text: str, chunk_chars: int) -> list[str]:
    """Cut text into pieces of about chunk_chars at blank lines (hard cut at a line end past 2x). ''.join == text."""
    return list(chunk_lines(text.splitlines(keepends=True), chunk_chars))


def read_raw(path: str | os.PathLike) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def assign_splits(records: list[dict[str, Any]], domain: str, seed: int, val_fraction: float) -> list[str]:
    """Split label per chunk record; a domain with >= 2 chunks always gets >= 1 val and >= 1 train chunk."""
    us = [split_u(seed, domain, r["doc"], r["chunk"]) for r in records]
    labels = ["val" if u < val_fraction else "train" for u in us]
    if len(records) >= 2 and val_fraction > 0:
        order = sorted(range(len(us)), key=lambda i: us[i])
        if "val" not in labels:
            labels[order[0]] = "val"  # the chunk whose hash is smallest: still a pure function of the inputs
        if "train" not in labels:
            labels[order[-1]] = "train"
    return labels


# ----------------------------------------------------------------------------------------------------------------
# prepare: sources -> raw chunks (+ tokenizer sample) -> tokenizer -> token shards -> manifest
# ----------------------------------------------------------------------------------------------------------------

def _log(msg: str) -> None:
    print(f"[data] {msg}", file=sys.stderr, flush=True)


def _load_manifest(data_dir: Path) -> dict[str, Any]:
    path = data_dir / "manifest.json"
    if not path.exists():
        return {}
    try:
        m = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        return {}  # a damaged manifest only costs a rebuild (writes are atomic, so this means hand editing)
    return m if m.get("version") == MANIFEST_VERSION else {}  # an older layout: rebuilt, never misread


def _key(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode("utf-8")).hexdigest()


def _check(cfg: PrepareConfig) -> None:
    unknown = [s for s in cfg.sources if s not in SOURCES]
    if unknown:
        raise ValueError(f"unknown source(s) {unknown}; valid: {', '.join(SOURCES)}")
    if not 0.0 < cfg.val_fraction < 1.0:
        raise ValueError(f"--val-fraction {cfg.val_fraction} must be in (0, 1)")
    from ..util.errors import check_number

    check_number("--vocab-size", cfg.vocab_size, kind=int, min=1)
    check_number("--chunk-chars", cfg.chunk_chars, kind=int, min=1)
    check_number("--seed", cfg.seed, kind=int, min=0)
    check_number("--workers", cfg.workers, kind=int, min=1)
    check_number("--tokenizer-sample-mb", cfg.tokenizer_sample_mb, kind=float, min=0.001)
    if not cfg.text_field:
        raise ValueError("--text-field must name a field/column, e.g. text")
    for q in (Path(cfg.data_dir), *Path(cfg.data_dir).parents):
        if q.exists():
            if not q.is_dir():
                raise ValueError(f"--data-dir {cfg.data_dir}: {q} is a file; pass a folder (it is created if missing)")
            break


def prepare(cfg: PrepareConfig) -> dict[str, Any]:
    """Build (or reuse) the corpus in cfg.data_dir and return the manifest. See the module docstring."""
    t0 = time.time()
    _check(cfg)
    data_dir = Path(cfg.data_dir)
    (data_dir / "raw").mkdir(parents=True, exist_ok=True)
    (data_dir / "tokens").mkdir(parents=True, exist_ok=True)
    cache_dir = data_dir / "cache"
    cache_dir.mkdir(parents=True, exist_ok=True)
    old = {} if cfg.force else _load_manifest(data_dir)
    old_domains: dict[str, Any] = old.get("domains", {})
    tok_dir = data_dir / "tokenizer"
    train_bpe = not cfg.tokenizer
    sample = TokenizerSample(int(cfg.tokenizer_sample_mb * 1e6)) if train_bpe else None

    # 1. sources -> raw chunk files, streamed (built-in sources reused while the raw file still matches the manifest;
    #    a reused domain's train chunks are re-read from the raw file for the tokenizer sample only if BPE is trained)
    entries: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}
    jobs: list[tuple[str, Callable[[], tuple[str, Any, dict[str, Any]]]]] = []
    for name in cfg.sources:
        jobs.append((name, lambda name=name: (name, *SOURCES[name](cache_dir))))
    for path in cfg.extra:
        jobs.append((str(path), lambda path=path: iter_extra(path, cfg.text_field)))
    prog = Progress(2 * len(jobs) + 1, "data prepare", "stage", heartbeat=True)
    for label, job in jobs:
        prog.update(1, stage=label)
        t = time.time()
        prev = old_domains.get(label)
        raw_path = data_dir / "raw" / f"{label}.jsonl"
        if (label in SOURCES and prev and raw_path.exists() and old.get("chunk_chars") == cfg.chunk_chars
                and old.get("seed") == cfg.seed and old.get("val_fraction") == cfg.val_fraction
                and prev.get("raw_sha256") == sha256_file(raw_path)):
            entries[label] = {k: prev[k] for k in ("source", "licence", "bytes", "documents", "replaced_chars",
                                                   "raw_file", "raw_sha256", "chunks", "n_chunks", "forced")
                              if k in prev}
            if sample is not None:
                _resample(raw_path, label, len(entries) - 1, cfg, entries[label]["forced"], sample)
            _log(f"{label}: reusing {raw_path}")
            continue
        try:
            domain, docs, info = job()
            if domain in entries:
                raise ValueError(f"two sources both make domain {domain!r}; rename one of the --extra paths")
            raw_path = data_dir / "raw" / f"{domain}.jsonl"
            stats = write_raw(raw_path, docs, cfg.chunk_chars, domain, cfg.seed, cfg.val_fraction, sample,
                              len(entries))
        except SourceUnavailable as exc:
            skipped[label] = str(exc)
            _log(f"{label}: SKIPPED: {exc}")
            continue
        _warn_replaced(info["replaced_chars"], domain)
        entries[domain] = {**info, **stats, "raw_file": f"raw/{domain}.jsonl"}
        _log(f"{domain}: {stats['documents']} documents, {stats['n_chunks']} chunks, {stats['bytes'] / 1e6:.2f} MB "
             f"({time.time() - t:.1f}s)")
    prog.total = len(jobs) + 1 + len(entries)
    if not entries:
        prog.close()
        raise ValueError("no corpus source could be read (see the SKIPPED lines above); install the Debian packages "
                         "with scripts/install_debian_deps.sh or pass --extra PATH")
    for domain, e in entries.items():
        empty = [s for s in ("train", "val") if e["chunks"][s] == 0]
        if empty:  # too small to split: said on stderr and recorded, not discovered later as an empty eval
            e["warning"] = (f"only {e['n_chunks']} chunk(s), so no {' or '.join(empty)} split; add more text "
                            f"or lower --chunk-chars (now {cfg.chunk_chars})")
            _log(f"{domain}: warning: {e['warning']}")

    # 2. tokenizer: a pretrained one, the cached one, or byte-level BPE trained on a bounded sample of train chunks
    prog.update(1, stage="tokenizer")  # each stage is counted and named as it starts (the heartbeat shows it)
    tok_key = _key("tokenizer", cfg.vocab_size, cfg.min_frequency, cfg.seed, cfg.val_fraction,
                   [(d, e["raw_sha256"]) for d, e in entries.items()], sample.nbytes if sample else None)
    key_file = tok_dir / "gattn_key.json"  # the cache key beside the tokenizer: a killed prepare reuses it too
    ids = None
    sample_bytes = sample.nbytes if sample is not None else None
    if cfg.tokenizer:  # a pretrained model's own tokenizer: fine-tuning data must speak the model's vocabulary
        tok, ids = external_tokenizer(cfg.tokenizer)
        save_tokenizer(tok, tok_dir)
        tok_key = _key("external-tokenizer", sha256_file(tok_dir / "tokenizer.json"))  # never reused as a BPE one
        _log(f"tokenizer: {cfg.tokenizer} (vocab {len(tok)}; bos {ids[BOS]}, eos {ids[EOS]})")
    elif _tokenizer_cached(tok_dir, key_file, tok_key):
        tok = get_tokenizer(tok_dir)
        _log(f"tokenizer: reusing {tok_dir}")
    else:
        t = time.time()
        texts = sample.texts()
        sample = None  # the sample's memory goes before the token pass
        tok = train_tokenizer(texts, cfg.vocab_size, cfg.min_frequency)
        del texts
        save_tokenizer(tok, tok_dir)
        atomic_write_json(key_file, {"key": tok_key, "sha256": sha256_file(tok_dir / "tokenizer.json")})
        _log(f"tokenizer: trained byte-level BPE on a {sample_bytes / 1e6:.1f} MB sample, vocab {len(tok)} "
             f"({time.time() - t:.1f}s)")
    tok_sha = sha256_file(tok_dir / "tokenizer.json")
    ids = ids or {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    dtype = token_dtype(len(tok))

    # 3. token shards: each chunk's ids then eos, per (domain, split), tokenized by --workers processes in order
    for domain, e in entries.items():
        t = time.time()
        tkey = _key("tokens", tok_sha, e["raw_sha256"], cfg.seed, cfg.val_fraction, dtype.str, stream.SHARD_CHUNKS)
        settings = {"seed": cfg.seed, "domain": domain, "val_fraction": cfg.val_fraction, "dtype": dtype.str,
                    "eos": ids[EOS]}
        prog.update(1, stage=f"tokens {domain}")
        res = tokenize_domain(data_dir, domain, e, tkey, tok_dir / "tokenizer.json", settings, cfg.workers,
                              progress=lambda k, n: prog.update(0, tokens=n, shard=k))
        e.update(tokens=res["tokens"], token_files=res["token_files"], tokens_key=tkey)
        reused = f", {res['shards_reused']} shard(s) reused" if res["shards_reused"] else ""
        _log(f"{domain}: {e['tokens']['train']:,} train / {e['tokens']['val']:,} val tokens in "
             f"{len(res['token_files']['train'])} shard(s){reused} ({time.time() - t:.1f}s)")

    prog.close()
    manifest = {
        "version": MANIFEST_VERSION,
        "vocab_size": len(tok),
        "dtype": dtype.name,
        "special_tokens": ids,
        "seed": cfg.seed,
        "val_fraction": cfg.val_fraction,
        "chunk_chars": cfg.chunk_chars,
        "tokenizer": {"dir": "tokenizer", "key": tok_key, "sha256": tok_sha, "min_frequency": cfg.min_frequency,
                      "external": cfg.tokenizer, "requested_vocab_size": cfg.vocab_size,
                      "sample_mb": cfg.tokenizer_sample_mb, "sample_bytes": sample_bytes},
        "domains": entries,
        "skipped": skipped,
        "workers": cfg.workers,
        "build_seconds": round(time.time() - t0, 2),
    }
    atomic_write_json(data_dir / "manifest.json", manifest, indent=2, sort_keys=True, ensure_ascii=False, newline=True)
    _log(f"done in {manifest['build_seconds']:.1f}s: {len(entries)} domains, {len(skipped)} skipped -> "
         f"{data_dir / 'manifest.json'}")
    return manifest


def _tokenizer_cached(tok_dir: Path, key_file: Path, tok_key: str) -> bool:
    if not (tok_dir / "tokenizer.json").exists() or not key_file.exists():
        return False
    try:
        rec = json.loads(key_file.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        return False
    return rec.get("key") == tok_key and rec.get("sha256") == sha256_file(tok_dir / "tokenizer.json")


def _resample(raw_path: Path, domain: str, domain_index: int, cfg: PrepareConfig, forced: dict[str, int],
              sample: TokenizerSample) -> None:
    """Offer a reused raw file's train chunks to the tokenizer sample (the same chunks a fresh read would offer)."""
    for i, line in enumerate(read_raw_lines(raw_path)):
        r = json.loads(line)
        u = split_u(cfg.seed, domain, r["doc"], r["chunk"])
        if (u >= cfg.val_fraction and i != forced.get("val")) or i == forced.get("train"):
            sample.offer(u, domain_index, i, r["text"])
