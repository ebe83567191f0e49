"""The one rule of "the same run settings": which TrainConfig fields may differ between a run and its resumption or
reuse (RESUMABLE_CHANGES: they do not change the numbers), and what differs between a saved run and a wanted one
(`changed_settings`, read by the trainer's --resume check and by experiment.train_or_reuse).

One exception to RESUMABLE_CHANGES: a model with a global-batch load-balancing loss (MoE layers, router_aux_loss_coef
> 0; moe.py). Micro-batch m of a step computes that loss from the expert counts of micro-batches 1..m summed over
every rank (the exact global batch is unknown before its last micro-batch), so which rows micro-batch m holds changes
the numbers: the number of micro-batches per step (grad_accum, as micro_batch derives it), and with more than one
the world size too (rank r's m-th micro-batch is rows [r B/N + (m-1) b, r B/N + m b) of the global batch). For such
a run those are compared (`balance_layout_changes`), so a resume onto another layout is refused in one line.
"""
from __future__ import annotations

from .config import RUN_RECORD_KEYS, TrainConfig, accum_for


# fields that may differ between a run and its resumption or reuse (they do not change the numbers)
RESUMABLE_CHANGES = frozenset({"progress", "tensorboard", "ckpt_every", "keep_checkpoints", "compile", "fast", "dist",
                               "accum_grads", "async_checkpoint",  # how checkpoints are written, not what they hold
                               "reshard_after_forward", "fsdp_prefetch", "keep_gathered",  # when FSDP2 gathers
                               "expert_parallel", "dp_replicate",  # the layout, not the math: DCP reshards on resume
                               "device", "attn_implementation", "activation_checkpointing",
                               "grad_accum", "micro_batch", "peak_tflops", "profile_steps", "collective_timeout_s",
                               "gc_every"})  # (grad_accum: except for a load-balancing loss, module docstring)


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

    diff = [k for k, v in want.items() if k not in RESUMABLE_CHANGES and k != "precision" and k not in RUN_RECORD_KEYS
            and not same(k, saved.get(k, defaults.get(k)), v)]
    if run_precision(saved) != run_precision(want):
        diff.append("precision")
    return sorted(diff + balance_layout_changes(saved, want))


def has_global_balance_loss(d: dict) -> bool:
    """Whether the run's model (its preset and overrides, or init_from's config.json) has MoE layers with a
    load-balancing loss; True where the model cannot be read (the safe answer: the layout is then compared)."""
    over = dict(d.get("model_overrides") or {})
    try:
        if d.get("init_from"):
            from gated_attention.configuration import GatedQwen3Config

            config = GatedQwen3Config.from_pretrained(d["init_from"], **over)
        else:
            from gated_attention.presets import model_config

            config = model_config(d.get("model", TrainConfig.model), match_params=False, **over)
    except (OSError, ValueError, TypeError):
        return True
    moe = any(config.is_moe_layer(i) for i in range(config.num_hidden_layers))
    return moe and float(config.router_aux_loss_coef or 0.0) > 0


def _accum(d: dict) -> int:
    """Micro-batches per rank per step: grad_accum, or as micro_batch derives it at the recorded world size."""
    if d.get("micro_batch") and d.get("world_size"):
        try:
            return accum_for(d["batch_size"], d["world_size"], d["micro_batch"])
        except (KeyError, ValueError):
            pass
    return d.get("grad_accum", TrainConfig.grad_accum)


def balance_layout_changes(saved: dict, want: dict) -> list[str]:
    """["grad_accum"] and/or ["world_size"] where the micro-batch layout of a run with a global-batch load-balancing
    loss differs (module docstring); [] otherwise. The world size counts only where both dicts record it (the trainer
    writes it beside the settings) and a step has several micro-batches."""
    if not has_global_balance_loss(want):
        return []
    diff = ["grad_accum"] if _accum(saved) != _accum(want) else []
    worlds = saved.get("world_size"), want.get("world_size")
    if None not in worlds and worlds[0] != worlds[1] and max(_accum(saved), _accum(want)) > 1:
        diff.append("world_size")
    return diff


def setting_differences(saved: dict, want: dict) -> list[str]:
    """`changed_settings` as readable items ("steps: saved 2 vs requested 3"); [] when the runs are the same."""
    defaults = TrainConfig().to_dict()

    def show(d: dict, k: str) -> str:
        if k == "precision":  # what was asked and what it ran / would run in
            return f"{d.get('precision', 'auto')!r} ({run_precision(d)})"
        if k == "grad_accum":  # as micro_batch derived it
            return repr(_accum(d))
        return repr(d.get(k, defaults.get(k)))

    return [f"{k}: saved {show(saved, k)} vs requested {show(want, k)}" for k in changed_settings(saved, want)]


def describe_changes(saved: dict, want: dict) -> str:
    """`setting_differences` as one clause ("steps: saved 2 vs requested 3; lr: ..."), "" when none."""
    items = setting_differences(saved, want)
    if set(balance_layout_changes(saved, want)) & {i.split(":")[0] for i in items}:
        items.append("an MoE run's load-balancing loss counts experts over the micro-batches of a step so far, so "
                     "its micro-batch layout (grad_accum, and the world size with grad_accum > 1) is part of the run")
    return "; ".join(items)
