"""Atomic, rotated training checkpoints: a gathered full state (DDP, one process), or sharded DCP (dist=fsdp).

Layout: OUT/checkpoints/step_00000120/{state.pt, meta.json, rng_rank0.pt, ...}; under dist=fsdp `state/` (a
torch.distributed.checkpoint folder: `.metadata` and one `__<rank>_0.distcp` per writing rank, written by every rank
in parallel, readable at any world size) in place of state.pt. A checkpoint is written into a hidden
temporary folder, every file fsync'ed, then the folder is renamed into place (rename is atomic on POSIX) and the
parent fsync'ed. A crash (even SIGKILL mid-write) therefore leaves either the previous checkpoints intact plus a stale
`.tmp-*` folder (removed on the next start) or the complete new one, never a half-written `step_*`.

Each checkpoint carries `manifest.json` (every other file's size and SHA-256), written LAST: a folder without a
matching manifest is not a checkpoint. Every rank hashes the files it wrote and rank 0 merges the records; on resume
every rank verifies 1/world of the files (the run folder is on a filesystem every rank sees: docs/scale.md). `--resume` verifies the newest and falls back to the newest valid one,
warning which were skipped. Re-saving an existing step renames the old copy aside, puts the new one in place, and
only then deletes the old one. A write that fails (a full disk) removes its temp folder and leaves every previous
checkpoint intact. Files are read back with `torch.load(weights_only=True)` (tensors and plain containers only, no
pickle code) and JSON: nothing from a run folder can execute code.

Tests kill a run inside a checkpoint write (after state.pt, before the rename) with tests/probes/kill_hooks.py, which
wraps `write_files`; nothing here knows about it.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle  # only for its exception type: torch.load(weights_only=True) raises UnpicklingError
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
                shutil.rmtree(p, ignore_errors=True)
            elif p.name.startswith(".old-step_"):  # killed between the two renames of a re-save
                final = root / p.name[len(".old-"):]
                if final.exists():
                    shutil.rmtree(p, ignore_errors=True)
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


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


_RANK_FILE = re.compile(r"^(?:rng_rank(\d+)\.pt|" + SHARDED + r"/__(\d+)_\d+\.distcp)$")


def file_owner(name: str) -> int:
    """The rank that wrote checkpoint file `name` (relative path): rng_rank<r>.pt and the DCP shard __<r>_*.distcp
    are rank r's; everything else (meta.json, state.pt, .metadata, config.json) rank 0's."""
    m = _RANK_FILE.match(name)
    return int(m.group(1) or m.group(2)) if m else 0


def _files(folder: Path) -> list[str]:
    return [p.relative_to(folder).as_posix() for p in sorted(folder.rglob("*")) if p.is_file() and p.name != MANIFEST]


def _record(path: Path) -> dict:
    return {"size": path.stat().st_size, "sha256": _sha256(path)}


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
        path.write_text(json_dumps({"version": 1, "files": files}, indent=1, sort_keys=True))
        _fsync_file(path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def verify(ckpt: Path, rank: int = 0, world: int = 1) -> str | None:
    """None if checkpoint folder `ckpt` is complete and intact, else the reason it is not. With world > 1 this
    rank checks the manifest and every world-th file of it (from its `rank`-th): the ranks of a job verify a
    checkpoint together, each reading 1/world of it (any world size, whatever wrote it)."""
    man = ckpt / MANIFEST
    if not man.is_file():
        return "no manifest.json (incomplete write or written by an older version)"
    try:
        files = json.loads(man.read_text())["files"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return "manifest.json is unreadable"
    if "meta.json" not in files:
        return "manifest lists no meta.json"
    if "state.pt" not in files and SHARDED + "/.metadata" not in files:
        return f"manifest lists no state.pt and no {SHARDED}/.metadata"
    for i, (name, rec) in enumerate(sorted(files.items())):
        if i % world != rank:
            continue
        p = ckpt / name
        if not p.is_file():
            return f"{name} is missing"
        if p.stat().st_size != rec.get("size"):
            return f"{name} has {p.stat().st_size} bytes, manifest says {rec.get('size')} (truncated?)"
        if _sha256(p) != rec.get("sha256"):
            return f"{name} checksum does not match the manifest (corrupt)"
    return None


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
    shutil.rmtree(bad, ignore_errors=True)
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
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(root)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    for _, stale in list_checkpoints(out_dir)[:-keep]:
        shutil.rmtree(stale, ignore_errors=True)
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
    except (OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError) as exc:  # damaged, or not ours
        raise UserError(f"checkpoint {ckpt} could not be loaded ({type(exc).__name__}: {exc}); delete it to resume "
                        "from an older one") from None
    return state, meta, rng


# ---------------------------------------------------------------- what a run resumes from

# what marks a folder as a training run folder: the settings the trainer writes first, or its checkpoints
RUN_MARKERS = ("train_config.json", "checkpoints")


def is_run_dir(out: Path) -> bool:
    return any((out / m).exists() for m in RUN_MARKERS)


def resume_decision(out: Path, resume: bool | str, cfg_path: Path, want: dict, overwrite: bool = False
                    ) -> bool | str:
    """Rank 0: check the run folder against the request; returns what to do: False (start), True (resume from the
    newest valid checkpoint, an error if none is valid) or "auto" (resume from it, start if none is valid; a
    checkpoint that fails verification is moved aside as corrupt-step_N, with a warning, never deleted). Every rank
    then verifies the checkpoints together (newest_valid). A new run goes only into a new or empty folder or a run
    folder (RUN_MARKERS), or with `overwrite` into any folder: a folder of other files is the user's."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; choose a folder for the run")
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
    if cfg_path.exists():
        from .resume_rule import describe_changes

        saved = read_json_object(cfg_path, "saved run settings", "restore it or start a new --out")
        diff = describe_changes(saved, want)
        if diff:
            raise UserError(f"--resume with settings that differ from the saved run ({diff}); use the original "
                            "settings or a new --out")
    if any_ckpt is None:
        return False  # the run was stopped before its first checkpoint: it starts again from step 0
    return "auto" if auto else True


def newest_valid(out: Path, info) -> Path | None:
    """The newest checkpoint that passes verification, checked by every rank together (each reads 1/world of its
    files: checkpoint.verify); rank 0 sets each failing newer one aside (corrupt-step_N, with a warning)."""
    from . import dist as D

    paths = [str(p) for _, p in reversed(list_checkpoints(out))] if info.is_main else None  # lists, renames nothing
    for path in map(Path, D.broadcast_object(paths, info)):
        reasons = D.gather_objects(verify(path, info.rank, info.world_size), info)
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
