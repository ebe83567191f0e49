"""Atomic file writes, the one home for them: a reader (or a crash) never sees a half-written file or folder.

Files: write a unique temp file beside the target, fsync, rename over it (`atomic_write_bytes/text/json`).
Folders: build everything in a temp folder beside the target, then swap it into place (`atomic_dir`).
Temp files get the user's umask (mkstemp alone would make them 0600) and are removed if anything fails.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

_UMASK = os.umask(0)  # read once: os.umask can only be read by setting it
os.umask(_UMASK)


def chmod_like_umask(path: str | os.PathLike) -> None:
    """Give a file made by mkstemp/mkdtemp the mode a plain open() would have (0666 minus the umask)."""
    os.chmod(path, 0o666 & ~_UMASK)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # unique per call: concurrent writers (parallel runs sharing an output folder) never share a temp file
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        chmod_like_umask(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any, indent: int | None = 1, *, sort_keys: bool = False,
                      ensure_ascii: bool = True, newline: bool = False) -> None:
    text = json.dumps(obj, indent=indent, sort_keys=sort_keys, ensure_ascii=ensure_ascii)
    atomic_write_text(path, text + ("\n" if newline else ""))


def atomic_save_figure(fig, path: str | os.PathLike, **savefig_kwargs) -> None:
    """matplotlib `fig.savefig` through a temp file (the format is taken from `path`'s suffix)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=f".tmp{path.suffix}")
    os.close(fd)
    try:
        fig.savefig(tmp, **savefig_kwargs)
        chmod_like_umask(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


@contextmanager
def atomic_dir(dst: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a fresh temp folder beside `dst`; on normal exit it replaces `dst` (an existing `dst` only with
    overwrite=True, else FileExistsError before anything is written). On an exception nothing changes."""
    dst = Path(dst)
    if dst.exists() and any(dst.iterdir()) and not overwrite:
        raise FileExistsError(f"{dst} already exists; pass --overwrite to replace it")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dst.parent, prefix=f".{dst.name}.", suffix=".tmp"))
    try:
        yield tmp
        old = None
        if dst.exists():
            old = dst.with_name(f".{dst.name}.{os.getpid()}.old")
            os.replace(dst, old)
        try:
            os.replace(tmp, dst)
        except BaseException:
            if old is not None:
                os.replace(old, dst)
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
