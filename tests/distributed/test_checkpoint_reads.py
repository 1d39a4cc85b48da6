"""A resume reads only what each rank now owns: rank files keep their rows by owner bucket, and
a rank at any world size reads of each file the byte ranges of its buckets (checked by crc32),
not every rank's whole file; checkpoints of the earlier layout (rows inside the ``.pt``) load."""

from __future__ import annotations

import json
from pathlib import Path

import dist_cases
import numpy as np
import pytest
import torch
from dist_harness import run_ranks

from recpipe.errors import RecpipeError
from trainer.checkpoint import save_checkpoint as save_state
from trainer.distributed.checkpoint import (
    SparseReads,
    bucket_modulus,
    read_checkpoint,
    read_part,
    save_parts,
)
from trainer.distributed.shard import owner_of

SAVED = 2  # ranks that wrote the checkpoint
TIMEOUT_S = 300


class _Rank:
    """What :func:`save_parts` needs of a rank's group, without one (rank files only)."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size

    def barrier(self, *, what: str) -> None:
        del what


def _table(rng: np.random.Generator, n: int, dim: int = 4) -> dict:
    """A table's saved rows with the fields a part may carry: values, a per-row state, a
    nested per-row state, a scalar and a ``None``."""
    ids = rng.choice(1 << 40, n, replace=False).astype(np.int64)
    return {"ids": torch.from_numpy(ids), "values": torch.randn(n, dim), "state": torch.rand(n),
            "moments": {"m": torch.randn(n, dim, dtype=torch.float64)}, "step": 7,
            "extra": None}  # fmt: skip


def _save(root: Path, parts: list[dict]) -> dict:
    for rank, rows in enumerate(parts):
        part = {"step": 3, "rank": rank, "world_size": len(parts), "rows": rows}
        save_parts(root, comm=_Rank(rank, len(parts)), area="sparse", step=3, part=part,
                   doc={"kind": "distributed", "step": 3, "world_size": len(parts)})  # fmt: skip
    return read_checkpoint(root)


def _read(root: Path, state: dict, rank: int, world: int) -> tuple[list[dict], SparseReads]:
    reads = SparseReads()
    parts = [read_part(root, state, "sparse", rank=r, world_size=state["world_size"],
                       owned=(rank, world), reads=reads)["rows"] for r in range(SAVED)]  # fmt: skip
    return parts, reads


def _merged(parts: list[dict], name: str) -> dict:
    ids = torch.cat([p[name]["ids"] for p in parts])
    order = torch.argsort(ids)
    return {"ids": ids[order], "values": torch.cat([p[name]["values"] for p in parts])[order],
            "state": torch.cat([p[name]["state"] for p in parts])[order],
            "m": torch.cat([p[name]["moments"]["m"] for p in parts])[order]}  # fmt: skip


@pytest.fixture
def saved(tmp_path):
    rng = np.random.default_rng(0)
    parts = [{"big": _table(rng, 4000), "small": _table(rng, 7), "empty": _table(rng, 0)}
             for _ in range(SAVED)]  # fmt: skip
    return tmp_path, _save(tmp_path, parts), parts


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 7])
def test_each_rank_reads_exactly_the_rows_it_owns(saved, world):
    """At every world size the ranks' rows are every saved row once, each on its owner, with
    every field as saved (any per-row field, nested ones too; scalars and ``None`` kept)."""
    root, state, written = saved
    got: list[dict] = []
    for rank in range(world):
        parts, _ = _read(root, state, rank, world)
        for part in parts:
            for entry in part.values():
                assert (owner_of(entry["ids"].numpy(), world) == rank).all()
                assert entry["step"] == 7 and entry["extra"] is None
        got += parts
    for name in ("big", "small", "empty"):
        want, have = _merged(written, name), _merged(got, name)
        for key in want:
            assert torch.equal(have[key], want[key]), (name, key)


def test_a_rank_reads_its_share_of_the_sparse_bytes(saved):
    """Resuming 2 -> 3 ranks: each rank reads the headers and its own rows' bytes, about a third
    of the rows (every rank read every rank file whole before)."""
    root, state, _ = saved
    folder = root / state["sparse"]
    total = sum(f.stat().st_size for f in folder.iterdir())
    headers = sum(f.stat().st_size for f in folder.iterdir() if f.suffix != ".rows")
    row_bytes = 8 + 4 * 4 + 4 + 8 * 4  # ids, values, state, moments.m
    assert bucket_modulus(4000) % 3 == 0 and bucket_modulus(7) == 1  # "small": one bucket
    for rank in range(3):
        parts, reads = _read(root, state, rank, 3)
        own = sum(int(p["big"]["ids"].numel()) for p in parts)
        assert reads.files == SAVED
        # the headers, exactly its own rows of "big", every row of "small" (a bucket of 7 rows)
        assert reads.bytes == headers + (own + SAVED * 7) * row_bytes
        assert reads.bytes < 0.5 * total


def test_a_damaged_rows_file_is_refused_by_name(saved):
    root, state, _ = saved
    data = root / state["sparse"] / "rank-00001-of-00002.rows"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    data.write_bytes(bytes(raw))
    with pytest.raises(
        RecpipeError,
        match=r"rank-00001-of-00002.rows: table 'big', bucket at rows \d+\.\.\d+: the bytes do not match their crc32",
    ):
        for rank in range(3):
            _read(root, state, rank, 3)
    data.unlink()
    with pytest.raises(
        RecpipeError, match=r"rank-00001-of-00002.rows: the checkpoint's rows are missing"
    ):
        _read(root, state, 0, 1)


def test_a_checkpoint_of_the_earlier_layout_still_loads(tmp_path):
    """Rows inside each rank's ``.pt`` (the layout before buckets): read whole, as before."""
    rng = np.random.default_rng(1)
    parts = [{"t": _table(rng, 50)} for _ in range(SAVED)]
    folder = tmp_path / "sparse" / "step-000000003"
    for rank, rows in enumerate(parts):
        save_state({"step": 3, "rank": rank, "world_size": SAVED, "rows": rows},
                   folder / f"rank-{rank:05d}-of-{SAVED:05d}.pt")  # fmt: skip
    state = {"step": 3, "world_size": SAVED, "sparse": "sparse/step-000000003"}
    got, reads = _read(tmp_path, state, 0, 3)
    assert reads.bytes == sum(f.stat().st_size for f in folder.iterdir())
    assert torch.equal(_merged(got, "t")["values"], _merged(parts, "t")["values"])


# -------------------------------------------------------------------------------------------
# a real resume: saved by 2 ranks, read by 3


def _save_at_two(rank: int, world: int, dataset: str, out: str) -> None:
    from trainer.distributed.checkpoint import save_checkpoint

    comm = dist_cases.subgroup_comm(world)
    trainer = dist_cases.build(dataset, "adagrad", comm, torch.float32)
    for batch in dist_cases.rank_batches(dataset, rank=rank, world=world, dedup=True, steps=2):
        trainer.train_step(batch)
    save_checkpoint(out, comm=comm, sparse=trainer.sparse, step=2, state={})


def _load_at_three(rank: int, world: int, dataset: str, out: str) -> None:
    from trainer.distributed.checkpoint import load_sparse

    comm = dist_cases.subgroup_comm(world)
    trainer = dist_cases.build(dataset, "adagrad", comm, torch.float32)
    reads = load_sparse(out, read_checkpoint(out), sparse=trainer.sparse)
    rows = {name: int(e["ids"].numel()) for name, e in trainer.sparse.owned_rows().items()}
    Path(out, f"read-{rank}.json").write_text(json.dumps({"bytes": reads.bytes, "rows": rows}))


@pytest.mark.slow
def test_a_resume_at_three_ranks_reads_less_than_the_checkpoint(dist_dataset, tmp_path):
    """2 ranks train and save; 3 ranks load their rows: each reads less than the checkpoint's
    sparse bytes (every rank read all of them before), and together they hold every row."""
    out = str(tmp_path)
    assert run_ranks(_save_at_two, 2, str(dist_dataset), out, timeout_s=TIMEOUT_S) == [0, 0]
    state = read_checkpoint(out)
    folder = tmp_path / state["sparse"]
    total = sum(f.stat().st_size for f in folder.iterdir())
    saved = dist_cases.checkpoint_tables(out)
    assert run_ranks(_load_at_three, 3, str(dist_dataset), out, timeout_s=TIMEOUT_S) == [0, 0, 0]
    reads = [json.loads((tmp_path / f"read-{r}.json").read_text()) for r in range(3)]
    for r in reads:
        assert r["bytes"] < total, (r["bytes"], total)
    for name, entry in saved.items():
        assert sum(r["rows"][name] for r in reads) == entry["ids"].numel()
