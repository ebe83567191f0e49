"""Compare two runs of the same lab figure by figure: `python scripts/compare_lab_json.py BEFORE/lab.json
AFTER/lab.json` prints every differing figure (path: before vs after) and exits 1 when there is one, 0 when the two
are the same. Time and provenance fields (wall/CPU seconds, paths of the run folders) differ between any two runs and
are left out, and so is anything under a key named in --ignore."""
from __future__ import annotations

import argparse
import json
import sys

# keys whose values are times, or the folders the runs lived in: they differ between any two runs of the same code
VOLATILE = {"wall_time_s", "wall_s", "cpu_s", "cpu_time_s", "cpu_s_runs", "started", "finished", "timestamp",
            "provenance", "out", "data_dir", "models", "starts", "model_dir", "path", "dir", "source", "elapsed_s",
            "fingerprint", "train_wall_time_s", "timings_s"}


def diff(a, b, path: str = "", ignore: frozenset = frozenset()) -> list[str]:
    """Every place where a and b differ, as 'path: a vs b' (keys in VOLATILE or ignore are skipped)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            if k in VOLATILE or k in ignore:
                continue
            if k not in a or k not in b:
                out.append(f"{path}.{k}: {'absent' if k not in a else 'present'} vs "
                           f"{'absent' if k not in b else 'present'}")
            else:
                out += diff(a[k], b[k], f"{path}.{k}", ignore)
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: {len(a)} items vs {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in diff(x, y, f"{path}[{i}]", ignore)]
    if isinstance(a, str) and isinstance(b, str) and a.startswith("/") and b.startswith("/"):
        return []  # an absolute path: where the run lived, not a figure
    return [] if a == b else [f"{path}: {json.dumps(a)[:80]} vs {json.dumps(b)[:80]}"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("before")
    p.add_argument("after")
    p.add_argument("--ignore", nargs="*", default=[], help="more keys to leave out")
    args = p.parse_args(argv)
    with open(args.before) as f, open(args.after) as g:
        found = diff(json.load(f), json.load(g), ignore=frozenset(args.ignore))
    for line in found:
        print(line)
    print(f"{args.before} vs {args.after}: {'the same figures' if not found else f'{len(found)} difference(s)'}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
