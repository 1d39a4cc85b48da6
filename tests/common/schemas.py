"""Schema TOML strings shared by the tests (parse them with ``schemas.parse_schema``)."""

from __future__ import annotations

__all__ = ["SMALL_SCHEMA", "TINY_SCHEMA"]

TINY_SCHEMA = """
[dataset]
name = "tiny"

[[dense]]
name = "user_age"
fill = 30.0

[[dense]]
name = "item_price"
fill = 0.0

[[sparse]]
name = "user_items"
kind = "user"
max_len = 6

[[sparse]]
name = "user_sellers"
kind = "user"
max_len = 4

[[sparse]]
name = "user_segment"
kind = "user"
max_len = 1

[[sparse]]
name = "item_id"
kind = "item"
max_len = 1

[[sparse]]
name = "item_tags"
kind = "item"
max_len = 3

[dedup]
groups = [["user_items", "user_sellers"], ["user_segment"]]
"""
"""2 dense, 5 sparse features (user lists in two dedup groups, two plain item features): the
readers' hand-made datasets."""

SMALL_SCHEMA = """
[dataset]
name = "small"
[[dense]]
name = "age"
[[dense]]
name = "price"
[[sparse]]
name = "liked_items"
kind = "user"
max_len = 6
[[sparse]]
name = "liked_sellers"
kind = "user"
max_len = 4
[[sparse]]
name = "segment"
kind = "user"
max_len = 1
[[sparse]]
name = "item_id"
kind = "item"
max_len = 1
[[sparse]]
name = "item_tags"
kind = "item"
max_len = 3
[dedup]
groups = [["liked_items", "liked_sellers"], ["segment"]]
"""
"""The same shape under short names: the trainer's directly built batches."""
