"""Runs and units: the plumbing every multi-run job shares (compare, longctx, the labs).

  ensure_corpus(data_dir, vocab_size, log, tag) -> Path
      Prepare the default corpus in `data_dir` (with `vocab_size`) if it has no manifest yet.
  train_or_reuse(cfg, run_dir, log, tag, step_hook, model_factory, plugins, key) -> summary
      One trainer run per folder, under the reuse rule of cache.py: a finished run (summary.json + final/config.json)
      is reused, an interrupted one resumes from its last checkpoint (the trainer's exact resume), a fresh folder
      trains, and a folder holding a run with other settings stops the job. "Other settings" is the trainer's own
      comparison (`train.resume_rule.changed_settings`, also its --resume check): every TrainConfig field except those that
      do not change the numbers, precision by what it resolves to, a field added after the run counting as its
      default, gate aliases being the same gate. A caller whose run depends on more than its TrainConfig (a lab unit:
      its task, recipe, measurement settings) passes that as `key`, stored in run_dir/unit_key.json under the same
      rule (other settings stop the job; an earlier input, e.g. a retrained start, makes the run obsolete: it starts
      over). A step hook with state (trainer.train) ends holding the whole run's state in all three cases (restored
      from the checkpoints on resume, from the final one on reuse). This is the one resume policy: every model a job
      or lab trains is a trainer run folder resumed from its own checkpoints, so a SIGKILL loses at most the steps
      since the last one.
  run_units(fn, tasks, jobs, log, threads) -> [fn(t) for t in tasks]
      Independent units (one model each) in-process or in `jobs` spawned worker processes of `threads` torch
      threads each (small models: one core per model beats sharing threads: two `gattn compare` models at once,
      one thread each, train 1.15-1.2x faster than one after the other with two threads on the 2-core machine);
      `default_jobs()` is the CLIs' --jobs default. Workers adopt the parent's measured bf16 speed-up, so
      precision="auto" resolves alike in every unit of a job.
"""
from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any, Callable

from ..util.io import read_json_object
from ..train.resume_rule import setting_differences
from . import cache

Log = Callable[[str], Any]


def ensure_corpus(data_dir: str | Path, vocab_size: int = 8192, log: Log = print, tag: str = "[run]",
                  sources: tuple[str, ...] | None = None) -> Path:
    """Prepare the corpus (the default sources unless `sources`) in `data_dir` if it has no manifest yet (the data
    layer caches everything)."""
    from gated_attention import data  # attribute access at call time: tests replace data.prepare

    data_dir = Path(data_dir)
    if not (data_dir / "manifest.json").exists():
        srcs = tuple(sources) if sources else data.DEFAULT_SOURCES
        extra = f" --sources {' '.join(srcs)}" if sources else ""
        log(f"{tag} {data_dir} is not prepared: running "
            f"`gattn data prepare --data-dir {data_dir} --vocab-size {vocab_size}{extra}` first")
        data.prepare(data.PrepareConfig(data_dir=str(data_dir), vocab_size=vocab_size, sources=srcs))
    return data_dir


def is_finished(run_dir: str | Path) -> bool:
    run_dir = Path(run_dir)
    return (run_dir / "summary.json").exists() and (run_dir / "final" / "config.json").exists()


def train_or_reuse(cfg, run_dir: str | Path, log: Log = print, tag: str = "[run]", step_hook=None,
                   model_factory=None, plugins=None, key: dict | None = None, key_defaults: dict | None = None,
                   inputs: tuple[str, ...] = (), resolved_precision: str | None = None) -> dict:
    """Train `cfg` into run_dir, reusing a finished run or resuming an interrupted one; returns summary.json's
    content. Raises cache.StaleResult when run_dir holds a run with other settings. step_hook, model_factory, plugins:
    the trainer's (a stopping rule, a recorder with state_dict/load_state_dict; a lab's own model; its data source, optimizer groups, trainable
    phases, extra loss: train/plugins.py). key (with key_defaults and inputs as in cache.load): the caller's own
    settings of the run, checked before anything runs. resolved_precision: the job's one decision for cfg.precision
    (util.precision.decide), compared and trained in as it is; None: decided per run."""
    import shutil

    from ..train import checkpoint, trainer  # module attributes: tests replace trainer.train

    run_dir = Path(run_dir)
    if key is not None:
        key_path = run_dir / "unit_key.json"
        if cache.load(key_path, key, defaults=key_defaults, inputs=inputs) is None and key_path.exists():
            log(f"{tag} {run_dir}: made from an earlier version of its input; training it again")
            shutil.rmtree(run_dir)  # obsolete (or its key edited by hand): the run starts over
        run_dir.mkdir(parents=True, exist_ok=True)
        if not key_path.exists():
            cache.save(key_path, key, {})
    cfg_path = run_dir / "train_config.json"
    if cfg_path.exists():
        saved = read_json_object(cfg_path, "saved run settings", "delete that run folder")
        want = cfg.to_dict() if resolved_precision is None else {**cfg.to_dict(),
                                                                 "resolved_precision": resolved_precision}
        cache.check(run_dir, saved, want, diffs=setting_differences(saved, want))
    if is_finished(run_dir):
        log(f"{tag} {cfg.gate}: reuse finished run {run_dir}")
        if hasattr(step_hook, "load_state_dict"):  # the hook ends as it would have after training (its records)
            trainer.restore_step_hook(run_dir, step_hook)
        return read_json_object(run_dir / "summary.json", "run summary", "delete that run folder to retrain it")
    resume = run_dir.exists() and checkpoint.latest_checkpoint(run_dir) is not None
    log(f"{tag} {cfg.gate}: {'resuming' if resume else 'training'} {cfg.steps} steps at length {cfg.seq_len} "
        f"-> {run_dir}")
    given = {k: v for k, v in (("step_hook", step_hook), ("model_factory", model_factory), ("plugins", plugins))
             if v is not None}
    if resolved_precision is not None:
        given["resolved_precision"] = resolved_precision
    # overwrite: run_dir is this job's own folder (it may hold the unit's key beside the run)
    return trainer.train(cfg, run_dir, resume=resume, overwrite=True, **given)  # tests replace trainer.train


def _init_worker(threads: int, bf16_speedup: float | None = None) -> None:
    import torch

    from ..util.precision import adopt_measurement
    from ..util.quiet import quiet_dependencies

    quiet_dependencies()  # a spawned worker starts with transformers' bars on (in-process state is not inherited)
    torch.set_num_threads(threads)
    adopt_measurement(bf16_speedup)  # the parent's measurement: every unit of a job resolves "auto" alike


def run_units(fn: Callable, tasks: list, jobs: int = 1, log=print, threads: int = 1) -> list:
    """[fn(t) for t in tasks], in-process for jobs=1, else in `jobs` spawned workers with `threads` torch threads
    each. Results come back in task order; the first failure is re-raised after the others finish or fail."""
    if jobs < 1:
        raise ValueError(f"--jobs must be >= 1; got {jobs}")
    if jobs == 1 or len(tasks) <= 1:
        import torch

        # in-process units get the same thread count as a worker would: torch's default (one per core) spin-waits
        # against every other process on a shared machine (a 1-layer scaling unit took 12x the CPU time so)
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return [fn(t) for t in tasks]
        finally:
            torch.set_num_threads(before)
    import multiprocessing as mp

    from ..util.precision import shared_measurement

    results: list = [None] * len(tasks)
    errors = []
    # spawn, not fork: a forked child of a process that already ran torch ops can deadlock in its thread pools
    with ProcessPoolExecutor(max_workers=min(jobs, len(tasks)), mp_context=mp.get_context("spawn"),
                             initializer=_init_worker, initargs=(threads, shared_measurement())) as pool:
        futs = {pool.submit(fn, t): i for i, t in enumerate(tasks)}
        for fut in as_completed(futs):
            try:
                results[futs[fut]] = fut.result()
            except Exception as exc:  # noqa: BLE001 - reported after the pool drains
                errors.append(exc)
                log(f"a unit failed: {exc}")
    if errors:
        raise errors[0]
    return results


def cores() -> int:
    """CPU cores this process may use (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def default_jobs() -> int:
    """Worker processes when --jobs is not given: one per available core, at most 2 (the labs' reference machine)."""
    return max(1, min(2, cores()))


def unique_labels(models: list, parent_label: Callable[[Any], str], flag: str = "--models") -> None:
    """Give models measured side by side distinct `.label`s: a label that several share is prefixed with
    `parent_label(model)` (the folder the model came from); a label still repeated is the same model listed twice."""
    count: dict[str, int] = {}
    for m in models:
        count[m.label] = count.get(m.label, 0) + 1
    for m in models:
        if count[m.label] > 1:
            m.label = f"{parent_label(m)}:{m.label}"
    labels = [m.label for m in models]
    if len(set(labels)) != len(labels):
        raise ValueError(f"{flag}: the same model is listed twice ({sorted({x for x in labels if labels.count(x) > 1})})")
