"""Atomic, rotated, full-state training checkpoints.

Layout: OUT/checkpoints/step_00000120/{state.pt, meta.json, rng_rank0.pt, ...}. A checkpoint is written into a hidden
temporary folder, every file fsync'ed, then the folder is renamed into place (rename is atomic on POSIX) and the
parent fsync'ed. A crash (even SIGKILL mid-write) therefore leaves either the previous checkpoints intact plus a stale
`.tmp-*` folder (removed on the next start) or the complete new one, never a half-written `step_*`.

Tests kill a run inside a checkpoint write (after state.pt, before the rename) with tests/kill_hooks.py, which wraps
`write_files`; nothing here knows about it.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch

_STEP_DIR = re.compile(r"^step_(\d{8})$")
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


def tmp_dir_for(out_dir: str | Path, step: int) -> Path:
    """The (shared) temporary folder all ranks write into for this step's checkpoint."""
    return checkpoint_root(out_dir) / f".tmp-step_{step:08d}"


def write_files(tmp: Path, files: dict[str, object]) -> None:
    """Write torch objects (name.pt) or JSON (name.json) into `tmp`, each fsync'ed. Called by every rank for its
    own files (rank 0 also writes the shared state)."""
    tmp.mkdir(parents=True, exist_ok=True)
    for name, obj in files.items():
        path = tmp / name
        if name.endswith(".json"):
            path.write_text(json.dumps(obj, indent=1, sort_keys=True))
        else:
            torch.save(obj, path)
        _fsync_file(path)


def commit(out_dir: str | Path, step: int, keep: int) -> Path:
    """Rename the finished temporary folder into place and rotate (keep the last `keep`). Rank 0 only."""
    root = checkpoint_root(out_dir)
    tmp = tmp_dir_for(out_dir, step)
    final = root / f"step_{step:08d}"
    _fsync_dir(tmp)
    if final.exists():  # re-saving the same step (e.g. end of a resumed run): replace it
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(root)
    for _, old in list_checkpoints(out_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_files(ckpt: Path, rank: int) -> tuple[dict, dict, dict | None]:
    """(shared state, meta, this rank's RNG state or None if the checkpoint came from fewer ranks)."""
    state = torch.load(ckpt / "state.pt", map_location="cpu", weights_only=False)
    meta = json.loads((ckpt / "meta.json").read_text())
    rng_path = ckpt / f"rng_rank{rank}.pt"
    rng = torch.load(rng_path, map_location="cpu", weights_only=False) if rng_path.exists() else None
    return state, meta, rng
