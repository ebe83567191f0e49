"""Atomic file writes, the one home for them: a reader (or a crash) never sees a half-written file or folder.

Files: write a unique temp file beside the target, fsync, rename over it (`atomic_write_bytes/text/json`).
Folders: build everything in a temp folder beside the target, then swap it into place (`atomic_dir`).
Temp files get the user's umask (mkstemp alone would make them 0600) and are removed if anything fails.

- Strict JSON out: `json_dumps` / `atomic_write_json` / `jsonl_line` write what a strict parser accepts. A
  non-finite float becomes `null` and the dict that held it records why: `{"loss": null, "nonfinite": {"loss":
  "nan"}}` (key -> "nan" / "inf" / "-inf"; a list element is recorded under the list's key).
- Strict JSON in: `read_json` turns a missing file, a folder, bad UTF-8 or bad JSON into one UserError line.
- Folder locks: `lock_dir(path)` — an exclusive OS lock (fcntl.flock) held while a command writes `path`; a second
  process gets a UserError naming the holder's PID. The lock file is removed when the command ends, however it ends
  (only a killed process leaves one, which the next command locks and removes). Every command that writes an output folder takes it in the
  library, the same way: its entry point is decorated `@locks_output("out", "gattn CMD")` (compare, each lab,
  longctx, extend; the trainer locks its run folder itself, rank 0 only), never in the CLI.
- HF checkpoint folders: `hf_weight_files` finds the weights the way transformers does (`model.safetensors`, else the
  shards named by `model.safetensors.index.json`, each confined to the folder; any other .safetensors is ignored);
  `load_safetensors` / `check_hf_dir` verify headers and sizes first, so a corrupt or truncated file is a clear
  error. No pickle is ever read from a user-supplied path.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import inspect
import json
import math
import os
import shutil
import struct
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from .errors import UserError

_UMASK = os.umask(0)  # read once: os.umask can only be read by setting it
os.umask(_UMASK)


def chmod_like_umask(path: str | os.PathLike) -> None:
    """Give a file made by mkstemp/mkdtemp the mode a plain open() would have (0666 minus the umask)."""
    os.chmod(path, 0o666 & ~_UMASK)


def _replace_atomically(path: str | os.PathLike, write, suffix: str = ".tmp") -> None:
    """`write(temp_path)` into a unique temp file beside `path`, then rename it over `path`; on any failure the temp
    file is removed and `path` is untouched. Unique per call: concurrent writers (parallel runs sharing an output
    folder) never share a temp file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=suffix)
    os.close(fd)
    try:
        write(tmp)
        chmod_like_umask(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_with(path: str | os.PathLike, write) -> None:
    """`write(temp_path)` writes the whole file (e.g. a library's own writer); it lands at `path` atomically."""
    _replace_atomically(path, write)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    def write(tmp):
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    _replace_atomically(path, write)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any, indent: int | None = 1, *, sort_keys: bool = False,
                      ensure_ascii: bool = True, newline: bool = False) -> None:
    text = json_dumps(obj, indent=indent, sort_keys=sort_keys, ensure_ascii=ensure_ascii)  # strict JSON
    atomic_write_text(path, text + ("\n" if newline else ""))


def atomic_save_figure(fig, path: str | os.PathLike, **savefig_kwargs) -> None:
    """matplotlib `fig.savefig` through a temp file (the format is taken from `path`'s suffix)."""
    _replace_atomically(path, lambda tmp: fig.savefig(tmp, **savefig_kwargs), suffix=f".tmp{Path(path).suffix}")


def save_png(fig, path: str | os.PathLike, dpi: int = 110) -> Path:
    """A plot as PNG, atomically (tight bounding box), then closes the figure: the one figure writer of the analysis
    plots and every report. Returns the path."""
    import matplotlib.pyplot as plt

    path = Path(path)
    try:
        atomic_save_figure(fig, path, format="png", dpi=dpi, bbox_inches="tight")
    finally:
        plt.close(fig)
    return path


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


# ------------------------------------------------------------------------------------------------ strict JSON

def _nonfinite_name(x: float) -> str:
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


def to_strict(obj: Any) -> Any:
    """A copy of `obj` in which every non-finite float is None, and each dict that held one (directly or inside a
    list value) gains "nonfinite": {key: "nan" | "inf" | "-inf"}. Tuples become lists; numpy/torch scalars become
    Python numbers."""
    if isinstance(obj, bool) or obj is None or isinstance(obj, (str, int)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        out, bad = {}, {}
        for k, v in obj.items():
            out[k] = to_strict(v)
            reason = _first_nonfinite(v)
            if reason is not None:
                bad[str(k)] = reason
        if bad:
            prev = out.get("nonfinite")
            out["nonfinite"] = {**prev, **bad} if isinstance(prev, dict) else bad
        return out
    if isinstance(obj, (list, tuple)):
        return [to_strict(v) for v in obj]
    if hasattr(obj, "item") and callable(obj.item) and getattr(obj, "ndim", 0) == 0:  # numpy / torch scalar
        return to_strict(obj.item())
    if hasattr(obj, "tolist"):  # numpy array / tensor
        return to_strict(obj.tolist())
    return obj


def _first_nonfinite(v: Any) -> str | None:
    """The reason to record for dict value `v`: its own non-finiteness, or that of a list element (not nested
    dicts, which record their own)."""
    if isinstance(v, float) and not math.isfinite(v):
        return _nonfinite_name(v)
    if isinstance(v, (list, tuple)):
        for x in v:
            r = _first_nonfinite(x)
            if r is not None:
                return r
    if hasattr(v, "item") and getattr(v, "ndim", None) == 0:
        return _first_nonfinite(v.item())
    return None


def from_strict(obj: Any) -> Any:
    """Inverse of `to_strict` for dict values: null + "nonfinite": {key: reason} becomes float(reason) again (a
    list value gets its null elements back as that reason). For state that must round-trip, e.g. checkpoint meta."""
    if isinstance(obj, list):
        return [from_strict(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    reasons = obj.get("nonfinite") if isinstance(obj.get("nonfinite"), dict) else {}
    out = {k: from_strict(v) for k, v in obj.items() if not (k == "nonfinite" and reasons)}
    for k, why in reasons.items():
        if k in out and why in ("nan", "inf", "-inf"):
            if out[k] is None:
                out[k] = float(why)
            elif isinstance(out[k], list):
                out[k] = [float(why) if v is None else v for v in out[k]]
    return out


def nonfinite_paths(obj: Any, prefix: str = "") -> list[str]:
    """Dotted paths of every non-finite float in `obj` (to report a NaN metric, not just null it)."""
    if isinstance(obj, float):
        return [] if math.isfinite(obj) else [prefix or "<root>"]
    if isinstance(obj, dict):
        return [p for k, v in obj.items() for p in nonfinite_paths(v, f"{prefix}.{k}" if prefix else str(k))]
    if isinstance(obj, (list, tuple)):
        return [p for i, v in enumerate(obj) for p in nonfinite_paths(v, f"{prefix}[{i}]")]
    return []


def json_dumps(obj: Any, **kw) -> str:
    """json.dumps that a strict parser accepts (no NaN/Infinity tokens; see `to_strict`)."""
    return json.dumps(to_strict(obj), allow_nan=False, **kw)


def jsonl_line(obj: Any) -> str:
    """One strict JSON line (with the newline) for a .jsonl log."""
    return json_dumps(obj) + "\n"


def append_jsonl(path: str | os.PathLike, obj: Any) -> None:
    """Append one strict JSON line to a .jsonl log (created if missing), flushed and fsynced: a kill leaves at most
    the last line cut short, which `read_jsonl` skips."""
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(jsonl_line(obj))
        fh.flush()
        os.fsync(fh.fileno())


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """The objects of a .jsonl log, in order; a missing file is empty and a line cut short by a kill is skipped."""
    path = Path(path)
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # the last line of a killed writer
    return out


def _reject_constant(name: str):
    raise ValueError(f"non-standard JSON constant {name}")


def strict_loads(text: str) -> Any:
    """json.loads that rejects NaN / Infinity (what our writers never produce)."""
    return json.loads(text, parse_constant=_reject_constant)


def read_json(path: str | os.PathLike, what: str = "JSON file", fix: str | None = None) -> Any:
    """Parse the JSON file `path`; any problem (missing, a folder, not UTF-8, not JSON) is one UserError line."""
    path = Path(path)
    fix = fix or "fix or regenerate it"
    if not path.exists():
        raise UserError(f"{what} {path} does not exist; {fix}")
    if path.is_dir():
        raise UserError(f"{what} {path} is a folder, not a file; {fix}")
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise UserError(f"{what} {path} is not UTF-8 ({exc.reason} at byte {exc.start}); {fix}") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"{what} {path} is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}); "
                        f"{fix}") from None


def read_json_object(path: str | os.PathLike, what: str = "JSON file", fix: str | None = None) -> dict:
    obj = read_json(path, what, fix)
    if not isinstance(obj, dict):
        raise UserError(f"{what} {path} holds a JSON {type(obj).__name__}, not an object; {fix or 'fix or regenerate it'}")
    return obj


def renamed(d: dict, renames: dict) -> dict:
    """`d` with its keys stored under an older name read under today's (`renames`: old -> new; None drops a retired
    setting); a key stored under both names is an error."""
    out = {k: v for k, v in d.items() if k not in renames}
    for old, new in renames.items():
        if old in d and new is not None:
            if new in d:
                raise ValueError(f"settings hold both {old!r} and its new name {new!r}; keep {new!r}")
            out[new] = d[old]
    return out


# ------------------------------------------------------------------------------------------------ folder locks

_held: dict[str, list] = {}  # lock file -> [fd, depth]: re-entrant within one process (compare -> train)
_held_guard = threading.Lock()


def lock_path_for(path: str | os.PathLike) -> Path:
    """The lock file of output folder `path`: a hidden sibling, so the folder itself may be created, renamed into
    place or replaced atomically while locked, and its contents stay exactly what the command writes."""
    p = Path(os.path.abspath(path))
    return p.parent / f".{p.name}.gattn-lock"


@contextlib.contextmanager
def lock_dir(path: str | os.PathLike, cmd: str = "gattn") -> Iterator[Path]:
    """Hold an exclusive OS lock (fcntl.flock, released by the kernel when the process dies) on output folder
    `path` for the duration of the block. A second process raises UserError naming the holder's PID. Re-entrant in
    one process. Under torchrun only RANK 0 locks (all ranks of one job write one folder)."""
    if int(os.environ.get("RANK", "0")) != 0:
        yield lock_path_for(path)
        return
    lp = lock_path_for(path)
    key = str(lp)
    with _held_guard:
        if key in _held:
            _held[key][1] += 1
            reentered = True
        else:
            reentered = False
    if not reentered:
        try:
            lp.parent.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise UserError(f"cannot create output folder {Path(path)}: a file is in the way; choose another path") \
                from None
        fd = _flock_linked(lp, path, cmd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        with _held_guard:
            _held[key] = [fd, 1]
    try:
        yield lp
    finally:
        with _held_guard:
            entry = _held[key]
            entry[1] -= 1
            if entry[1] == 0:
                del _held[key]
                # unlinked while still held, so no finished run leaves its lock file behind; a process that opened
                # this file meanwhile finds it unlinked once it gets the lock, and retries on a new one
                with contextlib.suppress(OSError):
                    os.unlink(lp)
                fcntl.flock(entry[0], fcntl.LOCK_UN)
                os.close(entry[0])


def _flock_linked(lp: Path, path, cmd: str) -> int:
    """An fd of lock file `lp` holding its exclusive flock, the file still linked at `lp` (a previous holder unlinks
    it before releasing: a lock won on the unlinked file would exclude nobody, so it is dropped and taken again)."""
    while True:
        fd = os.open(lp, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)
            raise UserError(f"{Path(path)} is in use by another {cmd} process (PID {holder}, lock {lp}); wait for it "
                            f"to finish or choose another output folder") from None
        except OSError as exc:  # ENOLCK/EOPNOTSUPP: a filesystem without flock (Lustre mounted without -o flock)
            os.close(fd)
            raise UserError(f"cannot lock output folder {Path(path)}: its filesystem does not support flock "
                            f"({exc.strerror or exc}, lock {lp}); mount it with flock support (Lustre: -o flock; "
                            "NFS: with its lock service) or choose an output folder on a filesystem that has it "
                            "(docs/scale.md: filesystem assumptions)") from None
        try:
            linked = os.path.samestat(os.fstat(fd), os.stat(lp))
        except FileNotFoundError:
            linked = False
        if linked:
            return fd
        os.close(fd)


def locks_output(where: str | Callable[..., Any], cmd: str):
    """Decorator for the library entry point of a command that writes an output folder: the whole call holds
    `lock_dir` on that folder, so every command locks the same way whatever calls it (the CLI only parses). `where`
    names the argument holding the folder ("out", or "lab.out": an attribute of an argument), or is a function of
    the call's arguments (by name) returning it; None from it means no lock (a run that only reads)."""
    def decorate(fn):
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def locked(*args, **kwargs):
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            if callable(where):
                folder = where(**bound.arguments)
            else:
                name, *attrs = where.split(".")
                folder = bound.arguments[name]
                for a in attrs:
                    folder = getattr(folder, a)
            if folder is None:
                return fn(*args, **kwargs)
            with lock_dir(folder, cmd):
                return fn(*args, **kwargs)

        return locked

    return decorate


# ------------------------------------------------------------------------------------------------ HF weights

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


def _confined(folder: Path, name: str, index: Path) -> Path:
    if not isinstance(name, str) or not name:
        raise UserError(f"{index} names a shard {name!r} that is not a file name; fix the index")
    p = (folder / name).resolve()
    if not p.is_relative_to(folder.resolve()):
        raise UserError(f"{index} names shard {name!r} outside the checkpoint folder; shards must live in {folder}")
    if not p.is_file():
        raise UserError(f"{index} names shard {name!r}, which is missing from {folder}; copy the complete checkpoint")
    return p


def hf_weight_files(folder: str | os.PathLike) -> list[Path]:
    """The weight files transformers would load from `folder`: model.safetensors, else the shards listed by
    model.safetensors.index.json. Other .safetensors files are ignored; pickles are refused."""
    folder = Path(folder)
    single, index = folder / SAFE_WEIGHTS, folder / SAFE_INDEX
    if single.is_file():
        return [single]
    if index.is_file():
        idx = read_json_object(index, "shard index", "re-save the checkpoint")
        wm = idx.get("weight_map")
        if not isinstance(wm, dict) or not wm:
            raise UserError(f"{index} has no 'weight_map' object; re-save the checkpoint")
        return [_confined(folder, n, index) for n in sorted(set(wm.values()), key=str)]
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES) if folder.is_dir() else []
    if pickles:
        raise UserError(f"{folder} has only pickle weights {pickles}, which are never loaded (they can run arbitrary "
                        "code); re-save them as safetensors (save_pretrained(safe_serialization=True))")
    others = sorted(p.name for p in folder.glob("*.safetensors")) if folder.is_dir() else []
    hint = f" (found {others}, which are not model weights by HF naming)" if others else ""
    raise UserError(f"{folder} has no {SAFE_WEIGHTS} or {SAFE_INDEX}{hint}; pass a checkpoint folder as "
                    "save_pretrained writes it")


def verify_safetensors(path: str | os.PathLike) -> dict:
    """Check that `path` is a complete safetensors file (header parses, every tensor lies inside the file); return
    its header. Raises UserError naming the file otherwise."""
    path = Path(path)
    fix = "re-save or re-copy the checkpoint"
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise UserError(f"{path} is truncated ({size} bytes, no safetensors header); {fix}")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > 100_000_000:
            raise UserError(f"{path} is corrupt or truncated (header of {n} bytes in a {size}-byte file); {fix}")
        try:
            header = json.loads(fh.read(n).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise UserError(f"{path} is corrupt (unreadable safetensors header); {fix}") from None
    if not isinstance(header, dict):
        raise UserError(f"{path} is corrupt (safetensors header is not an object); {fix}")
    data = size - 8 - n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offs = info.get("data_offsets") if isinstance(info, dict) else None
        if not (isinstance(offs, list) and len(offs) == 2 and all(isinstance(o, int) for o in offs)):
            raise UserError(f"{path} is corrupt (tensor {name!r} has no valid data_offsets); {fix}")
        if not 0 <= offs[0] <= offs[1] <= data:
            raise UserError(f"{path} is truncated (tensor {name!r} ends at byte {offs[1]} of {data} data bytes); {fix}")
    return header


def load_safetensors(path: str | os.PathLike) -> dict:
    """The tensors of one .safetensors file, after `verify_safetensors`; library errors become UserError."""
    from safetensors.torch import load_file

    verify_safetensors(path)
    try:
        return load_file(str(path))
    except Exception as exc:  # SafetensorError and friends: a damaged file, not a bug here
        raise UserError(f"{path} could not be read as safetensors ({exc}); re-save or re-copy the checkpoint") \
            from None


def load_hf_state(folder: str | os.PathLike) -> dict:
    """The full state dict of an HF checkpoint folder (all shards merged; a key in two shards is an error)."""
    state: dict = {}
    for f in hf_weight_files(folder):
        for k, v in load_safetensors(f).items():
            if k in state:
                raise UserError(f"key {k} appears in more than one weight file of {folder}; re-save the checkpoint")
            state[k] = v
    return state


def check_hf_dir(folder: str | os.PathLike, what: str = "checkpoint folder") -> dict:
    """Verify an HF checkpoint folder before from_pretrained touches it: a folder, config.json a JSON object,
    weights present and intact. Returns config.json."""
    folder = Path(folder)
    if not folder.exists():
        raise UserError(f"{what} {folder} does not exist; check the path")
    if not folder.is_dir():
        raise UserError(f"{what} {folder} is a file; pass the folder (config.json + model.safetensors)")
    config = read_json_object(folder / "config.json", "config", "pass a checkpoint folder written by save_pretrained")
    for f in hf_weight_files(folder):
        verify_safetensors(f)
    return config


__all__ = ["chmod_like_umask", "atomic_write_with", "atomic_write_bytes", "atomic_write_text", "atomic_write_json", "atomic_save_figure",
           "save_png", "atomic_dir", "to_strict", "from_strict", "nonfinite_paths", "json_dumps", "jsonl_line",
           "append_jsonl", "read_jsonl", "strict_loads", "read_json", "read_json_object", "lock_path_for", "lock_dir",
           "locks_output", "SAFE_WEIGHTS", "SAFE_INDEX", "PICKLE_SUFFIXES", "hf_weight_files", "verify_safetensors",
           "load_safetensors", "load_hf_state", "check_hf_dir"]
