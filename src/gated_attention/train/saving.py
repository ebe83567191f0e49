"""The trainer's checkpoint saves: every save is staged, then committed, by one code path.

    stage    every file into the step's temporary folder (checkpoint.tmp_dir_for): the weights — gathered by rank 0
             (state.pt), or under dist=fsdp sharded DCP written by every rank —, meta.json (counters, spike window,
             step-hook state) and each rank's RNG file
    commit   once every rank's files are written: each rank hashes its own, rank 0 merges the records into
             manifest.json (written last) and renames the folder into place (checkpoint.commit: atomic, rotation)

A blocking save commits at once. With `async_checkpoint` (dist=fsdp) a periodic save stages its shards into CPU
memory (dcp.async_save: state.save_sharded_state), writes meta.json and the RNG files at once (so they hold the
values of that step), and returns: DCP's thread writes the shards and then hashes them while training goes on. The
commit comes before the next save, at the end of the run (train._finish), or when the run fails (commit_on_error),
so at most one save is in flight and a checkpoint becomes the newest only when it is complete and hashed, as a
blocking one does: a SIGKILL before the commit leaves a temporary folder, which is never a checkpoint (removed at the
next start; --resume continues from the one before). docs/scale.md measures what the loop saves by it.
"""
from __future__ import annotations

import json
import sys
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from . import checkpoint as ckpt_mod
from . import dist as D
from .state import RunState


@dataclass
class Staged:
    """A checkpoint whose files are written, or being written (an async save's shards), but not yet committed."""

    step: int
    tmp: Path  # its temporary folder
    own_hashes: Callable[[], dict]  # this rank's records of its own files (hash_own_files), waiting for its writes


def save_checkpoint(run, parts: RunState, next_step: int, background: bool = False) -> None:
    """Checkpoint `parts` (the run's state.run_state) as step `next_step` (a collective): commit the save still
    in flight, if any, then stage this one and — unless `background` — commit it. `run`: the trainer's run (its
    info, cfg, out, model, precision, `staged` and `ckpt_group`)."""
    commit_staged(run)
    run.staged = _stage(run, parts, next_step, background)
    run.last_ckpt_step = next_step
    if not background:
        commit_staged(run)


def _stage(run, parts: RunState, next_step: int, background: bool) -> Staged:
    """Every file of the checkpoint into its temporary folder: the weights (`background`: staged into CPU memory
    here, written by DCP's thread), then meta.json and each rank's RNG, written now so they hold this step's values
    whatever runs before the commit. A failure on any rank (a full disk) stops every rank: on_rank0 /
    on_every_rank stand between the phases."""
    info = run.info
    tmp = ckpt_mod.tmp_dir_for(run.out, next_step)
    shared, writing = {}, None
    if parts.weights.sharded:
        writing = D.on_every_rank(info, lambda: parts.weights.save_sharded(tmp / ckpt_mod.SHARDED, background,
                                                                            run.ckpt_group))
    else:
        shared["state.pt"] = parts.weights.state_dict()  # collective
    shared["meta.json"] = {**parts.meta_dict(), "world_size": info.world_size, "config": run.cfg.to_dict(),
                           "resolved_precision": run.precision}
    if parts.weights.sharded and hasattr(run.model, "config"):  # `gattn convert` reads it as a model folder
        shared["config.json"] = json.loads(run.model.config.to_json_string())
    D.on_rank0(info, lambda: ckpt_mod.write_files(tmp, shared))
    D.on_every_rank(info, lambda: ckpt_mod.write_files(tmp, {f"rng_rank{info.rank}.pt": parts.rng.state_dict()}))

    def own() -> dict:
        return ckpt_mod.hash_own_files(tmp, info.rank)

    # an async write: the rank hashes its files in DCP's thread as soon as they are written, off the loop too
    return Staged(next_step, tmp, then(writing, own).result if writing is not None else own)


def then(future: Future, fn: Callable[[], object]) -> Future:
    """The future of fn(), run (in the thread that completes `future`) once `future` has succeeded; `future`'s
    error otherwise."""
    out: Future = Future()

    def done(f: Future) -> None:
        try:
            f.result()
            out.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on `out`
            out.set_exception(exc)

    future.add_done_callback(done)
    return out


def commit_staged(run, together: bool = True) -> None:
    """Commit the staged checkpoint, if any — the one commit of every save: once every rank's files are written and
    hashed (an async write is waited for here), rank 0 merges the records into manifest.json, written last, and
    renames the folder into place. together=False is the error path: no collective (a peer may be in one this rank
    will never join, or dead): each rank waits for its own write and rank 0 commits alone, hashing the other ranks'
    files itself — DCP completes a write on rank 0 only once every rank's shards are written — or raises, leaving
    the folder uncommitted, when its write failed."""
    staged, run.staged = run.staged, None
    if staged is None:
        return
    info = run.info

    def commit(hashed: dict) -> str:
        ckpt_mod.write_manifest(staged.tmp, hashed)  # any file without a record (together=False) is hashed here
        return str(ckpt_mod.commit(run.out, staged.step, run.cfg.keep_checkpoints))

    if not together:
        mine = staged.own_hashes()
        if info.is_main:
            commit(mine)
        return
    # every rank hashes the files it wrote (in parallel); rank 0 merges them into the manifest, written last
    mine = D.on_every_rank(info, staged.own_hashes)
    hashed = {k: v for part in D.gather_objects(mine, info) for k, v in part.items()}
    D.on_rank0(info, lambda: commit(hashed))


def commit_on_error(run) -> None:
    """Before a failing run exits: an async save still in flight is committed where its write completed
    (commit_staged together=False); one that did not complete stays a temporary folder, and --resume continues
    from the checkpoint before it."""
    step = run.staged.step if run.staged is not None else None
    try:
        commit_staged(run, together=False)
    except Exception as exc:  # noqa: BLE001 - the run's own error is the one to raise
        if run.info.is_main:
            print(f"gattn train: the checkpoint of step {step} was not committed ({type(exc).__name__}: {exc}); "
                  "--resume continues from the one before it", file=sys.stderr, flush=True)
