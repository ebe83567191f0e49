"""A run's restorable state: what a checkpoint holds, defined once (`run_state`) as a few objects with
`state_dict()` / `load_state_dict()` that the trainer's save and restore both walk, plus the helpers that gather,
shard and load the model/optimizer state dicts and the RNG states.

    Weights      the model's (master) weights and AdamW's moments: state.pt (gathered by rank 0), or under
                 dist=fsdp a sharded DCP folder state/ written by every rank
    Counters     step, tokens, skipped steps, ... (meta.json "state")
    SpikeDetector the loss-spike window (meta.json "spikes"; train/monitors.py)
    HookState    the step hook's own state, when it has one (meta.json "step_hook")
    RNG          this rank's RNG states (rng_rank<r>.pt, one file per rank)

The files themselves are written by train/checkpoint.py (atomic, verified, rotated).
"""
from __future__ import annotations

import random
import warnings
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..util.errors import UserError


class Weights:
    """The model's weights and the optimizer's state; `after_load()` runs after every load (the bf16 twin's
    refresh under bf16-params)."""

    what = "model and optimizer state"

    def __init__(self, model, optimizer, sharded: bool, after_load: Callable[[], None] = lambda: None):
        self.model, self.optimizer, self.sharded, self.after_load = model, optimizer, sharded, after_load

    def state_dict(self) -> dict:
        """The gathered full state, on CPU (a collective under DDP/FSDP): state.pt's contents."""
        msd, osd = full_state(self.model, self.optimizer)
        return {"model": msd, "optimizer": osd}

    def load_state_dict(self, sd: dict) -> None:
        load_full_state(self.model, self.optimizer, sd["model"], sd["optimizer"])
        self.after_load()

    def save_sharded(self, folder: Path, background: bool = False, group=None) -> Future | None:
        """Every rank writes its own shards into the DCP folder (a collective); `background`: staged here, written
        by a background thread, the future of that write returned (save_sharded_state)."""
        return save_sharded_state(self.model, self.optimizer, folder, background, group)

    def load_sharded(self, folder: Path) -> None:
        """Every rank reads its shards from a DCP folder written at any world size (a collective)."""
        load_sharded_state(self.model, self.optimizer, folder)
        self.after_load()


class Counters:
    """The run's counters (a dict the trainer updates in place)."""

    what = "counters"

    def __init__(self, st: dict):
        self.st = st

    def state_dict(self) -> dict:
        return dict(self.st)

    def load_state_dict(self, d: dict) -> None:
        self.st.update(d)


class HookState:
    """The state of train()'s step hook (curves, probe records), for a hook with state_dict / load_state_dict."""

    what = "state of this run's step hook"

    def __init__(self, hook):
        self.hook = hook

    def state_dict(self) -> dict:
        return self.hook.state_dict()

    def load_state_dict(self, d: dict) -> None:
        self.hook.load_state_dict(d)


def has_state(hook) -> bool:
    return hasattr(hook, "state_dict") and hasattr(hook, "load_state_dict")


class RNG:
    """This rank's RNG states."""

    what = "RNG state"

    def state_dict(self) -> dict:
        return rng_state()

    def load_state_dict(self, d: dict) -> None:
        set_rng_state(d)


@dataclass
class RunState:
    """What a checkpoint holds: `weights` (state.pt or state/), `meta` (name -> part, JSON in meta.json), `rng`
    (each rank's own file)."""

    weights: Weights
    meta: dict
    rng: RNG

    def meta_dict(self) -> dict:
        return {name: part.state_dict() for name, part in self.meta.items()}

    def load_meta(self, meta: dict, ckpt: Path) -> None:
        load_meta(self.meta, meta, ckpt)


def load_meta(parts: dict, meta: dict, ckpt: Path) -> None:
    """Each part (name -> part) from meta.json's `meta`; a part the checkpoint lacks (written by a run without it)
    is an error."""
    for name, part in parts.items():
        if name not in meta:
            raise UserError(f"checkpoint {ckpt} holds no {part.what} (written without it); delete "
                            f"{ckpt.parent.parent} to train that run again")
        part.load_state_dict(meta[name])


def run_state(model, optimizer, sharded: bool, counters: dict, spikes, step_hook,
              after_load: Callable[[], None] = lambda: None) -> RunState:
    """The one definition of a checkpoint's contents (the trainer's save and restore both use it)."""
    meta = {"state": Counters(counters), "spikes": spikes}
    if has_state(step_hook):
        meta["step_hook"] = HookState(step_hook)
    return RunState(weights=Weights(model, optimizer, sharded, after_load), meta=meta, rng=RNG())


def rng_state() -> dict:
    """This rank's RNG states: CPU torch, Python, and the CUDA generator of this rank's own device only (a rank
    draws from no other GPU; saving every visible device's made a checkpoint unresumable on a host with fewer)."""
    st = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    return st


def set_rng_state(st: dict) -> None:
    """Restore rng_state()'s states; the CUDA one into this rank's current device. A checkpoint of an older version
    holds a list with every visible device's state: this rank's is the one at its device's index (a rank's device
    is its LOCAL_RANK, as it was when written); where the list has no such entry that generator starts afresh."""
    torch.set_rng_state(st["torch"])
    random.setstate(st["python"])
    cuda = st.get("cuda")
    if cuda is None or not torch.cuda.is_available():
        return
    here = torch.cuda.current_device()
    if isinstance(cuda, (list, tuple)):
        cuda = cuda[here] if here < len(cuda) else None
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, here)


def full_state(model, optimizer) -> tuple[dict, dict]:
    """Gathered full (unsharded) model and optimizer state dicts, on CPU (a collective under DDP/FSDP)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=torch.distributed.is_initialized())
    msd, osd = get_state_dict(model, optimizer, options=opts)
    if not torch.distributed.is_initialized():
        msd = {k: v.detach().cpu().clone() for k, v in msd.items()}
        osd = _to_cpu(osd)
    return msd, osd


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return obj


_ONE_PROCESS = "torch.distributed is disabled, unavailable or uninitialized"  # DCP's warning in one process


@contextmanager
def _one_process_quiet():
    """DCP in one process warns on every call that it assumes one process: that is the intent (dist=fsdp at world
    size 1), so that warning is dropped."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_ONE_PROCESS)
        yield


def _quiet_one_process_warning() -> None:
    """The same warning dropped for the rest of this process: an asynchronous save emits it from DCP's writer
    thread, after any catch_warnings of the caller has ended (only that message, only from DCP)."""
    warnings.filterwarnings("ignore", message=_ONE_PROCESS, module="torch.distributed.checkpoint")


def save_sharded_state(model, optimizer, folder, background: bool = False, group=None) -> Future | None:
    """torch.distributed.checkpoint (DCP): every rank writes its own shards of the model and AdamW state into
    `folder` in parallel (a collective; in one process the whole state); no gather anywhere.

    background: dcp.async_save — this rank's shards are staged (copied into CPU memory: training may change the
    weights as soon as this returns) and written by a background thread; returns the future of that write. DCP's
    thread executor (its default), not its process one: the thread shares this process, its memory and its fate (a
    SIGKILL takes the writer with it) and runs DCP's collectives over `group` (dist.checkpoint_group); the process
    executor adds a second Python process per rank (its own torch import and gloo group, set up through a TCP store
    on rank 0 at the first save) and pickles the staged state to it through a pipe — more start-up and one more
    copy, for a write that is I/O (which releases the GIL) either way. The write completes on any rank only after
    every rank's shards are written and fsync'ed (DCP gathers the write results before rank 0 writes .metadata)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optimizer)
    sd, writer = {"model": msd, "optimizer": osd}, dcp.FileSystemWriter(str(folder), sync_files=True)
    if background:
        if not torch.distributed.is_initialized():  # in one process DCP warns from its thread, where no
            _quiet_one_process_warning()  # catch_warnings reaches
        return dcp.async_save(sd, storage_writer=writer, process_group=group)
    with _one_process_quiet():
        dcp.save(sd, storage_writer=writer)
    return None


def load_sharded_state(model, optimizer, folder) -> None:
    """Load a DCP checkpoint written at any world size into this run's model and optimizer, each rank reading the
    parts of its own shards (DCP reshards: 2 ranks -> 1 process -> 2 ranks)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, optimizer)  # the optimizer's state is created (zeros) for DCP to fill
    sd = {"model": msd, "optimizer": osd}
    with _one_process_quiet():
        dcp.load(sd, storage_reader=dcp.FileSystemReader(str(folder)))
    set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])


def save_hf_sharded(model, folder) -> None:
    """The model's weights as HF safetensors written from the shards (a collective): every rank writes its own
    shards (DCP's HuggingFaceStorageWriter), which rank 0 then consolidates into full tensors on disk, streaming —
    no rank gathers the model in memory. A tied head is stored once (as save_pretrained does)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    sd = get_model_state_dict(model)
    if getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        sd.pop("lm_head.weight", None)
    dcp.save(sd, storage_writer=dcp.HuggingFaceStorageWriter(str(folder), save_distributed=True,
                                                              enable_consolidation=True))


def load_full_state(model, optimizer, msd: dict, osd: dict) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd,
                   options=StateDictOptions(full_state_dict=True))
