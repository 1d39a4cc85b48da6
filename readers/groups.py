"""Dedup groups chosen at read time: the schema's, ``recpipe stats``' proposal, or a file's.

The Parquet bytes of a clustered dataset do not depend on the dedup groups (a group only says
which sparse columns the reader packs into one IKJT), so the groups are a reader option:
``make_dataloader(..., dedup_groups=...)``, ``recpipe train --dedup-groups`` and
``recpipe serve --dedup-groups`` take

* ``None``: the schema's ``[dedup] groups`` and ``partial`` (what the dataset was built with);
* ``"auto"``: the groups and partial features ``recpipe stats`` proposes for the dataset at the
  reader's batch size (sparse features whose measured DedupeFactor exceeds 1.5, grouped when
  they change on the same samples; among the others, those whose partial DedupeFactor exceeds
  1.5 are read as a partial IKJT);
* a TOML file holding a ``[dedup]`` table shaped like the schema's (``partial`` optional: none
  when absent)::

      [dedup]
      groups = [["user_items", "user_sellers"], ["user_segment"]]
      partial = ["user_recent_items"]

* the groups themselves, a list of lists of sparse feature names (``[]``: no group), and no
  partial feature.

Changing the groups never changes what a model computes: a feature in no group travels in the
plain KJT, and dedup on/off train to the same losses.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from recpipe._deps import optional_import
from recpipe.errors import DataError, SchemaError

if TYPE_CHECKING:
    from schemas import DatasetSchema

__all__ = [
    "AUTO",
    "DedupGroups",
    "Groups",
    "read_dedup_file",
    "read_groups_file",
    "resolve_dedup_groups",
]

AUTO = "auto"
"""The ``dedup_groups`` value that takes ``recpipe stats``' proposal."""

Groups = tuple[tuple[str, ...], ...]
DedupGroups = Sequence[Sequence[str]] | str | os.PathLike[str] | None
"""What a ``dedup_groups`` option accepts (see the module docstring)."""


def read_groups_file(path: str | os.PathLike[str]) -> Groups:
    """The ``[dedup] groups`` of a TOML file (nothing else may be in it but a schema's tables).

    Raises:
        DataError: the file cannot be read or parsed, or has no ``[dedup]`` table with
            ``groups`` (a list of lists of names).
    """
    return read_dedup_file(path)[0]


def read_dedup_file(path: str | os.PathLike[str]) -> tuple[Groups, tuple[str, ...]]:
    """The ``[dedup] groups`` and ``partial`` (``()`` when absent) of a TOML file.

    Raises:
        DataError: as :func:`read_groups_file`, or ``partial`` is not a list of names.
    """
    where = os.fspath(path)
    try:
        doc = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        msg = f"`dedup_groups` file {where!r}: cannot read it as TOML: {exc}"
        raise DataError(msg) from exc
    dedup = doc.get("dedup")
    if not isinstance(dedup, dict) or "groups" not in dedup:
        msg = (
            f"`dedup_groups` file {where!r}: no [dedup] table with `groups`; write e.g.\n"
            '[dedup]\ngroups = [["user_items", "user_sellers"]]'
        )
        raise DataError(msg)
    unknown = sorted(set(dedup) - {"groups", "partial"})
    if unknown:
        msg = (
            f"`dedup_groups` file {where!r}: [dedup] has unknown keys {unknown!r} "
            "(only `groups` and `partial`)"
        )
        raise DataError(msg)
    partial = dedup.get("partial", [])
    if not (isinstance(partial, list) and all(isinstance(n, str) for n in partial)):
        msg = f"`dedup_groups` file {where!r}: [dedup] `partial` must be a list of names, got {partial!r}"
        raise DataError(msg)
    groups = dedup["groups"]
    ok = isinstance(groups, list) and all(
        isinstance(g, list) and all(isinstance(n, str) for n in g) for g in groups
    )
    if not ok:
        msg = f"`dedup_groups` file {where!r}: [dedup] `groups` must be a list of lists of names, got {groups!r}"
        raise DataError(msg)
    return tuple(tuple(g) for g in groups), tuple(partial)


def _proposed_groups(
    dataset: str | os.PathLike[str] | Sequence[Any] | None,
    *,
    schema: DatasetSchema,
    batch_size: int,
) -> tuple[Groups, tuple[str, ...]]:
    if dataset is None or not isinstance(dataset, str | os.PathLike) or not Path(dataset).is_dir():
        msg = f"`dedup_groups` 'auto' needs the dataset directory (to run the stats on), got {dataset!r}"
        raise DataError(msg)
    # the proposal is recpipe stats' (DuckDB over the dataset); etl ships with the readers
    stats = optional_import("etl.stats", purpose="`dedup_groups` 'auto'")
    report = stats.compute_stats(dataset, schema=schema, batch_size=batch_size)
    return tuple(tuple(g) for g in report.proposed_groups), tuple(report.proposed_partial)


def resolve_dedup_groups(
    spec: DedupGroups,
    *,
    schema: DatasetSchema,
    dataset: str | os.PathLike[str] | Sequence[Any] | None = None,
    batch_size: int = 4096,
) -> DatasetSchema:
    """``schema`` with its dedup groups replaced as ``spec`` says (see the module docstring).

    Args:
        spec: ``None``, ``"auto"``, a TOML file, or the groups.
        schema: the dataset's schema.
        dataset: the dataset directory (``"auto"`` runs the stats on it).
        batch_size: the batch size the reader cuts (``"auto"``'s factors are measured at it).

    Returns:
        The schema to read with (``schema`` itself for ``None``): its ``dedup_groups`` and
        ``dedup_partial`` say what the readers pack.

    Raises:
        DataError: ``"auto"`` without a dataset directory, or a bad groups file.
        SchemaError: a group names an unknown or dense feature, or a feature twice.
    """
    if spec is None:
        return schema
    partial: tuple[str, ...] = ()
    if isinstance(spec, str) and spec == AUTO:
        groups, partial = _proposed_groups(dataset, schema=schema, batch_size=batch_size)
    elif isinstance(spec, str | os.PathLike):
        groups, partial = read_dedup_file(spec)
    elif isinstance(spec, Sequence) and all(
        isinstance(g, Sequence) and not isinstance(g, str) for g in spec
    ):
        groups = tuple(tuple(g) for g in spec)
    else:
        msg = f"`dedup_groups` must be None, 'auto', a TOML file or a list of lists of names, got {spec!r}"
        raise DataError(msg)
    try:
        return schema.with_dedup(groups, partial)
    except SchemaError as exc:
        msg = f"`dedup_groups` {spec!r}: {exc}"
        raise SchemaError(msg) from exc
