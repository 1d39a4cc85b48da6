"""Where towers, tables and samples live in an SPTT job, and who talks to whom.

G ranks on hosts of L ranks each (H = G / L hosts; on one machine a "host" is a block of L
local ranks). There are T = H towers: tower ``t`` lives on host ``t``, its tables dealt to the
host's L ranks (whole tables, contiguous runs of the tower's features, balanced by feature
count). Rank ``g`` is local rank ``g mod L`` of host ``g div L``::

    G = 4, L = 2            host 0: ranks 0 1  (tower 0)     host 1: ranks 2 3  (tower 1)
    host groups             {0, 1}  {2, 3}                   all-to-all inside a host
    peer groups             {0, 2}  {1, 3}                   the same local rank on every host

Peers are the ranks with the same ``g mod L``, ordered by ``(g mod T, g div L)``; a rank's
peer group has T members, one per host, and only peer all-to-alls cross hosts (besides the
global all-to-all of the sparse ids).

Nothing here talks to other processes: :class:`SPTTLayout` is the arithmetic every rank
repeats identically.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from trainer.config import TableConfig
from trainer.towers.config import TowerError, TowerPlan

__all__ = ["SPTTLayout", "peer_ranks"]


def peer_ranks(world_size: int, ranks_per_host: int, local: int) -> list[int]:
    """Local rank ``local`` of every host, ordered by ``(g mod T, g div L)`` (T = hosts).

    >>> peer_ranks(4, 2, 1)
    [1, 3]
    >>> peer_ranks(8, 2, 0)
    [0, 4, 2, 6]
    """
    towers = world_size // ranks_per_host
    ranks = [h * ranks_per_host + local for h in range(towers)]
    return sorted(ranks, key=lambda g: (g % towers, g // ranks_per_host))


def _table_blocks(
    tower: Sequence[str], table_of: Mapping[str, str], *, index: int
) -> list[tuple[str, tuple[str, ...]]]:
    """The tower's features as runs of one table each: ``[(table, features)]``."""
    blocks: list[tuple[str, list[str]]] = []
    for f in tower:
        table = table_of[f]
        if blocks and blocks[-1][0] == table:
            blocks[-1][1].append(f)
        else:
            blocks.append((table, [f]))
    names = [b[0] for b in blocks]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        msg = (
            f"tower {index}: the features of table(s) {repeated!r} must be adjacent in the tower "
            "(a table lives on one rank)"
        )
        raise TowerError(msg)
    return [(name, tuple(feats)) for name, feats in blocks]


def _deal(blocks: Sequence[tuple[str, tuple[str, ...]]], ranks: int) -> list[list[int]]:
    """Contiguous runs of ``blocks`` for ``ranks`` ranks, balanced by features: block ``b``
    goes to the rank whose share of the features its middle falls in."""
    total = sum(len(f) for _, f in blocks)
    out: list[list[int]] = [[] for _ in range(ranks)]
    before = 0
    for b, (_, feats) in enumerate(blocks):
        middle = before + len(feats) / 2
        out[min(int(middle * ranks / total), ranks - 1)].append(b)
        before += len(feats)
    return out


@dataclass(frozen=True)
class SPTTLayout:
    """The placement of an SPTT job (see the module docstring).

    Args:
        plan: the towers (as many as hosts).
        tables: the model's tables (each feature in one; a table's features in one tower).
        world_size: G.
        ranks_per_host: L (must divide G).
    """

    plan: TowerPlan
    tables: tuple[TableConfig, ...]
    world_size: int
    ranks_per_host: int
    _features: tuple[tuple[str, ...], ...] = field(init=False, repr=False)
    _tables: tuple[tuple[TableConfig, ...], ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        g, per = self.world_size, self.ranks_per_host
        for name, value in (("world_size", g), ("ranks_per_host", per)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                msg = f"`{name}` must be a positive integer, got {value!r}"
                raise TowerError(msg)
        if g % per:
            msg = f"`ranks_per_host` {per} must divide the {g} ranks of the job"
            raise TowerError(msg)
        if self.plan.num_towers != g // per:
            msg = (
                f"the plan has {self.plan.num_towers} towers but the job has {g // per} hosts "
                f"({g} ranks, {per} per host): SPTT puts one tower on each host"
            )
            raise TowerError(msg)
        tables = tuple(self.tables)
        object.__setattr__(self, "tables", tables)
        table_of = {f: t.name for t in tables for f in t.features}
        by_name = {t.name: t for t in tables}
        self.plan.check_features(table_of)
        features: list[tuple[str, ...]] = []
        placed: list[tuple[TableConfig, ...]] = []
        for t, tower in enumerate(self.plan.towers):
            blocks = _table_blocks(tower, table_of, index=t)
            for name, feats in blocks:
                if set(feats) != set(by_name[name].features):
                    msg = f"table {name!r}: its features {list(by_name[name].features)!r} must all be in tower {t}"
                    raise TowerError(msg)
            for chosen in _deal(blocks, per):
                features.append(tuple(f for b in chosen for f in blocks[b][1]))
                placed.append(tuple(by_name[blocks[b][0]] for b in chosen))
        object.__setattr__(self, "_features", tuple(features))
        object.__setattr__(self, "_tables", tuple(placed))

    # -- ranks ---------------------------------------------------------------------------------
    @property
    def num_hosts(self) -> int:
        """H = T."""
        return self.world_size // self.ranks_per_host

    def host_of(self, rank: int) -> int:
        """The host (and tower) of ``rank``."""
        return rank // self.ranks_per_host

    def local_of(self, rank: int) -> int:
        """``rank``'s local rank on its host."""
        return rank % self.ranks_per_host

    def host_ranks(self, host: int) -> list[int]:
        """The ranks of ``host``, in local-rank order."""
        return [host * self.ranks_per_host + k for k in range(self.ranks_per_host)]

    def peers(self, local: int) -> list[int]:
        """The peer group of local rank ``local``, in peer order (:func:`peer_ranks`)."""
        return peer_ranks(self.world_size, self.ranks_per_host, local)

    # -- features ------------------------------------------------------------------------------
    def features_of(self, rank: int) -> tuple[str, ...]:
        """The features whose tables ``rank`` holds, in tower order."""
        return self._features[rank]

    def tables_of(self, rank: int) -> tuple[TableConfig, ...]:
        """The tables ``rank`` holds."""
        return self._tables[rank]

    def tower_features(self, tower: int) -> tuple[str, ...]:
        """Tower ``tower``'s features: its host's ranks' features one after the other (the
        plan's order)."""
        return self.plan.towers[tower]
