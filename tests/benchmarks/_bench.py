"""Load a benchmark module (``benchmarks/<name>.py``) for the smoke tests beside this file."""

from __future__ import annotations

import importlib
from types import ModuleType


def load_benchmark(name: str) -> ModuleType:
    """Import ``benchmarks.<name>``, the module ``python -m benchmarks.<name>`` runs."""
    return importlib.import_module(f"benchmarks.{name}")
