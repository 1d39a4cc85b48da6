"""TorchRec's ``EmbeddingBagCollection`` and ``EmbeddingCollection``, deduplicating: swap by one import.

A TorchRec model changes one line and keeps everything else::

    from torchrec import EmbeddingBagCollection, EmbeddingCollection          # before
    from trainer.torchrec import EmbeddingBagCollection, EmbeddingCollection  # after

The classes here take the same arguments (TorchRec's ``EmbeddingBagConfig`` /
``EmbeddingConfig``: ``name``, ``embedding_dim``, ``num_embeddings``, ``feature_names``,
``pooling``, ``init_fn``, ``data_type``), hold the same parameters under the same
``state_dict`` keys (``embedding_bags.<table>.weight``, ``embeddings.<table>.weight``: plain
``nn.Parameter`` s with dense gradients, so ``torch.optim.Adam`` just works), draw the same
initial weights from the same torch seed, and return the same types (a ``KeyedTensor``; a dict of
``JaggedTensor``). On a TorchRec ``KeyedJaggedTensor`` they compute what TorchRec computes.

What they add is the deduplicated input: recpipe's :class:`~recpipe.batch.Batch` (its plain KJT
and its IKJT groups), one :class:`~recpipe.ikjt.InverseKeyedJaggedTensor`, or a recpipe
:class:`~recpipe.jagged.KeyedJaggedTensor`. A feature of an IKJT group is looked up and pooled on
the group's U unique rows only, and the result is expanded to the B batch rows with the group's
inverse lookup (RecD O5; sequences expand with the jagged index select, O6)::

    unique rows (U = 3)   u0 = [7, 3]   u1 = [5]   u2 = [9, 9, 1]
    inverse_lookup [B]    [0, 0, 1, 2, 2, 2, 1]
    pooled [U, D]         [p0, p1, p2]
    output [B, D]         [p0, p0, p1, p2, p2, p2, p1]      (backward sums the duplicates)

TorchRec is an optional dependency: this module imports it (through
:func:`recpipe._deps.optional_import`) when a collection is built, and a missing TorchRec is a
:class:`~recpipe.errors.DependencyError` saying how to install it. ``docs/torchrec.md`` lists
what differs from TorchRec.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any

import torch
from torch import nn

from recpipe._deps import optional_import
from recpipe.errors import DataError, RecpipeError
from recpipe.kernels import jagged_index_select
from trainer.modules import (
    JaggedEmbeddings,
    SparseInput,
    check_table_ids,
    checked_lookup,
    locate_features,
)

__all__ = ["EmbeddingBagCollection", "EmbeddingCollection"]

_PURPOSE = "trainer.torchrec's TorchRec-compatible embedding collections"
_ID_HINT = (
    "map the ids into the table before the lookup (e.g. the readers' HashModulo "
    "preprocessing) or raise the table's `num_embeddings` above the largest id"
)


def _torchrec(name: str) -> ModuleType:
    return optional_import(f"torchrec.{name}", purpose=_PURPOSE)


def _table_names(tables: Sequence[Any], config_class: type, what: str) -> None:
    """Every table is a ``config_class`` with a unique name (TorchRec's own rule)."""
    seen: set[str] = set()
    for i, table in enumerate(tables):
        if not isinstance(table, config_class):
            msg = f"`tables[{i}]` must be a TorchRec {what}, got {type(table).__name__}"
            raise RecpipeError(msg)
        if table.name in seen:
            msg = f"`tables` holds table name {table.name!r} twice"
            raise RecpipeError(msg)
        seen.add(table.name)


def _dtype(config: Any) -> torch.dtype:
    """TorchRec's rule: FP32 tables are float32, every other data type float16."""
    fp32 = _torchrec("modules.embedding_configs").DataType.FP32
    return torch.float32 if config.data_type == fp32 else torch.float16


def _unique(names: Sequence[Sequence[str]]) -> list[str]:
    return list(dict.fromkeys(name for table in names for name in table))


def _id_check(feature: str, table: str, num_embeddings: int) -> Any:
    return functools.partial(
        check_table_ids,
        feature=feature,
        table=table,
        num_embeddings=num_embeddings,
        hint=_ID_HINT,
    )


def _is_torchrec_kjt(features: object) -> bool:
    return isinstance(features, _torchrec("sparse.jagged_tensor").KeyedJaggedTensor)


def _torchrec_features(features: Any, names: Sequence[str]) -> dict[str, Any]:
    """``{feature: TorchRec JaggedTensor}`` of the TorchRec KJT ``features``."""
    jts = features.to_dict()
    missing = [n for n in names if n not in jts]
    if missing:
        msg = (
            f"sparse features {missing!r} are not in the KeyedJaggedTensor; it holds {list(jts)!r}"
        )
        raise DataError(msg)
    return jts


class _Collection(nn.Module):
    """What both collections share: their device and TorchRec's initialisation of the tables."""

    _device: torch.device

    def _weights(self) -> list[tuple[Any, nn.Parameter]]:
        """``(config, weight)`` of every table, in config order."""
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        """Where the tables live."""
        return self._device

    def reset_parameters(self) -> None:
        """Initialise every table with its config's ``init_fn`` (nothing on the meta device)."""
        if self._device.type == "meta":
            return
        for table, weight in self._weights():
            if table.init_fn is not None:
                table.init_fn(weight)


class EmbeddingBagCollection(_Collection):
    """TorchRec's ``EmbeddingBagCollection`` that also pools deduplicated rows (RecD O5).

    Args:
        tables: TorchRec ``EmbeddingBagConfig`` s (``pooling`` SUM or MEAN).
        is_weighted: the input TorchRec KJT carries per-id weights (sum pooling only; recpipe's
            jagged types have no weights).
        device: where the tables live (``"meta"``: no initialisation, as in TorchRec).
        sparse_grad: give the tables sparse gradients (only the rows looked up): for SGD,
            Adagrad or ``SparseAdam``. The default, dense gradients, is TorchRec's.

    Raises:
        DependencyError: TorchRec is not installed.
        RecpipeError: a table is not an ``EmbeddingBagConfig``, a name repeats, or its pooling
            is not SUM or MEAN.

    ``forward(features)`` returns a TorchRec ``KeyedTensor`` ``[B, sum of D]`` with one key per
    feature (``feature@table`` when a feature reads several tables), in table order.
    ``features`` is a TorchRec ``KeyedJaggedTensor`` (its ``inverse_indices``, when set, expand
    the pooled rows as in TorchRec), or a recpipe ``Batch``, IKJT or KJT.
    """

    def __init__(
        self,
        tables: Sequence[Any],
        is_weighted: bool = False,
        device: torch.device | str | None = None,
        *,
        sparse_grad: bool = False,
    ) -> None:
        super().__init__()
        configs = _torchrec("modules.embedding_configs")
        _table_names(tables, configs.EmbeddingBagConfig, "EmbeddingBagConfig")
        self._is_weighted = bool(is_weighted)
        self._sparse_grad = bool(sparse_grad)
        self.embedding_bags = nn.ModuleDict()
        self._embedding_bag_configs = list(tables)
        self._lengths_per_embedding: list[int] = []
        modes = {configs.PoolingType.SUM: "sum", configs.PoolingType.MEAN: "mean"}
        for table in tables:
            if table.pooling not in modes:
                msg = f"table {table.name!r}: `pooling` must be SUM or MEAN, got {table.pooling}"
                raise RecpipeError(msg)
            bag = nn.EmbeddingBag(
                table.num_embeddings,
                table.embedding_dim,
                mode=modes[table.pooling],
                device=device,
                include_last_offset=True,
                dtype=_dtype(table),
                sparse=self._sparse_grad,
            )
            self.embedding_bags[table.name] = bag
            device = device if device is not None else bag.weight.device
            if not table.feature_names:
                table.feature_names = [table.name]
            self._lengths_per_embedding.extend([table.embedding_dim] * len(table.feature_names))
        self._device = torch.device(device) if device is not None else torch.device("cpu")
        names = _torchrec("modules.embedding_modules").get_embedding_names_by_table(tables)
        self._embedding_names: list[str] = [n for table in names for n in table]
        self._feature_names: list[list[str]] = [list(t.feature_names) for t in tables]
        self.reset_parameters()

    def forward(self, features: Any) -> Any:
        """Pooled embeddings of every feature: a TorchRec ``KeyedTensor`` of ``[B, sum of D]``."""
        if _is_torchrec_kjt(features):
            pooled = self._pool_torchrec(features)
        else:
            pooled = self._pool_recpipe(features)
        return _torchrec("sparse.jagged_tensor").KeyedTensor(
            keys=self._embedding_names,
            length_per_key=self._lengths_per_embedding,
            values=torch.cat(pooled, dim=1),  # (B, sum of D)
        )

    def _tables(self) -> list[tuple[Any, nn.EmbeddingBag, list[str]]]:
        bags = self.embedding_bags
        return [
            (t, bags[t.name], names)
            for t, names in zip(self._embedding_bag_configs, self._feature_names)
        ]

    def _pool_torchrec(self, features: Any) -> list[torch.Tensor]:
        """TorchRec's computation: every bag over its rows, expanded by ``inverse_indices``."""
        jts = _torchrec_features(features, _unique(self._feature_names))
        inverse = features.inverse_indices_or_none()
        row_of = {} if inverse is None else {k: i for i, k in enumerate(inverse[0])}
        out = []
        for table, bag, names in self._tables():
            for name in names:
                jt = jts[name]
                weights = jt.weights() if self._is_weighted else None
                pooled = checked_lookup(
                    lambda ids, jt=jt, bag=bag, w=weights: bag(ids, jt.offsets(), w),
                    jt.values(),
                    check=_id_check(name, table.name, table.num_embeddings),
                ).float()  # (R, D)
                if inverse is not None:
                    pooled = pooled.index_select(0, inverse[1][row_of[name]])  # (B, D)
                out.append(pooled)
        return out

    def _pool_recpipe(self, features: SparseInput) -> list[torch.Tensor]:
        """Pool each feature on its stored rows (U unique ones in a dedup group), then expand."""
        if self._is_weighted:
            msg = (
                "`is_weighted` collections need a TorchRec KeyedJaggedTensor with weights; "
                f"recpipe's {type(features).__name__} carries none"
            )
            raise DataError(msg)
        rows = locate_features(features, _unique(self._feature_names))
        out = []
        for table, bag, names in self._tables():
            for name in names:
                jt = rows[name].jagged
                offsets = jt.offsets()
                pooled = checked_lookup(
                    lambda ids, offsets=offsets, bag=bag: bag(ids, offsets),
                    jt.values().to(torch.int64),
                    check=_id_check(name, table.name, table.num_embeddings),
                ).float()  # (R, D)
                inverse = rows[name].inverse
                out.append(pooled if inverse is None else pooled.index_select(0, inverse))
        return out

    def is_weighted(self) -> bool:
        """Whether the input carries per-id weights."""
        return self._is_weighted

    def embedding_bag_configs(self) -> list[Any]:
        """The tables' ``EmbeddingBagConfig`` s."""
        return self._embedding_bag_configs

    def _weights(self) -> list[tuple[Any, nn.Parameter]]:
        return [(t, self.embedding_bags[t.name].weight) for t in self._embedding_bag_configs]


class EmbeddingCollection(_Collection):
    """TorchRec's ``EmbeddingCollection`` (un-pooled sequences) that also takes deduplicated rows.

    For a feature of an IKJT group the embeddings of the group's U unique rows are looked up and
    expanded to the B batch rows with the jagged index select (RecD O6; its backward is a jagged
    index add). :meth:`unique_embeddings` returns them before the expansion, for compute that
    runs on unique rows too (e.g. :class:`trainer.attention.AttentionPooling`, O7).

    Args:
        tables: TorchRec ``EmbeddingConfig`` s, all of the same ``embedding_dim``.
        device: where the tables live.
        need_indices: also return each feature's ids, as the ``weights`` of its JaggedTensor.
        use_gather_select: a sharding hint of TorchRec's, kept and reported, unused here.
        use_gather_select_per_sharding: the same, per sharding type.
        sparse_grad: sparse gradients for the tables (default: dense, like TorchRec).

    Raises:
        DependencyError: TorchRec is not installed.
        RecpipeError: a table is not an ``EmbeddingConfig``, a name repeats, or the tables'
            dimensions differ.

    ``forward(features)`` returns ``{feature: JaggedTensor}`` (``feature@table`` for a feature
    read by several tables): values ``[ids of the B rows, D]``, lengths ``[B]``.
    """

    def __init__(
        self,
        tables: Sequence[Any],
        device: torch.device | str | None = None,
        need_indices: bool = False,
        use_gather_select: bool = False,
        use_gather_select_per_sharding: Mapping[str, bool] | None = None,
        *,
        sparse_grad: bool = False,
    ) -> None:
        super().__init__()
        configs = _torchrec("modules.embedding_configs")
        _table_names(tables, configs.EmbeddingConfig, "EmbeddingConfig")
        self.embeddings = nn.ModuleDict()
        self._embedding_configs = list(tables)
        self._need_indices = bool(need_indices)
        self._use_gather_select = bool(use_gather_select)
        self._use_gather_select_per_sharding = use_gather_select_per_sharding
        self._sparse_grad = bool(sparse_grad)
        self._device = torch.device(device) if device is not None else torch.device("cpu")
        dims = {t.embedding_dim for t in tables}
        if len(dims) > 1:
            by_table = {t.name: t.embedding_dim for t in tables}
            msg = f"every table of an EmbeddingCollection must have one `embedding_dim`, got {by_table}"
            raise RecpipeError(msg)
        self._embedding_dim = dims.pop() if dims else -1
        for table in tables:
            self.embeddings[table.name] = nn.Embedding(
                table.num_embeddings,
                table.embedding_dim,
                device=device,
                dtype=_dtype(table),
                sparse=self._sparse_grad,
            )
            if table.init_fn is not None:  # right after each table, as TorchRec does
                table.init_fn(self.embeddings[table.name].weight)
            if not table.feature_names:
                table.feature_names = [table.name]
        modules = _torchrec("modules.embedding_modules")
        self._embedding_names_by_table: list[list[str]] = modules.get_embedding_names_by_table(
            tables
        )
        self._feature_names: list[list[str]] = [list(t.feature_names) for t in tables]

    def forward(self, features: Any) -> dict[str, Any]:
        """``{feature: TorchRec JaggedTensor}`` of the embeddings of every batch row's ids."""
        jagged = _torchrec("sparse.jagged_tensor").JaggedTensor
        if _is_torchrec_kjt(features):
            return self._embed_torchrec(features, jagged)
        out = {}
        for name, seq, ids in self._embed_recpipe(features):
            values, offsets = seq.values, seq.offsets
            if seq.inverse is not None:
                values, offsets = jagged_index_select(values, offsets, seq.inverse)  # O6
                if ids is not None:  # the same rows: their layout is known, no sync on a GPU
                    ids = jagged_index_select(
                        ids, seq.offsets, seq.inverse, out_offsets=offsets,
                        num_out_values=values.shape[0],
                    )[0]  # fmt: skip
            lengths = offsets[1:] - offsets[:-1]
            out[name] = jagged(values=values, lengths=lengths, offsets=offsets, weights=ids)
        return out

    def unique_embeddings(self, features: SparseInput) -> dict[str, JaggedEmbeddings]:
        """The embeddings before expansion: U unique rows and the inverse lookup per group.

        ``features`` is a recpipe ``Batch``, IKJT or KJT (a plain KJT's rows are its B rows).
        ``JaggedEmbeddings.expand()`` gives what :meth:`forward` returns.
        """
        return {name: seq for name, seq, _ in self._embed_recpipe(features)}

    def _tables(self) -> list[tuple[Any, nn.Embedding, list[str], list[str]]]:
        return [
            (t, self.embeddings[t.name], features, names)
            for t, features, names in zip(
                self._embedding_configs, self._feature_names, self._embedding_names_by_table
            )
        ]

    def _embed_torchrec(self, features: Any, jagged: type) -> dict[str, Any]:
        if features.variable_stride_per_key() or features.inverse_indices_or_none() is not None:
            msg = (
                "`features` is a variable-batch KeyedJaggedTensor (inverse_indices); TorchRec's "
                "EmbeddingCollection would return its unique rows unexpanded: pass recpipe's IKJT "
                "(the dedup path) or the expanded KeyedJaggedTensor"
            )
            raise DataError(msg)
        jts = _torchrec_features(features, _unique(self._feature_names))
        out = {}
        for table, emb, feature_names, names in self._tables():
            for feature, name in zip(feature_names, names):
                jt = jts[feature]
                values = checked_lookup(
                    lambda ids, emb=emb: emb(ids),
                    jt.values(),
                    check=_id_check(feature, table.name, table.num_embeddings),
                ).float()  # (N, D)
                ids = jt.values() if self._need_indices else None
                out[name] = jagged(values=values, lengths=jt.lengths(), weights=ids)
        return out

    def _embed_recpipe(
        self, features: SparseInput
    ) -> list[tuple[str, JaggedEmbeddings, torch.Tensor | None]]:
        """``(name, embeddings of the stored rows, their ids if need_indices)`` per feature."""
        rows = locate_features(features, _unique(self._feature_names))
        out = []
        for table, emb, feature_names, names in self._tables():
            for feature, name in zip(feature_names, names):
                where = rows[feature]
                jt = where.jagged
                values = checked_lookup(
                    lambda ids, emb=emb: emb(ids),
                    jt.values().to(torch.int64),
                    check=_id_check(feature, table.name, table.num_embeddings),
                ).float()  # (N, D)
                seq = JaggedEmbeddings(values, jt.offsets(), where.inverse, where.group)
                out.append((name, seq, jt.values() if self._need_indices else None))
        return out

    def need_indices(self) -> bool:
        """Whether the output JaggedTensors carry the ids as weights."""
        return self._need_indices

    def embedding_dim(self) -> int:
        """The tables' embedding dimension (-1 without tables)."""
        return self._embedding_dim

    def embedding_configs(self) -> list[Any]:
        """The tables' ``EmbeddingConfig`` s."""
        return self._embedding_configs

    def embedding_names_by_table(self) -> list[list[str]]:
        """Output names, table by table."""
        return self._embedding_names_by_table

    def use_gather_select(self) -> bool:
        """TorchRec's sharding hint, as given."""
        return self._use_gather_select

    def use_gather_select_per_sharding(self) -> Mapping[str, bool] | None:
        """TorchRec's per-sharding hint, as given."""
        return self._use_gather_select_per_sharding

    def _weights(self) -> list[tuple[Any, nn.Parameter]]:
        return [(t, self.embeddings[t.name].weight) for t in self._embedding_configs]
