"""Package namespaces whose public names load on first use (PEP 562).

A package `__init__` that lists where each of its names is defined - `__getattr__, __dir__ = lazy_exports(__name__,
HOMES)` with HOMES = {name: submodule} - imports none of those submodules until a name is read, so importing a
light part of the package (a name table that a command-line parser reads) does not import torch through its heavy
siblings. Only names defined in the package's own submodules are answered (tests/test_architecture.py checks it):
this is not a way to keep an old name alive.
"""
from __future__ import annotations

import importlib
import sys


def lazy_exports(package: str, homes: dict[str, str]):
    """(`__getattr__`, `__dir__`) of `package`, whose public name N is the attribute N of submodule `homes[N]`."""

    def __getattr__(name: str):
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{homes[name]}"), name)
        setattr(sys.modules[package], name, value)  # later reads skip this function
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *homes})

    return __getattr__, __dir__
