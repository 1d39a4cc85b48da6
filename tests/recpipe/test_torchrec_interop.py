"""Round trips with TorchRec's KeyedJaggedTensor, including inverse_indices (variable batch)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recpipe._deps import optional_import
from recpipe.batch import Batch
from recpipe.errors import DataError, DependencyError
from recpipe.ikjt import InverseKeyedJaggedTensor, PartialInverseKeyedJaggedTensor
from recpipe.jagged import JaggedTensor, KeyedJaggedTensor
from tests.common.tensors import kjt_from_rows

try:
    trj = optional_import("torchrec.sparse.jagged_tensor", purpose="the TorchRec interop tests")
except DependencyError as exc:  # pragma: no cover - depends on the environment
    pytest.skip(f"TorchRec cannot be imported here: {exc}", allow_module_level=True)

from recpipe.torchrec_interop import (
    batch_to_torchrec,
    from_torchrec,
    ikjt_from_torchrec,
    ikjt_to_torchrec,
    jagged_from_torchrec,
    jagged_to_torchrec,
    to_torchrec,
)

pytestmark = pytest.mark.torchrec


USER = {"liked": [[1, 2], [1, 2], [3], [3], [1, 2]], "seller": [[7], [7], [8], [8], [7]]}


@st.composite
def batches(draw):
    dtype = draw(st.sampled_from([np.int32, np.int64]))
    batch = draw(st.integers(0, 8))
    protos = draw(st.lists(st.lists(st.integers(0, 9), max_size=4), min_size=1, max_size=3))
    rows = {
        f"f{k}": [protos[draw(st.integers(0, len(protos) - 1))] for _ in range(batch)]
        for k in range(draw(st.integers(1, 3)))
    }
    return rows, dtype


@settings(max_examples=30, deadline=None)
@given(batches())
def test_kjt_round_trip_shares_tensors(case):
    rows, dtype = case
    kjt = kjt_from_rows(rows, dtype)
    tr = to_torchrec(kjt)
    assert tr.keys() == kjt.keys() and tr.stride() == kjt.stride()
    assert tr.values().data_ptr() == kjt.values().data_ptr()
    assert tr.lengths().data_ptr() == kjt.lengths().data_ptr()
    back = from_torchrec(tr)
    assert back.equals(kjt) and back.values().data_ptr() == kjt.values().data_ptr()
    for key in kjt.keys():
        assert torch.equal(tr[key].values(), kjt[key].values())


def test_from_torchrec_of_a_torchrec_built_kjt():
    tr = trj.KeyedJaggedTensor.from_lengths_sync(
        keys=["a", "b"],
        values=torch.tensor([1, 2, 3, 4, 5]),
        lengths=torch.tensor([2, 0, 1, 2], dtype=torch.int32),
    )
    kjt = from_torchrec(tr)
    assert kjt.lengths().dtype == torch.int64
    assert kjt.equals(kjt_from_rows({"a": [[1, 2], []], "b": [[3], [4, 5]]}))


def test_jagged_round_trip():
    jt = JaggedTensor.from_lengths(torch.tensor([4, 5, 6]), torch.tensor([1, 0, 2]))
    tr = jagged_to_torchrec(jt)
    assert tr.lengths().tolist() == [1, 0, 2]
    assert jagged_from_torchrec(tr).equals(jt)


@settings(max_examples=30, deadline=None)
@given(batches())
def test_ikjt_round_trip_and_inverse_expansion(case):
    rows, dtype = case
    kjt = kjt_from_rows(rows, dtype)
    ikjt = InverseKeyedJaggedTensor.from_kjt(kjt)
    tr = ikjt_to_torchrec(ikjt)
    assert tr.variable_stride_per_key() and tr.stride() == ikjt.batch_size
    assert tr.stride_per_key() == [ikjt.num_unique] * len(ikjt.keys())
    assert ikjt_from_torchrec(tr).equals(ikjt)
    # expanding TorchRec's unique rows with its own inverse_indices gives our to_kjt()
    inv_keys, inverse = tr.inverse_indices()
    expanded = {}
    for key in inv_keys:
        unique = jagged_from_torchrec(tr[key])
        expanded[key] = unique.index_select(inverse[inv_keys.index(key)])
    assert KeyedJaggedTensor.from_jagged_dict(expanded, stride=kjt.stride()).equals(ikjt.to_kjt())
    assert ikjt.to_kjt().equals(kjt)


def test_embedding_bag_collection_pools_ikjt_like_the_expanded_kjt():
    ebc_mod = optional_import("torchrec.modules.embedding_modules")
    cfg_mod = optional_import("torchrec.modules.embedding_configs")
    torch.manual_seed(0)
    ebc = ebc_mod.EmbeddingBagCollection(
        tables=[
            cfg_mod.EmbeddingBagConfig(
                name="t", embedding_dim=4, num_embeddings=10, feature_names=["liked", "seller"]
            )
        ]
    )
    ikjt = InverseKeyedJaggedTensor.from_kjt(kjt_from_rows(USER))
    assert ikjt.num_unique == 2
    dedup = ebc(ikjt_to_torchrec(ikjt)).values()  # (B, 2 * 4), pooled on U rows then expanded
    plain = ebc(to_torchrec(ikjt.to_kjt())).values()
    assert dedup.shape == (5, 8)
    assert torch.equal(dedup, plain)


def test_batch_to_torchrec_is_the_expanded_view():
    ikjt = InverseKeyedJaggedTensor.from_kjt(kjt_from_rows(USER))
    plain = kjt_from_rows({"item": [[1], [2], [3], [4], [5]]})
    batch = Batch(torch.ones(5, 3), torch.zeros(5), plain, {"user": ikjt})
    tr = batch_to_torchrec(batch)
    assert from_torchrec(tr.sparse_features).equals(batch.to_plain().kjt)
    assert torch.equal(tr.dense_features, batch.dense)


def test_what_torchrec_cannot_express_is_refused():
    ikjt = InverseKeyedJaggedTensor.from_kjt(kjt_from_rows(USER))
    with pytest.raises(DataError, match="variable batch per key"):
        from_torchrec(ikjt_to_torchrec(ikjt))
    with pytest.raises(DataError, match="no `inverse_indices`"):
        ikjt_from_torchrec(to_torchrec(kjt_from_rows(USER)))
    weighted = trj.KeyedJaggedTensor(
        keys=["a"], values=torch.tensor([1]), weights=torch.tensor([0.5]), lengths=torch.tensor([1])
    )
    with pytest.raises(DataError, match="weights"):
        from_torchrec(weighted)
    partial = PartialInverseKeyedJaggedTensor.from_kjt(kjt_from_rows({"h": [[1, 2], [2, 3]]}))
    with pytest.raises(DataError, match="partial IKJT"):
        ikjt_to_torchrec(partial)
    # two keys deduplicated separately: their inverse rows differ, so they are not one group
    tr = trj.KeyedJaggedTensor(
        keys=["a", "b"],
        values=torch.tensor([1, 2, 3, 4]),
        lengths=torch.tensor([1, 1, 1, 1]),
        stride_per_key_per_rank=[[2], [2]],
        inverse_indices=(["a", "b"], torch.tensor([[0, 1, 1], [0, 0, 1]])),
    )
    with pytest.raises(DataError, match="different inverse indices"):
        ikjt_from_torchrec(tr)
    with pytest.raises(DataError, match="must be a torchrec KeyedJaggedTensor"):
        from_torchrec(kjt_from_rows(USER))
    no_keys = trj.KeyedJaggedTensor(
        keys=[],
        values=torch.empty(0, dtype=torch.int64),
        lengths=torch.empty(0, dtype=torch.int64),
        stride=2,
        stride_per_key_per_rank=[],
        inverse_indices=([], torch.empty(0, 2, dtype=torch.int64)),
    )
    with pytest.raises(DataError, match="`kjt` has no keys"):
        ikjt_from_torchrec(no_keys)
