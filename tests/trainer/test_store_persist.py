"""The persistent tier: checkpoints, recovery of uncommitted work, corrupted and truncated files."""

from __future__ import annotations

import json

import numpy as np
import pytest

from recpipe.errors import StoreError
from recpipe_cli import main
from trainer.store import EmbeddingStore, StoreConfig, inspect_store, open_store

DIM = 4


def train(store: EmbeddingStore, steps: range, *, seed: int = 0) -> None:
    import torch

    rng = np.random.default_rng([seed, steps.start])
    for _ in steps:
        ids = rng.integers(-50, 50, 30) * 1_000_003
        loc = store.prefetch(ids)
        rows = store.pull(loc)
        store.push(loc, torch.ones_like(rows) * 0.1 + rows)
        store.update()


@pytest.fixture
def store_dir(tmp_path):
    path = tmp_path / "s"
    cfg = StoreConfig(
        dim=DIM, optimizer="rowwise_adagrad", chunk_rows=8, cache_rows=40, pin_window=1
    )
    with EmbeddingStore.create(path, cfg) as store:
        train(store, range(10))
        store.reshard(5)
        store.checkpoint(9)
        snapshot = store.export()
        written = store.stats().written_back
        train(store, range(10, 20))  # uncommitted work, written to disk by evictions
        assert store.stats().written_back > written
    return path, snapshot


def test_open_restores_the_last_checkpoint_exactly(store_dir):
    path, (ids, values) = store_dir
    with open_store(path, cache_rows=40, pin_window=1, verify=True) as store:
        got_ids, got_values = store.export()
        assert store.stats().last_checkpoint_step == 9
        assert store.stats().hot_rows == 5
    np.testing.assert_array_equal(got_ids, ids)
    assert got_values.tobytes() == values.tobytes()


def test_a_checkpoint_writes_only_changed_rows(tmp_path):
    cfg = StoreConfig(dim=DIM, chunk_rows=8)
    with EmbeddingStore.create(tmp_path / "s", cfg) as store:
        train(store, range(5))
        first = store.checkpoint(4).result()
        assert first["rows_written"] == store.num_rows
        loc = store.prefetch(np.array([0, 1_000_003]))  # two existing ids
        store.push(loc, store.pull(loc))
        store.update()
        assert store.checkpoint(5, wait=False).result()["rows_written"] == 2
        assert store.checkpoint(6).result()["rows_written"] == 0


def test_new_store_refuses_an_existing_directory(store_dir):
    path, _ = store_dir
    with pytest.raises(StoreError, match="already holds a store"):
        EmbeddingStore.create(path, StoreConfig(dim=DIM))


def test_truncated_row_file_is_detected(store_dir):
    path, _ = store_dir
    with open(path / "rows.bin", "r+b") as f:
        f.truncate(f.seek(0, 2) - 10)
    with pytest.raises(StoreError, match="truncated"):
        open_store(path)


def test_truncated_ids_file_is_detected(store_dir):
    path, _ = store_dir
    with open(path / "ids.bin", "r+b") as f:
        f.truncate(16)
    with pytest.raises(StoreError, match=r"ids\.bin.*truncated"):
        open_store(path)


def _flip_row_byte(path, row: int) -> None:
    """Flip a bit in both on-disk copies of ``row`` (so the committed one is hit)."""
    meta = json.loads((path / "meta.json").read_text())
    copy_bytes = (meta["dim"] + meta["state_dim"] + 1) * 4
    with open(path / "rows.bin", "r+b") as f:
        for pos in (2 * row, 2 * row + 1):
            f.seek(pos * copy_bytes + 3)
            b = f.read(1)
            f.seek(pos * copy_bytes + 3)
            f.write(bytes([b[0] ^ 0x40]))


def test_corrupted_row_is_detected_on_verify_and_on_read(store_dir):
    path, (ids, _) = store_dir
    _flip_row_byte(path, 3)
    with pytest.raises(StoreError, match="row 3 fails its checksum"):
        open_store(path, verify=True)
    with open_store(path) as store, pytest.raises(StoreError, match="checksum"):
        store.prefetch(ids[3:4])


@pytest.mark.parametrize("name", ["CURRENT", "meta.json"])
def test_corrupted_commit_record_or_meta_is_detected(store_dir, name):
    path, _ = store_dir
    text = (path / name).read_text()
    (path / name).write_text(
        text.replace('"', "'", 1) if name == "meta.json" else text.replace("9", "8", 1)
    )
    with pytest.raises(StoreError, match="corrupted"):
        open_store(path)


def test_corrupted_or_missing_copy_bitmap_is_detected(store_dir):
    path, _ = store_dir
    (bitmap,) = path.glob("copies-*.bin")
    data = bytearray(bitmap.read_bytes())
    data[0] ^= 0x01
    bitmap.write_bytes(bytes(data))
    with pytest.raises(StoreError, match=r"copies-\d+\.bin.*corrupted"):
        open_store(path)
    bitmap.unlink()
    with pytest.raises(StoreError, match="missing"):
        open_store(path)


def test_uncommitted_writes_never_touch_the_committed_copy(store_dir):
    """Reopening twice (a crash during recovery) gives the same checkpoint."""
    path, (_, values) = store_dir
    for _ in range(2):
        with open_store(path, cache_rows=40, pin_window=1) as store:
            assert store.export()[1].tobytes() == values.tobytes()
            train(store, range(30, 33))  # and more uncommitted work, dropped


def test_inspect_and_cli(store_dir, capsys):
    path, (ids, _) = store_dir
    info = inspect_store(path)
    assert info["rows"] == ids.size
    assert info["hot_rows"] == 5
    assert info["last_checkpoint"]["step"] == 9
    assert info["chunks"] >= -(-ids.size // 8)
    assert main(["store", str(path), "--json", "--verify"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["verified_rows"] == ids.size
    assert main(["store", str(path)]) == 0
    text = capsys.readouterr().out
    assert "last checkpoint" in text and "step 9" in text


def test_cli_reports_a_missing_store(tmp_path, capsys):
    assert main(["store", str(tmp_path / "nope")]) == 1
    assert "not a store directory" in capsys.readouterr().err


def test_background_checkpoint_copies_on_write(tmp_path):
    """Rows updated while a background checkpoint is being written are saved as they were."""
    import threading

    import torch

    cfg = StoreConfig(dim=DIM, chunk_rows=8)
    ids = np.arange(20) * 7919 - 50
    with EmbeddingStore.create(tmp_path / "s", cfg) as store:
        train(store, range(3))
        store.checkpoint(2)  # starts the writer thread
        loc = store.prefetch(ids)
        store.push(loc, store.pull(loc) + 1.0)
        store.update()
        expected = store.export()
        gate = threading.Event()
        store._writer._executor.submit(gate.wait)  # hold the writer so the next checkpoint queues
        future = store.checkpoint(3, wait=False)
        assert store._writer.frozen.any()
        loc = store.prefetch(ids)
        store.push(loc, torch.full((loc.num_unique, DIM), 5.0))
        store.update()  # touches frozen rows: their images are saved first
        assert (store._writer.cow_saved >= 0).any()
        gate.set()
        assert future.result()["step"] == 3
    with open_store(tmp_path / "s") as store:
        got = store.export()
    np.testing.assert_array_equal(got[0], expected[0])
    assert got[1].tobytes() == expected[1].tobytes()


def test_saved_index_is_used_and_checked(store_dir):
    path, (ids, _) = store_dir
    info = inspect_store(path)["saved_index"]
    assert info is not None and info["rows"] <= ids.size
    with open_store(path) as store:
        np.testing.assert_array_equal(store.lookup_rows(ids), np.arange(ids.size))
    index_file = path / f"index-{info['epoch']}.bin"
    data = bytearray(index_file.read_bytes())
    data[-5] ^= 0x01
    index_file.write_bytes(bytes(data))
    with pytest.raises(StoreError, match="index file is corrupted"):
        open_store(path)


def test_background_checkpoint_while_the_cache_grows(tmp_path):
    """A checkpoint in flight while prefetches grow the cache and updates touch frozen rows
    commits exactly the rows as they were at its step."""
    import threading

    import torch

    cfg = StoreConfig(dim=DIM, chunk_rows=8)
    ids = np.arange(40) * 7919 - 50
    with EmbeddingStore.create(tmp_path / "s", cfg) as store:
        train(store, range(4))
        store.checkpoint(3)
        loc = store.prefetch(ids)
        store.push(loc, store.pull(loc) * 0.5)
        store.update()
        expected = store.export()
        gate = threading.Event()
        store._writer._executor.submit(gate.wait)  # hold the writer: the checkpoint below waits
        future = store.checkpoint(4, wait=False)
        for k in range(3):  # new ids grow the slab under the frozen rows
            loc = store.prefetch(np.concatenate([ids, np.arange(100) + 10**12 * (k + 1)]))
            store.push(loc, torch.full((loc.num_unique, DIM), 2.0))
            store.update()
        assert store._writer.cow_pool.shape[0] >= ids.size  # grown while saving the frozen images
        gate.set()
        assert future.result()["step"] == 4
    with open_store(tmp_path / "s", verify=True) as store:
        got = store.export()
    np.testing.assert_array_equal(got[0], expected[0])
    assert got[1].tobytes() == expected[1].tobytes()


def test_order_by_row_sorts_distinct_rows():
    from trainer.store import _kernels as K

    rows = np.random.default_rng(3).permutation(1000)[:300].astype(np.int64)
    order = K.order_by_row(rows, 1000)
    np.testing.assert_array_equal(rows[order], np.sort(rows))


def _sorted_export(store: EmbeddingStore) -> tuple[bytes, bytes]:
    ids, values = store.export()
    order = np.argsort(ids)
    return ids[order].tobytes(), values[order].tobytes()


def test_open_rolls_back_one_checkpoint_until_a_row_is_written(tmp_path):
    """A trainer with several stores reopens each at the step of its dense checkpoint: a store
    that committed one checkpoint later (a crash in between) rolls back to it."""
    path = tmp_path / "s"
    cfg = StoreConfig(dim=DIM, optimizer="rowwise_adagrad", chunk_rows=8, cache_rows=200)
    with EmbeddingStore.create(path, cfg) as store:
        train(store, range(5))
        store.checkpoint(4)
        at_4 = _sorted_export(store)
        train(store, range(5, 10))  # new ids too: the later checkpoint has more rows
        store.checkpoint(9)
        at_9 = _sorted_export(store)
    assert len(at_4[0]) < len(at_9[0]) and (path / "PREVIOUS").exists()
    assert inspect_store(path)["previous_checkpoint_step"] == 4
    with open_store(path, step=4, cache_rows=200) as store:
        assert _sorted_export(store) == at_4 and store.stats().last_checkpoint_step == 4
        train(store, range(5, 10))  # the same steps again: the same rows
        store.checkpoint(9)
        assert _sorted_export(store) == at_9
    with open_store(path, step=9, cache_rows=200) as store:
        assert _sorted_export(store) == at_9
    with pytest.raises(StoreError, match="not of step 3"):
        open_store(path, step=3)


@pytest.mark.parametrize("write", ["eviction", "checkpoint"])
def test_roll_back_is_refused_once_a_row_was_written(tmp_path, write):
    path = tmp_path / "s"
    cfg = StoreConfig(dim=DIM, chunk_rows=8, cache_rows=40, pin_window=1)
    with EmbeddingStore.create(path, cfg) as store:
        train(store, range(3))
        store.checkpoint(2)
        train(store, range(3, 6))
        store.checkpoint(5)
        written = store.stats().written_back
        train(store, range(6, 9))
        if write == "checkpoint":
            store.checkpoint(8)
        assert store.stats().written_back > written  # evictions (or the checkpoint) wrote rows
    assert not (path / "PREVIOUS").exists() or write == "checkpoint"
    with pytest.raises(StoreError, match="not of step 2"):
        open_store(path, step=2, cache_rows=40, pin_window=1)
    if write == "checkpoint":  # the checkpoint of step 5 is the one kept now
        with open_store(path, step=5, cache_rows=40, pin_window=1) as store:
            assert store.stats().last_checkpoint_step == 5
    leftovers = {p.name for p in path.iterdir() if p.name.startswith(("copies-", "hot-"))}
    assert len(leftovers) <= 2  # the files of at most two checkpoints are kept


def test_a_damaged_previous_record_blocks_only_the_roll_back(tmp_path):
    path = tmp_path / "s"
    with EmbeddingStore.create(path, StoreConfig(dim=DIM, chunk_rows=8)) as store:
        train(store, range(3))
        store.checkpoint(2)
        train(store, range(3, 6))
        store.checkpoint(5)
        at_5 = _sorted_export(store)
    (path / "PREVIOUS").write_text((path / "PREVIOUS").read_text().replace('"step"', '"stepp"'))
    with open_store(path) as store:  # the last checkpoint does not need it
        assert _sorted_export(store) == at_5
    with pytest.raises(StoreError, match=r"PREVIOUS.*corrupted"):
        open_store(path, step=2)


def test_a_second_checkpoint_of_the_same_state_commits_nothing(tmp_path):
    """Checkpointing a step already committed, with nothing changed, keeps the roll-back point."""
    path = tmp_path / "s"
    with EmbeddingStore.create(path, StoreConfig(dim=DIM, chunk_rows=8)) as store:
        train(store, range(3))
        store.checkpoint(2)
        train(store, range(3, 6))
        first = store.checkpoint(5).result()
        again = store.checkpoint(5).result()
        assert again["already_committed"] and again["rows_written"] == 0
        assert again["epoch"] == first["epoch"] and store.stats().checkpoints == 2
        at_5 = _sorted_export(store)
        train(store, range(6, 7))
        assert store.checkpoint(6).result()["epoch"] == first["epoch"] + 1  # a change commits
    log = (path / "checkpoints.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in log] == [2, 5, 6]
    with open_store(path, step=5) as store:  # the roll-back point survived the repeat
        assert _sorted_export(store) == at_5


# -- damage a store must survive: nothing an open or an inspection does may change a file ----


def _digest(path) -> dict[str, tuple[int, str]]:
    """Size and sha256 of every file of a store directory."""
    import hashlib

    return {
        p.name: (p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest())
        for p in sorted(path.iterdir())
    }


def test_inspecting_verifying_and_opening_write_nothing(store_dir, capsys):
    """Work after the last checkpoint left new rows in new chunks of rows.bin (evictions) and
    ids past the committed ones in ids.bin (a checkpoint that never committed): inspection,
    --verify and opening (plain, verified) leave every byte of every file as it was (they used
    to cut rows.bin and ids.bin to the committed rows)."""
    path, (ids, _) = store_dir
    with open_store(path, cache_rows=40, pin_window=1) as store:
        for k in range(4):  # new ids: rows past the committed chunks, evicted to rows.bin
            loc = store.prefetch(np.arange(30) + 10**9 * (k + 1))
            store.push(loc, store.pull(loc))
            store.update()
    with open(path / "ids.bin", "ab") as f:
        f.write(np.arange(3, dtype=np.int64).tobytes())
    before = _digest(path)
    assert before["rows.bin"][0] > inspect_store(path)["rows"] * 2 * (DIM + 2) * 4
    assert main(["store", str(path), "--verify", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["verified_rows"] == ids.size
    assert main(["store", str(path)]) == 0
    open_store(path, cache_rows=40, pin_window=1).close()
    open_store(path, cache_rows=40, pin_window=1, verify=True).close()
    assert _digest(path) == before


def test_a_store_without_its_commit_record_is_refused_and_left_intact(store_dir, capsys):
    """`rm S/CURRENT` used to make `recpipe store S --verify` print "verified 0 rows", exit 0 and
    truncate rows.bin and ids.bin to 0 bytes, and open_store(S) an empty store at step -1."""
    path, _ = store_dir
    (path / "CURRENT").unlink()
    before = _digest(path)
    for argv in (["store", str(path), "--verify"], ["store", str(path)]):
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert str(path) in err and "no commit record: CURRENT is missing" in err
        assert "ids.bin" in err and "Nothing was changed" in err
    with pytest.raises(StoreError, match="no commit record: CURRENT is missing"):
        open_store(path)
    with pytest.raises(StoreError, match="no commit record"):
        inspect_store(path)
    with pytest.raises(StoreError, match="already holds a store"):
        EmbeddingStore.create(path, StoreConfig(dim=DIM))
    assert _digest(path) == before
    assert before["rows.bin"][0] > 0 and before["ids.bin"][0] > 0


def test_a_store_that_never_committed_opens_empty(tmp_path):
    """Rows evicted before the first checkpoint (then a crash): nothing was committed, so the
    store opens empty at step -1, and its first checkpoint commits as usual."""
    path = tmp_path / "s"
    cfg = StoreConfig(dim=DIM, chunk_rows=8, cache_rows=40, pin_window=1)
    with EmbeddingStore.create(path, cfg) as store:
        train(store, range(5))
        assert store.stats().written_back > 0  # rows.bin holds uncommitted rows
    before = _digest(path)
    assert inspect_store(path)["last_checkpoint"]["step"] == -1
    with open_store(path, cache_rows=40, pin_window=1) as store:
        assert store.num_rows == 0 and store.stats().last_checkpoint_step == -1
        train(store, range(2))
        store.checkpoint(1)
        expected = store.export()
    assert before["rows.bin"][0] > 0
    with open_store(path, cache_rows=40, pin_window=1, verify=True) as store:
        got = store.export()
    np.testing.assert_array_equal(got[0], expected[0])
    assert got[1].tobytes() == expected[1].tobytes()


def test_store_files_without_meta_are_not_taken_for_a_new_store(store_dir):
    path, _ = store_dir
    (path / "meta.json").unlink()
    with pytest.raises(StoreError, match=r"holds store files \(.*ids\.bin.*\) but no meta\.json"):
        EmbeddingStore.create(path, StoreConfig(dim=DIM))


def test_torn_and_undecodable_log_lines_are_skipped_and_counted(store_dir, capsys):
    """`printf '\\xff\\n' >> S/checkpoints.jsonl; recpipe store S` ended in a raw
    UnicodeDecodeError; the log is informational, so bad lines are skipped and counted, and
    the next checkpoint's line is not glued to a torn one."""
    path, _ = store_dir
    log = path / "checkpoints.jsonl"
    good = len(log.read_text().splitlines())
    with open(log, "ab") as f:
        f.write(b"\xff\n5\n{}\n")
        f.write(b'{"step": 12, "epo')  # torn: the process died mid-line
    assert main(["store", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"checkpoints logged  {good} (4 unreadable lines skipped)" in out
    assert main(["store", str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["checkpoints"] == good and info["checkpoint_log_lines_skipped"] == 4
    with open_store(path, cache_rows=40, pin_window=1) as store:
        train(store, range(40, 42))
        store.checkpoint(41)
    info = inspect_store(path)
    assert info["checkpoints"] == good + 1 and info["checkpoint_log_lines_skipped"] == 4
    assert info["recent_checkpoints"][-1]["step"] == 41
