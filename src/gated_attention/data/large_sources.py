"""Opt-in large offline sources (a few hundred million tokens), from Debian: the Linux kernel and GCIDE.

Not in DEFAULT_SOURCES: `gattn data prepare --sources ... kernel_c kernel_doc gcide` after
`GATTN_LARGE_SOURCES=1 scripts/install_debian_deps.sh`. Why these: they are in the same registry as the default
sources (Debian main, offline once installed), their licences allow training and redistribution of derived models
(GPL-2 kernel; GCIDE GPL-2-or-later), they are large (kernel 6.1: ~1.1 GB of C, ~60 MB of reST/text docs; GCIDE
~40 MB of dictionary entries) and real human-written text and code of good quality, with little duplication.
Documents are streamed straight from the compressed archives, so memory does not grow with their size.
"""
from __future__ import annotations

import base64
import glob
import gzip
import re
import tarfile
from pathlib import Path
from typing import Any, Iterator

from .formats import SourceUnavailable
from .text import decode_utf8

GCIDE_DICT = "/usr/share/dictd/gcide.dict.dz"
GCIDE_INDEX = "/usr/share/dictd/gcide.index"
_DOC_SUFFIXES = (".rst", ".txt")
_C_SUFFIXES = (".c", ".h")


def _kernel_tarball() -> str:
    found = sorted(glob.glob("/usr/src/linux-source-*.tar.xz"),
                   key=lambda p: [int(x) for x in re.findall(r"\d+", Path(p).name)])
    if not found:
        raise SourceUnavailable("needs the Debian package linux-source-6.1 (or another linux-source-*); run "
                                "GATTN_LARGE_SOURCES=1 scripts/install_debian_deps.sh as root")
    return found[-1]


def _kernel_docs(tarball: str, keep, info: dict[str, Any]) -> Iterator[tuple[str, str]]:
    with tarfile.open(tarball, "r|xz") as tar:  # a stream: members in archive order, nothing seeks or buffers
        for m in tar:
            if not m.isfile():
                continue
            rel = m.name.split("/", 1)[-1]
            if not keep(rel):
                continue
            data = tar.extractfile(m).read()
            if b"\x00" in data:
                continue
            text, n = decode_utf8(data)
            info["replaced_chars"] += n
            yield rel, text


def _kernel(keep, what: str) -> tuple[Iterator, dict[str, Any]]:
    tarball = _kernel_tarball()
    info: dict[str, Any] = {"source": f"Debian {Path(tarball).name.removesuffix('.tar.xz')} ({tarball}): {what}",
                            "licence": "GPL-2.0 (Linux kernel; see /usr/share/doc/linux-source-*/copyright)",
                            "replaced_chars": 0}
    return _kernel_docs(tarball, keep, info), info


def _source_kernel_c(cache_dir: Path) -> tuple[Iterator, dict[str, Any]]:
    return _kernel(lambda rel: rel.endswith(_C_SUFFIXES) and not rel.startswith("Documentation/"),
                   "C sources and headers (*.c, *.h)")


def _source_kernel_doc(cache_dir: Path) -> tuple[Iterator, dict[str, Any]]:
    return _kernel(lambda rel: rel.startswith("Documentation/") and rel.endswith(_DOC_SUFFIXES),
                   "Documentation/ reST and text (*.rst, *.txt)")


def _b64(s: str) -> int:
    """dictd's index numbers: base64 digits (A-Za-z0-9+/), most significant first."""
    alphabet = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    n = 0
    for ch in s.encode():
        n = n * 64 + alphabet.index(ch)
    return n


def _source_gcide(cache_dir: Path) -> tuple[Iterator, dict[str, Any]]:
    if not (Path(GCIDE_DICT).exists() and Path(GCIDE_INDEX).exists()):
        raise SourceUnavailable("needs the Debian package dict-gcide; run "
                                "GATTN_LARGE_SOURCES=1 scripts/install_debian_deps.sh as root")
    info: dict[str, Any] = {"source": f"Debian dict-gcide ({GCIDE_DICT}): one document per dictionary entry",
                            "licence": "GPL-2.0-or-later (GCIDE; see /usr/share/doc/dict-gcide/copyright)",
                            "replaced_chars": 0}

    def docs() -> Iterator[tuple[str, str]]:
        entries: dict[int, tuple[int, str]] = {}  # offset -> (length, first headword): several words share an entry
        with open(GCIDE_INDEX, encoding="utf-8", errors="replace") as f:
            for line in f:
                parts = line.rstrip("\n").split("\t")
                if len(parts) != 3 or parts[0].startswith("00-"):  # 00-database-*: metadata, not entries
                    continue
                off, length = _b64(parts[1]), _b64(parts[2])
                entries.setdefault(off, (length, parts[0]))
        pos = 0
        with gzip.open(GCIDE_DICT, "rb") as f:  # dictzip is gzip-compatible; read in offset order, one entry a time
            for off in sorted(entries):
                length, word = entries[off]
                if off < pos:
                    continue  # overlapping entry (already covered)
                f.seek(off)
                text, n = decode_utf8(f.read(length))
                pos = off + length
                info["replaced_chars"] += n
                yield f"{off}:{word}", text

    return docs(), info


LARGE_DEFAULT = ("kernel_doc", "gcide")  # what `gattn compare --large-sources` adds (~100 MB: minutes to prepare)
LARGE_SOURCES = {"kernel_c": _source_kernel_c, "kernel_doc": _source_kernel_doc, "gcide": _source_gcide}
