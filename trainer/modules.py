"""Dedup-aware embedding modules (RecD O5, O6); attention pooling (O7) is in :mod:`trainer.attention`.

Every module here takes the sparse features of a :class:`~recpipe.batch.Batch` in either form
and gives the same result (to float rounding) for both:

* a plain :class:`~recpipe.jagged.KeyedJaggedTensor` of B rows per key (the no-dedup path);
* an :class:`~recpipe.ikjt.InverseKeyedJaggedTensor` per dedup group: the work runs on the U
  unique rows of the group only, and the output is expanded to the B batch rows at the end::

      ikjt unique rows   u0 = [7, 3]   u1 = [5]   u2 = [9, 9, 1]         U = 3
      inverse_lookup     [0, 0, 1, 2, 2, 2, 1]                            B = 7
      pooled (O5)        [p0, p1, p2]                            [U, D]
      expanded           [p0, p0, p1, p2, p2, p2, p1]            [B, D]   index_select(inverse)

  The backward of the expansion (``index_select``) sums the gradients of the duplicate rows
  into their unique row, which is exactly the gradient of the plain path.

A feature of a :class:`~recpipe.ikjt.PartialInverseKeyedJaggedTensor` (lists that shift by
one id, stored as windows into packed ids) is looked up once per *packed* id, and its rows'
embeddings are gathered from those ``[P, D]`` rows (:func:`locate_windows`): the same
numbers as the expanded lists', with P lookups instead of N.

:class:`PooledEmbeddings` pools each feature into ``[B, D]``;
:class:`SequenceEmbeddings` keeps a feature's ``[values, D]`` jagged as
:class:`JaggedEmbeddings` (still over unique rows; ``expand()`` runs the jagged index select,
O6); :class:`~trainer.attention.AttentionPooling` runs a small transformer encoder layer over a
group's sequences on the unique rows and expands its ``[U, D]`` output (O7). Both collections return plain dicts
and take recpipe's :class:`TableConfig`; :func:`dedup_batch` deduplicates a plain batch's groups
as the readers do (the model's ``--dedup off`` path). The TorchRec-shaped ``EmbeddingBagCollection`` and
``EmbeddingCollection`` (TorchRec configs in, ``KeyedTensor`` / ``JaggedTensor`` out) are in
:mod:`trainer.torchrec`, built on the same helpers.

Embedding tables are pluggable: :class:`TableConfig` says what a table is, and a *table
factory* builds the module that holds it (:class:`ParameterTable` by default: an ordinary
``nn.Parameter``). Any module with ``pool(ids, offsets, mode=...)`` and ``rows(ids)`` (see
:class:`TableBackend`) works, e.g. one backed by the hybrid embedding store of
:mod:`trainer.store`.

A batch's id plan (:class:`IdPlan`, computed once by :func:`trainer.idplan.plan_batch`) lists
each table's distinct ids and where each feature's ids sit among them. A
:class:`PlannedBatch` carries it to the collections, which look its features up by position
in tables that read plans (:class:`PlannedTable`, e.g. the sharded tables, whose rows the
exchange fetched for the plan's ids); other tables, and batches without a plan, are looked up
by id.
"""

from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from recpipe.batch import Batch
from recpipe.errors import DataError, RecpipeError
from recpipe.ikjt import InverseKeyedJaggedTensor, PartialInverseKeyedJaggedTensor
from recpipe.jagged import JaggedTensor, KeyedJaggedTensor
from recpipe.kernels import jagged_index_select
from trainer import _kernels
from trainer.config import PoolingMode, TableConfig

__all__ = [
    "FeatureRows",
    "IdPlan",
    "JaggedEmbeddings",
    "PackedRows",
    "ParameterTable",
    "PlannedBatch",
    "PlannedTable",
    "PooledEmbeddings",
    "PoolingMode",
    "SequenceEmbeddings",
    "SparseInput",
    "TableBackend",
    "TableConfig",
    "TableDict",
    "TableFactory",
    "check_table_ids",
    "checked_lookup",
    "dedup_batch",
    "expand_rows",
    "init_table",
    "locate_features",
    "locate_windows",
    "lookup_values",
    "table_ids",
    "table_seed",
]

SparseInput = Batch | KeyedJaggedTensor | InverseKeyedJaggedTensor | PartialInverseKeyedJaggedTensor
"""What the modules accept: a whole Batch (KJT + IKJTs), a plain KJT, or one dedup group."""


# -------------------------------------------------------------------------------------------
# table configs and backends


class TableBackend(Protocol):
    """What a table module must offer (an ``nn.Module``)."""

    config: TableConfig

    def pool(self, ids: torch.Tensor, offsets: torch.Tensor, *, mode: PoolingMode) -> torch.Tensor:
        """Pooled ``[R, D]`` embeddings of ``R`` bags (``offsets`` [R + 1] into ``ids``)."""
        ...

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """``[n, D]`` embeddings of ``ids`` [n] (no pooling)."""
        ...


@runtime_checkable
class PlannedTable(Protocol):
    """A table backend that reads a batch through its :class:`IdPlan` (the rows of the plan's
    distinct ids fetched once for the batch, each feature's lookups by position among them)."""

    config: TableConfig

    def pool_planned(
        self, plan: IdPlan, feature: str, offsets: torch.Tensor, *, mode: PoolingMode
    ) -> torch.Tensor:
        """Pooled ``[R, D]`` bags of ``feature``'s ids (``offsets`` [R + 1])."""
        ...

    def rows_planned(self, plan: IdPlan, feature: str) -> torch.Tensor:
        """``[n, D]`` rows of ``feature``'s ids."""
        ...


TableFactory = Callable[[TableConfig, int], nn.Module]
"""Builds a table module from its config and the model seed."""


def table_seed(seed: int, name: str) -> int:
    """The init seed of table ``name``: independent of the order tables are built in."""
    return (int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (1 << 62)


def check_table_ids(
    ids: torch.Tensor, *, feature: str, table: str, num_embeddings: int, hint: str | None = None
) -> None:
    """Raise :class:`DataError` if ``ids`` of ``feature`` do not all index a row of ``table``.

    Args:
        ids: the ids looked up.
        feature: the feature they belong to (named in the message).
        table: the table's name.
        num_embeddings: the table's rows.
        hint: what to do about it (default: recpipe's ``hash_ids`` and ``HashModulo`` hints).
    """
    if ids.numel() == 0:
        return
    ids = ids.to(torch.int64)
    bad = (ids < 0) | (ids >= num_embeddings)
    if not bool(bad.any()):
        return
    bad_ids = ids[bad]
    hint = hint or (
        "take ids modulo the table with `hash_ids=True` (ModelConfig.hash_ids, "
        "`recpipe train --hash-ids`, the default), map them into range with the readers' "
        "HashModulo preprocessing, or raise `num_embeddings` above the largest id"
    )
    msg = (
        f"feature {feature!r}: id {int(bad_ids[0])} is outside table {table!r} of "
        f"{num_embeddings:,} rows (valid ids 0..{num_embeddings - 1}; "
        f"{bad_ids.numel():,} of the batch's {ids.numel():,} ids are outside, "
        f"from {int(bad_ids.min())} to {int(bad_ids.max())})\nhint: {hint}"
    )
    raise DataError(msg)


def table_ids(config: TableConfig, ids: torch.Tensor) -> torch.Tensor:
    """The ids table ``config`` reads for ``ids``: int64, taken modulo ``num_embeddings`` when
    ``hash_ids`` is on. Every table backend (parameter tables, the store, sharded tables)
    reads through this, so a flag means the same model in every mode."""
    ids = ids.to(torch.int64)
    return torch.remainder(ids, config.num_embeddings) if config.hash_ids else ids


def init_table(config: TableConfig, seed: int) -> torch.Tensor:
    """The initial ``[num_embeddings, D]`` rows of a table: uniform in ``±sqrt(1 /
    num_embeddings)`` (TorchRec's default), row ``i`` a hash of (:func:`table_seed`, ``i``):
    the rows the store and sharded tables give each id, so every backend starts from the
    same model."""
    ids = np.arange(config.num_embeddings, dtype=np.int64)
    scale = math.sqrt(1.0 / config.num_embeddings)
    seed = table_seed(seed, config.name) % (1 << 31)
    return torch.from_numpy(_kernels.init_rows(ids, config.dim, seed=seed, scale=scale))


class ParameterTable(nn.Module):
    """An embedding table held in an ``nn.Parameter`` (the default backend).

    Starts from :func:`init_table` (the same rows for the same seed whatever else the model
    holds, and the same rows the store and sharded tables start from).

    Args:
        config: the table.
        seed: the model seed.
    """

    def __init__(self, config: TableConfig, seed: int = 0) -> None:
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(init_table(config, seed))

    def _ids(self, ids: torch.Tensor) -> torch.Tensor:
        return table_ids(self.config, ids)

    def pool(self, ids: torch.Tensor, offsets: torch.Tensor, *, mode: PoolingMode) -> torch.Tensor:
        """Pooled ``[R, D]`` bags (one fused ``embedding_bag``)."""
        return F.embedding_bag(
            self._ids(ids),
            self.weight,
            offsets,
            mode=mode,
            sparse=self.config.sparse_grad,
            include_last_offset=True,
        )  # (R, D)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """``[n, D]`` rows of ``ids``."""
        return F.embedding(self._ids(ids), self.weight, sparse=self.config.sparse_grad)

    def check_ids(self, ids: torch.Tensor, *, feature: str) -> None:
        """Raise :class:`DataError` if ``feature``'s ``ids`` do not all index a row of the table.

        Ids taken modulo ``num_embeddings`` (``hash_ids``) always do. The collections call this
        only after torch refused a lookup (CPU: no cost while ids are in range), and before each
        lookup on other devices, where an index out of range is a device-side assert.
        """
        c = self.config
        if not c.hash_ids:
            check_table_ids(ids, feature=feature, table=c.name, num_embeddings=c.num_embeddings)

    def extra_repr(self) -> str:
        c = self.config
        return f"{c.name!r}, {c.num_embeddings} x {c.dim}, features={list(c.features)}"


def checked_lookup(
    lookup: Callable[..., torch.Tensor],
    ids: torch.Tensor,
    *args: Any,
    check: Callable[[torch.Tensor], None] | None,
    **kwargs: Any,
) -> torch.Tensor:
    """``lookup(ids, *args, **kwargs)``, with ids out of range reported by ``check(ids)``.

    ``check`` raises a :class:`DataError` naming the feature and the table (see
    :func:`check_table_ids`). On the CPU it runs only after torch refused the lookup (no cost
    while ids are in range); on other devices before it, where an index out of range would end
    in a device-side assert.
    """
    if check is not None and ids.device.type != "cpu":
        check(ids)
    try:
        return lookup(ids, *args, **kwargs)
    except (IndexError, RuntimeError):
        if check is not None:
            check(ids)
        raise


def _lookup(
    table: nn.Module,
    feature: str,
    lookup: Callable[..., torch.Tensor],
    ids: torch.Tensor,
    *args: Any,
    **kwargs: Any,
) -> torch.Tensor:
    """``lookup(ids, *args, **kwargs)`` (a method of ``table``); ids out of range name ``feature``."""
    check = None
    if isinstance(table, ParameterTable):
        check = functools.partial(table.check_ids, feature=feature)
    return checked_lookup(lookup, ids, *args, check=check, **kwargs)


class TableDict(nn.Module):
    """Table modules by table name (any name without a ``.``, even ``items`` or ``keys``)."""

    def __getitem__(self, name: str) -> nn.Module:
        return self._modules[name]

    def __contains__(self, name: object) -> bool:
        return name in self._modules

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[str]:
        return iter(self._modules)

    def add(self, name: str, module: nn.Module) -> None:
        """Register ``module`` as table ``name``."""
        if "." in name or not name:
            msg = f"table `name` must be non-empty and contain no '.', got {name!r}"
            raise RecpipeError(msg)
        self._modules[name] = module


def _build_tables(
    tables: Iterable[TableConfig], factory: TableFactory | None, seed: int
) -> tuple[TableDict, dict[str, str]]:
    """Table modules by name and ``{feature: table name}``; checks names and feature reuse."""
    factory = factory or ParameterTable
    modules = TableDict()
    feature_table: dict[str, str] = {}
    for cfg in tables:
        if cfg.name in modules:
            msg = f"`tables` name {cfg.name!r} twice"
            raise RecpipeError(msg)
        for feature in cfg.features:
            if feature in feature_table:
                msg = (
                    f"feature {feature!r} is in tables {feature_table[feature]!r} and "
                    f"{cfg.name!r}; a feature reads exactly one table"
                )
                raise RecpipeError(msg)
            feature_table[feature] = cfg.name
        modules.add(cfg.name, factory(cfg, seed))
    return modules, feature_table


# -------------------------------------------------------------------------------------------
# finding a feature's rows in a Batch


@dataclass(frozen=True)
class FeatureRows:
    """Where a feature's lists are: ``jagged`` rows, and the inverse lookup when deduplicated.

    Attributes:
        jagged: the rows of the feature: U unique rows (``inverse`` [B] given) or B rows.
        inverse: ``[B]`` unique row of every batch row, or ``None`` (``jagged`` has B rows).
        group: the dedup group the feature came from (``None`` for the plain KJT).
    """

    jagged: JaggedTensor
    inverse: torch.Tensor | None
    group: str | None = None

    @property
    def batch_size(self) -> int:
        """Batch rows B."""
        return self.jagged.batch_size if self.inverse is None else self.inverse.numel()


def locate_features(features: SparseInput, keys: Iterable[str]) -> dict[str, FeatureRows]:
    """Find ``keys`` in a Batch (its KJT or one of its IKJT groups) or in a plain KJT.

    ``features`` may also be one dedup group alone (an IKJT). A
    :class:`~recpipe.ikjt.PartialInverseKeyedJaggedTensor` group is expanded to its B rows (it
    has no unique rows to work on).

    Raises:
        DataError: a key is in none of them.
    """
    if isinstance(features, KeyedJaggedTensor):
        kjt, groups = features, {}
    elif isinstance(features, Batch):
        kjt, groups = features.kjt, features.ikjts
    elif isinstance(features, InverseKeyedJaggedTensor | PartialInverseKeyedJaggedTensor):
        kjt = KeyedJaggedTensor.from_jagged_dict({}, stride=features.batch_size)
        groups = {"+".join(features.keys()): features}
    else:
        msg = (
            "`features` must be a Batch, a KeyedJaggedTensor or an InverseKeyedJaggedTensor, "
            f"got {type(features).__name__}"
        )
        raise DataError(msg)
    group_of = {key: name for name, g in groups.items() for key in g.keys()}
    expanded: dict[str, KeyedJaggedTensor] = {}
    out = {}
    for key in keys:
        if key in kjt:
            out[key] = FeatureRows(kjt[key], None)
            continue
        name = group_of.get(key)
        if name is None:
            have = [*kjt.keys(), *group_of]
            msg = f"sparse feature {key!r} is not in the batch; it holds {have!r}"
            raise DataError(msg)
        group = groups[name]
        if isinstance(group, PartialInverseKeyedJaggedTensor):
            if name not in expanded:
                expanded[name] = group.to_kjt()
            out[key] = FeatureRows(expanded[name][key], None, name)
        else:
            out[key] = FeatureRows(group[key], group.inverse_lookup, name)
    return out


def dedup_batch(
    batch: Batch, groups: Iterable[Sequence[str]], partial: Sequence[str] = ()
) -> Batch:
    """``batch`` with the ``groups`` (and the ``partial`` features) that its plain KJT holds
    deduplicated as the readers deduplicate them (:meth:`InverseKeyedJaggedTensor.from_jagged`,
    :meth:`PartialInverseKeyedJaggedTensor.from_jagged`: the same unique rows, in the same
    order, as ``--dedup on`` reads).

    A plain batch computed through its unique rows sums the gradients of duplicate rows into
    their unique row before they reach the tables or the attention layers, as a deduplicated
    batch does: the two train bit for bit alike. Groups already deduplicated, or not all in the
    KJT, are left as they are; a batch with nothing to deduplicate is returned unchanged.
    """
    kjt, moved = batch.kjt, set[str]()
    ikjts: dict[str, InverseKeyedJaggedTensor | PartialInverseKeyedJaggedTensor] = {}
    for keys in groups:
        if keys and all(k in kjt for k in keys):
            ikjts["+".join(keys)] = InverseKeyedJaggedTensor.from_jagged({k: kjt[k] for k in keys})
            moved.update(keys)
    if partial and all(k in kjt for k in partial):
        ikjts["+".join(partial)] = PartialInverseKeyedJaggedTensor.from_jagged(
            {k: kjt[k] for k in partial}
        )
        moved.update(partial)
    if not moved:
        return batch
    rest = [k for k in kjt.keys() if k not in moved]
    plain = (
        kjt.select(rest)
        if rest
        else KeyedJaggedTensor.from_jagged_dict({}, stride=batch.batch_size)
    )
    if isinstance(batch, PlannedBatch):  # new lookups: the plan no longer describes them
        batch = batch.unplanned()
    return replace(batch, kjt=plain, ikjts={**batch.ikjts, **ikjts})


@dataclass(frozen=True)
class PackedRows:
    """A feature of a partial IKJT: its packed ids and where its rows' values read them.

    Attributes:
        ids: ``[P]`` the packed ids (each stored id once).
        positions: ``[N]`` the packed id of every value of the B expanded rows.
        offsets: ``[B + 1]`` the expanded rows' offsets into ``positions``.
        group: the partial group's name.
    """

    ids: torch.Tensor
    positions: torch.Tensor
    offsets: torch.Tensor
    group: str


def locate_windows(
    features: SparseInput, keys: Iterable[str]
) -> tuple[dict[str, PackedRows], list[str]]:
    """Split ``keys`` into the features of partial IKJT groups (their :class:`PackedRows`)
    and the rest (for :func:`locate_features`), in order."""
    if isinstance(features, Batch):
        groups = {
            name: g
            for name, g in features.ikjts.items()
            if isinstance(g, PartialInverseKeyedJaggedTensor)
        }
    elif isinstance(features, PartialInverseKeyedJaggedTensor):
        groups = {"+".join(features.keys()): features}
    else:
        groups = {}
    group_of = {key: name for name, g in groups.items() for key in g.keys()}
    packed, rest = {}, []
    for key in keys:
        name = group_of.get(key)
        if name is None:
            rest.append(key)
        else:
            ids, positions, offsets = groups[name].key_windows(key)
            packed[key] = PackedRows(ids, positions, offsets, name)
    return packed, rest


def lookup_values(features: SparseInput, keys: Iterable[str]) -> dict[str, torch.Tensor]:
    """The ids the collections look up for each of ``keys``: a partial group's packed ids
    (:func:`locate_windows`), otherwise the values of the rows :func:`locate_features` finds."""
    packed, rest = locate_windows(features, keys)
    found = locate_features(features, rest)
    return {k: packed[k].ids if k in packed else found[k].jagged.values() for k in keys}


# -------------------------------------------------------------------------------------------
# a batch's id plan (the input-dist stage: computed once, read by every consumer)


@dataclass(frozen=True)
class IdPlan:
    """Which rows a batch reads, per table, computed once (:func:`trainer.idplan.plan_batch`)
    and read by every consumer: the exchange and the caches fetch the rows of ``ids``, the
    collections look a feature up by its ``positions`` among them::

        table "items", features item_id, liked          (ids after :func:`table_ids`)
        lookups     item_id [7 3 7]   liked [3 9]
        ids         [7 3 9]                              [U] first appearance
        positions   item_id [0 1 0]   liked [1 2]        index into ids, per feature

    Attributes:
        serial: the plan's number (unique in the process): a table checks that the rows it
            holds were fetched for this plan.
        tables: the planned tables' names, in the planner's order.
        ids: per table, int64 ``[U]`` numpy array of its distinct ids in order of first
            appearance.
        positions: ``{feature: [n] int64}``: where each id the collection looks up for the
            feature (:func:`lookup_values`) sits in its table's ``ids``.
        table_of: ``{feature: index into tables}``.
    """

    serial: int
    tables: tuple[str, ...]
    ids: tuple[np.ndarray, ...]
    positions: Mapping[str, torch.Tensor]
    table_of: Mapping[str, int]

    @property
    def num_unique(self) -> int:
        """Distinct ids of all tables."""
        return sum(int(u.size) for u in self.ids)


@dataclass(eq=False, kw_only=True)
class PlannedBatch(Batch):
    """A :class:`~recpipe.batch.Batch` with its :class:`IdPlan` (what the lookups of the
    batch's rows read). The collections look its planned features up by position in tables
    that read plans (:class:`PlannedTable`); moving it (``to``, ``pin_memory``), expanding it
    (``to_plain``) or deduplicating it again gives a batch without a plan (the plan's
    positions belong to these lookups)."""

    plan: IdPlan

    @classmethod
    def of(cls, batch: Batch, plan: IdPlan) -> PlannedBatch:
        """``batch`` (its tensors, not copied) with ``plan``."""
        return cls(**{f.name: getattr(batch, f.name) for f in fields(Batch)}, plan=plan)

    def unplanned(self) -> Batch:
        """The batch without its plan (the same tensors)."""
        return Batch(**{f.name: getattr(self, f.name) for f in fields(Batch)})

    def to_plain(self) -> Batch:
        """The batch without dedup (and without its plan: other lookups)."""
        return self.unplanned().to_plain()


def _plan_of(features: SparseInput) -> IdPlan | None:
    return features.plan if isinstance(features, PlannedBatch) else None


def _planned(table: nn.Module, plan: IdPlan | None, key: str) -> bool:
    """Whether ``key`` is looked up through ``plan`` in ``table``."""
    return plan is not None and key in plan.positions and isinstance(table, PlannedTable)


class _ExpandRows(torch.autograd.Function):
    """``pooled[inverse]`` whose backward sums each unique row's gradient over its batch rows
    with one compiled loop, in batch order: the sums torch's ``index_select`` backward makes
    (torch goes through ``scatter_add_`` and an expanded index)."""

    @staticmethod
    def forward(ctx, pooled, inverse):
        ctx.inverse, ctx.rows = inverse, pooled.shape[0]
        return pooled.index_select(0, inverse)  # (B, D)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        out = grad.new_zeros(ctx.rows, grad.shape[1])  # (U, D)
        _kernels.add_rows(grad.contiguous().numpy(), ctx.inverse.numpy(), out.numpy())
        return out, None


def expand_rows(pooled: torch.Tensor, inverse: torch.Tensor | None) -> torch.Tensor:
    """``[U, ...]`` -> ``[B, ...]`` by the inverse lookup (backward sums duplicates, O5)."""
    if inverse is None:
        return pooled
    if (
        pooled.requires_grad
        and torch.is_grad_enabled()
        and pooled.device.type == "cpu"
        and pooled.dim() == 2
        and pooled.dtype in (torch.float32, torch.float64)
        and inverse.dtype == torch.int64
        and inverse.is_contiguous()
    ):
        return _ExpandRows.apply(pooled, inverse)
    return pooled.index_select(0, inverse)


# -------------------------------------------------------------------------------------------
# embedding bags (O5)


class PooledEmbeddings(nn.Module):
    """Pooled embeddings of many features, deduplicated per IKJT group (RecD O5).

    For a feature of an IKJT group only the U unique rows are looked up and pooled; the
    ``[U, D]`` result is expanded to ``[B, D]`` with the group's inverse lookup. Features of the
    plain KJT are pooled over their B rows.

    Args:
        tables: the tables; each names the features that read it.
        seed: init seed (see :func:`table_seed`).
        table_factory: builds each table module (default :class:`ParameterTable`).

    Example::

        ebc = PooledEmbeddings([TableConfig("items", 1000, 16, ("item_id", "liked"))])
        out = ebc(batch)  # {"item_id": [B, 16], "liked": [B, 16]}
    """

    def __init__(
        self,
        tables: Sequence[TableConfig],
        *,
        seed: int = 0,
        table_factory: TableFactory | None = None,
    ) -> None:
        super().__init__()
        self.tables, self.feature_table = _build_tables(tables, table_factory, seed)
        self.features: tuple[str, ...] = tuple(self.feature_table)

    def forward(self, features: SparseInput) -> dict[str, torch.Tensor]:
        """``{feature: [B, D]}`` for every feature of the collection, in table order."""
        packed, rest = locate_windows(features, self.features)
        found = locate_features(features, rest)
        plan = _plan_of(features)
        out = {}
        for key in self.features:
            table = self.tables[self.feature_table[key]]
            mode = table.config.pooling
            planned = _planned(table, plan, key)
            if key in packed:
                p = packed[key]
                rows = (
                    table.rows_planned(plan, key)
                    if planned
                    else _lookup(table, key, table.rows, p.ids)
                )  # (P, D)
                out[key] = F.embedding_bag(
                    p.positions, rows, p.offsets, mode=mode, include_last_offset=True
                )  # (B, D): the bags of the expanded rows, gathered from the P packed rows
                continue
            jt = found[key].jagged
            if planned:
                pooled = table.pool_planned(plan, key, jt.offsets(), mode=mode)  # (R, D)
            else:
                pooled = _lookup(table, key, table.pool, jt.values(), jt.offsets(), mode=mode)
            out[key] = expand_rows(pooled, found[key].inverse)  # (B, D)
        return out


# -------------------------------------------------------------------------------------------
# sequence embeddings (O6)


@dataclass(frozen=True)
class JaggedEmbeddings:
    """Per-row sequences of embeddings, possibly over the unique rows of a dedup group.

    ``values`` [N, D] with ``offsets`` [R + 1]: R = U unique rows when ``inverse`` [B] is set,
    else R = B::

        unique rows   u0: [e7 e3]   u1: [e5]        values [e7 e3 e5]  offsets [0, 2, 3]
        inverse       [0, 0, 1]                     B = 3
        expand()      [e7 e3 | e7 e3 | e5]          jagged index select (O6)

    Attributes:
        values: ``[N, D]`` embeddings.
        offsets: ``[R + 1]`` int64.
        inverse: ``[B]`` int64 unique row of every batch row, or ``None``.
        group: the dedup group (``None`` for plain rows).
    """

    values: torch.Tensor
    offsets: torch.Tensor
    inverse: torch.Tensor | None = None
    group: str | None = None

    @property
    def num_rows(self) -> int:
        """Rows stored, R."""
        return self.offsets.numel() - 1

    @property
    def batch_size(self) -> int:
        """Batch rows B."""
        return self.num_rows if self.inverse is None else self.inverse.numel()

    def expand(self) -> JaggedEmbeddings:
        """The B batch rows (jagged index select; its backward is a jagged index add)."""
        if self.inverse is None:
            return self
        values, offsets = jagged_index_select(self.values, self.offsets, self.inverse)
        return JaggedEmbeddings(values, offsets, None, None)

    def to_jagged(self) -> JaggedTensor:
        """The stored rows as a :class:`~recpipe.jagged.JaggedTensor` of ``[N, D]`` values."""
        return JaggedTensor(self.values, self.offsets, validate=False)


class SequenceEmbeddings(nn.Module):
    """Un-pooled embeddings of sequence features, kept jagged (and deduplicated).

    For a feature of an IKJT group the embeddings of the U unique rows are returned with the
    group's inverse lookup (:class:`JaggedEmbeddings`); expand them with
    :meth:`JaggedEmbeddings.expand` (O6), or pool them first and expand the pooled rows (O7).

    Args:
        tables: the tables (``pooling`` is ignored).
        seed: init seed.
        table_factory: builds each table module.
    """

    def __init__(
        self,
        tables: Sequence[TableConfig],
        *,
        seed: int = 0,
        table_factory: TableFactory | None = None,
    ) -> None:
        super().__init__()
        self.tables, self.feature_table = _build_tables(tables, table_factory, seed)
        self.features: tuple[str, ...] = tuple(self.feature_table)

    def forward(self, features: SparseInput) -> dict[str, JaggedEmbeddings]:
        """``{feature: JaggedEmbeddings}`` for every feature of the collection.

        A feature of a partial IKJT comes as its B expanded rows, gathered from the embeddings
        of its P packed ids.
        """
        packed, rest = locate_windows(features, self.features)
        found = locate_features(features, rest)
        plan = _plan_of(features)
        out = {}
        for key in self.features:
            table = self.tables[self.feature_table[key]]
            planned = _planned(table, plan, key)
            if key in packed:
                p = packed[key]
                rows = (
                    table.rows_planned(plan, key)
                    if planned
                    else _lookup(table, key, table.rows, p.ids)
                )  # (P, D)
                values = rows.index_select(0, p.positions)  # (N, D)
                out[key] = JaggedEmbeddings(values, p.offsets, None, p.group)
                continue
            jt = found[key].jagged
            values = (
                table.rows_planned(plan, key)
                if planned
                else _lookup(table, key, table.rows, jt.values())
            )  # (N, D)
            out[key] = JaggedEmbeddings(values, jt.offsets(), found[key].inverse, found[key].group)
        return out
