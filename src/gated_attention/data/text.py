"""Corpus text basics: the special tokens, the documented invalid-UTF-8 policy and file checksums."""
from __future__ import annotations

import hashlib
import os
import re
import warnings


BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SPECIAL_TOKENS = [BOS, EOS, PAD]  # fixed order -> ids 0, 1, 2 in every tokenizer we train
MANIFEST_VERSION = 2  # 2: token files are lists of shards (tokens/<domain>/<split>-<k>.bin)


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
