"""Analysis cost vs sequence length: time and peak memory of `analyze_model` at T = 2k..16k, memory-light path
(method="capture": q.k0 and chunked log-sum-exps, never a T x T map for all heads) vs eager maps
(method="eager-probs", skipped above --eager-max). Each measurement runs in a fresh subprocess; peak memory is that
process's peak RSS minus its RSS just before the call (model built, tokens ready). The analysis runs under the
--precision's autocast (fp32 master weights, as `gattn analyze` loads them).
Run: python bench/bench_analysis.py [--lengths 2048,4096,8192,16384] [--precision auto|bf16|fp32]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

import common

CHILD = r"""
import json, resource, sys, time
sys.path.insert(0, {src!r})
import torch
torch.set_num_threads({threads})
from gated_attention import GatedQwen3ForCausalLM
from gated_attention.presets import model_config
from gated_attention.analysis.analyze import AnalysisConfig, analyze_model
from gated_attention.util.precision import numerics
def rss_now():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()
torch.manual_seed(0)
model = GatedQwen3ForCausalLM(model_config({preset!r}, {gate!r}, max_position_embeddings={T})).eval()
ids = torch.randint(0, model.config.vocab_size, (1, {T}))
before = rss_now()
t = time.perf_counter()
with numerics({prec!r}, "cpu"):
    analyze_model(model, [ids], AnalysisConfig(method={method!r}))
dt = time.perf_counter() - t
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({{"seconds": dt, "peak_extra_bytes": max(0, peak - before)}}))
"""


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="small", help="model preset (presets.py)")
    ap.add_argument("--gate", default="sdpa_elementwise", help="gate of the analysed model")
    ap.add_argument("--lengths", default="2048,4096,8192,16384", help="comma list of sequence lengths")
    ap.add_argument("--eager-max", type=int, default=4096, help="longest T for the eager-map path (memory ~ T^2)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads in each child")
    ap.add_argument("--out", default="analysis", help="results/<out>.json")
    common.precision_arg(ap)
    args = ap.parse_args(argv)
    prec = common.resolve_precision(args.precision)
    try:
        import gated_attention.analysis.analyze  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"gated_attention.analysis is not available ({e}); nothing to benchmark")
    rows = []
    for T in map(int, args.lengths.split(",")):
        for method in ("capture", "eager-probs"):
            if method == "eager-probs" and T > args.eager_max:
                continue
            code = CHILD.format(src=str(common.ROOT.parent / "src"), threads=args.threads, preset=args.preset,
                                gate=args.gate, T=T, method=method, prec=prec)
            proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
            if proc.returncode != 0:
                rows.append({"T": T, "method": method, "error": proc.stderr.strip().splitlines()[-1:]})
                print(f"T={T} {method}: FAILED {proc.stderr.strip().splitlines()[-1:]}")
                continue
            res = json.loads(proc.stdout.strip().splitlines()[-1])
            row = {"T": T, "method": method, **res, "peak_extra_gib": res["peak_extra_bytes"] / 2**30}
            rows.append(row)
            print(f"T={T} {method}: {res['seconds']:.1f}s, peak +{row['peak_extra_gib']:.2f} GiB", flush=True)
    result = {"bench": "analysis", "machine": common.machine(), "preset": args.preset, "gate": args.gate,
              "resolved_precision": prec, "rows": rows}
    path = common.write_json(args.out, result)
    print(common.md_table(rows, ["T", "method", "seconds", "peak_extra_gib"]))
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
