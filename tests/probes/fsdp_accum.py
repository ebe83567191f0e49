"""Run under torchrun by tests/test_distributed.py: train dist=fsdp with gradient accumulation and record, after each
micro-batch's backward in the second step, how many bytes of tensors this rank holds beyond what it held when that
step began (grads were None then, the optimizer state already existed; the activations are freed by the end of a
backward, so the difference is the gradients this rank keeps while it accumulates).

    torchrun --nproc_per_node=2 tests/probes/fsdp_accum.py OUT_DIR RESULT_PREFIX [--set KEY=VALUE ...]

Writes RESULT_PREFIX.rankN.json: {"whole_grad_bytes": fp32 bytes of every trainable parameter's whole gradient,
"held": [bytes after micro-batch 1, 2, ...], "accumulation": the plan's policy}.
"""
from __future__ import annotations

import gc
import json
import os
import sys

import torch


def live_tensor_bytes() -> int:
    """Bytes of every distinct storage held by a live Python tensor object or by its .grad (a gradient lives in
    autograd's C++ metadata and has no Python object until read), DTensors by their local shard."""
    from torch.distributed.tensor import DTensor

    seen = {}
    gc.collect()

    def add(t):
        t = t._local_tensor if isinstance(t, DTensor) else t
        if t.device.type == "meta":
            return
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        if st.nbytes():
            seen[st.data_ptr()] = st.nbytes()

    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor):
            add(obj)
            if obj.is_leaf and obj.requires_grad and obj.grad is not None:
                add(obj.grad)
    return sum(seen.values())


def main() -> None:
    from gated_attention.train import trainer
    from gated_attention.train.train_presets import tiny
    from gated_attention.train.overrides import apply_overrides

    out, prefix, sets = sys.argv[1], sys.argv[2], [a for a in sys.argv[3:] if a != "--set"]
    cfg = apply_overrides(tiny(), ["dist=fsdp", "precision=fp32", "compile=false", "stats_every=0", "ckpt_every=0",
                                   "steps=2"] + sets)
    rec = {"held": []}
    state = {"step": -1, "base": 0}
    train_step, backward = trainer._train_step, torch.Tensor.backward

    def _train_step(run, step):
        state["step"] = step
        if step == 1:
            state["base"] = live_tensor_bytes()
            rec["whole_grad_bytes"] = 4 * sum(p.numel() for p in run.par.master.parameters() if p.requires_grad)
            rec["accumulation"] = run.par.accumulation
        return train_step(run, step)

    def _backward(self, *args, **kwargs):
        backward(self, *args, **kwargs)
        if state["step"] == 1:
            rec["held"].append(live_tensor_bytes() - state["base"])

    trainer._train_step = _train_step
    torch.Tensor.backward = _backward
    trainer.train(cfg, out)
    rank = os.environ.get("RANK", "0")
    with open(f"{prefix}.rank{rank}.json", "w") as fh:
        json.dump(rec, fh)


if __name__ == "__main__":
    main()
