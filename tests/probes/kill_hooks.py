"""Run `gattn` with SIGKILL fault injection, for the crash/resume tests (test-only code, kept out of the package).

    python tests/probes/kill_hooks.py train ...
    torchrun ... tests/probes/kill_hooks.py train ...   (as the script of each rank)

GATTN_TEST_KILL_AT_STEP=N       SIGKILL right after step N (0-based) is finished: logged, step hook run, and
                                checkpointed if due.
GATTN_TEST_KILL_IN_RUN=PATH     ... only in the trainer run whose folder's path ends with PATH, e.g. runs/baseline or
                                baseline/seed0/train (a job's or a lab's unit: one model among the several a command
                                trains; default: the first run to reach step N).
GATTN_TEST_KILL_IN_CKPT_WRITE=N SIGKILL inside the N-th checkpoint write, after the state (state.pt or the DCP
                                shards) and meta.json are written, before the manifest and the rename.
GATTN_TEST_KILL_AFTER_SAVE=N    SIGKILL right after the N-th checkpoint save has returned to the loop (with
                                async_checkpoint: staged, its write perhaps in flight, not committed).
GATTN_TEST_DELAY_CKPT_WRITE=N   the N-th checkpoint save's DCP shard write starts WRITE_DELAY_S late (a slow disk;
                                with async_checkpoint the loop trains on meanwhile, in DCP's writer thread).
GATTN_TEST_FAULT_RANK=R        ... only on rank R (torchrun's RANK; default: every rank).
GATTN_TEST_RAISE_AT_STEP=N      raise RuntimeError("injected failure at step N on rank R") right after step N instead
                                of a SIGKILL (a rank that fails while its peers go on into the next collectives).
GATTN_TEST_STALL_AT_STEP=N      sleep STALL_S right after step N (a hung node: alive, in no collective).
Faults fire only in a torchrun's first attempt (TORCHELASTIC_RESTART_COUNT unset or 0): the workers torchrun
--max-restarts restarts run clean.
GATTN_TEST_FAULT_ONCE=FILE      ... and only in the first process that starts with this FILE (it creates it): for a
                                node's workers that torchrun restarts without counting a restart (another node
                                failed), whose TORCHELASTIC_RESTART_COUNT stays 0.
GATTN_TEST_HASH_TRACE=FILE      append "RANK CALLER PATH" to FILE for every checkpoint file this rank hashes (CALLER:
                                "verify" on resume, "_record" when a manifest is written).
GATTN_TEST_STEP_TRACE=FILE      append "RUN_FOLDER STEP" (absolute path) to FILE after every finished step of every run
                                (what a rerun trained: a resume starts at the checkpoint, a reused unit trains nothing).
GATTN_TEST_EXIT_TRACE=FILE      append "atexit RANK THREADS" to FILE from an exit handler (THREADS: the process's
                                native thread names, comma-separated) and "os._exit RANK CODE" when the process
                                ends through dist.exit_process.
They wrap library functions by name (trainer._after_step, trainer._save_checkpoint, checkpoint.write_files, DCP's
FileSystemWriter.write_data), so the package has no test code;
they act in the process that runs them (`--jobs 1`: a job's units train in-process).

In-process, for the NaN-skipping tests: `with nan_at_steps({3, 4}): train(cfg, out)` makes those steps non-finite
(wrapping trainer.forward_backward: the step's CE and every gradient become NaN, as a NaN loss's backward makes them).
"""
from __future__ import annotations

import os
import signal
import sys
from contextlib import contextmanager


def install() -> None:
    from gated_attention.train import checkpoint, trainer

    kill_step = int(os.environ.get("GATTN_TEST_KILL_AT_STEP", "-1"))
    raise_step = int(os.environ.get("GATTN_TEST_RAISE_AT_STEP", "-1"))
    stall_step = int(os.environ.get("GATTN_TEST_STALL_AT_STEP", "-1"))
    kill_run = os.environ.get("GATTN_TEST_KILL_IN_RUN")
    trace = os.environ.get("GATTN_TEST_STEP_TRACE")
    rank = os.environ.get("RANK", "0")
    faulty = (os.environ.get("GATTN_TEST_FAULT_RANK", rank) == rank
              and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and _first_process())
    if not faulty:
        kill_step = raise_step = stall_step = -1
    if kill_step >= 0 or raise_step >= 0 or stall_step >= 0 or trace:
        after_step = trainer._after_step

        def _after_step(run, rec, *args, **kwargs):
            after_step(run, rec, *args, **kwargs)
            if trace:
                with open(trace, "a") as fh:
                    fh.write(f"{run.out.resolve()} {rec['step']}\n")
            here = run.out.resolve().as_posix()
            if rec["step"] == kill_step and (kill_run is None or here == kill_run or here.endswith("/" + kill_run)):
                os.kill(os.getpid(), signal.SIGKILL)
            if rec["step"] == raise_step:
                raise RuntimeError(f"injected failure at step {raise_step} on rank {rank}")
            if rec["step"] == stall_step:
                import time

                time.sleep(STALL_S)

        trainer._after_step = _after_step
    exit_trace = os.environ.get("GATTN_TEST_EXIT_TRACE")
    if exit_trace:
        import atexit

        def _threads() -> str:
            tasks = sorted(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else []
            names = []
            for t in tasks:
                try:
                    names.append(open(f"/proc/self/task/{t}/comm").read().strip())
                except OSError:  # the thread ended meanwhile
                    pass
            return ",".join(names)

        def _note(line: str) -> None:
            with open(exit_trace, "a") as fh:
                fh.write(line + "\n")

        atexit.register(lambda: _note(f"atexit {rank} {_threads()}"))
        real_exit = os._exit

        def _exit(code):
            _note(f"os._exit {rank} {code}")
            real_exit(code)

        os._exit = _exit
    hash_trace = os.environ.get("GATTN_TEST_HASH_TRACE")
    if hash_trace:
        import inspect

        sha256 = checkpoint._sha256

        def _sha256(path):
            with open(hash_trace, "a") as fh:
                fh.write(f"{rank} {inspect.stack()[1].function} {path}\n")
            return sha256(path)

        checkpoint._sha256 = _sha256
    kill_write = int(os.environ.get("GATTN_TEST_KILL_IN_CKPT_WRITE", "0")) if faulty else 0
    if kill_write > 0:
        write_files = checkpoint.write_files
        done = [0]

        def _write_files(tmp, files):
            write_files(tmp, files)
            if "meta.json" in files:  # after the state (state.pt, or the DCP shards before it), before the rename
                done[0] += 1
                if done[0] == kill_write:
                    os.kill(os.getpid(), signal.SIGKILL)

        checkpoint.write_files = _write_files
    kill_after_save = int(os.environ.get("GATTN_TEST_KILL_AFTER_SAVE", "0")) if faulty else 0
    delay_write = int(os.environ.get("GATTN_TEST_DELAY_CKPT_WRITE", "0")) if faulty else 0
    if kill_after_save > 0 or delay_write > 0:
        _count_saves(trainer, kill_after_save, delay_write)


STALL_S = 300.0  # GATTN_TEST_STALL_AT_STEP: far past the tests' time limits
WRITE_DELAY_S = 3.0  # GATTN_TEST_DELAY_CKPT_WRITE: far longer than the tests' few tiny steps and a commit take


def _first_process() -> bool:
    """Whether faults are armed in this process: always, or with GATTN_TEST_FAULT_ONCE=FILE where this creates FILE."""
    once = os.environ.get("GATTN_TEST_FAULT_ONCE")
    if not once:
        return True
    try:
        os.close(os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def _count_saves(trainer, kill: int, delay: int) -> None:
    """Saves counted at trainer._save_checkpoint: the process SIGKILLed after the `kill`-th returns; the `delay`-th
    one's shard write (DCP's FileSystemWriter.write_data, in its writer thread for an async save) sleeps first."""
    import time

    from torch.distributed.checkpoint import FileSystemWriter

    saves = [0]
    write_data, save = FileSystemWriter.write_data, trainer._save_checkpoint

    def _write_data(self, *args, **kwargs):
        if saves[0] == delay:  # the next save cannot have begun: it commits this one first
            time.sleep(WRITE_DELAY_S)
        return write_data(self, *args, **kwargs)

    def _save_checkpoint(*args, **kwargs):
        saves[0] += 1
        save(*args, **kwargs)
        if saves[0] == kill:
            os.kill(os.getpid(), signal.SIGKILL)

    FileSystemWriter.write_data = _write_data
    trainer._save_checkpoint = _save_checkpoint


@contextmanager
def nan_at_steps(steps):
    """While open, the trainer's steps in `steps` (0-based) compute a NaN loss and NaN gradients."""
    from gated_attention.train import trainer

    real = trainer.forward_backward

    def forward_backward(run, step, batch):
        losses = real(run, step, batch)
        if step in steps:
            for p in run.par.master.parameters():
                if p.grad is not None:
                    p.grad.fill_(float("nan"))
            losses.ce = losses.ce * float("nan")
        return losses

    trainer.forward_backward = forward_backward
    try:
        yield
    finally:
        trainer.forward_backward = real


if __name__ == "__main__":
    install()
    from gated_attention.cli import main

    sys.exit(main(sys.argv[1:]))
