"""The training loop: AdamW + schedule, accumulation, clipping, autocast, NaN skipping, spikes, eval, checkpoints.

Numerics: `precision` ("auto" by default) is resolved once per run on rank 0 (gated_attention.util.precision: bf16 autocast
only where this machine runs it fast), logged, broadcast, written as `resolved_precision` beside the settings in
train_config.json, in every checkpoint's meta.json and in summary.json; a run is never resumed or reused in another
resolved precision (train.resume_rule.changed_settings).

Exact resume: everything that affects the numbers is either a pure function of the step (LR, the batch) or saved in
the checkpoint (weights, AdamW moments, RNG states, spike-detector window, counters, the step hook's state: defined
once in train/state.py's `run_state`), so a run killed at any point (SIGKILL, also during a checkpoint write) and
resumed logs the same losses, and its step hook holds the same records, as one that never stopped. On resume,
log.jsonl is cut back to the checkpoint's step so it describes exactly one run. This is the one resume policy of every model a command trains (compare, longctx, the labs:
experiment.train_or_reuse resumes an interrupted run folder).

`_train` reads as the run's outline: check the folder (rank 0 decides, dist.on_rank0), set up (data, build on the
meta device, `parallelize`: train/parallelize.py, optimizer), restore, then per step `_train_step`
(`forward_backward`, `update`, and every `stats_every` steps `monitoring`) and `_after_step` (eval, log line,
divergence stop, step hook, checkpoint: train/saving.py), then `_finish`. What a lab needs of the loop (its own task
as the data source, its optimizer groups and trainable phases, an extra loss term, an observer, a step hook, its own
model) comes in as plug-ins (train/plugins.py), so the labs train through this loop too.
"""
from __future__ import annotations

import math
import random
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from . import checkpoint as ckpt_mod
from . import dist as D
from . import saving
from .config import TrainConfig
from .data_source import epochs_note, make_source
from .evaluate import domain_losses
from .logs import close_logs, log_step, open_logs, summary as run_summary, truncate_log
from .state import HookState, RunState, full_state, has_state, load_meta, run_state, save_hf_sharded
from .model_setup import apply_trainable, build_model, check_attn_implementation, param_groups
from .meta_init import build_on_meta, fill_model
from .parallelize import Parallel, parallelize
from .plan import check_fits, sizes
from .plugins import Plugins, begin as begin_step_hook
from .runtime import garbage_collection
from .schedule import lr_for
from ..modeling import GatedQwen3ForCausalLM
from ..moe import reset_moe_balance
from .monitors import SpikeDetector, monitoring, snapshot_params
from ..util.errors import UserError
from ..util.io import atomic_dir, atomic_write_json, atomic_write_text, json_dumps, lock_dir
from ..util.precision import check_resolved, decide, gemm_mode, numerics


# ---------------------------------------------------------------- the loop

def train(cfg: TrainConfig, out_dir: str | Path, resume: bool | str = False, model_factory=None, step_hook=None,
          plugins: Plugins | None = None, resolved_precision: str | None = None, overwrite: bool = False) -> dict:
    """Train per `cfg` into `out_dir`; returns the summary (also written to out_dir/summary.json on rank 0).

    resume: False starts a new run (an error where out_dir holds checkpoints); True continues from the newest valid
    checkpoint (an error where there is none); "auto" resumes where out_dir holds a valid checkpoint and starts
    otherwise — the one command line of a job that torchrun --max-restarts restarts.

    plugins: what a lab plugs into the loop (train/plugins.py): its data source, optimizer groups, trainable phases,
    extra loss, observer, step hook and model factory. `model_factory=` and `step_hook=` are the same two plug-ins
    given as keywords (Plugins.step_hook / Plugins.model_factory; giving one both ways is an error).
    resolved_precision: the calling command's decision for cfg.precision (util.precision.decide, one of RESOLVED),
    taken as it is; None: this call is the command (`gattn train`), which decides here and logs it.
    overwrite: start a new run in a folder that holds other files (refused otherwise: checkpoint.resume_decision).
    A run that fails before its first checkpoint leaves its folder removed (it created it and trained nothing) or
    as it is, to start over; the error says which (checkpoint.failed_before_checkpoint).
    restore_step_hook reloads a step hook's state from a finished run."""
    plugins = (plugins or Plugins()).with_aliases(step_hook=step_hook, model_factory=model_factory)
    cfg.validate()
    info = D.setup(cfg.device, cfg.dist, cfg.collective_timeout_s)
    out, began = Path(out_dir), {}
    try:
        with ExitStack() as stack:  # one writer per run folder: a second process stops with the holder's PID
            # rank 0, holding the lock: does this call create the folder (so nothing in it is anyone else's)?
            made = D.on_rank0(info, lambda: bool(stack.enter_context(lock_dir(out, "gattn train")))
                              and not out.exists())
            try:
                summary = _train(cfg, out, resume, info, plugins, resolved_precision, overwrite, began)
            except BaseException as exc:
                note = ckpt_mod.failed_before_checkpoint(out, made) if began.get("fresh") and info.is_main else None
                if note:  # still locked: no other process is in the folder being removed
                    exc.add_note(note)  # the CLI's one error line carries it (util.errors.handle)
                raise
    except BaseException:
        D.teardown(failed=True)  # no barrier: a peer may be waiting in a collective this rank will never join
        raise
    D.teardown()
    return summary


@dataclass
class _Run:
    """Everything one training run holds between steps (built by _setup, mutated by the step/log/checkpoint parts)."""

    cfg: TrainConfig
    out: Path
    info: D.DistInfo
    source: object
    model: nn.Module  # THE model: the plain module every forward runs on (parallelize.Parallel.model)
    par: Parallel  # the model as parallelized: master weights, speed plan, layers, the data-parallel controls
    optimizer: torch.optim.Optimizer
    spikes: SpikeDetector
    st: dict  # counters saved in every checkpoint (step, tokens, skipped steps, ...)
    fused_loss: bool  # our LM computes CE chunk by chunk through lm_head: no fp32 (b, T, V) logits
    fwd_kw: dict  # extra forward kwargs (use_cache=False for our LM: no KV cache while training)
    precision: str = "fp32"  # the resolved precision ("bf16" | "bf16-params" | "fp32"), decided by rank 0 in _check_run_dir
    per_rank: int = 0
    micro: int = 0
    tokens_per_step: int = 0
    tb: object = None
    bar: object = None
    log_fh: object = None
    meter: object = None  # per-line memory / TFLOP/s / MFU and the profiler (train/metrics.py, made in open_logs)
    last_ckpt_step: int = -1
    staged: object = None  # a checkpoint staged but not committed (saving.Staged): an async save in flight
    ckpt_group: object = None  # async_checkpoint: the process group of DCP's background writes (dist.checkpoint_group)
    plugins: Plugins = Plugins()  # a lab's source, groups, phases, extra loss, observer, step hook (train/plugins.py)

    @property
    def log_path(self) -> Path:
        return self.out / "log.jsonl"


def _train(cfg: TrainConfig, out: Path, resume: bool | str, info: D.DistInfo, plugins: Plugins,
           resolved_precision: str | None = None, overwrite: bool = False, began: dict | None = None) -> dict:
    latest, precision, decided = _check_run_dir(cfg, out, resume, info, resolved_precision, overwrite)
    if began is not None:
        began["fresh"] = latest is None  # the folder is checked and the run starts from step 0
    run = _setup(cfg, out, info, precision, plugins)
    # said once the run is set up, so a run that cannot start prints only its error line
    for note in (decided, epochs_note(cfg, run.source)) if info.is_main else ():
        if note:
            print(f"gattn train: {note}", file=sys.stderr, flush=True)
    _restore(run, latest)  # None: a new run
    if run.st["step"] == 0:
        begin_step_hook(plugins.step_hook, run.model)  # a fresh run: the hook sees the model as built (a curve's step 0)
    open_logs(run)
    t_start = time.perf_counter() - run.st["wall_time"]
    # a run restored from its final checkpoint (killed while exporting) that had stopped early stays stopped
    try:
        with garbage_collection(cfg.gc_every) as collect:  # every rank collects at the same steps (train/runtime.py)
            while run.st["step"] < cfg.steps and not run.st["diverged"] and not run.st["stop_reason"]:
                t0 = time.perf_counter()
                rec = _train_step(run, run.st["step"])
                _after_step(run, rec, t0, t_start)
                collect(run.st["step"])
        return _finish(run, t_start)
    except BaseException:
        saving.commit_on_error(run)  # an async checkpoint in flight
        raise


# ---------------------------------------------------------------- setup and resume

def _check_run_dir(cfg: TrainConfig, out: Path, resume: bool | str, info: D.DistInfo,
                   resolved_precision: str | None = None, overwrite: bool = False
                   ) -> tuple[Path | None, str, str | None]:
    """The run's precision, its folder checked against `resume`, its settings written; returns (the checkpoint to
    resume from — the newest VALID one — or None, the resolved precision, the line saying how this command decided
    it or None). Each decision is rank 0's, broadcast: an error there stops every rank."""
    cfg.check_world(info.world_size)
    # rank 0's measurement decides for every rank (two ranks timing a GEMM under load could disagree)
    precision, decided = D.on_rank0(info, lambda: _decide_precision(cfg, info, resolved_precision))
    cfg.check_world(info.world_size, precision)
    want = {**cfg.to_dict(), "resolved_precision": precision, "world_size": info.world_size}
    wanted = D.on_rank0(info, lambda: ckpt_mod.resume_decision(out, resume, out / "train_config.json", want,
                                                               overwrite))
    D.on_rank0(info, lambda: atomic_write_text(out / "train_config.json", json_dumps(want, indent=1)))
    latest = ckpt_mod.newest_valid(out, info, want) if wanted else None
    if wanted and latest is None:
        if wanted != "auto":  # the same on every rank: every rank stops
            raise UserError(f"no valid checkpoint left in {out / 'checkpoints'} (all failed verification, see the "
                            "warnings above); start over with a new --out")
        if info.is_main:
            print(f"gattn train: --resume auto: no valid checkpoint in {out}; starting a new run", file=sys.stderr,
                  flush=True)
    elif wanted == "auto" and info.is_main:
        print(f"gattn train: --resume auto: resuming from {latest}", file=sys.stderr, flush=True)
    return latest, precision, decided


def _decide_precision(cfg: TrainConfig, info: D.DistInfo, resolved_precision: str | None) -> tuple[str, str | None]:
    """(the caller's decision, checked, None) or (this command's, the line that logs it) (util.precision.decide)."""
    if resolved_precision is not None:  # the command decided (and logged) it where the run was configured
        return check_resolved(resolved_precision, "resolved_precision"), None
    return decide(cfg.precision, info.device, cfg.dist if info.distributed else "none")


def _setup(cfg: TrainConfig, out: Path, info: D.DistInfo, precision: str, plugins: Plugins = Plugins()) -> _Run:
    """One path for every mode: data source -> build (on meta where it is filled later) -> the plan's fit check and
    memory decisions -> parallelize (materialise, bf16 twin, fast path, checkpointing, DDP/FSDP:
    train/parallelize.py) -> optimizer and fresh counters."""
    plugins.check(cfg, info, mixed=precision == "bf16-params" and not info.distributed)
    check_attn_implementation(cfg.attn_implementation, info.device)  # triton_gated: a GPU, or one clear line
    torch.manual_seed(cfg.seed)  # the same seed on every rank, so replicas start identical
    random.seed(cfg.seed)
    source = plugins.source if plugins.source is not None else make_source(cfg) if cfg.data == "corpus" else None
    vocab = getattr(source, "vocab_size", None)
    model, materialize = _build(cfg, plugins.model_factory, vocab, info)
    apply_trainable(model, cfg.trainable)  # before parallelize: DDP/FSDP and the optimizer see only what trains
    # before anything is allocated (the default model is still on the meta device): a run the plan says cannot fit
    # stops with one line; the plan's memory decisions (checkpointing, whole gradients across micro-batches,
    # parameters kept gathered) are the run's. A lab's own model: no plan (parallelize decides without one)
    memory = check_fits(cfg, info.device, info.world_size, precision, vocab, shapes=(model.config, sizes(model))) \
        if plugins.model_factory is None else None
    if source is None:  # synthetic tokens over the model's own vocabulary
        source = make_source(cfg, model.config.vocab_size if hasattr(model, "config") else None)
    model.train()
    par = parallelize(model, cfg, info, precision, materialize, memory)
    groups = plugins.param_groups(par.master) if plugins.param_groups is not None else param_groups(par.master, cfg)
    optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    st = {"step": 0, "tokens": 0, "skipped_steps": 0, "bad_in_a_row": 0, "wall_time": 0.0, "diverged": False,
          "stop_reason": None, "val": {}, "last_loss": None}
    per_rank = cfg.batch_size // info.world_size
    ckpt_group = D.checkpoint_group(info) if cfg.async_checkpoint else None  # every rank, here: a collective
    return _Run(cfg=cfg, out=out, info=info, source=source, model=par.model, par=par, precision=precision,
                ckpt_group=ckpt_group,
                plugins=plugins, fused_loss=par.speed.fused_loss and not plugins.needs_logits,
                fwd_kw={"use_cache": False} if isinstance(par.model, GatedQwen3ForCausalLM) else {},
                optimizer=optimizer, spikes=SpikeDetector(cfg.spike_window, cfg.spike_delta, cfg.spike_noise_k),
                st=st, per_rank=per_rank, micro=per_rank // cfg.grad_accum,
                tokens_per_step=cfg.batch_size * cfg.seq_len)


def _build(cfg: TrainConfig, model_factory, vocab: int | None, info: D.DistInfo):
    """(the model, how to fill it or None). The default builder: on the meta device in every mode, filled by
    parallelize from one init stream (train/meta_init.py) — after sharding under dist=fsdp, so no rank holds the
    whole model — so a seed gives the same weights in one process, under DDP and under FSDP at any world size. A
    lab's factory: its own model with its own weights, built as it is."""
    if model_factory is None:
        return build_on_meta(build_model, cfg, vocab), lambda m: fill_model(m, cfg, vocab, info.device)
    return model_factory(cfg, vocab).to(info.device), None


def _restore(run: _Run, latest: Path | None) -> None:
    """Exact resume from checkpoint `latest` (every part of _state: weights, AdamW moments, counters, spike window,
    step-hook state, RNG), cutting log.jsonl back to its step; with no checkpoint a fresh run starts a fresh log."""
    info = run.info
    if latest is not None:
        shared, meta, rng = ckpt_mod.load_files(latest, info.rank)
        parts = _state(run)
        if shared is None:  # DCP: each rank reads its shards, whatever the world size that wrote it
            D.on_every_rank(info, lambda: parts.weights.load_sharded(latest / ckpt_mod.SHARDED))
        else:
            _loading(latest, lambda: parts.weights.load_state_dict(shared))
        _loading(latest, lambda: parts.load_meta(meta, latest))
        if rng is not None:  # None: this rank did not exist in the run that wrote it
            _loading(latest, lambda: parts.rng.load_state_dict(rng))
        if info.is_main:
            truncate_log(run.log_path, run.st["step"])
    elif info.is_main and run.log_path.exists():
        run.log_path.unlink()  # a fresh run (no checkpoint yet) starts a fresh log
    D.barrier(info)


def _loading(ckpt: Path, load) -> None:
    """load(): a part of checkpoint `ckpt` into the run; contents that verified but are not what this run holds (a
    file written by hand or by another program, with its manifest) are one line, not a traceback."""
    try:
        load()
    except (KeyError, TypeError, IndexError, AttributeError, RuntimeError) as exc:
        raise UserError(f"checkpoint {ckpt} holds contents this run cannot load ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0] if str(exc) else ''}); delete it to resume from an older one") \
            from None


def _state(run: _Run) -> RunState:
    """What this run's checkpoints hold (state.run_state, the one definition; under dist=fsdp sharded DCP)."""
    return run_state(run.par.master, run.optimizer, run.cfg.dist == "fsdp", run.st, run.spikes, run.plugins.step_hook,
                     after_load=run.par.after_update)


# ---------------------------------------------------------------- one optimizer step

def _train_step(run: _Run, step: int) -> dict:
    """One optimizer step: forward_backward over the micro-batches, update, and every `stats_every` steps monitoring;
    returns the step's log record."""
    cfg, info = run.cfg, run.info
    t0 = time.perf_counter()
    lr = _set_lr(run, step)
    if run.plugins.trainable_at is not None:
        run.plugins.trainable_at(step, run.model)  # this step's trainable set (a phase)
    rows = slice(info.rank * run.per_rank, (info.rank + 1) * run.per_rank)  # this rank's rows of the global batch
    batch = run.source.train_batch(cfg.batch_size, cfg.seq_len, cfg.seed, step, rows=rows).to(info.device)  # (B/N, T+1)
    stats_due = cfg.stats_every > 0 and step % cfg.stats_every == 0
    run.par.reshard()  # FSDP2: what an evaluation or probe forward left gathered goes back to the shards
    before = snapshot_params(run.par.master) if stats_due else None
    losses = forward_backward(run, step, batch)
    rec = update(run, step, losses, lr)
    note = run.par.speed.observe(time.perf_counter() - t0, cfg.steps - step - 1,
                                 agree=lambda choice: D.broadcast_object(choice, info))  # rank 0's decision for all
    if note and info.is_main:
        print(f"gattn train: {note}", file=sys.stderr, flush=True)  # stdout may carry JSON
    if stats_due:
        rec.update(monitoring(run, batch, before, moe="aux_loss" in rec))
    # MoE global-batch expert counts span exactly one optimizer step: start the next one afresh (after monitoring's
    # train-mode probe forward, so it does not leak into the next step's load-balancing loss)
    reset_moe_balance(run.model)
    return rec


def _set_lr(run: _Run, step: int) -> float:
    lr = lr_for(run.cfg, step)
    for g in run.optimizer.param_groups:
        g["lr"] = lr * g.get("lr_mult", 1.0)  # a plug-in's groups may scale the schedule (retrofit: gates vs rest)
    return lr


@dataclass
class StepLosses:
    """A step's losses on this rank: means over its micro-batches (tensors; reduced over ranks by update)."""

    ce: torch.Tensor  # the next-token CE (the logged loss)
    aux: torch.Tensor | None  # the model's auxiliary loss (MoE load balancing, z-loss), None for a model without
    extra: dict  # a plug-in's logged floats (extra_loss / observe)


def forward_backward(run: _Run, step: int, batch: torch.Tensor) -> StepLosses:
    """Forward and backward over the step's micro-batches of `batch` (B/N, T+1); gradients accumulate (synced over
    ranks as parallelize's Parallel.micro_batch says) into the parameters."""
    n = run.cfg.grad_accum
    losses = StepLosses(ce=torch.zeros((), device=run.info.device), aux=None, extra={})
    for i in range(n):
        chunk = batch[i * run.micro:(i + 1) * run.micro]  # (b, T+1)
        x, y = chunk[:, :-1], chunk[:, 1:]  # (b, T) each
        with run.par.micro_batch(last=i == n - 1):
            ce, total, aux, logs = _forward(run, step, x, y)
            (total / n).backward()
        losses.ce += ce.detach() / n
        if aux is not None:
            losses.aux = (0.0 if losses.aux is None else losses.aux) + aux.detach().float() / n
        for k, v in logs.items():
            losses.extra[k] = losses.extra.get(k, 0.0) + float(v) / n
    return losses


def _forward(run: _Run, step: int, x: torch.Tensor, y: torch.Tensor):
    """One micro-batch's training forward: (the CE, the loss to backpropagate: CE + aux + a plug-in's term, the aux
    loss or None, a plug-in's floats to log)."""
    plug = run.plugins
    with numerics(run.precision, run.info.device), run.par.speed.training_forward(), \
            plug.forward_context(step, run.model):
        out = (run.par.forward(input_ids=x, shift_labels=y, fused_loss=True, **run.fwd_kw) if run.fused_loss
               else run.par.forward(input_ids=x, **run.fwd_kw))
    aux = getattr(out, "aux_loss", None)
    if run.fused_loss:  # out.loss = CE + aux already; the CE alone is what gets logged
        total = out.loss
        ce = total - aux.float() if aux is not None else total
    else:
        ce = F.cross_entropy(out.logits.float().flatten(0, 1), y.flatten())  # logits (b, T, V)
        total = ce + (aux.float() if aux is not None else 0.0)
    logs = {}
    if plug.extra_loss is not None or plug.observe is not None:  # a lab's extra term (retrofit's penalties)
        extra, logs = plug.after_forward(step, x, y, out, ce)  # or observer; the logged loss stays the CE
        if extra is not None:
            total = total + extra
    return ce, total, aux, logs


def update(run: _Run, step: int, losses: StepLosses, lr: float) -> dict:
    """Clip, skip a non-finite step (no update, counted), else the optimizer step; the step's record."""
    cfg, info, st = run.cfg, run.info, run.st
    grad_norm = D.clip_grad_norm(run.par.master.parameters(),  # under EP the experts' gradients have their own mesh
                                 cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
    grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)  # FSDP2: DTensor
    loss = float(D.reduce_mean(losses.ce, info))
    bad = not (math.isfinite(loss) and math.isfinite(grad_norm))
    if bad:  # skip: no update from a non-finite step
        st["skipped_steps"] += 1
        st["bad_in_a_row"] += 1
    else:
        run.optimizer.step()
        st["bad_in_a_row"] = 0
    run.optimizer.zero_grad(set_to_none=True)
    if not bad:
        run.par.after_update()
    st["step"] = step + 1
    st["tokens"] += run.tokens_per_step
    st["last_loss"] = loss
    rec = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "skipped": bad,
           "spike": run.spikes.update(step, loss)}
    if losses.aux is not None:
        rec["aux_loss"] = float(D.reduce_mean(losses.aux, info))
    if losses.extra:
        rec["extra"] = losses.extra
    return rec


def _after_step(run: _Run, rec: dict, t0: float, t_start: float) -> None:
    """Periodic eval, the log line, the divergence stop, the step hook (a stopping rule sets st["stop_reason"]) and
    periodic checkpoints, after step rec["step"]. The checkpoint comes last, so it holds the hook's state (and the RNG
    after anything the hook drew): resuming from it replays nothing and skips nothing."""
    cfg, st, step = run.cfg, run.st, rec["step"]
    if cfg.eval_every and st["step"] % cfg.eval_every == 0 and st["step"] < cfg.steps:
        st["val"] = _evaluate(run)
        rec["val"] = st["val"]
    dt = time.perf_counter() - t0
    st["wall_time"] = time.perf_counter() - t_start
    rec["tokens"] = st["tokens"]
    rec["tokens_per_s"] = run.tokens_per_step / max(dt, 1e-9)
    log_step(run, rec)
    if st["bad_in_a_row"] >= cfg.max_bad_steps:
        st["diverged"] = True
        st["stop_reason"] = (f"stopped: {st['bad_in_a_row']} non-finite steps in a row at step {step} "
                             f"(max_bad_steps={cfg.max_bad_steps}); lower the LR or check the data")
        if run.info.is_main:
            print(f"gattn train: {st['stop_reason']}", flush=True)
        return
    if run.plugins.step_hook is not None:
        reason = run.plugins.step_hook(st["step"], run.model)
        run.model.train()  # the hook may have switched to eval mode
        if reason:
            st["stop_reason"] = str(reason)
            return  # _finish writes the final checkpoint
    if cfg.ckpt_every and st["step"] % cfg.ckpt_every == 0 and st["step"] < cfg.steps:
        _save_checkpoint(run, st["step"], background=cfg.async_checkpoint)


def _evaluate(run: _Run) -> dict:
    cfg = run.cfg
    res = domain_losses(run.model, run.source, seq_len=cfg.seq_len, max_batches=cfg.eval_batches,
                        batch_size=cfg.eval_batch_size, device=run.info.device, precision=run.precision)
    return res["losses"]


# ---------------------------------------------------------------- checkpointing and the end of the run

def _save_checkpoint(run: _Run, next_step: int, background: bool = False) -> None:
    """An exact-resume checkpoint of every part of _state (collective; train/saving.py: staged, then committed —
    `background`: async_checkpoint's write in the background, committed before the next save)."""
    saving.save_checkpoint(run, _state(run), next_step, background)


def restore_step_hook(out_dir: str | Path, hook) -> None:
    """Load a finished run's step-hook state from its newest checkpoint (the final one: written after the last hook
    call), so a caller reusing the run sees what the hook held when training ended."""
    latest = ckpt_mod.latest_valid_checkpoint(out_dir)
    if latest is None:
        raise UserError(f"{out_dir} holds no checkpoint to restore the step hook's state from; delete it to train "
                        "that run again")
    if has_state(hook):
        load_meta({"step_hook": HookState(hook)}, ckpt_mod.load_files(latest, 0)[1], latest)


def _finish(run: _Run, t_start: float) -> dict:
    """Final eval, a last checkpoint if the final step has none, the exported model and summary.json."""
    close_logs(run)
    st, info = run.st, run.info
    st["val"] = _evaluate(run)
    st["wall_time"] = time.perf_counter() - t_start
    saving.commit_staged(run)  # an async save still in flight (that of the last step, or before the final one below)
    if run.last_ckpt_step != st["step"]:
        _save_checkpoint(run, st["step"])  # blocking: nothing is left to overlap it with
    sharded = info.distributed and info.mode == "fsdp"
    if sharded and hasattr(run.model, "save_pretrained"):  # final/ written from the shards: no rank gathers the model
        _export_final_sharded(run, run.out / "final")
    msd, _ = full_state(run.par.master, run.optimizer) if info.distributed and not sharded else (None, None)

    def export() -> dict:
        if not sharded:
            _export_final(run.par.master, msd, run.source, run.out / "final")
        summary = _summary(run)
        atomic_write_json(run.out / "summary.json", summary)  # strict JSON
        return summary

    return D.on_rank0(info, export) or {}


def _summary(run: _Run) -> dict:
    """summary.json: the log's figures (logs.summary) and how the run ran (precision, speed, parallelism)."""
    info = run.info
    summary = run_summary(run.cfg, run.st, run.spikes, run.log_path)
    summary["resolved_precision"] = run.precision
    if run.precision != "fp32":  # how its bf16 GEMMs ran: "native", or "emulated" (util/bf16_emulation.py)
        summary["bf16_gemms"] = gemm_mode(info.device)
    summary["speed"] = run.par.speed.describe()
    summary["throughput"] = run.meter.describe()  # flops_per_token and the peak MFU is measured against
    summary["parallel"] = {"world_size": info.world_size, "wrapper": info.mode if info.distributed else "none",
                           "grad_accum": run.cfg.grad_accum,
                           "accumulation": run.par.accumulation,
                           "dp_replicate": run.cfg.dp_replicate, "expert_parallel": run.cfg.expert_parallel}
    if run.par.gather is not None:  # FSDP2's gather policy as applied (train/fsdp_policy.py)
        g = run.par.gather
        summary["parallel"].update(reshard_after_forward=run.cfg.reshard_after_forward, fsdp_prefetch=g.prefetch,
                                   keep_gathered=g.keep_gathered)
    return summary


def _export_final_sharded(run: _Run, dest: Path) -> None:
    """final/ under FSDP (a collective): rank 0 opens the atomic temp folder, every rank writes its shards as HF
    safetensors into it (state.save_hf_sharded: consolidated on disk by rank 0), rank 0 adds config, generation
    config and tokenizer and swaps the folder into place; a failure on any rank leaves the old final/ untouched."""
    import shutil

    info, stack = run.info, ExitStack()
    tmp = Path(D.on_rank0(info, lambda: str(stack.enter_context(atomic_dir(dest, overwrite=True)))))

    def finish():
        shutil.rmtree(tmp / "sharded", ignore_errors=True)  # the per-rank pieces, consolidated by now
        files = sorted(tmp.glob("model-*-of-*.safetensors"))
        if len(files) == 1:  # one file: the plain layout every loader reads first
            files[0].rename(tmp / "model.safetensors")
            (tmp / "model.safetensors.index.json").unlink(missing_ok=True)
        run.model.config.save_pretrained(tmp)
        if getattr(run.model, "generation_config", None) is not None:
            run.model.generation_config.save_pretrained(tmp)
        _save_tokenizer(run.source, tmp)

    try:
        D.on_every_rank(info, lambda: save_hf_sharded(run.par.master, tmp))
        D.on_rank0(info, finish)
    except BaseException as exc:
        stack.__exit__(type(exc), exc, exc.__traceback__)  # rank 0: the temp folder goes, final/ stays as it was
        raise
    D.on_rank0(info, stack.close)  # rank 0: the new final/ in place


def _export_final(raw: nn.Module, full_sd: dict | None, source, dest: Path) -> None:
    """save_pretrained (plus the tokenizer when there is one) into a temp folder, then swapped into place."""
    if not hasattr(raw, "save_pretrained"):
        return  # stand-in test models
    with atomic_dir(dest, overwrite=True) as tmp:
        if full_sd is not None:  # sharded/replicated: rebuild a plain model from the gathered weights
            plain = type(raw)(raw.config)
            plain.load_state_dict(full_sd)
            plain.save_pretrained(tmp)
        else:
            raw.save_pretrained(tmp)
        _save_tokenizer(source, tmp)


def _save_tokenizer(source, folder: Path) -> None:
    """The run's tokenizer beside its exported model, when its data source has one."""
    if getattr(source, "tokenizer", None) is not None:
        from gated_attention.data import save_tokenizer

        save_tokenizer(source.tokenizer, folder)
