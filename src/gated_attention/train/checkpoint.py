"""Atomic, rotated training checkpoints: a gathered full state (DDP, one process), or sharded DCP (dist=fsdp).

Layout: OUT/checkpoints/step_00000120/{state.pt, meta.json, rng_rank0.pt, ...}; under dist=fsdp `state/` (a
torch.distributed.checkpoint folder: `.metadata` and one `__<rank>_0.distcp` per writing rank, written by every rank
in parallel, readable at any world size) in place of state.pt. A checkpoint is written into a hidden
temporary folder, every file fsync'ed, then the folder is renamed into place (rename is atomic on POSIX) and the
parent fsync'ed. A crash (even SIGKILL mid-write) therefore leaves either the previous checkpoints intact plus a stale
`.tmp-*` folder (removed on the next start) or the complete new one, never a half-written `step_*`.

Each checkpoint carries `manifest.json`, written LAST: a folder without a matching manifest is not a checkpoint. It
records every other file's size and the SHA-256 of each of its pieces (1 MiB, or 1/64 of a larger file: at most 64
per file). Every rank hashes the files it wrote and rank 0 merges the records. On resume the ranks verify a
checkpoint together, each 1/world of the files (the run folder is on a filesystem every rank sees: docs/scale.md),
without reading it whole: every size, and of each file its first and last piece and 4 more drawn afresh each time
(a file of up to 6 pieces is read whole). A truncated, missing, replaced or zero-filled file is caught by its size
or its first or last piece; damage confined to the middle of a large file is caught with the probability that a
drawn piece covers it — the load that follows reads every byte, and `verify(full=True)` checks every piece.
`--resume` verifies the newest and falls back to the newest valid one, warning which were skipped. Re-saving an
existing step renames the old copy aside, puts the new one in place, and only then deletes the old one. A write
that fails (a full disk) removes its temp folder and leaves every previous checkpoint intact. Files are read back with `torch.load(weights_only=True)` (tensors and plain containers only, no
pickle code) and JSON: nothing from a run folder can execute code.

Tests kill a run inside a checkpoint write (after state.pt, before the rename) with tests/probes/kill_hooks.py, which
wraps `write_files`; nothing here knows about it.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle  # only for its exception type: torch.load(weights_only=True) raises UnpicklingError
import random
import re
import shutil
import sys
from pathlib import Path

import torch

from ..util.errors import UserError
from ..util.io import from_strict, json_dumps, read_json_object

_STEP_DIR = re.compile(r"^step_(\d{8})$")
MANIFEST = "manifest.json"
SHARDED = "state"  # the DCP folder of a sharded checkpoint


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checkpoint_root(out_dir: str | Path) -> Path:
    return Path(out_dir) / "checkpoints"


def list_checkpoints(out_dir: str | Path) -> list[tuple[int, Path]]:
    root = checkpoint_root(out_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(found)


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    ckpts = list_checkpoints(out_dir)
    return ckpts[-1][1] if ckpts else None


def clean_stale(out_dir: str | Path) -> None:
    """Remove temporary folders left by a write that was killed."""
    root = checkpoint_root(out_dir)
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith(".tmp-"):
                _remove(p)
            elif p.name.startswith(".old-step_"):  # killed between the two renames of a re-save
                final = root / p.name[len(".old-"):]
                if final.exists() or not p.is_dir():
                    _remove(p)
                else:
                    os.rename(p, final)


def tmp_dir_for(out_dir: str | Path, step: int) -> Path:
    """The (shared) temporary folder all ranks write into for this step's checkpoint."""
    return checkpoint_root(out_dir) / f".tmp-step_{step:08d}"


def write_files(tmp: Path, files: dict[str, object]) -> None:
    """Write torch objects (name.pt) or JSON (name.json) into `tmp`, each fsync'ed. Called by every rank for its
    own files (rank 0 also writes the shared state). On failure (e.g. a full disk) `tmp` is removed and the error
    re-raised: the previous checkpoints are untouched."""
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        for name, obj in files.items():
            path = tmp / name
            if name.endswith(".json"):
                path.write_text(json_dumps(obj, indent=1, sort_keys=True))
            else:
                with open(path, "wb") as fh:  # a Python file: a full disk surfaces as OSError, not a bare iostream error
                    torch.save(obj, fh)
            _fsync_file(path)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        cause = exc.__context__
        if isinstance(exc, RuntimeError) and isinstance(cause, OSError):  # torch wraps the write's OSError
            raise cause from None
        raise


PIECE = 1 << 20  # the smallest hashed piece of a file (bytes)
MAX_PIECES = 64  # pieces per file at most: the manifest stays small whatever the file's size
SAMPLED = 4  # pieces a resume checks besides a file's first and last, drawn afresh each time


def _piece_size(size: int) -> int:
    return max(PIECE, -(-size // MAX_PIECES))


def _sha256(path: Path) -> str:
    """The SHA-256 of a whole file (manifests of version 1 recorded one per file)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(PIECE), b""):
            h.update(block)
    return h.hexdigest()


def _piece_hash(fh, index: int, step: int) -> str:
    h = hashlib.sha256()
    fh.seek(index * step)
    left = step
    while left > 0 and (block := fh.read(min(PIECE, left))):
        h.update(block)
        left -= len(block)
    return h.hexdigest()


def _remove(path: Path) -> None:
    """Remove a file or a folder tree, whichever `path` is (a stray entry may be either); nothing if absent."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            path.unlink()
        except FileNotFoundError:
            pass


_RANK_FILE = re.compile(r"^(?:rng_rank(\d+)\.pt|" + SHARDED + r"/__(\d+)_\d+\.distcp)$")


def file_owner(name: str) -> int:
    """The rank that wrote checkpoint file `name` (relative path): rng_rank<r>.pt and the DCP shard __<r>_*.distcp
    are rank r's; everything else (meta.json, state.pt, .metadata, config.json) rank 0's."""
    m = _RANK_FILE.match(name)
    return int(m.group(1) or m.group(2)) if m else 0


def _files(folder: Path) -> list[str]:
    return [p.relative_to(folder).as_posix() for p in sorted(folder.rglob("*")) if p.is_file() and p.name != MANIFEST]


def _record(path: Path) -> dict:
    """The file's size and the SHA-256 of each of its pieces (one read of the file)."""
    size = path.stat().st_size
    step = _piece_size(size)
    with open(path, "rb") as fh:
        pieces = [_piece_hash(fh, i, step) for i in range(-(-size // step))]
    return {"size": size, "piece": step, "pieces": pieces}


def hash_own_files(tmp: Path, rank: int) -> dict:
    """Size and SHA-256 of the files rank `rank` wrote into `tmp` (file_owner): every rank hashes its own, in
    parallel, and rank 0 merges them into the manifest (write_manifest) — no rank reads the whole checkpoint."""
    return {name: _record(tmp / name) for name in _files(tmp) if file_owner(name) == rank}


def write_manifest(tmp: Path, hashed: dict | None = None) -> None:
    """Record every file's size and SHA-256 in manifest.json — the last file written into a checkpoint. `hashed`:
    the records the ranks computed of their own files (hash_own_files, merged); any file without one is hashed
    here."""
    try:
        hashed = hashed or {}
        files = {name: hashed.get(name) or _record(tmp / name) for name in _files(tmp)}
        path = tmp / MANIFEST
        path.write_text(json_dumps({"version": 2, "files": files}, indent=1, sort_keys=True))
        _fsync_file(path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def verify(ckpt: Path, rank: int = 0, world: int = 1, full: bool = False) -> str | None:
    """None if checkpoint folder `ckpt` is complete and intact, else the reason it is not: every file's size and of
    each file its first, last and SAMPLED more pieces (`full`: every piece; see the module docstring). With world > 1
    this rank checks the manifest and every world-th file of it (from its `rank`-th): the ranks of a job verify a
    checkpoint together (any world size, whatever wrote it)."""
    man = ckpt / MANIFEST
    if not man.is_file():
        return "no manifest.json (incomplete write or written by an older version)"
    try:
        files = json.loads(man.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError):
        return "manifest.json is unreadable"
    if not isinstance(files, dict) or not all(isinstance(r, dict) for r in files.values()):
        return "manifest.json is not a checkpoint manifest"
    if "meta.json" not in files:
        return "manifest lists no meta.json"
    if "state.pt" not in files and SHARDED + "/.metadata" not in files:
        return f"manifest lists no state.pt and no {SHARDED}/.metadata"
    for i, (name, rec) in enumerate(sorted(files.items())):
        if i % world == rank:
            reason = _check_file(ckpt, name, rec, full)
            if reason is not None:
                return reason
    return None


def _check_file(ckpt: Path, name: str, rec: dict, full: bool) -> str | None:
    """Why file `name` of `ckpt` does not match its manifest record `rec`, or None."""
    p = ckpt / name
    if ".." in Path(name).parts or Path(name).is_absolute():
        return f"manifest names {name!r}, outside the checkpoint"
    if not p.is_file():
        return f"{name} is missing"
    size = p.stat().st_size
    if size != rec.get("size"):
        return f"{name} has {size} bytes, manifest says {rec.get('size')} (truncated?)"
    if "pieces" not in rec:  # a manifest of version 1: one hash of the whole file
        return None if _sha256(p) == rec.get("sha256") else f"{name} checksum does not match the manifest (corrupt)"
    step, pieces = rec.get("piece"), rec.get("pieces")
    if not isinstance(step, int) or step < 1 or not isinstance(pieces, list) or len(pieces) != -(-size // step):
        return f"manifest entry of {name} is malformed"
    n = len(pieces)
    picks = range(n) if full or n <= SAMPLED + 2 else \
        sorted({0, n - 1, *random.SystemRandom().sample(range(1, n - 1), SAMPLED)})
    try:
        with open(p, "rb") as fh:
            bad = next((i for i in picks if _piece_hash(fh, i, step) != pieces[i]), None)
    except OSError as exc:
        return f"{name} could not be read ({exc.strerror or exc})"
    return None if bad is None else f"{name} piece {bad} of {n} does not match the manifest (corrupt)"


def latest_valid_checkpoint(out_dir: str | Path, warn=None, check=None) -> Path | None:
    """The newest checkpoint that passes `check(path) -> reason or None` (default: verify). Each newer one is
    renamed to `corrupt-step_N` (so rotation and later resumes ignore it) by `set_aside`. None when there is no
    valid checkpoint. In one process; a job's ranks verify together with newest_valid."""
    for _, path in reversed(list_checkpoints(out_dir)):
        reason = (check or verify)(path)
        if reason is None:
            return path
        set_aside(path, reason, warn)
    return None


def set_aside(path: Path, reason: str, warn=None) -> None:
    """Rename a checkpoint that failed verification to corrupt-step_N (kept for inspection; no longer counts as a
    checkpoint) and report it via `warn(message)` (default: a line on stderr). Rank 0 only."""
    warn = warn or (lambda m: print(m, file=sys.stderr, flush=True))
    bad = path.with_name(f"corrupt-{path.name}")
    _remove(bad)
    os.rename(path, bad)
    warn(f"gattn: warning: skipping checkpoint {path.name}: {reason}; moved it to {bad} and falling back to an "
         "older one")


def commit(out_dir: str | Path, step: int, keep: int) -> Path:
    """Rename the finished temporary folder into place and rotate (keep the last `keep`). Rank 0 only."""
    root = checkpoint_root(out_dir)
    tmp = tmp_dir_for(out_dir, step)
    final = root / f"step_{step:08d}"
    _fsync_dir(tmp)
    old = None
    if final.exists():  # re-saving the same step (e.g. end of a resumed run): the old copy goes only once the new is in
        old = root / f".old-step_{step:08d}"
        _remove(old)
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(root)
    if old is not None:
        _remove(old)
    for _, stale in list_checkpoints(out_dir)[:-keep]:  # renamed out of the checkpoints first: a kill during the
        doomed = root / f".tmp-rotated-{stale.name}"  # delete leaves a temporary folder (removed at the next start),
        os.rename(stale, doomed)  # never a half-deleted step_N
        _remove(doomed)
    return final


def is_sharded(ckpt: Path) -> bool:
    return (Path(ckpt) / SHARDED / ".metadata").is_file()


def load_files(ckpt: Path, rank: int) -> tuple[dict | None, dict, dict | None]:
    """(shared state — None for a sharded checkpoint, whose state/ is read by state.load_sharded_state —, meta, this
    rank's RNG state or None if the checkpoint came from fewer ranks).

    weights_only=True: only tensors and plain containers are unpickled, so a run folder from someone else cannot
    execute code."""
    try:
        state = None if is_sharded(ckpt) else torch.load(ckpt / "state.pt", map_location="cpu", weights_only=True)
        meta = from_strict(json.loads((ckpt / "meta.json").read_text()))  # NaN state round-trips
        rng_path = ckpt / f"rng_rank{rank}.pt"
        rng = torch.load(rng_path, map_location="cpu", weights_only=True) if rng_path.exists() else None
        if not isinstance(meta, dict) or not isinstance(state, (dict, type(None))) or \
                not isinstance(rng, (dict, type(None))):
            raise ValueError("not a checkpoint's contents")
    except (OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError) as exc:  # damaged, or not ours
        raise UserError(f"checkpoint {ckpt} could not be loaded ({type(exc).__name__}: {exc}); delete it to resume "
                        "from an older one") from None
    return state, meta, rng


# ---------------------------------------------------------------- what a run resumes from

# what marks a folder as a training run folder: the settings the trainer writes first, or its checkpoints
RUN_MARKERS = ("train_config.json", "checkpoints")


# a run folder's own entries and what each must be: anything else in their place is refused before anything is read
LAYOUT = {"train_config.json": "file", "log.jsonl": "file", "summary.json": "file", "checkpoints": "folder",
          "final": "folder", "tb": "folder"}


def is_run_dir(out: Path) -> bool:
    return any((out / m).exists() for m in RUN_MARKERS)


def check_layout(out: Path) -> None:
    """One line naming the first of the run's own entries (LAYOUT) that is a folder where a file belongs or the
    reverse: the run would fail on it later, after training."""
    for name, kind in LAYOUT.items():
        p = out / name
        if p.exists() and p.is_dir() != (kind == "folder"):
            raise UserError(f"{p} is a {'folder' if p.is_dir() else 'file'} where the run keeps its {name} {kind}; "
                            "move it out of the run folder and rerun")


def saved_settings(out: Path, warn=None) -> dict | None:
    """The settings a run folder was started with: train_config.json, or where that is missing or damaged the
    settings recorded in its newest intact checkpoint (said by `warn`); None where neither exists. A damaged
    train_config.json with no intact checkpoint is one line naming it."""
    path = out / "train_config.json"
    try:
        if not path.exists():
            return _checkpoint_settings(out, None, warn)
        return _settings(read_json_object(path, "saved run settings", "restore it or start a new --out"), path)
    except UserError as exc:
        found = _checkpoint_settings(out, exc, warn)
        if found is None:
            raise
        return found


def _settings(found: dict, where: Path) -> dict:
    """`found` if it is a run's settings (TrainConfig reads and validates it), else one line naming `where`."""
    from .config import TrainConfig

    try:
        TrainConfig.from_dict(found).validate()
    except (ValueError, TypeError) as exc:
        raise UserError(f"{where} holds no run's settings ({exc}); restore it or start a new --out") from None
    return found


def _checkpoint_settings(out: Path, problem: Exception | None, warn) -> dict | None:
    """The settings in meta.json of the newest checkpoint of `out` that verifies, or None."""
    for _, ckpt in reversed(list_checkpoints(out)):
        if verify(ckpt) is not None:
            continue
        try:
            meta = json.loads((ckpt / "meta.json").read_text())
            found = _settings({**meta["config"], "resolved_precision": meta["resolved_precision"]}, ckpt)
        except (OSError, ValueError, KeyError, TypeError):  # UserError included
            continue
        if problem is not None or not (out / "train_config.json").exists():
            (warn or (lambda m: print(m, file=sys.stderr, flush=True)))(
                f"gattn: warning: {problem or 'train_config.json is missing'}; using the settings recorded in "
                f"checkpoint {ckpt.name}")
        return found
    return None


def settings_differ(ckpt: Path, want: dict) -> str | None:
    """Why checkpoint `ckpt` (verified) is not this run's — the settings in its meta.json differ from `want`
    (resume_rule) —, or None (a checkpoint of an older version records none)."""
    from .resume_rule import describe_changes

    try:
        meta = json.loads((ckpt / "meta.json").read_text())
        if not isinstance(meta, dict) or "config" not in meta:
            return None if isinstance(meta, dict) else "its meta.json is not a checkpoint's"
        saved = {**meta["config"], "resolved_precision": meta.get("resolved_precision")}
        diff = describe_changes(saved, want)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"its meta.json is unreadable ({type(exc).__name__})"
    return f"it was written by a run with other settings ({diff})" if diff else None


def resume_decision(out: Path, resume: bool | str, cfg_path: Path, want: dict, overwrite: bool = False
                    ) -> bool | str:
    """Rank 0: check the run folder against the request; returns what to do: False (start), True (resume from the
    newest valid checkpoint, an error if none is valid) or "auto" (resume from it, start if none is valid; a
    checkpoint that fails verification is moved aside as corrupt-step_N, with a warning, never deleted). Every rank
    then verifies the checkpoints together (newest_valid). A new run goes only into a new or empty folder or a run
    folder (RUN_MARKERS), or with `overwrite` into any folder: a folder of other files is the user's."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; choose a folder for the run")
    if out.is_dir():
        check_layout(out)
    if resume is not True and not overwrite and out.is_dir() and any(out.iterdir()) and not is_run_dir(out):
        raise UserError(f"--out {out} already holds files and is not a training run folder (no train_config.json "
                        "or checkpoints/); choose a new or empty --out, or pass --overwrite to train into it "
                        "(its files of the same names are replaced, others kept)")
    out.mkdir(parents=True, exist_ok=True)
    clean_stale(out)
    any_ckpt = latest_checkpoint(out)
    auto = resume == "auto"
    if auto:
        if any_ckpt is None:
            return "auto"  # nothing to verify: the trainer says it starts
        resume = True
    if any_ckpt is not None and not resume:
        raise UserError(f"{out} already holds checkpoints; pass --resume (or --resume auto) to continue or choose a "
                        "new --out")
    if not resume:
        return False
    if any_ckpt is None and not cfg_path.exists():
        raise UserError(f"nothing to resume in {out} (no train_config.json, no checkpoints); drop --resume to start "
                        "a new run there")
    saved = saved_settings(out, warn=lambda m: None)  # run_config said where they came from
    if saved is not None:
        from .resume_rule import describe_changes

        diff = describe_changes(saved, want)
        if diff:
            raise UserError(f"--resume with settings that differ from the saved run ({diff}); use the original "
                            "settings or a new --out")
    if any_ckpt is None:
        return False  # the run was stopped before its first checkpoint: it starts again from step 0
    return "auto" if auto else True


def newest_valid(out: Path, info, want: dict | None = None) -> Path | None:
    """The newest checkpoint that passes verification, checked by every rank together (each reads 1/world of its
    files: checkpoint.verify) and, given the run's settings `want`, written by this run (settings_differ: a
    checkpoint copied in from another run); rank 0 sets each failing newer one aside (corrupt-step_N, with a
    warning)."""
    from . import dist as D

    def check(path: Path) -> str | None:
        return verify(path, info.rank, info.world_size) or (settings_differ(path, want) if want else None)

    paths = [str(p) for _, p in reversed(list_checkpoints(out))] if info.is_main else None  # lists, renames nothing
    for path in map(Path, D.broadcast_object(paths, info)):
        reasons = D.gather_objects(check(path), info)
        reason = next((r for r in reasons if r is not None), None)
        if reason is None:
            return path
        D.on_rank0(info, lambda: set_aside(path, reason))  # a failed rename on rank 0 stops every rank
    return None


def failed_before_checkpoint(out: Path, made: bool) -> str | None:
    """Rank 0, after a run failed: None where `out` holds a checkpoint or a final model (it resumes as usual);
    else what was done, for the error line: a folder this run created with no step logged is removed (nothing in it
    was trained, nor anyone's before), any other is kept as it is, which rerunning the command starts over."""
    if list_checkpoints(out) or (out / "final").exists() or not out.is_dir():
        return None
    log = out / "log.jsonl"
    if made and not (log.is_file() and log.stat().st_size):
        shutil.rmtree(out, ignore_errors=True)
        if not out.exists():
            return f"nothing was trained, so {out}, which this run created, was removed"
        return f"nothing was trained; {out}, which this run created, could not be removed completely: delete it"
    return (f"no checkpoint was written, so {out} holds no trained state (only this run's settings and log); "
            "rerunning the command starts over from step 0, or delete it")
