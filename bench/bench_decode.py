"""Decode throughput with the KV cache: our model's generate (dynamic cache, static cache, fused layers) and the lean
loop decode.generate_fast (static cache; eager and with a torch.compile'd single-token step) vs transformers' Qwen3
`generate` with the same weights, greedy, batch 1 and 8, all timed round-robin in one process.
tokens/s = batch * new tokens / wall time of the whole generate call (prefill included, as a user sees it).
Weights and activations are cast to the --precision's dtype (bf16 or fp32; auto = bf16 where this CPU runs bf16
GEMMs fast), for every implementation alike.
Run: python bench/bench_decode.py [--prompt 32 --new 64 --batches 1,8 --precision auto|bf16|fp32]
"""
from __future__ import annotations

import argparse
import copy

import common  # (also puts src/ on the path)
import torch

from gated_attention import GatedQwen3ForCausalLM
from gated_attention.decode import generate_fast
from gated_attention.fused import fuse_qkv
from gated_attention.presets import model_config
from hf_reference import hf_from_ours

GATES = {"ungated": "baseline", "G1-elem-parity": "sdpa_elementwise", "G1-head-parity": "sdpa_headwise"}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="small", help="model preset (presets.py)")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    ap.add_argument("--new", type=int, default=64, help="generated tokens")
    ap.add_argument("--batches", default="1,8", help="comma list of batch sizes")
    ap.add_argument("--configs", default="ungated,G1-elem-parity", help=f"comma list from {list(GATES)}")
    common.precision_arg(ap)
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                    help="weights/activations dtype (older spelling of --precision bf16 / fp32; overrides it)")
    ap.add_argument("--reps", type=int, default=3, help="timed round-robin rounds (median taken)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    ap.add_argument("--out", default="decode", help="results/<out>.json")
    ap.add_argument("--no-compile", action="store_true", help="skip the compiled-step variant (compiles take a while)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.dtype:
        args.precision = {"bfloat16": "bf16", "float32": "fp32"}[args.dtype]
    prec = common.resolve_precision(args.precision)
    from gated_attention.util.precision import dtype_of

    dtype = dtype_of(prec)
    fns, meta, agree = {}, {}, {}
    for label in args.configs.split(","):
        if label not in GATES:
            raise SystemExit(f"unknown config {label!r}; valid: {', '.join(GATES)}")
        torch.manual_seed(0)
        ours = GatedQwen3ForCausalLM(model_config(args.preset, GATES[label])).eval()
        hf = hf_from_ours(ours).eval().to(dtype)
        fast = fuse_qkv(copy.deepcopy(ours)).to(dtype)
        ours = ours.to(dtype)
        for bs in map(int, args.batches.split(",")):
            ids = torch.randint(0, ours.config.vocab_size, (bs, args.prompt))
            kw = dict(max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False)
            variants = {
                "ours": lambda m=ours, i=ids: m.generate(i, **kw),
                "ours_static": lambda m=ours, i=ids: m.generate(i, cache_implementation="static", **kw),
                "ours_fast_static": lambda m=fast, i=ids: m.generate(i, cache_implementation="static", **kw),
                "ours_lean": lambda m=fast, i=ids: generate_fast(m, i, args.new, stop_at_eos=False),
                "hf": lambda m=hf, i=ids: m.generate(i, **kw),
            }
            if not args.no_compile:  # the compiled step is cached on the loop's code: compiled once per shape
                variants["ours_lean_compiled"] = lambda m=fast, i=ids: generate_fast(m, i, args.new, stop_at_eos=False,
                                                                                   compile_step=True)
            with torch.no_grad():
                outs = {k: f() for k, f in variants.items()}
            agree[f"{label}|b{bs}"] = {k: float((o == outs["hf"]).float().mean()) for k, o in outs.items()}
            for impl, f in variants.items():
                name = f"{label}|b{bs}|{impl}"
                fns[name] = torch.no_grad()(f)
                meta[name] = {"config": label, "batch": bs, "impl": impl}
    times = common.interleaved(fns, args.reps, args.warmup)
    rows = []
    for name, ts in times.items():
        m, med = meta[name], common.median(times[name])
        rows.append({**m, "name": name, "median_s": med, "times_s": ts,
                     "tokens_per_s": m["batch"] * args.new / med})
    by = {r["name"]: r for r in rows}
    for r in rows:
        r["speedup_vs_hf_generate"] = by[f"{r['config']}|b{r['batch']}|hf"]["median_s"] / r["median_s"]
    result = {"bench": "decode", "machine": common.machine(), "preset": args.preset, "prompt": args.prompt,
              "new_tokens": args.new, "dtype": str(dtype).removeprefix("torch."), "resolved_precision": prec,
              "reps": args.reps, "token_agreement_with_hf": agree,
              "rows": rows}
    path = common.write_json(args.out, result)
    print(common.md_table(rows, ["config", "batch", "impl", "median_s", "tokens_per_s", "speedup_vs_hf_generate"]))
    print(f"greedy-token agreement with transformers: {agree}\nwrote {path}")
    return result


if __name__ == "__main__":
    main()
