"""Rewrite README.md's claims excerpt from the compare.json its first line names (the main job's committed result),
so that the README and that result's report say the same: `python scripts/readme_excerpt.py` (after
`gattn compare --report-only --out results/...` or a new run committed there). `--check` only says whether
it is current (exit 1 when not)."""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from gated_attention.compare.compare_report import splice_excerpt  # noqa: E402


def main(argv: list[str]) -> int:
    readme = ROOT / "README.md"
    text = readme.read_text(encoding="utf-8")
    new = splice_excerpt(text, ROOT)
    if "--check" in argv:
        print("README excerpt: " + ("current" if new == text else "stale: run python scripts/readme_excerpt.py"))
        return 0 if new == text else 1
    if new != text:
        readme.write_text(new, encoding="utf-8")
    print(f"README excerpt: {'rewritten' if new != text else 'already current'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
