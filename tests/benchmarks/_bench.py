"""Load a `benchmarks/<name>.py` script as a module, for the smoke tests beside this file."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """Import ``benchmarks/<name>.py`` (a script, not a package module) under a private name.

    ``benchmarks/`` joins ``sys.path`` as it does when a script runs (``python benchmarks/x.py``),
    so the scripts' ``from _common import ...`` resolves the same way in both.
    """
    if str(BENCHMARKS) not in sys.path:
        sys.path.append(str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(
        f"recpipe_bench_{name}", BENCHMARKS / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module
