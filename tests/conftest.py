"""Shared fixtures (the plain functions behind them live in tests/support/harness.py, importable as `harness`).

tests/ holds the test files; tests/support/ the helpers they import by module name (`harness`, `memprobe`,
`_extras`, the independent references), put on sys.path here; tests/probes/ the scripts tests run as their own
processes (under torchrun or as `gattn`'s entry point), imported as `probes.NAME` where a test also calls into one."""
from __future__ import annotations

import os
import sys

# Triton's interpreter (the only way its kernels run without a GPU; tests/test_triton_attention.py) is chosen when
# triton.language is first imported, which other modules (torch.compile's inductor) may do during collection.
os.environ.setdefault("TRITON_INTERPRET", "1")

# Under xdist every worker (and what it spawns: `gattn` subprocesses, torchrun ranks) shares the cores with the other
# workers: torch's default of one thread per core would run 2 workers x 2 threads on 2 cores, and OpenMP threads that
# spin-wait for a descheduled peer slow everything down. Each worker gets its share of the cores (a user's own
# OMP_NUM_THREADS wins); one process (-n 0) keeps torch's default.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _THREADS = str(max(1, (os.cpu_count() or 1) // _WORKERS))
    for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_var, _THREADS)
    if "torch" in sys.modules:  # imported before this file (by a plugin): set it in this process too
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))  # the helpers, by module name

import harness  # noqa: E402


@pytest.fixture
def tiny_model():
    """Factory: tiny_model(gate="baseline", backend="sdpa", seed=0, **config_overrides) -> a tiny eval-mode LM."""
    return harness.tiny_lm


@pytest.fixture
def gattn():
    """Run `gattn ARGS...` in a subprocess: gattn("gates", "--json") -> CompletedProcess (text stdout/stderr)."""
    return harness.run_gattn


@pytest.fixture
def gattn_main(capsys):
    """Run `gattn ARGS...` in this process: gattn_main("gates", "--json") -> (exit code, stdout, stderr)."""
    from gated_attention.cli import main

    def run(*args):
        rc = main([str(a) for a in args])
        cap = capsys.readouterr()
        return rc, cap.out, cap.err

    return run


@pytest.fixture
def check_reference():
    """assert_matches_reference(fast, reference, inputs, ...): a fast path's outputs and gradients vs its reference."""
    return harness.assert_matches_reference


WORDS = ("the of and to in is was that he it with as his on be at by had not are but from or have an they which one "
         "you were her all she there would their we him been has when who will more no if out so said what up its "
         "about into than them can only other new some could time these two may then do first any my now such like")


def _prose(rng, n_par: int) -> str:
    words = WORDS.split()
    pars = []
    for _ in range(n_par):
        sents = [" ".join(rng.choice(words) for _ in range(rng.randint(5, 14))).capitalize() + "."
                 for _ in range(rng.randint(2, 5))]
        pars.append(" ".join(sents))
    return "\n\n".join(pars)


def _code(rng, n_funcs: int) -> str:
    out = []
    for i in range(n_funcs):
        a, b = rng.choice("xyzab"), rng.choice("uvwcd")
        out.append(f"def f{i}({a}, {b}):\n    if {a} > {b}:\n        return {a} - {b}\n    return {a} * {rng.randint(1, 9)}\n")
    return "\n\n".join(out)


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> Path:
    """A prepared two-domain corpus (prose, code) from generated text files, 300-token BPE: seconds to build."""
    import random

    rng = random.Random(0)
    prose = {f"book{i}.txt": _prose(rng, 60) for i in range(4)}
    code = {f"mod{i}.py": _code(rng, 80) for i in range(3)}
    out = tmp_path_factory.mktemp("tiny_corpus") / "data"
    return Path(harness.prepare_text_corpus(out, {"prose": prose, "code": code}, vocab_size=300, val_fraction=0.2,
                                            chunk_chars=600))


# --- Scheduling over xdist workers (pyproject's addopts: -n auto --dist loadgroup --no-loadscope-reorder) ----------
# Each test is its own unit of work, except the files whose module fixtures cost seconds to build (a lab run, a
# prepared corpus): those carry `pytestmark = pytest.mark.xdist_group(...)` and run whole in one worker, their
# fixtures built once. The other files' shared fixtures are session-scoped, built at most once per worker: a
# module-scoped one would be torn down and built again whenever the worker turns to another file's test, which the
# order below does all the time. Units are sent to the workers longest first (the LPT rule: the last unit to finish is then a
# short one), by the per-test seconds of the last profiled run in tests/durations.json (refreshed with
# scripts/refresh_test_durations.py); a test not in it counts as DEFAULT_SECONDS. Only the ORDER depends on those
# timings: what runs, and every result, does not.
DURATIONS = Path(__file__).with_name("durations.json")
DEFAULT_SECONDS = 0.1  # a test not in the file: most are the many short ones the file leaves out (< 0.25 s)


def _unit(item) -> str:
    group = item.get_closest_marker("xdist_group")
    if group is not None:
        return "group:" + (group.args[0] if group.args else group.kwargs.get("name", "default"))
    return item.nodeid.split("@")[0]


def pytest_configure(config):
    """--dist loadgroup needs pytest 8: pytest 9 keeps node ids where pytest-xdist 3.8 cannot add "@group", so each
    xdist_group would be split over workers, every worker rebuilding its minute-long module fixtures."""
    if config.getoption("dist", "no") == "loadgroup" and int(pytest.__version__.split(".")[0]) >= 9:
        raise pytest.UsageError(f"pytest {pytest.__version__} breaks pytest-xdist's --dist loadgroup; install the "
                                "project's dev extra (pytest<9): bash scripts/setup.sh")


def pytest_collection_modifyitems(config, items):
    import json

    seconds = json.loads(DURATIONS.read_text(encoding="utf-8")) if DURATIONS.exists() else {}
    cost: dict[str, float] = {}
    for item in items:
        unit = _unit(item)
        cost[unit] = cost.get(unit, 0.0) + seconds.get(item.nodeid.split("@")[0], DEFAULT_SECONDS)
    first = {}
    for i, item in enumerate(items):
        first.setdefault(_unit(item), i)
    # longest unit first; a group's tests stay together, in their collected order
    items.sort(key=lambda it: (-cost[_unit(it)], first[_unit(it)]))
