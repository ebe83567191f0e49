"""TrainConfig (every knob of a training run), training presets, and typed `--set key=value` overrides.

A training preset is a small function returning a TrainConfig; presets derive from each other with
`dataclasses.replace`, and each names a model preset from gated_attention.presets. Model-config fields are
overridden with a `model.` prefix (`model.num_hidden_layers=4`) and stored in `model_overrides`.
"""
from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field, replace


TRAINABLE = ("all", "gates")  # what the optimizer updates (train.model_setup.apply_trainable)
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "triton_gated")  # attention.KERNELS: what a training run may select
ACTIVATION_CHECKPOINTING = ("none", "full")  # train.model_setup.apply_activation_checkpointing
ACCUM_GRADS = ("sharded", "auto")  # train.dist.unsharded_accumulation
RUN_RECORD_KEYS = ("resolved_precision",)  # written beside the settings in train_config.json; not TrainConfig fields
# settings stored under an older name (train_config.json, a lab's lab.json): old -> new, or None for a retired one
RENAMED_KEYS = {"inject_nan_steps": None}  # fault injection moved to the tests' hooks (tests/kill_hooks.py)


@dataclass
class TrainConfig:
    # --- what to train
    model: str = "small"  # model preset name (gated_attention.presets.model_config)
    gate: str = "none"  # gate registry name; "none" (alias "baseline") is the ungated model
    model_overrides: dict = field(default_factory=dict)  # extra GatedQwen3Config fields (from --set model.KEY=V)
    init_from: str | None = None  # continued training: load this checkpoint dir (its config sets the model)
    trainable: str = "all"  # "all" parameters, or only the "gates" (cheap fine-tuning of a retrofitted gate)
    # --- data
    data: str = "corpus"  # "corpus" (gattn data prepare output), "synthetic" (built-in Markov tokens, for tests) or
    # "custom" (a lab's own task: the source passed in train(..., plugins=Plugins(source=...)), train/plugins.py)
    data_dir: str | None = None  # corpus directory; None = the data module's default
    domains: list[str] | None = None  # train on these domains only; None = all
    seq_len: int = 256  # tokens per sequence (inputs); each sample holds seq_len+1 tokens
    retrieval_mix: float = 0.0  # share of train rows replaced by RULER retrieval samples (longctx: teaches the format)
    retrieval_tasks: list[str] | None = None  # RULER tasks for those rows; None = retrieval_mix.DEFAULT_MIX_TASKS
    batch_size: int = 16  # GLOBAL sequences per optimizer step, split over ranks then micro-batches
    grad_accum: int = 1  # micro-batches per rank per step (memory knob; does not change the math)
    micro_batch: int = 0  # sequences per rank per forward; > 0 sets grad_accum = batch_size / (world * micro_batch)
    # when the run starts (the paper presets: 1, so one recipe runs on any number of GPUs); 0 = grad_accum as given
    steps: int = 2000  # optimizer steps in the whole run
    # --- optimizer (AdamW; the paper gives no betas/eps/wd, so these are common LLM defaults)
    lr: float = 3e-3  # peak learning rate
    min_lr: float = 3e-5  # floor reached at the end of the decay (paper MoE runs: 2e-3 -> 3e-5)
    warmup_steps: int = 100  # linear warm-up from 0
    schedule: str = "cosine"  # "cosine" (warmup + cosine) or "wsd" (warmup, stable, decay)
    wsd_decay_frac: float = 0.2  # WSD: fraction of the run spent decaying at the end
    wsd_decay_shape: str = "linear"  # WSD decay: "linear" or "sqrt" (1 - sqrt(progress))
    weight_decay: float = 0.1  # applied to matrices only (see wd_on_embeddings)
    wd_on_embeddings: bool = False  # decaying embeddings hurts rare tokens; off by default
    beta1: float = 0.9
    beta2: float = 0.95  # 0.95 rather than 0.999: the usual LLM choice, less prone to late spikes
    eps: float = 1e-8
    grad_clip: float = 1.0  # global-norm clip; 0 disables clipping (the norm is still measured)
    # --- numerics and speed
    precision: str = "auto"  # "auto", "bf16" (autocast), "bf16-params" (bf16 weights, fp32 master), "fp32": util/precision.py
    fast: bool = True  # fused q/k/v/gate GEMM, fused gate, chunked loss (train/fastpath.py); false = plain reference
    compile: str = "auto"  # "auto" (compile when the run outlasts the compile cost), "true" or "false" (eager)
    attn_implementation: str = "sdpa"  # attention kernel: "sdpa", "eager" (the reference), or "triton_gated" (CUDA +
    # Triton: the G1 gate fused into a flash-attention kernel's epilogue); the same math, so a run may switch on resume
    device: str = "auto"  # "auto" (cuda if present), "cpu" or "cuda"
    dist: str = "ddp"  # under torchrun: "ddp" or "fsdp" (FSDP2 fully_shard); ignored in one process
    accum_grads: str = "sharded"  # dist=fsdp with grad_accum > 1: "sharded" reduce-scatters every micro-batch (a rank
    # holds 1/N of the fp32 gradients); "auto" keeps whole gradients until the last micro-batch (one reduce-scatter
    # per step) only where `gattn plan` says they fit this rank's memory (train.dist.unsharded_accumulation)
    activation_checkpointing: str = "none"  # "full": each decoder layer keeps only its input and recomputes itself in
    # backward (activations: one (B, T, d) tensor per layer + one layer's worth, for ~1/3 more compute; docs/scale.md)
    seed: int = 0  # model init and data order; the batch at step s is a function of (seed, s)
    # --- monitoring
    eval_every: int = 0  # per-domain validation every N steps (0 = only at the end)
    eval_batches: int = 4  # validation batches per domain
    eval_batch_size: int = 8  # sequences per validation batch
    stats_every: int = 50  # update/weight ratio and max |activation| per layer every N steps (0 = never)
    spike_window: int = 50  # loss-spike detector: trailing median over this many steps ...
    spike_delta: float = 0.1  # ... exceeded by more than this many nats (paper map §1.8: 125 baseline / 0 gated spikes)
    spike_noise_k: float = 6.0  # ... or by this many robust sigmas (1.4826 MAD) of the window, if larger: small-batch noise
    max_bad_steps: int = 5  # stop (diverged) after this many NaN/Inf steps in a row
    ckpt_every: int = 500  # checkpoint every N steps (0 = only at the end)
    keep_checkpoints: int = 2  # rotation: keep the last K checkpoints
    progress: bool = True  # rank 0: tqdm bar on a terminal, else a line every GATTN_PROGRESS_INTERVAL s (util/progress.py)
    tensorboard: bool = True  # write TensorBoard events if tensorboard is installed

    def validate(self) -> "TrainConfig":
        def bad(msg: str):
            from gated_attention.util.errors import UserError

            raise UserError(f"invalid training config: {msg}")

        if self.schedule not in ("cosine", "wsd"):
            bad(f"schedule={self.schedule!r}; use 'cosine' or 'wsd'")
        if self.wsd_decay_shape not in ("linear", "sqrt"):
            bad(f"wsd_decay_shape={self.wsd_decay_shape!r}; use 'linear' or 'sqrt'")
        from gated_attention.util import precision as P

        try:
            P.check(self.precision)
        except ValueError as exc:
            bad(str(exc))
        if self.trainable not in TRAINABLE:
            bad(f"trainable={self.trainable!r}; use one of {', '.join(TRAINABLE)}")
        from .fastpath import compile_choice

        try:
            self.compile = compile_choice(self.compile)  # also accepts the bools older train_config.json files hold
        except ValueError as exc:
            bad(str(exc))
        if self.attn_implementation not in ATTN_IMPLEMENTATIONS:
            bad(f"attn_implementation={self.attn_implementation!r}; use one of {', '.join(ATTN_IMPLEMENTATIONS)} "
                "(triton_gated needs a CUDA GPU)")
        if self.data not in ("corpus", "synthetic", "custom"):
            bad(f"data={self.data!r}; use 'corpus' or 'synthetic' ('custom' is a lab's own source)")
        if self.dist not in ("ddp", "fsdp"):
            bad(f"dist={self.dist!r}; use 'ddp' or 'fsdp'")
        if self.accum_grads not in ACCUM_GRADS:
            bad(f"accum_grads={self.accum_grads!r}; use one of {', '.join(ACCUM_GRADS)}")
        if self.device not in ("auto", "cpu", "cuda"):
            bad(f"device={self.device!r}; use 'auto', 'cpu' or 'cuda'")
        if self.activation_checkpointing not in ACTIVATION_CHECKPOINTING:
            bad(f"activation_checkpointing={self.activation_checkpointing!r}; use one of "
                f"{', '.join(ACTIVATION_CHECKPOINTING)}")
        from gated_attention.util.errors import UserError, check_number

        try:  # numbers where they enter: finite, in range, integers where counts
            for name in ("seq_len", "batch_size", "grad_accum", "steps", "spike_window", "max_bad_steps",
                         "keep_checkpoints", "eval_batches", "eval_batch_size"):
                check_number(name, getattr(self, name), kind=int, min=1)
            for name in ("warmup_steps", "eval_every", "stats_every", "ckpt_every", "seed", "micro_batch"):
                check_number(name, getattr(self, name), kind=int, min=0)
            check_number("lr", self.lr, min=0.0, min_open=True)
            for name in ("min_lr", "weight_decay", "grad_clip", "spike_delta", "spike_noise_k"):
                check_number(name, getattr(self, name), min=0.0)
            for name in ("beta1", "beta2"):
                check_number(name, getattr(self, name), min=0.0, max=0.999999)
            check_number("eps", self.eps, min=0.0, min_open=True)
            check_number("wsd_decay_frac", self.wsd_decay_frac, min=0.0, max=1.0)
            check_number("retrieval_mix", self.retrieval_mix, min=0.0, max=1.0)
        except UserError as exc:
            bad(str(exc))
        if not isinstance(self.model_overrides, dict):
            bad("model_overrides must be a JSON object of model-config fields")
        if self.data_dir is not None and not isinstance(self.data_dir, str):
            bad(f"data_dir={self.data_dir!r} must be a path")
        if self.warmup_steps < 0:
            bad(f"warmup_steps={self.warmup_steps} must be >= 0")
        if not 0.0 <= self.wsd_decay_frac <= 1.0:
            bad(f"wsd_decay_frac={self.wsd_decay_frac} must be in [0, 1]")
        if self.min_lr > self.lr:
            bad(f"min_lr={self.min_lr} exceeds lr={self.lr}")
        if not 0.0 <= self.retrieval_mix <= 1.0:
            bad(f"retrieval_mix={self.retrieval_mix} must be in [0, 1]")
        if self.retrieval_mix > 0:
            if self.data != "corpus":
                bad("retrieval_mix needs data='corpus' (retrieval samples are written with the corpus tokenizer)")
            from .retrieval_mix import check_mix_tasks

            try:
                check_mix_tasks(self.retrieval_tasks)
            except ValueError as exc:
                bad(str(exc))
        return self

    def check_world(self, world_size: int, resolved_precision: str | None = None) -> None:
        """The global batch must split evenly over ranks and micro-batches (same math for any world size); bf16-params
        over several ranks needs FSDP2 (its policy reduces gradients in fp32; DDP would all-reduce bf16 ones).
        With `micro_batch` set, this is where grad_accum is derived for the world size the run starts at (a resumed
        run may start at another: grad_accum is in RESUMABLE_CHANGES)."""
        if self.micro_batch:
            self.grad_accum = accum_for(self.batch_size, world_size, self.micro_batch)
        if world_size > 1 and resolved_precision == "bf16-params" and self.dist != "fsdp":
            raise ValueError(f"precision bf16-params under torchrun needs dist=fsdp (FSDP2's MixedPrecisionPolicy keeps "
                             f"fp32 master weights and reduces gradients in fp32; dist={self.dist} would all-reduce "
                             "bf16 gradients); add --set dist=fsdp")
        if self.batch_size % (world_size * self.grad_accum):
            raise ValueError(
                f"batch_size={self.batch_size} is not divisible by world_size*grad_accum={world_size}*{self.grad_accum}; "
                f"pick a batch_size that is a multiple of {world_size * self.grad_accum}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        d = {k: v for k, v in d.items() if k not in RUN_RECORD_KEYS}  # train_config.json's records, not settings
        d = renamed(d, RENAMED_KEYS)
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown TrainConfig keys {unknown}; valid: {sorted(names)}")
        return cls(**d)


def renamed(d: dict, renames: dict) -> dict:
    """`d` with its keys stored under an older name read under today's (`renames`: old -> new; None drops a retired
    setting); a key stored under both names is an error."""
    out = {k: v for k, v in d.items() if k not in renames}
    for old, new in renames.items():
        if old in d and new is not None:
            if new in d:
                raise ValueError(f"settings hold both {old!r} and its new name {new!r}; keep {new!r}")
            out[new] = d[old]
    return out


def accum_for(batch_size: int, world_size: int, micro_batch: int) -> int:
    """Micro-batches per rank per step for a global batch split over `world_size` ranks in `micro_batch` rows."""
    if batch_size % (world_size * micro_batch):
        raise ValueError(f"batch_size={batch_size} is not divisible by world_size*micro_batch={world_size}*"
                         f"{micro_batch}; pick a micro_batch (or a world size) that divides it")
    return batch_size // (world_size * micro_batch)


# ---------------------------------------------------------------- presets (each derives from another)

def tiny() -> TrainConfig:
    """Seconds on a CPU: tests and smoke runs (synthetic data so nothing needs preparing)."""
    return TrainConfig(model="tiny", data="synthetic", seq_len=32, batch_size=8, steps=40, lr=3e-3, min_lr=3e-4,
                       warmup_steps=4, eval_batches=2, eval_batch_size=4, stats_every=10, spike_window=10,
                       ckpt_every=20, progress=False, tensorboard=False)


def small() -> TrainConfig:
    """The CPU default: the `small` model on the prepared corpus, minutes to an hour."""
    return replace(tiny(), model="small", data="corpus", seq_len=256, batch_size=16, steps=2000, lr=3e-3,
                   min_lr=3e-5, warmup_steps=100, eval_every=250, eval_batches=8, eval_batch_size=8, stats_every=50,
                   spike_window=50, ckpt_every=250, progress=True, tensorboard=True)


def small_stress() -> TrainConfig:
    """A high-LR, short-warm-up recipe for one `gattn train` run (the grid over gates x LRs is `gattn lab stability`)."""
    return replace(small(), lr=1e-2, min_lr=1e-4, warmup_steps=20, steps=500, eval_every=0, ckpt_every=100)


def tiny_stress() -> TrainConfig:
    return replace(tiny(), lr=3e-2, warmup_steps=2)


# ---- the paper's own recipes (paper map §4, ../shared/SPEC.md §4): the model shape + its hyperparameters, in the
# setup clusters train in: FSDP2 sharding, bf16 parameters with fp32 master weights and reductions, every decoder
# layer recomputed in backward. Global batch in sequences of 4096 tokens, one sequence per GPU per forward
# (micro_batch=1: grad_accum follows the world size). AdamW betas/eps/weight decay/clip are not in the paper: the
# project's defaults. `gattn plan --preset NAME` says how many GPUs a preset needs and how long it takes.

def _paper_common() -> TrainConfig:
    return replace(small(), seq_len=4096, micro_batch=1, warmup_steps=1000, schedule="cosine", min_lr=3e-5,
                   dist="fsdp", precision="bf16-params", activation_checkpointing="full", eval_every=2000,
                   eval_batches=8, eval_batch_size=4, stats_every=500, ckpt_every=1000)


def paper_dense_28l() -> TrainConfig:
    """1.7B dense, 28 layers, 400B tokens (Table 2 rows 1-2): max LR 4e-3, global batch 1024 x 4096 tokens, 95,367
    steps (400e9 / 4,194,304, the SPEC's derived ~95k). The 3.5T-token run (rows 3-4) is this preset with
    --set lr=4.5e-3 --set batch_size=2048 --set steps=417233."""
    return replace(_paper_common(), model="1.7b-28l", lr=4e-3, batch_size=1024, steps=95_367)


def paper_dense_48l() -> TrainConfig:
    """1.7B dense, 48 layers (d 1536), 400B tokens (Table 2 rows 5, 8, 9): max LR 4e-3, global batch 1024, 95,367
    steps. The stress rows: --set lr=8e-3 (rows 6, 10); 1T tokens at batch 4096: --set batch_size=4096
    --set steps=59605 --set lr=5.3e-3 (or 8e-3, rows 11-14)."""
    return replace(_paper_common(), model="1.7b-48l", lr=4e-3, batch_size=1024, steps=95_367)


def paper_moe_15a2b() -> TrainConfig:
    """15A2B MoE (128 experts, top-8), 400B tokens (Tables 1, 3, 4, 6): max LR 2e-3, global batch 1024, 100k steps.
    The load-balancing loss is global-batch (moe.py: expert counts summed over ranks and micro-batches, Qiu et al.
    2025) with Qwen3-MoE's weight 1e-3; the router z-loss weight 1e-3 is ST-MoE's (the paper gives no weights)."""
    return replace(_paper_common(), model="15a2b", lr=2e-3, batch_size=1024, steps=100_000,
                   model_overrides={"router_aux_loss_coef": 1e-3, "router_z_loss_coef": 1e-3})


TRAIN_PRESETS = {"tiny": tiny, "small": small, "small-stress": small_stress, "tiny-stress": tiny_stress,
                 "paper-dense-28l": paper_dense_28l, "paper-dense-48l": paper_dense_48l,
                 "paper-moe-15a2b": paper_moe_15a2b}


def train_preset(name: str) -> TrainConfig:
    if name not in TRAIN_PRESETS:
        raise ValueError(f"unknown training preset {name!r}; valid: {', '.join(TRAIN_PRESETS)}")
    return TRAIN_PRESETS[name]()


# ---------------------------------------------------------------- --set key=value

def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean (true/false), got {text!r}")


def _convert(text: str, tp, key: str):
    """Convert `text` to the annotated type `tp` (str | None, list[int], ...)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if text.strip().lower() in ("none", "null") and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(text, inner[0], key)
    if origin is list:
        if text.strip().startswith("["):
            items = json.loads(text)
        else:
            items = [t for t in text.split(",") if t.strip()]
        return [_convert(str(i), args[0] if args else str, key) for i in items]
    if origin is dict or tp is dict:
        val = json.loads(text)
        if not isinstance(val, dict):
            raise ValueError(f"{key}: expected a JSON object")
        return val
    if tp is bool:
        return _parse_bool(text)
    if tp is int:
        return int(float(text)) if ("e" in text.lower() and float(text).is_integer()) else int(text)
    if tp is float:
        return float(text)
    return text


def _convert_like(text: str, current, key: str):
    """Model-config values: convert to the type of the current value; JSON for anything structured."""
    if isinstance(current, bool):
        return _parse_bool(text)
    if isinstance(current, int):
        return int(text)
    if isinstance(current, float):
        return float(text)
    if isinstance(current, str):
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def apply_overrides(cfg: TrainConfig, sets: list[str], model_fields: dict | None = None) -> TrainConfig:
    """Apply `key=value` strings. `model.KEY=V` goes to model_overrides, checked against `model_fields`
    (name -> current value of the model config) when given."""
    hints = typing.get_type_hints(TrainConfig)
    names = [f.name for f in dataclasses.fields(TrainConfig)]
    changes: dict = {}
    model_over = dict(cfg.model_overrides)
    for item in sets:
        if "=" not in item:
            raise ValueError(f"--set {item!r}: expected key=value")
        key, text = item.split("=", 1)
        key = key.strip()
        if key.startswith("model."):
            mkey = key[len("model."):]
            if model_fields is not None and mkey not in model_fields:
                raise ValueError(f"--set {key}: unknown model-config field {mkey!r}; valid: "
                                 f"{', '.join(sorted(k for k in model_fields if not k.startswith('_')))}")
            try:
                model_over[mkey] = _convert_like(text, (model_fields or {}).get(mkey), key)
            except ValueError as exc:
                raise ValueError(f"--set {key}={text!r}: {exc}; give a value of the field's type") from None
            continue
        if key not in names or key == "model_overrides":
            raise ValueError(f"--set {key}: unknown training setting; valid: {', '.join(n for n in names if n != 'model_overrides')}"
                             " (model-config fields take a 'model.' prefix)")
        try:
            changes[key] = _convert(text, hints[key], key)
        except (ValueError, json.JSONDecodeError) as exc:
            raise ValueError(f"--set {key}={text!r}: {exc}") from None
    return replace(cfg, model_overrides=model_over, **changes).validate()


def config_from_args(preset: str, gate: str | None, sets: list[str], data_dir: str | None) -> TrainConfig:
    """A training preset with a gate, a corpus folder and `--set key=value` overrides (model.* keys checked)."""
    cfg = train_preset(preset)
    if gate is not None:
        cfg.gate = gate
    if data_dir is not None:
        # a corpus folder given means training on it: the `tiny` preset's synthetic data would otherwise ignore it
        cfg.data_dir, cfg.data = data_dir, "corpus" if cfg.data == "synthetic" else cfg.data
    from gated_attention.presets import model_config

    cfg = apply_overrides(cfg, sets, model_config(cfg.model, gate=cfg.gate).to_dict())
    if data_dir is not None and cfg.data == "synthetic":
        raise ValueError(f"--data-dir {data_dir} with --set data=synthetic: synthetic data reads no corpus; drop one")
    check_model(cfg)
    return cfg


def run_config(out: str, preset: str | None = None, gate: str | None = None, sets: list[str] = (),
               data_dir: str | None = None, resume: bool | str = False) -> TrainConfig:
    """The settings of `gattn train --out OUT [--resume [auto]]`. With resume and no preset: the saved run's own
    settings (OUT/train_config.json) plus `sets`, where a gate or corpus given again must be the saved one (never
    silently ignored). Otherwise the preset's (default `small`) with `gate`, `data_dir` and `sets`. resume="auto"
    is resume where OUT holds a saved run and a new run elsewhere (no error). The trainer then checks a resumed run's
    settings against its checkpoint (changed_settings)."""
    from pathlib import Path

    from ..util.errors import UserError
    from ..util.io import read_json_object

    saved = Path(out) / "train_config.json"
    if resume == "auto":
        resume = saved.exists()
    if resume and not saved.exists() and not (Path(out) / "checkpoints").is_dir():
        raise UserError(f"nothing to resume in {out} (no train_config.json, no checkpoints); drop --resume to start "
                        "a new run there")
    if not (resume and saved.exists() and preset is None):
        return config_from_args(preset or "small", gate, list(sets), data_dir)
    cfg = TrainConfig.from_dict(read_json_object(saved, "saved run settings", "restore it or use a new --out"))
    for flag, key, value in (("--gate", "gate", gate), ("--data-dir", "data_dir", data_dir)):
        if value is not None and _comparable(key, value) != _comparable(key, getattr(cfg, key)):
            raise UserError(f"--resume with {flag} {value} but the saved run has {key}={getattr(cfg, key)!r}; drop "
                            f"{flag} (or pass the saved value) or start a new --out")
    cfg = apply_overrides(cfg, list(sets))
    check_model(cfg)
    return cfg


def _comparable(key: str, value):
    """A setting given again with --resume, in the form it is compared in: the canonical gate name, the resolved
    corpus path."""
    from pathlib import Path

    if value is None:
        return None
    if key == "gate":
        from gated_attention.gates import canonical_name

        try:
            return canonical_name(value)
        except ValueError:
            return value
    return str(Path(value).resolve())


def check_model(cfg: TrainConfig) -> None:
    """Build the model config now (cheap), so a bad model.* override fails before anything is written."""
    if cfg.init_from:
        return  # the checkpoint's config.json decides; checked when it is loaded
    from gated_attention.presets import model_config

    model_config(cfg.model, gate=cfg.gate, **cfg.model_overrides)


# ---------------------------------------------------------------- "same run settings": the one rule

# fields that may differ between a run and its resumption or reuse (they do not change the numbers)
RESUMABLE_CHANGES = frozenset({"progress", "tensorboard", "ckpt_every", "keep_checkpoints", "compile", "fast", "dist",
                               "accum_grads",
                               "device", "attn_implementation", "activation_checkpointing",
                               "grad_accum", "micro_batch"})


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

    diff = [k for k, v in want.items() if k not in RESUMABLE_CHANGES and k not in ("precision", "resolved_precision")
            and not same(k, saved.get(k, defaults.get(k)), v)]
    if run_precision(saved) != run_precision(want):
        diff.append("precision")
    return sorted(diff)


def setting_differences(saved: dict, want: dict) -> list[str]:
    """`changed_settings` as readable items ("steps: saved 2 vs requested 3"); [] when the runs are the same."""
    defaults = TrainConfig().to_dict()

    def show(d: dict, k: str) -> str:
        if k == "precision":  # what was asked and what it ran / would run in
            return f"{d.get('precision', 'auto')!r} ({run_precision(d)})"
        return repr(d.get(k, defaults.get(k)))

    return [f"{k}: saved {show(saved, k)} vs requested {show(want, k)}" for k in changed_settings(saved, want)]


def describe_changes(saved: dict, want: dict) -> str:
    """`setting_differences` as one clause ("steps: saved 2 vs requested 3; lr: ..."), "" when none."""
    return "; ".join(setting_differences(saved, want))
