"""Where a result came from: the code's commit and the machine it ran on (`provenance`, recorded in every lab.json),
and the version of the code that decides a trained unit's numbers (`code_version`, part of a unit's reuse key).

`code_version` hashes the *syntax* of the modules a training unit executes — the model (the package's top-level
modules and kernels/), the trainer (train/), the data pipeline (data/) and the precision policy — with docstrings
dropped, so an edit to a comment or a docstring keeps stored units reusable while any change of code makes a lab stop
before mixing runs of two code versions (the reuse rule: experiment/cache.py).
"""
from __future__ import annotations

import ast
import hashlib
import os
import platform
import subprocess
from functools import lru_cache
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]
TRAINING_CODE = ("*.py", "kernels/*.py", "train/*.py", "data/*.py", "util/precision.py")  # globs under the package


def _syntax(path: Path) -> str:
    """The module's syntax tree without docstrings (comments are not in the tree at all)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(body, list) and body and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)


@lru_cache(maxsize=1)
def code_version() -> str:
    """A 16-hex-digit hash of the training code's syntax (the files of TRAINING_CODE, in sorted order)."""
    h = hashlib.sha256()
    files = sorted({p for g in TRAINING_CODE for p in PACKAGE.glob(g)})
    for p in files:
        h.update(p.relative_to(PACKAGE).as_posix().encode())
        h.update(_syntax(p).encode())
    return h.hexdigest()[:16]


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=PACKAGE, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), with its bf16 GEMM class: 'AMX', 'AVX512-BF16' or 'AVX2'."""
    name, flags = "", ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and not name:
                    name = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = line
    except OSError:
        pass
    have = set(flags.split(":", 1)[-1].split())
    kind = "AMX" if "amx_bf16" in have else "AVX512-BF16" if "avx512_bf16" in have else (
        "AVX2" if "avx2" in have else "other")
    return f"{name or platform.processor() or 'unknown CPU'} ({kind})"


def provenance() -> dict:
    """{commit, dirty, cpu, torch, threads, code_version}: what a lab.json records beside its figures."""
    import torch

    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": bool(status) if status is not None else None, "cpu": cpu_model(),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "cores": os.cpu_count(),
            "code_version": code_version()}
