"""What a lab plugs into the one training loop (`train.trainer.train(..., plugins=Plugins(...))`), so that every model
a command trains — `gattn train`, compare, longctx, every lab — goes through the same loop with its precision,
compile decision, fast path, NaN skipping, logs and exact-resume checkpoints. Every field is optional; a run without
plug-ins is the plain trainer.

  source        where the batches come from, in place of the corpus / synthetic source (data_source.py), with
                `cfg.data == "custom"`: train_batch(batch_size, seq_len, seed, step, rows=None) -> (B, T+1) token ids,
                a pure function of (seed, step) like the trainer's own sources (so resuming needs nothing but the
                step); `domains` (the held-out domains the trainer's eval reads; [] = none, the lab measures itself)
                with eval_batches(domain, seq_len, max_batches, batch_size); optional vocab_size and tokenizer.
  param_groups  fn(model) -> AdamW parameter groups, in place of the trainer's decay rule
                (model_setup.param_groups). A group's "lr_mult" scales the schedule's LR for that group (default 1):
                e.g. gates at the full LR and the pretrained weights at a tenth.
  trainable_at  fn(step, model): sets requires_grad for the step about to run (a phase in which only some parameters
                train). A parameter without a gradient is skipped by AdamW (no update, no weight decay, no state) and
                by the gradient clip. One process only (DDP/FSDP and the bf16-params master copy fix the trainable
                set when they wrap the model); compile stays off or recompiles at each phase change.
  extra_loss    an object called after each training forward:
                    extra_loss(step, inputs, targets, output, ce) -> (Tensor | None, {name: float})
                the tensor is added to the loss that is backpropagated (the logged "loss" stays the next-token CE,
                `ce`), the floats are logged under the step record's "extra" (their mean over micro-batches). Optional
                attributes: `needs_logits = True` (the forward returns full logits in output.logits: the chunked
                fused loss is not used) and forward_context(step, model) -> a context entered around the forward (a
                capture.py tap that keeps q/k/gate tensors with their graph).

The step hook (train()'s `step_hook`) may define begin(model): called once, before the first step of a fresh run (not
on resume), with the model as built: a learning curve's step-0 point.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

CUSTOM_DATA = "custom"  # TrainConfig.data for a run fed by Plugins.source


@dataclass(frozen=True)
class Plugins:
    source: object = None
    param_groups: Callable | None = None
    trainable_at: Callable | None = None
    extra_loss: object = None

    def check(self, cfg, info, mixed: bool) -> None:
        """One clear error for a plug-in the run cannot take (before any step)."""
        from ..util.errors import UserError

        if (cfg.data == CUSTOM_DATA) != (self.source is not None):
            raise UserError(f"data={cfg.data!r} with{'out' if self.source is None else ''} a plug-in source: "
                            f"data={CUSTOM_DATA!r} is the run fed by train(..., plugins=Plugins(source=...)), and only "
                            "that run")
        if self.trainable_at is not None and (info.distributed or mixed):
            raise UserError("a plug-in trainable set (trainable_at) needs one process without bf16-params (DDP/FSDP "
                            "and the bf16 master copy fix what trains when they wrap the model)")

    @property
    def needs_logits(self) -> bool:
        return bool(getattr(self.extra_loss, "needs_logits", False))

    def forward_context(self, step: int, model):
        fn = getattr(self.extra_loss, "forward_context", None)
        return fn(step, model) if fn is not None else nullcontext()


def begin(step_hook, model) -> None:
    """The step hook's begin(model), where it has one (a fresh run, before the first step)."""
    fn = getattr(step_hook, "begin", None)
    if fn is not None:
        fn(model)
