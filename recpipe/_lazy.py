"""One mechanism for lazy re-exports (PEP 562) in package ``__init__`` files.

Packages re-export their public nouns without importing the modules that define them, so that
``import etl`` never imports torch and ``recpipe --help`` stays fast. A package keeps a literal
``__all__`` (what linters and readers look at) and hands the rest to :func:`lazy_exports`::

    __all__ = ["ReaderConfig", "make_dataloader"]
    __getattr__, __dir__ = lazy_exports(
        __name__, {"readers.source": ("ReaderConfig",), "readers.dataset": ("make_dataloader",)}
    )

This module imports nothing beyond the standard library: every layer may use it.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, where: Mapping[str, Iterable[str]]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """Build a package's ``__getattr__`` and ``__dir__``.

    Args:
        package: the package's ``__name__``.
        where: defining module -> the names it provides.

    Returns:
        ``(__getattr__, __dir__)``. A resolved name is cached in the package's namespace, so each
        module is imported once, on first use; ``__dir__`` lists the package's ``__all__``.

    Raises:
        ValueError: a name is listed under two modules.

    >>> getattr_, dir_ = lazy_exports("json", {"json.decoder": ("JSONDecodeError",)})
    >>> getattr_("JSONDecodeError").__name__
    'JSONDecodeError'
    """
    module_of: dict[str, str] = {}
    for module, names in where.items():
        for name in names:
            if name in module_of:
                msg = f"`{name}` is exported by both {module_of[name]!r} and {module!r}"
                raise ValueError(msg)
            module_of[name] = module

    def __getattr__(name: str) -> Any:
        module = module_of.get(name)
        if module is None:
            msg = f"module {package!r} has no attribute {name!r}"
            raise AttributeError(msg)
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(getattr(sys.modules[package], "__all__", module_of))

    return __getattr__, __dir__
