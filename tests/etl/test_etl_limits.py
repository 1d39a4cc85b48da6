"""`etl shard` and `etl build` against the machine's limits: open files, a full disk, options
that cannot work. Each ends in one line naming the path or the option, never a traceback, and
nothing already there is lost.

Regression tests of issue 33, item 17 (each failed before its fix): `etl shard --num-shards
2000` under a limit of 1,024 open files died with a raw `Too many open files` (one file held
open per shard); a full disk during a build or a shard ended in a raw `OSError` traceback;
`--spill-dir /proc/nope` and `--memory-limit 1KB` ended in raw tracebacks.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from recpipe_cli import main
from tests.etl.test_input_integrity import SCHEMA, one_line_error

ROOT = Path(__file__).resolve().parents[2]


def _logs(path: Path, n: int, *, sessions: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as fh:
        for i in range(n):
            rec = {
                "request_id": f"r{i}",
                "ts": 1_000 + i,
                "session_id": f"s{i % sessions}",
                "dense": {"user_age": float(i % 90)},
                "sparse": {"item_id": [i % 13, i % 7, 1]},
                "pad": "x" * 200,
            }
            fh.write(json.dumps(rec) + "\n")
    return path


@pytest.fixture
def schema(tmp_path) -> str:
    path = tmp_path / "schema.toml"
    path.write_text(SCHEMA)
    return str(path)


# --- open files -----------------------------------------------------------------------------

_FILES_LIMIT = 128


def _few_open_files() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (_FILES_LIMIT, _FILES_LIMIT))


def test_shard_writes_more_shards_than_it_may_open_files(tmp_path, schema):
    shards = 3 * _FILES_LIMIT
    logs = _logs(tmp_path / "logs" / "a.jsonl", 2_000, sessions=1_000)
    out = tmp_path / "shards"
    argv = ["etl", "shard", str(logs), "--out", str(out), "--schema", schema]
    proc = subprocess.run(
        [sys.executable, "-m", "recpipe_cli", *argv, "--num-shards", str(shards), "--no-compare"],
        preexec_fn=_few_open_files,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((out / "_shard.json").read_text())
    assert report["lines_routed"] == 2_000 and len(report["lines_per_shard"]) == shards
    assert len(list(out.glob("shard-*.jsonl.zst"))) == shards
    # the shards hold every line, each once
    assert main(["etl", "build", str(out), "--out", str(tmp_path / "ds"), "--schema", schema,
                 "--quiet"]) == 0  # fmt: skip
    manifest = json.loads((tmp_path / "ds" / "_manifest.json").read_text())
    assert manifest["rows_out"] == 2_000


# --- a full disk ----------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs (root only, where mounting is allowed), unmounted afterwards."""
    where = tmp_path / "disk"
    where.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(where)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {proc.stderr.strip() or proc.returncode}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=60, check=False)


def _fill(disk: Path, leave: int) -> None:
    """Fill ``disk`` but ``leave`` bytes."""
    import os

    st = os.statvfs(disk)
    free = st.f_bavail * st.f_frsize
    (disk / "filler").write_bytes(b"\0" * max(0, free - leave))


@pytest.mark.parametrize("command", ["build", "shard"])
def test_a_full_disk_is_one_line_and_the_old_output_is_kept(
    tmp_path, schema, small_disk, capsys, command
):
    small = _logs(tmp_path / "small" / "a.jsonl", 50, sessions=10)
    big = _logs(tmp_path / "big" / "a.jsonl", 20_000, sessions=5_000)
    out = small_disk / "out"
    base = ["etl", command, "--out", str(out), "--schema", schema, "--quiet"]
    assert main([*base, str(small)]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    capsys.readouterr()
    _fill(small_disk, leave=64 << 10)
    assert main([*base, str(big), "--overwrite"]) == 1
    one_line_error(capsys.readouterr().err, str(out), "No space left on device")
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler", "out"]


@pytest.mark.parametrize("command", ["build", "shard"])
def test_the_library_names_the_output_on_a_full_disk(tmp_path, small_disk, command):
    from etl.build import build
    from etl.shard import shard
    from recpipe.errors import RecpipeError
    from schemas import parse_schema

    logs = _logs(tmp_path / "big" / "a.jsonl", 20_000, sessions=5_000)
    _fill(small_disk, leave=64 << 10)
    run = build if command == "build" else shard
    with pytest.raises(RecpipeError, match="No space left on device") as got:
        run(logs, small_disk / "out", schema=parse_schema(SCHEMA))
    assert str(small_disk / "out") in str(got.value).splitlines()[0]
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler"]


def test_a_full_spill_dir_is_one_line_naming_it(tmp_path, schema, small_disk, capsys):
    logs = _logs(tmp_path / "logs" / "a.jsonl", 500, sessions=50)
    _fill(small_disk, leave=0)
    spill = small_disk / "spill"
    argv = ["etl", "build", str(logs), "--out", str(tmp_path / "ds"), "--schema", schema]
    argv += ["--memory-limit", "64MB", "--spill-dir", str(spill), "--quiet"]
    assert main(argv) == 1
    one_line_error(capsys.readouterr().err, str(spill), "No space left on device")
    assert not (tmp_path / "ds").exists() and not list(spill.iterdir())


# --- options that cannot work ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("option", "value", "name"),
    [
        ("--spill-dir", "/proc/nope", "spill"),
        ("--memory-limit", "1KB", "memory"),
        ("--memory-limit", "1MB", "memory"),
    ],
)
def test_a_spill_dir_or_memory_limit_that_cannot_work_is_one_line(
    tmp_path, schema, capsys, option, value, name
):
    logs = _logs(tmp_path / "logs" / "a.jsonl", 50, sessions=10)
    argv = ["etl", "build", str(logs), "--out", str(tmp_path / "ds"), "--schema", schema]
    try:
        code = main([*argv, option, value, "--quiet"])
    except SystemExit as exc:  # a value the parser refuses: usage and one error line
        code = exc.code
    assert code not in (0, None)
    err = capsys.readouterr().err
    one_line_error(err, value)
    assert name in err.split("error:")[1].split("\n")[0].replace("_", "-")
    assert not (tmp_path / "ds").exists()
