"""Preprocessing a partial IKJT (lists that shift by one id): element-wise steps run once on the
packed ids and give what they give on the expanded lists; a step that changes lengths is refused
by name."""

from __future__ import annotations

import pytest
import torch

from readers.pipeline import Pipeline
from readers.transforms import HashModulo, Truncate, VocabLookup
from recpipe.batch import Batch
from recpipe.errors import DataError
from recpipe.ikjt import PartialInverseKeyedJaggedTensor
from recpipe.jagged import KeyedJaggedTensor
from tests.common.tensors import kjt_from_rows

ITEMS = [[11, 12], [11, 12, 13], [12, 13, 14], [13, 14, 15], [], [19], [19, 18]]
SELLERS = [[5], [6, 5], [], [7, 7, 7], [1], [2], [3, 3]]


def _batches() -> tuple[Batch, Batch]:
    kjt = kjt_from_rows({"user_items": ITEMS, "user_sellers": SELLERS})
    b = len(ITEMS)
    common = {"dense": torch.zeros(b, 2), "labels": torch.zeros(b)}
    partial = PartialInverseKeyedJaggedTensor.from_kjt(kjt, ["user_items", "user_sellers"])
    empty = KeyedJaggedTensor.from_jagged_dict({}, stride=b)
    return Batch(kjt=empty, ikjts={"p": partial}, **common), Batch(kjt=kjt, **common)


def test_elementwise_steps_on_packed_ids_equal_the_expanded_lists(tiny_schema):
    steps = [
        HashModulo(features=("user_items",), modulus=7, salt=3),
        VocabLookup(features=("user_sellers",), vocab=(5, 6, 7)),
    ]
    pipe = Pipeline(steps, schema=tiny_schema)
    partial, plain = _batches()
    got = pipe(partial).ikjts["p"]
    want = pipe(plain).kjt
    assert isinstance(got, PartialInverseKeyedJaggedTensor)
    assert got.values().numel() == partial.ikjts["p"].values().numel()  # still packed
    expanded = got.to_kjt()
    for key in ("user_items", "user_sellers"):
        assert torch.equal(expanded[key].values(), want[key].values()), key
        assert torch.equal(expanded[key].offsets(), want[key].offsets()), key


def test_a_step_that_changes_lengths_is_refused_on_a_partial_group(tiny_schema):
    pipe = Pipeline([Truncate(features=("user_items",), max_len=1)], schema=tiny_schema)
    partial, _ = _batches()
    with pytest.raises(
        DataError, match=r"'user_items' as a partial IKJT.*Truncate changes lengths"
    ):
        pipe(partial)


def test_keys_reading_the_same_packed_ids_are_refused():
    """`b`'s window lies inside `a`'s: an element-wise step on `a` would rewrite `b`'s ids too."""
    group = PartialInverseKeyedJaggedTensor(
        ("a", "b"), torch.tensor([1, 2, 3]), torch.tensor([0, 1]), torch.tensor([3, 1])
    )
    with pytest.raises(DataError, match="keys 'a' and 'b' of the partial IKJT read the same"):
        group.map_key_values("a", lambda ids: ids + 1)
