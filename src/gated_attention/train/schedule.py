"""Learning-rate schedules as pure functions of the optimizer step (so the schedule's state is just the step).

Both start with a linear warm-up: lr(s) = peak * (s+1)/warmup for s < warmup (step 0 already trains).
  cosine: peak -> min_lr over the remaining steps, following half a cosine; lr(steps-1) == min_lr.
  wsd   : warm-up, Stable at peak, then Decay over the last `wsd_decay_frac` of the run to min_lr,
          linearly or as 1 - sqrt(progress) (which keeps the LR higher early in the decay).
"""
from __future__ import annotations

import math


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, steps: int, schedule: str = "cosine",
          wsd_decay_frac: float = 0.2, wsd_decay_shape: str = "linear") -> float:
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "cosine":
        span = max(1, steps - 1 - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule == "wsd":
        decay_steps = int(round(wsd_decay_frac * steps))
        decay_start = steps - decay_steps
        if decay_steps == 0 or step < decay_start:
            return lr
        progress = min(1.0, (step - decay_start + 1) / decay_steps)  # reaches 1 on the last step
        factor = 1.0 - progress if wsd_decay_shape == "linear" else 1.0 - math.sqrt(progress)
        return min_lr + (lr - min_lr) * factor
    raise ValueError(f"unknown schedule {schedule!r}; use 'cosine' or 'wsd'")


def lr_for(cfg, step: int) -> float:
    """lr_at with the fields of a TrainConfig."""
    return lr_at(step, lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=cfg.warmup_steps, steps=cfg.steps,
                 schedule=cfg.schedule, wsd_decay_frac=cfg.wsd_decay_frac, wsd_decay_shape=cfg.wsd_decay_shape)
