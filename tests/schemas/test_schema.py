"""Schema loading: every validation error, the TOML round trip, the Arrow schema."""

from __future__ import annotations

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recpipe.errors import SchemaError
from schemas import (
    DatasetSchema,
    DenseFeature,
    SparseFeature,
    default_schema,
    default_schema_path,
    load_schema,
    parse_schema,
)

BASE = """
[dataset]
name = "feed"
[[dense]]
name = "user_age"
[[sparse]]
name = "user_liked_items"
kind = "user"
max_len = 50
[[sparse]]
name = "user_segment"
kind = "user"
max_len = 1
[[sparse]]
name = "item_id"
kind = "item"
max_len = 1
"""


def test_loads_the_design_example():
    schema = parse_schema(BASE + '[dedup]\ngroups = [["user_liked_items"], ["user_segment"]]\n')
    assert schema.name == "feed"
    assert schema.dense == (DenseFeature("user_age", 0.0),)
    assert schema.sparse[0] == SparseFeature("user_liked_items", "user", 50, True)
    assert schema.dedup_groups == (("user_liked_items",), ("user_segment",))
    assert schema.feature_names == ["user_age", "user_liked_items", "user_segment", "item_id"]
    assert schema.feature("item_id").kind == "item"


def test_arrow_schema():
    arrow = parse_schema(BASE).arrow_schema()
    assert arrow.names == [
        "session_id",
        "ts",
        "label",
        "user_age",
        "user_liked_items",
        "user_segment",
        "item_id",
    ]
    assert arrow.field("session_id").type == pa.int64()
    assert arrow.field("ts").type == pa.int64()
    assert arrow.field("label").type == pa.float32()
    assert arrow.field("user_age").type == pa.float32()
    assert arrow.field("item_id").type == pa.list_(pa.int64())


def test_default_schema_is_bundled_and_valid():
    schema = default_schema()
    assert default_schema_path().name == "synth.toml"
    assert schema == load_schema(default_schema_path()) == load_schema()
    assert not schema.feature("item_tags").truncate
    assert schema.dedup_groups
    assert {f.kind for f in schema.sparse} == {"user", "item", "context"}


def test_round_trip_default():
    schema = default_schema()
    assert parse_schema(schema.to_toml()) == schema


def test_with_dedup_and_snippet():
    schema = parse_schema(BASE).with_dedup([["user_segment", "item_id"]])
    assert schema.dedup_groups == (("user_segment", "item_id"),)
    assert schema.dedup_toml() == '[dedup]\ngroups = [["user_segment", "item_id"]]\n'
    assert parse_schema(BASE + schema.dedup_toml()).dedup_groups == schema.dedup_groups
    with pytest.raises(SchemaError, match="unknown feature `nope`"):
        schema.with_dedup([["nope"]])


names = st.from_regex(r"[a-z][a-z0-9_]{0,10}", fullmatch=True).filter(
    lambda n: n not in {"session_id", "ts", "label", "user_id", "request_id", "dense", "sparse"}
)


@settings(max_examples=40, deadline=None)
@given(
    dense=st.lists(st.tuples(names, st.floats(-1e6, 1e6)), max_size=4),
    sparse=st.lists(
        st.tuples(
            names, st.sampled_from(["user", "item", "context"]), st.integers(1, 500), st.booleans()
        ),
        min_size=1,
        max_size=5,
    ),
)
def test_round_trip_property(dense, sparse):
    seen: set[str] = set()
    dense_f = []
    for name, fill in dense:
        if name not in seen:
            seen.add(name)
            dense_f.append(DenseFeature(name, fill))
    sparse_f = []
    for name, kind, max_len, trunc in sparse:
        if name not in seen:
            seen.add(name)
            sparse_f.append(SparseFeature(name, kind, max_len, trunc))
    if not sparse_f:
        return
    groups = [[sparse_f[0].name]]
    schema = DatasetSchema("x", tuple(dense_f), tuple(sparse_f), tuple(map(tuple, groups)))
    assert parse_schema(schema.to_toml()) == schema


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        # unknown keys, everywhere, with a hint
        (
            lambda t: t.replace('kind = "item"', 'kind = "item"\nmax_lenn = 3'),
            r"unknown key `max_lenn`\nhint: did you mean `max_len`",
        ),
        (
            lambda t: t.replace("[dataset]", "[dataset]\nsesion_key = 'sid'"),
            r"\[dataset\]: unknown key `sesion_key`\nhint: did you mean `session_key`",
        ),
        (lambda t: t + "[dedupe]\n", r"unknown key `dedupe`\nhint: did you mean `dedup`"),
        (
            lambda t: t + "[dedup]\ngroup = []\n",
            r"\[dedup\]: unknown key `group`\nhint: did you mean `groups`",
        ),
        (
            lambda t: t.replace('name = "user_age"', 'name = "user_age"\nfil = 1.0'),
            r"\[\[dense\]\] #1 \(user_age\): unknown key `fil`\nhint: did you mean `fill`",
        ),
        # duplicates across dense and sparse
        (
            lambda t: t.replace('name = "item_id"', 'name = "user_age"'),
            r"feature `user_age` is defined twice",
        ),
        # max_len
        (
            lambda t: t.replace("max_len = 50", "max_len = 0"),
            r"`max_len` must be in \[1, 1000000\], got 0",
        ),
        (
            lambda t: t.replace("max_len = 50", 'max_len = "50"'),
            r"`max_len` must be an integer, got '50'",
        ),
        (lambda t: t.replace("max_len = 50", "max_len = 2.5"), r"`max_len` must be an integer"),
        (
            lambda t: t.replace("max_len = 50\n", ""),
            r"#1 \(user_liked_items\): missing required key `max_len`",
        ),
        # kind
        (
            lambda t: t.replace('kind = "item"', 'kind = "items"'),
            r"`kind` must be one of \['user', 'item', 'context'\], got 'items'\nhint: did you mean `item`",
        ),
        # dedup groups
        (
            lambda t: t + '[dedup]\ngroups = [["user_likes"]]\n',
            r"groups\[0\]: unknown feature `user_likes`",
        ),
        (lambda t: t + '[dedup]\ngroups = [["user_age"]]\n', r"`user_age` is a dense feature"),
        (
            lambda t: t + '[dedup]\ngroups = [["item_id"], ["user_segment", "item_id"]]\n',
            r"groups\[1\]: `item_id` is already in groups\[0\]",
        ),
        (
            lambda t: t + '[dedup]\ngroups = [["item_id", "item_id"]]\n',
            r"`item_id` appears twice in the group",
        ),
        (lambda t: t + "[dedup]\ngroups = [[]]\n", r"groups\[0\]: is empty"),
        (lambda t: t + '[dedup]\ngroups = "item_id"\n', r"`groups` must be a list of lists"),
        # reserved and bad names
        (
            lambda t: t.replace('name = "item_id"', 'name = "ts"'),
            r"feature `ts`: the name is reserved",
        ),
        (
            lambda t: t.replace('name = "item_id"', 'name = "label"'),
            r"feature `label`: the name is reserved",
        ),
        (
            lambda t: t.replace('name = "item_id"', 'name = "item id"'),
            r"`name` must be an identifier",
        ),
        (
            lambda t: t.replace("[dataset]", "[dataset]\nsession_key = 'sid'").replace(
                'name = "item_id"', 'name = "sid"'
            ),
            r"feature `sid`: the name is reserved",
        ),
        # other
        (lambda t: t.replace('name = "feed"\n', ""), r"\[dataset\]: missing required key `name`"),
        (
            lambda t: t.replace('name = "user_age"', 'name = "user_age"\nfill = "zero"'),
            r"`fill` must be a number",
        ),
        (
            lambda t: t.replace('kind = "item"', "kind = 'item'\ntruncate = 1"),
            r"`truncate` must be true or false",
        ),
        (lambda t: t + "[[dense]\n", r"not valid TOML"),
        (lambda t: '[dataset]\nname = "x"\n', r"defines no features"),
    ],
)
def test_validation_errors(edit, match):
    with pytest.raises(SchemaError, match=match):
        parse_schema(edit(BASE), source="feed.toml")


def test_errors_name_the_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text(BASE.replace("max_len = 50", "max_len = -1"))
    with pytest.raises(SchemaError, match=r"bad\.toml \[\[sparse\]\] #1 \(user_liked_items\)"):
        load_schema(path)
    with pytest.raises(SchemaError, match=r"`path`: schema file .*missing\.toml' does not exist"):
        load_schema(tmp_path / "missing.toml")


def test_unknown_feature_lookup():
    with pytest.raises(SchemaError, match=r"no feature `item_ids`\nhint: did you mean `item_id`"):
        parse_schema(BASE).feature("item_ids")


def test_dataclass_validation():
    with pytest.raises(SchemaError, match="`max_len`"):
        SparseFeature("x", "user", 0)
    with pytest.raises(SchemaError, match="`fill` must be finite"):
        DenseFeature("x", float("nan"))


def test_preprocess_tables_are_left_to_the_readers(tmp_path):
    text = default_schema_path().read_text() + (
        '\n[[preprocess]]\ntransform = "hash_modulo"\nfeatures = ["item_id"]\n'
    )
    path = tmp_path / "with_preprocess.toml"
    path.write_text(text)
    assert load_schema(path) == load_schema(default_schema_path())


# DuckDB matches column and JSON-key names ignoring case: such collisions ended in a raw
# `_duckdb.InvalidInputException` (or a dataset `recpipe stats` could not read)
CASE_COLLISIONS = [
    (
        lambda t: t.replace('name = "item_id"', 'name = "User_Segment"'),
        r"feature `User_Segment` collides with feature `user_segment` ignoring case",
    ),
    (
        lambda t: t.replace('name = "user_age"', 'name = "Label"'),
        r"feature `Label` collides with a dataset column or raw-log key `label` ignoring case",
    ),
    (
        lambda t: t.replace('name = "user_age"', 'name = "SESSION_ID"'),
        r"feature `SESSION_ID` collides with a dataset column or raw-log key `session_id`",
    ),
    (
        lambda t: t.replace("[dataset]", "[dataset]\nsession_key = 'sid'").replace(
            'name = "item_id"', 'name = "SID"'
        ),
        r"feature `SID` collides with a dataset column or raw-log key `sid` ignoring case",
    ),
    (
        lambda t: t.replace("[dataset]", "[dataset]\nsession_key = 'SID'\nuser_key = 'sid'"),
        r"\[dataset\]: `user_key` 'sid' collides with `session_key` 'SID' ignoring case",
    ),
    (
        lambda t: t.replace("[dataset]", "[dataset]\ntime_key = 'Request_Id'"),
        r"`time_key` 'Request_Id' collides with `request_id` \(fixed raw-log key\)",
    ),
]


@pytest.mark.parametrize(
    ("edit", "match"),
    CASE_COLLISIONS,
    ids=[
        "feature-feature",
        "dense-label",
        "feature-session_id",
        "feature-session_key",
        "key-key",
        "key-request_id",
    ],
)
def test_names_colliding_ignoring_case_are_refused_naming_both_and_the_file(tmp_path, edit, match):
    path = tmp_path / "case.toml"
    path.write_text(edit(BASE))
    with pytest.raises(SchemaError, match=match) as caught:
        load_schema(path)
    assert str(caught.value).startswith(f"{path}: ")


def test_a_case_collision_stops_the_cli_build_with_the_schema_error(tmp_path, capsys):
    from recpipe_cli import main

    logs = tmp_path / "f.jsonl"
    logs.write_text(
        '{"request_id": "r1", "session_id": "s1", "ts": 1700000000000, '
        '"sparse": {"a": [1], "A": [2]}}\n'
    )
    schema = tmp_path / "s.toml"
    schema.write_text(
        '[dataset]\nname = "x"\n'
        '[[sparse]]\nname = "a"\nkind = "user"\nmax_len = 5\n'
        '[[sparse]]\nname = "A"\nkind = "user"\nmax_len = 5\n'
    )
    rc = main(["etl", "build", str(logs), "--schema", str(schema), "--out", str(tmp_path / "ds")])
    err = capsys.readouterr().err
    assert rc == 1
    assert "s.toml: feature `A` collides with feature `a` ignoring case" in err
    assert not (tmp_path / "ds").exists()
