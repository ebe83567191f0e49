"""Training harness: config and presets, LR schedules, atomic checkpoints, stability tooling, the loop, DDP/FSDP2,
the data sources (corpus, synthetic, retrieval mixing), evaluation.

Entry points: `train(cfg, out_dir, resume=False)` (trainer.py), `domain_losses(...)` (evaluate.py); the commands
`gattn train|eval` are in gated_attention/cli/train.py.
"""
from .config import TrainConfig
from .overrides import apply_overrides
from .train_presets import TRAIN_PRESETS, train_preset

__all__ = ["TrainConfig", "TRAIN_PRESETS", "train_preset", "apply_overrides", "train"]


def train(*args, **kwargs):
    """trainer.train, imported on first call (the loop pulls in torch.distributed, tqdm, the data layer; the\n    config alone does not)."""
    from .trainer import train as _train

    return _train(*args, **kwargs)
