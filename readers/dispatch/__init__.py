"""Embedding-aware sample dispatch (ESD): which rank trains which samples of a global batch.

Each rank caches embedding rows; a sample costs little on a rank that already holds the latest
versions of its rows and much on one that must pull them (or make another rank push them first)
over a slow link. The dispatcher keeps an exact shadow of every rank's cache, prices each
session on each rank with ESD's cost model and places sessions with HybridDis (exact for the
hardest share, greedy for the rest), every rank getting exactly its share of samples.

* :mod:`readers.dispatch.pieces`: session pieces, the unit of dispatch.
* :mod:`readers.dispatch.keys`: the (table, id) rows each piece reads, numbered densely.
* :mod:`readers.dispatch.shadow`: the ranks' caches and the rows' latest versions, step by step.
* :mod:`readers.dispatch.cost`: the cost model.
* :mod:`readers.dispatch.assign`: the exact placement, the greedy pass, HybridDis.
* :mod:`readers.dispatch.dispatcher`: :class:`Dispatcher`, its config and the policies.
* :mod:`readers.dispatch.cut`: :class:`DispatchCut`, the dispatcher as a
  :class:`readers.ranks.RankCut` (``recpipe train --dispatch``, ``recpipe serve --dispatch``).

See ``docs/dispatch.md``. Importing this package imports neither torch nor Numba.
"""

from __future__ import annotations

from recpipe._lazy import lazy_exports

__all__ = [
    "DISPATCH_CHOICES",
    "POLICIES",
    "CacheShadow",
    "Dispatch",
    "DispatchConfig",
    "DispatchCut",
    "Dispatcher",
    "PieceRows",
    "PiecedBatch",
    "Pieces",
    "RowIndex",
    "StepTransfers",
    "TableMap",
    "exact_flow",
    "greedy_flow",
    "hybrid_flow",
    "piece_costs",
    "piece_rows",
    "rank_cut",
    "session_pieces",
]

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "readers.dispatch.assign": ("exact_flow", "greedy_flow", "hybrid_flow"),
        "readers.dispatch.cost": ("piece_costs",),
        "readers.dispatch.cut": ("DISPATCH_CHOICES", "DispatchCut", "rank_cut"),
        "readers.dispatch.dispatcher": (
            "POLICIES", "Dispatch", "DispatchConfig", "Dispatcher", "PiecedBatch",
        ),
        "readers.dispatch.keys": ("PieceRows", "RowIndex", "TableMap", "piece_rows"),
        "readers.dispatch.pieces": ("Pieces", "session_pieces"),
        "readers.dispatch.shadow": ("CacheShadow", "StepTransfers"),
    },
)  # fmt: skip
