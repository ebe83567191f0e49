"""What activation checkpointing keeps, measured per decoder layer: the bytes of the tensors autograd saves while each
layer's forward runs (torch.autograd.graph.saved_tensors_hooks) and, under `selective`, of the op outputs
torch.utils.checkpoint's selective caching mode keeps for the recompute (found as the `_VersionWrapper` objects it
stores them in, which autograd's hooks never see); unique storages, parameters (sharded or gathered) excluded.
Imported by tests/test_activation_checkpointing.py, and run under torchrun by it for FSDP2 at 2 ranks (gloo):

    torchrun --nproc_per_node=2 tests/probes/ac_probe.py OUT.json

Each rank builds the tiny model the trainer's way (fast path, activation checkpointing, then FSDP2 per layer and at the
root) with the layer forward compiled (aot_eager: the trainer's tracing without a C++ build) either before wrapping
(compile=true) or after (compile=auto decides after some steps), plus eager, for every mode in MODES, and writes
{"MODE/CASE": [bytes per layer]}.
"""
from __future__ import annotations

import gc
import json
import sys

import torch
from torch.utils.checkpoint import _VersionWrapper

MODES = ("none", "full", "selective", "every:2")  # what the 2-rank run measures


def sac_cache() -> dict[int, _VersionWrapper]:
    """Every op output selective checkpointing holds now (its caching mode wraps each kept output), by object id."""
    return {id(o): o for o in gc.get_objects() if type(o) is _VersionWrapper}  # not isinstance: proxies raise


def build(mode: str, preset: str = "tiny", compile_at: str | None = None, fsdp: bool = False,
          gate: str = "sdpa_elementwise"):
    """(model, speed plan, decoder layers): AC `mode`, compiled "before" / "after" the FSDP2 wrap or not (None)."""
    from gated_attention.train import fastpath
    from gated_attention.train.activation_checkpoint import apply_activation_checkpointing
    from gated_attention.train.monitors import decoder_layers
    from harness import tiny_lm

    model = tiny_lm(gate, preset=preset, eval=False, seed=0)
    model.train()
    layers = decoder_layers(model)
    cfg = type("C", (), {"fast": True, "compile": "false"})()
    plan = fastpath.prepare(cfg, model, layers, torch.device("cpu"))
    plan.backend = "aot_eager"
    if compile_at == "before":
        plan._enable("compile=true")
    apply_activation_checkpointing(layers, mode)
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for layer in layers:
            fully_shard(layer)  # makes each layer an instance of a new FSDP subclass (one more `forward` wrapper)
        fully_shard(model)
    if compile_at == "after":
        plan._enable("compile=auto")
    return model, plan, layers


def saved_bytes_per_layer(model, plan, layers, steps: int = 2) -> list[int]:
    """Bytes autograd saves during each layer's forward in the last of `steps` training steps (the first compiles)."""
    current: list = [None]
    per: dict[int, dict[int, int]] = {}
    params: set[int] = set()
    cached_before: dict = {}  # the selective cache's entries when the running layer started (held: ids stay unique)

    def keep(i, t):
        if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter):
            s = t.untyped_storage()
            if s.data_ptr() not in params:
                per.setdefault(i, {})[s.data_ptr()] = s.nbytes()

    def pre(module, args, i):
        current[0] = i
        params.clear()  # FSDP2 frees a layer's gathered weights after its forward: their addresses get reused
        for p in module.parameters():  # as the layer holds them now (FSDP2: gathered for this forward)
            params.add(p.untyped_storage().data_ptr())
        cached_before.clear()
        cached_before.update(sac_cache())

    def post(module, args, out, i):
        current[0] = None
        for key, wrapper in sac_cache().items():  # what this layer's forward added to the selective cache
            if key not in cached_before:
                keep(i, wrapper.val)
        cached_before.clear()

    handles = []
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(lambda m, a, i=i: pre(m, a, i)))
        handles.append(layer.register_forward_hook(lambda m, a, o, i=i: post(m, a, o, i)))

    def pack(t):
        if current[0] is not None:
            keep(current[0], t)
        return t

    ids = torch.randint(0, model.config.vocab_size, (2, 33), generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        per.clear()
        with plan.training_forward(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(input_ids=ids[:, :-1], shift_labels=ids[:, 1:], fused_loss=True, use_cache=False)
        out.loss.backward()
    for h in handles:
        h.remove()
    return [sum(per.get(i, {}).values()) for i in range(len(layers))]


def main() -> None:
    import torch.distributed as dist

    from gated_attention.train import dist as D

    info = D.setup("cpu", "fsdp")
    result = {}
    for mode in MODES:
        for compile_at in (None, "before", "after"):
            model, plan, layers = build(mode, compile_at=compile_at, fsdp=True)
            result[f"{mode}/{compile_at or 'eager'}"] = saved_bytes_per_layer(model, plan, layers)
            torch._dynamo.reset()
    if info.rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(result, f)
    dist.barrier()
    D.teardown()


if __name__ == "__main__":
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # harness (tests/support/)
    main()
    from gated_attention.train.dist import exit_process

    exit_process(0)  # a rank whose group ended: no interpreter finalization (train/dist.py says why)
