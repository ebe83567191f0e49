"""`gattn plan --recommend`: the parallel layout the plan says trains fastest, among those that fit with the memory
margin free (train/plan.py: `fits`).

The search holds the recipe (model, global batch, sequence length, precision, steps) and the machine fixed and varies
what the trainer lets a run choose for the same math:
  dist                  fsdp (HSDP with dp_replicate = R > 1: shard groups of N / R ranks, R replicas) or ddp;
  expert_parallel       E dividing the routed experts and the shard group (MoE models, under fsdp);
  accum_grads           sharded | auto, and keep_gathered false | auto (auto: only where the plan says it fits);
  activation_checkpointing  none | selective | full;
  micro_batch           every divisor of the sequences a rank takes per step (grad_accum follows: the same global
                        batch).
Each candidate is planned by `plan.plan` on the model built once (`plan.model_shapes`); the recommendation is the one
with the least planned step time, ties broken by the smaller memory total, then the fewer changes from the config
(the search meets the config's own choices first).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from .config import TrainConfig
from .plan import model_shapes, plan

CHECKPOINTING = ("none", "selective", "full")


@dataclass(frozen=True)
class Layout:
    """One candidate: the settings `--set` gives the trainer."""

    dist: str
    dp_replicate: int
    expert_parallel: int
    accum_grads: str
    keep_gathered: str
    activation_checkpointing: str
    micro_batch: int

    def sets(self) -> list[str]:
        return [f"{k}={v}" for k, v in asdict(self).items()]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(cfg: TrainConfig, gpus: int, num_experts: int) -> list[Layout]:
    """The candidates (module docstring) for `gpus` ranks; the config's own choice of each setting first."""
    per_rank = cfg.batch_size // gpus if cfg.batch_size % gpus == 0 else 0
    own = cfg.micro_batch or (per_rank // cfg.grad_accum if per_rank and per_rank % cfg.grad_accum == 0 else 0)
    micro = sorted(_divisors(per_rank), key=lambda m: m != own) if per_rank else []
    ckpt = sorted(CHECKPOINTING, key=lambda c: c != cfg.activation_checkpointing)
    out = []
    for dist in ("fsdp", "ddp") if gpus > 1 else ("fsdp",):
        replicas = [r for r in _divisors(gpus) if gpus // r >= 2] if dist == "fsdp" and gpus > 1 else [1]
        for R in sorted(replicas, key=lambda r: r != cfg.dp_replicate):
            shard = gpus // R
            eps = [e for e in _divisors(num_experts) if shard % e == 0] if dist == "fsdp" and num_experts else [1]
            for E in sorted(eps, key=lambda e: e != cfg.expert_parallel):
                for ac in ckpt:
                    for mb in micro:
                        several = per_rank // mb > 1 and dist == "fsdp"  # the auto policies need micro-batches
                        for accum in ("sharded", "auto") if several else ("sharded",):
                            for keep in ("false", "auto") if several else ("false",):
                                out.append(Layout(dist, R, E, accum, keep, ac, mb))
    return out


def recommend(cfg: TrainConfig, *, gpus: int, shapes: tuple | None = None, keep: tuple[str, ...] = (),
              **hardware) -> dict:
    """The fastest layout that fits (module docstring) as the `recommended` object of `gattn plan --json`: its
    `--set` settings, planned step time, tokens/s, MFU, days and memory; None-valued figures where nothing fits.
    `hardware`: plan's machine arguments (gpu_memory_gb, gpu_tflops, mfu, topo, precision, device). keep: Layout
    fields held at the config's own values (what the user set), the rest searched."""
    from ..util.errors import UserError

    shapes = shapes or model_shapes(cfg)
    config = shapes[0]
    best, searched, fitting = None, 0, 0
    own = _own_layout(cfg)
    for layout in layouts(cfg, gpus, config.num_experts or 0):
        if any(getattr(layout, k) != own[k] for k in keep):
            continue
        searched += 1
        candidate = replace(cfg, dp_replicate=layout.dp_replicate, expert_parallel=layout.expert_parallel,
                            accum_grads=layout.accum_grads, keep_gathered=layout.keep_gathered, micro_batch=0)
        try:
            p = plan(candidate, gpus=gpus, dist=layout.dist, activation_checkpointing=layout.activation_checkpointing,
                     micro_batch=layout.micro_batch, shapes=shapes, **hardware)
        except (UserError, ValueError):  # a layout the trainer refuses (a precision DDP cannot run, a mesh)
            continue
        if not p["fits"]:
            continue
        fitting += 1
        key = (p["comm_per_step"]["step_seconds"], p["memory_per_gpu_gb"]["total"])
        if best is None or key < best[0]:
            best = (key, layout, p)
    out = {"layouts_searched": searched, "layouts_fit": fitting}
    if best is None:
        return {**out, "set": None, "step_seconds": None, "tokens_per_s": None, "mfu": None, "days": None}
    _, layout, p = best
    s = p["settings"]
    return {**out, "set": layout.sets(), "layout": asdict(layout), "step_seconds": p["comm_per_step"]["step_seconds"],
            "tokens_per_s": p["tokens_per_s"], "mfu": p["mfu"], "days": p["days"],
            "memory_per_gpu_gb": p["memory_per_gpu_gb"]["total"], "grad_accum": s["grad_accum"],
            "grad_accumulation": s["grad_accumulation"], "keep_gathered_engaged": s["keep_gathered"],
            "compute_seconds": p["comm_per_step"]["compute_seconds"], "comm_seconds": p["comm_per_step"]["seconds"]}


def format_recommendation(rec: dict, given: dict) -> str:
    """The lines `gattn plan --recommend` adds under the plan's table."""
    if rec["set"] is None:
        return (f"  recommended     none: not one of {rec['layouts_searched']} layouts fits with the margin free "
                "(more GPUs, or a smaller model)")
    step = given["comm_per_step"]["step_seconds"]
    line = " ".join(f"--set {s}" for s in rec["set"])
    return "\n".join([
        f"  recommended     {line}",
        f"                  {rec['step_seconds']:.3g} s per step ({rec['step_seconds'] / step:.2g}x this plan's "
        f"{step:.3g} s), {rec['tokens_per_s']:,.0f} tokens/s, MFU {rec['mfu']:.1%}, {rec['days']:.3g} days, "
        f"{rec['memory_per_gpu_gb']:.1f} GB per GPU; grad_accum {rec['grad_accum']}, gradients "
        f"{rec['grad_accumulation']}, parameters {'kept' if rec['keep_gathered_engaged'] else 'not kept'} gathered "
        f"(best of {rec['layouts_fit']} fitting layouts of {rec['layouts_searched']} searched)"])


LAYOUT_FIELDS = tuple(Layout.__dataclass_fields__)


def _own_layout(cfg: TrainConfig) -> dict:
    """The config's own value of each Layout field, in the Layout's terms (keep_gathered as a string)."""
    return {**{k: getattr(cfg, k) for k in LAYOUT_FIELDS}, "keep_gathered": str(cfg.keep_gathered).lower()}


def launch_layout(cfg: TrainConfig, world: int, set_keys: tuple[str, ...] = (), device: str = "cuda",
                  gpu_memory_gb: float | None = None) -> tuple[TrainConfig, str | None]:
    """The layout a preset that takes the recommended one (train_presets.RECOMMENDED_LAYOUT) runs at this launch's
    world size: `recommend`'s fastest fitting layout, the settings the user gave (set_keys) held fixed; (cfg, the line
    saying so). One process, or no layout that fits: cfg unchanged (the trainer's fit check speaks for the latter)."""
    if world <= 1:
        return cfg, None
    keep = tuple(k for k in LAYOUT_FIELDS if k in set_keys)
    rec = recommend(cfg, gpus=world, keep=keep, device=device, gpu_memory_gb=gpu_memory_gb)
    if rec["set"] is None:
        return cfg, None
    lay = rec["layout"]
    out = replace(cfg, **{k: lay[k] for k in LAYOUT_FIELDS})
    held = f" ({', '.join(keep)} as given)" if keep else ""
    return out.validate(), (f"layout: the plan's fastest for {world} ranks{held}: "
                            + " ".join(f"{k}={lay[k]}" for k in LAYOUT_FIELDS if k not in keep)
                            + f" ({rec['step_seconds']:.3g} s per step planned, MFU {rec['mfu']:.1%}; "
                            "--set any of them to fix it)")
