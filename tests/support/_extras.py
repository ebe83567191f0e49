"""Optional extras in tests: skipped where they are not installed, REQUIRED where GATTN_REQUIRE_EXTRAS=1 (CI sets it,
so an integration test can never silently turn into a skip there)."""
from __future__ import annotations

import importlib
import os

import pytest

REQUIRED = os.environ.get("GATTN_REQUIRE_EXTRAS") == "1"


def need(module: str, hint: str):
    """Import `module`, or skip with `hint` (fail under GATTN_REQUIRE_EXTRAS=1)."""
    if REQUIRED:
        try:
            return importlib.import_module(module)
        except ImportError as exc:
            pytest.fail(f"GATTN_REQUIRE_EXTRAS=1 but {module} is missing ({exc}); {hint}", pytrace=False)
    return pytest.importorskip(module, reason=f"{module} not installed: {hint}")
