"""What reader processes run: a :class:`BatchProducer` turns a :class:`ShardSpec` (one reader's
part of one client's shard of an epoch) into batches.

:class:`DatasetProducer` runs the reader pipeline over a clustered dataset
(:func:`readers.dataset.iter_batches`), optionally over one :class:`~readers.holdout.Holdout`
part of it (the training or the held-out row groups, as the in-process trainer divides them);
:class:`SyntheticProducer` makes deterministic batches to exercise the service without one.

A client that is one rank of a multi-rank job asks for its rank instead of a shard
(:class:`RankRequest`): :class:`DatasetProducer` then runs the in-process rank reader,
:class:`readers.ranks.RankBatchDataset`, positioned at the client's state, so the rank gets the
very batches it would read in-process (its readers take every ``num_readers``-th step; the
session relays them in step order).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from readers.holdout import Holdout
from recpipe.errors import DataError

if TYPE_CHECKING:
    from recpipe.batch import Batch
    from schemas import DatasetSchema

__all__ = ["BatchProducer", "DatasetProducer", "RankRequest", "ShardSpec", "SyntheticProducer"]


@dataclass(frozen=True)
class RankRequest:
    """A client that is rank ``rank`` of a ``world_size``-rank job.

    Attributes:
        rank: the client's rank.
        world_size: ranks of the job.
        state: where the rank reader starts: a :meth:`readers.ranks.RankBatchDataset.state_dict`
            (saved at any world size), or ``None`` for the start of the requested epoch. The
            server resolves it (:meth:`DatasetProducer.rank_state`) before readers see it.
        batch_size: rows per rank and step (``None``: the producer's).
        drop_remainder: see :class:`readers.ranks.RankBatchDataset`.
    """

    rank: int
    world_size: int
    state: Mapping[str, Any] | None = None
    batch_size: int | None = None
    drop_remainder: bool = True


@dataclass(frozen=True)
class ShardSpec:
    """The part of an epoch one reader produces.

    A client reads shard ``shard`` of ``num_shards``; its ``num_readers`` readers split that
    shard further, reader ``reader`` taking its own part. Flattened, reader ``reader`` of
    shard ``shard`` is part ``shard * num_readers + reader`` of ``num_shards * num_readers``.
    With ``holdout``, the epoch is that part of the dataset only (shards split it as before).
    With ``ranks``, the client is one rank of a job (``shard``/``num_shards`` are its rank and
    world size) and reader ``reader`` makes every ``num_readers``-th of the rank's steps.
    """

    shard: int = 0
    num_shards: int = 1
    reader: int = 0
    num_readers: int = 1
    epoch: int = 0
    holdout: Holdout | None = None
    ranks: RankRequest | None = None

    @property
    def part(self) -> int:
        """This reader's part of the epoch, in ``[0, num_parts)``."""
        return self.shard * self.num_readers + self.reader

    @property
    def num_parts(self) -> int:
        """Parts the epoch is split into, over all shards and readers."""
        return self.num_shards * self.num_readers


class BatchProducer(Protocol):
    """What a reader process runs: a picklable callable yielding the batches of one part.

    A producer may also have ``batch_size`` (rows per batch: a client asking for another size
    is refused) and, over a dataset's row groups, ``count_splits(holdout) -> int`` (row groups
    in a :class:`~readers.holdout.Holdout` part; without it, a client asking for a part is
    refused) and ``rank_state(ranks, epoch=, holdout=) -> state`` (the position a rank client
    starts at; without it, a client asking for a rank is refused).
    """

    def __call__(self, spec: ShardSpec) -> Iterator[Batch]: ...


@dataclass(frozen=True)
class DatasetProducer:
    """The reader pipeline over a clustered dataset (:func:`readers.dataset.iter_batches`).

    Attributes:
        dataset: the clustered dataset directory (``recpipe etl build`` output).
        batch_size: rows per batch.
        dedup: ``True``: one IKJT per dedup group of the schema; ``False``: one plain KJT.
        preprocess: the preprocessing pipeline: a config file, a list of ``[[preprocess]]``
            entries (see ``readers.pipeline.Pipeline.from_config``), or ``None``.
        fitted: the fitted state of its ``fit`` entries (``recpipe fit --out``; ``None``: the
            one ``recpipe fit`` wrote into the dataset, see ``readers.fitted``).
        schema: a schema TOML file, or ``None`` for the schema in the dataset's manifest.
        shuffle: shuffle row groups and sessions (seeded; the epoch is mixed in).
        seed: the shuffle seed.
        warmup_batches: batches a new reader process runs through the pipeline and drops
            before its first client (see :meth:`warm_up`); 0 turns it off.
        read_ahead: row groups a reader process decodes ahead in a second thread
            (:class:`readers.source.ReaderConfig`; 0: one thread per reader process).
        cut: how a rank client's global batches are cut into rank micro-batches
            (:class:`readers.ranks.RankCut`, picklable; ``None``: contiguous ranges).
        dedup_groups: the dedup groups to read with instead of the schema's (see
            :mod:`readers.groups`: ``"auto"``, a TOML file, or the groups; ``None``: the
            schema's). ``recpipe serve`` resolves ``"auto"`` once, before the readers start.
        extras: dataset columns every batch carries in ``Batch.extras``
            (:class:`readers.source.ReaderConfig`, :mod:`readers.extras`); ``()``: none.
        verify, on_error: how much of the files' bytes the readers check, and what a corrupt
            file does (:class:`readers.source.ReaderConfig`).
    """

    dataset: str
    batch_size: int = 4096
    dedup: bool = True
    preprocess: str | Sequence[Mapping[str, Any]] | None = None
    fitted: str | None = None
    schema: str | None = None
    shuffle: bool = False
    seed: int = 0
    warmup_batches: int = 20
    read_ahead: int = 1
    cut: Any = None
    dedup_groups: Any = None
    extras: tuple[str, ...] = ()
    verify: str = "pages"
    on_error: str = "raise"

    def __post_init__(self) -> None:
        if isinstance(self.warmup_batches, bool) or not (
            isinstance(self.warmup_batches, int) and self.warmup_batches >= 0
        ):
            msg = f"`warmup_batches` must be a non-negative integer, got {self.warmup_batches!r}"
            raise DataError(msg)
        from readers.source import ReaderConfig

        # checks them here, not in a reader process
        ReaderConfig(read_ahead=self.read_ahead, extras=self.extras, verify=self.verify,
                     on_error=self.on_error)  # fmt: skip

    def warm_up(self) -> None:
        """Run the first ``warmup_batches`` batches of the epoch through the pipeline and drop
        them: a fresh process loads its compiled kernels and grows its memory pools on first
        use, not while a client waits. The default, 20, crosses one 65,536-row group at
        B=4096. Errors are left to the first client's run."""
        with contextlib.suppress(Exception):
            for _ in itertools.islice(self(ShardSpec()), self.warmup_batches):
                pass

    def __call__(self, spec: ShardSpec) -> Iterator[Batch]:
        """Yield the batches of ``spec``'s part of the epoch."""
        from readers.dataset import iter_batches

        if spec.ranks is not None:
            return self._rank_batches(spec)
        config = self._reader_config()
        return iter_batches(
            self.dataset,
            schema=self.read_schema(),
            config=config,
            transforms=self.preprocess,
            fitted=self.fitted,
            dedup=self.dedup,
            rank=spec.shard,
            world_size=spec.num_shards,
            worker_id=spec.reader,
            num_workers=spec.num_readers,
            epoch=spec.epoch,
            holdout=spec.holdout,
        )

    def _reader_config(self, batch_size: int | None = None) -> Any:
        from readers.source import ReaderConfig

        return ReaderConfig(
            batch_size=self.batch_size if batch_size is None else batch_size,
            shuffle=self.shuffle,
            seed=self.seed,
            read_ahead=self.read_ahead,
            verify=self.verify,
            on_error=self.on_error,
            extras=self.extras,
        )

    def _rank_reader(self, ranks: RankRequest, holdout: Holdout | None) -> Any:
        """The in-process rank reader this client's rank would use (at its batch size)."""
        from readers.dataset import make_pipeline
        from readers.ranks import RankBatchDataset
        from readers.source import DatasetSource

        schema = self.read_schema()
        splits = DatasetSource(self.dataset, schema=schema).splits
        if holdout is not None:
            splits = holdout.select(splits, session_key=schema.session_key)
        cut = copy.copy(self.cut)  # a fresh copy per client: a stateful cut starts with it
        return RankBatchDataset(
            self.dataset, schema=schema, config=self._reader_config(ranks.batch_size),
            transforms=make_pipeline(
                self.preprocess, schema, dataset=self.dataset, fitted=self.fitted
            ),
            dedup=self.dedup, rank=ranks.rank,
            world_size=ranks.world_size, splits=splits, cut=cut,
            drop_remainder=ranks.drop_remainder,
        )  # fmt: skip

    def rank_state(
        self, ranks: RankRequest, *, epoch: int, holdout: Holdout | None = None
    ) -> dict[str, Any]:
        """Where rank client ``ranks`` starts: its state (or the start of ``epoch``) loaded by
        its rank reader, with this stream's rows and shuffle settings filled in.

        Raises:
            DataError: a state that is not a stream position of this stream (other rows,
                shuffle or seed), or a dataset that cannot be read.
        """
        reader = self._rank_reader(ranks, holdout)
        if ranks.state is None:
            reader.set_epoch(epoch)
        else:
            reader.load_state_dict(ranks.state)
        return reader.state_dict()

    def _rank_batches(self, spec: ShardSpec) -> Iterator[Batch]:
        """This reader's share (every ``num_readers``-th step) of a rank client's epoch."""
        assert spec.ranks is not None  # the caller checked
        reader = self._rank_reader(spec.ranks, spec.holdout)
        reader.load_state_dict(spec.ranks.state)
        steps = reader.iter_indexed(worker_id=spec.reader, num_workers=spec.num_readers)
        return (batch for _, batch in steps)

    def count_splits(self, holdout: Holdout) -> int:
        """Row groups in the ``holdout`` part of the dataset.

        Raises:
            DataError: the dataset cannot be opened, or cannot be divided as asked.
        """
        from readers.source import DatasetSource

        schema = self.read_schema()
        splits = DatasetSource(self.dataset, schema=schema).splits
        return len(holdout.select(splits, session_key=schema.session_key))

    def read_schema(self) -> DatasetSchema:
        """The schema the readers use: ``schema`` (else the manifest's) with ``dedup_groups``."""
        from readers.dataset import dataset_schema
        from readers.groups import resolve_dedup_groups
        from schemas import load_schema

        schema = dataset_schema(self.dataset) if self.schema is None else load_schema(self.schema)
        return resolve_dedup_groups(
            self.dedup_groups, schema=schema, dataset=self.dataset, batch_size=self.batch_size
        )


@dataclass(frozen=True)
class SyntheticProducer:
    """Deterministic synthetic batches, to exercise the service without a dataset.

    Batch ``i`` of the epoch goes to part ``i % num_parts``. Rows are numbered through the
    epoch and the row number is stored in ``dense[:, 0]`` (exact up to 2**24 rows), so a test
    can count rows. Sessions hold ``rows_per_session`` consecutive rows and share their
    ``user_*`` lists, which form one dedup group (``"user"``) when ``dedup`` is on. It has no
    row groups to hold out: a client asking for a :class:`~readers.holdout.Holdout` part is
    refused.

    Attributes:
        num_batches: batches per epoch.
        batch_size: rows per batch.
        num_dense: dense features (at least 1).
        rows_per_session: rows per session.
        list_len: maximum length of the user lists.
        dedup: put the user lists in an IKJT group instead of the plain KJT.
        seed: the seed; the epoch and batch index are mixed in.
    """

    num_batches: int = 16
    batch_size: int = 256
    num_dense: int = 4
    rows_per_session: int = 8
    list_len: int = 32
    dedup: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("batch_size", "num_dense", "rows_per_session", "list_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                msg = f"`{name}` must be a positive integer, got {value!r}"
                raise DataError(msg)
        if not isinstance(self.num_batches, int) or self.num_batches < 0:
            msg = f"`num_batches` must be a non-negative integer, got {self.num_batches!r}"
            raise DataError(msg)

    def __call__(self, spec: ShardSpec) -> Iterator[Batch]:
        """Yield the batches of ``spec``'s part of the epoch."""
        for index in range(spec.part, self.num_batches, spec.num_parts):
            yield self.make_batch(index, epoch=spec.epoch)

    def make_batch(self, index: int, *, epoch: int = 0) -> Batch:
        """Batch ``index`` of epoch ``epoch`` (the same on every call)."""
        from recpipe.batch import Batch
        from recpipe.ikjt import InverseKeyedJaggedTensor
        from recpipe.jagged import KeyedJaggedTensor

        gen = torch.Generator().manual_seed(hash((self.seed, epoch, index)) & 0x7FFFFFFF)
        b = self.batch_size
        rows = torch.arange(index * b, (index + 1) * b, dtype=torch.int64)
        sessions = rows // self.rows_per_session
        first = int(sessions[0])
        num_sessions = int(sessions[-1]) - first + 1
        dense = torch.rand((b, self.num_dense), generator=gen)
        dense[:, 0] = rows.to(torch.float32)
        labels = (torch.rand(b, generator=gen) < 0.3).to(torch.float32)
        plain_lengths = torch.cat(
            [torch.ones(b, dtype=torch.int64), torch.randint(0, 5, (b,), generator=gen)]
        )
        plain = KeyedJaggedTensor(
            ["item_id", "item_tags"],
            torch.randint(0, 1 << 40, (int(plain_lengths.sum()),), generator=gen),
            plain_lengths,
        )
        # (S sessions) lists, then one copy per row of the session
        user_lengths = torch.randint(0, self.list_len + 1, (2 * num_sessions,), generator=gen)
        per_session = KeyedJaggedTensor(
            ["user_items", "user_sellers"],
            torch.randint(0, 1 << 20, (int(user_lengths.sum()),), generator=gen),
            user_lengths,
        )
        user = per_session.index_select(sessions - first)
        if self.dedup:
            kjt, ikjts = plain, {"user": InverseKeyedJaggedTensor.from_kjt(user)}
        else:
            kjt, ikjts = KeyedJaggedTensor.concat([plain, user]), {}
        return Batch(dense=dense, labels=labels, kjt=kjt, ikjts=ikjts, session_ids=sessions)
