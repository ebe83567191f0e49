"""A reader for R's serialization format (.rds, lazy-load .rdx/.rdb), enough for R data packages, without R."""
from __future__ import annotations

import gzip
import lzma
import os
import struct
import bz2
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

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
