"""``[dedup] partial``: sparse features read as a partial IKJT (lists that shift by one id)."""

from __future__ import annotations

import pytest

from recpipe.errors import SchemaError
from schemas import parse_schema

BASE = """
[dataset]
name = "p"
[[dense]]
name = "age"
[[sparse]]
name = "recent"
kind = "user"
max_len = 8
[[sparse]]
name = "seg"
kind = "user"
max_len = 1
"""


def test_partial_parses_and_round_trips():
    schema = parse_schema(BASE + '[dedup]\ngroups = [["seg"]]\npartial = ["recent"]\n')
    assert schema.dedup_partial == ("recent",) and schema.dedup_groups == (("seg",),)
    assert parse_schema(schema.to_toml()) == schema
    assert schema.dedup_toml() == '[dedup]\ngroups = [["seg"]]\npartial = ["recent"]\n'
    only = parse_schema(BASE + '[dedup]\npartial = ["recent"]\n')
    assert parse_schema(only.to_toml()) == only  # a [dedup] with no group is written too
    assert schema.with_dedup([]).dedup_partial == ()  # the whole [dedup] is replaced
    assert schema.with_dedup([], ["seg"]).dedup_partial == ("seg",)


@pytest.mark.parametrize(
    ("dedup", "error"),
    [
        ('partial = "recent"', r"\[dedup\] partial: must be a list of sparse feature names"),
        ('partial = ["nope"]', r"\[dedup\] partial: unknown feature `nope`"),
        ('partial = ["age"]', r"`age` is a dense feature"),
        ('partial = ["recent", "recent"]', r"`recent` appears twice"),
        (
            'groups = [["recent"]]\npartial = ["recent"]',
            r"`recent` is already in groups\[0\]; a feature is deduplicated one way\nhint: ",
        ),
        ("partal = []", r"unknown key `partal`\nhint: did you mean `partial`\?"),
    ],
)
def test_bad_partial_is_one_clear_error(dedup, error):
    with pytest.raises(SchemaError, match=error):
        parse_schema(BASE + "[dedup]\n" + dedup + "\n")
