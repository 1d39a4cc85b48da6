"""`etl.stats`: duplication statistics on hand-made Parquet datasets whose numbers are known."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from etl.stats import compute_stats, dataset_files, dedupe_factor_model
from recpipe.errors import CorruptInputError, DataError, SchemaError
from schemas import DatasetSchema, DenseFeature, SparseFeature

LIST = pa.list_(pa.int64())

SCHEMA = DatasetSchema(
    name="tiny",
    dense=(DenseFeature("age"),),
    sparse=(
        SparseFeature("hist", "user", 8),
        SparseFeature("seller", "user", 8),
        SparseFeature("item", "item", 1),
    ),
)

# session_id, ts, age, hist, seller, item — in file order.
TINY = [
    (0, 1, 30.0, [1, 2], [5], [10]),
    (0, 2, 30.0, [1, 2], [5], [11]),
    (0, 3, 30.0, [1, 2, 3], [6], [12]),  # hist: append
    (0, 4, 30.0, [9], [7], [13]),
    (1, 5, 40.0, [4, 5, 6], [8], [10]),
    (1, 6, 41.0, [5, 6, 7], [9], [10]),  # hist: slide left
]


def _table(rows: list[tuple], schema: DatasetSchema = SCHEMA) -> pa.Table:
    cols = list(zip(*rows))
    data = {
        "session_id": pa.array(cols[0], pa.int64()),
        "ts": pa.array(cols[1], pa.int64()),
        "label": pa.array([0.0] * len(rows), pa.float32()),
    }
    for i, name in enumerate(schema.feature_names, start=2):
        kind = pa.float32() if name in schema.dense_names else LIST
        data[name] = pa.array(cols[i], kind)
    return pa.table(data, schema=schema.arrow_schema())


def _write(root: Path, rows: list[tuple], *, splits: tuple[int, ...] = (), **kwargs) -> Path:
    """Write ``rows`` as ``part-NNNNN.parquet`` files cut at ``splits`` (file order kept)."""
    root.mkdir(parents=True, exist_ok=True)
    table = _table(rows, **kwargs)
    bounds = [0, *splits, len(rows)]
    for i, (lo, hi) in enumerate(itertools.pairwise(bounds)):
        pq.write_table(table.slice(lo, hi - lo), root / f"part-{i:05d}.parquet")
    return root


def test_tiny_dataset_exact_numbers(tmp_path):
    root = _write(tmp_path / "ds", TINY, splits=(3,))
    report = compute_stats(root, schema=SCHEMA, batch_size=4)

    assert report.rows == 6 and report.files == 2
    assert report.sessions.sessions == 2
    assert report.sessions.mean == 3.0 and report.sessions.max == 4
    assert report.sessions.histogram == ((2, 4, 1, 2), (4, 8, 1, 4))
    # batches [rows 0-3: session 0], [rows 4-5: session 1] -> 2 (batch, session) pairs
    assert report.batches == 2
    assert report.samples_per_batch_session == 3.0

    age, hist, seller, item = (report.feature(n) for n in ("age", "hist", "seller", "item"))
    assert (age.rows_with_prev, age.exact_duplicates) == (4, 3)
    assert age.d == 0.75 and age.exact_pct == 75.0
    assert age.measured_factor == 6 / 3  # batch 0: {30}, batch 1: {40, 41}
    assert age.model_factor == pytest.approx(1 / (1 - 2 / 3 * 0.75))

    assert (hist.exact_duplicates, hist.partial_duplicates) == (1, 2)
    assert hist.partial_pct == 50.0
    assert hist.values == 14 and hist.avg_len == pytest.approx(14 / 6)
    assert hist.unique_values == 12  # batch 0: [1,2] [1,2,3] [9]; batch 1: both lists
    assert hist.measured_factor == pytest.approx(14 / 12)

    assert (seller.exact_duplicates, seller.partial_duplicates) == (1, 0)
    assert item.exact_duplicates == 1 and item.measured_factor == pytest.approx(6 / 5)
    total = 4 * 6 + 8 * (14 + 6 + 6)
    assert hist.logical_bytes == 8 * 14 and hist.byte_share == pytest.approx(8 * 14 / total)
    assert age.byte_share == pytest.approx(4 * 6 / total)
    assert hist.parquet_bytes > 0
    assert seller.unique_values == 5 and item.unique_values == 5
    assert report.sparse_factor == pytest.approx((14 + 6 + 6) / (12 + 5 + 5))

    # nothing sparse reaches 1.5x; dense `age` (2x) is never proposed: [dedup] holds sparse only
    assert report.proposed_features == [] and report.proposed_groups == []


def test_dedupe_factor_model():
    assert dedupe_factor_model(0.0, 16.0) == 1.0
    assert dedupe_factor_model(0.8, 1.0) == 1.0
    assert dedupe_factor_model(1.0, 4.0) == pytest.approx(
        4.0
    )  # all duplicates: one row per session
    assert dedupe_factor_model(0.8, 16.5) == pytest.approx(1 / (1 - 15.5 / 16.5 * 0.8))


def _grouping_rows() -> list[tuple]:
    """a and b change on the same rows (always together), c changes on other rows."""
    rows = []
    for sid in range(4):
        for k in range(6):
            ab = [100 + sid * 10 + k // 2]  # changes every 2nd row
            c = [200 + sid * 10 + (k + 1) // 3]  # changes on rows 2, 5
            rows.append((sid, sid * 100 + k, 1.0, ab, [7, *ab], c))
    return rows


GROUP_SCHEMA = DatasetSchema(
    name="groups",
    dense=(DenseFeature("x"),),
    sparse=(
        SparseFeature("a", "user", 4),
        SparseFeature("b", "user", 4),
        SparseFeature("c", "user", 4),
    ),
)


def test_groups_features_that_change_together(tmp_path):
    root = _write(tmp_path / "ds", _grouping_rows(), schema=GROUP_SCHEMA)
    report = compute_stats(root, schema=GROUP_SCHEMA, batch_size=24)

    # per session of 6: a/b change at k=2,4 (exact 3 of 5), c changes at k=2,5 (exact 3 of 5)
    for name in "abc":
        assert report.feature(name).exact_duplicates == 4 * 3
    assert report.samples_per_batch_session == 6.0
    assert report.feature("a").measured_factor == pytest.approx(24 / 12)
    assert report.feature("b").measured_factor == pytest.approx(48 / 24)
    assert report.proposed_features == ["a", "b", "c"]
    assert report.jaccard["a"]["b"] == 1.0
    assert report.jaccard["a"]["c"] == pytest.approx(4 / 12)  # k=2 shared, k=4 vs k=5 not
    assert report.proposed_groups == [("a", "b"), ("c",)]
    assert report.dedup_toml() == '[dedup]\ngroups = [["a", "b"], ["c"]]\n'
    # the snippet is a valid [dedup] table for the dataset's schema
    from schemas import parse_schema

    text = GROUP_SCHEMA.to_toml() + "\n" + report.dedup_toml()
    assert parse_schema(text).dedup_groups == (("a", "b"), ("c",))


def test_time_ordered_collapses_measured_factor(tmp_path):
    rows = _grouping_rows()
    clustered = compute_stats(
        _write(tmp_path / "c", rows, schema=GROUP_SCHEMA), schema=GROUP_SCHEMA, batch_size=4
    )
    # the same rows in time order, sessions interleaved (one sample of each session per batch)
    by_time = sorted(rows, key=lambda r: (r[1] % 100, r[0]))
    by_time = [(r[0], (r[1] % 100) * 10 + r[0], *r[2:]) for r in by_time]
    timed = compute_stats(
        _write(tmp_path / "t", by_time, schema=GROUP_SCHEMA), schema=GROUP_SCHEMA, batch_size=4
    )

    assert timed.samples_per_batch_session == 1.0
    assert clustered.samples_per_batch_session == 3.0  # 24 rows in 8 (batch, session) pairs
    for name in "abc":
        # duplication of the data itself does not depend on the file order ...
        assert timed.feature(name).d == clustered.feature(name).d
        # ... but only clustered batches can exploit it
        assert timed.feature(name).measured_factor == 1.0
        assert timed.feature(name).model_factor == 1.0
        assert clustered.feature(name).measured_factor > 1.5
    assert timed.proposed_groups == []
    assert timed.sparse_factor == 1.0 and clustered.sparse_factor > 1.5
    assert "S = 1.00" in timed.format_table() and "cannot pay" in timed.format_table()
    assert "cannot pay" not in clustered.format_table()


# --- a plain-Python reference on random datasets ----------------------------------------------


def _one_step(prev: list[int], cur: list[int]) -> bool:
    lp, lc = len(prev), len(cur)
    if lp >= 1 and lc == lp + 1 and (cur[:lp] == prev or cur[1:] == prev):
        return True
    return lp >= 2 and lc == lp and (cur[:-1] == prev[1:] or cur[1:] == prev[:-1])


def _reference(rows: list[tuple], schema: DatasetSchema, batch_size: int) -> dict:
    order = sorted(range(len(rows)), key=lambda i: (rows[i][0], rows[i][1], i))
    prev_of: dict[int, int] = {}
    for a, b in itertools.pairwise(order):
        if rows[a][0] == rows[b][0]:
            prev_of[b] = a
    pairs = {(i // batch_size, r[0]) for i, r in enumerate(rows)}
    out = {"S": len(rows) / len(pairs)}
    for col, name in enumerate(schema.feature_names, start=2):
        dense = name in schema.dense_names
        exact = partial = 0
        for i, p in prev_of.items():
            cur, prev = rows[i][col], rows[p][col]
            if cur == prev:
                exact += 1
            elif not dense and _one_step(prev, cur):
                partial += 1
        size = (lambda v: 1) if dense else len
        unique = {
            (i // batch_size, v if dense else tuple(v)) for i, v in enumerate(r[col] for r in rows)
        }
        values = sum(size(r[col]) for r in rows)
        stored = sum(1 if dense else len(v) for _, v in unique)
        out[name] = {
            "exact": exact,
            "partial": partial,
            "values": values,
            "measured": values / stored if stored else 1.0,
        }
    return out


@st.composite
def _random_rows(draw):
    sessions = draw(st.integers(1, 5))
    rows = []
    for sid in range(sessions):
        n = draw(st.integers(1, 7))
        ts = sorted(draw(st.lists(st.integers(0, 20), min_size=n, max_size=n)))  # ties allowed
        for t in ts:
            lists = [draw(st.lists(st.integers(1, 3), max_size=3)) for _ in range(3)]
            rows.append((sid, t, float(draw(st.integers(0, 2))), *lists))
    perm = draw(st.permutations(range(len(rows))))
    return [rows[i] for i in perm]


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(rows=_random_rows(), batch_size=st.integers(1, 9), cut=st.integers(0, 40))
def test_matches_python_reference(tmp_path_factory, rows, batch_size, cut):
    root = tmp_path_factory.mktemp("ds")
    splits = (cut,) if 0 < cut < len(rows) else ()
    _write(root, rows, splits=splits)
    report = compute_stats(root, schema=SCHEMA, batch_size=batch_size, threads=1)
    ref = _reference(rows, SCHEMA, batch_size)

    assert report.samples_per_batch_session == pytest.approx(ref["S"])
    for name in SCHEMA.feature_names:
        got, want = report.feature(name), ref[name]
        assert got.exact_duplicates == want["exact"], name
        assert got.partial_duplicates == want["partial"], name
        assert got.values == want["values"], name
        assert got.measured_factor == pytest.approx(want["measured"]), name
        assert got.model_factor == pytest.approx(dedupe_factor_model(got.d, ref["S"]))


# --- outputs, manifest, errors ------------------------------------------------------------


def test_outputs_json_table_plots(tmp_path):
    root = _write(tmp_path / "ds", _grouping_rows(), schema=GROUP_SCHEMA)
    report = compute_stats(root, schema=GROUP_SCHEMA, batch_size=24)

    path = report.write_json(tmp_path / "out" / "stats.json")
    data = json.loads(path.read_text())
    assert data["rows"] == 24 and data["batch_size"] == 24
    assert data["proposed_groups"] == [["a", "b"], ["c"]]
    assert [f["name"] for f in data["features"]] == ["x", "a", "b", "c"]
    assert data["features"][1]["exact_pct"] == pytest.approx(60.0)
    assert data["samples_per_session"]["histogram"] == [
        {"lo": 4, "hi": 8, "sessions": 4, "samples": 24}
    ]

    table = report.format_table()
    lines = table.splitlines()
    header = next(line for line in lines if line.startswith("feature"))
    row_a = next(line for line in lines if line.startswith("a "))
    assert len(row_a) == len(header)  # aligned columns
    assert "measured" in header and "2.00x" in row_a
    assert '[dedup]\ngroups = [["a", "b"], ["c"]]' in table

    pngs = report.plot(tmp_path / "plots")
    assert [p.name for p in pngs] == ["samples_per_session.png", "features.png"]
    for png in pngs:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_schema_from_manifest(tmp_path):
    root = _write(tmp_path / "ds", TINY)
    (root / "_manifest.json").write_text(
        json.dumps({"schema": SCHEMA.to_toml(), "order": "session"})
    )
    report = compute_stats(root, batch_size=4)
    assert report.order == "session"
    assert [f.name for f in report.features] == SCHEMA.feature_names
    assert report.feature("hist").partial_duplicates == 2


def test_errors_name_the_problem(tmp_path):
    root = _write(tmp_path / "ds", TINY)
    with pytest.raises(DataError, match=r"no `_manifest.json`.*\n.*--schema"):
        compute_stats(root)
    with pytest.raises(DataError, match=r"`batch_size` must be a positive integer, got 0"):
        compute_stats(root, schema=SCHEMA, batch_size=0)
    with pytest.raises(DataError, match=r"`dataset_dir` .* is not a directory"):
        compute_stats(tmp_path / "missing", schema=SCHEMA)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"holds no part-\*.parquet files"):
        dataset_files(tmp_path / "empty")
    other = DatasetSchema(name="other", dense=(DenseFeature("x"),), sparse=SCHEMA.sparse)
    with pytest.raises(DataError, match=r"lacks column\(s\) 'x' of schema 'other'"):
        compute_stats(root, schema=other)
    (root / "_manifest.json").write_text(json.dumps({"schema": "[dataset]\nnam = 'x'\n"}))
    with pytest.raises(SchemaError, match=r"_manifest.json \[schema\].*unknown key `nam`"):
        compute_stats(root)


def test_bad_dataset_files_raise_clear_errors(tmp_path):
    root = _write(tmp_path / "typed", TINY)
    table = pq.read_table(root / "part-00000.parquet")
    at = table.schema.get_field_index("hist")
    table = table.set_column(at, "hist", pa.array([1] * len(TINY), pa.int64()))
    pq.write_table(table, root / "part-00000.parquet")
    with pytest.raises(DataError, match=r"part-00000.parquet.*'hist' is BIGINT, expected a list"):
        compute_stats(root, schema=SCHEMA)
    corrupt = _write(tmp_path / "corrupt", TINY)
    (corrupt / "part-00000.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(CorruptInputError, match=r"cannot be read as Parquet.*part-00000.parquet"):
        compute_stats(corrupt, schema=SCHEMA)


def test_cli(tmp_path, capsys):
    from recpipe_cli import main

    root = _write(tmp_path / "ds", _grouping_rows(), schema=GROUP_SCHEMA)
    schema_path = tmp_path / "schema.toml"
    schema_path.write_text(GROUP_SCHEMA.to_toml())
    out = tmp_path / "stats"
    code = main(
        ["stats", str(root), "--schema", str(schema_path), "--batch-size", "24", "--out", str(out)]
    )
    assert code == 0
    captured = capsys.readouterr()
    assert "DedupeFactor at B=24" in captured.out
    assert "stats: 24 samples" in captured.err
    assert {p.name for p in out.iterdir()} == {
        "stats.json",
        "samples_per_session.png",
        "features.png",
    }

    code = main(
        [
            "stats",
            str(root),
            "--schema",
            str(schema_path),
            "--out",
            str(out),
            "--no-plots",
            "--json",
        ]
    )
    assert code == 0
    assert json.loads(capsys.readouterr().out)["batch_size"] == 4096

    assert main(["stats", str(root), "--out", str(out)]) == 1  # no manifest, no --schema
    assert "--schema" in capsys.readouterr().err


def test_histogram_bins_cover_all_sessions(tmp_path):
    rows = [(sid, t, 0.0, [1], [1], [1]) for sid, n in enumerate((1, 2, 3, 8, 9)) for t in range(n)]
    report = compute_stats(_write(tmp_path / "ds", rows), schema=SCHEMA, batch_size=4)
    hist = report.sessions.histogram
    assert [(lo, hi, n) for lo, hi, n, _ in hist] == [(1, 2, 1), (2, 4, 2), (8, 16, 2)]
    assert sum(s for *_, s in hist) == report.rows == 23
    assert report.sessions.median == 3.0
    assert math.isclose(report.sessions.mean, 23 / 5)
    assert np.isclose(report.sessions.p90, np.quantile([1, 2, 3, 8, 9], 0.9))


# --- empty datasets -------------------------------------------------------------------------


def _assert_zeros(report, schema: DatasetSchema) -> None:
    assert (report.rows, report.batches, report.samples_per_batch_session) == (0, 0, 0.0)
    assert report.sessions.sessions == 0 and report.sessions.histogram == ()
    assert [f.name for f in report.features] == schema.feature_names
    for f in report.features:
        assert (f.rows, f.values, f.exact_duplicates, f.d) == (0, 0, 0, 0.0)
        assert f.model_factor == f.measured_factor == 1.0
    assert report.proposed_features == [] and report.proposed_groups == []
    assert report.sparse_factor == report.sparse_model_factor == 1.0
    assert "the dataset is empty" in report.format_table()
    data = json.loads(json.dumps(report.to_dict(), allow_nan=False))
    assert data["rows"] == 0 and data["samples_per_session"]["sessions"] == 0


@pytest.mark.parametrize("lines", [b"", b'{"request_id": "r1"}\nnot json\n'])
def test_stats_of_an_empty_build_are_zeros(tmp_path, lines):
    from etl.build import build
    from schemas import default_schema

    (tmp_path / "f.jsonl").write_bytes(lines)
    manifest = build(tmp_path / "f.jsonl", tmp_path / "ds")
    assert manifest["rows_out"] == 0 and manifest["files"] == []
    report = compute_stats(tmp_path / "ds")
    assert report.files == 0 and report.order == "session"
    _assert_zeros(report, default_schema())
    assert report.plot(tmp_path / "plots") == [] and not (tmp_path / "plots").exists()


def test_stats_of_parquet_parts_without_rows_are_zeros(tmp_path):
    root = tmp_path / "ds"
    root.mkdir()
    pq.write_table(_table(TINY).slice(0, 0), root / "part-00000.parquet")
    report = compute_stats(root, schema=SCHEMA)
    assert report.files == 1
    _assert_zeros(report, SCHEMA)


def test_no_parts_is_an_error_unless_the_build_kept_no_rows(tmp_path):
    (tmp_path / "bare").mkdir()
    with pytest.raises(DataError, match=r"holds no part-\*.parquet files"):
        compute_stats(tmp_path / "bare", schema=SCHEMA)
    lost = tmp_path / "lost"  # the manifest promises rows that are not there
    lost.mkdir()
    manifest = {"schema": SCHEMA.to_toml(), "rows_out": 6, "files": [{"path": "part-00000"}]}
    (lost / "_manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=r"holds no part-\*.parquet files"):
        compute_stats(lost)


def test_cli_stats_of_an_empty_build(tmp_path, capsys):
    from recpipe_cli import main

    (tmp_path / "empty.jsonl").write_bytes(b"")
    ds, out = tmp_path / "ds", tmp_path / "stats"
    assert (
        main(["etl", "build", str(tmp_path / "empty.jsonl"), "--out", str(ds), "--no-progress"])
        == 0
    )
    assert "0 rows out" in capsys.readouterr().out
    assert main(["stats", str(ds), "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "the dataset is empty" in captured.out
    assert "no plots" in captured.err and "stats: 0 samples" in captured.err
    assert [p.name for p in out.iterdir()] == ["stats.json"]
    assert json.loads((out / "stats.json").read_text())["rows"] == 0
    assert main(["stats", str(ds), "--out", str(out), "--json", "--no-plots"]) == 0
    assert json.loads(capsys.readouterr().out)["batches"] == 0
