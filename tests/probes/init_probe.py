"""Run by tests/test_distributed.py, under torchrun or as one process: a one-step `tiny` training run whose step hook
saves, from its begin(model) (a fresh run, before the first step), the model's weights as the trainer built them —
gathered under FSDP2 — to OUT.pt (rank 0).

    [torchrun --nproc_per_node=2] tests/probes/init_probe.py OUT.pt RUN_DIR [--set KEY=VALUE ...]
"""
from __future__ import annotations

import sys

import torch


class SaveInitialWeights:
    """A step hook whose begin(model) writes the whole model's state dict (every rank joins the gather)."""

    def __init__(self, out: str):
        self.out = out

    def begin(self, model) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        group = torch.distributed.is_initialized()
        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=group))
        if not group or torch.distributed.get_rank() == 0:
            torch.save({k: v.detach().cpu().clone() for k, v in sd.items()}, self.out)

    def __call__(self, steps_done: int, model) -> None:
        return None


def main() -> None:
    from gated_attention.train.overrides import apply_overrides
    from gated_attention.train.train_presets import tiny
    from gated_attention.train.trainer import train

    out, run_dir, sets = sys.argv[1], sys.argv[2], [a for a in sys.argv[3:] if a != "--set"]
    cfg = apply_overrides(tiny(), ["steps=1", "precision=fp32", "compile=false", "stats_every=0", "ckpt_every=0",
                                   "eval_batches=1"] + sets)
    train(cfg, run_dir, step_hook=SaveInitialWeights(out))


if __name__ == "__main__":
    main()
    from gated_attention.train.dist import exit_process

    exit_process(0)  # a rank whose group ended: no interpreter finalization (train/dist.py says why)
