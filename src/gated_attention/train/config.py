"""TrainConfig: every knob of a training run, its checks, and how it is stored (to_dict / from_dict, with settings
stored under older names read through RENAMED_KEYS).

Its other jobs each have their own home: the presets in train/train_presets.py, the `--set key=value` parser (and a
command's settings from its arguments) in train/overrides.py, the rule of which settings make two runs different
(resume, reuse) in train/resume_rule.py. The comment beside each field below, with its `#` continuation lines, is
the setting's meaning as `gattn settings` shows it (train/settings.py reads it), and a `# --- name` line opens a group.
"""
from __future__ import annotations

import re

import dataclasses
from dataclasses import dataclass, field

from ..util.io import renamed
from .parallel_dims import ParallelDims


TRAINABLE = ("all", "gates")  # what the optimizer updates (train.model_setup.apply_trainable)
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "triton_gated")  # attention.KERNELS: what a training run may select
ACTIVATION_CHECKPOINTING = ("none", "full", "selective", "every:N")  # train.activation_checkpoint
ACCUM_GRADS = ("sharded", "auto")  # train.memory_decision.unsharded_accumulation
RESHARD_AFTER_FORWARD = ("default", "always", "never")  # train.fsdp_policy (torchtitan's policy names)
SAMPLERS = ("random", "epoch")  # corpus batch samplers (train.data_source.CorpusSource)
CHOICES = {  # setting -> (its allowed values, the hint of its error)
    "schedule": (("cosine", "wsd"), "use 'cosine' or 'wsd'"),
    "wsd_decay_shape": (("linear", "sqrt"), "use 'linear' or 'sqrt'"),
    "trainable": (TRAINABLE, f"use one of {', '.join(TRAINABLE)}"),
    "attn_implementation": (ATTN_IMPLEMENTATIONS,
                            f"use one of {', '.join(ATTN_IMPLEMENTATIONS)} (triton_gated needs a CUDA GPU)"),
    "data": (("corpus", "synthetic", "custom"), "use 'corpus' or 'synthetic' ('custom' is a lab's own source)"),
    "sampler": (SAMPLERS, f"use one of {', '.join(SAMPLERS)}"),
    "dist": (("ddp", "fsdp"), "use 'ddp' or 'fsdp'"),
    "accum_grads": (ACCUM_GRADS, f"use one of {', '.join(ACCUM_GRADS)}"),
    "reshard_after_forward": (RESHARD_AFTER_FORWARD, f"use one of {', '.join(RESHARD_AFTER_FORWARD)}"),
    "device": (("auto", "cpu", "cuda"), "use 'auto', 'cpu' or 'cuda'"),
}
# written beside the settings in train_config.json; not TrainConfig fields (the world size: an MoE run's micro-batch
# layout, train/resume_rule.py)
RUN_RECORD_KEYS = ("resolved_precision", "world_size")
# settings stored under an older name (train_config.json, a lab's lab.json): old -> new, or None for a retired one
RENAMED_KEYS = {"inject_nan_steps": None}  # fault injection moved to the tests' hooks (tests/probes/kill_hooks.py)


@dataclass
class TrainConfig:
    # --- what to train
    model: str = "small"  # model preset name (gated_attention.presets.model_config)
    gate: str = "none"  # gate registry name; "none" (alias "baseline") is the ungated model
    model_overrides: dict = field(default_factory=dict)  # extra GatedQwen3Config fields (from --set model.KEY=V)
    init_from: str | None = None  # continued training: load this checkpoint dir (its config sets the model)
    ffn_multiple: int = 0  # a gated dense model's FFN, shrunk to parameter parity, is rounded to a multiple of this
    # (halved while the 0.1 % parity needs: presets.parity_width); 0 = the model preset's own (128 for the 1.7B
    # shapes, 1 = the exact width for the CPU shapes)
    trainable: str = "all"  # "all" parameters, or only the "gates" (cheap fine-tuning of a retrofitted gate)
    # --- data
    data: str = "corpus"  # "corpus" (gattn data prepare output), "synthetic" (built-in Markov tokens, for tests) or
    # "custom" (a lab's own task: the source passed in train(..., plugins=Plugins(source=...)), train/plugins.py)
    data_dir: str | None = None  # corpus directory; None = the data module's default
    domains: list[str] | None = None  # train on these domains only; None = all
    seq_len: int = 256  # tokens per sequence (inputs); each sample holds seq_len+1 tokens
    sampler: str = "random"  # corpus windows: "random" (drawn with replacement: the default every recorded result
    # used) or "epoch" (every window once per epoch in a new seeded order; data/epoch.py). Both are pure functions of
    # (seed, step), so resume is exact at any world size
    pack_documents: bool = False  # sampler=epoch: read documents packed with a <|bos|> before each (rows start
    # anywhere, not always at <|bos|>); false = windows of the stored stream, each row <|bos|> + seq_len tokens
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
    beta1: float = 0.9  # AdamW's first-moment (momentum) decay
    beta2: float = 0.95  # 0.95 rather than 0.999: the usual LLM choice, less prone to late spikes
    eps: float = 1e-8  # AdamW's epsilon, added to the root of the second moment
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
    # per step) only where `gattn plan` says they fit this rank's memory (train.memory_decision)
    reshard_after_forward: str = "default"  # dist=fsdp: which shard groups free their gathered parameters after
    # forward (train/fsdp_policy.py): "default" every decoder layer but the last, not the root (torchtitan's);
    # "always" every group (least memory, most all-gathers); "never" none (the whole model gathered until backward)
    fsdp_prefetch: int = 0  # dist=fsdp: layers all-gathered ahead explicitly in forward and backward; 0 = FSDP2's
    # implicit prefetch (one layer, issued when reached). More overlap on a GPU, N + 1 layers gathered at once
    keep_gathered: str = "false"  # dist=fsdp with grad_accum > 1: keep the gathered parameters across the step's
    # micro-batches (one all-gather per group per step, the whole model unsharded all step): "true", "false", or
    # "auto" where `gattn plan` says it fits this rank's memory (train.fsdp_policy.gather_policy)
    expert_parallel: int = 1  # dist=fsdp: each MoE layer's routed experts sharded over E ranks, tokens sent to
    # their experts' ranks by all-to-all (train/expert_parallel.py); E divides the experts and world / dp_replicate
    dp_replicate: int = 1  # dist=fsdp: R replicas of the model (HSDP): sharded within groups of world / R ranks,
    # replicated across the R groups (gradient shards all-reduced between them); 1 = plain FSDP over every rank
    activation_checkpointing: str = "none"  # "full": each decoder layer keeps only its input and recomputes itself in
    # backward (activations: one (B, T, d) tensor per layer + one layer's worth, for ~1/3 more compute); "selective":
    # each layer keeps its GEMM and attention outputs and recomputes only the cheap ops between them (norms, RoPE,
    # gates, SwiGLU); "every:N": "full" on every N-th layer (0, N, 2N, ...), the others keep everything (docs/scale.md)
    seed: int = 0  # model init and data order; the batch at step s is a function of (seed, s)
    gc_every: int = 50  # Python's automatic garbage collection off during training, a full collection every N steps
    # on every rank at the same step instead (train/runtime.py): a collection left automatic pauses one rank at a
    # time and the others wait for it in the next collective; 50 is torchtitan's; 0 = Python's automatic collection
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
    collective_timeout_s: float = 0.0  # under torchrun: how long a rank waits in one collective before it fails
    # (0 = PyTorch's default: 10 min NCCL, 30 min gloo); longer where rank 0's lone work between collectives (a
    # checkpoint commit on a slow shared filesystem) takes longer, shorter to turn a stalled node into a restart sooner
    async_checkpoint: bool = False  # dist=fsdp: a periodic checkpoint is staged (copied to CPU memory) and written by
    # a background thread while training goes on, committed before the next save (docs/scale.md); false = blocking
    progress: bool = True  # rank 0: tqdm bar on a terminal, else a line every GATTN_PROGRESS_INTERVAL s (util/progress.py)
    tensorboard: bool = True  # write TensorBoard events if tensorboard is installed
    peak_tflops: float = 0.0  # one device's peak for the logged MFU; 0 = the nominal GPU figure (train/metrics.py's
    # table) or, on a CPU, a GEMM measured once at startup
    profile_steps: str = ""  # "A-B": torch.profiler trace of log steps A..B on every rank into OUT/profile/ ("" = none)

    def validate(self) -> "TrainConfig":
        """One clear error (UserError) for the first bad setting; returns self (compile normalised)."""
        from gated_attention.util.errors import UserError

        try:
            self._check_choices()
            self._check_numbers()
            self._check_gather_policy()
            self._check_data()
        except (UserError, ValueError) as exc:
            raise UserError(f"invalid training config: {exc}") from None
        return self

    def _check_choices(self) -> None:
        """Every setting that takes one of a few names (CHOICES), the precision and the compile setting."""
        from gated_attention.util import precision as P

        from .fastpath import compile_choice
        from .fsdp_policy import keep_choice

        for key, (allowed, hint) in CHOICES.items():
            if getattr(self, key) not in allowed:
                raise ValueError(f"{key}={getattr(self, key)!r}; {hint}")
        checkpointing_mode(self.activation_checkpointing)
        P.check(self.precision)
        self.compile = compile_choice(self.compile)  # also accepts the bools older train_config.json files hold
        self.keep_gathered = keep_choice(self.keep_gathered)  # a JSON true / false too

    def _check_numbers(self) -> None:
        """Numbers where they enter: finite, in range, integers where counts."""
        from gated_attention.util.errors import check_number

        for name in ("seq_len", "batch_size", "grad_accum", "steps", "spike_window", "max_bad_steps",
                     "keep_checkpoints", "eval_batches", "eval_batch_size", "expert_parallel", "dp_replicate"):
            check_number(name, getattr(self, name), kind=int, min=1)
        for name in ("warmup_steps", "eval_every", "stats_every", "ckpt_every", "seed", "micro_batch", "fsdp_prefetch",
                     "ffn_multiple", "gc_every"):
            check_number(name, getattr(self, name), kind=int, min=0)
        check_number("lr", self.lr, min=0.0, min_open=True)
        for name in ("min_lr", "weight_decay", "grad_clip", "spike_delta", "spike_noise_k"):
            check_number(name, getattr(self, name), min=0.0)
        for name in ("beta1", "beta2"):
            check_number(name, getattr(self, name), min=0.0, max=0.999999)
        check_number("eps", self.eps, min=0.0, min_open=True)
        check_number("wsd_decay_frac", self.wsd_decay_frac, min=0.0, max=1.0)
        check_number("retrieval_mix", self.retrieval_mix, min=0.0, max=1.0)
        check_number("peak_tflops", self.peak_tflops, min=0.0)
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr={self.min_lr} exceeds lr={self.lr}")

    def _check_gather_policy(self) -> None:
        """FSDP2's gather policy (train/fsdp_policy.py) means nothing to DDP: set away from its default, it needs
        dist=fsdp (as dp_replicate and expert_parallel do)."""
        asked = [f"{k}={getattr(self, k)}" for k, off in (("reshard_after_forward", "default"), ("fsdp_prefetch", 0),
                                                          ("keep_gathered", "false")) if getattr(self, k) != off]
        if asked and self.dist != "fsdp":
            raise ValueError(f"{', '.join(asked)} needs dist=fsdp (FSDP2's gather policy; DDP keeps whole parameters "
                             "on every rank); add --set dist=fsdp")

    def _check_data(self) -> None:
        """The model and data settings that are not plain names or numbers."""
        if not isinstance(self.model_overrides, dict):
            raise ValueError("model_overrides must be a JSON object of model-config fields")
        if self.data_dir is not None and not isinstance(self.data_dir, str):
            raise ValueError(f"data_dir={self.data_dir!r} must be a path")
        if self.retrieval_mix > 0:
            if self.data != "corpus":
                raise ValueError("retrieval_mix needs data='corpus' (retrieval samples are written with the corpus "
                                 "tokenizer)")
            from .retrieval_mix import check_mix_tasks

            check_mix_tasks(self.retrieval_tasks)
        parse_profile_steps(self.profile_steps)
        if self.sampler == "epoch" and self.data != "corpus":
            raise ValueError(f"sampler='epoch' needs data='corpus' (data={self.data!r} brings its own batches)")
        if not isinstance(self.pack_documents, bool):
            raise ValueError(f"pack_documents={self.pack_documents!r} must be true or false")
        if not isinstance(self.collective_timeout_s, (int, float)) or self.collective_timeout_s < 0:
            raise ValueError(f"collective_timeout_s={self.collective_timeout_s!r} must be a number of seconds >= 0 "
                             "(0 = PyTorch's default)")
        if not isinstance(self.async_checkpoint, bool):
            raise ValueError(f"async_checkpoint={self.async_checkpoint!r} must be true or false")
        if self.async_checkpoint and self.dist != "fsdp":
            raise ValueError(f"async_checkpoint=true needs dist=fsdp (an asynchronous save is DCP's sharded one; "
                             f"dist={self.dist} writes a gathered state.pt); add --set dist=fsdp or drop async_checkpoint")
        if self.pack_documents and self.sampler != "epoch":
            raise ValueError("pack_documents=true needs sampler='epoch' (the random sampler reads the stored stream)")

    def check_world(self, world_size: int, resolved_precision: str | None = None) -> ParallelDims:
        """The global batch must split evenly over ranks and micro-batches (same math for any world size); bf16-params
        over several ranks needs FSDP2 (its policy reduces gradients in fp32; DDP would all-reduce bf16 ones); the
        replicas and expert parallelism must tile the ranks (returns that layout: parallel_dims.ParallelDims).
        With `micro_batch` set, this is where grad_accum is derived for the world size the run starts at (a resumed
        run may start at another: grad_accum is in RESUMABLE_CHANGES)."""
        if self.micro_batch:
            self.grad_accum = accum_for(self.batch_size, world_size, self.micro_batch)
        if world_size > 1 and resolved_precision == "bf16-params" and self.dist != "fsdp":
            raise ValueError(f"precision bf16-params under torchrun needs dist=fsdp (FSDP2's MixedPrecisionPolicy keeps "
                             f"fp32 master weights and reduces gradients in fp32; dist={self.dist} would all-reduce "
                             "bf16 gradients); add --set dist=fsdp")
        dims = ParallelDims.of(self, world_size)
        if self.batch_size % (world_size * self.grad_accum):
            raise ValueError(
                f"batch_size={self.batch_size} is not divisible by world_size*grad_accum={world_size}*{self.grad_accum}; "
                f"pick a batch_size that is a multiple of {world_size * self.grad_accum}")
        return dims

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


def checkpointing_mode(value) -> tuple[str, int]:
    """An `activation_checkpointing` setting as (kind, every): "none" -> ("none", 0), "full" -> ("full", 1),
    "selective" -> ("selective", 1), "every:N" -> ("full", N) (layers 0, N, 2N, ... checkpointed). ValueError with the
    valid forms otherwise."""
    hint = ("use 'none', 'full', 'selective' (keep GEMM and attention outputs, recompute the rest) or 'every:N' "
            "(full checkpointing of every N-th layer, N >= 2)")
    if value in ("none", "full", "selective"):
        return value, 0 if value == "none" else 1
    m = re.fullmatch(r"every:(\d+)", value) if isinstance(value, str) else None
    if m is None:
        raise ValueError(f"activation_checkpointing={value!r}; {hint}")
    if int(m.group(1)) < 2:
        raise ValueError(f"activation_checkpointing={value!r}: N must be at least 2 ('full' checkpoints every layer); "
                         f"{hint}")
    return "full", int(m.group(1))


def accum_for(batch_size: int, world_size: int, micro_batch: int) -> int:
    """Micro-batches per rank per step for a global batch split over `world_size` ranks in `micro_batch` rows."""
    if batch_size % (world_size * micro_batch):
        raise ValueError(f"batch_size={batch_size} is not divisible by world_size*micro_batch={world_size}*"
                         f"{micro_batch}; pick a micro_batch (or a world size) that divides it")
    return batch_size // (world_size * micro_batch)


def parse_profile_steps(text: str) -> tuple[int, int] | None:
    """'' -> None; 'A' -> (A, A); 'A-B' -> (A, B) with 0 <= A <= B; anything else: ValueError naming the form."""
    text = (text or "").strip()
    if not text:
        return None
    m = re.fullmatch(r"(\d+)(?:-(\d+))?", text)
    if not m or (m.group(2) is not None and int(m.group(2)) < int(m.group(1))):
        raise ValueError(f"profile_steps={text!r}; use A-B (log.jsonl step numbers, A <= B) or a single step A")
    return int(m.group(1)), int(m.group(2) if m.group(2) is not None else m.group(1))
