"""`etl shard` (RecD O1) and the raw-log reader it shares with the build (etl/rawio.py)."""

from __future__ import annotations

import argparse
import hashlib
import json
import re
from collections import Counter

import orjson
import pytest
import zstandard

from etl.rawio import expand_inputs, iter_lines, iter_unroutable
from etl.shard import ShardConfig, register_cli, shard, shard_path
from etl.synth import SynthConfig, generate
from recpipe.errors import CorruptInputError, DataError, RecpipeError


def _shard_lines(out, n):
    return [[line for _, line in iter_lines(shard_path(out, i))] for i in range(n)]


def _zst(path, text: bytes) -> None:
    path.write_bytes(zstandard.ZstdCompressor().compress(text))


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return generate(
        tmp_path_factory.mktemp("logs"),
        SynthConfig(num_requests=4_000, seed=5, files=3, bad_fraction=0.02),
    )


@pytest.fixture(scope="module")
def sharded(logs, tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded") / "shards"
    return out, shard(logs.root / "features", out, config=ShardConfig(num_shards=4))


def test_nothing_lost_and_counts_reconcile(logs, sharded):
    out, report = sharded
    assert report["lines_in"] == logs.num_requests
    assert report["lines_in"] == sum(report["lines_per_shard"]) + report["lines_unroutable"]
    on_disk = json.loads((out / "_shard.json").read_text())
    assert on_disk["lines_per_shard"] == report["lines_per_shard"]
    shards = _shard_lines(out, 4)
    assert [len(s) for s in shards] == report["lines_per_shard"]
    bad = list(iter_unroutable(out / "_unroutable.jsonl.zst"))
    assert len(bad) == report["lines_unroutable"]
    # Every input line is found exactly once, verbatim, in a shard or the unroutable file.
    inputs = Counter(line for p in logs.features for _, line in iter_lines(p))
    outputs = Counter(line for s in shards for line in s) + Counter(raw for *_, raw in bad)
    assert inputs == outputs


def test_unroutable_lines_keep_their_origin(logs, sharded):
    out, report = sharded
    bad = list(iter_unroutable(out / "_unroutable.jsonl.zst"))
    # Malformed lines that not even a lenient parser reads are the unroutable ones here.
    assert report["unroutable_by_reason"] == {"malformed_json": logs.num_bad["malformed_json"]}
    for source, line_no, reason, raw in bad:
        assert reason == "malformed_json"
        lines = dict(iter_lines(source))
        assert lines[line_no] == raw


def test_sessions_stay_in_one_shard_grouped(sharded):
    out, _ = sharded
    seen: dict[str, int] = {}
    for i, lines in enumerate(_shard_lines(out, 4)):
        order = []
        for line in lines:
            try:
                sid = orjson.loads(line)["session_id"]
            except (orjson.JSONDecodeError, KeyError):
                continue  # NaN / Infinity lines are routed but not strict JSON
            assert seen.setdefault(sid, i) == i
            if not order or order[-1] != sid:
                order.append(sid)
        # one flush for this small input: each session is one contiguous run
        assert len(order) == len(set(order))


def test_routing_is_a_stable_hash(sharded):
    out, _ = sharded
    line = next(line for _, line in iter_lines(shard_path(out, 2)))
    sid = orjson.loads(line)["session_id"]
    digest = hashlib.blake2b(b"s" + sid.encode(), digest_size=8).digest()
    assert int.from_bytes(digest, "little") % 4 == 2


def test_deterministic_output(logs, sharded, tmp_path):
    out, _ = sharded
    again = tmp_path / "again"
    shard(logs.root / "features", again, config=ShardConfig(num_shards=4))
    for i in range(4):
        assert shard_path(out, i).read_bytes() == shard_path(again, i).read_bytes()


def test_session_routing_compresses_better(logs, sharded):
    _, report = sharded
    c = report["compare"]
    assert report["shard_ratio_session_vs_request"] == c["bytes_by_request"] / c["bytes_by_session"]
    assert c["bytes_by_session"] < c["bytes_by_session_ungrouped"] < c["bytes_by_request"]
    assert report["bytes_out"] == c["bytes_by_session"]


def test_by_request_routes_every_request_by_its_id(logs, tmp_path):
    report = shard(logs.features, tmp_path / "r", config=ShardConfig(num_shards=3, by="request"))
    assert report["lines_in"] == sum(report["lines_per_shard"]) + report["lines_unroutable"]
    assert report["shard_ratio_session_vs_request"] > 1.0


def test_without_session_id_routes_by_user(tmp_path):
    logs = generate(tmp_path / "logs", SynthConfig(num_requests=1_500, with_session_id=False))
    report = shard(logs.features, tmp_path / "out", config=ShardConfig(num_shards=3))
    assert report["routed_by_key"] == {"user_id": 1_500}
    users: dict[int, int] = {}
    for i, lines in enumerate(_shard_lines(tmp_path / "out", 3)):
        for line in lines:
            assert users.setdefault(orjson.loads(line)["user_id"], i) == i


def test_lines_without_any_key_are_unroutable(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_bytes(
        b'{"request_id": "r-1", "ts": 1, "session_id": "s-1"}\n'
        b'{"request_id": "r-2", "ts": 2}\n'
        b"[1, 2]\n"
        b'{"request_id": "r-3", "ts": 3, "session_id": ["x"]}\n'
        b'{"request_id": "r-4", "ts": 4, "user_id": 7}\n'
    )
    report = shard(src, tmp_path / "out", config=ShardConfig(num_shards=2, compare=False))
    assert report["lines_unroutable"] == 3
    assert report["unroutable_by_reason"] == {"missing_session_key": 2, "malformed_json": 1}
    bad = list(iter_unroutable(tmp_path / "out" / "_unroutable.jsonl.zst"))
    assert [(b[1], b[2]) for b in bad] == [
        (2, "missing_session_key"),
        (3, "malformed_json"),
        (4, "missing_session_key"),
    ]
    assert "compare" not in report


def test_non_json_text_is_routed_to_unroutable(tmp_path):
    src = tmp_path / "notes.jsonl"
    src.write_bytes(b"hello\n\x00\x01 control bytes are UTF-8 \xc3\xa9\n")
    report = shard(src, tmp_path / "out", config=ShardConfig(num_shards=2))
    assert report["lines_unroutable"] == 2 and report["lines_routed"] == 0
    bad = list(iter_unroutable(tmp_path / "out" / "_unroutable.jsonl.zst"))
    assert bad[1][3] == b"\x00\x01 control bytes are UTF-8 \xc3\xa9"  # kept verbatim


GOOD_LINE = b'{"request_id": "r-1", "session_id": "s-1", "ts": 1}\n'


def test_a_byte_order_mark_opening_the_file_is_text(tmp_path):
    src = tmp_path / "bom.jsonl"
    src.write_bytes(b"\xef\xbb\xbf" + GOOD_LINE)
    report = shard(src, tmp_path / "out", config=ShardConfig(num_shards=2))
    assert report["lines_routed"] == 1 and report["lines_unroutable"] == 0


@pytest.mark.parametrize(
    ("name", "data", "line", "byte", "offset"),
    [
        ("binary.jsonl", b"\x00\xff\xfe binary \x80\x81\n" * 10, 1, 0xFF, 1),
        ("utf16.jsonl", GOOD_LINE.decode().encode("utf-16"), 1, 0xFF, 0),
        ("one_bad_line.jsonl", GOOD_LINE * 3 + b'{"session_id": "s\xe9"}\n', 4, 0xE9, 17),
        (
            "one_bad_line.jsonl.zst",
            zstandard.ZstdCompressor().compress(GOOD_LINE * 5000 + b"\xc3(\n" + GOOD_LINE),
            5001,
            0xC3,
            0,
        ),
    ],
    ids=["binary", "utf16", "one_bad_line", "one_bad_line_zst"],
)
def test_a_file_that_is_not_utf8_stops_shard_as_it_stops_build(
    tmp_path, name, data, line, byte, offset
):
    from etl.build import build

    src = tmp_path / name
    src.write_bytes(data)
    where = rf"line {line}: not UTF-8 text \(byte {byte:#04x} at byte {offset} of the line\)"
    with pytest.raises(CorruptInputError, match=rf"{re.escape(name)}: {where}"):
        shard(src, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))
    good = tmp_path / "good.jsonl"
    good.write_bytes(GOOD_LINE * 2)
    shard(good, tmp_path / "kept", config=ShardConfig(num_shards=2))
    kept = {p.name: p.read_bytes() for p in (tmp_path / "kept").iterdir()}
    with pytest.raises(CorruptInputError, match=re.escape(name)):  # earlier output kept
        shard([good, src], tmp_path / "kept", overwrite=True)
    assert {p.name: p.read_bytes() for p in (tmp_path / "kept").iterdir()} == kept
    with pytest.raises(CorruptInputError, match=rf"{re.escape(name)}: cannot read input: .*UTF-8"):
        build(src, tmp_path / "built")


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda p, good: p.write_bytes(good[: len(good) // 2]), r"truncated zstd file"),
        (lambda p, good: p.write_bytes(b"not zstd at all\n"), r"not a zstd file"),
        (lambda p, good: p.write_bytes(good[:20] + b"\x00" * 64 + good[84:]), r"corrupt zstd"),
        (lambda p, good: p.write_bytes(b"PAR1" + good), r"is a Parquet file"),
    ],
)
def test_corrupt_zstd_input_names_the_file(tmp_path, make, match):
    text = b"".join(
        b'{"request_id": "r-%d", "session_id": "s-%d", "ts": %d}\n' % (i, i % 7, i)
        for i in range(5_000)
    )
    good = zstandard.ZstdCompressor(write_checksum=True).compress(text)
    path = tmp_path / "broken.jsonl.zst"
    make(path, good)
    with pytest.raises(CorruptInputError, match=rf"broken\.jsonl\.zst: .*{match}"):
        shard(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out.tmp-*"))  # no half-written output left behind


def test_existing_output_needs_overwrite(logs, sharded):
    out, _ = sharded
    with pytest.raises(DataError, match="already exists"):
        shard(logs.features, out)


def test_config_validation():
    with pytest.raises(RecpipeError, match="`num_shards` must be in"):
        ShardConfig(num_shards=0)
    with pytest.raises(RecpipeError, match="`by` must be one of"):
        ShardConfig(by="user")  # type: ignore[arg-type]


def test_iter_lines_and_expand_inputs(tmp_path):
    (tmp_path / "d" / "sub").mkdir(parents=True)
    _zst(tmp_path / "d" / "a.jsonl.zst", b'{"a":1}\r\n\n{"a":2}')
    _zst(tmp_path / "d" / "multi.jsonl.zst", b"")
    (tmp_path / "d" / "sub" / "b.jsonl").write_bytes(b'{"b":1}\n')
    (tmp_path / "d" / "_manifest.jsonl").write_bytes(b"skip me\n")
    (tmp_path / "d" / "other.txt").write_bytes(b"skip me\n")
    assert list(iter_lines(tmp_path / "d" / "a.jsonl.zst")) == [(1, b'{"a":1}'), (3, b'{"a":2}')]
    found = expand_inputs(tmp_path / "d")
    assert [p.name for p in found] == ["a.jsonl.zst", "multi.jsonl.zst", "b.jsonl"]
    assert expand_inputs([str(tmp_path / "d" / "*.zst"), tmp_path / "d" / "a.jsonl.zst"]) == [
        tmp_path / "d" / "a.jsonl.zst",
        tmp_path / "d" / "multi.jsonl.zst",
    ]
    # concatenated zstd frames are one stream
    two = zstandard.ZstdCompressor().compress(b"x\n") + zstandard.ZstdCompressor().compress(b"y\n")
    (tmp_path / "two.jsonl.zst").write_bytes(two)
    assert list(iter_lines(tmp_path / "two.jsonl.zst")) == [(1, b"x"), (2, b"y")]
    with pytest.raises(DataError, match="does not exist"):
        expand_inputs(tmp_path / "nope")
    with pytest.raises(DataError, match="matches no files"):
        expand_inputs(str(tmp_path / "*.parquet"))


def test_cli_help_and_run(logs, tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="recpipe etl")
    register_cli(parser.add_subparsers(dest="stage"))
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["shard", "--help"])
    assert exc.value.code == 0
    assert "--num-shards" in capsys.readouterr().out
    args = parser.parse_args(
        [
            "shard",
            str(logs.root / "features"),
            "--out",
            str(tmp_path / "o"),
            "--num-shards",
            "2",
            "--quiet",
        ]
    )
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "shard_ratio_session_vs_request" in out and "unroutable" in out
