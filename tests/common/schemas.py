"""Schema TOML strings shared by the tests (parse them with ``schemas.parse_schema``)."""

from __future__ import annotations

__all__ = ["TINY_SCHEMA"]

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
readers' hand-made datasets and the trainer's directly built batches."""
