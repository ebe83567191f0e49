"""The models `gattn lab quant` measures, and the data each is measured on.

`resolve_models(paths, data_dir)` turns the --models folders into `QuantModel`s, each with the three things the
verdict groups by, read from the model and its run files, never from a folder name alone:

  variant  the gate of its config.json (gated_attention.gates' canonical name; "none" for an ungated model)
  arm      what its seeds are replicates of: the variant (a sink-lab unit: its unit variant, e.g. `sink_logits`;
           a retrofit-lab unit: its recipe, e.g. `bos-penalty`, the ungated `control` being that lab's baseline)
  family   the models compared with each other: the same kind of data and shape (text: width, depth, heads and corpus;
           sink lab: the task; retrofit: its own family per start kind); within a family each gated arm is
           compared with the baseline arm (different models: not paired); `seed` names a model within its arm (the
           policy comparison pairs a model quantized one way with itself quantized another)

Accepted folders (the streaming lab's list, plus the scaling and retrofit labs' outputs):
  a sink-lab unit OUT/runs/<variant>/seed<k>, or a whole sink-lab OUT (every unit)
  a retrofit-lab unit OUT/runs/<start>/<recipe>/seed<k> (its model/), or a whole retrofit-lab OUT
  a scaling-lab OUT (its lab.json: every unit at its variant's best LR)
  a `gattn compare` OUT (every runs/<run>/final), a trainer run folder (final/), or any folder with config.json
Text models read their corpus and window length from the run's train_config.json (--data-dir for a folder that
names none). Data: the corpus's validation windows (BOS first) per domain; the sink task's held-out sequences;
calibration (awq-int4): training windows from a seed no training run uses.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from ...experiment.runs import unique_labels

CALIBRATION_SEED = 104_729  # a data stream no training run here uses (they use seeds 0..n)


@dataclass
class QuantModel:
    """One model to quantize (JSON-ready)."""

    label: str  # unique name in the lab (lab.json rows' `model`)
    path: str  # the HF folder from_pretrained reads
    kind: str  # "text" | "sink_lab"
    variant: str  # canonical gate of config.json ("none" = ungated)
    arm: str  # what its seeds replicate (module docstring)
    family: str  # the models it is compared with
    seed: str  # the model within its arm (family, arm, seed): one trained model
    baseline: bool  # the arm every gated arm of the family is measured against
    data_dir: str | None = None  # text: the corpus
    seq_len: int | None = None  # text: window length
    task: dict | None = None  # sink_lab: BackcopyTask fields

    def to_dict(self) -> dict:
        return asdict(self)


def _config(folder: Path) -> dict:
    from gated_attention.util.io import read_json_object

    return read_json_object(folder / "config.json", "model config", "point --models at a model folder")


def _gate(conf: dict) -> str:
    from gated_attention.gates import canonical_name

    if conf.get("model_type") != "gated_qwen3":
        return "none"
    return canonical_name(conf.get("gate") or "none")


def _ungated(conf: dict) -> bool:
    return _gate(conf) == "none" and conf.get("mechanism") in (None, "none")


def _digest(task: dict) -> str:
    """A short name of a task's settings (every field): two families never share one by accident."""
    import hashlib

    return hashlib.sha256(json.dumps(task, sort_keys=True).encode()).hexdigest()[:8]


def _shape(conf: dict) -> str:
    return f"d{conf.get('hidden_size')}l{conf.get('num_hidden_layers')}h{conf.get('num_attention_heads')}"


def _sink_unit(unit: Path) -> QuantModel:
    from ..sinks import stored

    meta = stored.load_run_meta(unit)
    if not (unit / "config.json").is_file():
        raise ValueError(f"--models {unit}: this sink-lab unit kept no model; re-run `gattn lab sinks` into a new "
                         "--out")
    conf = _config(unit)
    task = dict(meta["task"])
    return QuantModel(label=f"{meta['variant']}/seed{meta['seed']}", path=str(unit), kind="sink_lab",
                      variant=_gate(conf), arm=meta["variant"], seed=str(meta["seed"]),
                      family=f"sink lab {_shape(conf)} T{task.get('seq_len')} task {_digest(task)}",
                      baseline=_ungated(conf), task=task)


def _is_retrofit_unit(unit: Path) -> bool:
    f = unit / "result.json"
    if not (f.is_file() and (unit / "model" / "config.json").is_file()):
        return False
    try:
        key = json.loads(f.read_text(encoding="utf-8")).get("key") or {}
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    return isinstance(key, dict) and "recipe" in key and isinstance(key.get("start"), dict)


def _retrofit_unit(unit: Path) -> QuantModel:
    from ..retrofit.recipes import CONTROL

    key = json.loads((unit / "result.json").read_text(encoding="utf-8"))["key"]
    start, recipe = key["start"], key["recipe"]
    conf = _config(unit / "model")
    sink = start.get("kind") == "sink"
    return QuantModel(label=f"{start['label']}/{recipe}/seed{key['seed']}", path=str(unit / "model"),
                      kind="sink_lab" if sink else "text", variant=_gate(conf), arm=recipe,
                      seed=f"{start['label']}/s{key['seed']}", baseline=recipe == CONTROL,
                      family=f"retrofit {'sink lab' if sink else 'text'} {_shape(conf)}",
                      task=start.get("task") if sink else None, data_dir=None if sink else start.get("data_dir"),
                      seq_len=None if sink else start.get("seq_len"))


def _text(model_dir: Path, label: str, data_dir: str | None) -> QuantModel:
    from gated_attention.util.io import read_json_object

    conf = _config(model_dir)
    tc_file = next((p for p in (model_dir / "train_config.json", model_dir.parent / "train_config.json")
                    if p.is_file()), None)
    tc = read_json_object(tc_file, "train config") if tc_file else {}
    corpus = data_dir or tc.get("data_dir")
    if not corpus:
        raise ValueError(f"--models {model_dir}: no train_config.json names its corpus; pass --data-dir (a corpus "
                         f"prepared in the model's vocabulary)")
    from gated_attention.data import Corpus
    from gated_attention.data.tokenizer import check_vocab_fits
    from gated_attention.util.io import check_hf_dir

    check_hf_dir(model_dir, "--models folder")  # weights present and intact, before any model is measured
    if conf.get("vocab_size"):
        check_vocab_fits(Corpus(corpus).vocab_size, int(conf["vocab_size"]), f"the corpus {corpus}", str(model_dir))
    v = _gate(conf)
    return QuantModel(label=label, path=str(model_dir), kind="text", variant=v,
                      arm=v if conf.get("mechanism") in (None, "none") else conf["mechanism"],
                      seed=str(tc.get("seed", 0)), baseline=_ungated(conf),
                      family=f"text {_shape(conf)} {Path(corpus).name}", data_dir=str(corpus),
                      seq_len=tc.get("seq_len") or conf.get("max_position_embeddings"))


def _scaling_units(p: Path) -> list[Path] | None:
    """The best-LR units of a scaling-lab OUT (its lab.json), or None when p is not one."""
    f = p / "lab.json"
    if not f.is_file():
        return None
    try:
        lab = json.loads(f.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    if not isinstance(lab, dict) or "best_lr" not in lab or "runs" not in lab:
        return None
    best = lab["best_lr"]
    return [p / r["model_dir"] for r in lab["runs"] if best.get(r["variant"], {}).get(r["size"]) == r["lr"]]


def _folder(p: Path, data_dir: str | None) -> list[QuantModel]:
    from ..sinks import stored

    if stored.is_run_dir(p):
        return [_sink_unit(p)]
    if _is_retrofit_unit(p):
        return [_retrofit_unit(p)]
    units = sorted(u for u in p.glob("runs/*/seed*") if stored.is_run_dir(u))
    if units:
        return [_sink_unit(u) for u in units]
    units = sorted(u for u in p.glob("runs/*/*/seed*") if _is_retrofit_unit(u))
    if units:
        return [_retrofit_unit(u) for u in units]
    scaling = _scaling_units(p)
    if scaling:
        return [_text(d, d.parent.name, data_dir) for d in scaling]
    finals = sorted(d for d in p.glob("runs/*/final") if (d / "config.json").is_file())
    if finals:  # a compare OUT
        return [_text(d, d.parent.name, data_dir) for d in finals]
    if (p / "final" / "config.json").is_file():  # a trainer run folder
        return [_text(p / "final", p.name, data_dir)]
    if (p / "config.json").is_file():
        return [_text(p, p.parent.name if p.name == "final" else p.name, data_dir)]
    raise ValueError(f"--models {p}: holds no model (give a sink-lab or retrofit-lab unit or OUT, a scaling-lab or "
                     f"compare OUT, a trainer run folder with final/, or a model folder with config.json)")


def resolve_models(paths: list, data_dir: str | None = None) -> list[QuantModel]:
    """Every model the --models folders hold (module docstring), with unique labels."""
    out: list[QuantModel] = []
    for raw in paths:
        p = Path(raw)
        if not p.is_dir():
            raise ValueError(f"--models {p}: not a folder")
        out += _folder(p, data_dir)
    unique_labels(out, lambda m: Path(m.path).parent.parent.name)
    seen: dict[tuple, QuantModel] = {}
    for m in out:
        other = seen.setdefault((m.family, m.arm, m.seed), m)
        if other is not m:
            raise ValueError(f"--models: {other.path} and {m.path} are both {m.arm} seed {m.seed} of the family "
                             f"{m.family!r}, so a seed no longer names one model; measure them in separate labs (--out)")
    return out


# ---------------------------------------------------------------- data

def text_eval(data_dir: str, seq_len: int, windows: int, batch_size: int = 32) -> dict:
    """{domain: [batches (b, seq_len + 1)]}: the first `windows` validation windows of every domain, BOS first."""
    from gated_attention import data

    corpus = data.Corpus(data_dir)
    nb = -(-windows // batch_size)
    out = {}
    for d in corpus.domains:
        bs = list(data.eval_batches(corpus, d, seq_len, nb, batch_size))
        rows = sum(len(b) for b in bs)
        if rows > windows:
            bs[-1] = bs[-1][: len(bs[-1]) - (rows - windows)]
        if bs:
            out[d] = bs
    if not out:
        raise ValueError(f"{data_dir}: no validation window of {seq_len} tokens in any domain")
    return out


def text_calibration(data_dir: str, seq_len: int, windows: int, batch_size: int = 16) -> list:
    """Training windows for awq-int4's calibration pass (CALIBRATION_SEED's stream; BOS first)."""
    from gated_attention import data

    corpus = data.Corpus(data_dir)
    n = -(-windows // batch_size)
    return [data.sample_batch(corpus, "train", batch_size, seq_len, CALIBRATION_SEED, k)[:, :-1] for k in range(n)]


def task_eval(task: dict, sequences: int):
    """Held-out Bigram-Backcopy sequences (sequences, T + 1) of a sink-lab model's task."""
    from ..sinks.backcopy import BackcopyTask

    return BackcopyTask(**task).eval_set(sequences)


def task_calibration(task: dict, sequences: int, batch_size: int = 16) -> list:
    from ..sinks.backcopy import BackcopyTask

    t = BackcopyTask(**task)
    n = -(-sequences // batch_size)
    return [t.train_batch(batch_size, CALIBRATION_SEED, k)[:, :-1] for k in range(n)]
