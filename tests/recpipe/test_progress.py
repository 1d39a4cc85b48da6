"""Progress bars: a live bar on a terminal, whole lines (no ``\\r`` frames) in a log."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from recpipe.progress import progress_bar

REPO = Path(__file__).resolve().parents[2]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _run(stream: io.StringIO, steps: int, **kwargs: object) -> str:
    bar = progress_bar(total=steps, desc="work", file=stream, **kwargs)
    for _ in range(steps):
        bar.update(1)
    bar.set_postfix(loss=0.5)
    bar.close()
    return stream.getvalue()


def test_a_log_gets_whole_lines_and_its_final_state():
    text = _run(io.StringIO(), 1000)
    assert "\r" not in text and "\x1b[" not in text
    lines = text.splitlines()
    assert len(lines) <= 3  # the start, (perhaps) one more, the end: not one per update
    assert lines[0].startswith("work:") and "1000/1000" in lines[-1] and "loss=0.5" in lines[-1]
    assert text.endswith("\n")


def test_the_log_interval_is_configurable(monkeypatch):
    monkeypatch.setenv("RECPIPE_PROGRESS_EVERY_S", "0")
    lines = _run(io.StringIO(), 5).splitlines()
    counts = [re.search(r"(\d)/5", line).group(1) for line in lines]
    assert counts[:6] == ["0", "1", "2", "3", "4", "5"]  # a line per update


def test_a_terminal_gets_the_live_bar_and_disable_writes_nothing():
    assert "\r" in _run(_Terminal(), 10)
    assert _run(io.StringIO(), 10, disable=True) == ""


@pytest.mark.slow
def test_a_command_writing_to_a_log_leaves_no_carriage_returns(tmp_path):
    """`recpipe etl shard` with stderr going to a file, as under nohup or in CI."""
    logs = tmp_path / "logs.jsonl"
    logs.write_text("".join(
        f'{{"request_id": "r{i}", "user_id": "u{i % 7}", "session_id": "s{i % 7}", "ts": {i}, '
        f'"dense": {{}}, "sparse": {{}}}}\n'
        for i in range(2000)
    ))  # fmt: skip
    env = {**os.environ, "RECPIPE_PROGRESS_EVERY_S": "0"}
    proc = subprocess.run(
        [sys.executable, "-m", "recpipe_cli", "etl", "shard", str(logs), "--out",
         str(tmp_path / "shards"), "--num-shards", "2"],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "shard" in proc.stderr and "\r" not in proc.stderr
