"""`gattn lab NAME ...`: the labs' subcommand group. Each lab has `configure_<name>(parser)` (its options, each with
help text) and `run_<name>(args) -> int` here, calling its library module in gated_attention/labs/. Adding a lab = one
row in LABS + those two functions.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dataclasses import replace

from ..util import errors as E
from ..util import precision as P

from ..experiment.runs import default_jobs
from ..labs.sinks.sink_lab import BUDGETS, SinkLabConfig, budget_config
from ..labs.stability import stability_lab

def configure_sinks(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="runs/lab/sinks",
                        help="output folder: runs/<variant>/seed<k>/ (result.json + the finished model as a "
                             "from_pretrained folder), lab.json, report.md, report.html, plots/ (default "
                             "runs/lab/sinks; a re-run reuses finished models and continues killed ones)")
    parser.add_argument("--budget", default="default", choices=list(BUDGETS),
                        help="; ".join(f"{k}: {v.help}" for k, v in BUDGETS.items()) + " (default: default)")
    parser.add_argument("--variants", nargs="+", default=None, metavar="NAME",
                        help="gate names (`gattn gates`) and baseline mechanisms (sink_logits, bondarenko_gate, "
                             "clipped_softmax, forgetting, ...)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers, 1-3")
    parser.add_argument("--heads", type=int, default=None, help="attention heads per layer")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per model")
    parser.add_argument("--seeds", type=int, default=None,
                        help="seeds 0..N-1 per variant: model init and data order, the same for every variant")
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate (AdamW)")
    parser.add_argument("--gate-init", choices=("normal", "identity"), default=None,
                        help="normal: the official N(0, 0.02) init, gate ~0.5 at start; identity: gate == 1 at start")
    P.add_argument(parser, default=None, note="; measurements always run in fp32")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="torch.compile the training forward (~2x faster after ~10 s of compiling)")
    parser.add_argument("--batch-size", type=int, default=None, help="sequences per step")
    parser.add_argument("--min-lr", type=float, default=None, help="learning rate at the end of the decay")
    parser.add_argument("--warmup-steps", type=int, default=None, help="linear warm-up steps")
    parser.add_argument("--schedule", choices=("cosine", "wsd"), default=None,
                        help="cosine decay, or WSD (hold the peak, decay over the last --decay-frac of the steps)")
    parser.add_argument("--decay-frac", dest="wsd_decay_frac", type=float, default=None,
                        help="WSD: share of the steps spent decaying to --min-lr at the end; 0 = constant LR after "
                             "the warm-up")
    parser.add_argument("--weight-decay", type=float, default=None,
                        help="AdamW decoupled weight decay on matrices (embeddings, norms and biases excluded)")
    parser.add_argument("--beta2", type=float, default=None, help="Adam second-moment decay")
    parser.add_argument("--adam-eps", dest="eps", type=float, default=None, help="Adam epsilon")
    parser.add_argument("--qk-norm", choices=("on", "off"), default=None,
                        help="RMSNorm on q and k per head (Qwen3's QK-norm); Guo et al.'s model has none")
    parser.add_argument("--grad-clip", type=float, default=None, help="global gradient-norm clip (0 = off)")
    parser.add_argument("--hidden-size", type=int, default=None, help="model width d")
    parser.add_argument("--intermediate-size", type=int, default=None, help="FFN width of the ungated model")
    parser.add_argument("--eval-every", type=int, default=None, help="learning-curve interval in steps")
    for dest, (_, kind, text) in _SINK_TASK_OPTIONS.items():  # BackcopyTask fields
        parser.add_argument("--" + dest.replace("_", "-"), type=kind, default=None, help="task: " + text)
    parser.add_argument("--jobs", type=int, default=None,
                        help="models trained at once, one core each (default: min(2, available cores))")
    parser.add_argument("--report-only", action="store_true",
                        help="train nothing: write lab.json and the report from the models already finished in "
                             "--out with these settings (a run stopped early; seeds per variant as available)")
    _state_budget_defaults(parser)


def _state_budget_defaults(parser: argparse.ArgumentParser) -> None:
    """Append each option's true default, read from the budgets themselves, to its help (so it cannot go stale)."""
    cfgs = {name: b.config for name, b in BUDGETS.items()}
    task_fields = {a: f for a, (f, _, _) in _SINK_TASK_OPTIONS.items()}

    def value(cfg, dest):
        v = cfg.task[task_fields[dest]] if dest in task_fields else getattr(cfg, dest)
        if dest == "qk_norm" or isinstance(v, bool):
            return "on" if v else "off"
        return " ".join(map(str, v)) if isinstance(v, list) else f"{v:g}" if isinstance(v, float) else str(v)

    for action in parser._actions:
        dest = action.dest
        if dest not in _SINK_OPTIONS + ("qk_norm",) and dest not in task_fields:
            continue
        vals = {name: value(cfg, dest) for name, cfg in cfgs.items()}
        if len(set(vals.values())) == 1:
            action.help += f" (default {vals['default']})"
        else:
            action.help += " (default: " + "; ".join(f"{v} with --budget {n}" for n, v in vals.items()) + ")"


_SINK_OPTIONS = ("variants", "layers", "heads", "steps", "seeds", "lr", "gate_init", "precision", "compile",
                "batch_size", "min_lr", "warmup_steps", "schedule", "hidden_size", "intermediate_size", "eval_every",
                "wsd_decay_frac", "weight_decay", "beta2", "eps", "grad_clip")
# option dest -> (BackcopyTask field, type, help)
_SINK_TASK_OPTIONS = {"vocab": ("vocab", int, "normal tokens V"), "triggers": ("triggers", int, "trigger tokens k"),
                      "seq_len": ("seq_len", int, "tokens per sequence incl. BOS"),
                      "alpha": ("alpha", float, "Dirichlet concentration of the bigram rows (lower = more predictable)"),
                      "task_seed": ("seed", int, "seed of the chain and the triggers")}


def sinks_config(args) -> SinkLabConfig:
    """The budget's SinkLabConfig with every option the user gave applied on top."""
    cfg = budget_config(args.budget)
    over = {k: getattr(args, k) for k in _SINK_OPTIONS if getattr(args, k, None) is not None}
    task = {f: getattr(args, a) for a, (f, _, _) in _SINK_TASK_OPTIONS.items() if getattr(args, a, None) is not None}
    if task:
        over["task"] = {**cfg.task, **task}
    if getattr(args, "qk_norm", None) is not None:
        over["qk_norm"] = args.qk_norm == "on"
    return replace(cfg, **over).validate()


def run_sinks(args) -> int:
    from ..labs.sinks import sink_report
    from ..labs.sinks.sink_lab import run_lab as run_sink_lab

    cfg = sinks_config(args)
    jobs = args.jobs if args.jobs is not None else default_jobs()
    lab = run_sink_lab(cfg, args.out, jobs=jobs, report_only=args.report_only)
    print(sink_report.text_table(lab))
    print(f"report: {Path(args.out) / 'report.html'}  ({lab['wall_time_s']:.0f}s)")
    return 0


def configure_stability(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="runs/lab/stability",
                        help="output folder: runs/, plots/, lab.json, report.md, report.html (default "
                             "runs/lab/stability, where `gattn compare` reads it; a re-run reuses finished runs and "
                             "retrains interrupted ones, so a stopped lab continues where it was)")
    parser.add_argument("--budget", default="default", choices=list(stability_lab.BUDGETS),
                        help="; ".join(f"{k}: {v.help}" for k, v in stability_lab.BUDGETS.items()) + " (default: default)")
    parser.add_argument("--variants", nargs="+", default=list(stability_lab.DEFAULT_VARIANTS), metavar="NAME",
                        help=f"gate variants (names from `gattn gates`; default: {' '.join(stability_lab.DEFAULT_VARIANTS)})")
    parser.add_argument("--lrs", nargs="+", type=float, default=None, metavar="LR",
                        help="peak learning rates of the grid (default: the budget's; default "
                             f"{' '.join(f'{x:g}' for x in stability_lab.BUDGETS['default'].lrs)})")
    parser.add_argument("--qk-norm", default="both", choices=list(stability_lab.QK_SETTINGS),
                        help="train with QK-norm on, off, or both (default both)")
    parser.add_argument("--steps", type=int, default=None,
                        help="optimizer steps per run (default: the budget's; every run sees the same tokens)")
    parser.add_argument("--seeds", type=int, default=None,
                        help=f"seeds per setting (default: the budget's, {stability_lab.BUDGETS['default'].seeds} for "
                             f"default); >= 3 gives bootstrap intervals worth reading")
    parser.add_argument("--seed-lrs", default=None, choices=("edge", "all"),
                        help="where seeds 1.. run: every LR (all: whole curves per seed, which the intervals need; "
                             "the default of every budget but shallow) or only the last stable LR and the first LR "
                             "past the edge of each setting, found from seed 0 (edge)")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="training / model.* overrides on top of the budget's recipe for every run, as in "
                             "`gattn train --set` (e.g. --set model.num_hidden_layers=24 --set beta2=0.99); "
                             "repeatable. gate, lr, min_lr, seed, steps, data, data_dir and model.use_qk_norm are set "
                             "by the lab's own flags")
    parser.add_argument("--data-dir", default=None,
                        help="prepared corpus folder (default: the budget's, data_v1k with the 1024-token "
                             "vocabulary, prepared automatically if missing)")
    parser.add_argument("--jobs", type=int, default=None,
                        help="runs trained in parallel, one thread each (default: one per core, at most 2)")
    P.add_argument(parser, default="auto", note="; lab.json records the resolved precision of every run")


def run_stability(args) -> int:
    lab = stability_lab.LabConfig(out=args.out, budget=args.budget, variants=tuple(args.variants),
                         lrs=tuple(args.lrs) if args.lrs else None, qk_norm=args.qk_norm, steps=args.steps,
                         seeds=args.seeds, seed_lrs=args.seed_lrs, sets=tuple(args.sets), data_dir=args.data_dir,
                         precision=args.precision, jobs=args.jobs if args.jobs is not None else default_jobs())
    res = stability_lab.run_lab(lab, log=lambda m: print(m, file=sys.stderr, flush=True))
    from ..labs.stability.stability_report import sensitivity_text

    print(sensitivity_text(res))
    print(f"report: {Path(args.out) / 'report.html'}  ({res['wall_time_s']:.0f}s, "
          f"{res['cpu_s_runs'] / 60:.1f} core-minutes of training)")
    return 0


def configure_scaling(parser: argparse.ArgumentParser) -> None:
    from ..labs.scaling import scaling_lab as sl

    parser.add_argument("--out", default="runs/lab/scaling",
                        help="output folder: runs/<variant>_<size>_lr<lr>_s<seed>/ (trainer run folders with "
                             "final/ and result.json), plots/, lab.json, report.md, report.html (default "
                             "runs/lab/scaling; a re-run reuses finished units and resumes interrupted ones)")
    parser.add_argument("--budget", default="default", choices=list(sl.BUDGETS),
                        help="; ".join(f"{k}: {v.help}" for k, v in sl.BUDGETS.items()) + " (default: default)")
    parser.add_argument("--variants", nargs="+", default=list(sl.DEFAULT_VARIANTS), metavar="NAME",
                        help="gate variants, baseline included (default: " + " ".join(sl.DEFAULT_VARIANTS) + ")")
    parser.add_argument("--tokens-per-param", type=float, default=None,
                        help="training tokens per non-embedding parameter of the ungated model at every size "
                             "(default: the budget's; 20, Chinchilla's ratio, for default and gpu)")
    parser.add_argument("--protocol", default="shared-lr", choices=list(sl.PROTOCOLS),
                        help="shared-lr (default, the paper's): every arm trains at the baseline's tuned LR; tuned: "
                             "every variant is swept and trains at its own best LR (the LR-tolerance question)")
    parser.add_argument("--tuning-seeds", nargs="+", type=int, default=[0], metavar="SEED",
                        help="seeds of the LR sweep (default 0); they pick LRs and never count in a verdict")
    parser.add_argument("--confirm-seeds", nargs="+", type=int, default=None, metavar="SEED",
                        help="seeds that measure Δ, in the order they run, the pilot first (default: fresh seeds "
                             f"{sl.CONFIRM_FROM}, {sl.CONFIRM_FROM + 1}, ...; never a tuning seed)")
    parser.add_argument("--pilot-pairs", type=int, default=None,
                        help="confirm pairs every size runs before the design is registered; their within-arm "
                             "spread (blind to Δ) plans the rest (default: the budget's, 4 for default)")
    parser.add_argument("--max-pairs", type=int, default=None,
                        help="the most confirm pairs a size may plan (default: the budget's, 10 for default); past "
                             "it the verdict says what the budget could not decide")
    parser.add_argument("--seeds", type=int, default=None,
                        help="a fixed number of confirm pairs at every size instead of the planned one (>= 2)")
    parser.add_argument("--accept-code-change", action="store_true",
                        help="reuse units trained by another version of the training code (counted in lab.json "
                             "provenance); without it such a unit stops the lab with one line")
    parser.add_argument("--lrs", nargs="+", type=float, default=None, metavar="LR",
                        help="the tuning sweep's LRs (default: the budget's, spaced x2); the sweep is extended past "
                             "an edge while the best LR sits on it")
    parser.add_argument("--sizes", nargs="+", default=None, metavar="NAME",
                        help="train only these rungs of the budget's ladder (names as --plan prints them, e.g. "
                             "d48l2; default: all; the loss-vs-compute fit needs 3)")
    parser.add_argument("--heldout", nargs="+", default=[], metavar="PATH",
                        help="plain-text files never trained on: every run's loss on them (heldout_loss)")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="training overrides for every unit, as in `gattn train --set` (e.g. --set beta2=0.99); "
                             "gate, lr, min_lr, seed, steps, data, data_dir, precision and model.* are the lab's")
    parser.add_argument("--data-dir", default=None,
                        help="prepared corpus folder (default: data_v1k, the 1024-token-vocabulary corpus, "
                             "prepared automatically if missing)")
    parser.add_argument("--jobs", type=int, default=None,
                        help="units trained in parallel, one thread each (default: one per core, at most 2)")
    parser.add_argument("--plan", action="store_true",
                        help="print the ladder (parameters, tokens, FLOPs per size and the units' total FLOPs) "
                             "and exit without training")
    parser.add_argument("--recipe", default=None, choices=list(sl.RECIPES),
                        help="train every unit under this change of the base recipe (default: the budget's; "
                             "default and gpu: init-fan-in, adopted by the recipe pilot; quick: current): "
                             + "; ".join(f"{k}: {r.help}" for k, r in sl.RECIPES.items()).replace("%", "%%"))
    parser.add_argument("--recipe-pilot", default=None, metavar="SIZE",
                        help="instead of the ladder: train every arm at this size under each candidate recipe "
                             "(beta2 0.99, 10 %% warm-up, fan-in init, batch x2) on pilot seeds 200, 201, ... and "
                             "adopt one only if it halves the within-arm spread of the final loss (blind to Δ); "
                             "writes OUT/recipe_pilot.json")
    P.add_argument(parser, default="fp32", note="; fp32 by default: the same numbers on either CPU kind")


def run_scaling(args) -> int:
    from ..labs.scaling import scaling_lab as sl
    from ..labs.scaling import scaling_report

    lab = sl.LabConfig(out=args.out, budget=args.budget, variants=tuple(args.variants), seeds=args.seeds,
                       tuning_seeds=tuple(args.tuning_seeds), protocol=args.protocol,
                       confirm_seeds=tuple(args.confirm_seeds) if args.confirm_seeds else None,
                       pilot_pairs=args.pilot_pairs, max_pairs=args.max_pairs,
                       accept_code_change=args.accept_code_change,
                       tokens_per_param=args.tokens_per_param, lrs=tuple(args.lrs) if args.lrs else None,
                       heldout=tuple(args.heldout), sets=tuple(args.sets), data_dir=args.data_dir,
                       sizes=tuple(args.sizes) if args.sizes else None,
                       precision=args.precision, recipe=args.recipe,
                       jobs=args.jobs if args.jobs is not None else default_jobs()).validate()
    if args.plan:
        print(sl.plan_text(lab))
        return 0
    if args.recipe_pilot:
        from ..labs.scaling import recipe_pilot as rp

        res = sl.recipe_pilot(lab, args.recipe_pilot, log=lambda m: print(m, file=sys.stderr, flush=True))
        print(rp.text_table(res))
        print(f"written: {Path(args.out) / 'recipe_pilot.json'}  ({res['cpu_s'] / 60:.1f} core-minutes in units)")
        return 0
    res = sl.run_lab(lab, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(scaling_report.text_table(res))
    print(f"report: {Path(args.out) / 'report.html'}  ({res['wall_time_s']:.0f}s, "
          f"{res['cpu_s_runs'] / 60:.1f} core-minutes in units)")
    return 0


def configure_streaming(parser: argparse.ArgumentParser) -> None:
    from ..labs.streaming import DEFAULT_SINK_TOKENS

    parser.add_argument("--models", nargs="+", metavar="DIR",
                        help="model folders (required unless --report-only): a sink-lab run OUT/runs/<variant>/seed<k> (or a whole sink-lab OUT), a "
                             "`gattn compare` OUT (its runs/<variant>/final), a trainer run folder (final/) or any "
                             "folder with config.json")
    parser.add_argument("--window", type=int, required=True, metavar="W",
                        help="recent tokens the rolling KV cache keeps (the current one included)")
    parser.add_argument("--sink-tokens", type=int, nargs="+", default=list(DEFAULT_SINK_TOKENS), metavar="K",
                        help="first tokens kept forever, one measurement per K; 0 = a plain sliding window "
                             f"(default: {' '.join(map(str, DEFAULT_SINK_TOKENS))})")
    parser.add_argument("--out", default="runs/lab/streaming",
                        help="output folder: lab.json, report.md, report.html, plots/ (default runs/lab/streaming)")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="tokens per held-out sequence (default: the length each model was trained on)")
    parser.add_argument("--sequences", type=int, default=32, help="held-out sequences per model (default 32)")
    parser.add_argument("--text", default=None, metavar="FILE",
                        help="score windows of this UTF-8 text file instead of the corpus (text models only)")
    parser.add_argument("--data-dir", default=None,
                        help="corpus of model folders whose train_config.json does not name one (default: the "
                             "corpus each run trained on)")


def run_streaming(args) -> int:
    from ..labs.streaming import streaming_lab
    from ..labs.streaming import streaming_report

    cfg = streaming_lab.StreamingConfig(models=args.models, window=args.window, sink_tokens=args.sink_tokens,
                                    seq_len=args.seq_len, sequences=args.sequences, text=args.text,
                                    data_dir=args.data_dir)
    lab = streaming_lab.run_streaming(cfg, args.out, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(streaming_report.text_table(lab))
    print(f"report: {Path(args.out) / 'report.html'}  ({lab['wall_time_s']:.0f}s)")
    return 0


def configure_retrofit(parser: argparse.ArgumentParser) -> None:
    from ..labs import retrofit as rl
    from ..labs.retrofit.recipes import CONTROL, DEFAULT_RECIPES, RECIPES, REST_LR

    d = rl.RetrofitLabConfig()
    parser.add_argument("--from", dest="starts", nargs="+", required=True, metavar="DIR",
                        help="trained UNGATED starting models, all of one kind: sink-lab runs (OUT/runs/baseline/seed0 "
                             "of `gattn lab sinks`), training runs (RUN or RUN/final of gattn train / compare), or HF "
                             "checkpoint folders (with --data-dir: a corpus in the model's vocabulary)")
    parser.add_argument("--recipes", nargs="+", default=list(DEFAULT_RECIPES), metavar="NAME",
                        help=f"recipes to compare against the control ({CONTROL!r} always runs; REST_LR = "
                             f"{REST_LR:g}): " + "; ".join(f"{n}: {r.help}".replace("%", "%%") for n, r in RECIPES.items())
                             + f". Default: {' '.join(DEFAULT_RECIPES)}")
    parser.add_argument("--steps", type=E.positive_int, default=None,
                        help="retrofit steps per unit (default: --step-share x the steps the start was trained for)")
    parser.add_argument("--step-share", type=E.positive_float, default=d.step_share,
                        help=f"default --steps as a share of the start's training steps (default {d.step_share:g})")
    parser.add_argument("--seeds", type=E.positive_int, default=d.seeds,
                        help=f"seeds 0..N-1 per start and recipe: gate init (random) and data order (default {d.seeds})")
    parser.add_argument("--lr", type=E.positive_float, default=None,
                        help="peak LR of the gates; recipes train the pretrained weights at REST_LR x this (default: "
                             "the start's own training peak LR)")
    parser.add_argument("--batch-size", type=E.positive_int, default=None,
                        help="sequences per step (default: the start's training batch size, 16 when unknown)")
    parser.add_argument("--weight-decay", type=E.nonneg_float, default=None,
                        help="AdamW weight decay on matrices (default: the start's own, 0.1 when unknown)")
    P.add_argument(parser, default=d.precision, note="; lab.json records the resolved one; measurements always run "
                   "in fp32")
    parser.add_argument("--eval-every", type=E.positive_int, default=None,
                        help="learning-curve interval in steps (default: a tenth of the steps)")
    parser.add_argument("--eval-size", type=E.positive_int, default=d.eval_size,
                        help=f"held-out sequences (sink task; text: eval-size/32 batches of 8 windows per domain) "
                             f"(default {d.eval_size})")
    parser.add_argument("--stream-window", type=E.positive_int, default=None,
                        help="sliding window W of the streaming loss (default: a quarter of the sequence length)")
    parser.add_argument("--data-dir", default=None,
                        help="text: the prepared corpus (default: the training run's; required for an HF checkpoint, "
                             "prepared with `gattn data prepare --tokenizer DIR`)")
    parser.add_argument("--seq-len", type=E.positive_int, default=None,
                        help="text: window length (default: the training run's, else 256)")
    parser.add_argument("--keep-models", action=argparse.BooleanOptionalAction, default=d.keep_models,
                        help="keep each unit's final model in OUT/runs/<start>/<recipe>/seed<k>/model (default on)")
    parser.add_argument("--jobs", type=E.positive_int, default=None,
                        help="units trained at once, one core each (default: min(2, available cores))")
    parser.add_argument("--out", type=E.out_dir, default="runs/lab/retrofit",
                        help="output folder: runs/<start>/<recipe>/seed<k>/, lab.json, report.md, report.html, plots/ "
                             "(default runs/lab/retrofit; a re-run reuses finished units and continues killed ones)")


def run_retrofit(args) -> int:
    from ..labs import retrofit as rl
    from ..labs.retrofit import retrofit_report

    cfg = rl.RetrofitLabConfig(
        starts=list(args.starts), recipes=list(args.recipes), steps=args.steps, step_share=args.step_share,
        seeds=args.seeds, lr=args.lr, batch_size=args.batch_size, weight_decay=args.weight_decay,
        precision=args.precision, eval_every=args.eval_every, eval_size=args.eval_size,
        stream_window=args.stream_window, data_dir=args.data_dir, seq_len=args.seq_len,
        keep_models=args.keep_models).validate()
    lab = rl.run_lab(cfg, args.out, jobs=args.jobs if args.jobs is not None else default_jobs())
    print(retrofit_report.text_table(lab))
    print(f"report: {Path(args.out) / 'report.html'}  ({lab['wall_time_s']:.0f}s)")
    return 0


def configure_quant(parser: argparse.ArgumentParser) -> None:
    from ..labs.quant.quant_lab import QuantLabConfig, policy_names, scheme_names

    d = QuantLabConfig(models=[])
    parser.add_argument("--models", nargs="+", metavar="DIR",
                        help="model folders (required unless --report-only): a `gattn compare` OUT (every runs/<run>/final), a scaling-lab OUT (every "
                             "unit at its variant's best LR), a sink-lab or retrofit-lab OUT or one of their units, a "
                             "trainer run folder (final/) or any folder with config.json. Each model's gate is read "
                             "from its config.json and its seed from its run; gated models are compared with the "
                             "baseline of the same shape and data")
    parser.add_argument("--schemes", nargs="+", default=scheme_names(), metavar="NAME",
                        help="quantization schemes (gated_attention.quant; default all): " + " ".join(scheme_names()))
    parser.add_argument("--policies", nargs="+", default=policy_names(), metavar="NAME",
                        help="how the gate is quantized (default all three): all (the gate fused with q_proj as one "
                             "tensor, as the official / Qwen3-Next layouts hold it), keep-gate (the gate's projection "
                             "left in full precision), split-gate (the gate with its own scales)")
    parser.add_argument("--data-dir", default=None,
                        help="prepared corpus of text models (default: the corpus each run's train_config.json names; "
                             "required for a folder that names none)")
    parser.add_argument("--eval-windows", type=E.positive_int, default=d.eval_windows,
                        help=f"held-out windows per corpus domain (sink-lab task: held-out sequences) every model is "
                             f"measured on, quantized or not (default {d.eval_windows})")
    parser.add_argument("--calibration-windows", type=E.positive_int, default=d.calibration_windows,
                        help=f"training windows of awq-int4's calibration pass (default {d.calibration_windows})")
    parser.add_argument("--out", type=E.out_dir, default="runs/lab/quant",
                        help="output folder: rows/<model>/*.json (one stored row each), lab.json, report.md, "
                             "report.html, plots/ (default runs/lab/quant; a re-run measures only the missing rows)")
    parser.add_argument("--report-only", action="store_true",
                        help="judge OUT/lab.json's stored results again with the current rule and rewrite lab.json, "
                             "the report and the plots; measures nothing and needs no --models")


def run_quant(args) -> int:
    from ..labs.quant import QuantLabConfig, quant_report
    from ..labs.quant import run_lab as run_quant_lab
    from ..labs.quant.quant_lab import report_only

    if args.report_only:
        lab = report_only(args.out)
        print(quant_report.text_table(lab))
        print(f"report: {Path(args.out) / 'report.html'}")
        return 0
    if not args.models:
        raise E.UserError("--models is required (the model folders to measure); or pass --report-only to judge an "
                          "existing OUT again")
    cfg = QuantLabConfig(models=list(args.models), schemes=list(args.schemes), policies=list(args.policies),
                         data_dir=args.data_dir, eval_windows=args.eval_windows,
                         calibration_windows=args.calibration_windows).validate()
    lab = run_quant_lab(cfg, args.out, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(quant_report.text_table(lab))
    print(f"report: {Path(args.out) / 'report.html'}  ({lab['wall_time_s']:.0f}s)")
    return 0


# name -> (configure, run, one-line help)
LABS = {
    "sinks": (configure_sinks, run_sinks,
              "Bigram-Backcopy sink lab (Guo et al. 2024): BOS attention of idle heads, baseline vs gates, in minutes."),
    "streaming": (configure_streaming, run_streaming,
                  "Sliding-window decoding with and without sink tokens (StreamingLLM): loss of full attention vs a "
                  "rolling KV window keeping the first K tokens, per model and position."),
    "stability": (configure_stability, run_stability,
                  "LR sweeps of deep narrow models with/without QK-norm (Wortsman et al. 2023 proxies): loss "
                  "spikes, divergence, max stable LR, LR sensitivity with intervals over seeds, logit growth."),
    "scaling": (configure_scaling, run_scaling,
                "A ladder of model sizes, every variant at its own best LR, over seeds: Δ loss at equal parameters "
                "against the paper's 0.0128 nats, loss-vs-compute fits, LR basins, Δ along training."),
    "retrofit": (configure_retrofit, run_retrofit,
                 "Gates added to a trained ungated model: can they remove its sink? Recipes vs a control, over "
                 "seeds (sink, skill, gates, streaming loss, learning curves)."),
    "quant": (configure_quant, run_quant,
              "Gated models under quantization: 7 schemes x 3 gate policies (all / keep-gate / split-gate), Δ loss "
              "per domain vs the unquantized model, the gate and the sink after quantization, gated vs baseline "
              "(Welch) and policy vs policy (paired on the same models) against the paper's δ, and a recommended "
              "policy where the evidence decides one."),
}


def configure_lab(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Science labs: small controlled experiments that show one effect of gated attention, "
                          "measured over seeds, with lab.json, report.md, report.html and plots.")
    sub = parser.add_subparsers(dest="lab", metavar="LAB", required=True)
    for name, (configure, _, help_text) in LABS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        configure(p)


def run_lab(args) -> int:
    return int(LABS[args.lab][1](args) or 0)
