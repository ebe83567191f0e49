"""`gattn lab sinks`: attention sinks on the Bigram-Backcopy task, baseline vs gates, measured over seeds.

Each variant (a gate name from `gattn gates`, or a runtime baseline mechanism such as `sink_logits`) is this project's
LM (`GatedQwen3ForCausalLM` from `presets.model_config` with small-shape overrides: 1-3 layers, default 1 layer,
1 head, d=128) trained on the task (backcopy.py) with the project's optimizer conventions (AdamW, weight decay on
matrices only via the trainer's `param_groups`, warm-up + cosine/WSD from `train.schedule`, global-norm clipping,
the resolved precision: gated_attention.util.precision), trained by the one training loop, `train.trainer.train` via
`experiment.train_or_reuse`: the task is the trainer's data source, the learning curve and the time-to-skill rule its
step hook, and the per-step backcopy CE an extra-loss plug-in that adds nothing (train/plugins.py). Every variant and
seed sees the same batches (a batch is a function of the seed and the step) and starts from the same seed.

Measurements (measure(); capture.py's Recorder with eager probabilities, on a fixed held-out set), per layer and head:
attention on BOS from dormant and from active (trigger) queries, attention on the previous token from trigger
queries, value drain ||v_BOS|| / mean ||v_other||, residual peak ||h_BOS|| / median ||h_other|| per layer, CE on
backcopy and bigram positions next to the chain's entropy floor, gate score on dormant vs active queries, and the
step at which backcopy CE first falls below 0.5. Headline numbers (lab.json's per-seed scalars) are those of the
*backcopy head*: the (layer, head) with the largest attention on the previous token from trigger queries (in the
default 1-layer 1-head model, the only head); the residual peak is the largest over layers.

The command is `gattn lab sinks` (study.py). Layout of OUT: runs/<variant>/seed<k>/ holds result.json (the
unit's settings under "key", its measurements) and the finished model as a Hugging Face folder (config.json,
model.safetensors, generation_config.json: `GatedQwen3ForCausalLM.from_pretrained(run_dir)` loads it; `load_run(run_dir)`
returns it with its task and lab settings), + the trainer's run files (train_config.json, log.jsonl, summary.json; checkpoints/ and final/ while running); then lab.json, report.md, report.html, plots/.
Finished units are reused; a killed run continues from its last checkpoint; settings that differ from an existing
OUT fail loudly.
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from .backcopy import BackcopyTask
from ...experiment import cache
from ...util.io import locks_output
from ...experiment.study import Budget, Recorder, Units, finish_unit, save_lab, stored_settings, with_stored
from ...experiment.study import with_changes as changes_over
from ...experiment.stats import mean_std
from ...gates import DEFAULT_VARIANTS

METRICS = ("bos_attention_dormant", "bos_attention_active", "prev_attention_active", "value_drain_ratio",
           "residual_peak_ratio", "backcopy_ce", "bigram_ce", "bigram_ce_floor", "gate_dormant", "gate_active",
           "steps_to_skill")
EXTRA_METRICS = ("null_attention_dormant", "final_train_loss", "wall_time_s", "cpu_time_s", "params")
SKILL_CE = 0.5  # "time to skill": backcopy CE below this (ln 2 ~ 0.69 would still be a coin flip between 2 tokens)
MAP_LEN = 40  # tokens of the attention map kept per model (sequence 0 of the held-out set)
SKILL_WINDOW = 50  # steps in the trailing mean of the training batches' backcopy CE (one batch holds ~300 triggers)


def _base_train():
    """How every unit trains, besides what a budget or an option changes: the project's optimizer conventions
    (AdamW, weight decay on matrices only, warm-up + cosine/WSD, global-norm clipping), the task as the data (a
    plug-in source), the lab's measurements in place of the trainer's eval and probes."""
    from gated_attention.train.config import TrainConfig

    return TrainConfig(
        data="custom", device="cpu", wd_on_embeddings=False, beta1=0.9, eval_every=0, stats_every=0,
        max_bad_steps=1, keep_checkpoints=1, progress=False, tensorboard=False, precision="auto",
        steps=800,  # at lr 1e-2 the gated models solve the backcopy in ~100 steps, the baseline in ~150-200
        batch_size=32,
        lr=1e-2,  # 3e-3 forms a stronger sink only after ~5000 steps, without solving the task (results/sink_lab.md)
        min_lr=1e-3, warmup_steps=50,
        schedule="wsd",  # the sink grows while the LR is high; a cosine decay over 800 steps stalls it (baseline 0.13
        # at step 600 vs 0.40-0.62 with the LR held near the peak); WSD decays over the last wsd_decay_frac
        wsd_decay_frac=0.2,
        weight_decay=0.0,  # decay shrinks the QK scale (the BOS logit gap) and the copy circuit (the cost of not
        # sinking): 1.0 -> BOS 0.05, 0 -> 0.91
        beta2=0.95, eps=1e-8, grad_clip=1.0,
        compile="true",  # ~2x faster steps after ~10 s of compiling
        ckpt_every=1000)


# model-config fields of a unit's shape over the `small` preset (num_key_value_heads = heads, head_dim = d / heads)
BASE_MODEL = {
    "num_hidden_layers": 1,  # 1-3: the task needs one head; more layers show where the sink moves
    "num_attention_heads": 1,
    "hidden_size": 128,
    "intermediate_size": 64,  # FFN width (gated variants shrink it to keep the parameter count); the bigram part needs
    # no FFN (untied embeddings hold it), and a wide one (256) let one baseline seed in three drift off the sink
    # (0.46-0.64, the FFN can clean up a spread head's output instead); 64 sinks in every seed
    "gate_init": "normal",  # normal (gate ~0.5 at start, the official init) | identity (gate == 1 at start)
    "use_qk_norm": False,  # Guo et al.'s model has none. With it the logit gap is bounded by the norm gains and the
    # backcopy is learned worse at lr 1e-2 (CE 0.19 vs 0.002 at T=64)
}


@dataclass
class SinkLabConfig:
    """A sink lab: its own axes here; how each unit trains is `train` (a TrainConfig) and its shape `model`
    (model-config fields). Its stored form (units' keys, lab.json's "config", the options) is `settings()`."""

    variants: list = field(default_factory=lambda: list(DEFAULT_VARIANTS))
    # BackcopyTask fields; T=64: a dormant query late in a long sequence can spread over many keys almost for free (the
    # copied values average out), so the full BOS sink pays only where few keys precede it: at T=128 the baseline's
    # sink reached 0.15-0.5 in 800-1600 steps, at T=64 0.9-1.0 (results/sink_lab.md)
    task: dict = field(default_factory=lambda: BackcopyTask(seq_len=64).to_dict())
    seeds: int = 3  # seeds 0..n-1: model init and data order, identical across variants
    curve_every: int = 100  # learning-curve resolution in steps
    eval_size: int = 64  # held-out sequences for every measurement
    model: dict = field(default_factory=lambda: dict(BASE_MODEL))
    train: object = field(default_factory=_base_train)  # TrainConfig; gate, seed and seq_len are set per unit

    def validate(self) -> "SinkLabConfig":
        from gated_attention.util.errors import UserError

        BackcopyTask(**self.task)  # raises on a bad task
        layers, heads, d = (self.model[k] for k in ("num_hidden_layers", "num_attention_heads", "hidden_size"))
        if not 1 <= layers <= 3:
            raise ValueError(f"--layers must be 1, 2 or 3 (the task needs one head); got {layers}")
        if heads < 1 or d % heads:
            raise ValueError(f"--heads must divide the hidden size {d}; got {heads}")
        for name in ("seeds", "eval_every", "eval_size"):
            if self.settings()[name] < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1; got {self.settings()[name]}")
        for v in self.variants:
            resolve_variant(v)
        if len(set(self.variants)) != len(self.variants):
            raise ValueError(f"--variants lists a variant twice: {self.variants}")
        try:
            unit_train_config(self, self.variants[0], 0, self.train.precision)
        except UserError as e:  # named by the option that sets it
            flag = next((f for s, f in FLAGS.items() if f"{s}=" in str(e)), None)
            raise UserError(f"{e}{f' (option {flag})' if flag else ''}") from None
        model_config_for(self, self.variants[0])  # gate/init/shape incompatibilities fail before any training
        return self

    def settings(self) -> dict:
        """The stored form: every setting under its stored name (STORED), as units' keys and lab.json hold them."""
        out = stored_settings(self, STORED)
        out["compile"] = out["compile"] == "true"
        return out

    def changed(self, **stored) -> "SinkLabConfig":
        """A copy with settings changed by their stored names (the options' names: steps=, layers=, eval_every=, ...);
        not validated."""
        return with_stored(self, {k: ("true" if v else "false") if k == "compile" else v for k, v in stored.items()},
                           STORED, "sink-lab")


# stored name (options, units' result.json keys, lab.json "config") -> the setting: a lab axis, a model-config field
# ("model.NAME") or a TrainConfig field (its own name); compile is stored as a bool. The one translation table.
STORED = {"variants": "variants", "task": "task", "layers": "model.num_hidden_layers",
          "heads": "model.num_attention_heads", "hidden_size": "model.hidden_size",
          "intermediate_size": "model.intermediate_size", "gate_init": "model.gate_init", "seeds": "seeds",
          "steps": "steps", "batch_size": "batch_size", "lr": "lr", "min_lr": "min_lr",
          "warmup_steps": "warmup_steps", "schedule": "schedule", "wsd_decay_frac": "wsd_decay_frac",
          "weight_decay": "weight_decay", "beta2": "beta2", "eps": "eps", "qk_norm": "model.use_qk_norm",
          "grad_clip": "grad_clip", "precision": "precision", "compile": "compile", "eval_every": "curve_every",
          "eval_size": "eval_size", "ckpt_every": "ckpt_every"}
# a TrainConfig field -> the option that sets it, where the two names differ
FLAGS = {"wsd_decay_frac": "--decay-frac", "eps": "--adam-eps"}
# stored names of older units (result.json keys, lab.json) -> today's stored names
RENAMED_KEYS = {"decay_frac": "wsd_decay_frac", "adam_eps": "eps"}


def with_changes(cfg: SinkLabConfig, changes: dict) -> SinkLabConfig:
    """A copy of cfg with `changes` (experiment.study.with_changes: lab axes, model.NAME, TrainConfig fields)."""
    return changes_over(cfg, changes, "sink-lab")


BUDGETS: dict[str, Budget] = {
    "small": Budget("CI smoke run: V=16, T=32, d=32, 60 steps, 2 seeds (seconds)", {
        "task": BackcopyTask(vocab=16, triggers=2, seq_len=32).to_dict(), "model.hidden_size": 32,
        "model.intermediate_size": 64, "seeds": 2, "steps": 60, "batch_size": 8, "warmup_steps": 5, "curve_every": 20,
        "eval_size": 8, "ckpt_every": 30, "compile": "false"}),
    "default": Budget(
        "V=64, k=3, T=64, 1 layer x 1 head, d=128, FFN 64, QK-norm off, no weight decay, 800 steps of 32 sequences "
        "at lr 1e-2 (WSD: held, then decayed to 1e-3 over the last 20 %%), 3 seeds, compiled: the baseline forms the "
        "full BOS sink in every seed; about 30 s of CPU per model (bf16)"),
}


def budget_config(name: str, **changes) -> SinkLabConfig:
    """The SinkLabConfig of budget `name` with `changes` (by their stored names: SinkLabConfig.changed) on top: a
    copy, so changing it leaves the budget alone. Not validated (the lab validates what it runs)."""
    if name not in BUDGETS:
        raise ValueError(f"unknown sink-lab budget {name!r}; valid: {', '.join(BUDGETS)}")
    return with_changes(SinkLabConfig(), BUDGETS[name].changes).changed(**changes)


# ---------------------------------------------------------------- variants and models

def resolve_variant(name: str) -> tuple[str, str]:
    """(gate, baseline) of a variant name: a gate from `gattn gates` (ungated = `baseline`), or a runtime baseline
    mechanism (sink_logits, bondarenko_gate, clipped_softmax, forgetting, ...) on the ungated model."""
    from gated_attention.mechanisms import get_mechanism
    from gated_attention.gates import GATES, canonical_name

    try:
        gate = canonical_name(name)
        if gate in GATES:
            return gate, "none"  # (gate, mechanism)
    except (ValueError, KeyError):
        pass
    try:
        spec = get_mechanism(name)
    except ValueError:
        spec = None
    if spec is None or not spec.runtime:
        from gated_attention.mechanisms import MECHANISMS

        runtime = [n for n, s in MECHANISMS.items() if s.runtime]
        raise ValueError(f"unknown variant {name!r}; valid: a gate ({', '.join(GATES)}) or a baseline mechanism "
                         f"({', '.join(runtime)}); see `gattn gates`")
    return "none", name


def model_config_for(cfg: SinkLabConfig, variant: str):
    from gated_attention.presets import model_config

    gate, baseline = resolve_variant(variant)
    task = BackcopyTask(**cfg.task)
    m = cfg.model
    return model_config("small", gate=gate, mechanism=baseline, vocab_size=task.model_vocab, **m,
                        num_key_value_heads=m["num_attention_heads"],
                        head_dim=m["hidden_size"] // m["num_attention_heads"],
                        max_position_embeddings=max(512, task.seq_len + 1), tie_word_embeddings=False, bos_token_id=0)


# ---------------------------------------------------------------- measurement

def _headline(per_layer: list[dict]) -> tuple[int, int]:
    """(layer, head) of the backcopy head: the largest attention on the previous token from trigger queries."""
    best, where = -1.0, (0, 0)
    for e in per_layer:
        for h, v in enumerate(e["prev_attention_active"]):
            if v is not None and v > best:
                best, where = v, (e["layer"], h)
    return where


def measure(model, task: BackcopyTask, seqs) -> dict:
    """Every lab metric of `model` on held-out sequences seqs (B, T+1): headline scalars + per-layer lists."""
    import torch

    from gated_attention.mechanisms import HeadSliceGate
    from gated_attention.capture import Recorder, capture

    from . import metrics as M

    inputs, targets = seqs[:, :-1], seqs[:, 1:]
    masks = task.masks(inputs)
    act, dor = masks["active"], masks["dormant"]
    rec = Recorder(names={"attn_probs", "v", "gate", "ffn_residual"}, wants_probs=True)
    layer_in, hooks = {}, []
    for i, layer in enumerate(model.model.layers):  # Bondarenko's gate is not a registry gate: read its input
        if isinstance(layer.self_attn.mechanism, HeadSliceGate):
            hooks.append(layer.self_attn.register_forward_pre_hook(
                lambda _m, args, i=i: layer_in.__setitem__(i, args[0].detach())))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), capture(model, rec):
            logits = model(input_ids=inputs).logits  # (B, T, V+1), fp32: measurements are not autocast
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)
    per_layer = []
    H = model.config.num_attention_heads
    for i in range(model.config.num_hidden_layers):
        probs = rec.get(i, "attn_probs").float()  # (B, H, T, S)
        gate = rec.get(i, "gate")
        if i in layer_in:
            gate = model.model.layers[i].self_attn.mechanism.score(layer_in[i]).unsqueeze(-1)  # (B, T, H, 1)
        elif gate is not None and gate.dim() == 3:
            gate = gate.unsqueeze(-2)  # G5 after o_proj: (B, T, 1, d), one "head"
        dormant_rows = probs.sum(-1)  # (B, H, T): < 1 where probability went to no key (learned sink, clipping)
        null = (1.0 - dormant_rows) * dor[:, None, :]
        per_layer.append({
            "layer": i,
            "bos_attention_dormant": M.key_attention(probs, dor),
            "bos_attention_active": M.key_attention(probs, act),
            "prev_attention_active": M.prev_token_attention(probs, act),
            "null_attention_dormant": [float(x) for x in null.sum(dim=(0, 2)) / max(int(dor.sum()), 1)],
            "value_drain_ratio": M.value_drain_ratio(rec.get(i, "v")),
            "residual_peak_ratio": M.residual_peak_ratio(rec.get(i, "ffn_residual")),
            "gate_dormant": M.gate_by_query(gate, dor) if gate is not None else None,
            "gate_active": M.gate_by_query(gate, act) if gate is not None else None,
        })
    layer, head = _headline(per_layer)
    e = per_layer[layer]

    def at_head(vals):
        if vals is None:
            return None
        if len(vals) == H:
            return vals[head]
        if len(vals) == 1:  # one score for the whole layer (G5 after o_proj)
            return vals[0]
        return vals[head * len(vals) // H]  # per KV head: query head h reads KV head h // (H / KV)

    n = min(MAP_LEN, inputs.shape[1])
    probs = rec.get(layer, "attn_probs")[0, head, :n, :n].float()  # (n, n): sequence 0, the backcopy head
    return {
        "bos_attention_dormant": at_head(e["bos_attention_dormant"]),
        "bos_attention_active": at_head(e["bos_attention_active"]),
        "prev_attention_active": at_head(e["prev_attention_active"]),
        "null_attention_dormant": at_head(e["null_attention_dormant"]),
        "value_drain_ratio": at_head(e["value_drain_ratio"]),
        "residual_peak_ratio": max(x["residual_peak_ratio"] for x in per_layer),
        "backcopy_ce": M.masked_ce(logits, targets, act),
        "bigram_ce": M.masked_ce(logits, targets, dor),
        "bigram_ce_floor": task.bigram_floor(inputs, dor),
        "gate_dormant": at_head(e["gate_dormant"]),
        "gate_active": at_head(e["gate_active"]),
        "backcopy_head": [layer, head],
        "per_layer": per_layer,
        "attention_map": [[round(float(x), 4) for x in row] for row in probs],
        "map_active_rows": [int(t) for t in act[0, :n].nonzero().flatten()],
    }


# ---------------------------------------------------------------- one unit: a variant x seed

def _unit_key(cfg: SinkLabConfig, variant: str, seed: int) -> dict:
    from gated_attention.util.precision import RESOLVED, resolve

    d = cfg.settings()
    for k in ("variants", "seeds", "ckpt_every"):  # the unit does not depend on these
        d.pop(k)
    # a model trained in bf16 is not the fp32 one: the key holds what the precision resolved to on this machine (so
    # "auto" that ran in bf16 reuses a unit trained with "bf16", and never one trained in fp32). The lab's units get
    # a config whose precision the lab decided already (unit_jobs); "auto" here is a unit trained on its own
    p = cfg.train.precision
    d["precision"] = p if p in RESOLVED else resolve(p, "cpu")
    return {**d, "variant": variant, "seed": seed, "format": 1}


def _stored_unit(unit_dir: str | Path, cfg: SinkLabConfig, variant: str, seed: int) -> dict | None:
    """The unit's result.json when it was made with these settings (cache.load: None if absent, StaleResult if made
    with others). A knob added to the lab after a unit was trained counts as its default for that unit."""
    key = _unit_key(cfg, variant, seed)
    return cache.load(Path(unit_dir) / "result.json", key, defaults=_unit_defaults(key), renames=RENAMED_KEYS)


def _unit_defaults(key: dict) -> dict:
    """The key a unit would have with every knob at its default (what a knob added later counts as), in the
    precision of `key` (already decided: no second decision)."""
    return _unit_key(SinkLabConfig().changed(precision=key["precision"]), key["variant"], key["seed"])


class _BackcopySource:
    """The trainer's data source for a unit (train/plugins.py): the task's batches, a pure function of (seed, step);
    no held-out domains (the lab measures on its own eval set)."""

    domains: list = []

    def __init__(self, task: BackcopyTask):
        self.task, self.vocab_size = task, task.model_vocab

    def train_batch(self, batch_size: int, seq_len: int, seed: int, step: int, rows: slice | None = None):
        seqs = self.task.train_batch(batch_size, seed, step)  # (B, T+1)
        return seqs if rows is None else seqs[rows]

    def eval_batches(self, domain: str, seq_len: int, max_batches: int, batch_size: int):
        return iter(())


class _BatchCE:
    """The trainer's observe plug-in (train/plugins.py): each training batch's backcopy CE (the time-to-skill rule)
    and next-token CE, into the recorder. It reads the logits at the backcopy positions, so the run keeps full logits
    (needs_logits: the chunked fused loss is off, as it always was for the lab's units)."""

    needs_logits = True

    def __init__(self, rec: "_UnitRecorder"):
        self.rec = rec

    def __call__(self, step, fwd) -> dict:
        import torch.nn.functional as F

        import torch

        active = self.rec.task.masks(fwd.inputs)["active"]  # (B, T)
        with torch.no_grad():
            tok = F.cross_entropy(fwd.output.logits.detach().float().transpose(1, 2), fwd.targets,
                                  reduction="none")  # (B, T)
        bc = float(tok[active].mean()) if bool(active.any()) else math.nan
        self.rec.observe(float(fwd.ce), bc)
        return {"backcopy_ce": bc}


class _UnitRecorder(Recorder):
    """The unit's step hook (experiment.study.Recorder): the learning curve (measure() every eval_every steps, from
    step 0), the trailing training CEs and the time-to-skill step, CPU and wall time."""

    def __init__(self, cfg: SinkLabConfig, variant: str, seed: int, task: BackcopyTask):
        super().__init__(cfg.curve_every, cfg.train.steps, bc=[], losses=[], skill=None)
        self.cfg, self.variant, self.seed, self.task = cfg, variant, seed, task
        self.eval_seqs = task.eval_set(cfg.eval_size)
        self.batch_ce = _BatchCE(self)

    def observe(self, loss: float, bc: float) -> None:
        self.trail("losses", loss, SKILL_WINDOW)
        self.trail("bc", bc, SKILL_WINDOW)

    def point(self, step: int, model) -> dict:
        m = measure(model, self.task, self.eval_seqs)
        losses = self.state["losses"]
        _log(f"{self.variant} seed {self.seed}: step {step}/{self.steps}  backcopy CE {_f(m['backcopy_ce'])}  "
             f"bigram CE {_f(m['bigram_ce'])} (floor {_f(m['bigram_ce_floor'])})  BOS attn dormant "
             f"{_f(m['bos_attention_dormant'])}  gate dormant/active {_f(m['gate_dormant'])}/"
             f"{_f(m['gate_active'])}  ({self.wall_s():.0f}s)")
        return {"step": step, **{k: m[k] for k in METRICS if k in m},
                "null_attention_dormant": m["null_attention_dormant"],
                "train_loss": sum(losses) / len(losses) if losses else None}

    def after_step(self, steps_done: int, model) -> None:
        from .metrics import trailing_mean

        st = self.state  # a non-finite step never gets here: the unit's max_bad_steps=1 stops the run first
        if st["skill"] is None and len(st["bc"]) == SKILL_WINDOW and \
                trailing_mean(st["bc"], SKILL_WINDOW)[-1] < SKILL_CE:
            st["skill"] = steps_done - 1


def unit_train_config(cfg: SinkLabConfig, variant: str, seed: int, precision: str):
    """The trainer settings of one unit: the lab's `train` with the variant's gate, the seed, the task's length and
    the precision the lab decided."""
    gate, _ = resolve_variant(variant)
    return replace(cfg.train, gate=gate, seed=seed, seq_len=BackcopyTask(**cfg.task).seq_len,
                   precision=precision).validate()


def train_unit(job: tuple) -> dict:
    """Train one variant x seed (or reuse / resume it) and return its result dict. job = (cfg dict, variant, seed,
    unit dir); a plain tuple so it can cross to a worker process. The unit is a trainer run folder
    (experiment.train_or_reuse, the one resume policy): a killed unit resumes from its last checkpoint with its
    learning curve, and ends with the figures of an uninterrupted one."""
    import shutil

    from gated_attention.experiment.runs import train_or_reuse
    from gated_attention.modeling import GatedQwen3ForCausalLM
    from gated_attention.train.plugins import Plugins

    cfg_d, variant, seed, unit_dir = job
    cfg = SinkLabConfig().changed(**cfg_d)
    unit_dir = Path(unit_dir)
    key = _unit_key(cfg, variant, seed)
    done = _stored_unit(unit_dir, cfg, variant, seed)
    if done is not None:
        _log(f"{variant} seed {seed}: reusing {unit_dir / 'result.json'}")
        return done
    task = BackcopyTask(**cfg.task)
    tcfg = unit_train_config(cfg, variant, seed, key["precision"])
    rec = _UnitRecorder(cfg, variant, seed, task)
    summary = train_or_reuse(tcfg, unit_dir, _log, f"seed {seed} gate", step_hook=rec,
                             model_factory=lambda c, v: GatedQwen3ForCausalLM(model_config_for(cfg, variant)),
                             plugins=Plugins(source=_BackcopySource(task), observe=rec.batch_ce),
                             key=key, key_defaults=_unit_defaults(key), resolved_precision=key["precision"])
    if summary.get("diverged") or summary.get("stop_reason"):
        raise ValueError(f"{variant} seed {seed}: {summary.get('stop_reason') or 'diverged'}; lower --lr "
                         f"(run folder {unit_dir})")
    model = GatedQwen3ForCausalLM.from_pretrained(unit_dir / "final")  # the trained fp32 weights
    st = rec.state
    final = measure(model, task, rec.eval_seqs)
    result = {"variant": variant, "seed": seed, **{k: final[k] for k in METRICS if k in final},
              "steps_to_skill": st["skill"], "null_attention_dormant": final["null_attention_dormant"],
              "final_train_loss": sum(st["losses"]) / max(len(st["losses"]), 1),
              "wall_time_s": rec.wall_s(), "cpu_time_s": rec.cpu_s(),
              "params": sum(p.numel() for p in model.parameters()), "backcopy_head": final["backcopy_head"],
              "per_layer": final["per_layer"], "attention_map": final["attention_map"],
              "map_active_rows": final["map_active_rows"], "curve": st["curve"],
              "resolved_precision": summary.get("resolved_precision")}
    for f in (unit_dir / "final").iterdir():  # the unit folder is the model's HF folder (load_run, from_pretrained)
        shutil.copy2(f, unit_dir / f.name)
    return finish_unit(unit_dir, key, result)  # the lab needs the model, not the optimizer state


def _f(v, d: int = 3) -> str:
    return "–" if v is None else f"{v:.{d}f}"


def _log(msg: str) -> None:
    print(f"[sinks] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the lab

def unit_jobs(cfg: SinkLabConfig, out: str | Path, precision: str) -> Units:
    """Every variant x seed unit of the lab as a `train_unit` job (cfg settings, variant, seed, unit dir), seed-major
    (an interrupted lab has every variant at its first seeds, not some variants at none), with the finished ones'
    results. precision: the command's decision for the precision (util.precision.decide): each job's config carries
    it, so no unit (in a worker process or not) decides again. `gattn compare` trains the pending ones in its own
    worker pool next to its LM variants."""
    from gated_attention.util.precision import check_resolved

    out = Path(out)
    unit = cfg.changed(precision=check_resolved(precision))
    jobs_list = [(unit.settings(), v, s, str(out / "runs" / v / f"seed{s}")) for s in range(cfg.seeds)
                 for v in cfg.variants]
    return Units(train_unit, jobs_list, [_stored_unit(j[3], unit, j[1], j[2]) for j in jobs_list])


@locks_output("out", "gattn lab sinks")  # one writer per lab folder (its worker processes write inside)
def run_lab(cfg: SinkLabConfig, out: str | Path, jobs: int = 1, log=_log, report_only: bool = False) -> dict:
    """Train/reuse every variant x seed, aggregate, write lab.json, report.md, report.html and plots into out.
    report_only: train nothing; report the finished units (e.g. of a run stopped early), seeds as available."""
    cfg.validate()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    from gated_attention.util.precision import decide

    precision, line = decide(cfg.train.precision, "cpu")  # the lab's one decision: every unit trains in it
    units = unit_jobs(cfg, out, precision)
    pending = units.pending()  # finished units need no worker
    log(f"{len(units.units)} models ({len(cfg.variants)} variants x {cfg.seeds} seeds), {cfg.train.steps} steps each, "
        f"{jobs} at a time, {line} -> {out}")
    if len(pending) < len(units.units):
        log(f"reusing {len(units.units) - len(pending)} finished model(s)")
    if report_only:
        results = [r for r in units.done if r is not None]
        if not results:
            raise ValueError(f"--report-only: no finished model in {out}/runs with these settings")
        log(f"--report-only: {len(pending)} unfinished model(s) left out: "
            + ", ".join(f"{j[1]} seed {j[2]}" for j in pending))
        cfg = replace(cfg, variants=[v for v in cfg.variants if any(r["variant"] == v for r in results)])
    else:
        results = units.run(jobs, log)
    return write_lab(cfg, out, results, precision, started=t0)


@locks_output("out", "gattn lab sinks")
def write_lab(cfg: SinkLabConfig, out: str | Path, results: list[dict], precision: str,
              started: float | None = None) -> dict:
    """Aggregate the finished units' results (every variant of cfg, seeds as given) over seeds and write lab.json,
    report.md, report.html and plots into out: the lab's last step, also taken by `gattn compare`, which trains the
    units in its own pool. precision: what cfg.precision was decided to be (lab.json's resolved_precision);
    started: perf_counter() when the lab began (its wall time; default: now)."""
    from . import sink_report

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter() if started is None else started
    task = BackcopyTask(**cfg.task)
    variants = {}
    for v in cfg.variants:
        per_seed = [{k: r[k] for k in r if k != "key"} for r in results if r["variant"] == v]
        mean, std = mean_std(per_seed, METRICS + EXTRA_METRICS)
        for k in ("gate_dormant", "gate_active", "steps_to_skill"):  # keep "not measured" distinguishable
            if all(r.get(k) is None for r in per_seed):
                mean[k] = std[k] = None
        variants[v] = {"per_seed": per_seed, "mean": mean, "std": std,
                       "skilled_seeds": sum(r.get("steps_to_skill") is not None for r in per_seed)}
    lab = {
        "task": {**task.to_dict(), "name": "bigram_backcopy", "bos_id": 0,
                 "trigger_ids": task.trigger_ids.tolist(),
                 "bigram_ce_floor": variants[cfg.variants[0]]["mean"]["bigram_ce_floor"]},
        "config": {**cfg.settings(), "resolved_precision": precision},
        "variants": variants,
        "wall_time_s": time.perf_counter() - t0,
    }
    return save_lab(out, lab, lambda d: sink_report.make_plots(d, lab), lambda: sink_report.write(out, lab))
