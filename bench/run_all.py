"""Run every benchmark (each in its own process) and write bench/results/*.json plus bench/results/SUMMARY.md, the
table of measured ratios against the project's targets. `--quick` shrinks every run to a smoke test.
Run: python bench/run_all.py [--threads N] [--quick] [--precision auto|bf16|fp32] [--results DIR]
     (or: bash bench/run_all.sh ...)
Every bench runs in the same --precision (default auto: the product's choice for this CPU); SUMMARY.md states, beside
every ratio, the precision it was measured in and the CPU's kind and ISA flags (AMX / AVX512-BF16 / AVX2 ...), so a
figure from one CPU kind is never read as another's. `--results DIR` keeps a second run apart (e.g. a forced fp32 run:
`--precision fp32 --results bench/results/fp32`, what an AVX2-only CPU runs).
On a shared machine use --threads 1: every ratio is then single-core vs single-core, and the load average before and
after each bench goes into SUMMARY.md.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import common

PY = sys.executable
LOADS: list[tuple[str, tuple[float, float, float]]] = []  # (moment, 1/5/15-minute load average)
TRAIN_CONFIGS = "ungated,G1-elem-parity,G1-head-parity"  # the configs the targets are stated for


def run(script: str, *args: str) -> bool:
    cmd = [PY, str(common.ROOT / script), *args]
    print("$", " ".join(cmd), flush=True)
    LOADS.append((f"before {script}", os.getloadavg()))
    ok = subprocess.run(cmd).returncode == 0
    LOADS.append((f"after {script}", os.getloadavg()))
    return ok


def load(name: str):
    p = common.RESULTS / f"{name}.json"
    return json.loads(p.read_text()) if p.exists() else None


def _when(res: dict) -> str:
    m = res.get("machine") if isinstance(res, dict) else None
    m = m if isinstance(m, dict) else {}
    la = m.get("load_avg")
    return f"{m.get('utc', 'time not recorded')}, load " + (" / ".join(f"{x:.1f}" for x in la) if la else "?")


def _prec(res: dict | None) -> str:
    """The precision a result was measured in ("bf16 (assumed)" for files written before benches recorded it)."""
    return (res or {}).get("resolved_precision") or "bf16 (assumed)"


def _cpu(res: dict | None) -> str:
    m = (res or {}).get("machine") or {}
    kind = m.get("cpu_kind") or ("AMX-BF16" if "amx_bf16" in m.get("isa", []) else
                                 "AVX512-BF16" if "avx512_bf16" in m.get("isa", []) else "?")
    return kind


def machine_line(res: dict) -> str:
    m = res["machine"]
    ratio = m.get("bf16_gemm_speedup")
    return (f"Machine: {m['cpu']} — CPU kind **{_cpu(res)}** (ISA flags: {', '.join(m['isa'])}); bf16/fp32 GEMM speed "
            f"{'%.2fx' % ratio if ratio else 'not recorded'}; {m['cores']} cores, torch threads {m['torch_threads']}, "
            f"torch {m['torch']}, transformers {m['transformers']}, load {m['load_avg']}")


def summary() -> str:
    lines = ["# Benchmark summary (ratios measured side by side in one process; medians)", ""]
    targets = []
    tr = load("train")
    if tr:
        by = {r["name"]: r for r in tr["rows"]}
        peak = tr.get("peak_flops", tr.get("peak_bf16_flops"))
        p = _prec(tr)
        lines += [machine_line(tr),
                  f"Train shape: preset {tr['preset']}, batch {tr['batch']} x seq {tr['seq']}, precision **{p}**; "
                  f"measured {tr.get('peak_precision', 'bf16')} GEMM peak {peak / 1e9:.0f} GFLOP/s", ""]

        def add(name, value, target, ok):
            targets.append((name, value, target, ok, p, _cpu(tr)))

        for mode in ("eager", "compile"):
            for label, target in (("G1-elem-parity", 1.03), ("G1-head-parity", 1.01)):
                r = by.get(f"{label}|ours_fast|{mode}")
                if r and r["step_time_vs_ungated_fast"] is not None:
                    add(f"{label} step time / ungated ({mode}, fast path)", r["step_time_vs_ungated_fast"],
                        f"<= {target}", r["step_time_vs_ungated_fast"] <= target)
            for label in ("ungated", "G1-elem-parity", "G1-head-parity"):
                r = by.get(f"{label}|ours_fast|{mode}")
                if r and r["speedup_vs_hf"] is not None:
                    add(f"{label} train tokens/s / transformers ({mode})", r["speedup_vs_hf"], ">= 1.3",
                        r["speedup_vs_hf"] >= 1.3)
        for mode in ("compile", "eager"):
            rows = [r for r in tr["rows"] if r["mode"] == mode and r["impl"] == "ours_fast"]
            if rows:
                best = max(rows, key=lambda r: r["mfu"])
                add(f"MFU d={tr.get('hidden_size', '?')} {mode}, best variant ({best['name']})", best["mfu"],
                    ">= 0.50" if mode == "compile" else "—", best["mfu"] >= 0.5)
        lines += ["## Train step", "", common.md_table(tr["rows"], [
            "config", "impl", "mode", "median_s", "rel_iqr", "tokens_per_s", "step_time_vs_ungated",
            "step_time_vs_ungated_fast", "speedup_vs_hf", "mfu"]), "",
                  "rel_iqr: interquartile range of the repetitions over their median (the noise of one timing; a "
                  "ratio of two timings is uncertain by roughly the sum of theirs).", ""]
    mj = load("mainjob")
    if mj:
        for mode, sm in mj["summary"].items():
            targets.append((f"main job ({mj['budget']} budget) train tokens/s, {mode} / plain reference",
                            sm["speedup_vs_plain"], ">= 1.5", sm["speedup_vs_plain"] >= 1.5, _prec(mj), _cpu(mj)))
        lines += [f"## The main job's training step (bench_mainjob.py: `gattn compare --budget {mj['budget']}` "
                  f"model, batch {mj['batch']} x seq {mj['seq']}, vocab {mj['vocab']}, {_prec(mj)}; measured "
                  f"{_when(mj)})", "",
                  common.md_table(mj["rows"], ["variant", "mode", "median_s", "rel_iqr", "tokens_per_s",
                                               "speedup_vs_plain", "one_off_s"]), ""]
        for mode, sm in mj["summary"].items():
            lines.append(f"- {mode}: {sm['speedup_vs_plain']:.2f}x the plain path per step; the {mj['steps']}-step "
                         f"budget's wall time {sm['wall_speedup_at_budget_steps']:.2f}x shorter (one-off compile "
                         f"{sm['one_off_s_all_variants']:.0f} s for all variants included); the plain path's wall time "
                         f"fits {sm['steps_in_plain_wall_time']} steps")
        lines.append("")
    big = load("train_d768")
    if big:
        best = max(big["rows"], key=lambda r: r["mfu"])
        targets.append((f"MFU d={big['hidden_size']} (larger shape), best variant ({best['name']})", best["mfu"],
                        ">= 0.50 (stated for the default shape)", best["mfu"] >= 0.5, _prec(big), _cpu(big)))
        lines += [f"## Train step at d={big['hidden_size']}, {big['num_hidden_layers']} layers, batch {big['batch']} x "
                  f"seq {big['seq']} (MFU at a larger shape; {_prec(big)})", "",
                  common.md_table(big["rows"], ["config", "impl", "mode", "median_s", "tokens_per_s", "speedup_vs_hf",
                                                "mfu"]), ""]
    pc = load("profile_train_compile")
    if pc:
        fams = sorted({f for r in pc["impls"].values() for f in r["families"]})
        rows = [{"op family": f, **{impl: f"{100 * r['families'].get(f, 0):.1f} %"
                                    for impl, r in pc["impls"].items()}} for f in fams]
        rows.append({"op family": "profiled ms / step", **{i: f"{r['total_ms_per_step']:.0f}"
                                                          for i, r in pc["impls"].items()}})
        rows.append({"op family": "distinct inductor kernels (with sigmoid)",
                     **{i: f"{r.get('fused_kernels', 0)} ({r.get('fused_kernels_with_sigmoid', 0)})"
                        for i, r in pc["impls"].items()}})
        lines += [f"## Compiled train step profile (profile_train.py --compile: {pc['gate']}, batch {pc['batch']} x "
                  f"seq {pc['seq']}, {_prec(pc)}; measured {_when(pc)})", "", common.md_table(rows, ["op family", *pc["impls"]]),
                  "", "ours_fast_opaque = the same compiled layers with the gate traced as the custom "
                  "autograd.Function (the path before the fix).", ""]
    prof = load("profile_train")
    if prof:
        fams = sorted({f for r in prof["impls"].values() for f in r["families"]})
        rows = [{"op family": f, **{impl: f"{100 * r['families'].get(f, 0):.1f} %"
                                    for impl, r in prof["impls"].items()}} for f in fams]
        lines += [f"## Where a train step's time goes (profile_train.py: {prof['gate']}, batch {prof['batch']} x seq "
                  f"{prof['seq']}, {_prec(prof)}, share of profiler self CPU time)", "",
                  common.md_table(rows, ["op family", *prof["impls"]]), ""]
        fast = next((r for r in (tr or {}).get("rows", []) if r["gate"] == prof["gate"] and r["match_params"]
                     and r["impl"] == "ours_fast" and r["mode"] == "eager"), None)
        gemm = prof["impls"].get("ours_fast", {}).get("families", {}).get("matmul (GEMM)")
        if fast and gemm:
            lines += [f"MFU ceiling at this shape: the step's GEMMs take {100 * gemm:.0f} % of its time, so they run "
                      f"at about MFU / share = {fast['mfu'] / gemm:.2f} of the measured GEMM peak; removing every "
                      f"non-GEMM cost would still leave MFU near that figure.", ""]
    de = load("decode")
    if de:
        for r in de["rows"]:
            if r["impl"] != "hf":
                targets.append((f"decode {r['config']} b{r['batch']} {r['impl']} / transformers generate",
                                r["speedup_vs_hf_generate"], ">= 1.5", r["speedup_vs_hf_generate"] >= 1.5,
                                _prec(de), _cpu(de)))
        lines += [f"## Decode (prompt {de['prompt']}, {de['new_tokens']} new tokens, {de['dtype']})", "",
                  common.md_table(de["rows"], ["config", "batch", "impl", "median_s", "tokens_per_s",
                                               "speedup_vs_hf_generate"]), ""]
    an = load("analysis")
    if an:
        for r in an["rows"]:
            if r.get("method") == "capture" and r.get("T") == max(x["T"] for x in an["rows"]) and "peak_extra_gib" in r:
                targets.append((f"analysis peak memory at T={r['T']} (GiB)", r["peak_extra_gib"], "<= 2",
                                r["peak_extra_gib"] <= 2, _prec(an), _cpu(an)))
        lines += ["## Analysis", "", common.md_table(an["rows"], ["T", "method", "seconds", "peak_extra_gib",
                                                                  "error"]), ""]
    moe = load("moe")
    if moe:
        lines += [f"## MoE fast path vs loop reference (bench_moe.py, {_prec(moe)})", "",
                  common.md_table(moe.get("results", []), ["variant", "median_ms", "speedup_vs_loop"]), ""]
    stamps = [(n, load(n)) for n in ("train", "train_d768", "mainjob", "profile_train", "profile_train_compile",
                                     "decode", "analysis", "moe")]
    stamps = [(n, r) for n, r in stamps if isinstance(r, dict)]
    if stamps:
        lines += ["## When each result was measured (UTC, 1/5/15-minute load average at its end)", "",
                  "A file without a time stamp comes from a run made before time stamps were recorded (an earlier "
                  "round); compare only figures measured together.", "",
                  "\n".join(f"- {n}.json: {_when(r)}" for n, r in stamps), ""]
    loads = LOADS or [(m, tuple(v)) for m, v in (load("loads") or [])]
    if loads:
        lines += ["## Load average during the run (2-core machine shared with other engineers)", "",
                  "\n".join(f"- {m}: {a:.2f} / {b:.2f} / {c:.2f}" for m, (a, b, c) in loads), ""]
    head = ["## Targets", "", "| measure | value | target | met | precision | CPU kind |", "|---|---|---|---|---|---|"]
    head += [f"| {n} | {v:.3g} | {t} | {'—' if t == '—' else 'yes' if ok else 'NO'} | {p} | {c} |"
             for n, v, t, ok, p, c in targets]
    return "\n".join(lines[:4] + head + [""] + lines[4:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=0, help="torch threads for every bench (0 = torch default)")
    ap.add_argument("--quick", action="store_true", help="tiny smoke-test sizes (checks the scripts, not speed)")
    ap.add_argument("--skip", default="", help="comma list of benches to skip: train, d768, profile_compile, mainjob, decode, analysis, moe")
    ap.add_argument("--reps", type=int, default=5, help="timed rounds of the train bench (medians)")
    ap.add_argument("--impls", default="ours,ours_fast,hf", help="train bench implementations")
    ap.add_argument("--compile-impls", default="ours_fast,hf", help="train bench implementations also compiled "
                    "(each compile costs minutes on a loaded 2-core machine)")
    common.precision_arg(ap, what="numerics of every bench", note="; recorded as resolved_precision in every result")
    ap.add_argument("--results", default=None, metavar="DIR",
                    help="write the result JSONs and SUMMARY.md there (default bench/results)")
    ap.add_argument("--clock", choices=["wall", "cpu"], default=None,
                    help="timer of every bench: wall time, or process CPU time (default: cpu with --threads 1, "
                         "where it is the honest measure on a machine shared beyond its cores; wall otherwise)")
    args = ap.parse_args(argv)
    os.environ["BENCH_CLOCK"] = args.clock or ("cpu" if args.threads == 1 else "wall")
    if args.results:  # the child benches read it through common.RESULTS
        common.RESULTS = Path(args.results).resolve()
        os.environ["BENCH_RESULTS"] = str(common.RESULTS)
    skip = set(filter(None, args.skip.split(",")))
    th = ["--threads", str(args.threads)] if args.threads else []
    pr = ["--precision", args.precision]  # every bench runs in the same precision
    ok = True
    if "train" not in skip:
        q = ["--batch", "2", "--seq", "32", "--reps", "1", "--warmup", "1", "--modes", "eager"] if args.quick else []
        tr = [] if args.quick else ["--reps", str(args.reps), "--warmup", "1", "--impls", args.impls,
                                    "--compile-impls", args.compile_impls]
        ok &= run("bench_train.py", *th, *pr, *q, *tr, "--configs", TRAIN_CONFIGS)
        q = ["--batch", "2", "--seq", "32", "--reps", "1", "--warmup", "1"] if args.quick else \
            ["--batch", "8", "--reps", "3", "--warmup", "1"]
        if "d768" not in skip:
            ok &= run("bench_train.py", *th, *pr, *q, "--hidden", "768", "--heads", "12", "--kv-heads", "4", "--configs",
                      "ungated,G1-elem-parity", "--impls", "ours_fast,hf", "--modes", "eager", "--out", "train_d768")
        q = ["--batch", "2", "--seq", "32", "--steps", "1"] if args.quick else []
        ok &= run("profile_train.py", *th, *pr, *q)
        if not args.quick and "profile_compile" not in skip:
            ok &= run("profile_train.py", *th, *pr, "--compile", "--out", "profile_train_compile")
    if "mainjob" not in skip:
        q = ["--reps", "1", "--modes", "plain,fast", "--budget", "small"] if args.quick else []
        ok &= run("bench_mainjob.py", *th, *pr, *q)
    if "decode" not in skip:
        q = ["--prompt", "8", "--new", "8", "--reps", "1", "--batches", "1"] if args.quick else []
        ok &= run("bench_decode.py", *th, *pr, *q)
    if "analysis" not in skip:
        q = ["--lengths", "512,1024", "--eager-max", "512"] if args.quick else []
        ok &= run("bench_analysis.py", *q, *pr, *(th or ["--threads", "1"]))
    if "moe" not in skip and (common.ROOT / "bench_moe.py").exists():
        q = ["--steps", "2", "--warmup", "1", "--tokens", "256"] if args.quick else []
        ok &= run("bench_moe.py", *th, *pr, *q, "--out", str(common.RESULTS / "moe.json"))
    # a run of some benches (--skip) keeps the recorded loads of the others, so SUMMARY.md shows every result's
    ran = {m.split(" ", 1)[1] for m, _ in LOADS}
    kept = [(m, tuple(v)) for m, v in (load("loads") or [])
            if m.startswith(("before ", "after ")) and m.split(" ", 1)[1] not in ran]
    LOADS[:0] = kept
    common.write_json("loads", LOADS)
    text = summary()
    common.write_text(common.RESULTS / "SUMMARY.md", text + "\n")
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
