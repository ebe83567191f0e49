"""Run under torchrun by tests/test_distributed.py: build a training model sharded from birth (dist=fsdp: meta device,
FSDP2, each rank fills its shards; train/meta_init.py), then gather it and save the full state dict (rank 0) with
each rank's share of the parameters' elements.

    torchrun --nproc_per_node=2 tests/fsdp_birth.py OUT.pt [--set KEY=VALUE ...]
"""
from __future__ import annotations

import json
import sys

import torch


def main() -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from gated_attention.train import dist as D
    from gated_attention.train.config import apply_overrides, tiny
    from gated_attention.train.meta_init import build_on_meta, fill_model
    from gated_attention.train.model_setup import build_model
    from gated_attention.train.monitors import decoder_layers

    out, sets = sys.argv[1], [a for a in sys.argv[2:] if a != "--set"]
    cfg = apply_overrides(tiny(), ["dist=fsdp", "precision=fp32"] + sets)
    info = D.setup("cpu", "fsdp")
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


if __name__ == "__main__":
    main()
