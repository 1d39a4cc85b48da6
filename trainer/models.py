"""DLRM with optional attention-pooled sequence features, built from a dataset schema.

::

    dense [B, F] -> signed log1p -> batch norm -> bottom MLP ------------------------> x0 [B, D]
    sparse features -> PooledEmbeddings (dedup per IKJT group, O5) -> e1..en [B, D]
    history group  -> SequenceEmbeddings -> AttentionPooling (O7) -> a1..am [B, D]
    pairwise dots of [x0, e1..en, a1..am] (upper triangle) ++ x0 -> top MLP -> logit [B]

The model takes a :class:`~recpipe.batch.Batch` with or without IKJTs and trains bit for bit
the same either way (``--dedup on|off``): a plain batch's dedup groups are deduplicated here,
as the readers would, so that the gradients of duplicate rows are summed into their unique row
before the tables and the attention layers in both cases (:meth:`DLRM.set_dedup_groups`).
Nothing here imports training code.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from recpipe.batch import Batch
from recpipe.errors import RecpipeError
from trainer.attention import AttentionPooling
from trainer.config import ModelConfig, TableConfig
from trainer.modules import (
    PooledEmbeddings,
    SequenceEmbeddings,
    TableFactory,
    dedup_batch,
)

if TYPE_CHECKING:
    from schemas import DatasetSchema

__all__ = ["DLRM", "ModelConfig", "attention_features", "default_tables"]


def attention_features(schema: DatasetSchema, config: ModelConfig) -> tuple[str, ...]:
    """The sequence features a config pools by attention.

    ``"auto"`` picks, among the schema's dedup groups whose features are all ``user``
    features, the one with the largest total ``max_len``, and takes its features with
    ``max_len > 1`` (a user history such as liked items + liked sellers). A training run
    resolves it against the dataset's schema as written (:func:`trainer.train.resolve_model`),
    not the groups it reads with.
    """
    if config.attention == "none":
        return ()
    if config.attention != "auto":
        names = set(schema.sparse_names)
        for f in config.attention:
            if f not in names:
                msg = f"`attention` feature {f!r} is not a sparse feature of the schema {sorted(names)!r}"
                raise RecpipeError(msg)
        return tuple(config.attention)
    best: tuple[int, tuple[str, ...]] = (0, ())
    for group in schema.dedup_groups:
        specs = [schema.feature(f) for f in group]
        if not all(s.kind == "user" for s in specs):
            continue
        seq = tuple(s.name for s in specs if s.max_len > 1)
        total = sum(s.max_len for s in specs if s.max_len > 1)
        if seq and total > best[0]:
            best = (total, seq)
    return best[1]


def default_tables(schema: DatasetSchema, config: ModelConfig) -> tuple[TableConfig, ...]:
    """One table per sparse feature (named after it): ``num_embeddings`` x ``embedding_dim``."""
    return tuple(
        TableConfig(
            name=f,
            num_embeddings=config.num_embeddings,
            dim=config.embedding_dim,
            features=(f,),
            pooling=config.pooling,
            hash_ids=config.hash_ids,
            sparse_grad=config.sparse_grad,
        )
        for f in schema.sparse_names
    )


def _mlp(widths: Sequence[int], *, last_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(widths)):
        layers.append(nn.Linear(a, b))
        if i < len(widths) - 2 or last_relu:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def _split_tables(
    tables: Sequence[TableConfig], sequence: set[str]
) -> tuple[list[TableConfig], list[TableConfig]]:
    """Tables for pooled bags and for sequences (a shared table may serve both: its features
    are divided and the two parts keep the table's name, hence the same init)."""
    bags, seqs = [], []
    for t in tables:
        pooled = tuple(f for f in t.features if f not in sequence)
        seq = tuple(f for f in t.features if f in sequence)
        if pooled:
            bags.append(_with_features(t, pooled))
        if seq:
            seqs.append(_with_features(t, seq))
    return bags, seqs


def _with_features(table: TableConfig, features: tuple[str, ...]) -> TableConfig:
    if features == table.features:
        return table
    return TableConfig(
        table.name,
        table.num_embeddings,
        table.dim,
        features,
        pooling=table.pooling,
        hash_ids=table.hash_ids,
        sparse_grad=table.sparse_grad,
    )


class DLRM(nn.Module):
    """DLRM (bottom MLP, embedding bags, pairwise dot interaction, top MLP) with attention-pooled
    sequence features; deduplication-aware through its modules.

    Build it with :meth:`from_schema`. ``forward(batch)`` returns ``[B]`` logits.

    Args:
        num_dense: dense features F.
        tables: all tables (bag features and sequence features).
        config: the model config (widths, attention, seed).
        attention: sequence features pooled by attention (they must be in ``tables``).
        max_len: ``{feature: max_len}`` of the attention features.
        table_factory: builds table modules (default: ``nn.Parameter`` tables).

    Note:
        When a table is shared between a pooled feature and an attention feature, the two
        modules each hold a copy initialised identically (same name and seed) but trained
        separately. Give such features separate tables to avoid surprises.
    """

    def __init__(
        self,
        num_dense: int,
        tables: Sequence[TableConfig],
        *,
        config: ModelConfig,
        attention: Sequence[str] = (),
        max_len: dict[str, int] | None = None,
        table_factory: TableFactory | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        dim = config.embedding_dim
        attention = tuple(attention)
        bag_tables, seq_tables = _split_tables(tables, set(attention))
        known = {f for t in tables for f in t.features}
        missing = [f for f in attention if f not in known]
        if missing:
            msg = f"`attention` features {missing!r} read no table"
            raise RecpipeError(msg)
        seed = config.seed
        self.ebc = PooledEmbeddings(bag_tables, seed=seed, table_factory=table_factory)
        self.seq = (
            SequenceEmbeddings(seq_tables, seed=seed, table_factory=table_factory)
            if seq_tables
            else None
        )
        self.attention = (
            AttentionPooling(
                attention,
                dim=dim,
                max_len=max_len or 50,
                num_heads=config.attention_heads,
                num_layers=config.attention_layers,
                seed=seed,
            )
            if attention
            else None
        )
        self.num_dense = num_dense
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            # standardise the (log-compressed) dense features with batch statistics
            self.dense_norm = nn.BatchNorm1d(num_dense, affine=False) if num_dense else None
            self.bottom = _mlp([num_dense, *config.bottom_mlp, dim], last_relu=True)
            n = 1 + len(self.ebc.features) + (1 if attention else 0)
            self.num_vectors = n
            top_in = dim + n * (n - 1) // 2
            self.top = _mlp([top_in, *config.top_mlp, 1], last_relu=False)
        rows, cols = torch.triu_indices(n, n, offset=1)
        self.register_buffer("_tri", rows * n + cols, persistent=False)
        self.dedup_groups: tuple[tuple[str, ...], ...] = ()
        self.dedup_partial: tuple[str, ...] = ()

    def set_dedup_groups(
        self, groups: Sequence[Sequence[str]], partial: Sequence[str] = ()
    ) -> None:
        """Deduplicate these groups (and ``partial`` features) of a plain batch before the
        lookups (:func:`~trainer.modules.dedup_batch`); :meth:`from_schema` sets the schema's.

        Float sums depend on their order: a deduplicated batch sums the gradients of a unique
        row's duplicates first (in batch order), then runs the embedding and attention backward
        once per unique row. A plain batch computed row by row would sum the same terms in
        another order, so the groups make it take the deduplicated path too, with the readers'
        unique rows: ``--dedup on`` and ``off`` then train bit for bit alike on the CPU, whatever
        the optimizer. No parameter or checkpoint depends on them. ``()`` computes a plain
        batch on all its rows (the no-dedup baseline the benchmarks time).
        """
        self.dedup_groups = tuple(tuple(g) for g in groups)
        self.dedup_partial = tuple(partial)

    @classmethod
    def from_schema(
        cls,
        schema: DatasetSchema,
        config: ModelConfig | None = None,
        *,
        table_factory: TableFactory | None = None,
    ) -> DLRM:
        """Build the model for a dataset schema (dense features, sparse features, dedup groups:
        how a plain batch is summed, see :meth:`set_dedup_groups`).

        Args:
            schema: the dataset schema.
            config: the model config (default :class:`ModelConfig()`).
            table_factory: builds table modules (e.g. store-backed ones).
        """
        config = config or ModelConfig()
        tables = config.tables if config.tables is not None else default_tables(schema, config)
        names = set(schema.sparse_names)
        for t in tables:
            unknown = [f for f in t.features if f not in names]
            if unknown:
                msg = f"table {t.name!r} reads {unknown!r}, not sparse features of the schema"
                raise RecpipeError(msg)
        attention = attention_features(schema, config)
        max_len = {f: schema.feature(f).max_len for f in attention}
        model = cls(
            len(schema.dense_names),
            tables,
            config=config,
            attention=attention,
            max_len=max_len,
            table_factory=table_factory,
        )
        model.set_dedup_groups(schema.dedup_groups, schema.dedup_partial)
        return model

    def forward(self, batch: Batch) -> torch.Tensor:
        """``[B]`` logits of a batch (deduplicated or plain)."""
        if self.dedup_groups or self.dedup_partial:
            batch = dedup_batch(batch, self.dedup_groups, self.dedup_partial)
        x0 = self.dense_vector(batch.dense)  # (B, D)
        vectors = list(self.ebc(batch).values())
        if self.attention is not None:
            vectors.append(self.attention(self.seq(batch)))
        return self.interact(x0, vectors)

    def dense_vector(self, dense: torch.Tensor) -> torch.Tensor:
        """``x0`` [B, D]: the bottom MLP's output for ``[B, F]`` dense features (signed log1p,
        batch norm)."""
        dense = torch.nan_to_num(dense, nan=0.0).to(self.bottom[0].weight.dtype)
        dense = torch.sign(dense) * torch.log1p(dense.abs())  # (B, F)
        norm = self.dense_norm
        if norm is not None and self.training and dense.shape[0] < 2:  # one row: no batch stats
            dense = F.batch_norm(dense, norm.running_mean, norm.running_var, training=False)
        elif norm is not None:
            dense = norm(dense)
        return self.bottom(dense)  # (B, D)

    def interact(self, x0: torch.Tensor, vectors: Sequence[torch.Tensor]) -> torch.Tensor:
        """``[B]`` logits: pairwise dots of ``[x0, *vectors]`` (each ``[B, D]``, as many as the
        model was built for) with ``x0``, through the top MLP."""
        t = torch.stack([x0, *vectors], dim=1)  # (B, n, D)
        dots = torch.bmm(t, t.transpose(1, 2)).flatten(1)  # (B, n * n)
        z = torch.cat([x0, dots.index_select(1, self._tri)], dim=1)  # (B, D + n(n-1)/2)
        return self.top(z).squeeze(1)  # (B,)
