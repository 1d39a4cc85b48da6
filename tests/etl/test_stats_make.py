"""`make demo`'s stats measure the dedup factors at the batch size `make train` trains with
(issue 32 item 7: the stats proposed groups for B=4096 while the training ran at B=1024)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def _batch_sizes(*knobs: str) -> dict[str, str]:
    """`--batch-size` of the `recpipe stats` and `recpipe train` commands `make -n demo` runs."""
    out = subprocess.run(
        ["make", "--no-print-directory", "-n", "demo", *knobs],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    found = {}
    for cmd in ("stats", "train"):
        line = re.search(rf"recpipe {cmd} .*$", out, re.M)
        assert line, f"`make -n demo` runs no `recpipe {cmd}`:\n{out}"
        size = re.search(r"--batch-size (\S+)", line.group(0))
        found[cmd] = size.group(1) if size else "stats' default"
    return found


@pytest.mark.parametrize("knobs", [(), ("BATCH=512",)])
def test_demo_stats_use_the_training_batch_size(knobs):
    sizes = _batch_sizes(*knobs)
    assert sizes["stats"] == sizes["train"], sizes
    if knobs:
        assert sizes["train"] == "512"
