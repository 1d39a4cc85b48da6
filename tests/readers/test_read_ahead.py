"""Row-group read-ahead (``ReaderConfig.read_ahead``): the same stream as without it, errors and
skips at the same point, bounded memory, and no thread or open file left behind."""

from __future__ import annotations

import gc
import os
import threading
from pathlib import Path

import pyarrow as pa
import pytest

from readers.source import DatasetSource, ReaderConfig, SourcePosition, _ReadAhead, plan_splits
from recpipe.errors import CorruptInputError, DataError
from tests.common.tables import tables_equal

THREAD_NAME = "recpipe-read-ahead"


def _read_ahead_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == THREAD_NAME]


def _open_files_under(root: Path) -> list[str]:
    """Paths under ``root`` this process holds open (Linux ``/proc``)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the fd of the listing itself, closed by now
            continue
        if target.startswith(str(root)):
            out.append(target)
    return out


def _source(root, tiny_schema, **kw) -> DatasetSource:
    return DatasetSource(root, schema=tiny_schema, config=ReaderConfig(**kw))


def _run(source: DatasetSource, splits, **kw) -> tuple[list, Exception | None]:
    """``(batch, position, skipped so far)`` until the stream ends or fails, and the error."""
    out = []
    try:
        for table, pos in source.iter_tables(splits, **kw):
            out.append((table, pos, list(source.skipped)))
    except (DataError, CorruptInputError) as exc:
        return out, exc
    return out, None


def _assert_same_stream(got: list, want: list) -> None:
    assert len(got) == len(want) > 0
    for (a, pos_a, skipped_a), (b, pos_b, skipped_b) in zip(got, want):
        assert pos_a == pos_b
        assert skipped_a == skipped_b
        assert tables_equal(a, b)


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("last_batch", ["partial", "drop"])
def test_stream_is_the_same_with_and_without_read_ahead(
    make_dataset, tiny_schema, shuffle, last_batch
):
    root = make_dataset(num_sessions=120, files=3, row_group_rows=25)
    kw = {"batch_size": 16, "shuffle": shuffle, "seed": 4, "shuffle_buffer": 9}
    base = _source(root, tiny_schema, read_ahead=0, last_batch=last_batch, **kw)
    splits = plan_splits(base.splits, config=base.config, epoch=1)
    assert len(splits) > 10
    want, err = _run(base, splits, epoch=1)
    assert err is None
    middle = want[len(want) // 2][1]
    assert 0 < middle.split_pos < len(splits) and (middle.row > 0 or not shuffle)
    want_rest, _ = _run(base, splits, epoch=1, start=middle)
    for depth in (1, 3):
        source = _source(root, tiny_schema, read_ahead=depth, last_batch=last_batch, **kw)
        got, err = _run(source, splits, epoch=1)
        assert err is None
        _assert_same_stream(got, want)
        rest, _ = _run(source, splits, epoch=1, start=middle)
        _assert_same_stream(rest, want_rest)
        assert _run(source, splits, epoch=1, start=SourcePosition(len(splits), 0)) == ([], None)
    assert _read_ahead_threads() == []


def _corrupt_middle_split(make_dataset, corrupt_column) -> Path:
    """Three files of ~2 row groups; row group 0 of the second file cannot be decoded."""
    root = make_dataset(num_sessions=36, files=3, row_group_rows=25)
    corrupt_column(root / "part-00001.parquet", "item_tags")
    return root


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_bad_split_surfaces_when_the_stream_reaches_it(
    make_dataset, tiny_schema, corrupt_column, on_error
):
    root = _corrupt_middle_split(make_dataset, corrupt_column)
    base = _source(root, tiny_schema, batch_size=8, read_ahead=0, on_error=on_error)
    want, want_err = _run(base, base.splits)
    bad = next(s.index for s in base.splits if s.path.endswith("part-00001.parquet"))
    assert 2 <= bad <= 3
    if on_error == "raise":
        assert isinstance(want_err, CorruptInputError)
        assert "part-00001.parquet: row group 0 column `item_tags`" in str(want_err)
    else:
        assert want_err is None
        assert [(s.path, s.row_group) for s in base.skipped] == [(base.splits[bad].path, 0)]

    source = _source(root, tiny_schema, batch_size=8, read_ahead=3, on_error=on_error)
    reached = threading.Event()
    read_split = source.read_split

    def watched(split, **kw):
        try:
            return read_split(split, **kw)
        finally:
            if split.index == bad:
                reached.set()

    source.read_split = watched  # type: ignore[method-assign]
    stream = source.iter_tables(source.splits)
    got = [(*next(stream), list(source.skipped))]
    # the thread has read (and failed on) the bad split; the consumer is still at split 0
    assert reached.wait(timeout=60)
    assert got[0][1].split_pos == 0 and source.skipped == []
    err = None
    try:
        for table, pos in stream:
            got.append((table, pos, list(source.skipped)))
    except CorruptInputError as exc:
        err = exc
    _assert_same_stream(got, want)
    assert sum(pos.split_pos < bad for _, pos, _ in got) > 1  # batches before it came first
    assert str(err) == str(want_err) and type(err) is type(want_err)
    assert source.skipped == base.skipped
    assert _read_ahead_threads() == []


def test_closing_early_or_dropping_the_stream_stops_the_thread(make_dataset, tiny_schema):
    root = make_dataset(num_sessions=120, files=3, row_group_rows=25)
    source = _source(root, tiny_schema, batch_size=8, read_ahead=2)
    before = threading.active_count()

    stream = source.iter_tables(source.splits)
    assert _read_ahead_threads() == []  # nothing starts before the first batch is asked for
    next(stream)
    (thread,) = _read_ahead_threads()
    assert thread.daemon and threading.active_count() == before + 1
    stream.close()
    assert not thread.is_alive() and threading.active_count() == before
    assert _open_files_under(root) == []

    stream = source.iter_tables(source.splits)
    next(stream)
    (thread,) = _read_ahead_threads()
    del stream
    gc.collect()
    assert not thread.is_alive() and threading.active_count() == before
    assert _open_files_under(root) == []

    for _ in source.iter_tables(source.splits):  # read to the end
        pass
    assert _read_ahead_threads() == [] and _open_files_under(root) == []


def test_an_error_stops_the_thread(make_dataset, tiny_schema, corrupt_column):
    root = _corrupt_middle_split(make_dataset, corrupt_column)
    source = _source(root, tiny_schema, batch_size=8, read_ahead=2)
    before = threading.active_count()
    with pytest.raises(CorruptInputError, match=r"part-00001\.parquet: row group 0"):
        list(source.iter_tables(source.splits))
    assert threading.active_count() == before and _read_ahead_threads() == []
    assert _open_files_under(root) == []


def test_read_ahead_holds_at_most_depth_results():
    produced: list[int] = []
    asked = threading.Event()

    def reads(target: int):
        for i in range(100):
            produced.append(i)
            if len(produced) == target:
                asked.set()
            yield pa.table({"x": [i]}), None

    depth, taken = 3, 4
    ahead = _ReadAhead(reads(taken + depth), depth=depth)
    for i in range(taken):
        table, err = next(ahead)
        assert err is None and table.column("x")[0].as_py() == i
    assert asked.wait(timeout=60)
    ahead.close()  # joins the thread: it can add nothing after this
    assert produced == list(range(taken + depth))


def test_config_validation():
    assert ReaderConfig().read_ahead == 1
    assert ReaderConfig(read_ahead=0).read_ahead == 0
    for bad in (-1, 1.5, "2", True, None):
        with pytest.raises(DataError, match=r"`read_ahead` must be a non-negative integer"):
            ReaderConfig(read_ahead=bad)  # type: ignore[arg-type]
