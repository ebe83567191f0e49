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
  extra_loss    a term added to the training loss, called after each training forward:
                    extra_loss(step, inputs, targets, output, ce) -> (Tensor | None, {name: float})
                the tensor is added to the loss that is backpropagated (the logged "loss" stays the next-token CE,
                `ce`), the floats are logged under the step record's "extra" (their mean over micro-batches). Optional
                attributes: `needs_logits` (below) and forward_context(step, model) -> a context entered around the
                forward (a capture.py tap that keeps q/k/gate tensors with their graph).
  observe       what a lab watches of each training forward, changing nothing: observe(step, fwd) -> {name: float}
                or None, with fwd a `Forward` (the micro-batch's inputs and targets, the model's output, the
                detached CE); the floats are logged under the step record's "extra" like extra_loss's (the sink lab:
                the batch's backcopy CE, its time-to-skill rule).

  step_hook     step_hook(steps_done, model) -> str | None, after every optimizer step (after its log line, before
                its checkpoint) on every rank with the plain model; a non-empty string stops training there with it as
                the summary's stop_reason (a stopping rule such as longctx's --until-skill); it must give the same
                answer on every rank. A hook with state (curves, probe records) defines state_dict() -> JSON-able dict
                and load_state_dict(d): its state rides in every checkpoint (train/state.py), so a killed and resumed
                run ends with the hook holding what an uninterrupted one holds. It may define begin(model): called
                once, before the first step of a fresh run (not on resume), with the model as built (a curve's step-0
                point).
  model_factory model_factory(cfg, vocab_size) -> nn.Module in place of the default GatedQwen3ForCausalLM builder (a
                lab's own model: the sink lab's small shapes, the retrofit lab's retrofitted start; tests' stand-ins).
                Its model is built as it is (not on the meta device) with its own weights.

`needs_logits = True` on extra_loss or observe: the forward returns the full (b, T, V) logits in output.logits, so the
chunked fused loss (which never builds them; output.logits is then None) is not used for that run.

train()'s `step_hook=` and `model_factory=` keywords are the same two plug-ins (`with_aliases`).
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

CUSTOM_DATA = "custom"  # TrainConfig.data for a run fed by Plugins.source


@dataclass(frozen=True)
class Forward:
    """One micro-batch's training forward, as an observer sees it."""

    inputs: object  # (b, T) token ids
    targets: object  # (b, T) next tokens
    output: object  # the model's output (logits None under the chunked loss: see needs_logits)
    ce: object  # the next-token CE of the micro-batch, detached (the logged loss)


@dataclass(frozen=True)
class Plugins:
    source: object = None
    param_groups: Callable | None = None
    trainable_at: Callable | None = None
    extra_loss: object = None
    observe: Callable | None = None
    step_hook: Callable | None = None
    model_factory: Callable | None = None

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

    def with_aliases(self, step_hook=None, model_factory=None) -> "Plugins":
        """These plug-ins with train()'s `step_hook=` / `model_factory=` keywords filled in (one place to give each)."""
        from dataclasses import replace

        from ..util.errors import UserError

        for name, given in (("step_hook", step_hook), ("model_factory", model_factory)):
            if given is not None and getattr(self, name) is not None:
                raise UserError(f"train(..., {name}=...) and Plugins({name}=...) both given; pass it once")
        return replace(self, step_hook=step_hook or self.step_hook, model_factory=model_factory or self.model_factory)

    @property
    def needs_logits(self) -> bool:
        return any(getattr(p, "needs_logits", False) for p in (self.extra_loss, self.observe))

    def after_forward(self, step: int, inputs, targets, output, ce):
        """The extra loss term (or None) and the floats to log, from extra_loss and observe."""
        extra, logs = self.extra_loss(step, inputs, targets, output, ce) if self.extra_loss is not None else (None, {})
        if self.observe is not None:
            logs = {**logs, **(self.observe(step, Forward(inputs, targets, output, ce.detach())) or {})}
        return extra, logs

    def forward_context(self, step: int, model):
        fn = getattr(self.extra_loss, "forward_context", None)
        return fn(step, model) if fn is not None else nullcontext()


def begin(step_hook, model) -> None:
    """The step hook's begin(model), where it has one (a fresh run, before the first step)."""
    fn = getattr(step_hook, "begin", None)
    if fn is not None:
        fn(model)
