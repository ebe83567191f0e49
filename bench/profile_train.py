"""Where a training step's time goes: torch.profiler over a few steps (in --precision: bf16 autocast or fp32;
forward + backward + AdamW) of our fast path and of transformers' implementation, self CPU time grouped into op
families; writes results/profile_train.json and prints the table. Shares are what matter (the machine is shared;
absolute ms are noise). `--budget NAME` profiles `gattn compare --budget NAME`'s model and batch instead of a preset.
Run: python bench/profile_train.py [--gate sdpa_elementwise --batch 16 --seq 256 --threads 1 --precision fp32]
     python bench/profile_train.py --budget default --compile --no-hf --precision fp32 --out profile_mainjob_fp32
"""
from __future__ import annotations

import argparse
import copy

import common  # (also puts src/ on the path)
import torch
from torch.profiler import ProfilerActivity, profile

from bench_train import make_step
from gated_attention import GatedQwen3ForCausalLM
from gated_attention import fused as fused_mod
from gated_attention.fused import fuse_qkv
from gated_attention.train import fastpath
from gated_attention.train.monitors import decoder_layers
from gated_attention.presets import model_config
from hf_reference import hf_from_ours

# op-name substrings -> family (first match wins); the families the round-1 profile used
FAMILIES = [("inductor fused kernels", ("cpp_fused", "triton_")),
            ("matmul (GEMM)", ("addmm", "::mm", "bmm", "linear", "matmul")),
            ("attention (SDPA)", ("scaled_dot_product", "flash_attention", "_efficient_attention")),
            ("cross-entropy / log-softmax", ("log_softmax", "ChunkedLinearCE", "nll_loss", "cross_entropy", "logsumexp",
                                             "_ChunkedLinearCE", "gather", "scatter")),
            ("dtype copies", ("::to", "_to_copy", "copy_")),
            ("optimizer (AdamW)", ("_foreach", "adam")),
            ("elementwise / norms", ("mul", "add", "sigmoid", "silu", "pow", "mean", "rsqrt", "neg", "cat", "sub",
                                     "div", "exp", "sum", "where", "fill", "zero"))]


def family(name: str) -> str:
    for fam, keys in FAMILIES:
        if any(k in name for k in keys):
            return fam
    return "other"


def profile_step(step, steps: int) -> dict:
    step()  # warm-up outside the profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    fam: dict[str, float] = {}
    top = []
    for ev in prof.key_averages():
        fam[family(ev.key)] = fam.get(family(ev.key), 0.0) + ev.self_cpu_time_total
        top.append((ev.self_cpu_time_total, ev.key))
    total = sum(fam.values())
    top.sort(reverse=True)
    fused = [k for _, k in top if "cpp_fused" in k or "triton_" in k]  # names: graph_N_cpp_fused_...
    return {"total_ms_per_step": total / 1e3 / steps, "fused_kernels": len(fused),
            "fused_kernels_with_sigmoid": sum("sigmoid" in k for k in fused),
            "families": {k: v / total for k, v in sorted(fam.items(), key=lambda kv: -kv[1])},
            "top_ops": [{"op": k, "share": t / total} for t, k in top[:12]]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="small", help="model preset (presets.py)")
    ap.add_argument("--gate", default="sdpa_elementwise", help="gate name (gates.py registry)")
    ap.add_argument("--batch", type=int, default=16, help="sequences per step")
    ap.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    ap.add_argument("--steps", type=int, default=2, help="profiled steps")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    ap.add_argument("--out", default="profile_train", help="results/<out>.json")
    ap.add_argument("--compile", action="store_true",
                    help="profile compiled steps: ours_fast as the trainer compiles it (one decoder-layer graph), "
                         "ours_fast_opaque the same with the gate as the custom autograd.Function (the pre-fix "
                         "path), hf = torch.compile(model); inductor's kernels are recorded one by one")
    ap.add_argument("--no-hf", action="store_true", help="profile only our implementation (saves a compile)")
    ap.add_argument("--budget", default=None, help="profile this `gattn compare` budget's model, batch and sequence "
                    "length (compare.BUDGETS: default, quick, ...) instead of --preset/--batch/--seq")
    common.precision_arg(ap)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    prec = common.resolve_precision(args.precision)
    overrides = {}
    if args.budget:
        from gated_attention.compare import BUDGETS

        if args.budget not in BUDGETS:
            raise SystemExit(f"unknown --budget {args.budget!r}; valid: {', '.join(BUDGETS)}")
        b = BUDGETS[args.budget]
        train = b.train_changes()
        args.batch, args.seq = train["batch_size"], train["seq_len"]
        overrides = {**train.get("model_overrides", {}), "vocab_size": b.vocab_size}
    torch.manual_seed(0)
    ours = GatedQwen3ForCausalLM(model_config(args.preset, args.gate, **overrides)).train()
    ids = torch.randint(0, ours.config.vocab_size, (args.batch, args.seq))
    res = {"bench": "profile_train", "machine": common.machine(), "preset": args.preset, "budget": args.budget,
           "gate": args.gate, "batch": args.batch, "seq": args.seq, "mode": "compile" if args.compile else "eager",
           "resolved_precision": prec, "impls": {}}
    if args.compile:
        import torch._inductor.config as ind

        ind.cpp.enable_kernel_profile = True  # one profiler event per generated C++ kernel
        for impl, opaque in (("ours_fast", False), ("ours_fast_opaque", True)):
            m = fuse_qkv(copy.deepcopy(ours), separate_params=True)
            plan = fastpath.SpeedPlan(True, "true", 0, True, decoder_layers(m), torch.device("cpu"))
            fused_mod.OPAQUE_GATE_UNDER_COMPILE = opaque  # read while tracing, i.e. during the warm-up step
            res["impls"][impl] = profile_step(make_step(m, ids, fused_loss=True, forward_ctx=plan.training_forward,
                                                        precision=prec), args.steps)
            fused_mod.OPAQUE_GATE_UNDER_COMPILE = False
        hf = hf_from_ours(ours).train()
        if not args.no_hf:
            res["impls"]["hf"] = profile_step(make_step(torch.compile(hf), ids, params=hf.parameters(),
                                                        precision=prec), args.steps)
    else:
        res["impls"]["ours_fast"] = profile_step(make_step(fuse_qkv(copy.deepcopy(ours), separate_params=True), ids,
                                                           fused_loss=True, precision=prec), args.steps)
        if not args.no_hf:
            res["impls"]["hf"] = profile_step(make_step(hf_from_ours(ours).train(), ids, precision=prec), args.steps)
    path = common.write_json(args.out, res)
    for impl, r in res["impls"].items():
        print(f"{impl}: {r['total_ms_per_step']:.0f} ms/step (profiler self time)")
        for k, v in r["families"].items():
            print(f"  {k:32s} {100 * v:5.1f} %")
    print(f"wrote {path}")
    return res


if __name__ == "__main__":
    main()
