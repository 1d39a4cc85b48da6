"""The Makefile: `make help` lists every target and knob; `make clean` never touches data/."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAKEFILE = ROOT / "Makefile"

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def _make(*args: str, cwd: Path = ROOT) -> str:
    out = subprocess.run(
        ["make", "--no-print-directory", "-f", str(MAKEFILE), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return out.stdout


def test_help_lists_every_target_and_knob():
    text = MAKEFILE.read_text()
    phony = re.search(r"^\.PHONY:(.*)$", text, re.M).group(1).split()
    knobs = re.findall(r"^([A-Z][A-Z_]*) \?=", text, re.M)
    assert {"clean", "format", "help", "test", "lint"} <= set(phony)
    assert {"REQUESTS", "SHARDS", "PORT", "OUT"} <= set(knobs)
    out = _make("help")
    targets, _, knob_part = out.partition("knobs (make")
    for target in phony:
        assert re.search(rf"^\s+{target}\s", targets, re.M), f"`make help` misses {target}"
    for knob in knobs:
        if knob == "NUMBA_CACHE_DIR":
            continue
        assert re.search(rf"^\s+{knob}\s", knob_part, re.M), f"`make help` misses {knob}"


def test_clean_removes_only_what_the_project_made(tmp_path):
    mine = tmp_path / "data" / "my_logs" / "part-0.jsonl"
    demo = tmp_path / "data" / "demo"
    cache = tmp_path / ".numba_cache" / "x.nbi"
    pycache = tmp_path / "pkg" / "__pycache__" / "m.pyc"
    for path in (mine, demo / "dataset" / "part-00000.parquet", demo / "notes.txt", cache, pycache):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x")
    _make("clean", cwd=tmp_path)
    assert mine.exists() and (demo / "dataset").exists()
    assert not cache.exists() and not pycache.parent.exists()
    _make("clean-demo", cwd=tmp_path)
    assert mine.exists(), "clean-demo must not touch the user's data"
    assert not (demo / "dataset").exists()
    assert (demo / "notes.txt").exists(), "clean-demo removes only what `make demo` wrote"
