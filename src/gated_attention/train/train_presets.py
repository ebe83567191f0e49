"""The training presets (`gattn train --preset NAME`): each a small function returning a TrainConfig, derived from
another with `dataclasses.replace`, each naming a model preset of gated_attention.presets.
"""
from __future__ import annotations

from dataclasses import replace

from .config import TrainConfig


def tiny() -> TrainConfig:
    """Seconds on a CPU: tests and smoke runs (synthetic data so nothing needs preparing)."""
    return TrainConfig(model="tiny", data="synthetic", seq_len=32, batch_size=8, steps=40, lr=3e-3, min_lr=3e-4,
                       warmup_steps=4, eval_batches=2, eval_batch_size=4, stats_every=10, spike_window=10,
                       ckpt_every=20, progress=False, tensorboard=False)


def small() -> TrainConfig:
    """The CPU default: the `small` model on the prepared corpus, minutes to an hour."""
    return replace(tiny(), model="small", data="corpus", seq_len=256, batch_size=16, steps=2000, lr=3e-3,
                   min_lr=3e-5, warmup_steps=100, eval_every=250, eval_batches=8, eval_batch_size=8, stats_every=50,
                   spike_window=50, ckpt_every=250, progress=True, tensorboard=True)


def small_stress() -> TrainConfig:
    """A high-LR, short-warm-up recipe for one `gattn train` run (the grid over gates x LRs is `gattn lab stability`)."""
    return replace(small(), lr=1e-2, min_lr=1e-4, warmup_steps=20, steps=500, eval_every=0, ckpt_every=100)


def tiny_stress() -> TrainConfig:
    return replace(tiny(), lr=3e-2, warmup_steps=2)


# ---- the paper's own recipes (paper map §4): the model shape + its hyperparameters, in the
# setup clusters train in: FSDP2 sharding, bf16 parameters with fp32 master weights and reductions, every decoder
# layer recomputed in backward. Global batch in sequences of 4096 tokens, one sequence per GPU per forward
# (micro_batch=1: grad_accum follows the world size). AdamW betas/eps/weight decay/clip are not in the paper: the
# project's defaults. `gattn plan --preset NAME` says how many GPUs a preset needs and how long it takes.

def _paper_common() -> TrainConfig:
    return replace(small(), seq_len=4096, micro_batch=1, warmup_steps=1000, schedule="cosine", min_lr=3e-5,
                   dist="fsdp", precision="bf16-params", activation_checkpointing="full", eval_every=2000,
                   eval_batches=8, eval_batch_size=4, stats_every=500, ckpt_every=1000)


def paper_dense_28l() -> TrainConfig:
    """1.7B dense, 28 layers, 400B tokens (Table 2 rows 1-2): max LR 4e-3, global batch 1024 x 4096 tokens, 95,367
    steps (400e9 / 4,194,304: the paper's ~95k). The 3.5T-token run (rows 3-4) is this preset with
    --set lr=4.5e-3 --set batch_size=2048 --set steps=417233."""
    return replace(_paper_common(), model="1.7b-28l", lr=4e-3, batch_size=1024, steps=95_367)


def paper_dense_48l() -> TrainConfig:
    """1.7B dense, 48 layers (d 1536), 400B tokens (Table 2 rows 5, 8, 9): max LR 4e-3, global batch 1024, 95,367
    steps. The stress rows: --set lr=8e-3 (rows 6, 10); 1T tokens at batch 4096: --set batch_size=4096
    --set steps=59605 --set lr=5.3e-3 (or 8e-3, rows 11-14)."""
    return replace(_paper_common(), model="1.7b-48l", lr=4e-3, batch_size=1024, steps=95_367)


def paper_moe_15a2b() -> TrainConfig:
    """15A2B MoE (128 experts, top-8), 400B tokens (Tables 1, 3, 4, 6): max LR 2e-3, global batch 1024, 100k steps.
    The load-balancing loss is global-batch (moe.py: expert counts summed over ranks and micro-batches, Qiu et al.
    2025) with Qwen3-MoE's weight 1e-3; the router z-loss weight 1e-3 is ST-MoE's (the paper gives no weights)."""
    return replace(_paper_common(), model="15a2b", lr=2e-3, batch_size=1024, steps=100_000,
                   model_overrides={"router_aux_loss_coef": 1e-3, "router_z_loss_coef": 1e-3})


# the presets whose parallel layout (dist, dp_replicate, expert_parallel, accum_grads, keep_gathered, checkpointing,
# micro_batch) is `gattn plan --recommend`'s fastest for the launch's world size unless --set gives it (the values
# above are the one-process fallback): train.recommend.launch_layout
RECOMMENDED_LAYOUT = ("paper-dense-28l", "paper-dense-48l", "paper-moe-15a2b")

TRAIN_PRESETS = {"tiny": tiny, "small": small, "small-stress": small_stress, "tiny-stress": tiny_stress,
                 "paper-dense-28l": paper_dense_28l, "paper-dense-48l": paper_dense_48l,
                 "paper-moe-15a2b": paper_moe_15a2b}


def train_preset(name: str) -> TrainConfig:
    if name not in TRAIN_PRESETS:
        raise ValueError(f"unknown training preset {name!r}; valid: {', '.join(TRAIN_PRESETS)}")
    return TRAIN_PRESETS[name]()
