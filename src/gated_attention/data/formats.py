"""`--extra PATH` readers, streamed: text files/folders, JSONL, Parquet and HF `datasets.save_to_disk` folders.

Each yields (doc_id, text) with text a str or, for a plain text file, an iterator over its lines (so a file far
larger than memory is never read whole). Parquet and `save_to_disk` go through pyarrow / datasets (the `data` extra);
a missing extra is one clear error. The `info` dict is filled in while the documents are read (replaced_chars,
skipped_files), so read it after the iterator is exhausted.
"""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any, Iterator

from .text import clean_text, decode_utf8

BLOCK = 1 << 20  # text files are read in 1 MiB blocks
EXTRA_HINT = "install the data extra: pip install 'gated-attention[data]' (pyarrow, datasets)"


class SourceUnavailable(RuntimeError):
    """A corpus source cannot be had here (not Debian, package missing, offline); the message says how to get it."""


def _need(module: str, what: str):
    try:
        return __import__(module, fromlist=["_"])
    except ImportError:
        raise SourceUnavailable(f"{what} needs the Python package {module.split('.')[0]}; {EXTRA_HINT}") from None


def is_saved_dataset(path: Path) -> bool:
    """A folder written by datasets' save_to_disk (a Dataset or a DatasetDict)."""
    return path.is_dir() and ((path / "dataset_info.json").exists() and (path / "state.json").exists()
                              or (path / "dataset_dict.json").exists())


def _sniff(path: Path) -> str | None:
    """None if the file is readable text, else why not. UTF-16 with a BOM is 'utf-16' (decoded whole, it is rare)."""
    with open(path, "rb") as f:
        head = f.read(2)
        if head in (b"\xff\xfe", b"\xfe\xff"):
            return "utf-16"
        f.seek(0)
        for block in iter(lambda: f.read(BLOCK), b""):
            if b"\x00" in block:
                return "NUL bytes: binary or UTF-16/32 without a BOM"
    return None


def text_file_lines(path: Path, info: dict[str, Any]) -> Iterator[str]:
    """The file's lines exactly as str.splitlines(keepends=True) of the whole decoded file would give them."""
    carry = ""
    pending = b""
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(BLOCK), b""):
            block = pending + block
            cut = block.rfind(b"\n") + 1  # decode whole lines only, so a multi-byte character is never split
            if cut == 0:
                pending = block
                continue
            pending = block[cut:]
            text, n = decode_utf8(block[:cut])
            info["replaced_chars"] += n
            lines = (carry + text).splitlines(keepends=True)
            carry = lines.pop() if lines else ""  # the last line may join the next block ("\r" + "\n")
            yield from lines
    text, n = decode_utf8(pending)
    info["replaced_chars"] += n
    yield from (carry + text).splitlines(keepends=True)


def _text_docs(f: Path, rel: str, info: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    why = _sniff(f)
    if why == "utf-16":
        try:
            raw = f.read_bytes().decode("utf-16").encode("utf-8")
        except UnicodeDecodeError:
            info.setdefault("skipped_files", []).append(f"{rel} (invalid UTF-16)")
            return
        text, n = decode_utf8(raw)
        info["replaced_chars"] += n
        yield rel, text
    elif why:
        info.setdefault("skipped_files", []).append(f"{rel} ({why})")
    else:
        yield rel, text_file_lines(f, info)


def _jsonl_docs(f: Path, rel: str, field: str, info: dict[str, Any]) -> Iterator[tuple[str, str]]:
    with open(f, "rb") as fh:
        for i, raw in enumerate(fh):
            line, n = decode_utf8(raw)
            info["replaced_chars"] += n
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{f}:{i + 1}: not valid JSON ({exc}); JSONL needs one object per line") from None
            if not isinstance(rec, dict) or not isinstance(rec.get(field), str):
                raise ValueError(f'{f}:{i + 1}: JSONL records need a string "{field}" field (--text-field)')
            t, n = clean_text(rec[field])
            info["replaced_chars"] += n
            yield f"{rel}:{i + 1}", t


def _column_docs(batches, rel: str, field: str, where: str, info: dict[str, Any]) -> Iterator[tuple[str, str]]:
    i = 0
    for batch in batches:
        if field not in batch.schema.names:
            raise ValueError(f"{where}: no column {field!r} (columns: {', '.join(batch.schema.names)}); "
                             f"pass --text-field")
        for value in batch.column(field).to_pylist():
            i += 1
            if value is None:
                continue
            if not isinstance(value, str):
                raise ValueError(f"{where}: column {field!r} holds {type(value).__name__}, not text; pass --text-field")
            t, n = clean_text(value)
            info["replaced_chars"] += n
            yield f"{rel}:{i}", t


def _parquet_docs(f: Path, rel: str, field: str, info: dict[str, Any]) -> Iterator[tuple[str, str]]:
    pq = _need("pyarrow.parquet", f"--extra {f} (Parquet)")
    pf = pq.ParquetFile(f)
    if field not in pf.schema_arrow.names:
        raise ValueError(f"{f}: no column {field!r} (columns: {', '.join(pf.schema_arrow.names)}); pass --text-field")
    yield from _column_docs(pf.iter_batches(batch_size=1024, columns=[field]), rel, field, str(f), info)


def _saved_dataset_docs(path: Path, field: str, info: dict[str, Any]) -> Iterator[tuple[str, str]]:
    ds = _need("datasets", f"--extra {path} (a datasets save_to_disk folder)")
    loaded = ds.load_from_disk(str(path))  # memory-mapped Arrow: rows are read batch by batch below
    parts = [(name, loaded[name]) for name in sorted(loaded)] if isinstance(loaded, ds.DatasetDict) else [("", loaded)]
    for name, d in parts:
        where = f"{path}" + (f" split {name}" if name else "")
        yield from _column_docs(d.data.to_batches(max_chunksize=1024), name or "rows", field, where, info)


def iter_extra(path: str | os.PathLike, text_field: str = "text") -> tuple[str, Iterator, dict[str, Any]]:
    """(domain name, documents, info) of a user file or folder; see the module docstring for the formats."""
    path = Path(path).expanduser()
    if not path.exists():
        raise SourceUnavailable(f"--extra {path}: no such file or folder")
    info: dict[str, Any] = {"source": f"user files ({path.resolve()})", "licence": "user-supplied",
                            "replaced_chars": 0}
    if is_saved_dataset(path):
        _need("datasets", f"--extra {path} (a datasets save_to_disk folder)")
        info["format"] = "datasets"
        return _domain_name(path), _saved_dataset_docs(path, text_field, info), info
    files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")) if path.is_dir() \
        else [path]
    if any(f.suffix == ".parquet" for f in files):
        _need("pyarrow.parquet", f"--extra {path} (Parquet)")  # fail before any reading, not halfway through
    root = path if path.is_dir() else path.parent

    def docs() -> Iterator[tuple[str, Any]]:
        n = 0
        for f in files:
            rel = f.relative_to(root).as_posix()
            if f.suffix == ".jsonl":
                gen = _jsonl_docs(f, rel, text_field, info)
            elif f.suffix == ".parquet":
                gen = _parquet_docs(f, rel, text_field, info)
            else:
                gen = _text_docs(f, rel, info)
            for d in gen:
                n += 1
                yield d
        for u in info.get("skipped_files", []):  # never skipped without a word: stderr now, the manifest later
            print(f"[data] --extra {path}: skipped {u}; convert it to UTF-8 text", file=sys.stderr, flush=True)
        if n == 0:
            skipped = info.get("skipped_files", [])
            why = f"every file was unreadable: {'; '.join(skipped)}" if skipped else "no text found"
            raise SourceUnavailable(f"--extra {path}: {why}; pass UTF-8 text, JSONL or Parquet files")

    return _domain_name(path), docs(), info


def _domain_name(path: Path) -> str:
    stem = path.name
    if path.is_file():
        for suffix in (".jsonl", ".txt", ".md", ".rst", ".json", ".parquet"):
            stem = stem.removesuffix(suffix)
    name = re.sub(r"[^A-Za-z0-9_-]+", "_", stem).strip("_")
    if not name:
        raise ValueError(f"cannot derive a domain name from {path}; rename it to something alphanumeric")
    return name
