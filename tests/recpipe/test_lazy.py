"""Lazy re-exports: every public name of every package resolves, and nothing else does."""

from __future__ import annotations

import importlib

import pytest

from recpipe._lazy import lazy_exports

PACKAGES = ["recpipe", "readers", "trainer", "trainer.store"]


@pytest.mark.parametrize("package", PACKAGES)
def test_every_public_name_resolves(package: str) -> None:
    module = importlib.import_module(package)
    for name in module.__all__:
        assert getattr(module, name) is not None, name
    assert dir(module) == sorted(module.__all__)


@pytest.mark.parametrize("package", PACKAGES)
def test_unknown_name_is_an_attribute_error(package: str) -> None:
    module = importlib.import_module(package)
    with pytest.raises(AttributeError, match=f"module {package!r} has no attribute 'nope'"):
        module.nope  # noqa: B018


def test_a_name_under_two_modules_is_refused() -> None:
    with pytest.raises(ValueError, match="`x` is exported by both 'a' and 'b'"):
        lazy_exports("pkg", {"a": ("x",), "b": ("x",)})
