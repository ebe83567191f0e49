"""Process-wide settings a training run makes for itself: Python's garbage collection and the CUDA allocator.

  * `garbage_collection(every)`: Python's automatic collection off while the loop runs, one full collection every
    `every` steps instead (TrainConfig.gc_every). A collection pauses the process for as long as its heap takes to
    walk; left automatic it falls at a different moment on each rank, and every other rank then waits for that one
    in the next collective. Collected at the same step everywhere, the pauses coincide. The previous state is
    restored when the loop ends (labs train many runs in one process).
  * `cuda_allocator_defaults(device)`: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True for a CUDA run unless the
    user set the allocator's configuration (PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF): segments that grow in
    place instead of fixed blocks, so MoE's and variable-length batches' changing shapes fragment less memory.
    Read by the allocator when CUDA initialises, so it is set before the run's first CUDA call (dist.setup).
"""
from __future__ import annotations

import gc
import os
from contextlib import contextmanager

import torch

ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # the allocator reads either name
EXPANDABLE = "expandable_segments:True"


@contextmanager
def garbage_collection(every: int):
    """Yields `after_step(step)`, to call after each optimizer step with the number of steps done; every <= 0 leaves
    Python's automatic collection as it is (and the callback does nothing)."""
    if every <= 0:
        yield lambda step: None
        return
    was_enabled = gc.isenabled()
    gc.disable()
    gc.collect()  # start from a clean heap: what setup left behind is not carried into the first interval

    def after_step(step: int) -> None:
        if step % every == 0:
            gc.collect()

    try:
        yield after_step
    finally:
        if was_enabled:
            gc.enable()


def cuda_allocator_defaults(device: torch.device) -> bool:
    """Set expandable segments for a CUDA run unless the allocator is configured already; True when it set them."""
    if device.type != "cuda" or any(name in os.environ for name in ALLOC_CONF_VARS):
        return False
    if torch.cuda.is_initialized():  # too late for the variable; the allocator takes the setting at run time
        torch.cuda.memory._set_allocator_settings(EXPANDABLE)
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = EXPANDABLE
    return True
