"""Write tests/durations.json (seconds per test id) from a JUnit XML file of a profiled run.

    .venv/bin/python -m pytest -q -n 0 --junitxml=/tmp/suite.xml      # the default run, in one process
    .venv/bin/python scripts/refresh_test_durations.py /tmp/suite.xml

tests/conftest.py sends the longest tests to the xdist workers first; nothing else reads these figures (no test's
outcome depends on them). A JUnit test time includes its setup, so a module fixture's build counts in its first test.
"""
from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

MIN_SECONDS = 0.25  # shorter tests are left out (they count as conftest's DEFAULT_SECONDS): a short, stable file


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_file():
        print("usage: refresh_test_durations.py JUNIT.xml (a pytest --junitxml file)", file=sys.stderr)
        return 2
    out = {}
    for case in ET.parse(argv[0]).iter("testcase"):
        module = case.get("classname", "").replace(".", "/")  # tests.test_x -> tests/test_x
        seconds = float(case.get("time", 0))
        if seconds >= MIN_SECONDS and case.find("skipped") is None:
            out[f"{module}.py::{case.get('name')}"] = round(seconds, 1)
    target = Path(__file__).resolve().parent.parent / "tests" / "durations.json"
    target.write_text(json.dumps(dict(sorted(out.items())), indent=0) + "\n", encoding="utf-8")
    print(f"{len(out)} tests of >= {MIN_SECONDS} s -> {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
