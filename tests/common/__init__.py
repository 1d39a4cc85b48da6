"""Helpers shared by the tests: schemas (``schemas``), data builders (``data``), tensor builders
(``tensors``) and table equality (``tables``). Import them as ``from tests.common.data import
...``; fixtures stay in the ``conftest.py`` files, built from these."""
