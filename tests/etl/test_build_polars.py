"""`etl build --engine polars` gives the DuckDB engine's dataset, quarantine and counts."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from etl import reasons
from etl.build import BuildConfig, inputs
from etl.build.validate import TS_RANGE
from etl.build.writer import hour_label
from recpipe.errors import CorruptInputError, DataError
from tests.etl.test_build import (
    BAD_CASES,
    GOOD,
    LABEL_EVENTS,
    _rec,
    _write,
    build_lenient,
    corrupt_inputs,
)
from tests.etl.test_build_fastpath import LINES

#: manifest entries that may differ between the engines
_RUN_KEYS = {"elapsed_s", "phase_s", "phase_cpu_s", "config"}


def _nullable(table: pa.Table) -> pa.Table:
    """``table`` with every field nullable (DuckDB marks some NOT NULL from its statistics)."""
    return table.cast(pa.schema([pa.field(f.name, f.type) for f in table.schema]))


def _both(tmp_path: Path, features, *, events=None, **options) -> tuple[dict, dict]:
    """Build with each engine into ``tmp_path/duckdb`` and ``tmp_path/polars``; assert parity."""
    out = {}
    for engine in ("duckdb", "polars"):
        cfg = BuildConfig(engine=engine, **options)
        out[engine] = build_lenient(features, tmp_path / engine, events=events, config=cfg)
    a, b = out["duckdb"], out["polars"]
    assert list(a) == list(b)  # the same manifest layout
    assert {k: v for k, v in a.items() if k not in _RUN_KEYS} == {
        k: v for k, v in b.items() if k not in _RUN_KEYS
    }
    assert {**a["config"], "engine": "polars"} == b["config"]
    for name in ("features", "events"):
        qa, qb = (pq.read_table(tmp_path / e / "_quarantine" / f"{name}.parquet") for e in out)
        assert _nullable(qa).equals(qb), name
    for f in a["files"]:  # the same writer on the same rows: the same bytes
        assert (tmp_path / "duckdb" / f["path"]).read_bytes() == (
            tmp_path / "polars" / f["path"]
        ).read_bytes(), f["path"]
    assert a["reconciles"] and b["reconciles"]
    for engine, m in out.items():  # the files hold exactly the rows counted
        parts = sorted((tmp_path / engine).rglob("part-*.parquet"))
        assert sum(pq.read_metadata(p).num_rows for p in parts) == m["rows_out"], engine
    return a, b


#: the line limit of the parity tests (lowered: the corpora stay small)
_MAX_LINE = 4096


def _corpus_bad_cases(tmp: Path):
    lines = [*GOOD, *(line for line, _, _ in BAD_CASES), *GOOD[:1], "", "   ", "[1, 2]", "null"]
    lines.append(_rec("long", 9, session="s1", dense={"user_age": 1.0}, pad="x" * _MAX_LINE))
    lines += [line.replace('"a', f'"t{i}') for i, line in enumerate(_TRICKY)]
    return _write(tmp / "f.jsonl", lines), None


def _corpus_fastpath_lines(tmp: Path):
    return _write(tmp / "f.jsonl.zst", LINES), None


def _corpus_lenient_and_unknown(tmp: Path):
    lines = [
        _rec("a", 1, session="s", dense={"user_age": None}, sparse={"item_id": None}),
        _rec(7, 2, session=3, user="u-1"),
        '{"request_id": "b", "ts": 3, "session_id": "s", "dense": {"user_age": 1}, "sparse": {}}',
        {"request_id": "c", "ts": 4, "session_id": "s"},
        _rec("d", 5, session="s", sparse={"user_liked_items": list(range(80))}),
        _rec("e", 6, session="s", dense={"mystery": 1.0}, sparse={"unknown_list": [1]}),
        '{"request_id": "f", "ts": 7, "sparse": {"item_id": [3, 1e5]}}',  # DuckDB reads 1e5
        '{"request_id": "g", "ts": 8, "user_id" : 5}',  # `"key" :` leaves the fast path
        '{"request_id": "h\\u00e9\\/", "ts": 9, "dense": {"user_age": -0.0}}',
    ]
    return _write(tmp / "f.jsonl", lines), None


def _corpus_duplicates(tmp: Path):
    a = _write(tmp / "a.jsonl", [_rec("r1", 10, session="s"), _rec("r2", 11, session="s")])
    b = _write(
        tmp / "b.jsonl.zst",
        [_rec("r1", 5, session="t"), _rec("r3", 12, session="s"), _rec("r2", 1), _rec(7, 3)],
    )
    c = _write(tmp / "c.jsonl", [_rec("7", 4), '{"request_id": "r\\"q", "ts": 1}'] * 2)
    return [a, b, c], None


def _corpus_labels(tmp: Path):
    feats = _write(tmp / "f.jsonl", [_rec(f"r{i}", i, session="s") for i in range(5)])
    evs = _write(
        tmp / "e.jsonl",
        [
            *LABEL_EVENTS,
            {"request_id": "r1", "ts": 9, "label": 0.25},
            {"request_id": "r3", "ts": 1.5, "label": 1},
            {"request_id": 4, "label": -0.0, "extra": [1]},
            '{"request_id": "r4", "label": NaN}',
            {"request_id": "r1", "label": 1e300},  # beyond float32: quarantined
            {"request_id": "r4", "label": -1e39},
            {"request_id": "r2", "label": 3.4028234663852886e38},  # float32's largest
        ],
    )
    return feats, evs


def _corpus_users_and_gaps(tmp: Path):
    gap = 30 * 60 * 1000
    rnd = random.Random(0)
    lines = [_rec(f"u{i}", rnd.randrange(0, 6 * gap), user=i % 7) for i in range(200)]
    lines += [_rec(f"n{i}", rnd.randrange(0, 6 * gap)) for i in range(20)]
    lines += [_rec(f"s{i}", rnd.randrange(0, 6 * gap), session=f"k{i % 9}") for i in range(100)]
    rnd.shuffle(lines)
    return _write(tmp / "f.jsonl.zst", lines), None


def _corpus_line_ends(tmp: Path):
    good = json.dumps(_rec("a", 1, session="s")).encode()
    crlf = b"\xef\xbb\xbf" + b"\r\n".join([good, b"", b"oops", b"  ", good.replace(b'"a"', b'"b"')])
    (tmp / "crlf.jsonl").write_bytes(crlf + b"\r\n\n")
    (tmp / "gz.jsonl.gz").write_bytes(
        gzip.compress(b"\n".join([b"", good.replace(b'"a"', b'"c"')]))
    )
    (tmp / "tail.jsonl").write_bytes(b"\n\n" + good.replace(b'"a"', b'"d"') + b"\n{")
    (tmp / "tiny.jsonl").write_bytes(b"{\n")
    # a bare `\r` is data: whitespace between tokens, or inside a string (not valid JSON)
    (tmp / "cr.jsonl").write_bytes(
        good.replace(b'"a"', b'"e"').replace(b", ", b",\r ")
        + b"\n"
        + good.replace(b'"a"', b'"f\rg"')
        + b"\r\r\n\r"
    )
    # lines of exactly the limit (before a `\r\n`), one byte over, and over mid-chunk
    fit = good.replace(b'"a"', b'"h' + b"x" * (_MAX_LINE - len(good) - 1) + b'"')
    over = good.replace(b'"a"', b'"i' + b"x" * (_MAX_LINE - len(good)) + b'"')
    (tmp / "long.jsonl").write_bytes(b"\r\n".join([fit, over, b"y" * 5 * _MAX_LINE, fit]))
    names = ["crlf.jsonl", "gz.jsonl.gz", "tail.jsonl", "tiny.jsonl", "cr.jsonl", "long.jsonl"]
    return [tmp / name for name in names], None


def _corpus_parquet_and_unroutable(tmp: Path):
    from etl.rawio import UNROUTABLE_NAME, unroutable_record

    rows = [_rec(f"r{i}", i, session="s") for i in range(5)]
    pq.write_table(pa.Table.from_pylist(rows), tmp / "f.parquet")
    pq.write_table(pa.table({"request_id": ["x"], "ts": ["noon"]}), tmp / "t.parquet")
    shards = tmp / "shards"
    shards.mkdir()
    _write(shards / "shard-00000.jsonl", [_rec("a", 1, session="s"), _rec("r1", 2)])
    records = [
        unroutable_record("raw/f.jsonl", 7, "malformed_json", b'{"request_id": "x"'),
        unroutable_record("raw/f.jsonl", 9, "no_key", json.dumps(_rec("b", 2)).encode()),
        unroutable_record("raw/g.jsonl", 3, "malformed_json", b"\xff\xfe"),
        # records of other files sharing line 9
        unroutable_record("raw/g.jsonl", 9, "no_key", json.dumps(_rec("c", 3)).encode()),
        unroutable_record("raw/h.jsonl", 9, "malformed_json", b"{"),
        unroutable_record("raw/i.jsonl", 9, "no_key", json.dumps(_rec("b", 4)).encode()),
    ]
    (shards / UNROUTABLE_NAME).write_bytes(
        zstandard.ZstdCompressor().compress(b"\n".join(records) + b"\n")
    )
    return [tmp / "f.parquet", tmp / "t.parquet", shards], None


def _corpus_empty(tmp: Path):
    (tmp / "f.jsonl").write_bytes(b"")
    (tmp / "e.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(b""))
    return tmp / "f.jsonl", tmp / "e.jsonl.zst"


CORPORA = {
    "bad_cases": _corpus_bad_cases,
    "fastpath_lines": _corpus_fastpath_lines,
    "lenient_and_unknown": _corpus_lenient_and_unknown,
    "duplicates": _corpus_duplicates,
    "labels": _corpus_labels,
    "users_and_gaps": _corpus_users_and_gaps,
    "line_ends": _corpus_line_ends,
    "parquet_and_unroutable": _corpus_parquet_and_unroutable,
    "empty": _corpus_empty,
}


@pytest.mark.parametrize("corpus", CORPORA)
def test_engines_give_the_same_dataset_quarantine_and_counts(tmp_path, corpus):
    features, events = CORPORA[corpus](tmp_path)
    a, _ = _both(tmp_path, features, events=events, row_group_size=16, max_line_bytes=_MAX_LINE)
    assert (a["rows_in"] > 0) == (corpus != "empty")
    if corpus == "bad_cases":  # every reason is met, every line accounted for
        assert all(a["quarantine_by_reason"][r] for r in reasons.QUARANTINE_REASONS)


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_lines_split_across_reads_and_batches_keep_their_numbers(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(inputs, "CHUNK_BYTES", chunk)
    monkeypatch.setattr(inputs, "BATCH_LINES", 3)
    good = [json.dumps(_rec(f"r{i}", i, session="s")).encode() for i in range(6)]
    (tmp_path / "lf.jsonl.zst").write_bytes(
        zstandard.ZstdCompressor().compress(
            b"\xef\xbb\xbf" + b"\n".join([good[0], b"", b"{", *good[:3]])
        )
    )
    (tmp_path / "crlf.jsonl").write_bytes(b"\r\n".join([b"", *good[3:], b" ", good[4]]) + b"\r\n")
    _both(tmp_path, [tmp_path / "lf.jsonl.zst", tmp_path / "crlf.jsonl"])


def _sessions_over_hours() -> list[dict]:
    hour = 3_600_000
    rnd = random.Random(1)
    lines = [_rec(f"long-{k}", k * hour // 9, session="long") for k in range(30)]
    for s in range(40):
        start = rnd.randrange(0, 3 * hour)
        n = 1 + s % 13
        lines += [_rec(f"r{s}-{k}", start + k * 600_000, user=s % 11) for k in range(n)]
    rnd.shuffle(lines)
    return lines


@pytest.mark.parametrize(
    "options",
    [
        {"order": "time", "row_group_size": 8},
        {"partition_by": "hour", "max_file_bytes": 1, "row_group_size": 8},
        {"order": "time", "partition_by": "hour", "row_group_size": 5},
        {"session_gap_ms": 900_000, "dictionary": "all"},
        {"sample_sessions": 0.5, "seed": 3, "dictionary": "none"},
    ],
    ids=["time", "hour-files", "time-hour", "gap", "sampled"],
)
def test_engines_agree_under_every_option(tmp_path, options):
    src = _write(tmp_path / "f.jsonl", _sessions_over_hours())
    a, _ = _both(tmp_path, src, **options)
    assert a["rows_out"] > 0
    if "partition_by" in options:
        assert len({Path(f["path"]).parent for f in a["files"]}) > 1


def test_engines_agree_on_the_synthetic_logs(synth_logs, tmp_path):
    a, _ = _both(tmp_path, synth_logs.features, events=synth_logs.events, row_group_size=4_096)
    assert a["quarantine_by_reason"] == {**a["quarantine_by_reason"], **synth_logs.num_bad}
    assert a["events_quarantined"] == sum(synth_logs.summary["num_bad_events"].values())


# --- the Polars fast path accepts only what the DuckDB fast path accepts, with its values ---

_NUMBERS = ["0", "-0", "7", "-1", "1e5", "1e+5", "1E5", "1.5", "-0.0", "1e-3", "1e19", "1e400"]
_NUMBERS += ["9223372036854775807", "9223372036854775808", "18446744073709551616", "3.5e38"]
_NUMBERS += ["NaN", "true", "null"]
_STRINGS = ['"a"', '"12"', '"a[b"', '"\\u00e9"', '"x\\"y"', '"1.5"', '""', '"true"', '"sparse"']
#: lines that Polars reads otherwise than DuckDB (kept from the Polars engine's own screen)
_TRICKY = [
    '{"request_id": "\\ud800", "ts": 1}',  # a lone surrogate: DuckDB finds no JSON
    '{"request_id": "a\\u0000b", "ts": 1}',
    '{"request_id": "a[b", "ts": 1, "sparse": {"item_id": 7}}',  # Polars reads 7 as [7]
    '{"request_id": "a", "ts": 1, "sparse": {"item_id": 7}}',
    '{"request_id": 1e5, "ts": 1, "sparse": {}}',  # Polars writes 1e5 as "100000"
    '{"request_id": "a", "ts": 1e3}',
    '{"request_id": "a", "ts": 1, "session_id": 1.0, "sparse": {}}',
    '{"request_id": "a\tb", "ts": 1}',
    '{"request_id": "a", "ts": 1, "dense": {"user_age": NaN}}',
    '{"request_id": "a", "ts": 1, "dense": {"user_age": "12"}}',
    '{"request_id": "a", "ts": 1, "dense": {"user_age": 1e400}}',
]


def _random_line(rnd: random.Random) -> str:
    def pick(options, p=0.5):
        return rnd.choice(options) if rnd.random() < p else None

    def key(name: str) -> str:
        return f'"{name}"' + rnd.choice([":"] * 8 + [": ", " :"])

    parts = []
    for name, p in (("request_id", 0.95), ("session_id", 0.5), ("user_id", 0.5), ("ts", 0.95)):
        if rnd.random() < p:
            value = pick(_STRINGS + _NUMBERS) or str(rnd.randrange(-5, 10**13))
            parts.append(key(name) + value)
    if rnd.random() < 0.8:
        names = rnd.sample(["user_age", "item_price", "context_hour", "mystery"], rnd.randrange(4))
        body = ",".join(key(n) + (pick(_NUMBERS + _STRINGS, 0.3) or "2.5") for n in names)
        parts.append(key("dense") + (pick(["[1.0]", "7", "null"], 0.05) or "{" + body + "}"))
    if rnd.random() < 0.8:
        names = rnd.sample(["user_segment", "item_id", "item_tags", "other"], rnd.randrange(4))
        lists = []
        for n in names:
            ids = [
                pick(_NUMBERS + _STRINGS, 0.1) or str(rnd.randrange(-99, 99))
                for _ in range(rnd.randrange(12))
            ]
            lists.append(
                key(n) + (pick([*_NUMBERS, "[[1]]", "{}"], 0.1) or "[" + ",".join(ids) + "]")
            )
        parts.append(key("sparse") + (pick(["[1]", "null"], 0.05) or "{" + ",".join(lists) + "}"))
    if rnd.random() < 0.05 and parts:
        parts.append(rnd.choice(parts))  # a repeated key
    if rnd.random() < 0.2:
        rnd.shuffle(parts)
    text = "{" + rnd.choice([",", ", "]).join(parts) + "}"
    return text if rnd.random() > 0.03 else text[: rnd.randrange(len(text))]


def test_engines_agree_on_random_lines(tmp_path):
    """Random, often invalid lines (every key layout, value kind and repeat) through both."""
    rnd = random.Random(5)
    lines = [_random_line(rnd) for _ in range(2000)] + [x for x in LINES if x] + _TRICKY
    a, _ = _both(tmp_path, _write(tmp_path / "f.jsonl", lines), row_group_size=64)
    assert a["rows_out"] > 200 and a["rows_quarantined"] > 200


def test_hour_partition_labels_match_duckdb_strftime():
    lo, hi = TS_RANGE
    rnd = random.Random(2)
    ms = [lo, hi, 0, -1, 253_402_300_800_000, -62_167_219_200_001]
    ms += [rnd.randrange(lo, hi) for _ in range(500)] + [
        rnd.randrange(-(10**14), 10**14) for _ in range(500)
    ]
    con = duckdb.connect()
    con.register("t", pa.table({"ms": pa.array(ms, pa.int64())}))
    want = [
        r[0] for r in con.execute("SELECT strftime(epoch_ms(ms), '%Y-%m-%d-%H') FROM t").fetchall()
    ]
    assert [hour_label(m // 3_600_000) for m in ms] == want


# --- what the Polars engine refuses, and where the DuckDB engine stops ---


def test_duckdb_only_options_are_refused(tmp_path):
    src = _write(tmp_path / "f.jsonl", GOOD)
    for options, name in (
        ({"memory_limit": "1GB"}, "memory_limit"),
        ({"spill_dir": tmp_path}, "spill_dir"),
        ({"threads": 2}, "threads"),
    ):
        with pytest.raises(DataError, match=f"`{name}` is an option of engine 'duckdb'"):
            build_lenient(src, tmp_path / "o", config=BuildConfig(engine="polars", **options))
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".o.*"))


def test_a_bare_carriage_return_is_data_in_both_engines(tmp_path):
    """Once refused by the Polars engine (and split by DuckDB's line reader): a lone `\r` is
    data, `\r\n` one line end, whatever line ends came before."""
    good = json.dumps(GOOD[0]).encode()
    cases = {
        "bare_cr.jsonl": good + b"\n" + good.replace(b", ", b",\r") + b"\r" + good + b"\n",
        "crlf_after_lf.jsonl": good + b"\n" + good + b"\r\n",
        "cr_at_end.jsonl.zst": zstandard.ZstdCompressor().compress(good + b"\r\n" + good + b"\r"),
    }
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        a, _ = _both(tmp_path / name.split(".")[0], tmp_path / name)
        assert a["rows_in"] == 2, name
    q = pq.read_table(tmp_path / "bare_cr" / "duckdb" / "_quarantine" / "features.parquet")
    assert q.column("raw").to_pylist() == [
        (good.replace(b", ", b",\r") + b"\r" + good).decode()  # one line, kept whole
    ]


def test_corrupt_inputs_raise_errors_naming_the_file_as_in_duckdb(tmp_path):
    for name, data in corrupt_inputs().items():
        (tmp_path / name).write_bytes(data)
        for engine in ("duckdb", "polars"):
            with pytest.raises(CorruptInputError, match=name):
                build_lenient(tmp_path / name, tmp_path / "out", config=BuildConfig(engine=engine))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("lines", "label", "options"),
    [
        ([_rec("a", 1, session="s"), _rec("b", 2, session="t")], 1e300, {}),
        ([_rec("a", TS_RANGE[0], user=1), _rec("b", TS_RANGE[1], user=1)], 1, {}),
        (
            [_rec(x, ts, session=x) for x, ts in zip("abcd", [*TS_RANGE, 2**62, -(2**62)])],
            1,
            {"partition_by": "hour"},
        ),
    ],
    ids=["label", "user-gap", "hour"],
)
def test_engines_agree_where_duckdb_used_to_stop(tmp_path, lines, label, options):
    """A label beyond float32 is quarantined; far-apart records and extreme ts build alike."""
    src = _write(tmp_path / "f.jsonl", lines)
    events = _write(tmp_path / "e.jsonl", [{"request_id": "a", "label": label}])
    a, _ = _both(tmp_path, src, events=events, **options)
    assert a["rows_out"] == 2 and a["sessions"] == 2
    assert a["events_quarantine_by_reason"][reasons.NON_FINITE] == (label == 1e300)
    assert a["quarantine_by_reason"][reasons.TS_OUT_OF_RANGE] == len(lines) - 2


def test_unroutable_records_sharing_a_line_number(tmp_path):
    """Records of several source files may share a line: each is built once, in both engines."""
    from etl.rawio import UNROUTABLE_NAME, unroutable_record

    shards = tmp_path / "shards"
    shards.mkdir()
    _write(shards / "shard-00000.jsonl", [_rec("a", 1, session="s")])
    records = [
        unroutable_record("raw/b.jsonl", 9, "malformed_json", b"{"),
        unroutable_record("raw/a.jsonl", 9, "malformed_json", b'{"request_id": "x"'),
        unroutable_record("raw/c.jsonl", 9, "no_key", json.dumps(_rec("b", 2)).encode()),
        unroutable_record("raw/d.jsonl", 9, "no_key", json.dumps(_rec("c", 3)).encode()),
    ]
    unroutable = shards / UNROUTABLE_NAME
    unroutable.write_bytes(zstandard.ZstdCompressor().compress(b"\n".join(records) + b"\n"))
    a, _ = _both(tmp_path, shards)
    assert (a["rows_in"], a["rows_out"], a["rows_quarantined"]) == (5, 3, 2)
    q = pq.read_table(tmp_path / "polars" / "_quarantine" / "features.parquet").to_pylist()
    assert [(x["source"], x["line"]) for x in q] == [("raw/b.jsonl", 9), ("raw/a.jsonl", 9)]


def test_cli_builds_with_the_polars_engine(tmp_path, capsys):
    from recpipe_cli import main

    src = _write(tmp_path / "f.jsonl", [*GOOD, "oops"])
    args = ["etl", "build", str(src), "--no-progress", "--engine", "polars"]
    args += ["--allow-missing-features"]
    assert main([*args, "--out", str(tmp_path / "out"), "--json"]) == 0
    manifest = json.loads(capsys.readouterr().out)
    assert manifest["config"]["engine"] == "polars" and manifest["rows_out"] == 3
    assert manifest["quarantine_by_reason"][reasons.MALFORMED_JSON] == 1
    assert main([*args, "--out", str(tmp_path / "o2"), "--memory-limit", "1GB"]) == 1
    assert "`--memory-limit` is an option of engine 'duckdb'" in capsys.readouterr().err
