"""How long `gattn` takes to answer what a newcomer types first: `--help`, `--version`, a command's `--help`, a
mistyped command or preset, `gattn settings`. Each is a fresh `python -m gated_attention.cli ...` process (what the
`gattn` script runs), timed wall-clock from start to exit; the median of --runs per command is reported, next to
`python -c pass` (the interpreter's own start, the floor).

--baseline-src DIR times a second source tree (e.g. a `git worktree` of an older commit) round-robin with this one,
so both see the same load: the before/after of a change. Writes bench/results/<--out>.json with the CPU, the load
average before and after, and each tree's commit.

Run: python bench/bench_cli.py [--runs 5] [--baseline-src DIR/src [--baseline-commit C]] [--out cli_startup]
     (a baseline tree: mkdir DIR && git archive C src | tar -x -C DIR)
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import common  # (also puts src/ on the path)

SRC = Path(__file__).resolve().parent.parent / "src"
# (label, argv after `gattn`); None = the interpreter alone
COMMANDS = [
    ("python -c pass", None),
    ("gattn --help", ["--help"]),
    ("gattn --version", ["--version"]),
    ("gattn train --help", ["train", "--help"]),
    ("gattn lab scaling --help", ["lab", "scaling", "--help"]),
    ("gattn compare --help", ["compare", "--help"]),
    ("gattn trian (mistyped)", ["trian"]),
    ("gattn train --preset smal (mistyped)", ["train", "--preset", "smal", "--out", "unused"]),
    ("gattn settings", ["settings"]),
]


def commit(src: Path) -> str:
    """The tree's commit, with `-dirty` when it has uncommitted changes to tracked files."""
    def git(*args):
        return subprocess.run(["git", "-C", str(src), *args], capture_output=True, text=True).stdout.strip()

    return git("rev-parse", "--short=12", "HEAD") + ("-dirty" if git("status", "--porcelain", "-uno") else "")


def run_once(src: Path, argv: list[str] | None) -> tuple[float, int]:
    cmd = [sys.executable, "-c", "pass"] if argv is None else [sys.executable, "-m", "gated_attention.cli", *argv]
    env = {**os.environ, "PYTHONPATH": str(src)}
    t = time.perf_counter()
    rc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
    return time.perf_counter() - t, rc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5, help="timed runs per command and tree (default 5)")
    ap.add_argument("--baseline-src", type=Path, default=None, help="another tree's src/ to time alongside")
    ap.add_argument("--baseline-commit", default=None,
                    help="the baseline's commit, when its tree is no git checkout (e.g. `git archive COMMIT src`)")
    ap.add_argument("--out", default="cli_startup", help="result name: bench/results/<out>.json")
    args = ap.parse_args(argv)
    trees = {"this": SRC} | ({"baseline": args.baseline_src.resolve()} if args.baseline_src else {})
    load_before = os.getloadavg()
    times = {t: {label: [] for label, _ in COMMANDS} for t in trees}
    codes = {t: {} for t in trees}
    for r in range(args.runs):
        for label, cmd in COMMANDS:  # round-robin: every tree and command in each round, so a slow spell hits all
            for tree, src in trees.items():
                seconds, rc = run_once(src, cmd)
                times[tree][label].append(seconds)
                codes[tree][label] = rc
        print(f"round {r + 1}/{args.runs}: " + ", ".join(
            f"{tree} {label}={times[tree][label][-1]:.2f}s" for tree in trees for label, _ in COMMANDS[1:3]),
            flush=True)
    result = {
        "what": "wall seconds from process start to exit, median of `runs` fresh processes per command",
        "runs": args.runs,
        "machine": common.machine(),
        "load_avg_before": load_before, "load_avg_after": os.getloadavg(),
        "trees": {tree: {"src": str(src), "commit": (args.baseline_commit if tree == "baseline" and
                                                      args.baseline_commit else commit(src))}
                  for tree, src in trees.items()},
        "commands": [{"command": label, **{tree: {"median_s": round(common.median(times[tree][label]), 3),
                                                  "min_s": round(min(times[tree][label]), 3),
                                                  "max_s": round(max(times[tree][label]), 3),
                                                  "exit_code": codes[tree][label]} for tree in trees}}
                     for label, _ in COMMANDS],
    }
    path = common.write_json(args.out, result)
    width = max(len(label) for label, _ in COMMANDS)
    print(f"{'command':<{width}}  " + "  ".join(f"{tree:>10}" for tree in trees))
    for row in result["commands"]:
        print(f"{row['command']:<{width}}  " + "  ".join(f"{row[tree]['median_s']:>9.2f}s" for tree in trees))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
