"""The run before it is paid for (`gattn plan`): size, FLOPs, memory per GPU, fit and time of a training config.

`plan(cfg, ...)` builds the model on the meta device (shapes only: seconds, no memory, any size) and reports
  - params_total / params_activated: every stored parameter (tied ones once); activated counts the k routed experts of
    each MoE layer in place of all E (presets.param_report's convention, which the test checks it against);
  - flops_per_token: MODEL FLOPs of one training token, 6 x activated matmul parameters (every Linear including the
    lm_head, the router, k experts) + causal attention 6 * L * H * D * (T + 1) (the QK^T and AV products over the
    average (T+1)/2 keys, forward + 2x backward) - bench/bench_train.py's `train_flops` count. Full
    activation checkpointing recomputes the layers' forward once more (every:N: the checkpointed layers'; selective:
    no GEMM): `hardware_flops_per_token` counts that too, MFU does not;
  - memory_per_gpu_gb by part, in GB (1e9 bytes), per rank:
      params      the stored weights: fp32 (4 B); bf16-params in one process adds the bf16 compute copy (2 B,
                  train/mixed_precision.py); FSDP2 shards them over the ranks (4 B / N: the fp32 masters); with
                  replicas (HSDP, dp_replicate=R) over the N / R ranks of a shard group, and so grads and optimizer;
                  the routed experts' fused (E, ., .) tensors (E_l = E / expert_parallel local experts over the
                  experts' own FSDP2 group of N / (R expert_parallel) ranks, the shard group without expert
                  parallelism) are placed as the trainer places them (parallel_dims.expert_shard_dim): whole
                  experts (Shard(0)) where the group divides the E_l experts, else split on dim 1 (Shard(1), or 2
                  where only that divides): 1 / group of them per rank either way; where neither divides, ceil(E_l /
                  group) whole experts, padded (`expert_share`);
      grads       fp32 gradients of the trainable parameters by the accumulation policy
                  (train.memory_decision, which the trainer follows): FSDP2 reduce-scattering every
                  micro-batch holds the sharded fp32 output (4 B / N); keeping whole gradients until the last
                  micro-batch (accum_grads=auto, only where that fits) holds them whole plus the sharded output
                  (4 B + 4 B / N; whole for this rank's parameters: under expert parallelism its own E_l experts);
                  DDP and one process hold them whole (4 B);
      optimizer   AdamW's two fp32 moments (8 B per trainable parameter, / N under FSDP2);
      activations what the forward saves for backward for one micro-batch of micro_batch x seq_len tokens, plus one
                  layer's worth of backward working memory (the formula: `activation_bytes`, calibrated against the
                  tensors autograd actually saves - tests/test_plan.py counts them; under expert parallelism the
                  MoE layers' routed rows with plan_activations.ROUTED_ALLOWANCE for imbalance); with full activation
                  checkpointing every layer keeps only its input (every:N: every N-th layer), with selective its
                  input and its GEMM and attention outputs (`selective_layer_bytes`), and one layer is recomputed
                  at a time;
      buffers     communication buffers: FSDP2's unsharded parameters in the compute dtype (the root group -
                  embeddings, final norm, head - for the whole step, plus the decoder layers the gather policy holds
                  gathered at once, train.fsdp_policy.peak_gathered_layers: the current and the prefetched layer by
                  default, N + 1 with fsdp_prefetch=N, every layer with reshard_after_forward=never or keep_gathered;
                  under EP a layer gathers only its rank's 1 / E of the routed experts) and, in the backward only
                  (`backward_buffers`), the root's and one layer's unsharded gradients; DDP's gradient buckets (a
                  second fp32 copy of the gradients); none in one process;
      loss        the chunked loss's temporaries at the model's vocabulary (fast path): per chunk of c tokens
                  (fused.loss_chunk_tokens: as many as fit fused.LOSS_CHUNK_BYTES) its fp32 (c, V) logits, their
                  compute-dtype copy and their gradient, the (V, d) fp32 product a bf16 chunk adds into the head
                  gradient (fp32 accumulates in place), and a compute-dtype copy of the head weight
                  where the compute dtype differs from the stored one; the plain loss (fast=false): its fp32 (b, T, V)
                  logits and their gradient;
      stats       the stats step's snapshot of the trainable parameters (fp32, this rank's shards; stats_every > 0);
      overhead    the runtime itself: CUDA context and NCCL on a GPU (GPU_OVERHEAD_GB); the imported libraries on
                  a CPU (CPU_OVERHEAD_GB, measured: docs/scale.md);
      eval        evaluation's loss temporaries: it scores through the chunked loss without gradient (no
                  (B, T, V) logits): one chunk's compute-dtype logits and their fp32 copy, each token's fp32 loss,
                  under bf16 autocast a bf16 copy of the head weight (the paper presets' (4, 4096) batch at
                  V = 151,936: 0.27 GB); evaluation runs between steps, with no gradients and no graph;
      total       the larger of one training step (params + grads + optimizer + activations + loss + stats +
                  buffers + overhead, less the smaller of the fused loss's temporaries, which live in the forward,
                  and FSDP2's unsharded gradients, `backward_buffers`, which live in the backward) and evaluation
                  (params + optimizer + buffers - backward_buffers + overhead + eval). MoE layers' dispatch
                  buffers (each routed token's copy in and out of its expert, the experts' hidden activations) are
                  in `activations` (saved per routed slot, and one layer's worth again as the backward's working
                  memory), not a part of their own;
      margin      on a GPU, MARGIN_FRACTION of its memory kept free for the caching allocator's reserve and
                  fragmentation: `fits` is total + margin <= the GPU's memory, and the `auto` decisions (whole
                  gradients, parameters kept gathered) engage only where they leave it free.
  - communication per step (`comm_per_step`): bytes one GPU moves and their time, each collective's α-β cost on
    the machine's two levels (train/plan_comm.py: NVLink inside a node, the network across nodes, where each group's
    ranks sit): FSDP2 all-gathers each group's parameters as the gather policy says (train.fsdp_policy:
    all_gathers_per_step, also `all_gathers`, the collectives' count: by default twice per micro-batch for every
    decoder layer but the last - forward, and again in backward - and once for the last layer and the root; twice
    for every group with reshard_after_forward=always, once with never, once per step with keep_gathered) in the
    compute dtype and reduce-scatters fp32 gradients once per micro-batch (or once per step where whole gradients
    are kept), each moving (S-1)/S of the tensor over a shard group of S = N / R ranks; HSDP then all-reduces each
    rank's gradient shard across the R replicas (2 (R-1)/R, one rank per shard group: across nodes where a shard
    group fills one); under EP the routed experts' gathers and reductions run over their own N / (R E) ranks, and
    every MoE layer all-to-alls each token's k rows of d activations out to their experts and back, in forward,
    backward and the recompute (`all_to_all_bytes`: (E-1)/E of them leave the rank under balanced routing; not
    overlapped: it adds to the step); DDP all-reduces the fp32 gradients once per step in 25 MiB buckets;
    none in one process;
  - tokens_per_s: the global batch's tokens over the step time, the larger of the compute time (the FLOPs the GPUs
    run, recompute included, at mfu * gpu_tflops on every GPU) and the communication time (FSDP2 and DDP overlap the
    two; the larger one bounds the step) plus EP's all-to-all time, and days to the recipe's token budget (steps x
    global batch x seq_len) at that speed; `mfu`: the model FLOPs of a step over its time at the GPUs' peak (below
    the assumed one where recompute or communication costs time).

The formulas model this project's trainer (the fused fast path by default, sdpa's flash kernel that keeps no T x T
matrix, FSDP2 with one group per decoder layer); docs/scale.md compares them with the peak memory measured on this
machine. torch.compile (compile=auto on a long run) saves fewer activations than eager, so a compiled run needs at
most what the plan says.

The plan makes the run's memory decisions (train/memory_decision.py: whole gradients or sharded ones, parameters
kept gathered or not, under its checkpointing mode) with this memory model; `plan_and_decide` returns them beside the
plan. `check_fits(cfg, ...)` is the trainer's check before anything is allocated: a config the plan says cannot fit
the memory this machine has stops with one line naming `gattn plan`; one that fits gets the plan's `MemoryDecision`,
which the trainer hands to parallelize as it is. Nothing here is imported by the model.
"""
from __future__ import annotations

import math
import os
from dataclasses import replace

import torch
from torch import nn

from . import fsdp_policy as FP
from .config import TrainConfig, accum_for, checkpointing_mode
from . import plan_hardware
from .memory_decision import GB, MemoryDecision, decide
from .parallel_dims import ParallelDims, expert_shard_dim
from .plan_activations import (  # noqa: F401 - the activation model, re-exported: plan.activation_bytes, ...
    activation_bytes, checkpointed_layers, layer_activation_bytes, layer_kept_bytes, recompute_share,
    selective_layer_bytes, GATE_COEF, LAYER_COEF, REST_COEF, ROUTED_ALLOWANCE)
from .plan_comm import Topology, comm_per_step, topology

GPU_OVERHEAD_GB = 2.0  # CUDA context (~0.5 GB) and NCCL's buffers per GPU
MARGIN_FRACTION = 0.08  # of a GPU's memory, kept free for the caching allocator's reserve and fragmentation
CPU_OVERHEAD_GB = 0.5  # a rank's RSS after importing torch + transformers + this package (0.47-0.48 GB, docs/scale.md)
DEFAULTS = plan_hardware.DEFAULTS  # one 8 x H100-80GB node (its own module: the CLI shows it without torch)
JSON_KEYS = ("params_total", "params_activated", "flops_per_token", "memory_per_gpu_gb", "fits", "tokens_per_s",
             "days")  # the documented contract; more keys follow them
MEMORY_KEYS = ("params", "grads", "optimizer", "activations", "loss", "stats", "buffers", "overhead", "eval",
               "total")
STEP_KEYS = ("params", "grads", "optimizer", "activations", "loss", "stats", "buffers", "overhead")  # in one step
EVAL_KEYS = ("params", "optimizer", "buffers", "overhead", "eval")  # held while evaluating (no gradients, no graph)


# ---------------------------------------------------------------- the model on the meta device

def meta_model(cfg: TrainConfig, vocab_size: int | None = None) -> nn.Module:
    """The model `cfg` trains, built on the meta device: every parameter has its shape and dtype, none has storage."""
    from gated_attention.modeling import GatedQwen3ForCausalLM

    from .model_setup import apply_trainable, build_model_config

    if cfg.init_from:
        from gated_attention.configuration import GatedQwen3Config
        from gated_attention.util.io import check_hf_dir

        check_hf_dir(cfg.init_from, "init_from")  # not a model folder: one line, not the default config's plan
        config = GatedQwen3Config.from_pretrained(cfg.init_from, **cfg.model_overrides)
    else:
        config = build_model_config(cfg, vocab_size)
    with torch.device("meta"):
        model = GatedQwen3ForCausalLM(config)
    apply_trainable(model, cfg.trainable)
    return model


def _unique(params) -> list[nn.Parameter]:
    seen, out = set(), []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def sizes(model: nn.Module) -> dict:
    """Parameter counts of a (meta) model: total, activated, trainable, activated matmul parameters, the largest
    decoder layer and the root group (what is not in a decoder layer)."""
    from gated_attention.moe import MoeExperts, MoeRouter

    config = model.config
    params = _unique(model.parameters())
    total = sum(p.numel() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    k_over_e = (config.num_experts_per_tok / config.num_experts) if config.num_experts else 1.0
    inactive = sum(p.numel() for m in model.modules() if isinstance(m, MoeExperts) for p in m.parameters())
    activated = total - round(inactive * (1 - k_over_e))
    matmul = 0
    for m in model.modules():  # every GEMM weight once per token; the embedding lookup is not a matmul
        if isinstance(m, nn.Linear):
            matmul += m.weight.numel()
        elif isinstance(m, MoeRouter):
            matmul += m.weight.numel()
        elif isinstance(m, MoeExperts):
            matmul += round(sum(p.numel() for p in m.parameters()) * k_over_e)
    layers = list(model.model.layers)
    per_layer = [sum(p.numel() for p in _unique(layer.parameters())) for layer in layers]
    layer_experts = [sum(p.numel() for m in layer.modules() if isinstance(m, MoeExperts) for p in m.parameters())
                     for layer in layers]
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    root = sum(p.numel() for p in params if id(p) not in in_layers)
    experts = [m for m in model.modules() if isinstance(m, MoeExperts)]
    expert_ps = _unique(p for m in experts for p in m.parameters())
    return {"total": total, "activated": activated, "trainable": trainable, "matmul_activated": matmul,
            "layer_max": max(per_layer, default=0), "root": root,
            "experts": sum(p.numel() for p in expert_ps),  # the routed experts' weights (expert parallelism's part)
            "experts_trainable": sum(p.numel() for p in expert_ps if p.requires_grad),
            "layer_experts_max": max((sum(p.numel() for p in m.parameters()) for m in experts), default=0),
            "expert_shapes": {n: tuple(p.shape) for n, p in experts[0].named_parameters()} if experts else {},
            "layers": per_layer, "layer_experts": layer_experts,  # per decoder layer: FSDP2's groups (the gathers)
            "moe_layers": len(experts)}


def flops_per_token(config, matmul_activated: int, seq_len: int) -> dict:
    """Model FLOPs per training token (6N + causal attention) and the hardware FLOPs with one more forward of every
    layer when activation checkpointing recomputes it."""
    L, H, D = config.num_hidden_layers, config.num_attention_heads, config.head_dim
    attention = 6 * L * H * D * (seq_len + 1)  # 3 x (2 GEMMs x 2 FLOPs x H*D x (T+1)/2 keys) per layer
    return {"model": 6 * matmul_activated + attention, "attention": attention,
            "forward": 2 * matmul_activated + attention // 3}


# ---------------------------------------------------------------- the plan

def _resolved(precision: str, dist: str) -> str:
    """The precision a GPU run computes in ('auto' on a CUDA GPU with bf16: bf16-params under FSDP, else bf16)."""
    if precision == "auto":
        return "bf16-params" if dist == "fsdp" else "bf16"
    return precision


def expert_share(sz: dict, n: int, ep: int = 1) -> float:
    """The share of the routed experts' weights one rank of a shard group of `n` ranks stores (module docstring:
    params), padding included: with `ep`-way expert parallelism E_l = E / ep experts over the experts' own n / ep
    ranks, each fused tensor (`sizes`' expert_shapes) on the dim parallel_dims.expert_shard_dim picks, as the
    trainer shards it."""
    shapes = list(sz["expert_shapes"].values())
    if n <= 1 or not shapes:
        return 1.0 / max(n, 1)
    group = n // ep
    stored = 0
    for E, a, b in shapes:
        local = (E // ep, a, b)
        dim = expert_shard_dim(local, group)
        stored += math.prod(local) // local[dim] * math.ceil(local[dim] / group)  # FSDP2 pads every rank's chunk
    return stored / sum(math.prod(s) for s in shapes)


def memory(sz: dict, config, *, world: int, dist: str, precision: str, checkpointing: str, tokens: int,
           fused_loss: bool = True, device: str = "cuda", unsharded_grads: bool = False, stats: bool = False,
           eval_tokens: int = 0, replicate: int = 1, ep: int = 1, gathered_layers: int = 2,
           gpu_memory_gb: float = 0.0) -> dict:
    """Bytes per rank by part (module docstring), in GB. unsharded_grads: FSDP2 keeps whole gradients across the
    micro-batches (train.memory_decision.decide said so); gathered_layers: decoder layers FSDP2 holds gathered at
    once (train.fsdp_policy.peak_gathered_layers). replicate (HSDP): the state is sharded over a shard
    group of world / replicate ranks; ep: the routed experts are sharded over ep ranks x the experts' own FSDP2 over
    the rest of the shard group (`expert_share`, placed as the trainer places them), and a layer's gathered experts are
    1 / ep of them; gpu_memory_gb: the device's memory, of which a GPU keeps MARGIN_FRACTION free (`margin`)."""
    P, Pt, X, Xt = sz["total"], sz["trainable"], sz["experts"], sz["experts_trainable"]
    sharded = dist == "fsdp" and world > 1
    one_process = world == 1
    n = world // replicate if sharded else 1
    share = expert_share(sz, n, ep)
    held, held_t = (P - X) / n + X * share, (Pt - Xt) / n + Xt * share  # what this rank stores
    whole_t = Pt - Xt * (1 - 1 / ep)  # this rank's whole gradients: under EP its own experts' only
    pd = 2 if precision == "bf16-params" else 4  # the dtype forward/backward see the parameters in
    params = 4 * held + (2 * P if precision == "bf16-params" and one_process else 0)
    grads = 4 * held_t + (4 * whole_t if sharded and unsharded_grads else 0)
    optimizer = 8 * held_t
    backward_only = 0.0  # of the buffers, what exists only in the backward (FSDP2's unsharded gradients)
    if sharded:  # root group unsharded all step, the layers held gathered; in the backward their unsharded grads
        layer = sz["layer_max"] - sz["layer_experts_max"] * (1 - 1 / ep)  # EP gathers only this rank's experts
        every_layer = P - sz["root"] - X * (1 - 1 / ep)
        backward_only = sz["root"] * pd + layer * (pd + 4)  # the root's and one layer's gradient (+ fp32 reduce input)
        buffers = sz["root"] * pd + min(gathered_layers * layer, every_layer) * pd + backward_only
    elif dist == "ddp" and not one_process:
        buffers = 4 * Pt  # gradient buckets (gradient_as_bucket_view=False: a copy of every gradient, all run long)
    else:
        buffers = 0.0
    routed = ROUTED_ALLOWANCE if ep > 1 else 1.0  # a rank computes the rows routed to its experts: not balanced
    act = activation_bytes(config, tokens, precision, checkpointing, fused_loss, routed, ep)["total"]
    overhead = (GPU_OVERHEAD_GB if device == "cuda" else CPU_OVERHEAD_GB) * GB
    parts = {"params": params, "grads": grads, "optimizer": optimizer, "activations": act,
             "loss": loss_temporaries(config, tokens, precision, fused_loss),
             "stats": 4 * held_t if stats else 0.0, "buffers": buffers, "overhead": overhead,
             "eval": eval_bytes(config, eval_tokens, precision)}
    # the fused loss's temporaries live in the forward (it computes its gradients there), FSDP2's unsharded gradients
    # in the backward: a step holds the larger of the two, never both; evaluation has no backward
    apart = min(parts["loss"], backward_only) if fused_loss else 0.0
    parts["total"] = max(sum(parts[k] for k in STEP_KEYS) - apart, sum(parts[k] for k in EVAL_KEYS) - backward_only)
    parts["backward_buffers"] = backward_only
    parts["margin"] = MARGIN_FRACTION * gpu_memory_gb * GB if device == "cuda" else 0.0
    return {k: v / GB for k, v in parts.items()}


def loss_temporaries(config, tokens: int, precision: str, fused_loss: bool = True) -> float:
    """Bytes the loss allocates beyond what `activations` counts (module docstring: loss)."""
    V, d = config.vocab_size, config.hidden_size
    if not fused_loss:
        return 2 * 4 * tokens * V  # fp32 logits' gradient and the softmax cross-entropy computes
    import torch

    from ..fused import loss_chunk_tokens

    compute = torch.float32 if precision == "fp32" else torch.bfloat16
    c = min(tokens, loss_chunk_tokens(V, compute))
    copy = 0 if precision == "fp32" else 2
    cast = 2 * V * d if precision == "bf16" else 0  # autocast: a bf16 copy of the fp32 head weight
    # one chunk's (c, V) fp32 logits, their compute-dtype copy and their gradient; the (V, d) fp32 product a bf16
    # GEMM that cannot write fp32 adds per chunk (fp32 accumulates in place: none)
    return (4 + copy + 4) * c * V + (4 * V * d if precision != "fp32" else 0) + cast


def eval_bytes(config, tokens: int, precision: str) -> float:
    """Evaluation's loss temporaries for `tokens` tokens (module docstring: eval): the chunked loss without gradient
    (train/evaluate.py): one chunk's compute-dtype logits and their fp32 copy, each token's fp32 loss, and under bf16
    autocast a bf16 copy of the fp32 head weight."""
    import torch

    from ..fused import loss_chunk_tokens

    V, d = config.vocab_size, config.hidden_size
    compute = torch.float32 if precision == "fp32" else torch.bfloat16
    c = min(tokens, loss_chunk_tokens(V, compute))
    copy = 0 if precision == "fp32" else 2  # in fp32 the logits are already the fp32 tensor
    cast = 2 * V * d if precision == "bf16" else 0
    return (copy + 4) * c * V + 4 * tokens + cast


def all_to_all_bytes(config, *, tokens: int, precision: str, ep: int, checkpointing: str) -> tuple[float, int]:
    """(bytes one rank sends in one all-to-all, such exchanges per micro-batch of `tokens` tokens) under expert
    parallelism (module docstring: comm): in every MoE layer each token's k rows of d activations go out to their
    experts' ranks and come back (dispatch + combine), again for their gradients in backward, and once more where
    activation checkpointing recomputes the forward (not under "selective": it keeps the all-to-alls' outputs);
    (ep - 1) / ep of the rows leave the rank under balanced routing."""
    if ep <= 1 or not config.num_experts:
        return 0.0, 0
    moe = [i for i in range(config.num_hidden_layers) if config.is_moe_layer(i)]
    replayed = set() if checkpointing_mode(checkpointing)[0] == "selective" else set(
        checkpointed_layers(config, checkpointing))
    ab = 4 if precision == "fp32" else 2  # the activations' dtype (bf16 under autocast and bf16-params)
    passes = sum(4 + (2 if i in replayed else 0) for i in moe)
    return tokens * config.num_experts_per_tok * config.hidden_size * ab, passes


def fsdp_groups(sz: dict, config, *, shard: int, ep: int) -> dict:
    """The parameters each FSDP2 group all-gathers (plan_comm.comm_per_step): the root's, each decoder layer's own
    and, under EP, each layer's routed experts as their group of shard / ep ranks gathers them (its E_l experts,
    padding included: `expert_share` x the group); without EP the experts are in their layer's group, gathered over
    the shard group the same way."""
    group = max(1, shard // ep)
    gathered = expert_share(sz, shard, ep) * group  # of a layer's experts: 1 / ep, more where they pad
    padded = [x * gathered for x in sz["layer_experts"]]
    dense = [p - e for p, e in zip(sz["layers"], sz["layer_experts"])]
    if ep > 1:
        return {"root": sz["root"], "layers": dense, "experts": padded}
    return {"root": sz["root"], "layers": [d + x for d, x in zip(dense, padded)], "experts": [0] * len(dense)}


def model_shapes(cfg: TrainConfig, vocab_size: int | None = None) -> tuple:
    """(model config, `sizes`) of the model `cfg` trains: what every plan of it shares (`plan(shapes=...)`: the
    layout search builds the model once)."""
    model = meta_model(cfg, vocab_size)
    return model.config, sizes(model)


def plan(cfg: TrainConfig, **options) -> dict:
    """The plan of training `cfg` on `gpus` GPUs (defaults: DEFAULTS, plan_comm.DEFAULT_TOPOLOGY and the config's own
    settings); the JSON object `gattn plan --json` prints (JSON_KEYS first, then the settings it assumed). The
    options: `plan_and_decide`'s."""
    return plan_and_decide(cfg, **options)[0]


def plan_and_decide(cfg: TrainConfig, *, gpus: int | None = None, gpu_memory_gb: float | None = None,
                    gpu_tflops: float | None = None, mfu: float | None = None, dist: str | None = None,
                    activation_checkpointing: str | None = None, seq_len: int | None = None,
                    micro_batch: int | None = None, precision: str | None = None, vocab_size: int | None = None,
                    device: str = "cuda", topo: Topology | None = None,
                    shapes: tuple | None = None) -> tuple[dict, MemoryDecision]:
    """(the plan, its memory decisions: what parallelize applies to this run). shapes: `model_shapes(cfg)` or
    (config, `sizes`) of a model the caller built where it has them (the model must be the one `cfg` builds)."""
    hw = _hardware(gpus=gpus, gpu_memory_gb=gpu_memory_gb, gpu_tflops=gpu_tflops, mfu=mfu)
    gpus, gpu_memory_gb, gpu_tflops, mfu = (hw[k] for k in ("gpus", "gpu_memory_gb", "gpu_tflops", "mfu"))
    topo = topo or topology()
    changes = {k: v for k, v in (("dist", dist), ("activation_checkpointing", activation_checkpointing),
                                 ("seq_len", seq_len), ("precision", precision)) if v is not None}
    cfg = replace(cfg, **changes).validate()
    mode = cfg.dist if gpus > 1 else "none"
    resolved = _resolved(cfg.precision, mode)
    accum, micro_batch = _split_batch(cfg, gpus, micro_batch, resolved)
    config, sz = shapes or model_shapes(cfg, vocab_size)
    dims = _dims(cfg, gpus, config)
    ep, replicate = dims.expert_parallel, dims.dp_replicate  # 1 and 1 outside FSDP2 (ParallelDims refuses others)
    fl = flops_per_token(config, sz["matmul_activated"], cfg.seq_len)
    common = dict(world=gpus, dist=mode, precision=resolved, checkpointing=cfg.activation_checkpointing,
                  tokens=micro_batch * cfg.seq_len, fused_loss=cfg.fast, device=device,
                  stats=cfg.stats_every > 0, eval_tokens=cfg.eval_batch_size * cfg.seq_len, replicate=replicate, ep=ep,
                  gpu_memory_gb=gpu_memory_gb)
    decision, mem = decide(cfg, layers=config.num_hidden_layers, mode=mode, world=gpus, grad_accum=accum,
                           memory=lambda unsharded, gathered: memory(sz, config, **common, unsharded_grads=unsharded,
                                                                     gathered_layers=gathered),
                           available_gb=gpu_memory_gb)
    unsharded, gather = decision.unsharded_grads, decision.gather
    a2a, passes = all_to_all_bytes(config, tokens=micro_batch * cfg.seq_len, precision=resolved, ep=ep,
                                   checkpointing=cfg.activation_checkpointing)
    shard = dims.shard
    comm = comm_per_step(sz, fsdp_groups(sz, config, shard=shard, ep=ep), world=gpus, dist=mode,
                         pd=2 if resolved == "bf16-params" else 4, grad_accum=accum, unsharded_grads=unsharded,
                         gathers=FP.all_gathers_per_step(gather, accum), topo=topo, replicate=replicate, ep=ep,
                         all_to_all=a2a, moe_passes=passes)
    step_tokens = cfg.batch_size * cfg.seq_len
    hardware = fl["model"] + round(fl["forward"] * recompute_share(config, cfg.activation_checkpointing))
    _step_time(comm, step_tokens * hardware / (mfu * gpu_tflops * 1e12 * gpus))
    tokens_per_s = step_tokens / comm["step_seconds"]
    budget = cfg.steps * cfg.batch_size * cfg.seq_len
    return {"params_total": sz["total"], "params_activated": sz["activated"], "flops_per_token": fl["model"],
            "memory_per_gpu_gb": mem, "fits": mem["total"] + mem["margin"] <= gpu_memory_gb,
            "tokens_per_s": tokens_per_s, "days": budget / tokens_per_s / 86400,
            "mfu": tokens_per_s * fl["model"] / (gpu_tflops * 1e12 * gpus),
            "hardware_flops_per_token": hardware, "params_trainable": sz["trainable"], "token_budget": budget,
            "comm_per_step": comm,
            "settings": {"model": cfg.model, "gate": cfg.gate, "gpus": gpus, "gpu_memory_gb": gpu_memory_gb,
                         "gpu_tflops": gpu_tflops, "mfu": mfu, **topo.as_dict(),
                         "assumed_bandwidth": topo.describe(gpus), "dist": mode,
                         "precision": resolved, "eval_batch_size": cfg.eval_batch_size,
                         "stats_every": cfg.stats_every,
                         "activation_checkpointing": cfg.activation_checkpointing, "seq_len": cfg.seq_len,
                         "global_batch": cfg.batch_size, "micro_batch": micro_batch, "grad_accum": accum,
                         "accum_grads": cfg.accum_grads, "grad_accumulation": decision.grad_accumulation,
                         "reshard_after_forward": cfg.reshard_after_forward,
                         "fsdp_prefetch": cfg.fsdp_prefetch, "keep_gathered": gather.keep_gathered,
                         "gathered_layers": FP.peak_gathered_layers(gather) if mode == "fsdp" else 0,
                         "dp_replicate": replicate, "expert_parallel": ep,
                         "experts_per_rank": (config.num_experts or 0) // ep,
                         "expert_sharding": _expert_sharding(sz, mode, shard, ep),
                         "memory_margin_fraction": MARGIN_FRACTION if device == "cuda" else 0.0,
                         "routed_allowance": ROUTED_ALLOWANCE if ep > 1 else 1.0,
                         "steps": cfg.steps, "fast": cfg.fast, "vocab_size": config.vocab_size}}, decision


def _expert_sharding(sz: dict, mode: str, shard: int, ep: int) -> str:
    """How the plan stores the routed experts (module docstring: params; the trainer's placement), in words."""
    shapes = sz["expert_shapes"]
    if not shapes or mode != "fsdp" or shard <= 1:
        return "none" if not shapes else "whole"
    group = shard // ep
    dims = {n: expert_shard_dim((E // ep, a, b), group) for n, (E, a, b) in shapes.items()}
    local = next(iter(shapes.values()))[0] // ep
    same = set(dims.values())
    placement = f"Shard({same.pop()})" if len(same) == 1 else ", ".join(f"{n} Shard({d})" for n, d in dims.items())
    rows = math.ceil(local / group)
    whole = f"padded: {rows} whole expert(s) per rank, not {local / group:.3g}" if rows * group > local else \
        f"{rows} per rank"
    how = [f"each split {group} ways, not padded"] * any(dims.values()) + [whole] * (0 in dims.values())
    return f"{placement}: {local} expert(s) over {group} rank(s), {'; '.join(how)}"


def _dims(cfg: TrainConfig, gpus: int, config) -> ParallelDims:
    """The layout the plan assumes (the config's degrees at `gpus` ranks), checked against the model's experts."""
    from ..util.errors import UserError

    try:
        return ParallelDims.of(cfg, gpus, config.num_experts or 0)
    except ValueError as exc:
        raise UserError(f"{exc} (gattn plan: --set expert_parallel)") from None


def _step_time(comm: dict, compute_s: float) -> None:
    """The step's time into `comm`: FSDP2's collectives overlap the compute (the larger bounds the step); EP's
    all-to-all sits on the critical path (the experts wait for their rows), so it adds. compute_s: the FLOPs the
    GPUs run, recompute included, at the assumed utilisation."""
    a2a_s = comm["all_to_all_seconds"]
    comm["compute_seconds"] = compute_s
    comm["step_seconds"] = max(compute_s, comm["seconds"] - a2a_s) + a2a_s


def _hardware(**given) -> dict:
    """The hardware figures a plan assumes: each one given, else DEFAULTS', checked (plan_hardware.assumed)."""
    return plan_hardware.assumed(**given)


def _split_batch(cfg: TrainConfig, gpus: int, micro_batch: int | None, resolved: str) -> tuple[int, int]:
    """(grad_accum, micro_batch) of the global batch over `gpus` ranks: from `micro_batch` when given, else the
    config's grad_accum."""
    from ..util.errors import UserError, check_number

    try:
        cfg.check_world(gpus, resolved)
        if micro_batch is not None:
            check_number("micro_batch", micro_batch, kind=int, min=1)
            return accum_for(cfg.batch_size, gpus, micro_batch), micro_batch
        return cfg.grad_accum, cfg.batch_size // (gpus * cfg.grad_accum)
    except ValueError as exc:
        raise UserError(f"{exc} (gattn plan: --gpus / --micro-batch / --dist)") from None


def format_plan(p: dict, preset: str) -> str:
    """The table `gattn plan` prints without --json."""
    s, m = p["settings"], p["memory_per_gpu_gb"]
    lines = [f"gattn plan: {preset} (model {s['model']}, gate {s['gate']}) on {s['gpus']} GPU(s) of "
             f"{s['gpu_memory_gb']:g} GB, {s['gpu_tflops']:g} TFLOP/s at MFU {s['mfu']:g}",
             f"  {s['dist'] if s['dist'] != 'none' else 'one process'}, {s['precision']}, activation checkpointing {s['activation_checkpointing']}, seq "
             f"{s['seq_len']}, micro-batch {s['micro_batch']} x grad_accum {s['grad_accum']} (global batch "
             f"{s['global_batch']}; gradients {s['grad_accumulation']}), {s['steps']:,} steps",
             f"  parameters      {p['params_total'] / 1e9:8.3f} B total, {p['params_activated'] / 1e9:.3f} B activated",
             f"  FLOPs / token   {p['flops_per_token'] / 1e9:8.2f} G (model), "
             f"{p['hardware_flops_per_token'] / 1e9:.2f} G with recompute",
             "  memory / GPU (GB)"]
    for key in MEMORY_KEYS[:-1]:
        note = "  (between steps, with params + optimizer + buffers + overhead)" if key == "eval" else ""
        lines.append(f"    {key:<12} {m[key]:8.2f}{note}")
    verdict = "fits" if p["fits"] else f"does NOT fit {s['gpu_memory_gb']:g} GB"
    lines.append(f"    {'total':<12} {m['total']:8.2f}   {verdict} (the larger of a training step and evaluation)")
    if m["margin"]:
        lines.append(f"    {'margin':<12} {m['margin']:8.2f}   kept free ({s['memory_margin_fraction']:.0%} of the GPU: the "
                     "caching allocator's reserve; `fits` and the auto policies leave it)")
    budget = p["token_budget"]
    tokens = f"{budget / 1e9:,.1f} B" if budget >= 1e9 else f"{budget / 1e6:,.2f} M"
    c = p["comm_per_step"]
    if s["dp_replicate"] > 1 or s["expert_parallel"] > 1:
        shard = s["gpus"] // s["dp_replicate"]
        lines.append(f"  layout          {s['dp_replicate']} replica(s) x {shard} shard(s)"
                     + (f"; experts over {s['expert_parallel']} ranks ({s['experts_per_rank']} per rank), "
                        f"all-to-all {c['all_to_all_gb']:.3g} GB per GPU per step, routed rows x "
                        f"{s['routed_allowance']:g} for imbalance" if s["expert_parallel"] > 1 else "")
                     + (f"; {c['all_reduce_gb']:.3g} GB all-reduced across replicas" if s["dp_replicate"] > 1 else ""))
    if s["dist"] == "fsdp":
        prefetch = f"{s['fsdp_prefetch']} layer(s) ahead" if s["fsdp_prefetch"] else "implicit"
        lines.append(f"  gathering       reshard_after_forward {s['reshard_after_forward']}, prefetch {prefetch}, "
                     f"{'kept across the micro-batches' if s['keep_gathered'] else 'not kept across micro-batches'}: "
                     f"{c['all_gathers']} all-gathers per step ({c['all_gather_gb']:.3g} GB), "
                     f"{s['gathered_layers']} layer(s) gathered at once")
        if s["expert_sharding"] not in ("none", "whole"):
            lines.append(f"  experts         {s['expert_sharding']} (the trainer's FSDP2 placement: whole experts "
                         "where the ranks divide them, else split on dim 1)")
    lines.append(f"  assumed bandwidth: {s['assumed_bandwidth']}")
    parts = ", ".join(f"{name} {c[key + '_seconds']:.3g}" for name, key in (
        ("all-gather", "all_gather"), ("reduce-scatter", "reduce"), ("all-reduce", "all_reduce"),
        ("all-to-all", "all_to_all")) if c[key + "_seconds"])
    lines.append(f"  step            {c['compute_seconds']:.3g} s compute at {s['mfu']:g} of peak, {c['seconds']:.3g} s "
                 f"communication ({c['total_gb']:.3g} GB per GPU{': ' + parts + ' s' if parts else ''}): "
                 f"{c['step_seconds']:.3g} s (the larger; the all-to-all adds)")
    lines.append(f"  speed           {p['tokens_per_s']:,.0f} tokens/s, MFU {p['mfu']:.1%}; {tokens} tokens in "
                 f"{p['days']:.3g} days")
    return "\n".join(lines)


# ---------------------------------------------------------------- the trainer's check before it builds

def available_gb(device: torch.device, local_world: int = 1) -> float:
    """Memory one rank may use here: the GPU's free memory, or the host's available memory split over its ranks."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free / GB
    try:
        with open("/proc/meminfo") as fh:
            info = {line.split(":")[0]: int(line.split()[1]) for line in fh if ":" in line}
        return info["MemAvailable"] * 1024 / GB / max(1, local_world)
    except (OSError, KeyError, ValueError):
        return math.inf  # unknown: do not refuse


def check_fits(cfg: TrainConfig, device: torch.device, world: int, precision: str, vocab_size: int | None = None,
               shapes: tuple | None = None) -> MemoryDecision:
    """Raise a UserError naming `gattn plan` when the plan of `cfg` at this world size exceeds the memory one rank
    has here; returns the plan's memory decisions otherwise (what parallelize applies). Run before anything is
    allocated: shapes, (config, `sizes`) of the run's model built on the meta device (else the plan builds one)."""
    from ..util.errors import UserError

    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    have = available_gb(device, local)
    p, decision = plan_and_decide(cfg, gpus=world, gpu_memory_gb=have if math.isfinite(have) else 1e12,
                                  precision=precision, vocab_size=vocab_size, device=device.type,
                                  micro_batch=cfg.batch_size // (world * cfg.grad_accum), shapes=shapes)
    if not p["fits"]:
        m = p["memory_per_gpu_gb"]
        where = "this GPU has free" if device.type == "cuda" else f"this host has for each of its {local} rank(s)"
        setting = f"{cfg.dist}, {precision}" if world > 1 else f"one process, {precision}"
        raise UserError(
            f"this run (model {cfg.model}, gate {cfg.gate}) needs ~{m['total']:.1f} GB per rank at world size {world} "
            f"({setting}: params {m['params']:.1f}, grads {m['grads']:.1f}, optimizer {m['optimizer']:.1f}, "
            f"activations {m['activations']:.1f}, loss {m['loss']:.1f}, stats {m['stats']:.1f}, buffers "
            f"{m['buffers']:.1f}; evaluation {m['eval']:.1f}) but {where} {have:.1f} GB; run "
            "`gattn plan` with the same --preset and --set to find a setting that fits (--gpus N under dist=fsdp, "
            "--activation-checkpointing selective, every:2 or full, a smaller --micro-batch" + _gather_hint(cfg)
            + "), or shrink the model with --set model.*=...")
    return decision


def _gather_hint(cfg: TrainConfig) -> str:
    """The gather settings that hold more parameters gathered than the default, as the fixes check_fits names."""
    fixes = [fix for asked, fix in ((cfg.keep_gathered == "true", "keep_gathered=false"),
                                    (cfg.reshard_after_forward == "never", "reshard_after_forward=default"))
             if asked]
    return "".join(f", --set {fix}" for fix in fixes)
