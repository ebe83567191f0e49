"""Training harness: config and presets, LR schedules, atomic checkpoints, stability tooling, the loop, DDP/FSDP2.

Entry points: `train(cfg, out_dir, resume=False)` (trainer.py), `gattn train|sweep|eval` (cli.py, sweep.py, evaluate.py).
"""
from .config import TRAIN_PRESETS, TrainConfig, apply_overrides, train_preset

__all__ = ["TrainConfig", "TRAIN_PRESETS", "train_preset", "apply_overrides", "train"]


def train(*args, **kwargs):
    """Lazy alias of trainer.train (keeps `import gated_attention.train` light)."""
    from .trainer import train as _train

    return _train(*args, **kwargs)
