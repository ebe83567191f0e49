"""Run under torchrun by tests/test_distributed.py: build a training model sharded from birth (dist=fsdp: meta device,
FSDP2, each rank fills its shards; train/meta_init.py), then gather it and save the full state dict (rank 0) with
each rank's share of the parameters' elements.

    torchrun --nproc_per_node=2 tests/probes/fsdp_birth.py OUT.pt [--set KEY=VALUE ...]

With --peak (no gather): each rank's peak RSS growth (tests/support/memprobe.py) while building and filling the model,
and while writing it as an HF folder from the shards into OUT.pt's folder (final/, state.save_hf_sharded), the bytes
of checkpoint tensors it asked safetensors for (init_from: every get_slice / get_tensor result, counted), its
shard's bytes and the whole model's; OUT.pt then holds {"ranks": [{build, save, read, local, whole}, ...]}.
"""
from __future__ import annotations

import json
import sys

import torch


def main() -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from gated_attention.train import dist as D
    from gated_attention.train.train_presets import tiny
    from gated_attention.train.overrides import apply_overrides
    from gated_attention.train.meta_init import build_on_meta, fill_model
    from gated_attention.train.model_setup import build_model
    from gated_attention.train.monitors import decoder_layers

    peak = "--peak" in sys.argv
    out, sets = sys.argv[1], [a for a in sys.argv[2:] if a not in ("--set", "--peak")]
    cfg = apply_overrides(tiny(), ["dist=fsdp", "precision=fp32"] + sets)
    info = D.setup("cpu", "fsdp")
    if peak:
        return measure_peaks(cfg, info, out)
    model = build_on_meta(build_model, cfg, None)
    total = sum(p.numel() for p in model.parameters())
    model = D.wrap(model, info, decoder_layers(model))
    fill_model(model, cfg, None, info.device)
    local = sum(p.to_local().numel() for p in model.parameters())
    shares = [None] * info.world_size
    torch.distributed.all_gather_object(shares, local / total)
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if info.is_main:
        torch.save({"state": {k: v.clone() for k, v in sd.items()}, "shares": shares,
                    "inv_freq": model.model.rotary_emb.inv_freq.clone()}, out)  # a non-persistent buffer
        print(json.dumps({"shares": shares}))
    D.teardown()


def measure_peaks(cfg, info, out: str) -> None:
    """Per rank: peak RSS growth of the sharded build (meta build, FSDP2, fill) and of final/'s sharded save."""
    from pathlib import Path

    import memprobe
    from gated_attention.train import dist as D
    from gated_attention.train.meta_init import build_on_meta, fill_model
    from gated_attention.train.model_setup import build_model
    from gated_attention.train.monitors import decoder_layers
    from gated_attention.train.state import save_hf_sharded

    import gated_attention.modeling  # noqa: F401 - imported before the mark: the window measures the model, not the
    # library's import (build_model imports the model's module on first use)

    read = count_reads()
    torch.distributed.barrier()
    start = memprobe.reset_peak()
    model = build_on_meta(build_model, cfg, None)
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    model = D.wrap(model, info, decoder_layers(model))
    fill_model(model, cfg, None, info.device)
    build = memprobe.peak_bytes() - start
    local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    torch.distributed.barrier()
    start = memprobe.reset_peak()
    save_hf_sharded(model, Path(out).parent / "final")
    save = memprobe.peak_bytes() - start
    ranks = [None] * info.world_size
    torch.distributed.all_gather_object(ranks, {"build": build, "save": save, "read": read[0], "local": local,
                                          "whole": whole})
    if info.is_main:
        torch.save({"ranks": ranks}, out)
        print(json.dumps(ranks))
    D.teardown()


def count_reads() -> list:
    """Count the bytes of every tensor (or slice of one) read through safetensors.safe_open from now on."""
    import safetensors

    read, real = [0], safetensors.safe_open

    def counted(t):
        read[0] += t.numel() * t.element_size()
        return t

    class Slice:
        def __init__(self, sl):
            self.sl = sl

        def get_shape(self):
            return self.sl.get_shape()

        def __getitem__(self, idx):
            return counted(self.sl[idx])

    class Handle:
        def __init__(self, *args, **kwargs):
            self.fh = real(*args, **kwargs)

        def __enter__(self):
            self.fh.__enter__()
            return self

        def __exit__(self, *exc):
            return self.fh.__exit__(*exc)

        def keys(self):
            return self.fh.keys()

        def get_slice(self, key):
            return Slice(self.fh.get_slice(key))

        def get_tensor(self, key):
            return counted(self.fh.get_tensor(key))

    safetensors.safe_open = Handle
    return read


if __name__ == "__main__":
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # memprobe (tests/support/)
    main()
    from gated_attention.train.dist import exit_process

    exit_process(0)  # a rank whose group ended: no interpreter finalization (train/dist.py says why)
