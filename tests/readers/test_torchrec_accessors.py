"""TorchRec-style code runs unchanged on the readers' batches (issue 32, item 1).

TorchRec reads its jagged tensors through methods (``kjt.values()``, ``kjt.keys()``,
``kjt.stride()``, ``jt.offsets()``, ...); recpipe's types have the same methods, so the
functions below, written exactly as a TorchRec user writes them, take a recpipe batch's KJT.
"""

from __future__ import annotations

import pytest
import torch

from readers.dataset import iter_batches
from readers.source import ReaderConfig
from recpipe.errors import DataError, DependencyError
from recpipe.ikjt import PartialInverseKeyedJaggedTensor

CFG = ReaderConfig(batch_size=16)


# -- written as TorchRec users write it (nothing recpipe-specific below) -------------------------
def rows_by_key(kjt) -> dict[str, list[list[int]]]:
    """Every key's rows as Python lists, from the flat accessors."""
    values, lengths = kjt.values(), kjt.lengths()
    out = {}
    for i, key in enumerate(kjt.keys()):
        start = kjt.offset_per_key()[i]
        key_lengths = lengths[i * kjt.stride() : (i + 1) * kjt.stride()].tolist()
        key_values = values[start : start + kjt.length_per_key()[i]].tolist()
        rows, at = [], 0
        for n in key_lengths:
            rows.append(key_values[at : at + n])
            at += n
        out[key] = rows
    return out


def mean_ids_per_row(kjt) -> dict[str, torch.Tensor]:
    """``[B]`` mean id of each row, per key, through ``to_dict()`` and the JaggedTensor methods."""
    out = {}
    for key, jt in kjt.to_dict().items():
        ids, offsets = jt.values().to(torch.float64), jt.offsets()
        sums = torch.zeros(jt.lengths().numel(), dtype=torch.float64)
        sums.index_add_(0, torch.repeat_interleave(jt.lengths()), ids)
        out[key] = sums / (offsets[1:] - offsets[:-1]).clamp(min=1)
    return out


# -- the checks --------------------------------------------------------------------------------
def _kjts(root, schema) -> list:
    """The readers' KJTs: the plain part of every batch, and its whole expanded view."""
    kjts = []
    for batch in iter_batches(root, schema=schema, config=CFG):
        kjts += [batch.kjt, batch.to_plain().kjt]
    return kjts


def test_torchrec_style_code_runs_on_reader_batches(make_dataset, tiny_schema):
    root = make_dataset(num_sessions=12)
    kjts = _kjts(root, tiny_schema)
    assert kjts
    for kjt in kjts:
        assert kjt.lengths().numel() == len(kjt.keys()) * kjt.stride()
        assert kjt.offsets()[-1].item() == kjt.values().numel() == sum(kjt.length_per_key())
        rows = rows_by_key(kjt)
        assert list(rows) == kjt.keys()
        for key, jt in kjt.to_dict().items():  # the reference: recpipe's own per-row view
            assert rows[key] == [r.tolist() for r in jt.to_dense_list()], key
        means = mean_ids_per_row(kjt)
        for key, want in rows.items():
            expect = [sum(r) / len(r) if r else 0.0 for r in want]
            assert means[key].tolist() == pytest.approx(expect), key
    assert {"user_items", "item_id"} <= set(kjts[-1].keys())


def test_dedup_groups_have_the_same_accessors(make_dataset, tiny_schema):
    root = make_dataset(num_sessions=12)
    batch = next(iter(iter_batches(root, schema=tiny_schema, config=CFG)))
    for name, group in batch.ikjts.items():
        assert group.keys() == name.split("+")
        assert group.values().numel() == group.num_values
        assert group.offsets()[-1].item() == group.values().numel()
        assert group.lengths().numel() == len(group.keys()) * group.num_unique
        assert rows_by_key(group.to_kjt()) == rows_by_key(batch.to_plain().kjt.select(group.keys()))
    partial = PartialInverseKeyedJaggedTensor.from_kjt(batch.to_plain().kjt, ["user_items"])
    assert partial.keys() == ["user_items"] and partial.values().dim() == 1


def test_weights_are_absent_and_say_so(make_dataset, tiny_schema):
    root = make_dataset(num_sessions=4)
    kjt = next(iter(iter_batches(root, schema=tiny_schema, config=CFG))).to_plain().kjt
    assert kjt.weights_or_none() is None and kjt["item_id"].weights_or_none() is None
    with pytest.raises(DataError, match=r"has no weights; hint: check `weights_or_none\(\)`"):
        kjt.weights()
    assert kjt.variable_stride_per_key() is False
    assert kjt.stride_per_key() == [kjt.stride()] * len(kjt.keys())


@pytest.mark.torchrec
def test_same_answers_as_on_the_torchrec_kjt(make_dataset, tiny_schema):
    """The TorchRec-style functions give the same answers on the TorchRec KJT that
    ``recpipe.torchrec_interop`` makes of the batch, and every accessor agrees."""
    from recpipe._deps import optional_import

    try:
        optional_import("torchrec.sparse.jagged_tensor", purpose="the TorchRec accessor test")
    except DependencyError as exc:  # pragma: no cover - depends on the environment
        pytest.skip(f"TorchRec cannot be imported here: {exc}")
    from recpipe.torchrec_interop import batch_to_torchrec, jagged_to_torchrec, to_torchrec

    root = make_dataset(num_sessions=12)
    for batch in iter_batches(root, schema=tiny_schema, config=CFG):
        ours = batch.to_plain().kjt
        theirs = to_torchrec(ours)
        assert rows_by_key(theirs) == rows_by_key(ours)
        for key, got in mean_ids_per_row(ours).items():
            torch.testing.assert_close(got, mean_ids_per_row(theirs)[key], rtol=0, atol=0)
        assert theirs.keys() == ours.keys() and theirs.stride() == ours.stride()
        assert theirs.length_per_key() == ours.length_per_key()
        assert theirs.offset_per_key() == ours.offset_per_key()
        for name in ("values", "lengths", "offsets"):
            assert torch.equal(getattr(theirs, name)(), getattr(ours, name)()), name
        jt = ours["user_items"]
        tr_jt = jagged_to_torchrec(jt)
        for name in ("values", "lengths", "offsets"):
            assert torch.equal(getattr(tr_jt, name)(), getattr(jt, name)()), name
        sparse = batch_to_torchrec(batch).sparse_features
        assert rows_by_key(sparse) == rows_by_key(ours)
