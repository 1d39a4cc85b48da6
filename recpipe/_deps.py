"""One place for optional heavy dependencies (torchrec, numba-cuda).

Use :func:`optional_import` instead of a bare ``import`` so that a missing extra gives an error
that says how to install it, and :func:`has_module` for cheap feature checks in tests.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

from recpipe.errors import DependencyError

__all__ = ["has_module", "optional_import"]

_INSTALL_HINTS = {
    "torchrec": "pip install 'recpipe[torchrec]' && pip install --no-deps torchrec==1.8.0",
    "fbgemm_gpu": "pip install fbgemm-gpu-cpu==1.8.0",
    "numba.cuda": "pip install 'recpipe[cuda]'",
}


def has_module(name: str) -> bool:
    """Return True if ``name`` can be imported (without importing it)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def optional_import(name: str, *, purpose: str = "") -> ModuleType:
    """Import an optional dependency or raise :class:`DependencyError` with an install hint.

    Args:
        name: module to import, e.g. ``"torchrec"``.
        purpose: what it is needed for, quoted in the error.
    """
    try:
        return importlib.import_module(name)
    except Exception as exc:  # ImportError, or an extension failing to load its library
        root = name.split(".")[0]
        hint = _INSTALL_HINTS.get(name) or _INSTALL_HINTS.get(root) or f"pip install {root}"
        why = f" (needed for {purpose})" if purpose else ""
        msg = f"optional dependency `{name}` is not available{why}: {exc}\nhint: {hint}"
        raise DependencyError(msg) from exc
