"""A DLRM whose sparse features are grouped into towers (DMT), in one process.

::

    dense [B, F] -> signed log1p -> batch norm -> bottom MLP -----------------------> x0 [B, N]
    sparse -> PooledEmbeddings (dedup per IKJT group) -> {feature: [B, N]}
    tower t: its features stacked [B, n_t, N] -> tower module -> [B, k_t, N]
    pairwise dots of [x0, tower 0's k_0 vectors, tower 1's, ...] ++ x0 -> top MLP -> logit [B]

With pass-through towers the vectors enter the interaction in the DLRM's own feature order and
every parameter is the DLRM's (same config, same seed): :class:`TowerDLRM` then computes the
same numbers as :class:`~trainer.models.DLRM`. With tower modules the top MLP is rebuilt for the
``1 + sum k_t`` vectors. The multi-rank form (SPTT) runs the same pieces on different ranks
(:mod:`trainer.towers.sptt`): :meth:`TowerDLRM.tower_input`, the towers, :meth:`TowerDLRM.head`.
Nothing here imports training code.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from recpipe.batch import Batch
from recpipe.errors import RecpipeError
from trainer.config import ModelConfig, TableConfig
from trainer.models import DLRM, _mlp, attention_features, default_tables
from trainer.modules import TableFactory, dedup_batch, table_seed
from trainer.towers.config import TowerModuleConfig, TowerPlan
from trainer.towers.modules import TowerModule, build_tower

if TYPE_CHECKING:
    from schemas import DatasetSchema

__all__ = ["FlopCount", "TowerDLRM", "model_tables"]


def model_tables(
    schema: DatasetSchema, config: ModelConfig, features: Sequence[str] | None = None
) -> tuple[TableConfig, ...]:
    """The tables a DLRM of ``config`` builds for ``schema`` (explicit or one per feature),
    only those of ``features`` when given (every feature of a kept table must be listed).

    Raises:
        RecpipeError: a listed feature reads no table, or a table is only partly listed.
    """
    tables = config.tables if config.tables is not None else default_tables(schema, config)
    if features is None:
        return tables
    wanted = list(features)
    known = {f for t in tables for f in t.features}
    unknown = [f for f in wanted if f not in known]
    if unknown:
        msg = f"`features` {unknown!r} are not sparse features of the model ({sorted(known)!r})"
        raise RecpipeError(msg)
    kept = tuple(t for t in tables if set(t.features) & set(wanted))
    partial = [t.name for t in kept if not set(t.features) <= set(wanted)]
    if partial:
        msg = f"`features` must list every feature of table(s) {partial!r} or none"
        raise RecpipeError(msg)
    return kept


@dataclass(frozen=True)
class FlopCount:
    """Forward FLOPs per sample of a model's dense parts (2 per multiply-add; lookups and
    element-wise work not counted).

    Attributes:
        bottom: the bottom MLP.
        towers: every tower module together.
        interaction: the pairwise dots.
        top: the top MLP.
    """

    bottom: int
    towers: int
    interaction: int
    top: int

    @property
    def total(self) -> int:
        return self.bottom + self.towers + self.interaction + self.top


def _mlp_flops(mlp: nn.Sequential) -> int:
    return sum(2 * m.in_features * m.out_features for m in mlp if isinstance(m, nn.Linear))


class TowerDLRM(DLRM):
    """A DLRM whose pooled features pass through towers before the dot interaction.

    Build it with :meth:`from_schema`. Towers hold pooled features only (no attention pooling).

    Args:
        num_dense: dense features F.
        tables: the tables of the sparse features.
        config: the model config (``attention`` must be ``none``).
        plan: which features form which tower (every feature of ``tables`` exactly once).
        towers: the tower modules' config.
        table_factory: builds table modules (default: ``nn.Parameter`` tables).
    """

    def __init__(
        self,
        num_dense: int,
        tables: Sequence[TableConfig],
        *,
        config: ModelConfig,
        plan: TowerPlan,
        towers: TowerModuleConfig,
        table_factory: TableFactory | None = None,
    ) -> None:
        super().__init__(num_dense, tables, config=config, table_factory=table_factory)
        plan.check_features(self.ebc.features)
        self.plan, self.tower_config = plan, towers
        dim = config.embedding_dim
        self.towers = nn.ModuleList(
            build_tower(towers, features=len(f), dim=dim, seed=config.seed, tower=t)
            for t, f in enumerate(plan.towers)
        )
        self.vectors = tuple(m.vectors for m in self.towers)
        # pass-through: each feature's place among the towers' outputs, in the DLRM's order
        where = {f: (t, j) for t, feats in enumerate(plan.towers) for j, f in enumerate(feats)}
        self._flat_order = [where[f] for f in self.ebc.features]
        if towers.kind != "none":
            n = 1 + sum(self.vectors)
            self.num_vectors = n
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(table_seed(config.seed, "towers:top"))
                self.top = _mlp([dim + n * (n - 1) // 2, *config.top_mlp, 1], last_relu=False)
            rows, cols = torch.triu_indices(n, n, offset=1)
            self._tri = (rows * n + cols).to(self._tri.device)

    @classmethod
    def from_schema(  # type: ignore[override]
        cls,
        schema: DatasetSchema,
        config: ModelConfig | None = None,
        *,
        plan: TowerPlan,
        towers: TowerModuleConfig | None = None,
        table_factory: TableFactory | None = None,
    ) -> TowerDLRM:
        """Build the towered model for a dataset schema.

        Raises:
            RecpipeError: the config pools features by attention, or the plan does not hold
                exactly the model's sparse features.
        """
        config = config or ModelConfig(attention="none")
        if attention_features(schema, config):
            msg = (
                "towers hold pooled features only: give the model `attention` 'none' "
                f"(it would pool {list(attention_features(schema, config))!r} by attention)"
            )
            raise RecpipeError(msg)
        model = cls(
            len(schema.dense_names),
            model_tables(schema, config),
            config=config,
            plan=plan,
            towers=towers or TowerModuleConfig(),
            table_factory=table_factory,
        )
        model.set_dedup_groups(schema.dedup_groups, schema.dedup_partial)
        return model

    @property
    def passthrough(self) -> bool:
        """Whether the towers only move the pooled embeddings (the flat DLRM's numbers)."""
        return self.tower_config.kind == "none"

    def tower_input(self, pooled: Mapping[str, torch.Tensor], tower: int) -> torch.Tensor:
        """Tower ``tower``'s features stacked: ``[B, n_t, N]``."""
        return torch.stack([pooled[f] for f in self.plan.towers[tower]], dim=1)

    def head(self, dense: torch.Tensor, outputs: Sequence[torch.Tensor]) -> torch.Tensor:
        """``[B]`` logits from the dense features and every tower's ``[B, k_t, N]`` output."""
        x0 = self.dense_vector(dense)  # (B, N)
        if self.passthrough:
            vectors = [outputs[t][:, j] for t, j in self._flat_order]
        else:
            vectors = [v for out in outputs for v in out.unbind(1)]
        return self.interact(x0, vectors)

    def forward(self, batch: Batch) -> torch.Tensor:
        """``[B]`` logits of a batch (deduplicated or plain: a plain batch's dedup groups are
        deduplicated first, as :meth:`DLRM.forward <trainer.models.DLRM.forward>` does)."""
        if self.dedup_groups or self.dedup_partial:
            batch = dedup_batch(batch, self.dedup_groups, self.dedup_partial)
        pooled = self.ebc(batch)
        outputs = [m(self.tower_input(pooled, t)) for t, m in enumerate(self.towers)]
        return self.head(batch.dense, outputs)

    def flops(self) -> FlopCount:
        """Forward FLOPs per sample of the dense parts."""
        n, dim = self.num_vectors, self.config.embedding_dim
        towers: Sequence[TowerModule] = list(self.towers)  # type: ignore[assignment]
        return FlopCount(
            bottom=_mlp_flops(self.bottom),
            towers=sum(m.flops() for m in towers),
            interaction=2 * n * n * dim,
            top=_mlp_flops(self.top),
        )
