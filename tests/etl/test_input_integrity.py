"""Inputs that cannot be read whole, or change while a run reads them, stop `etl build` and
`etl shard`: nothing is built from part of the input or from bytes its manifest does not record.

Regression tests of issue 33 (each failed before its fix): an unreadable subdirectory was
skipped silently (``Path.rglob`` swallows ``PermissionError``), so a build or shard exited 0
with half the rows (item 14); an input truncated while being read lost rows with exit 0 while
the manifest recorded the whole file's size and sha256, computed on another thread (item 15).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

import etl.build.driver
import etl.rawio
from recpipe_cli import main

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = """
[dataset]
name = "integrity"
[[dense]]
name = "user_age"
[[sparse]]
name = "item_id"
kind = "item"
max_len = 8
"""
_CAP_DAC_OVERRIDE, _CAP_DAC_READ_SEARCH, _PR_CAPBSET_DROP = 1, 2, 24


def _records(first: int, n: int) -> list[dict]:
    return [
        {
            "request_id": f"r{i}",
            "ts": 1_000 + i,
            "session_id": f"s{i // 10}",
            "dense": {"user_age": 30.0},
            "sparse": {"item_id": [i % 7, 1]},
        }
        for i in range(first, first + n)
    ]


def _jsonl(path: Path, records: list[dict], *, zst: bool = False) -> Path:
    data = b"".join(json.dumps(r).encode() + b"\n" for r in records)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(zstandard.ZstdCompressor().compress(data) if zst else data)
    return path


@pytest.fixture
def schema(tmp_path) -> str:
    path = tmp_path / "schema.toml"
    path.write_text(SCHEMA)
    return str(path)


def _argv(command: str, inputs: list[str], out: Path, schema: str) -> list[str]:
    if command == "validate":
        return ["etl", "validate", *inputs, "--schema", schema]
    common = [*inputs, "--out", str(out), "--schema", schema, "--quiet"]
    if command == "shard":
        return ["etl", "shard", *common, "--num-shards", "2"]
    return ["etl", "build", *common]


def one_line_error(err: str, *names: str) -> None:
    """``err`` (stderr) holds one error line, naming each of ``names``, and no traceback."""
    assert "Traceback" not in err, err
    lines = [line for line in err.strip().splitlines() if "error:" in line]
    assert len(lines) == 1, err
    for name in names:
        assert name in lines[0], err


# --- item 14: an unreadable directory or file under an input ------------------------------------


def _without_root_privilege() -> None:
    """In the child: drop the capabilities that let root read any file (chmod then applies)."""
    if os.geteuid() != 0:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (_CAP_DAC_OVERRIDE, _CAP_DAC_READ_SEARCH):
        if libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            os._exit(77)


def _run_unprivileged(argv: list[str]) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "recpipe_cli", *argv],
        preexec_fn=_without_root_privilege,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        check=False,
    )
    if proc.returncode == 77:
        pytest.skip("cannot drop root's file-access capabilities here (no CAP_SETPCAP)")
    return proc


@pytest.fixture
def unreadable(tmp_path):
    """``logs/`` with a readable file and an unreadable subdirectory holding another."""
    logs = tmp_path / "logs"
    _jsonl(logs / "a.jsonl", _records(0, 50))
    _jsonl(logs / "sub" / "b.jsonl", _records(50, 50))
    (logs / "sub").chmod(0)
    yield logs
    (logs / "sub").chmod(0o755)


@pytest.mark.parametrize("command", ["build", "shard", "validate"])
@pytest.mark.parametrize("given", ["dir", "glob"])
def test_an_unreadable_subdirectory_is_an_error_naming_it(
    tmp_path, unreadable, schema, command, given
):
    inputs = [str(unreadable)] if given == "dir" else [str(unreadable / "*" / "*.jsonl")]
    proc = _run_unprivileged(_argv(command, inputs, tmp_path / "out", schema))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    one_line_error(proc.stderr, str(unreadable / "sub"), "cannot read")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["build", "shard"])
def test_an_unreadable_input_file_is_an_error_naming_it(tmp_path, schema, command):
    logs = tmp_path / "logs"
    _jsonl(logs / "a.jsonl", _records(0, 50))
    secret = _jsonl(logs / "b.jsonl", _records(50, 50))
    secret.chmod(0)
    proc = _run_unprivileged(_argv(command, [str(logs)], tmp_path / "out", schema))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    one_line_error(proc.stderr, str(secret), "cannot read")


def test_a_readable_tree_still_builds_whole_unprivileged(tmp_path, schema):
    logs = tmp_path / "logs"
    _jsonl(logs / "a.jsonl", _records(0, 50))
    _jsonl(logs / "sub" / "b.jsonl", _records(50, 50))
    proc = _run_unprivileged([*_argv("build", [str(logs)], tmp_path / "out", schema), "--json"])
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["rows_out"] == 100


def test_glob_expansion_is_globs_but_strict(tmp_path):
    """The strict glob finds what :func:`glob.glob` finds (hidden names, ``**``, classes)."""
    import glob

    root = tmp_path / "g"
    for rel in ("x.jsonl", "a/y.jsonl", "a/b/z.jsonl", ".h/h.jsonl", "_u/u.jsonl", "c/w.txt"):
        _jsonl(root / rel, [])
    (root / "c" / "link").symlink_to(root / "a", target_is_directory=True)
    for pattern in ("*.jsonl", "**/*.jsonl", "**", "*/*.jsonl", "?/y.jsonl", ".*", "[ab]/*"):
        want = sorted({Path(p) for p in glob.glob(str(root / pattern), recursive=True)})
        assert etl.rawio._glob(str(root / pattern)) == want, pattern


# --- item 15: an input that changes while it is read -------------------------------------------


def _cut_after_first_read(monkeypatch) -> None:
    """Every JSON Lines input is cut to half its size once its first bytes have been read."""
    real = etl.rawio._iter_chunks

    def cutting(path, size=1 << 20):
        chunks = real(path, 4096)
        first = next(chunks, None)
        os.truncate(path, os.path.getsize(path) // 2)
        if first is not None:
            yield first
        yield from chunks

    monkeypatch.setattr(etl.rawio, "_iter_chunks", cutting)


@pytest.mark.parametrize(
    ("command", "engine"), [("build", "duckdb"), ("build", "polars"), ("shard", None)]
)
@pytest.mark.parametrize("zst", [False, True])
def test_an_input_cut_while_it_is_read_is_an_error(
    tmp_path, schema, monkeypatch, capsys, command, engine, zst
):
    name = "a.jsonl.zst" if zst else "a.jsonl"
    src = _jsonl(tmp_path / "logs" / name, _records(0, 2_000), zst=zst)
    _cut_after_first_read(monkeypatch)
    argv = _argv(command, [str(src)], tmp_path / "out", schema)
    assert main([*argv, *(["--engine", engine] if engine else [])]) == 1
    err = capsys.readouterr().err
    one_line_error(err, str(src), "changed")
    assert not (tmp_path / "out").exists()


def _replace_after_parse(monkeypatch, path: Path, data: bytes) -> None:
    """Once the build has parsed its inputs, put ``data`` (same size, other bytes) in place of
    ``path`` (deterministic: the parse is over, the manifest not yet written)."""
    real = etl.build.driver._combine

    def replace_then_combine(*args, **kwargs):
        tmp = path.with_name(".swap")
        tmp.write_bytes(data)
        os.replace(tmp, path)
        return real(*args, **kwargs)

    monkeypatch.setattr(etl.build.driver, "_combine", replace_then_combine)


@pytest.mark.parametrize("engine", ["duckdb", "polars"])
@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_an_input_replaced_during_the_build_is_an_error(
    tmp_path, schema, monkeypatch, capsys, engine, fmt
):
    logs = tmp_path / "logs"
    if fmt == "jsonl":
        src = _jsonl(logs / "a.jsonl", _records(0, 200))
        other = b"".join(json.dumps(r).encode() + b"\n" for r in _records(0, 200)[::-1])
    else:
        logs.mkdir()
        src = logs / "a.parquet"
        pq.write_table(pa.Table.from_pylist(_records(0, 200)), src)
        other_path = tmp_path / "other.parquet"
        pq.write_table(pa.Table.from_pylist(_records(0, 200)[::-1]), other_path)
        other = other_path.read_bytes()
    assert other != src.read_bytes()
    _replace_after_parse(monkeypatch, src, other)
    argv = [*_argv("build", [str(src)], tmp_path / "out", schema), "--engine", engine]
    assert main(argv) == 1
    one_line_error(capsys.readouterr().err, str(src), "changed")
    assert not (tmp_path / "out").exists()


def test_the_manifest_records_the_bytes_parsed(tmp_path, schema, capsys):
    src = _jsonl(tmp_path / "logs" / "a.jsonl.zst", _records(0, 300), zst=True)
    assert main([*_argv("build", [str(src)], tmp_path / "out", schema), "--json"]) == 0
    manifest = json.loads(capsys.readouterr().out)
    data = src.read_bytes()
    assert manifest["inputs"] == [
        {"path": str(src), "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    ]
    assert manifest["rows_out"] == 300
