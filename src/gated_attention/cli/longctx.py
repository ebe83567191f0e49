"""Long-context commands: `gattn extend` (RoPE scaling, optional fine-tune), `gattn ruler` (RULER scores of a
checkpoint: OUT/ruler.json, a task x length table, OUT/ruler.png) and `gattn longctx` (the Table 5 pipeline)."""
from __future__ import annotations

from ..util import errors as E  # argparse types: numbers and paths checked where they enter
from ..util import precision as P

import dataclasses
import json
from pathlib import Path


from ..longctx import extend, pipeline, ruler


# ---------------------------------------------------------------- gattn extend

def configure_extend(parser) -> None:
    parser.add_argument("dir", type=E.existing_dir, help="source HF checkpoint directory (config.json with rope_parameters)")
    parser.add_argument("--method", choices=extend.METHODS, default="yarn", help="RoPE scaling method (default: yarn)")
    parser.add_argument("--factor", type=E.positive_float, default=4.0, help="context extension factor, >= 1 (default: 4)")
    parser.add_argument("--rope-theta", type=E.positive_float, default=None,
                        help="new RoPE base (e.g. 1e6, the paper's base change); default: keep the checkpoint's")
    parser.add_argument("--original-max-position-embeddings", type=E.positive_int, default=None,
                        help="trained context length; default: the checkpoint's max_position_embeddings")
    parser.add_argument("--out", type=E.out_dir, required=True, help="destination directory for the extended checkpoint")
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it already has files")
    parser.add_argument("--finetune-steps", type=E.nonneg_int, default=0,
                        help="continue training the extended model for N steps at --seq-len (0 = training-free); "
                             "the run (log, checkpoints) goes to OUT.finetune/ and resumes there if killed")
    parser.add_argument("--seq-len", type=E.positive_int, default=None, help="training length for --finetune-steps (tokens)")
    parser.add_argument("--data-dir", type=E.existing_dir, default=None,
                        help="corpus for --finetune-steps (default: the source run's, else ./data)")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="training override for --finetune-steps, as in `gattn train --set` (e.g. lr=1e-3); "
                             "repeatable")


def run_extend(args) -> int:
    if args.finetune_steps:
        res = extend.finetune_checkpoint(args.dir, args.out, args.finetune_steps, args.seq_len, args.method,
                                         args.factor, args.rope_theta, args.original_max_position_embeddings,
                                         args.data_dir, args.sets, args.overwrite)
        print(f"wrote {args.out}: rope_parameters={json.dumps(res['config']['rope_parameters'])}, fine-tuned "
              f"{res['steps']} steps at {args.seq_len} tokens (final loss {res['final_loss']:.4f}; run in "
              f"{res['run_dir']})")
        return 0
    if args.seq_len is not None or args.sets:
        raise ValueError("--seq-len and --set only apply with --finetune-steps N")
    new = extend.extend_checkpoint(args.dir, args.out, args.method, args.factor, args.rope_theta,
                                   args.original_max_position_embeddings, args.overwrite)
    print(f"wrote {args.out}: rope_parameters={json.dumps(new['rope_parameters'])} "
          f"max_position_embeddings={new['max_position_embeddings']}")
    return 0


# ---------------------------------------------------------------- gattn ruler

def configure_ruler(parser) -> None:
    parser.add_argument("dir", type=E.existing_dir, help="HF checkpoint directory (model + tokenizer)")
    parser.add_argument("--lengths", type=E.positive_int, nargs="+", required=True, help="target prompt lengths in tokens")
    parser.add_argument("--tasks", nargs="+", default=list(ruler.NO_CORPUS_TASKS), choices=list(ruler.TASKS),
                        metavar="TASK", help=f"tasks (default: all that need no corpus). Valid: {', '.join(ruler.TASKS)}")
    parser.add_argument("--samples", type=E.positive_int, default=10, help="samples per task and length (default: 10)")
    parser.add_argument("--out", type=E.out_dir, required=True, help="output directory for ruler.json and ruler.png")
    parser.add_argument("--seed", type=E.nonneg_int, default=0, help="sample seed (same seed = same prompts)")
    parser.add_argument("--max-new-tokens", type=E.positive_int, default=None,
                        help="generation budget; default: per task family (niah 64, vt 32, cwe 96, fwe 40, passkey 16)")
    parser.add_argument("--haystack-file", type=E.existing_file, default=None,
                        help="text file used as the haystack of the corpus tasks (niah_single_2/3, multikey_1, ...)")
    parser.add_argument("--metric", choices=list(ruler.METRICS), default="all",
                        help="string match: all = fraction of answers found (RULER default), part = any found")
    parser.add_argument("--device", default="cpu", help="torch device for the model (default: cpu)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                        help="model dtype (default: float32)")


def run_ruler(args) -> int:
    result = ruler.evaluate_folder(args.dir, args.out, args.tasks, args.lengths, args.samples, args.seed,
                                   args.max_new_tokens, args.haystack_file, args.metric, args.device, args.dtype,
                                   echo=lambda m: print(m, flush=True))
    print(ruler.format_table(result))
    print(f"wrote {Path(args.out) / 'ruler.json'} and {Path(args.out) / 'ruler.png'}")
    return 0


# ---------------------------------------------------------------- gattn longctx

def budget_from_args(args) -> pipeline.Budget:
    if args.budget not in pipeline.BUDGETS:
        raise ValueError(f"unknown budget {args.budget!r}; valid: {', '.join(pipeline.BUDGETS)}")
    b = pipeline.BUDGETS[args.budget]
    changes = {k: getattr(args, k) for k in ("seq_len", "steps", "samples", "seeds", "skill_every", "skill_samples")
               if getattr(args, k, None) is not None}
    if getattr(args, "tasks", None):
        changes["mix_tasks"] = tuple(args.tasks)
    if getattr(args, "retrieval_mix", None) is not None:
        changes["retrieval_mix"] = args.retrieval_mix
    if getattr(args, "until_skill", None) is not None:
        changes["until_skill"] = None if args.until_skill <= 0 else args.until_skill  # 0 turns the rule off
    if getattr(args, "precision", None) is not None:
        changes["precision"] = args.precision
    return pipeline.check_budget(dataclasses.replace(b, **changes))


def configure_longctx(parser) -> None:
    parser.add_argument("--budget", choices=list(pipeline.BUDGETS), default="default",
                        help="cost preset: small (tiny model, seconds-minutes, for tests); default (3-layer model on "
                             "a 1k-vocab corpus, 2400 steps per model, one seed: ~35-50 min per model on a busy 2-core "
                             "CPU); fair (Table 5 at equal skill: the default model trained until it retrieves at L "
                             "(>= 90%% held-out, at most 4000 steps), 4 seeds, baseline / G1 elementwise / G1 "
                             "elementwise with identity gate init / G1 headwise, 30 samples per cell; ~8 min per "
                             "model and seed on one core). Run one --gates/--seed per process in parallel into the "
                             "same --out, then once with all of them to combine the cached stages")
    parser.add_argument("--out", type=E.out_dir, default="runs/longctx", help="output folder; finished stages in it are reused")
    parser.add_argument("--data-dir", type=E.existing_dir, default=None,
                        help="prepared corpus (gattn data prepare); default: the budget's (prepared if missing)")
    parser.add_argument("--gates", nargs="+", default=None, metavar="GATE[:INIT]",
                        help="models to compare: a gate name, optionally with ':identity' for the identity gate init "
                             "(zero gate weights, score exactly 1 at the start) instead of the official ':normal' "
                             "(gate ~0.5 at the start), e.g. baseline sdpa_elementwise sdpa_elementwise:identity "
                             "(default: the budget's)")
    parser.add_argument("--factor", type=E.positive_int, default=4, help="YaRN extension factor, a power of two (default 4)")
    parser.add_argument("--seq-len", type=E.positive_int, default=None, help="training length L (default: the budget's)")
    parser.add_argument("--steps", type=E.positive_int, default=None,
                        help="training steps per model; with --until-skill the cap (default: the budget's)")
    parser.add_argument("--until-skill", type=float, default=None, metavar="FRACTION",
                        help="stop training a model once its held-out exact match on the first task at L reaches "
                             "FRACTION (e.g. 0.9), checked every --skill-every steps; the step is reported as "
                             "steps-to-skill; 0 = off, train exactly --steps (default: the budget's; fair: 0.9)")
    parser.add_argument("--skill-every", type=int, default=None, help="steps between held-out skill checks")
    parser.add_argument("--skill-samples", type=int, default=None, help="held-out samples per skill check")
    parser.add_argument("--seeds", type=int, default=None,
                        help="seeds per model (--seed, --seed+1, ...); the report gives mean ± std over them")
    parser.add_argument("--samples", type=E.positive_int, default=None, help="RULER samples per task, length and seed")
    parser.add_argument("--tasks", nargs="+", default=None, metavar="TASK",
                        help=f"RULER tasks trained on and scored (no-corpus ones: {', '.join(ruler.NO_CORPUS_TASKS)})")
    parser.add_argument("--retrieval-mix", type=E.nonneg_float, default=None,
                        help="fraction of training rows replaced by retrieval samples (default: the budget's)")
    parser.add_argument("--seed", type=E.nonneg_int, default=0, help="first training and sample seed")
    P.add_argument(parser, default=None, note="; evaluation runs in fp32")
    parser.add_argument("--jobs", type=E.positive_int, default=None,
                        help="(model, seed) runs trained and scored at a time, each in its own process with "
                             "cores/JOBS torch threads (small models: one core per model beats sharing threads); "
                             "default: one per core, at most 2. --jobs 1 runs them one after another in this process")
    parser.add_argument("--report-only", action="store_true",
                        help="train and evaluate nothing: write the report from the finished (model, seed) runs and "
                             "show the progress of the others (a partial table while runs are going)")


def run_longctx(args) -> int:
    pipeline.run_pipeline(args.out, budget_from_args(args), args.data_dir, args.gates, args.factor, args.seed,
                          report_only=args.report_only, jobs=args.jobs)
    return 0
