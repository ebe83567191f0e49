"""The one rule of "the same run settings": which TrainConfig fields may differ between a run and its resumption or
reuse (RESUMABLE_CHANGES: they do not change the numbers), and what differs between a saved run and a wanted one
(`changed_settings`, read by the trainer's --resume check and by experiment.train_or_reuse).
"""
from __future__ import annotations

from .config import TrainConfig


# fields that may differ between a run and its resumption or reuse (they do not change the numbers)
RESUMABLE_CHANGES = frozenset({"progress", "tensorboard", "ckpt_every", "keep_checkpoints", "compile", "fast", "dist",
                               "accum_grads", "async_checkpoint",  # how checkpoints are written, not what they hold
                               "reshard_after_forward", "fsdp_prefetch", "keep_gathered",  # when FSDP2 gathers
                               "expert_parallel", "dp_replicate",  # the layout, not the math: DCP reshards on resume
                               "device", "attn_implementation", "activation_checkpointing",
                               "grad_accum", "micro_batch", "peak_tflops", "profile_steps", "collective_timeout_s"})


def run_precision(d: dict) -> str:
    """The precision a run computes in, from its settings dict (train_config.json, or a TrainConfig's to_dict()):
    the `resolved_precision` recorded beside the settings, else the setting resolved on this machine now
    (gated_attention.util.precision). A bf16 run and an fp32 run are different runs, whatever was asked for."""
    if d.get("resolved_precision"):
        return d["resolved_precision"]
    from gated_attention.util.precision import RESOLVED, resolve

    asked = d.get("precision", "auto")
    if asked in RESOLVED:
        return asked
    return resolve(asked, d.get("device", "auto"), d.get("dist", "none"))


def changed_settings(saved: dict, want: dict) -> list[str]:
    """The TrainConfig fields (as dicts) that differ between a saved run and the wanted one: the trainer's --resume
    check and experiment.train_or_reuse both use this. Fields in RESUMABLE_CHANGES are ignored; a field missing from
    `saved` (added to TrainConfig after that run) counts as its default; gate names compare canonically ("baseline"
    is "none"); precision compares by what it resolves to (`run_precision`: "auto" that ran in bf16 is the same run
    as "bf16", and differs from "auto" on a machine where it resolves to fp32)."""
    from gated_attention.gates import ALIASES

    defaults = TrainConfig().to_dict()

    def same(key, a, b):
        if key == "gate" and isinstance(a, str) and isinstance(b, str):
            return ALIASES.get(a, a) == ALIASES.get(b, b)
        return a == b

    diff = [k for k, v in want.items() if k not in RESUMABLE_CHANGES and k not in ("precision", "resolved_precision")
            and not same(k, saved.get(k, defaults.get(k)), v)]
    if run_precision(saved) != run_precision(want):
        diff.append("precision")
    return sorted(diff)


def setting_differences(saved: dict, want: dict) -> list[str]:
    """`changed_settings` as readable items ("steps: saved 2 vs requested 3"); [] when the runs are the same."""
    defaults = TrainConfig().to_dict()

    def show(d: dict, k: str) -> str:
        if k == "precision":  # what was asked and what it ran / would run in
            return f"{d.get('precision', 'auto')!r} ({run_precision(d)})"
        return repr(d.get(k, defaults.get(k)))

    return [f"{k}: saved {show(saved, k)} vs requested {show(want, k)}" for k in changed_settings(saved, want)]


def describe_changes(saved: dict, want: dict) -> str:
    """`setting_differences` as one clause ("steps: saved 2 vs requested 3; lr: ..."), "" when none."""
    return "; ".join(setting_differences(saved, want))
