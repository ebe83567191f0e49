"""Benchmark: train-step time (forward + backward) of MoE models, fast path vs the loop reference.

Two modes: a tiny stack of MoE blocks alone (default), or with --model PRESET the whole GatedQwen3ForCausalLM of a
preset (e.g. small-moe, tiny-moe: attention, dense parts and lm_head included; step = LM loss + aux loss, backward).

All variants run in one process on identical weights and inputs, interleaved round by round so machine load hits
them alike; the median step time of each is reported. Variants:
  loop          plain loop over experts (the reference)
  grouped       the fast path as configured by default (torch._grouped_mm where usable, else per-segment mm)
  grouped-seg   the fast path forced to its per-segment mm kernel (one mm per expert on sorted tokens; the fallback
                for shapes torch._grouped_mm rejects)
On a loaded, shared CPU use --threads 1: oversubscribed threads make the medians swing by 10x.

Usage:  python bench/bench_moe.py [--tokens 2048 --d 256 --experts 16 --top-k 4 --ffn 128 --layers 2] [--out FILE]
        python bench/bench_moe.py --model small-moe --threads 1 [--tokens 2048 --seq 256] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import types

import common  # bench/common.py: machine facts (CPU kind, ISA flags, load, time) beside the result
import torch
import torch.nn as nn

from gated_attention.moe import SparseMoeBlock, collect_aux_loss, moe_blocks, reset_moe_balance


class MoEStack(nn.Module):
    """Pre-norm residual MoE blocks, as in the decoder's FFN half, without attention."""

    def __init__(self, cfg, layers: int):
        super().__init__()
        self.norms = nn.ModuleList([nn.RMSNorm(cfg.hidden_size) for _ in range(layers)])
        self.blocks = nn.ModuleList([SparseMoeBlock(cfg) for _ in range(layers)])

    def forward(self, x):
        for norm, block in zip(self.norms, self.blocks):
            x = x + block(norm(x))
        return x


def build(args, impl: str, grouped_mm: bool | None, state=None) -> MoEStack:
    cfg = types.SimpleNamespace(
        hidden_size=args.d, hidden_act="silu", num_experts=args.experts, num_experts_per_tok=args.top_k,
        moe_intermediate_size=args.ffn, norm_topk_prob=True, router_aux_loss_coef=1e-3, router_z_loss_coef=1e-4,
        shared_expert_intermediate_size=args.shared, moe_impl=impl, initializer_range=0.02)
    model = MoEStack(cfg, args.layers)
    if state is not None:
        model.load_state_dict(state)
    for block in model.blocks:
        block.use_grouped_mm = grouped_mm
    return model.to(getattr(torch, args.dtype)).train()


def build_lm(args, impl: str, grouped_mm: bool | None, state=None) -> nn.Module:
    """The whole causal LM of preset --model with moe_impl=impl (same weights for every variant via `state`)."""
    from gated_attention.modeling import GatedQwen3ForCausalLM
    from gated_attention.presets import model_config

    model = GatedQwen3ForCausalLM(model_config(args.model, moe_impl=impl))
    if state is not None:
        model.load_state_dict(state)
    for _, block in moe_blocks(model):
        block.use_grouped_mm = grouped_mm
    return model.to(getattr(torch, args.dtype)).train()


def forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Stack: its output. LM: its logits (x holds token ids)."""
    return model(x) if isinstance(model, MoEStack) else model(input_ids=x).logits


def train_step(model: nn.Module, x: torch.Tensor) -> float:
    t0 = time.perf_counter()
    if isinstance(model, MoEStack):
        loss = model(x).float().square().mean() + collect_aux_loss(model)
    else:
        loss = model(input_ids=x, labels=x).loss  # shifted CE + the MoE aux loss
    loss.backward()
    elapsed = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    reset_moe_balance(model)  # one global batch per step, as the trainer does
    return elapsed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=2048, help="tokens per step (B*T); split as B=tokens//seq, T=seq")
    p.add_argument("--seq", type=int, default=256, help="sequence length T")
    p.add_argument("--d", type=int, default=256, help="hidden size")
    p.add_argument("--experts", type=int, default=16, help="number of experts E")
    p.add_argument("--top-k", type=int, default=4, help="experts per token k")
    p.add_argument("--ffn", type=int, default=128, help="expert FFN width (moe_intermediate_size)")
    p.add_argument("--shared", type=int, default=0, help="shared expert width (0 = none)")
    p.add_argument("--layers", type=int, default=2, help="MoE blocks in the stack")
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per variant first")
    common.precision_arg(p, what="parameter/activation dtype", note="; bf16 here casts the weights themselves")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="older spelling of --precision fp32 / bf16 (overrides it)")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = leave torch's default)")
    p.add_argument("--model", default=None,
                   help="benchmark the whole GatedQwen3ForCausalLM of this MoE preset (e.g. small-moe, tiny-moe) "
                        "instead of the MoE stack; --d/--experts/--top-k/--ffn/--shared/--layers are then ignored")
    p.add_argument("--out", default=None, help="write the results as JSON to this file (atomic write)")
    args = p.parse_args(argv)
    if args.tokens % args.seq:
        p.error(f"--tokens {args.tokens} must be a multiple of --seq {args.seq}")
    if args.threads:
        torch.set_num_threads(args.threads)
    from gated_attention.util import precision as P

    if args.dtype:
        args.precision = {"bfloat16": "bf16", "float32": "fp32"}[args.dtype]
    resolved, line = P.decide(args.precision, "cpu")
    print(f"bench: {line}", flush=True)
    args.dtype = str(P.dtype_of(resolved)).removeprefix("torch.")  # what build / build_lm cast to

    torch.manual_seed(0)
    make = build if args.model is None else build_lm
    reference = make(args, "loop", None)
    state = reference.state_dict()
    variants = {
        "loop": reference,
        "grouped": make(args, "grouped", None, state),
        "grouped-seg": make(args, "grouped", False, state),
    }
    if args.model is None:
        x = torch.randn(args.tokens // args.seq, args.seq, args.d).to(getattr(torch, args.dtype))  # (B, T, d)
    else:
        if not moe_blocks(reference):
            p.error(f"--model {args.model} has no MoE layers; pick an MoE preset (e.g. small-moe, tiny-moe)")
        x = torch.randint(0, reference.config.vocab_size, (args.tokens // args.seq, args.seq))  # (B, T) token ids

    # The variants must compute the same thing, or the timing comparison is meaningless.
    with torch.no_grad():
        ref_out = forward(reference, x).float()
        for name, model in variants.items():
            err = (forward(model, x).float() - ref_out).abs().max().item()
            if err > (1e-4 if args.dtype == "float32" else 5e-2):
                raise SystemExit(f"variant {name} differs from the loop reference by {err:.3g}; not benchmarking")

    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.warmup):
        for name, model in variants.items():
            train_step(model, x)
    for _ in range(args.steps):
        for name, model in variants.items():
            times[name].append(train_step(model, x))

    loop_ms = statistics.median(times["loop"]) * 1e3
    rows = []
    if args.model is None:
        shape = f"MoE stack: {args.layers} layers, d={args.d}, E={args.experts} top-{args.top_k}, expert ffn {args.ffn}"
    else:
        c = reference.config
        shape = (f"model {args.model} ({sum(p.numel() for p in reference.parameters()) / 1e6:.1f}M params): "
                 f"{c.num_hidden_layers} layers, d={c.hidden_size}, E={c.num_experts} top-{c.num_experts_per_tok}, "
                 f"expert ffn {c.moe_intermediate_size}, vocab {c.vocab_size}")
    print(f"{shape}, {args.tokens} tokens (T={args.seq}), {args.dtype}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}")
    print(f"{'variant':<14}{'median ms':>11}{'min ms':>9}{'speedup vs loop':>17}")
    for name, ts in times.items():
        med, best = statistics.median(ts) * 1e3, min(ts) * 1e3
        rows.append({"variant": name, "median_ms": med, "min_ms": best, "speedup_vs_loop": loop_ms / med,
                     "times_ms": [t * 1e3 for t in ts]})
        print(f"{name:<14}{med:>11.2f}{best:>9.2f}{loop_ms / med:>16.2f}x")

    if args.out:
        result = {"benchmark": "moe_train_step" if args.model is None else "moe_model_train_step",
                  "args": vars(args), "torch": torch.__version__, "resolved_precision": resolved,
                  "threads": torch.get_num_threads(), "machine": common.machine(),
                  "grouped_mm_available": hasattr(torch, "_grouped_mm"), "results": rows}
        out_dir = os.path.dirname(os.path.abspath(args.out))
        fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=".bench_moe.", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(result, f, indent=2)
        os.replace(tmp, args.out)  # atomic: a reader never sees a half-written file
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
