"""`gattn compare`: the main job. Train the ungated baseline and gated variants on the same data, seed and parameter
budget, evaluate per-domain perplexity, measure attention sinks / massive activations / gate statistics, and write a
report in the form of the paper's Table 4 (report.md, a self-contained report.html, compare.json, PNG plots).

Layout of OUT (default runs/compare):

  OUT/runs/<variant>/    one trainer run per variant (log.jsonl, checkpoints/, final/, summary.json) + analysis.json
  OUT/plots/*.png        loss curves, per-layer F-Attn/M-Act, attention maps, gate histograms
  OUT/compare.json       every number in the report
  OUT/report.md, OUT/report.html

Re-running reuses work: a variant whose summary.json exists (with the same settings) is not retrained, a run that was
interrupted resumes from its last checkpoint (the trainer's exact resume), and analysis.json is reused when its
settings match. Changing a setting for an existing OUT fails loudly instead of silently mixing runs.

Budgets (`--budget`) are TrainConfig changes over the `small` training preset; `--set` overrides them further.
"""
from __future__ import annotations

import copy
import functools
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from .. import experiment
from ..gates import DEFAULT_VARIANTS  # the run folders and the rows of compare.json
from ..util.io import read_json_object, atomic_write_text, json_dumps, locks_output, read_jsonl

DEFAULT_DATA_DIR = "data"  # the data module's `gattn data prepare` default


@dataclass(frozen=True)
class Budget:
    """A named training budget: changes over the `small` training preset, plus analysis size. Budgets are frozen and
    derived from each other with dataclasses.replace (see BUDGETS)."""

    help: str
    train: dict  # TrainConfig fields (model_overrides = model-config fields); budget_config copies them
    # a rung of the default scaling ladder (`gattn lab scaling`) whose recipe - shape, steps, windows, batch - `train`
    # goes over: derived when the budget is used (it sizes a model), so the table itself loads without torch
    ladder_rung: str | None = None
    analysis_batches: int = 4  # val batches (of eval_batch_size windows) per domain fed to the analysis
    map_len: int = 64  # tokens shown in the attention-map plots
    data_dir: str = DEFAULT_DATA_DIR  # corpus used when --data-dir is not given (prepared automatically)
    vocab_size: int = 8192  # BPE vocabulary that corpus is prepared with
    # the small sink lab compare runs after the LM variants: a `gattn lab sinks` budget (sink_lab.BUDGETS) and its
    # seeds here (the job's share of time it gets; run_compare's sink_lab_changes change more)
    sink_lab: str = "default"
    sink_lab_seeds: int = 1
    # the LM variants: seeds 0..seeds-1 of each (paired: the same batches per seed), and each variant's peak LR
    # (a variant missing here trains at train["lr"]); lr_source says where the LRs come from (tuned or not)
    seeds: int = 1
    lrs: dict = field(default_factory=dict)
    lr_source: str = "one LR for every variant, not tuned"
    # the streaming check on this run's models (`gattn lab streaming`): window = this fraction of each model's
    # training length, these sink-token counts (0 = a plain window), this many held-out sequences per model
    streaming: dict = field(default_factory=lambda: {"window_frac": 0.25, "sink_tokens": (0, 4), "sequences": 16})

    def train_changes(self) -> dict:
        """The TrainConfig changes of this budget: its ladder rung's recipe, if it names one, with `train` on top."""
        return {**(_ladder_rung(self.ladder_rung) if self.ladder_rung else {}), **self.train}


# Chosen by CPU experiments (the lead's notes: sink_experiments.md): a shallow, narrow model so many tokens fit the
# time budget, the fixed <|bos|> first token (the data sampler's default) so a sink has something to form on, a high
# peak LR with weight decay 0.1 (both make sinks appear sooner, Gu et al. 2024). The baseline's massive activations
# (`default`: M-Act ~300 against ~170 gated; `long`: 80 vs 30 at 1.2M tokens, 131 vs 56 at the end) and the gated
# models' lower PPL show within ~1M tokens. A first-token sink does not: F-Attn stays at the uniform-attention level
# (1/(t+1) averaged over queries) for the first ~2.5M tokens and then grows steadily, mostly in layer 0 (measured with
# `long` on a 1024-token-vocabulary corpus: baseline F-Attn 1.25x uniform at 4.3M tokens, 1.63x at 8.6M, 1.79x at the
# end (12.3M; layer 0 3.7x), while G1 elementwise, same tokens, ends at 1.15x with layer 0 at 1.4x, and 5 % lower val
# PPL). No head passes Gu et al.'s 0.3 threshold at this size, and the growth flattens as the cosine LR decays.
# Turning QK-norm off, or a higher LR/weight decay on code only, did not make it appear sooner. Hence `long`: windows
# of 256 (a lower uniform level, more keys to park on) and ~12M tokens. A 1024-token vocabulary makes each token ~2x
# cheaper (the LM head dominates this model) and is what `long` was measured with. `extended` = `long`'s setting for
# 1400 steps with a WSD schedule (the growth slowed exactly when the cosine LR fell, so WSD holds the peak): measured
# baseline F-Attn 0.037 = 1.54x uniform at 5.7M tokens (results/sink_emergence.md); it was the default until
# the main job had to fit 15 minutes on a CPU without fast bf16 (an fp32 step is 1.2-1.45x a bf16 one on a CPU that
# has it). `text` (the default before the scaling ladder's rung) = the same setting for 450 steps (1.8M tokens): an
# early-training PPL difference (one seed, one LR: not the paper's gain, see _DEFAULT below) and the massive
# activations show (both within ~1M tokens), the text sink does not yet, so the sink claim rests on the sink lab there
# (per-part costs on both CPU kinds: results/mainjob_budget.md). `quick` = the 1.2M-token default before those: 8k
# vocabulary, windows of 128.
_CPU_SHAPE = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32)  # ~1.8M parameters with the 8k vocabulary (1M in embeddings)


def _cpu_recipe(**changes) -> dict:
    """The TrainConfig changes the CPU budgets share (batch 16, peak LR 6e-3 decaying to 6e-5, weight decay 0.1, the
    CPU shape) with `changes` on top."""
    return dict(batch_size=16, lr=6e-3, min_lr=6e-5, weight_decay=0.1, eval_every=0, eval_batch_size=8,
                spike_window=50, model_overrides=dict(_CPU_SHAPE), **changes)


_TEXT = Budget(
    help="the main job's text setting before the scaling ladder's rung: ~1.8M tokens per variant (2.3 per "
         "non-embedding parameter) in "
         "windows of 256 on a 0.79M-non-embedding-parameter 4-layer model, WSD schedule, one LR for every variant, "
         "1024-token vocabulary, + the 1-seed sink lab and the streaming check",
    train=_cpu_recipe(seq_len=256, steps=450, warmup_steps=50, schedule="wsd", eval_batches=8, stats_every=100,
                      ckpt_every=225),
    data_dir="data_v1k", vocab_size=1024)


def _ladder_rung(name: str) -> dict:
    """The TrainConfig changes of one rung of `gattn lab scaling`'s default ladder: its shape and recipe (20 tokens per
    non-embedding parameter, windows of 128, batch 8, cosine to 10 %, weight decay 0.1, QK-norm)."""
    from ..labs.scaling import scaling_lab as sl

    spec = sl.BUDGETS["default"]
    size = next(s for s in spec.sizes if s.name == name)
    return sl.recipe(spec, size, sl.size_info(spec, size, 1024, spec.tokens_per_param))


# The main job's LM setting is the default scaling ladder's d48l2 rung (a 2-layer d=48 model, 60k non-embedding
# parameters, 20 tokens per parameter, the ladder's recipe with fan-in init) under the ladder's protocol: every arm at
# the baseline's best LR of the tuning seed's sweep there (seed 0: 0.004/0.008/0.016/0.032 -> 4.291/4.075/3.969/4.094
# nats, results/scaling.md), and its own seeds are confirmation seeds (100, 101, 102), never the tuning seed.
_RUNG = "d48l2"
LADDER_LR = 1.6e-2
CONFIRM_SEED = 100  # the first of the main job's seeds: the ladder's fresh confirm seeds start here too
# The baseline's loss drop per e-fold of compute at d48l2 (nats), which turns Δ into ln k when no scaling lab is given:
# alpha * A * C^-alpha of the default ladder's joint fit under its adopted recipe, L = 0.900 + 60.55 (k C)^-0.1077
# (results/scaling_fanin/lab.json).
LADDER_SLOPE = (0.3370, "the default ladder's joint fit at d48l2 (results/scaling_fanin/lab.json)")
_DEFAULT = Budget(
    help="the main job in under 15 minutes on 2 cores of either CPU kind (fp32 on an AVX2-only CPU): the default "
         "scaling ladder's d48l2 rung (2 layers, d=48, 60k non-embedding parameters) at 20 tokens per parameter "
         "(1.2M tokens), every arm at the baseline's tuned LR (the paper's shared-LR protocol), 3 paired "
         "confirmation seeds (100-102), windows of 128 on the default sources with a 1024-token vocabulary "
         "(prepared automatically in data_v1k unless --data-dir is given), + the 1-seed sink lab and the streaming "
         "check",
    ladder_rung=_RUNG,
    train={"lr": LADDER_LR, "min_lr": LADDER_LR * 0.01, "seed": CONFIRM_SEED,
           "eval_every": 0, "stats_every": 0, "spike_window": 50,
           # fp32 and eager, as the ladder trains: the same numbers on either CPU kind and whatever the machine's load
           # (bf16 autocast and compile=auto decide from timings; at d=48 neither is faster)
           "precision": "fp32", "compile": "false"},
    analysis_batches=1, data_dir="data_v1k", vocab_size=1024, seeds=3,
    lrs={"baseline": LADDER_LR, "sdpa_elementwise": LADDER_LR, "sdpa_headwise": LADDER_LR},
    lr_source=f"the baseline's best LR at {_RUNG} on the default scaling ladder's tuning seed (0), shared by every arm")

BUDGETS: dict[str, Budget] = {
    "small": Budget(
        help="CI smoke run: a ~0.6M-parameter 2-layer model, 60 steps per variant (a minute or two on 2 cores)",
        train=dict(seq_len=64, batch_size=8, steps=60, lr=3e-3, min_lr=3e-4, warmup_steps=6, eval_every=0,
                   eval_batches=2, eval_batch_size=4, stats_every=20, spike_window=20, ckpt_every=30,
                   model_overrides=dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=32)),
        analysis_batches=1, map_len=32, sink_lab="small"),
    "quick": replace(
        _TEXT,
        help="~1.2M tokens per variant on a 1.8M-parameter 4-layer model (8k-vocabulary corpus, windows of 128): "
             "about 5 minutes for three variants on 2 quiet CPU cores; shows the massive activations and the PPL "
             "gain, not yet a first-token sink",
        train={**_TEXT.train, "seq_len": 128, "steps": 600, "warmup_steps": 30, "schedule": "cosine",
               "eval_batches": 4, "stats_every": 50, "ckpt_every": 100},
        data_dir=DEFAULT_DATA_DIR, vocab_size=8192),
    "default": _DEFAULT,
    "text": _TEXT,
    "extended": replace(
        _TEXT,
        help="the main job's earlier default: ~5.7M tokens per variant in windows of 256, WSD schedule (holds the "
             "peak LR, where the sink grows), 1024-token vocabulary: ~20 minutes on 2 quiet bf16-capable cores, "
             "~30 in fp32; the baseline's first-token sink on text is visible (F-Attn 1.5x uniform) and the gated "
             "models stay near uniform",
        train={**_TEXT.train, "steps": 1400, "stats_every": 200, "ckpt_every": 700}),
    "long": replace(
        _TEXT,
        help="the budget that shows the first-token sink forming: ~12M tokens per variant in windows of 256 (same "
             "model, cosine schedule) on the 1024-token-vocabulary corpus: about 40 minutes for three variants on 2 "
             "quiet CPU cores; the sink is clearer (baseline 1.8x uniform, layer 0 3.7x)",
        train={**_TEXT.train, "steps": 3000, "warmup_steps": 100, "schedule": "cosine", "stats_every": 200,
               "ckpt_every": 500}),
}


# ---------------------------------------------------------------- configuration

def get_budget(name: str) -> Budget:
    """The budget called `name` (the one check of a --budget value)."""
    if name not in BUDGETS:
        raise ValueError(f"unknown --budget {name!r}; valid: {', '.join(BUDGETS)}")
    return BUDGETS[name]


def budget_config(budget: Budget, data_dir: str, sets: list[str] | None = None):
    """The TrainConfig shared by every variant (gate = baseline) for a budget, with `--set` overrides applied."""
    from gated_attention.presets import model_config
    from gated_attention.train.train_presets import train_preset
    from gated_attention.train.overrides import apply_overrides

    # each run reports progress (a bar on a terminal, a line every GATTN_PROGRESS_INTERVAL s otherwise); TensorBoard
    # files are noise here. A deep copy: the budgets share their model_overrides (replace of _DEFAULT)
    cfg = replace(train_preset("small"), **copy.deepcopy(budget.train_changes()), data="corpus", data_dir=str(data_dir),
                  gate="baseline", progress=True, tensorboard=False)
    fields = model_config(cfg.model, gate="baseline").to_dict()
    cfg = apply_overrides(cfg, list(sets or []), fields)
    if cfg.gate != "baseline":
        raise ValueError("--set gate=... is not allowed in compare; choose gates with --variants")
    return cfg


def check_variants(variants: list[str]) -> list[str]:
    from gated_attention.gates import ALIASES, GATES

    bad = [v for v in variants if v not in GATES and v not in ALIASES]
    if bad:
        raise ValueError(f"unknown variant(s) {bad}; valid: {', '.join(GATES)}, or an alias: {', '.join(ALIASES)} "
                         f"(see `gattn gates`)")
    if len(set(variants)) != len(variants):
        raise ValueError(f"--variants lists a variant twice: {variants}")
    return list(variants)


# ---------------------------------------------------------------- one variant: train (or reuse), then analyse

def analysis_batches(cfg, budget: Budget):
    """Val windows of every domain, each starting with <|bos|> as in training: a list of (b, T) LongTensors."""
    from gated_attention import data

    corpus = data.Corpus(cfg.data_dir)
    batches = []
    for domain in corpus.domains:
        for b in data.eval_batches(corpus, domain, cfg.seq_len, budget.analysis_batches, cfg.eval_batch_size):
            batches.append(b[:, :-1])  # (b, T): inputs only
    if not batches:
        raise ValueError(f"no validation windows of {cfg.seq_len} tokens in {cfg.data_dir}; lower seq_len")
    return batches


def analyze_variant(run_dir: Path, cfg, budget: Budget, batches) -> dict:
    """analysis.json of the variant's final model (reused when the analysis settings match)."""
    from gated_attention.analysis import AnalysisConfig, analyze_model, load_model

    final = run_dir / "final" / "model.safetensors"
    key = {"seq_len": cfg.seq_len, "batches": len(batches), "batch_size": int(batches[0].shape[0]),
           "map_len": budget.map_len, "final_mtime": final.stat().st_mtime if final.exists() else None}

    def compute() -> dict:
        model, kind = load_model(run_dir / "final")
        return analyze_model(model, batches, AnalysisConfig(map_len=budget.map_len), kind)

    return experiment.cached(run_dir / "analysis.json", key, compute, lambda m: None, "[compare]",
                             key_field="compare_key", indent=None, inputs=("final_mtime",))


def param_counts(run_dir: Path) -> dict:
    """param_report of the run's final model (total, non_embedding, ...)."""
    from gated_attention.presets import param_report
    from gated_attention.configuration import GatedQwen3Config

    return param_report(GatedQwen3Config.from_pretrained(run_dir / "final"))


def count_params(run_dir: Path) -> int:
    return int(param_counts(run_dir)["total"])


def mean_val_loss(summary: dict) -> float | None:
    """The run's validation loss in nats, mean over domains (the measure of the perplexity row)."""
    losses = [float(x) for x in (summary.get("val_losses") or {}).values()]
    return sum(losses) / len(losses) if losses else None


# ---------------------------------------------------------------- the whole job

def gate_share_below(analysis: dict, x: float) -> float | None:
    """The share of the gate scores (every layer's histogram pooled) below x, to the nearest bin edge; None ungated."""
    hs = [e["gate_histogram"] for e in analysis.get("layers", []) if e.get("gate_histogram")]
    if not hs:
        return None
    edges = hs[0]["edges"]
    below = sum(h["counts"][i] for h in hs for i in range(len(edges) - 1) if edges[i + 1] <= x + 1e-9)
    return below / max(1, sum(sum(h["counts"]) for h in hs))


def variant_row(name: str, summary: dict, analysis: dict, params: int) -> dict:
    """The numbers compare.json keeps per variant and seed (Table 4 columns first)."""
    from . import claims

    a = analysis
    return {
        "variant": name,
        "params": params,
        "avg_ppl": summary.get("avg_ppl"),
        "gate_mean": a.get("gate_mean"),
        "gate_near_zero": gate_share_below(a, claims.NEAR_ZERO),
        "m_act": a.get("max_abs_hidden"),
        "f_attn": a.get("first_token_attention"),
        "f_attn_max_layer": max((e.get("first_token_attention") or 0.0 for e in a.get("layers", [])), default=None),
        "spikes": summary.get("spikes"),
        "uniform_f_attn": a.get("uniform_first_token_attention"),
        "sink_rate": a.get("sink_rate"),
        "val_ppl": summary.get("val_ppl"),
        "val_losses": summary.get("val_losses"),
        "final_loss_avg10": summary.get("final_loss_avg10"),
        "skipped_steps": summary.get("skipped_steps"),
        "diverged": summary.get("diverged"),
        "tokens": summary.get("tokens"),
        "train_wall_time_s": summary.get("wall_time_s"),
        "analysis_loss": a.get("loss"),
        "max_abs_attn_output": a.get("max_abs_attn_output"),
        "max_abs_ffn_output": a.get("max_abs_ffn_output"),
        "mean_abs_y_pre_gate": a.get("mean_abs_y_pre_gate"),
        "mean_abs_y_post_gate": a.get("mean_abs_y_post_gate"),
        **{k: a.get(k) for k in ("sparsity_pre_gate_0.01", "sparsity_post_gate_0.01",
                                 "sparsity_pre_gate_x_mean_gate_0.01")},
        "per_layer": {
            "f_attn": [e.get("first_token_attention") for e in a.get("layers", [])],
            "m_act": [e.get("max_abs_hidden") for e in a.get("layers", [])],
            "gate_mean": [e.get("gate_mean") for e in a.get("layers", [])],
        },
    }


def sink_lab_config(budget: Budget, variants: list[str], changes: dict | None = None, precision: str = "auto"):
    """The budget's `gattn lab sinks` settings (its sink-lab budget and seeds, `changes` on top) on compare's
    variants, in the LM runs' precision setting; validated."""
    from gated_attention.labs.sinks import sink_lab

    return sink_lab.budget_config(budget.sink_lab, **{"seeds": budget.sink_lab_seeds, **(changes or {}),
                                                      "variants": list(variants), "precision": precision}).validate()


def sink_lab_summary(lab: dict, out: Path, lab_dir: Path) -> dict:
    """What compare.json keeps of its sink lab: per-variant means/stds, the table and plot paths (relative to out)."""
    from gated_attention.labs.sinks import sink_report

    head, rows = sink_report.table_cells(lab)
    return {"dir": str(lab_dir.relative_to(out)), "task": lab["task"], "config": lab["config"],
            "variants": {v: {"mean": x["mean"], "std": x["std"], "seeds": len(x["per_seed"])}
                         for v, x in lab["variants"].items()},
            "table": {"head": head, "rows": rows},
            "plots": {k: str((lab_dir / p).relative_to(out)) for k, p in lab.get("plots", {}).items()}}


def run_streaming_check(budget: Budget, out: Path, seq_len: int, lab: dict | None, log=print) -> dict:
    """`gattn lab streaming` on this run's text models (OUT/streaming/text) and, when the sink lab ran, on its models
    (OUT/streaming/sink_lab); returns what compare.json keeps (streaming_summary)."""
    from gated_attention.labs.streaming import streaming_lab

    s = budget.streaming
    runs = {"text": ([str(out)], seq_len)}
    if lab:
        runs["sink lab"] = ([str(out / "sink_lab")], lab["task"]["seq_len"])
    labs = {}
    for src, (models, length) in runs.items():
        cfg = streaming_lab.StreamingConfig(models=models, window=max(1, int(length * s["window_frac"])),
                                        sink_tokens=list(s["sink_tokens"]), sequences=s["sequences"])
        labs[src] = streaming_lab.run_streaming(cfg, out / "streaming" / src.replace(" ", "_"),
                                            log=lambda m: log(f"[compare] {m}"))
    return streaming_summary(labs, out)


def streaming_summary(labs: dict, out: Path) -> dict:
    """compare.json's "streaming": per source (text / sink lab) its window, every model's loss/ppl (no curves),
    the sink lab's by-variant means, one table and the plots (paths relative to out)."""
    from gated_attention.labs.streaming import streaming_report

    models, head, rows = {}, None, []
    for src, lab in labs.items():
        for name, m in lab["models"].items():
            models[name] = {"kind": m["kind"], "variant": m["variant"], "seq_len": m["seq_len"],
                            "full": {k: v for k, v in m["full"].items() if k != "per_position"},
                            "window": {k: {a: b for a, b in w.items() if a != "per_position"}
                                       for k, w in m["window"].items()}}
        h, r = streaming_report.table(lab)
        head = h if head is None or len(h) > len(head) else head
        rows += [x + [""] * (len(head) - len(x)) for x in r]
    text = [m for m in models.values() if m["kind"] == "text"]
    text_summary = ", ".join(
        f"{m['variant'].removeprefix('sdpa_')} {m['window']['0']['loss'] - m['full']['loss']:+.3f}"
        for m in text if "0" in m["window"])
    first = next(iter(labs.values()))
    return {"dir": "streaming", "window": {src: lab["config"]["window"] for src, lab in labs.items()},
            "sink_tokens": first["config"]["sink_tokens"], "models": models,
            "by_variant": (labs.get("sink lab") or {}).get("by_variant") or {},
            "text_summary": f"plain-window Δloss {text_summary}" if text_summary else "",
            "table": {"head": head, "rows": rows},
            "plots": {f"{src} per-position loss": str(((out / "streaming" / src.replace(" ", "_")) / p).relative_to(out))
                      for src, lab in labs.items() for p in lab.get("plots", {}).values()},
            "cpu_time_s": sum(lab["cpu_time_s"] for lab in labs.values())}


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _unit(task: tuple, log=_stderr):
    """One model of the job, in a worker process or in-process: ("lm", (cfg, run_dir, budget, resolved precision))
    trains (or reuses / resumes) an LM variant in the job's precision and analyses it -> (summary, analysis);
    ("sink", job) trains one unit of the sink study (its job carries the decided precision too)."""
    kind, payload = task
    if kind == "sink":
        from gated_attention.labs.sinks import train_unit

        return train_unit(payload)
    cfg, run_dir, budget, precision = payload
    summary = experiment.train_or_reuse(cfg, run_dir, log, "[compare]", resolved_precision=precision)
    return summary, analyze_variant(run_dir, cfg, budget, analysis_batches(cfg, budget))


def _ladder_slope(scaling_lab, budget: str) -> tuple[float, str] | None:
    """The baseline's loss drop per e-fold of compute at the job's rung (nats), which turns Δ into ln k: from the
    scaling lab's joint fit when one is given and holds the rung, else the default ladder's (LADDER_SLOPE); None for
    budgets that are not a ladder rung."""
    if budget != "default":
        return None
    path = Path(scaling_lab) / "lab.json" if scaling_lab else None
    if path is not None and path.is_file():
        slope = ((read_json_object(path, "scaling lab.json").get("multiplier_fit") or {}).get("slope") or {}).get(_RUNG)
        if slope:
            return float(slope), f"the scaling lab's joint fit at {_RUNG} ({path.parent})"
    return LADDER_SLOPE


def _bytes_per_token(data_dir: str) -> dict:
    from ..labs.scaling.measure import bytes_per_token

    return bytes_per_token(data_dir)


def run_name(variant: str, seed: int) -> str:
    """The run folder of one LM variant and seed (relative to OUT/runs): seed 0 keeps the variant's name."""
    return variant if seed == 0 else f"{variant}_seed{seed}"


def schedule_units(out: Path, cfgs: dict, budget: Budget, precision: str, sink_units=None
                   ) -> list[tuple]:
    """The job's models still to train as `_unit` tasks, longest first: the LM runs (cfgs: run name -> its
    validated TrainConfig; precision: the job's resolved one), then the sink study's pending units (sink_units: its
    experiment.study.Units; short ones that fill the second core while the last LM variant trains). Finished ones need
    no worker."""
    tasks = [("lm", (cfg, out / "runs" / name, budget, precision)) for name, cfg in cfgs.items()
             if not experiment.is_finished(out / "runs" / name)]
    return tasks + [("sink", j) for j in (sink_units.pending() if sink_units is not None else [])]


@locks_output("out", "gattn compare")  # one writer per output folder
def run_compare(out: str | Path, data_dir: str | Path | None = None, budget: str = "default",
                variants: list[str] | None = None, sets: list[str] | None = None, log=print,
                sink_lab: bool = True, stability_lab: str | Path | None = "runs/lab/stability",
                longctx: str | Path | None = "runs/longctx", jobs: int | None = None,
                streaming: bool = True, sink_lab_changes: dict | None = None, large_sources: bool = False,
                seeds: int | None = None, scaling_lab: str | Path | None = "runs/lab/scaling") -> dict:
    """Train/reuse every variant, analyse, run the small sink lab, and write compare.json, report.md, report.html
    and plots into `out`; the report opens with the "Paper claims vs this run" table (claims.py), which also
    reads a stability lab in `stability_lab` and a long-context report in `longctx` when they exist. streaming: also
    run the streaming check (sliding window with and without sink tokens) on the models. sink_lab_changes: changes
    to the budget's sink-lab settings (e.g. {"seeds": 3}).

    Layout (measured on the 2-core reference machine: compare's models train 1.15-1.2x faster two at a time with one
    thread each than one after the other with two threads): the LM variants and the sink lab's models are
    independent units, trained `jobs` at a time (default min(2, cores)) in worker processes of cores/jobs threads
    (experiment.run_units), longest first, so the sink lab's short models fill the core the last LM variant leaves
    free; each LM unit also runs its analysis. jobs=1: one after another in this process, with all its threads."""
    from . import claims, compare_report
    from . import seeds as S
    from ..experiment.provenance import provenance
    t0 = time.perf_counter()
    if seeds is not None and seeds < 1:
        raise ValueError(f"--seeds {seeds} must be >= 1")
    variants = check_variants(list(variants or DEFAULT_VARIANTS))
    b = get_budget(budget)
    if large_sources:  # the default sources + the opt-in large ones (~100 MB more text): a corpus of its own
        from ..data import DEFAULT_SOURCES, LARGE_DEFAULT

        data_dir = experiment.ensure_corpus(data_dir or f"{b.data_dir}_large", b.vocab_size, log, "[compare]",
                                            sources=DEFAULT_SOURCES + LARGE_DEFAULT)
    else:
        data_dir = experiment.ensure_corpus(data_dir or b.data_dir, b.vocab_size, log, "[compare]")
    base = budget_config(b, str(data_dir), sets)
    n_seeds = seeds or b.seeds
    lr_set = any(x.split("=", 1)[0].strip() in ("lr", "min_lr") for x in sets or [])
    lrs = {v: base.lr if lr_set else b.lrs.get(v, base.lr) for v in variants}
    # each (variant, seed) run, configured once: seed 0 in runs/<variant>, seed k in runs/<variant>_seed<k>
    cfgs = {run_name(v, k): replace(base, gate=v, seed=base.seed + k, lr=lrs[v],
                                    min_lr=base.min_lr * lrs[v] / base.lr).validate()
            for k in range(n_seeds) for v in variants}
    out = Path(out)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    batches = analysis_batches(base, b)
    from ..util.precision import decide, device_type

    # the job's one precision decision: every LM run and sink-lab unit (in this process or a worker) trains in it
    precision, line = decide(base.precision, base.device)
    log(f"[compare] {line}")
    sink_cfg = sink_units = None
    if sink_lab:  # its units are planned (and the finished ones read) once, here; trained in the same pool
        from ..labs import sinks

        sink_cfg = sink_lab_config(b, variants, sink_lab_changes, base.precision)
        # the sink lab's loop runs on the CPU: it shares the decision when the LM runs do too
        sink_precision = precision if device_type(base.device) == "cpu" else decide(sink_cfg.train.precision, "cpu")[0]
        sink_units = sinks.unit_jobs(sink_cfg, out / "sink_lab", sink_precision)
        log(f"[compare] sink lab ({b.sink_lab} budget, {sink_cfg.seeds} seed(s), {sink_cfg.train.steps} steps) -> "
            f"{out / 'sink_lab'}")
    jobs = jobs or experiment.default_jobs()
    tasks = schedule_units(out, cfgs, b, precision, sink_units)
    threads = max(1, experiment.cores() // jobs)
    n_lm = sum(t[0] == "lm" for t in tasks)
    if tasks:
        log(f"[compare] {len(tasks)} models to train ({n_lm} LM variants, {len(tasks) - n_lm} sink-lab units), "
            f"{jobs} at a time" + (f", {threads} thread(s) each" if jobs > 1 and len(tasks) > 1 else ""))
    fn = _unit if jobs > 1 and len(tasks) > 1 else functools.partial(_unit, log=log)  # in-process: the caller's log
    t_models = time.perf_counter()
    results = experiment.run_units(fn, tasks, jobs=jobs, log=log, threads=threads)
    trained = {t[1][1].name: r for t, r in zip(tasks, results) if t[0] == "lm"}  # run folder = run name
    timings = {"setup": t_models - t0, "models": time.perf_counter() - t_models}
    seed_rows, analyses, logs, seed_losses = {}, {}, {}, {}
    for k in range(n_seeds):
        for v in variants:  # every seed's model is analysed; a finished run is reused (a file read, its analysis too)
            name, run_dir = run_name(v, k), out / "runs" / run_name(v, k)
            summary, analysis = trained[name] if name in trained else _unit(
                ("lm", (cfgs[name], run_dir, b, precision)), log)
            seed_losses.setdefault(v, {})[k] = mean_val_loss(summary)
            seed_rows.setdefault(v, {})[str(k)] = variant_row(v, summary, analysis, count_params(run_dir))
            analyses.setdefault(v, {})[k], logs.setdefault(v, {})[k] = analysis, read_jsonl(run_dir / "log.jsonl")
    rows = {}
    for v in variants:  # the first seed's figures at the top level (as before seeds), every seed's under by_seed
        rows[v] = {**seed_rows[v]["0"], "by_seed": seed_rows[v], "lr": cfgs[v].lr,
                   "val_loss_by_seed": {str(k): seed_losses[v][k] for k in sorted(seed_losses[v])}}
        rows[v]["over_seeds"] = S.summarize(rows[v])
        m = lambda key, d: compare_report.fmt(S.mean(rows[v], key), d)  # noqa: E731
        log(f"[compare] {v} (mean over {n_seeds} seed(s)): Avg PPL {m('avg_ppl', 3)}  F-Attn {m('f_attn', 3)}  "
            f"M-Act {m('m_act', 1)}  gate {m('gate_mean', 3)}  spikes {m('spikes', 1)}")
    from ..gates import canonical_name

    base_v = next((v for v in variants if canonical_name(v) == "none"), variants[0])
    base_params = param_counts(out / "runs" / base_v)
    result = {
        "budget": budget,
        "variants": variants,
        "seeds": n_seeds,
        "ppl_measure": claims.ppl_measure(
            seed_losses, lrs={v: cfgs[v].lr for v in variants},
            lr_tuned={v: bool(b.lrs.get(v)) and not lr_set for v in variants},
            tokens_per_param=rows[base_v]["tokens"] / base_params["non_embedding"]
            if rows[base_v].get("tokens") else None, lr_source=b.lr_source if not lr_set else "--set lr",
            protocol="shared-lr" if len({cfgs[v].lr for v in variants}) == 1 else "per-variant LRs",
            seeds=[base.seed + k for k in range(n_seeds)], slope=_ladder_slope(scaling_lab, budget),
            bytes_per_token=_bytes_per_token(str(data_dir))),
        "data_dir": str(data_dir),
        "train_config": base.to_dict(),
        "resolved_precision": precision,  # what every run trained in (runs are keyed on it)
        "provenance": provenance(),  # the machine (CPU, cores, threads) and commit the report names
        "analysis": {"batches": len(batches), "batch_size": int(batches[0].shape[0]), "seq_len": base.seq_len,
                     "tokens": int(sum(x.numel() for x in batches)), "first_token": "<|bos|>"},
        "rows": rows,
        "layout": {"jobs": jobs, "threads_per_job": threads if jobs > 1 else None, "trained": len(tasks)},
        "wall_time_s": None,
    }
    lab = None
    t = time.perf_counter()
    if sink_lab:  # every unit is trained by now: this aggregates them and writes the lab's report
        fresh = [r for t, r in zip(tasks, results) if t[0] == "sink"]
        lab = sinks.write_lab(sink_cfg, out / "sink_lab", sink_units.results(fresh), sink_precision)
        result["sink_lab"] = sink_lab_summary(lab, out, out / "sink_lab")
    timings["sink_lab_report"], t = time.perf_counter() - t, time.perf_counter()
    if streaming:
        result["streaming"] = run_streaming_check(b, out, base.seq_len, lab, log)
    timings["streaming"], t = time.perf_counter() - t, time.perf_counter()
    result["claims"] = claims.claims_table(result, lab, stability_lab, longctx, scaling_lab)
    result["plot_data"] = compare_report.plot_data(analyses, logs)  # the report re-renders from compare.json alone
    plots = compare_report.make_plots(out / "plots", result)
    result["plots"] = {k: str(p.relative_to(out)) for k, p in plots.items()}
    timings["report"] = time.perf_counter() - t
    # where this invocation's wall time went (reused runs cost nothing): setup (corpus check, precision), models
    # (every LM variant + its analysis and the sink lab's units, `jobs` at a time), the sink lab's report, the
    # streaming check, the claims table and plots
    result["timings_s"] = timings
    result["wall_time_s"] = time.perf_counter() - t0
    atomic_write_text(out / "compare.json", json_dumps(result, indent=1))
    compare_report.write(out, result)
    return result
