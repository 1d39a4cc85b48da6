"""Crash safety of `etl build`: SIGKILL mid-run leaves nothing that looks complete."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq

from etl.build import build

_CHILD = """
import sys
from etl.build import build
build(sys.argv[1:-1], sys.argv[-1], progress=True)
"""


def test_sigkill_mid_build_leaves_no_dataset_and_next_run_succeeds(clean_synth_logs, tmp_path):
    out = tmp_path / "dataset"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    args = [str(p) for p in clean_synth_logs.features]
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, *args, str(out)],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        env=env,
        cwd=Path(__file__).resolve().parents[2],
    )
    # the first progress bar appears once the temporary directory exists and parsing starts
    assert proc.stderr is not None
    seen = b""
    while b"parse features" not in seen:
        chunk = proc.stderr.read1(4096)
        assert chunk, f"build ended before it was killed: {seen[-2000:]!r}"
        seen += chunk
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    assert not out.exists()
    stale = list(tmp_path.glob(".dataset.tmp-*"))
    assert stale and not any((s / "_manifest.json").exists() for s in stale)

    m = build(clean_synth_logs.features, out)
    assert (out / "_manifest.json").is_file()
    assert not list(tmp_path.glob(".dataset.tmp-*"))  # the stale directory was removed
    assert pq.ParquetDataset(sorted(out.glob("part-*.parquet"))).read().num_rows == m["rows_out"]
