"""The hybrid store as a rank's shard (``recpipe train --nproc N --store hybrid``).

Every rank keeps the rows it owns (``owner_of(id, N) == rank``) of each table in an
:class:`~trainer.store.EmbeddingStore` of its own (host cache + persistent tier, incremental
batch-consistent checkpoints, crash recovery), in place of the in-memory :class:`RowShard`::

    CK/store/rank-00000-of-00002/<table>/    rank 0's store of <table> (meta.json, rows.bin, ...)
    CK/store/rank-00001-of-00002/<table>/
    (no --checkpoint: a temporary directory per store, removed at the end)

:class:`StoreShard` has :class:`RowShard`'s interface, so the 2FP exchange
(:class:`~trainer.distributed.exchange.ShardedEmbeddings`) reads and writes through it unchanged:
``rows(ids)`` prefetches the ids (new ids get the store's hash init, the rows pinned for the
step) and returns their positions among the prefetch's unique rows, ``gather_into`` pulls them,
``apply`` pushes the summed gradients and runs the store's own row update (SGD, row-wise Adagrad,
or Adam at the exchange's step count: ``store.update(step=)``). The hot replica stays the exchange's: a hot row's copy in its owner's
store is refreshed when the row leaves the hot set and before every checkpoint.

Checkpoints (collective, :func:`save_store_checkpoint`): every rank writes its owned hot rows
into its stores and its stores commit the step together (only the rows changed since each one's
last commit; their writer threads write and fsync at once), then
:func:`trainer.distributed.checkpoint.save_parts` writes the rank headers and rank 0
``checkpoint.pt`` last. A crash before that leaves stores one commit ahead of ``checkpoint.pt``;
a resume reopens them at its step (``open_store(step=)`` rolls back one commit).

Resume at the same world size: each rank reopens its own stores at the checkpoint's step.
At another world size: each new rank creates fresh stores and reads from every old rank's
stores, read-only at the checkpoint's step, the ids (all of them: 8 bytes a row) and the
values and state of only the rows it now owns (:func:`read_owned_rows`).

Not supported (refused in one line): the per-rank caches (``--cache-rows``), a CUDA device. Towers keep each
rank's tables in its stores the same way (:mod:`trainer.towers.run`). The stores keep
float32 rows, in a host cache without a bound (as one process's ``--store hybrid``).
"""

from __future__ import annotations

import logging
import math
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from recpipe.errors import RecpipeError, StoreError
from trainer.distributed import _kernels as K
from trainer.distributed.shard import SparseOptimizer, owner_of
from trainer.modules import TableConfig, TableFactory, table_seed
from trainer.store import init_rows
from trainer.store.checkpoints import checkpoint_stores
from trainer.store.config import StoreConfig, store_optimizer
from trainer.store.persist import (
    CommitRecord,
    RowFile,
    StoreMeta,
    load_current,
    read_copies,
    read_ids,
)
from trainer.store.store import EmbeddingStore, Locations, open_store

if TYPE_CHECKING:
    from torch import nn

    from trainer.distributed.comm import Comm
    from trainer.distributed.exchange import ShardedEmbeddings

__all__ = [
    "StoreShard",
    "check_store_options",
    "commit_stores",
    "rank_store_dir",
    "read_owned_rows",
    "reopened_stores",
    "save_store_checkpoint",
    "store_table_factory",
]

_log = logging.getLogger(__name__)

_STORE_OPTIMIZER = {"sgd": "sgd", "rowwise_adagrad": "rowwise_adagrad", "adam": "adam"}


def rank_store_dir(root: str | Path, rank: int, world_size: int) -> Path:
    """``root/store/rank-R-of-W``: the directory of rank ``rank``'s stores (one per table)."""
    return Path(root) / "store" / f"rank-{rank:05d}-of-{world_size:05d}"


def check_store_options(*, optimizer: str, cache_rows: int) -> None:
    """Refuse what the store as a rank's shard does not support.

    Raises:
        RecpipeError: naming the flag.
    """
    if cache_rows:
        msg = (
            f"`--cache-rows` {cache_rows} with `--store` 'hybrid': not supported (the rows of a "
            "rank's store are read through the 2FP exchange); hint: drop --cache-rows"
        )
        raise RecpipeError(msg)


class StoreShard:
    """The rows one rank owns of one table, kept in an :class:`EmbeddingStore`, with
    :class:`~trainer.distributed.shard.RowShard`'s interface (see the module docstring).

    The row numbers :meth:`rows` returns are positions among the unique rows of that prefetch,
    valid for :meth:`gather_into` and :meth:`apply` until the next :meth:`rows`.

    Args:
        store: the store (float32 rows, no hot set of its own).
    """

    dtype = torch.float32
    device = torch.device("cpu")

    def __init__(self, store: EmbeddingStore) -> None:
        self.store = store
        self.dim = store.dim
        self.seed, self.init_scale = store.meta.seed, store.meta.init_scale
        self.step = 0  # the optimizer steps taken (as RowShard's; the store's optimizer ignores it)
        self._state = store.meta.state_dim
        self._loc: Locations | None = None

    @property
    def row_state_shape(self) -> tuple[int, ...] | None:
        """``()`` (row-wise Adagrad's accumulator), ``(2D,)`` (Adam's moments) or ``None``
        (SGD)."""
        return _row_state_shape(self._state)

    @property
    def num_rows(self) -> int:
        return self.store.num_rows

    def emptied(self) -> StoreShard:
        """This shard, which must hold no row yet (a resume at another world size fills a
        store created empty; a store is not emptied in place)."""
        if self.num_rows:
            msg = f"store {str(self.store.root)!r} already holds {self.num_rows} rows"
            raise StoreError(msg)
        return self

    def init_values(self, ids: np.ndarray) -> torch.Tensor:
        """The values ``ids`` start with ``[n, D]``."""
        return torch.from_numpy(init_rows(ids, self.dim, seed=self.seed, scale=self.init_scale))

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Prefetch ``ids`` (new ones get rows) and pin them; their positions among the
        prefetch's unique rows (int64 [n])."""
        self._loc = self.store.prefetch(np.ascontiguousarray(ids, dtype=np.int64))
        return self._loc.inverse.numpy()

    def _prefetched(self) -> Locations:
        if self._loc is None:
            raise StoreError("no rows prefetched: call rows(ids) first")
        return self._loc

    def gather_into(self, rows: np.ndarray, out: torch.Tensor, at: np.ndarray) -> None:
        """``out[at[i]] = values[rows[i]]`` (rows of the last :meth:`rows`)."""
        pulled = self.store.pull(self._prefetched())  # (U, D)
        K.copy_rows(pulled.numpy(), rows, out.numpy(), at)

    def apply(self, optimizer: SparseOptimizer, rows: np.ndarray, grads: torch.Tensor) -> None:
        """The store's optimizer step on ``rows`` (distinct, of the last :meth:`rows`) with
        ``grads`` [n, D] (the exchange's ``optimizer`` must be the store's)."""
        store = self.store
        kind = _STORE_OPTIMIZER.get(optimizer.kind)
        if kind != store.meta.optimizer or optimizer.lr != store.config.lr:
            msg = (
                f"store {str(store.root)!r} trains with {store.meta.optimizer} at lr "
                f"{store.config.lr}, the exchange with {optimizer.kind} at lr {optimizer.lr}"
            )
            raise StoreError(msg)
        loc = self._prefetched()
        full = torch.zeros(loc.num_unique, self.dim, dtype=torch.float32)
        full[torch.from_numpy(rows)] = grads.to(torch.float32)
        store.push(loc, full)
        store.update(step=self.step)  # Adam's bias correction: the exchange's step count

    def lookup(self, ids: np.ndarray) -> torch.Tensor:
        """Values of ``ids`` without creating rows (unknown ids get their init values)."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        known = self.store.lookup_rows(ids) >= 0
        out = torch.empty(ids.size, self.dim, dtype=torch.float32)
        if known.any():
            loc = self.store.prefetch(ids[known])
            pulled = self.store.pull(loc)
            out[torch.from_numpy(np.flatnonzero(known))] = pulled[loc.inverse]
        if not known.all():
            out[torch.from_numpy(np.flatnonzero(~known))] = self.init_values(ids[~known])
        return out

    def read(self, ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Values and state of ``ids`` (created when new)."""
        loc = self.store.prefetch(np.ascontiguousarray(ids, dtype=np.int64))
        rows = torch.from_numpy(self.store.read_rows(loc))[loc.inverse]  # (n, D + state)
        return rows[:, : self.dim], _state_columns(rows, self.dim, self._state)

    def write(self, ids: np.ndarray, values: torch.Tensor, state: torch.Tensor | None) -> None:
        """Set the values (and state) of ``ids`` (distinct; created when new)."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        if not ids.size:
            return
        loc = self.store.prefetch(ids)
        rows = self.store.read_rows(loc)  # (U, D + state)
        at = loc.inverse.numpy()
        rows[at, : self.dim] = values.detach().to("cpu", torch.float32).numpy()
        if self._state and state is not None:
            state = state.detach().to("cpu", torch.float32).reshape(ids.size, self._state)
            rows[at, self.dim :] = state.numpy()
        self.store.write_rows(loc, rows)

    def export(self) -> tuple[np.ndarray, torch.Tensor, torch.Tensor | None]:
        """Every row: ``(ids, values [n, D], state [n] or None)`` in row order (copies)."""
        ids, rows = self.store.export()
        values = torch.from_numpy(np.ascontiguousarray(rows[:, : self.dim]))
        state = _state_columns(torch.from_numpy(rows), self.dim, self._state)
        return ids, values, None if state is None else state.contiguous()

    def close(self) -> None:
        self.store.close()


def _row_state_shape(state_dim: int) -> tuple[int, ...] | None:
    """One row's optimizer state of ``state_dim`` floats, shaped as :class:`RowShard` keeps
    it: ``None`` (SGD), ``()`` (row-wise Adagrad), ``(2D,)`` (Adam's m | v)."""
    return None if not state_dim else () if state_dim == 1 else (state_dim,)


def _state_columns(rows: torch.Tensor, dim: int, state_dim: int) -> torch.Tensor | None:
    """The state of store rows ``[n, D + state]``, shaped per :func:`_row_state_shape` (a view)."""
    shape = _row_state_shape(state_dim)
    return None if shape is None else rows[:, dim:].reshape(rows.shape[0], *shape)


# -------------------------------------------------------------------------------------------
# building, saving, resuming


def store_table_factory(
    *,
    optimizer: str,
    lr: float,
    root: str | Path | None,
    rank: int,
    world_size: int,
    open_step: int | None,
    stores: list[EmbeddingStore],
) -> TableFactory:
    """Build :class:`~trainer.distributed.exchange.ShardedTable` s over :class:`StoreShard` s,
    initialised as :func:`~trainer.distributed.trainer.sharded_table_factory` initialises
    rows (a hash of ``table_seed(seed, name)`` and the id in ``±sqrt(1/num_embeddings)``).

    Args:
        optimizer: ``"sgd"``, ``"adagrad"`` (row-wise) or ``"adam"``.
        lr: the tables' learning rate.
        root: the checkpoint directory (``None``: a temporary store per table).
        rank, world_size: this rank of the job.
        open_step: reopen this rank's stores at this step (a resume at the same world size);
            ``None``: create them (any directory left there by an earlier try is removed).
        stores: every store made is appended here (the engine closes them).
    """
    from trainer.distributed.exchange import ShardedTable

    folder = None if root is None else rank_store_dir(root, rank, world_size)
    if folder is not None and open_step is None and folder.exists():
        shutil.rmtree(folder)  # a resume at this world size that stopped before its checkpoint

    def factory(table: TableConfig, seed: int) -> nn.Module:
        path = None if folder is None else folder / table.name
        if open_step is not None:
            assert path is not None
            where = f"rank {rank}'s store of table {table.name!r} at {str(path)!r}"
            if not (path / "meta.json").exists():
                msg = f"cannot resume at step {open_step}: {where} is missing (meta.json)"
                raise RecpipeError(msg)
            try:
                store = open_store(path, lr=lr, step=open_step, pin_window=4)
            except StoreError as exc:
                msg = f"cannot resume at step {open_step}: {where}: {exc}"
                raise RecpipeError(msg) from None
        else:
            config = StoreConfig(
                dim=table.dim,
                optimizer=store_optimizer(optimizer),
                lr=lr,
                seed=table_seed(seed, table.name) % (1 << 31),
                init_scale=math.sqrt(1.0 / table.num_embeddings),
                pin_window=4,  # a step's prefetch stays pinned through a few reads around it
                sync="full",
            )
            store = EmbeddingStore.create(path, config)
        stores.append(store)
        return ShardedTable(table, StoreShard(store))

    return factory


def _store_shards(sparse: ShardedEmbeddings) -> list[StoreShard]:
    shards = [t.shard for t in sparse.tables]
    if not all(isinstance(s, StoreShard) for s in shards):
        raise RecpipeError("the exchange's tables are not kept in stores")
    return shards  # type: ignore[return-value]


def commit_stores(sparse: ShardedEmbeddings, step: int) -> None:
    """Write the owned hot rows into their stores and commit every store at ``step`` (this
    rank's part of a checkpoint), the stores all at once
    (:func:`~trainer.store.checkpoints.checkpoint_stores`)."""
    rank, world = sparse.comm.rank, sparse.comm.world_size
    shards = _store_shards(sparse)
    for table, shard in zip(sparse.tables, shards, strict=True):
        mine = owner_of(table.hot_ids, world) == rank
        if mine.any():
            idx = torch.from_numpy(np.flatnonzero(mine))
            state = None if table.hot_state is None else table.hot_state[idx]
            shard.write(table.hot_ids[mine], table.hot_values[idx], state)
    checkpoint_stores([shard.store for shard in shards], step)


def save_store_checkpoint(
    root: str | Path, *, comm: Comm, sparse: ShardedEmbeddings, step: int,
    state: Mapping[str, Any],
) -> Path:  # fmt: skip
    """Save the job at ``step`` (collective): every rank's stores commit, then the rank
    headers and rank 0's ``checkpoint.pt`` (last); rank 0 then removes the stores of other
    world sizes (those a resume at this world size read its rows from)."""
    from trainer.distributed.checkpoint import KIND, save_parts

    commit_stores(sparse, step)
    part = {"step": step, "rank": comm.rank, "world_size": comm.world_size,
            "optimizer_step": sparse.optimizer_step}  # fmt: skip
    doc = {**state, "kind": KIND, "step": step, "world_size": comm.world_size,
           "store_world_size": comm.world_size,
           "hot": dict(zip(sparse.names, sparse.hot_sets(), strict=True))}  # fmt: skip
    path = save_parts(root, comm=comm, area="sparse", step=step, part=part, doc=doc)
    if comm.rank == 0:
        keep = f"-of-{comm.world_size:05d}"
        for old in (Path(root) / "store").glob("rank-*-of-*"):
            if not old.name.endswith(keep):
                shutil.rmtree(old, ignore_errors=True)
    return path


def _commit_of(root: Path, step: int) -> CommitRecord:
    """The store's commit of ``step``: CURRENT, or PREVIOUS where the store committed once
    more after it (a job killed before its ``checkpoint.pt``). Reads only."""
    current = load_current(root)
    if current.step == step:
        return current
    kept = CommitRecord.load(root, "PREVIOUS") if (root / "PREVIOUS").exists() else None
    if kept is None or kept.step != step or kept.epoch >= current.epoch:
        msg = f"store {str(root)!r} holds the checkpoint of step {current.step}, not of step {step}"
        raise StoreError(msg)
    return kept


def read_owned_rows(path: str | Path, *, step: int, rank: int, world_size: int) -> dict[str, Any]:
    """The rows of the store at ``path``, as committed at ``step``, that rank ``rank`` of
    ``world_size`` owns: ``{"ids", "values", "state", "bytes"}`` (CPU tensors; ``state``
    ``[n]`` (row-wise Adagrad), ``[n, 2D]`` (Adam) or ``None``; ``bytes`` read). Read-only: the commit record, the ids (every one, 8
    bytes a row), the committed copies' bitmap (a bit a row), and of ``rows.bin`` only the
    owned rows (checksummed)."""
    root = Path(path)
    meta = StoreMeta.load(root)
    commit = _commit_of(root, step)
    ids = read_ids(root / "ids.bin", commit.num_rows, commit.ids_crc)
    copies = read_copies(root / f"copies-{commit.epoch}.bin", commit)
    mine = np.flatnonzero(owner_of(ids, world_size) == rank)
    rows = np.empty((mine.size, meta.width), dtype=np.float32)
    if mine.size:
        file = RowFile(root / "rows.bin", meta, writable=False)
        try:
            if file.capacity < commit.num_rows:
                msg = f"store file {str(file.path)!r} is truncated: {file.capacity} rows, the checkpoint has {commit.num_rows}"
                raise StoreError(msg)
            pos = 2 * mine + copies[mine].astype(np.int64)
            file.read(pos, rows.view(np.uint32), np.arange(mine.size, dtype=np.int64))
        finally:
            file.close()
    state = _state_columns(torch.from_numpy(rows), meta.dim, meta.state_dim)
    return {
        "ids": torch.from_numpy(ids[mine].copy()),
        "values": torch.from_numpy(np.ascontiguousarray(rows[:, : meta.dim])),
        "state": None if state is None else state.contiguous(),
        "bytes": ids.nbytes + -(-ids.size // 8) + mine.size * meta.disk_width * 4,
    }


def reopened_stores(
    sparse: ShardedEmbeddings, *, optimizer_step: int, hot: Mapping[str, Any] | None = None
) -> None:
    """Resume over stores reopened at the checkpoint's step (:func:`store_table_factory`'s
    ``open_step``): the optimizer's step count, and the saved hot sets when ``hot`` is given."""
    _store_shards(sparse)
    sparse.optimizer_step = optimizer_step
    for table in sparse.tables:
        table.shard.step = optimizer_step
    if hot is not None:
        sparse.set_hot([np.array(hot.get(n, ()), dtype=np.int64) for n in sparse.names])


def load_store_sparse(
    root: str | Path, state: Mapping[str, Any], *, sparse: ShardedEmbeddings
) -> None:
    """Resume this rank's stores from the checkpoint ``state`` (collective): at the world size
    it was saved at, the stores were reopened at its step (:func:`store_table_factory`); at
    another, each rank fills its new stores with the rows it owns from the old ranks' stores.
    Then the saved hot sets are installed."""
    from trainer.distributed.checkpoint import read_part

    step, saved = int(state["step"]), int(state["store_world_size"])
    comm = sparse.comm
    first = read_part(root, state, "sparse", rank=0, world_size=saved)
    opt_step = int(first.get("optimizer_step", step))
    if saved == comm.world_size:
        reopened_stores(sparse, optimizer_step=opt_step)
    else:
        parts, read = [], 0
        for r in range(saved):
            folder = rank_store_dir(root, r, saved)
            part = {}
            for key, table in zip(sparse.names, sparse.tables, strict=True):
                try:
                    rows = read_owned_rows(folder / table.config.name, step=step, rank=comm.rank,
                                           world_size=comm.world_size)  # fmt: skip
                except StoreError as exc:
                    msg = f"cannot resume at step {step} from {saved} ranks' stores: {exc}"
                    raise RecpipeError(msg) from None
                read += rows.pop("bytes")
                part[key] = {**rows, "step": opt_step}
            parts.append(part)
        _log.debug("rank %d of %d: read %d bytes of %d ranks' stores for its rows",
                   comm.rank, comm.world_size, read, saved)  # fmt: skip
        sparse.load_owned_rows(parts)
    hot = state.get("hot", {})
    sparse.set_hot([hot[name].copy() if name in hot else [] for name in sparse.names])
