"""Benchmark: train-step time (forward + backward) of a tiny stack of MoE blocks, fast path vs the loop reference.

All variants run in one process on identical weights and inputs, interleaved round by round so machine load hits
them alike; the median step time of each is reported. Variants:
  loop          plain loop over experts (the reference)
  grouped       the fast path as configured by default (torch._grouped_mm where usable, else per-segment mm)
  grouped-seg   the fast path forced to its per-segment mm kernel (one mm per expert on sorted tokens; the fallback
                for shapes torch._grouped_mm rejects)
On a loaded, shared CPU use --threads 1: oversubscribed threads make the medians swing by 10x.

Usage:  python bench/bench_moe.py [--tokens 2048 --d 256 --experts 16 --top-k 4 --ffn 128 --layers 2] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import types

import torch
import torch.nn as nn

from gated_attention.moe import SparseMoeBlock, collect_aux_loss


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


def train_step(model: MoEStack, x: torch.Tensor) -> float:
    t0 = time.perf_counter()
    y = model(x)
    loss = y.float().square().mean() + collect_aux_loss(model)
    loss.backward()
    elapsed = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    for block in model.blocks:
        block.balance.reset()
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
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="parameter/activation dtype")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = leave torch's default)")
    p.add_argument("--out", default=None, help="write the results as JSON to this file (atomic write)")
    args = p.parse_args(argv)
    if args.tokens % args.seq:
        p.error(f"--tokens {args.tokens} must be a multiple of --seq {args.seq}")
    if args.threads:
        torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    reference = build(args, "loop", None)
    state = reference.state_dict()
    variants = {
        "loop": reference,
        "grouped": build(args, "grouped", None, state),
        "grouped-seg": build(args, "grouped", False, state),
    }
    x = torch.randn(args.tokens // args.seq, args.seq, args.d).to(getattr(torch, args.dtype))

    # The variants must compute the same thing, or the timing comparison is meaningless.
    with torch.no_grad():
        ref_out = reference(x).float()
        for name, model in variants.items():
            err = (model(x).float() - ref_out).abs().max().item()
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
    print(f"MoE stack: {args.layers} layers, d={args.d}, E={args.experts} top-{args.top_k}, expert ffn {args.ffn}, "
          f"{args.tokens} tokens, {args.dtype}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"{'variant':<14}{'median ms':>11}{'min ms':>9}{'speedup vs loop':>17}")
    for name, ts in times.items():
        med, best = statistics.median(ts) * 1e3, min(ts) * 1e3
        rows.append({"variant": name, "median_ms": med, "min_ms": best, "speedup_vs_loop": loop_ms / med,
                     "times_ms": [t * 1e3 for t in ts]})
        print(f"{name:<14}{med:>11.2f}{best:>9.2f}{loop_ms / med:>16.2f}x")

    if args.out:
        result = {"benchmark": "moe_train_step", "args": vars(args), "torch": torch.__version__,
                  "threads": torch.get_num_threads(), "machine": platform.machine(),
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
