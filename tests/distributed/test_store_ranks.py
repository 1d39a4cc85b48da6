"""The hybrid store as each rank's shard (``recpipe train --nproc N --store hybrid``): every rank
keeps the rows it owns in stores of its own, read and written through by the 2FP exchange; the
job gives one process's per-step losses, checkpoints through the stores and resumes from them."""

from __future__ import annotations

import pytest  # noqa: F401

from tests.trainer.test_one_loop import BATCH, _train, data  # noqa: F401  (data: a fixture)

STORE = ["--store", "hybrid"]


def _close(a: list[float], b: list[float], tol: float = 1e-6) -> float:
    assert len(a) == len(b)
    worst = max(abs(x - y) for x, y in zip(a, b, strict=True))
    assert worst <= tol, worst
    return worst


def test_two_ranks_with_stores_train_as_one_process_with_a_store(data, tmp_path):  # noqa: F811
    """`--nproc 2 --store hybrid --batch-size B` gives the per-step losses of one process
    `--store hybrid --batch-size 2B` within 1e-6 (float32; exact dense gradients), with a hot
    set chosen after 4 counted steps; each rank's rows live in its own stores."""
    steps = 12
    one = _train(data, "one process", tmp_path / "one", "--steps", steps,
                 "--batch-size", 2 * BATCH, *STORE)  # fmt: skip
    two = _train(data, "2 ranks", tmp_path / "two", "--steps", steps, *STORE,
                 "--count-steps", 4, "--hot-rows", 64)  # fmt: skip
    assert one["losses"][0] == two["losses"][0]
    _close(one["losses"], two["losses"])
    for rank in range(2):
        folder = tmp_path / "two" / "store" / f"rank-{rank:05d}-of-00002"
        tables = sorted(p.name for p in folder.iterdir())
        assert tables and all((folder / t / "meta.json").exists() for t in tables)
