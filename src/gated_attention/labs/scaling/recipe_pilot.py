"""`gattn lab scaling --recipe-pilot SIZE`: would a cheap change of the training recipe make the ladder's pairs less
noisy? The confirm pairs a size needs grow with the within-arm variance of the final loss, so a recipe that halves
the seed-to-seed spread quarters the pairs.

Per candidate recipe, every arm trains at one size on pilot seeds of its own (PILOT_FROM, ...: never a tuning or a
confirm seed, so a seed that chose the recipe never counts in the comparison the recipe serves) at the protocol's LR
(the ladder's tuning sweep at that size, reused from OUT). The current recipe runs on the same seeds. A recipe is
adopted only if its pooled within-arm sd is at most ADOPT_RATIO of the current recipe's: a rule fixed in advance and
blind to Δ (no arm is compared with another; only the spread within each arm counts). Writes
OUT/recipe_pilot.json; its units live beside the ladder's in OUT/runs/ (suffix `_r-<recipe>`). Candidates are
changes of the base recipe (`current`), whatever recipe the budget has adopted. An adopted recipe becomes a budget's
`recipe` (scaling_lab.py), or any ladder's with --recipe.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from ...experiment.provenance import provenance
from ...gates import canonical_name
from ...util.io import atomic_write_json, to_strict
from . import design as D
from . import verdict as V
from .summary import tuned_losses

PILOT_FROM = 200  # the recipe pilot's seeds: apart from the tuning seeds (0, ...) and the confirm seeds (100, ...)
ADOPT_RATIO = 0.5  # adopt a recipe only if the within-arm sd at least halves (fixed before any pilot ran)


@dataclass(frozen=True)
class Recipe:
    """One candidate change of the ladder's recipe (frozen; the current recipe changes nothing)."""

    help: str
    fields: tuple[tuple[str, object], ...] = ()  # TrainConfig changes, the --set vocabulary
    warmup_frac: float | None = None  # share of the steps in warm-up (None: the budget's)
    init_fan_in: bool = False  # every weight ~ N(0, 1/sqrt(hidden)) instead of N(0, 0.02)
    batch_mult: int = 1  # batch x this, steps / this (the same tokens), LR x sqrt(this) (Adam's square-root rule)


RECIPES: dict[str, Recipe] = {
    "current": Recipe("the ladder's recipe (AdamW beta2 0.95, 5 % warm-up, init std 0.02, batch 8)"),
    "beta2-0.99": Recipe("AdamW beta2 0.99: a longer second-moment average, steadier steps",
                         fields=(("beta2", 0.99),)),
    "warmup-10": Recipe("10 % of the steps in warm-up instead of 5 %: a gentler start", warmup_frac=0.10),
    "init-fan-in": Recipe("init std 1/sqrt(hidden) (fan-in scaling) instead of 0.02", init_fan_in=True),
    "batch-x2": Recipe("batch x2 at the same tokens (half the steps), LR x sqrt(2)", batch_mult=2),
}


def recipe_changes(changes: dict, recipe: Recipe, hidden: int, warmup_min: int = 5) -> dict:
    """The ladder's TrainConfig changes (scaling_lab.recipe) under `recipe`, for a model of width `hidden`; the LR
    scale the recipe asks for is lr_scale(recipe)."""
    c = {**changes, **dict(recipe.fields)}
    if recipe.batch_mult > 1:
        steps = max(20, math.ceil(c["steps"] / recipe.batch_mult))
        c.update(batch_size=c["batch_size"] * recipe.batch_mult, steps=steps, ckpt_every=max(1, steps // 4),
                 warmup_steps=max(warmup_min, round(c["warmup_steps"] / recipe.batch_mult)))
    if recipe.warmup_frac is not None:
        c["warmup_steps"] = max(warmup_min, round(recipe.warmup_frac * c["steps"]))
    if recipe.init_fan_in:
        c["model_overrides"] = {**c["model_overrides"], "initializer_range": 1 / math.sqrt(hidden)}
    return c


def lr_scale(recipe: Recipe) -> float:
    """The factor on the swept LR: the square root of the batch multiplier."""
    return math.sqrt(recipe.batch_mult)


def judge(sd: dict[str, float | None]) -> tuple[str | None, str]:
    """The adopted recipe (the one with the smallest sd among those at most ADOPT_RATIO x the current one's) and a
    sentence saying why."""
    ref = sd.get("current")
    if not ref:
        return None, "no decision: the current recipe's within-arm sd is missing"
    ok = {n: s for n, s in sd.items() if n != "current" and s is not None and s <= ADOPT_RATIO * ref}
    if not ok:
        best = min((s, n) for n, s in sd.items() if n != "current" and s is not None)
        return None, (f"keep the current recipe: no candidate halves the within-arm sd {ref:.4f} nats (the "
                      f"smallest, {best[1]}, is {best[0] / ref:.2f}x)")
    name = min(ok, key=ok.get)
    return name, f"adopt {name}: within-arm sd {ok[name]:.4f} vs {ref:.4f} nats ({ok[name] / ref:.2f}x <= {ADOPT_RATIO})"


def run_recipe_pilot(lab, size_name: str, ctx: dict, stage, sweep, log) -> dict:
    """Run the recipe pilot at one size and write OUT/recipe_pilot.json. ctx, stage and sweep: the lab's (the
    tuning sweep supplies the protocol's LR; stage trains units under a recipe)."""
    t0 = time.perf_counter()
    base = next(v for v in lab.variants if canonical_name(v) == "none")
    seeds = tuple(range(PILOT_FROM, PILOT_FROM + lab.n_pilot()))
    clash = set(seeds) & (set(lab.tuning_seeds) | set(lab.confirm_pool()))
    if clash:
        raise ValueError(f"recipe-pilot seeds {sorted(clash)} are also tuning or confirm seeds: give --confirm-seeds "
                         f"and --tuning-seeds outside {PILOT_FROM}..{PILOT_FROM + lab.n_pilot() - 1}")
    tuning = sweep(lab, ctx, log, size_name)
    lr_for = {}
    for v in lab.variants:
        swept = v if lab.protocol == "tuned" else base
        lr_for[v] = V.lr_basin(tuned_losses(tuning, swept, size_name, lab.tuning_seeds))["best_lr"]
    rows, sd = [], {}
    for name, recipe in RECIPES.items():
        points = [(v, size_name, lr_for[v], k) for k in seeds for v in lab.variants]
        res = stage(points, lab, ctx, log, recipe=name)
        per_arm = {v: [res[(v, size_name, lr_for[v], k)]["val_loss"] for k in seeds] for v in lab.variants}
        pooled, df = D.pooled_within_sd(per_arm)
        finite = [x for vals in per_arm.values() for x in vals if math.isfinite(x)]
        sd[name] = pooled
        rows.append({"name": name, "help": recipe.help, "within_sd": pooled, "df": df,
                     "per_arm_sd": {v: (statistics.stdev(x) if len(x) > 1 else None) for v, x in per_arm.items()},
                     "mean_loss_all_arms": statistics.fmean(finite) if finite else None,
                     "failures": sum(not math.isfinite(x) for vals in per_arm.values() for x in vals),
                     "cpu_s": sum(r.get("cpu_s") or 0 for r in res.values()),
                     "per_seed": per_arm})
    for r in rows:
        r["ratio_to_current"] = r["within_sd"] / sd["current"] if r["within_sd"] and sd["current"] else None
    adopted, decision = judge(sd)
    out = {"size": size_name, "protocol": lab.protocol, "lr": lr_for, "seeds": list(seeds),
           "tuning_seeds": list(lab.tuning_seeds), "adopt_ratio": ADOPT_RATIO,
           "rule": (f"adopt a recipe only if its pooled within-arm sd of the final validation loss is at most "
                    f"{ADOPT_RATIO} x the current recipe's on the same seeds (blind to Δ: arms are never compared)"),
           "recipes": rows, "adopted": adopted, "decision": decision,
           "cpu_s": sum(r["cpu_s"] for r in rows), "wall_time_s": time.perf_counter() - t0,
           "provenance": provenance()}
    atomic_write_json(Path(ctx["out"]) / "recipe_pilot.json", to_strict(out), indent=1)
    return out


def text_table(res: dict) -> str:
    """The pilot as the CLI prints it."""
    lines = [f"recipe pilot at {res['size']} ({len(res['seeds'])} seeds per arm, seeds {res['seeds'][0]}-"
             f"{res['seeds'][-1]}, protocol {res['protocol']}):",
             f"  {'recipe':<12} {'within-arm sd':>13} {'x current':>9} {'mean loss':>9}"]
    for r in res["recipes"]:
        sd = f"{r['within_sd']:.4f}" if r["within_sd"] is not None else "n/a"
        ratio = f"{r['ratio_to_current']:.2f}" if r["ratio_to_current"] is not None else "n/a"
        mean = f"{r['mean_loss_all_arms']:.4f}" if r["mean_loss_all_arms"] is not None else "n/a"
        lines.append(f"  {r['name']:<12} {sd:>13} {ratio:>9} {mean:>9}")
    return "\n".join(lines + [res["decision"]])
