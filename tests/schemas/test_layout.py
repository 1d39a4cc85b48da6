"""Schema settings for logs in another layout: `layout` and the `[keys]` mapping."""

from __future__ import annotations

import pytest

from recpipe.errors import SchemaError
from schemas import PASSTHROUGH_COLUMNS, parse_schema

BASE = """
[dataset]
name = "x"
{dataset}
{keys}
[[dense]]
name = "user_age"
[[sparse]]
name = "item_id"
kind = "item"
max_len = 1
"""


def _schema(dataset: str = "", keys: str = ""):
    return parse_schema(BASE.format(dataset=dataset, keys=keys), source="s.toml")


def test_defaults_are_the_nested_layout_without_mapping():
    s = _schema()
    assert s.layout == "nested" and s.raw_keys == () and not s.remapped
    assert s.raw_key("user_age") == "user_age"


def test_flat_layout_and_keys_round_trip_through_toml():
    s = _schema('layout = "flat"', '[keys]\nrequest_id = "req"\nuser_age = "age"')
    assert s.remapped and s.raw_key("request_id") == "req" and s.raw_key("user_age") == "age"
    assert parse_schema(s.to_toml()) == s
    hash(s)  # still a frozen, hashable value


def test_dataset_arrow_schema_appends_the_pass_through_strings():
    s = _schema()
    arrow = s.dataset_arrow_schema()
    assert arrow.names == [*s.arrow_schema().names, *PASSTHROUGH_COLUMNS]
    assert all(str(arrow.field(n).type) == "string" for n in PASSTHROUGH_COLUMNS)


@pytest.mark.parametrize(
    ("dataset", "keys", "match"),
    [
        ('layout = "flta"', "", r"(?s)s\.toml: \[dataset\]: `layout` must be one of .*did you mean `flat`"),
        ("", '[keys]\nuser_agee = "a"', r"(?s)s\.toml: \[keys\] user_agee: unknown name .*did you mean `user_age`"),
        ("", '[keys]\nts = "t"', r"\[keys\] ts: unknown name `ts`\nhint: set `time_key` in \[dataset\]"),
        ("", '[keys]\nuser_age = ""', r"\[keys\] user_age: the raw-log key must be a non-empty string"),
        ("", '[keys]\nuser_age = "a"\nitem_id = "a"', r"raw-log key 'a' is also mapped to `user_age`"),
        ('time_key = "request_id"', "", r"collides with `request_id`"),
        ('session_key = "user_id"\nuser_key = "uid"', "", r"`session_key` 'user_id' is the name of a pass-through column"),
    ],
)  # fmt: skip
def test_bad_layout_settings_name_file_table_and_key(dataset, keys, match):
    with pytest.raises(SchemaError, match=match):
        _schema(dataset, keys)
