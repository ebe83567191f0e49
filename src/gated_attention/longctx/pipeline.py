"""`gattn longctx`: the paper's Table 5 in small (the stages; the report is longctx/longctx_report.py, the stopping rule
longctx/skill.py, the retrieval mixing that makes it measurable at small scale is training-data code,
train/retrieval_mix.py).

Table 5 (paper map §3.5): models trained at one length are extended 4x with YaRN and no training; the gated model keeps far
more of its RULER score. At CPU scale:
  1. train each model (a gate, optionally with a non-default gate init: GATE:INIT) at length L on the corpus, with a
     fraction of every batch replaced by synthetic retrieval samples (ruler.training_samples, within L) so a tiny
     model learns the task format at all (a model trained on literature alone scores 0 at every length); with
     until_skill, training stops once a held-out check at L reaches the threshold (skill.SkillStop), so extension is
     compared at equal skill and steps-to-skill is measured; every model for `seeds` seeds;
  2. extend each checkpoint 4x with YaRN (extend.extend_checkpoint, original length L), training-free;
  3. score RULER tasks at L/2, L, 2L, 4L with and without YaRN (greedy, KV cache), teacher-forced answer NLL, and
     perplexity by position up to 4L on the corpus validation text;
  4. write OUT/report.md (tables, mean ± std over seeds), OUT/report.json (every number, plus the paper-vs-this-run
     `claim`) and OUT/report.png (score vs length, PPL vs position); see longctx.longctx_report.
Every stage is cached under OUT (runs/<model>/seed<k>/, runs/<model>/seed<k>/yarn<factor>/,
eval/<model>-seed<k>-<variant>.json; <model> is the gate, plus '.identity' for the identity init) and reused on a
re-run when its settings match; a half-finished training run resumes from its last checkpoint.

Prompts and retrieval rows both start with the corpus' <|bos|>: corpus windows always do (data.sample_batch), and the
baseline's attention sink forms on that fixed first token, so evaluation must feed it too (`BosTokenizer`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

# torch is imported inside the functions that run a model: the budgets (`gattn longctx`'s options) load without it

from gated_attention import experiment
from gated_attention.longctx import ruler
from gated_attention.longctx.longctx_report import build_report, format_markdown, write as write_report
from gated_attention.util.io import atomic_write_json, locks_output, read_json_object
from gated_attention.util.progress import Progress
from gated_attention.train.retrieval_mix import DEFAULT_MIX_TASKS, BosTokenizer, check_mix_tasks

# ---------------------------------------------------------------------------------------------------------------------
# Budgets
@dataclass(frozen=True)
class Budget:
    """Everything that sets the cost of a pipeline run; OUT caches are keyed on these values."""
    model: str = "small"  # model preset (gated_attention.presets)
    model_overrides: dict = field(default_factory=dict)  # preset fields to change (narrower = faster on a CPU)
    seq_len: int = 256  # the training length L; evaluation runs at L/2, L, 2L, 4L
    steps: int = 600  # optimizer steps per model (with until_skill: the cap, and the LR schedule's length)
    batch_size: int = 16
    lr: float = 3e-3
    warmup_steps: int = 40
    retrieval_mix: float = 0.5  # share of rows that are retrieval samples: high, so a tiny model learns the format fast
    mix_tasks: tuple = DEFAULT_MIX_TASKS  # trained on and evaluated
    samples: int = 10  # RULER samples per task, length and seed
    max_new_tokens: int = 12  # every default answer (a 5-7 digit number, an adjective-noun pair) fits
    ppl_batches: int = 2  # validation batches per domain for PPL by position (windows of 4L)
    ppl_batch_size: int = 4
    data_dir: str = "data"  # corpus used when --data-dir is not given; prepared (gattn data prepare) if missing
    vocab_size: int = 8192  # BPE vocabulary that corpus is prepared with when missing (1024: one token per digit)
    precision: str = "auto"  # training numerics: auto = bf16 autocast where this machine runs it fast, else fp32
    until_skill: float | None = None  # stop a model once its held-out exact match at L (first task) reaches this
    skill_every: int = 100  # steps between held-out skill checks (until_skill only)
    skill_samples: int = 32  # held-out samples per check: 32 puts one miss at ~3 %
    seeds: int = 1  # seeds per model: seed, seed+1, ...; the report gives mean ± std over them
    models: tuple = ("baseline", "sdpa_elementwise")  # GATE or GATE:INIT (gate_init), when --gates is not given


# the model the earlier runs used: 3 layers x 4 heads (2 KV) of width 128
_D128 = {"hidden_size": 128, "intermediate_size": 384, "head_dim": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
         "num_key_value_heads": 2}
# the fair budget's model and schedule: the default budget's 3-layer model at L = 256 (the one setting measured to learn
# copying, between steps 1200 and 1800 for the baseline); 2 layers at L = 128 and lr 1e-2 had not copied by step ~1840
# (results/long_context.md). The cap is the LR schedule's length: long enough for the slower gated start.
FAIR_MODEL = dict(_D128)
FAIR_L, FAIR_STEPS, FAIR_LR = 256, 4000, 6e-3
BUDGETS = {
    # seconds to a few minutes: the test and smoke budget (tiny model, a handful of steps, one task)
    "small": Budget(model="tiny", seq_len=256, steps=8, batch_size=4, warmup_steps=2, mix_tasks=("passkey",),
                    samples=1, max_new_tokens=6, ppl_batches=1, ppl_batch_size=2),
    # ~30-40 minutes on two busy shared cores, the two models trained in parallel: passkey only, every training row a
    # retrieval sample (the copy signal is ~10 tokens per row, so it needs every row and thousands of steps), a
    # 1024-token BPE corpus (each digit one token, lm_head 8x cheaper than at 8k), 3 layers x 4 heads of width 128
    "default": Budget(model="small", model_overrides=_D128,
                      seq_len=256, steps=2400, batch_size=16, lr=6e-3, warmup_steps=50, retrieval_mix=1.0,
                      mix_tasks=("passkey",), samples=10, max_new_tokens=10, data_dir="data_v1k", vocab_size=1024),
    # Table 5 at equal skill (results/long_context.md): every model trained until it retrieves at L (>= 90 % held-out passkey exact
    # match), 4 seeds, baseline vs G1 elementwise with the official (gate ~0.5) and the identity gate init and G1
    # headwise, 30 samples per cell; the default budget's model (measured in bf16), the cap raised to 4000 steps (~8 min per model
    # on one core; results/long_context.md)
    "fair": Budget(model="small", model_overrides=FAIR_MODEL,
                   seq_len=FAIR_L, steps=FAIR_STEPS, batch_size=16, lr=FAIR_LR, warmup_steps=50, retrieval_mix=1.0,
                   mix_tasks=("passkey",), samples=30, max_new_tokens=10, data_dir="data_v1k", vocab_size=1024,
                   until_skill=0.9, skill_every=50, skill_samples=32, seeds=4,
                   models=("baseline", "sdpa_elementwise", "sdpa_elementwise:identity", "sdpa_headwise")),
}


def parse_model(spec: str) -> tuple[str, str]:
    """'GATE' or 'GATE:INIT' -> (gate, gate_init); INIT is one of gates.GATE_INITS (normal is the default)."""
    from gated_attention.gates import GATE_INITS, get_gate

    gate, sep, init = spec.partition(":")
    init = init if sep else "normal"
    try:
        has_gate = get_gate(gate) is not None
    except (KeyError, ValueError) as exc:
        raise ValueError(f"model {spec!r}: {exc}") from None
    if init not in GATE_INITS:
        raise ValueError(f"model {spec!r}: unknown gate init {init!r}; write GATE or GATE:INIT with INIT one of "
                         f"{', '.join(GATE_INITS)}")
    if init != "normal" and not has_gate:
        raise ValueError(f"model {spec!r}: {gate} has no gate to initialise; drop ':{init}'")
    return gate, init


def model_dir_name(spec: str) -> str:
    """runs/<name>: the gate, plus '.<init>' for a non-default gate init (no ':' in paths)."""
    gate, init = parse_model(spec)
    return gate if init == "normal" else f"{gate}.{init}"


def canonical_model(spec: str) -> str:
    gate, init = parse_model(spec)
    return gate if init == "normal" else f"{gate}:{init}"


def check_budget(b: Budget) -> Budget:
    check_mix_tasks(b.mix_tasks)
    if b.seq_len < 2 or b.seq_len % 2:
        raise ValueError(f"--seq-len {b.seq_len} must be an even number (evaluation starts at L/2)")
    if b.until_skill is not None and not 0.0 < b.until_skill <= 1.0:
        raise ValueError(f"--until-skill {b.until_skill} must be a fraction in (0, 1] (e.g. 0.9), or 0 for off")
    for name in ("seeds", "skill_every", "skill_samples", "samples", "steps"):
        if getattr(b, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(b, name)} must be >= 1")
    for m in b.models:
        parse_model(m)
    from gated_attention.util.precision import check

    check(b.precision, "--precision")
    return b


def lengths_for(b: Budget, factor: int) -> list[int]:
    """L/2, L, 2L, ... up to factor*L."""
    out, L = [b.seq_len // 2], b.seq_len
    while L <= factor * b.seq_len:
        out.append(L)
        L *= 2
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Stages
def train_config_for(b: Budget, gate: str, data_dir: str, seed: int, gate_init: str = "normal"):
    from gated_attention.train.config import TrainConfig

    over = {**b.model_overrides, "max_position_embeddings": b.seq_len}  # the config states the trained length
    if gate_init != "normal":  # left out otherwise, so runs from before gate_init existed keep their cache key
        over["gate_init"] = gate_init
    return TrainConfig(model=b.model, gate=gate, model_overrides=over, data="corpus", data_dir=str(data_dir),
                       seq_len=b.seq_len, batch_size=b.batch_size, steps=b.steps, lr=b.lr, min_lr=b.lr / 100,
                       warmup_steps=b.warmup_steps, retrieval_mix=b.retrieval_mix, precision=b.precision,
                       retrieval_tasks=list(b.mix_tasks), seed=seed, eval_every=0, eval_batches=2,
                       eval_batch_size=4, stats_every=0, ckpt_every=max(1, b.steps // 8), keep_checkpoints=1,
                       progress=True, tensorboard=False).validate()


def skill_settings(b: Budget, seed: int) -> dict | None:
    """What the stopping rule depends on (part of a run's cache key); None when training runs a fixed step count."""
    if b.until_skill is None:
        return None
    return dict(until_skill=b.until_skill, every=b.skill_every, samples=b.skill_samples, task=b.mix_tasks[0],
                length=b.seq_len, seed=seed)


def train_stage(cfg, run_dir: Path, log=print, stopper=None, skill: dict | None = None,
                precision: str | None = None) -> Path:
    """Train (or reuse, or resume) one model (experiment.train_or_reuse); returns its final/ checkpoint directory.
    precision: the pipeline's decision for cfg.precision (None: decided by the run).

    stopper: a trainer step_hook (skill.SkillStop) that ends training once the model has the skill; `skill` is its
    settings dict, kept in run_dir/skill_config.json so a run is never reused or resumed under another stopping rule
    (a run from before the rule existed counts as "no rule").
    """
    skill_path = run_dir / "skill_config.json"
    if (run_dir / "train_config.json").exists():  # the stopping rule is part of the run's key (experiment.cache)
        old = read_json_object(skill_path, "stopping rule").get("rule") if skill_path.exists() else None
        experiment.cache.check(run_dir, {"stopping rule": old}, {"stopping rule": skill})
    if not skill_path.exists():
        atomic_write_json(skill_path, {"rule": skill}, indent=1)
    summary = experiment.train_or_reuse(cfg, run_dir, log, "[longctx]", step_hook=stopper,
                                        resolved_precision=precision)
    if summary.get("diverged"):
        raise ValueError(f"training {cfg.gate} diverged ({summary.get('stop_reason')}); lower the learning rate")
    return run_dir / "final"


def extend_stage(final: Path, dst: Path, seq_len: int, factor: int, log=print) -> Path:
    """The YaRN-extended copy of `final` in dst, under the reuse rule (experiment.cache): its key is the RoPE scaling
    (config.json's rope_parameters; another one stops the job), its input the trained model (a newer one makes the
    copy obsolete: it is made again)."""
    from gated_attention.longctx.extend import extend_checkpoint, extended_config

    want = extended_config(read_json_object(final / "config.json", "model config"), "yarn", float(factor),
                           original_max_position_embeddings=seq_len)["rope_parameters"]
    cfg_path = dst / "config.json"
    if cfg_path.exists():
        saved = read_json_object(cfg_path, "extended model config").get("rope_parameters")
        experiment.cache.check(dst, {"rope_parameters": saved}, {"rope_parameters": want})
        if (dst / "model.safetensors").stat().st_mtime >= (final / "model.safetensors").stat().st_mtime:
            log(f"[longctx] reuse {dst}")
            return dst
    extend_checkpoint(final, dst, "yarn", float(factor), original_max_position_embeddings=seq_len, overwrite=True)
    log(f"[longctx] extended {final} -> {dst} (YaRN x{factor} over {seq_len})")
    return dst


def ppl_by_position(model, data_dir: str, length: int, batches: int, batch_size: int, device) -> list[float]:
    """Mean next-token loss at each position 0..length-1 over corpus validation windows (every domain)."""
    from gated_attention.train.data_source import CorpusSource
    from gated_attention.train.evaluate import domain_losses

    source = CorpusSource(data_dir, None)
    res = domain_losses(model, source, seq_len=length, max_batches=batches, batch_size=batch_size, device=device,
                        precision="fp32", positions=True)
    if "pos_loss" not in res:
        raise ValueError(f"no corpus domain in {data_dir} has a validation split of {length} tokens for PPL by "
                         f"position; use a bigger corpus or a shorter --seq-len")
    return res["pos_loss"]


def answer_nll(model, tokenizer, sample: dict) -> float:
    """Mean NLL (nats/token) of the sample's answer (ruler.completion) after its prompt, teacher-forced.

    A continuous companion to the string-match score: a small model that never gets a key exactly right still shows
    how much of the answer it can recall, and how that recall degrades with length.
    """
    import torch

    prompt = ruler.encode(tokenizer, sample["prompt"])
    answer = list(tokenizer.tokenizer.encode(ruler.completion(sample), add_special_tokens=False))
    ids = torch.tensor([prompt + answer], device=next(model.parameters()).device)  # (1, T)
    with torch.no_grad():
        logits = model(input_ids=ids[:, :-1], logits_to_keep=len(answer)).logits[0]  # (A, V)
    return float(torch.nn.functional.cross_entropy(logits.float(), ids[0, -len(answer):]))


# the evaluated checkpoint's identity (its folder and its weights' modification time): a model trained again, or an OUT
# copied elsewhere, makes a stored evaluation obsolete (recomputed), not stale
EVAL_INPUTS = ("model", "mtime")


def eval_settings(model_dir: Path, b: Budget, lengths: list[int], seed: int) -> dict:
    """What an evaluation depends on (its cache key), the checkpoint's mtime included."""
    return dict(model=str(model_dir), tasks=list(b.mix_tasks), lengths=lengths, samples=b.samples,
                max_new_tokens=b.max_new_tokens, seed=seed, ppl_batches=b.ppl_batches,
                ppl_batch_size=b.ppl_batch_size, answer_nll=True, mtime=(model_dir / "model.safetensors").stat().st_mtime)


def cached_eval(model_dir: Path, out_json: Path, b: Budget, lengths: list[int], seed: int) -> dict | None:
    """eval_stage's stored result when it is current (the reuse rule, no work: for --report-only), else None."""
    if not (model_dir / "model.safetensors").exists():
        return None
    return experiment.cache.load(out_json, eval_settings(model_dir, b, lengths, seed), key_field="settings",
                                 inputs=EVAL_INPUTS)


def eval_stage(model_dir: Path, out_json: Path, b: Budget, lengths: list[int], data_dir: str, seed: int,
               log=print) -> dict:
    """RULER scores by length and PPL by position of one checkpoint (cached in out_json)."""
    settings = eval_settings(model_dir, b, lengths, seed)
    return experiment.cached(out_json, settings, lambda: _evaluate(model_dir, b, lengths, data_dir, seed, log), log,
                             "[longctx]", key_field="settings", indent=2, inputs=EVAL_INPUTS)


def _evaluate(model_dir: Path, b: Budget, lengths: list[int], data_dir: str, seed: int, log) -> dict:
    import torch

    from gated_attention.data import Corpus
    from gated_attention.modeling import GatedQwen3ForCausalLM

    corpus = Corpus(data_dir)
    tok = BosTokenizer(corpus.tokenizer, corpus.bos_id)
    device = torch.device("cpu")
    model = GatedQwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    model.generation_config.eos_token_id = corpus.eos_id
    name = "/".join(model_dir.parts[-3:])  # <model>/seed<k>/final or .../yarn<factor>
    scores: dict[str, dict[str, float | None]] = {t: {} for t in b.mix_tasks}
    nll: dict[str, dict[str, float | None]] = {t: {} for t in b.mix_tasks}
    records = []
    prog = Progress(len(b.mix_tasks) * len(lengths), f"longctx eval {name}", "cell", heartbeat=True)
    for task in b.mix_tasks:
        for n in lengths:
            prog.update(1, task=task, length=n)
            try:
                res = ruler.evaluate(model, tok, [task], [n], b.samples, b.max_new_tokens, seed)
            except ValueError as exc:
                # the bare prompt of this task is longer than n (L/2 with a short L): no score, shown as "-"
                if "empty haystack" not in str(exc):
                    raise
                log(f"  {name} {task} @ {n}: the prompt does not fit, no score")
                scores[task][str(n)] = nll[task][str(n)] = None
                continue
            scores[task][str(n)] = res["scores"][task][n]
            for rec in res["records"]:
                sample = ruler.generate_sample(task, tok, n, seed, rec["index"])
                rec["answer_nll"] = answer_nll(model, tok, sample)
            nll[task][str(n)] = sum(r["answer_nll"] for r in res["records"]) / len(res["records"])
            records += res["records"]
            log(f"  {name} {task} @ {n}: {scores[task][str(n)]:.1f}")
    prog.close()
    average, average_nll = {}, {}
    for n in lengths:  # over the tasks that fit at n
        got = [scores[t][str(n)] for t in b.mix_tasks if scores[t][str(n)] is not None]
        average[str(n)] = sum(got) / len(got) if got else None
        got = [nll[t][str(n)] for t in b.mix_tasks if nll[t][str(n)] is not None]
        average_nll[str(n)] = sum(got) / len(got) if got else None
    pos = ppl_by_position(model, data_dir, max(lengths), b.ppl_batches, b.ppl_batch_size, device)
    return dict(scores=scores, average=average, answer_nll=nll, average_answer_nll=average_nll, records=records,
                pos_loss=pos, rope_parameters=model.config.rope_parameters)


# ---------------------------------------------------------------------------------------------------------------------
# The pipeline
def lock_path(out, gates, seed: int = 0, seeds: int | None = None) -> Path:
    """The folder `gattn longctx` locks: one per gate set and seed range inside --out (the budget's defaults when None),
    so one model's seeds can train in parallel processes (`--seed 1 --seeds 1` beside `--seed 0 --seeds 1`)."""
    name = "gates-" + ("+".join(sorted(gates)) if gates else "default")
    return Path(out) / (name + f".seed{seed}" + (f"x{seeds}" if seeds else ""))


def _pipeline_lock(out_dir, b, gates, seed, report_only, **_):
    # one writer per gate set: two processes with the same --gates stop here; different --gates may share --out in
    # parallel (each training run folder also has its own lock, the trainer's); --report-only writes only the
    # report (atomically), meant to run while training processes go on: no lock
    return None if report_only else lock_path(out_dir, gates, seed, b.seeds)


@locks_output(_pipeline_lock, "gattn longctx")
def run_pipeline(out_dir, b: Budget, data_dir: str | None = None, gates=None, factor: int = 4, seed: int = 0,
                 log=print, report_only: bool = False, jobs: int | None = 1, threads: int | None = None) -> dict:
    """Train, extend, evaluate and report (see the module docstring); returns the report dict.

    gates: model specs GATE or GATE:INIT (None: the budget's models); seeds seed .. seed + b.seeds - 1.
    report_only: train and evaluate nothing; report the finished, evaluated (model, seed) pairs and the progress of
    the others (a partial report while runs are still going, or after an interrupted run).
    data_dir=None uses the budget's corpus (b.data_dir, prepared with b.vocab_size if missing).
    jobs > 1 runs the (model, seed) cells in that many worker processes of `threads` torch threads each (run_cell;
    jobs None: experiment.default_jobs(), threads None: the cores shared out); every stage is cached per cell, so the
    result is the same as one after another. The call holds the gate set's lock in OUT (`lock_path`) unless
    report_only.
    """
    if jobs is None:
        jobs = experiment.default_jobs()
    if threads is None:
        threads = max(1, experiment.cores() // jobs)
    if factor < 2 or factor & (factor - 1):
        raise ValueError(f"--factor {factor} must be a power of two >= 2 (lengths double from L to factor*L)")
    check_budget(b)
    from gated_attention.util.precision import decide

    # the pipeline's one decision, on the trainer's device ("auto"): every cell trains in it
    precision, line = decide(b.precision, "auto")
    models = [canonical_model(m) for m in (gates or b.models)]
    from gated_attention.gates import canonical_name

    if len({(canonical_name(parse_model(m)[0]), parse_model(m)[1]) for m in models}) != len(models):  # none == baseline
        raise ValueError(f"--gates lists a model twice: {' '.join(models)}")
    seeds = list(range(seed, seed + b.seeds))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lengths = lengths_for(b, factor)
    from gated_attention.data import Corpus

    data_dir = str(experiment.ensure_corpus(b.data_dir, b.vocab_size, log, "[longctx]") if data_dir is None
                   else data_dir)
    corpus = Corpus(data_dir)
    tok = BosTokenizer(corpus.tokenizer, corpus.bos_id)
    for task in b.mix_tasks:  # fail now, not after training, if a task cannot even be posed at L
        try:
            ruler.generate_sample(task, tok, b.seq_len, seed)
        except ValueError as exc:
            raise ValueError(f"task {task!r} does not fit the training length {b.seq_len} ({exc}); "
                             f"use a longer --seq-len or other --tasks") from None
    results, training = {}, {}
    cells = [(m, s) for s in seeds for m in models]  # seed-major: a killed run has every model at the first seed first
    if report_only:
        for m, s in cells:
            skill = skill_settings(b, s)
            _report_only_cell(out, out / "runs" / model_dir_name(m) / f"seed{s}", m, s, b, lengths, factor, skill,
                              results, training)
    else:
        jobs = max(1, min(int(jobs), len(cells)))
        if jobs > 1:
            log(f"[longctx] {len(cells)} (model, seed) runs, {jobs} at a time in worker processes "
                f"({threads} torch thread(s) each)")
        log(f"[longctx] {line}")
        tasks = [(str(out), b, m, s, data_dir, factor, lengths, jobs > 1, precision) for m, s in cells]
        fn = run_cell if jobs > 1 else functools.partial(run_cell, log=log)  # workers cannot take the caller's log
        for (m, s), (outcome, evals) in zip(cells, experiment.run_units(fn, tasks, jobs, log, threads)):
            training[(m, s)] = outcome
            results.update({(m, s, variant): res for variant, res in evals.items()})
    rep = build_report(results, training, b, lengths, factor, models, seeds, precision)
    atomic_write_json(out / "report.json", rep, indent=2)  # int length keys become strings, as JSON has them
    write_report(out, rep)  # report.png, report.md, report.html (atomic: one-model runs in parallel share OUT)
    log(format_markdown(rep))
    log(f"[longctx] wrote {out / 'report.md'}, {out / 'report.html'}, {out / 'report.json'}, {out / 'report.png'}")
    return rep


def run_cell(task: tuple, log=None) -> tuple[dict, dict]:
    """Train (until skilled), extend and evaluate one (model, seed): (training outcome, {variant: eval result}).

    Module-level and fed plain values, so experiment.run_units can run it in a worker process (--jobs); there (`tagged`)
    its lines go to stdout prefixed with the model and seed, as cells running in parallel interleave; in-process they
    go to `log`.
    """
    from gated_attention.data import Corpus
    from gated_attention.longctx import skill as S

    out, b, m, s, data_dir, factor, lengths, tagged, precision = task
    out = Path(out)
    if log is None:
        log = (lambda msg: print(f"[{m} seed{s}] {msg}", flush=True)) if tagged else print
    corpus = Corpus(data_dir)
    tok = BosTokenizer(corpus.tokenizer, corpus.bos_id)
    gate, init = parse_model(m)
    run_dir = out / "runs" / model_dir_name(m) / f"seed{s}"
    skill = skill_settings(b, s)
    stopper = None
    if skill is not None:
        scorer = S.PasskeyScorer(tok, b.seq_len, b.skill_samples, s, task=b.mix_tasks[0])
        stopper = S.SkillStop(scorer, b.skill_every, b.until_skill, run_dir / "skill.jsonl", log)
    final = train_stage(train_config_for(b, gate, data_dir, s, init), run_dir, log, stopper, skill, precision)
    outcome = S.training_outcome(run_dir, skill)
    yarn = extend_stage(final, run_dir / f"yarn{factor}", b.seq_len, factor, log)
    evals = {variant: eval_stage(model_dir, out / "eval" / f"{model_dir_name(m)}-seed{s}-{variant}.json", b, lengths,
                                 data_dir, s, log)
             for variant, model_dir in (("none", final), ("yarn", yarn))}
    return outcome, evals


def _report_only_cell(out: Path, run_dir: Path, m: str, s: int, b: Budget, lengths: list[int], factor: int,
                      skill: dict | None, results: dict, training: dict) -> None:
    from gated_attention.longctx import skill as S

    final, yarn = run_dir / "final", run_dir / f"yarn{factor}"
    if not ((run_dir / "summary.json").exists() and (final / "config.json").exists()):
        progress = S.training_progress(run_dir, skill)
        if progress is not None:
            training[(m, s)] = progress
        return
    training[(m, s)] = S.training_outcome(run_dir, skill)
    for variant, model_dir in (("none", final), ("yarn", yarn)):
        got = cached_eval(model_dir, out / "eval" / f"{model_dir_name(m)}-seed{s}-{variant}.json", b, lengths, s)
        if got is not None:
            results[(m, s, variant)] = got


