"""Finished sink-lab units as stored on disk: is a folder one (`is_run_dir`), its settings without the model
(`load_run_meta`), and the model with its task and lab settings (`load_run`): what the streaming and retrofit labs
read of a `gattn lab sinks` output."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .backcopy import BackcopyTask
from ...util.io import renamed
from .sink_lab import RENAMED_KEYS, STORED, SinkLabConfig


@dataclass
class SinkRun:
    """A finished sink-lab model with everything needed to evaluate or continue it on its task."""

    model: object  # GatedQwen3ForCausalLM, eval mode, fp32
    task: BackcopyTask  # the Bigram-Backcopy settings it was trained on (task.eval_set / train_batch / masks)
    config: SinkLabConfig  # the lab settings of its unit (variants/seeds as in its own unit: [variant], seed + 1)
    variant: str
    seed: int
    result: dict  # its result.json (measurements at the end of training; "key" = the unit's settings)
    path: Path


def is_run_dir(path: str | Path) -> bool:
    """True for a sink-lab unit folder OUT/runs/<variant>/seed<k> (result.json with a sink-lab key)."""
    from gated_attention.util.errors import UserError
    from gated_attention.util.io import read_json_object

    f = Path(path) / "result.json"
    if not f.is_file():
        return False
    try:
        key = read_json_object(f, "sink-lab result").get("key") or {}
    except UserError:
        return False
    return isinstance(key, dict) and "task" in key and "variant" in key and "seed" in key


def load_run_meta(path: str | Path) -> dict:
    """{"variant", "seed", "task"} of a finished unit folder without loading its model."""
    from gated_attention.util.io import read_json_object

    key = read_json_object(Path(path) / "result.json", "sink-lab result", "point at a finished unit folder")["key"]
    return {"variant": key["variant"], "seed": key["seed"], "task": key["task"]}


def load_run(path: str | Path) -> SinkRun:
    """The model of a finished sink-lab unit folder (`OUT/runs/<variant>/seed<k>`), with its task and settings.

    The folder is also a plain HF model folder: `GatedQwen3ForCausalLM.from_pretrained(path)` loads the same model;
    this helper adds the task (BackcopyTask) and the lab config it was trained with."""
    from gated_attention.util.io import read_json_object
    from gated_attention.modeling import GatedQwen3ForCausalLM

    path = Path(path)
    if not is_run_dir(path):
        raise ValueError(f"{path} is not a finished sink-lab run (no result.json with a sink-lab key); pass "
                         f"OUT/runs/<variant>/seed<k> of a `gattn lab sinks` output")
    result = read_json_object(path / "result.json", "sink-lab result")
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} holds a result but no model (trained before the lab kept its models); re-run "
                         f"`gattn lab sinks` into a new --out to get loadable models")
    key = dict(result["key"])
    variant, seed = key.pop("variant"), key.pop("seed")
    key.pop("format", None)
    key = renamed(key, RENAMED_KEYS)  # a unit trained before a knob took the TrainConfig field's name
    cfg = SinkLabConfig().changed(**{k: v for k, v in key.items() if k in STORED}, variants=[variant], seeds=seed + 1)
    model = GatedQwen3ForCausalLM.from_pretrained(path)
    model.eval()
    return SinkRun(model=model, task=BackcopyTask(**cfg.task), config=cfg, variant=variant, seed=seed,
                   result=result, path=path)
