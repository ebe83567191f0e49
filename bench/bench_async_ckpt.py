"""Checkpoint stall of the training loop, blocking saves vs async_checkpoint, under dist=fsdp at --ranks ranks (gloo
on CPU, torchrun): the seconds the loop is blocked per periodic save.

Each repetition trains the same short run twice, blocking then async (the order alternates between repetitions, so a
slow spell hits both), each in a fresh folder under a torchrun of its own. Every rank times, in its own process
(this file as the rank script: trainer._save_checkpoint and saving.commit_staged wrapped), every periodic save call
— for a blocking save the whole save; for an async one the staging plus the commit of the save before it (its write
waited for if unfinished) — and the commit of the last async save in the run's end. A save blocks the loop until its
slowest rank is through (the commit is a collective), so each save counts the maximum over ranks; stall per save =
(those summed + the end commit) / the number of periodic saves, of which the commits' share (a blocking save's
hashing, manifest and rename; an async one's wait for the previous write, manifest, rename and rotation) is reported
too. The final checkpoint (blocking in both modes) is not counted. Also reported: the run's training wall time
(summary.json's wall_time_s, which includes the final save), so the cost of the background thread competing for the
cores shows too.
Run: python bench/bench_async_ckpt.py [--reps 3 --ranks 2 --hidden 512 --layers 8 --vocab 8192 --steps 24 --every 4]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common  # (also puts src/ on the path)

MODES = {"blocking": [], "async": ["async_checkpoint=true"]}


def worker(result: str, args: list[str]) -> int:
    """One rank: `gattn train ARGS` with the save calls timed; writes RESULT.rank<r>.json."""
    from gated_attention.cli import main
    from gated_attention.train import saving, trainer

    saves, commits, ends, inside = [], [], [], [None]  # inside: the commit seconds of the save being timed
    save, commit = trainer._save_checkpoint, saving.commit_staged

    def timed_save(run, next_step, *a, **kw):
        t, inside[0] = time.perf_counter(), 0.0
        try:
            save(run, next_step, *a, **kw)
        finally:
            spent, inside[0] = inside[0], None
        if next_step < run.cfg.steps:  # a periodic save; the final one is blocking in either mode
            saves.append(time.perf_counter() - t)
            commits.append(spent)

    def timed_commit(run, *a, **kw):
        t = time.perf_counter()
        commit(run, *a, **kw)
        if inside[0] is not None:  # inside a save: part of its time
            inside[0] += time.perf_counter() - t
        else:
            ends.append(time.perf_counter() - t)

    trainer._save_checkpoint, saving.commit_staged = timed_save, timed_commit
    rc = main(args)
    times = {"saves": saves, "commits": commits, "end": ends}
    Path(f"{result}.rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(times))
    return rc


def train_sets(a) -> list[str]:
    return ["dist=fsdp", "precision=fp32", "compile=false", "gate=sdpa_elementwise", f"steps={a.steps}",
            f"ckpt_every={a.every}", "keep_checkpoints=2", "stats_every=0", "eval_batches=1", "eval_batch_size=2",
            f"batch_size={a.ranks}", f"seq_len={a.seq}", f"model.hidden_size={a.hidden}",
            f"model.intermediate_size={3 * a.hidden}", f"model.num_hidden_layers={a.layers}",
            f"model.num_attention_heads={a.hidden // 64}", f"model.num_key_value_heads={a.hidden // 64}",
            "model.head_dim=64", f"model.vocab_size={a.vocab}"]


def one_run(a, mode: str, folder: Path) -> dict:
    sets = train_sets(a) + MODES[mode]
    out, result = folder / mode, folder / f"{mode}_times"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={a.ranks}", __file__,
           "--worker", str(result), "train", "--preset", "tiny", "--out", str(out),
           *sum((["--set", s] for s in sets), [])]
    p = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"bench: the {mode} run failed:\n{p.stderr[-3000:]}")
    ranks = [json.loads((folder / f"{mode}_times.rank{r}.json").read_text()) for r in range(a.ranks)]
    per_save = [max(r["saves"][i] for r in ranks) for i in range(len(ranks[0]["saves"]))]
    commits = [max(r["commits"][i] for r in ranks) for i in range(len(ranks[0]["commits"]))]
    end = max(sum(r["end"]) for r in ranks)
    ckpt = max(p for p in (out / "checkpoints").iterdir() if p.name.startswith("step_"))
    size = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
    wall = json.loads((out / "summary.json").read_text())["wall_time_s"]
    shutil.rmtree(out)
    return {"per_save_s": per_save, "commit_in_save_s": commits, "end_commit_s": end,
            "commit_per_save_s": (sum(commits) + end) / len(commits),
            "stall_per_save_s": (sum(per_save) + end) / len(per_save),
            "train_wall_s": wall, "checkpoint_bytes": size}


def params(a) -> int:
    from gated_attention.train.overrides import apply_overrides
    from gated_attention.train.plan import meta_model, sizes
    from gated_attention.train.train_presets import tiny

    return sizes(meta_model(apply_overrides(tiny(), train_sets(a))))["total"]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3, help="repetitions of the (blocking, async) pair")
    ap.add_argument("--ranks", type=int, default=2, help="torchrun ranks (one thread each)")
    ap.add_argument("--hidden", type=int, default=512, help="hidden size (heads of 64)")
    ap.add_argument("--layers", type=int, default=8, help="decoder layers")
    ap.add_argument("--vocab", type=int, default=8192, help="vocabulary size")
    ap.add_argument("--seq", type=int, default=64, help="tokens per sequence (one sequence per rank per step)")
    ap.add_argument("--steps", type=int, default=24, help="optimizer steps per run")
    ap.add_argument("--every", type=int, default=4, help="ckpt_every: a periodic save every N steps")
    ap.add_argument("--out", default="async_ckpt", help="result name: bench/results/<out>.json")
    a = ap.parse_args(argv)
    n_params = params(a)
    print(f"bench: {n_params / 1e6:.1f}M parameters, fp32, {a.ranks} ranks, a save every {a.every} of {a.steps} steps",
          flush=True)
    load_before = os.getloadavg()
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory(prefix="bench_async_ckpt_") as tmp:
        for rep in range(a.reps):
            order = list(MODES) if rep % 2 == 0 else list(reversed(MODES))
            for mode in order:
                runs[mode].append(one_run(a, mode, Path(tmp) / f"rep{rep}"))
                r = runs[mode][-1]
                print(f"  rep {rep + 1}/{a.reps} {mode}: stall {r['stall_per_save_s']:.3f} s/save "
                      f"(saves {', '.join(f'{s:.3f}' for s in r['per_save_s'])}; end {r['end_commit_s']:.3f}; commits "
                      f"{r['commit_per_save_s']:.3f} s/save), "
                      f"training {r['train_wall_s']:.1f} s", flush=True)
    rows = [{"mode": m, "stall_s_per_save": common.median([r["stall_per_save_s"] for r in rs]),
             "spread": common.rel_spread([r["stall_per_save_s"] for r in rs]),
             "of_it_commit_s": common.median([r["commit_per_save_s"] for r in rs]),
             "train_wall_s": common.median([r["train_wall_s"] for r in rs]),
             "checkpoint_MB": rs[0]["checkpoint_bytes"] / 1e6} for m, rs in runs.items()]
    res = {"machine": common.machine(), "load_avg_before": load_before, "resolved_precision": "fp32",
           "params": n_params, "settings": vars(a), "runs": runs, "rows": rows}
    common.write_json(a.out, res)
    print(common.md_table(rows, ["mode", "stall_s_per_save", "spread", "of_it_commit_s", "train_wall_s",
                                 "checkpoint_MB"]))
    print(f"load average before {load_before}, after {os.getloadavg()}; {res['machine']['cpu']} "
          f"({res['machine']['cpu_kind']})")
    return res


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        sys.exit(worker(sys.argv[2], sys.argv[3:]))
    main()
