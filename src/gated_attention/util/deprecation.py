"""Moved modules keep their old import paths for one release: `import gated_attention.convert` still works, warns
(DeprecationWarning, naming the new path) and returns the new module itself, the same object, so attributes,
monkeypatching and pickling behave exactly as before.

`MOVED` maps an old dotted path to its new one; a moved package carries its whole subtree along
(`gated_attention.convert.llama` -> `gated_attention.interop.llama`), and an entry for a submodule overrides that.
`install()` (run by gated_attention/__init__.py) puts the finder first on sys.meta_path, so an old path never loads
a second copy of a module from the new folder. ARCHITECTURE.md ("Moved modules") shows this table to readers.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings

# old path -> new path; removed in the release after the one that moved them
MOVED: dict[str, str] = {
    "gated_attention.convert": "gated_attention.interop",
    "gated_attention.retrofit": "gated_attention.interop.retrofit",
    "gated_attention.errors": "gated_attention.util.errors",
    "gated_attention.io": "gated_attention.util.io",
    "gated_attention.progress": "gated_attention.util.progress",
    "gated_attention.precision": "gated_attention.util.precision",
    "gated_attention.baselines": "gated_attention.mechanisms",
    "gated_attention.triton_attention": "gated_attention.kernels.triton_attention",
    "gated_attention.triton_kernels": "gated_attention.kernels.triton_jit",
    "gated_attention.compare_report": "gated_attention.compare.report",
    "gated_attention.compare_claims": "gated_attention.compare.claims",
    "gated_attention.train.stability": "gated_attention.train.monitors",
    "gated_attention.analysis.sink": "gated_attention.analysis.attention_sinks",
    "gated_attention.labs.backcopy": "gated_attention.labs.sinks.backcopy",
    "gated_attention.labs.sink_metrics": "gated_attention.labs.sinks.metrics",
    "gated_attention.labs.sinks_report": "gated_attention.labs.sinks.report",
    "gated_attention.labs.stability_probe": "gated_attention.labs.stability.probe",
    "gated_attention.labs.stability_report": "gated_attention.labs.stability.report",
    "gated_attention.labs.streaming_report": "gated_attention.labs.streaming.report",
}


def new_path(name: str) -> str | None:
    """The new dotted path of an old one (an exact entry, else the nearest moved parent package), or None."""
    if name in MOVED:
        return MOVED[name]
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        parent = ".".join(parts[:i])
        if parent in MOVED:
            return ".".join([MOVED[parent], *parts[i:]])
    return None


def _caller_stacklevel() -> int:
    """warnings.warn's stacklevel of the first frame outside this file and the import machinery: the importer."""
    frame, level = sys._getframe(1), 2
    while frame is not None and (frame.f_code.co_filename == __file__
                                 or frame.f_code.co_filename.startswith("<frozen importlib")):
        frame, level = frame.f_back, level + 1
    return level


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers only for old paths: the 'module' it loads is the new module, its own __spec__ kept."""

    def __init__(self):
        self._spec_of: dict[str, importlib.machinery.ModuleSpec] = {}

    def find_spec(self, name, path=None, target=None):
        return importlib.machinery.ModuleSpec(name, self) if new_path(name) is not None else None

    def create_module(self, spec):
        new = new_path(spec.name)
        warnings.warn(f"{spec.name} moved to {new}; import it from there (the old path goes in the next release)",
                      DeprecationWarning, stacklevel=_caller_stacklevel())
        module = importlib.import_module(new)
        self._spec_of[module.__name__] = module.__spec__  # the import system sets __spec__ to the old path's
        return module

    def exec_module(self, module):
        module.__spec__ = self._spec_of.pop(module.__name__, module.__spec__)  # nothing to run: it is loaded


_FINDER = _MovedFinder()


def renamed_attributes(module_name: str, namespace: dict, renames: dict[str, str]):
    """A module-level `__getattr__` that still answers renamed or moved attributes for one release, with a
    DeprecationWarning: `renames` maps an old name to its new one in the same module (`namespace` is the module's
    globals()) or to "package.module:name" elsewhere (imported on first use)."""

    def __getattr__(name: str):
        if name not in renames:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        where, _, new = renames[name].rpartition(":")
        warnings.warn(f"{module_name}.{name} is now {where or module_name}.{new} (the old name goes in the next "
                      "release)", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(where), new) if where else namespace[new]

    return __getattr__


def install() -> None:
    """Put the finder first on sys.meta_path (once)."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
