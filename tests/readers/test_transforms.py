"""Transforms: semantics, config, and exactness of deduplicated preprocessing (IKJT vs KJT)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from readers.pipeline import Pipeline
from readers.transforms import (
    Bucketize,
    Clamp,
    FillMissing,
    HashModulo,
    Log1p,
    Normalize,
    SparseTransform,
    Truncate,
    VocabLookup,
    register_transform,
    transform_registry,
)
from recpipe.batch import Batch
from recpipe.errors import DataError, SchemaError
from recpipe.ikjt import InverseKeyedJaggedTensor
from recpipe.jagged import JaggedTensor, KeyedJaggedTensor, lengths_to_offsets
from tests.common.tensors import jagged_from_rows, rows_of


# -- semantics ---------------------------------------------------------------------------------
def test_hash_modulo_range_determinism_and_plain_modulo():
    values, offsets = jagged_from_rows([[0, -1, 2**62, -(2**63)], [], [7]])
    t = HashModulo(features=("f",), modulus=1000, salt=3)
    out, offs = t.apply_jagged(values, offsets)
    assert offs is offsets and out.dtype == torch.int64
    assert ((out >= 0) & (out < 1000)).all()
    assert torch.equal(out, t.apply_jagged(values, offsets)[0])
    other, _ = HashModulo(features=("f",), modulus=1000, salt=4).apply_jagged(values, offsets)
    assert not torch.equal(out, other)
    plain, _ = HashModulo(features=("f",), modulus=10, hash=False).apply_jagged(values, offsets)
    assert plain.tolist() == [0, 9, (2**62) % 10, (-(2**63)) % 10, 7]


# HashModulo's outputs before its hash moved to recpipe.kernels.splitmix: they must never change
# (a dataset preprocessed once must map ids to the same rows forever).
GOLDEN_IDS = [0, 1, -1, 7, 123456789, -(2**63), 2**63 - 1, 42]
GOLDEN_HASHES = {
    (0, 1000): [919, 849, 320, 487, 897, 915, 39, 797],
    (7, 1 << 18): [174908, 230773, 163940, 179966, 213852, 195517, 222678, 143268],
    (3, 97): [71, 53, 79, 6, 19, 65, 25, 6],
}


@pytest.mark.parametrize(("salt", "modulus"), list(GOLDEN_HASHES))
def test_hash_modulo_outputs_never_change(salt, modulus):
    values, offsets = jagged_from_rows([GOLDEN_IDS])
    t = HashModulo(features=("f",), modulus=modulus, salt=salt)
    assert t.apply_jagged(values, offsets)[0].tolist() == GOLDEN_HASHES[(salt, modulus)]


def test_truncate_keeps_last_or_first():
    values, offsets = jagged_from_rows([[1, 2, 3, 4], [], [5], [6, 7, 8]])
    out = Truncate(features="f", max_len=2).apply_jagged(values, offsets)
    assert rows_of(*out) == [[3, 4], [], [5], [7, 8]]
    out = Truncate(features="f", max_len=2, keep="first").apply_jagged(values, offsets)
    assert rows_of(*out) == [[1, 2], [], [5], [6, 7]]
    out = Truncate(features="f", max_len=0).apply_jagged(values, offsets)
    assert rows_of(*out) == [[], [], [], []]
    same = Truncate(features="f", max_len=9).apply_jagged(values, offsets)
    assert same[0] is values


def test_vocab_lookup_file_and_oov(tmp_path):
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("# ids\n40\n10\n\n30\n")
    t = VocabLookup(features="f", path=str(vocab))
    assert t.size == 4
    out = t.apply_jagged(*jagged_from_rows([[10, 30, 40, 99], [], [-5]]))
    assert rows_of(*out) == [[1, 2, 0, 3], [], [3]]
    t2 = VocabLookup(features="f", vocab=[10, 30], num_oov_buckets=4)
    out = t2.apply_jagged(*jagged_from_rows([[10, 30, 11, 12, 11]]))
    got = out[0].tolist()
    assert got[:2] == [0, 1] and all(2 <= x < 6 for x in got[2:]) and got[2] == got[4]
    vocab.write_text("1\n2\n1\n")
    with pytest.raises(SchemaError, match="lists id 1 twice"):
        VocabLookup(features="f", path=str(vocab))
    vocab.write_text("1\nabc\n")
    with pytest.raises(DataError, match=r"vocab\.txt: line 2: vocabulary id 'abc'"):
        VocabLookup(features="f", path=str(vocab))
    with pytest.raises(SchemaError, match="cannot read vocabulary file"):
        VocabLookup(features="f", path=str(tmp_path / "missing.txt"))


def test_dense_transforms():
    x = torch.tensor([[-1.0, 0.0], [3.0, float("nan")], [100.0, 2.5]])
    assert torch.allclose(
        Log1p(features=("a", "b")).apply_dense(x)[[0, 2]],
        torch.log1p(torch.tensor([[0.0, 0.0], [100.0, 2.5]])),
    )
    norm = Normalize(features=("a", "b"), mean=[1.0, 2.0], std=2.0).apply_dense(x)
    assert norm[0].tolist() == [-1.0, -1.0]
    clamp = Clamp(features=("a", "b"), min=0.0, max=10.0).apply_dense(x)
    assert clamp[2].tolist() == [10.0, 2.5] and clamp[0, 0] == 0.0
    filled = FillMissing(features=("a", "b"), value=-7.0).apply_dense(x)
    assert filled[1].tolist() == [3.0, -7.0]
    buckets = Bucketize(features=("a", "b"), boundaries=[0.0, 5.0]).apply_dense(x)
    assert buckets[0].tolist() == [0.0, 1.0] and buckets[2].tolist() == [2.0, 1.0]
    assert buckets.dtype == torch.float32


def test_sparse_elementwise_and_fill_missing():
    values, offsets = jagged_from_rows([[1, 50, 7], [], [99]])
    assert rows_of(*Clamp(features="f", min=2, max=60.5).apply_jagged(values, offsets)) == [
        [2, 50, 7], [], [60]
    ]  # fmt: skip
    assert rows_of(*Bucketize(features="f", boundaries=[5, 60]).apply_jagged(values, offsets)) == [
        [0, 1, 1], [], [2]
    ]  # fmt: skip
    assert rows_of(*FillMissing(features="f", value=4).apply_jagged(values, offsets)) == [
        [1, 50, 7], [4], [99]
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("cls", "params", "match"),
    [
        (HashModulo, {"modulus": 0}, "`modulus` must be a positive integer"),
        (Truncate, {"max_len": -1}, "`max_len`"),
        (Truncate, {"keep": "middle"}, "`keep`"),
        (Bucketize, {"boundaries": [3, 1]}, "strictly increasing"),
        (Clamp, {}, "`min` or `max` must be given"),
        (Normalize, {"std": 0.0}, "`std` must be > 0"),
        (Normalize, {"mean": [1.0, 2.0]}, "`mean` must be a number or a list of 1"),
        (VocabLookup, {}, "exactly one"),
    ],
)
def test_bad_parameters(cls, params, match):
    with pytest.raises(SchemaError, match=match):
        cls(features=("f",), **params)


# -- pipelines and configs ---------------------------------------------------------------------
def test_pipeline_from_dict_toml_and_schema_file(tmp_path, tiny_schema):
    from readers.pipeline import load_preprocess_entries

    (tmp_path / "v.txt").write_text("1\n2\n3\n")
    text = """
[[preprocess]]
transform = "VocabLookup"
features = ["user_items"]
params = { path = "v.txt", num_oov_buckets = 2 }

[[preprocess]]
transform = "Normalize"
features = ["item_price"]
params = { mean = 10.0, std = 5.0 }
"""
    (tmp_path / "pre.toml").write_text(text)
    pipe = Pipeline.from_config(tmp_path / "pre.toml", schema=tiny_schema)
    assert [type(t).__name__ for t in pipe.transforms] == ["VocabLookup", "Normalize"]
    assert pipe.transforms[0].size == 5  # relative vocabulary path resolved next to the file
    # the same tables inside a schema file
    (tmp_path / "schema.toml").write_text('[dataset]\nname = "x"\n' + text)
    entries = load_preprocess_entries(tmp_path / "schema.toml")
    assert entries[0]["params"]["path"] == str(tmp_path / "v.txt")
    again = Pipeline.from_config(tmp_path / "schema.toml", schema=tiny_schema)
    assert again.transforms == pipe.transforms
    assert len(Pipeline.from_config(None, schema=tiny_schema)) == 0
    (tmp_path / "bad.toml").write_text("[[preprocess]\n")
    with pytest.raises(SchemaError, match=r"bad\.toml: cannot read the preprocessing config"):
        Pipeline.from_config(tmp_path / "bad.toml", schema=tiny_schema)


def test_pipeline_config_errors(tiny_schema):
    def build(entry):
        return Pipeline.from_config([entry], schema=tiny_schema)

    with pytest.raises(SchemaError, match=r"#1: unknown `transform` 'Nope'"):
        build({"transform": "Nope", "features": ["item_id"]})
    with pytest.raises(SchemaError, match=r"HashModulo has no parameter `params.mod`"):
        build({"transform": "HashModulo", "features": ["item_id"], "params": {"mod": 3}})
    with pytest.raises(SchemaError, match=r"`features` names 'nope', not a feature of the schema"):
        build({"transform": "HashModulo", "features": ["nope"]})
    with pytest.raises(SchemaError, match=r"applies to \['dense'\] features"):
        build({"transform": "Log1p", "features": ["item_id"]})
    with pytest.raises(SchemaError, match="mixes dense and sparse"):
        build({"transform": "Clamp", "features": ["item_id", "user_age"], "params": {"min": 0}})
    with pytest.raises(SchemaError, match="unknown key"):
        build({"transform": "Log1p", "features": ["user_age"], "param": {}})
    with pytest.raises(SchemaError, match="`features` must be a non-empty list"):
        build({"transform": "Log1p", "features": []})


def test_config_errors_name_file_table_key_and_the_closest_name(tmp_path, tiny_schema):
    """Regression: errors named neither the file nor offered the name that was meant."""
    good = '[[preprocess]]\ntransform = "Log1p"\nfeatures = ["user_age"]\n\n'
    cases = [
        ('transfrom = "Log1p"\nfeatures = ["user_age"]\n',
         r"unknown key `transfrom` \(did you mean `transform`\?\)\nhint: the keys are transform"),
        ('transform = "HashModulus"\nfeatures = ["item_id"]\n',
         r"unknown `transform` 'HashModulus' \(did you mean `HashModulo`\?\)\nhint: registered"),
        ('transform = "HashModulo"\nfeatures = ["item_id"]\nparams = { modulo = 7 }\n',
         r"HashModulo has no parameter `params.modulo` \(did you mean `modulus`\?\)\n"
         r"hint: HashModulo takes hash, modulus, salt"),
        ('transform = "HashModulo"\nfeatures = ["item_ids"]\n',
         r"\(HashModulo\): `features` names 'item_ids', not a feature of the schema "
         r"\(did you mean `item_id`\?\)"),
        ('features = ["item_id"]\n', r"missing required key `transform`"),
        ('transform = "HashModulo"\nfeatures = ["item_id"]\nparams = 3\n',
         r"`params` must be a table"),
        ('transform = "HashModulo"\nfeatures = ["item_id"]\nparams = { modulus = 0 }\n',
         r"HashModulo: `modulus` must be a positive integer, got 0"),
    ]  # fmt: skip
    for body, match in cases:
        path = tmp_path / "pre.toml"
        path.write_text(good + "[[preprocess]]\n" + body)
        with pytest.raises(
            SchemaError, match=re.escape(f"{path} [[preprocess]] #2") + r".*" + match
        ):
            Pipeline.from_config(path, schema=tiny_schema)
    (tmp_path / "flat.toml").write_text("preprocess = [1]\n")
    with pytest.raises(SchemaError, match=r"flat\.toml \[\[preprocess\]\] #1: must be a table"):
        Pipeline.from_config(tmp_path / "flat.toml", schema=tiny_schema)


def test_fill_missing_uses_schema_fill(tiny_schema):
    pipe = Pipeline.from_config(
        {"preprocess": [{"transform": "FillMissing", "features": ["user_age", "item_price"]}]},
        schema=tiny_schema,
    )
    dense = torch.tensor([[float("nan"), float("nan")], [1.0, 2.0]])
    out = pipe.apply_dense(dense)
    assert out.tolist() == [[30.0, 0.0], [1.0, 2.0]]
    assert math.isnan(dense[0, 0])  # the input is not modified


# The custom transform of the module docstring, verbatim.
@register_transform
@dataclass
class DropIds(SparseTransform):
    """Drop every id >= ``limit`` from each list."""

    limit: int = 1000

    def apply_jagged(self, values, offsets):
        keep = values < self.limit
        lengths = torch.diff(offsets)
        row = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
        new_lengths = torch.bincount(row[keep], minlength=len(lengths))
        return values[keep], lengths_to_offsets(new_lengths)


def test_custom_transform_by_name(tiny_schema):
    assert transform_registry()["DropIds"] is DropIds
    pipe = Pipeline.from_config(
        [{"transform": "DropIds", "features": ["user_items"], "params": {"limit": 5}}],
        schema=tiny_schema,
    )
    out = pipe.apply_jagged("user_items", *jagged_from_rows([[1, 9, 3], [7], []]))
    assert rows_of(*out) == [[1, 3], [], []]


# -- exactness: preprocessing an IKJT then expanding == preprocessing the expanded KJT ---------
_ids = st.integers(min_value=-(2**63), max_value=2**63 - 1) | st.integers(0, 12)
_row = st.lists(_ids, max_size=7)


@st.composite
def _group_batch(draw):
    """B rows of a two-key group drawn from U distinct templates (so rows repeat)."""
    u = draw(st.integers(1, 6))
    templates = draw(st.lists(st.tuples(_row, _row), min_size=u, max_size=u))
    inverse = draw(st.lists(st.integers(0, u - 1), min_size=0, max_size=20))
    rows_a = [templates[i][0] for i in inverse]
    rows_b = [templates[i][1] for i in inverse]
    return rows_a, rows_b


def _transforms(vocab_path: str) -> list:
    keys = ("user_items", "user_sellers")
    return [
        HashModulo(features=keys, modulus=97, salt=1),
        HashModulo(features=keys, modulus=10, hash=False),
        Truncate(features=keys, max_len=2),
        Truncate(features=keys, max_len=1, keep="first"),
        VocabLookup(features=keys, path=vocab_path, num_oov_buckets=3),
        Bucketize(features=keys, boundaries=[0, 5, 10]),
        Clamp(features=keys, min=0, max=8),
        FillMissing(features=keys, value=-1),
        DropIds(features=keys, limit=6),
    ]


def _batches(schema, rows_a, rows_b):
    b = len(rows_a)
    features = {
        "user_items": JaggedTensor(*jagged_from_rows(rows_a)),
        "user_sellers": JaggedTensor(*jagged_from_rows(rows_b)),
    }
    plain_kjt = KeyedJaggedTensor.from_jagged_dict(features, stride=b)
    empty = KeyedJaggedTensor(
        [], torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64), stride=b
    )
    common = {"dense": torch.zeros(b, 2), "labels": torch.zeros(b), "session_ids": torch.arange(b)}
    if b == 0:
        ikjt = InverseKeyedJaggedTensor.from_kjt(plain_kjt)
    else:
        ikjt = InverseKeyedJaggedTensor.from_jagged(features)
    dedup = Batch(kjt=empty, ikjts={"g": ikjt}, **common)
    plain = Batch(kjt=plain_kjt, **common)
    return dedup, plain


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=_group_batch())
def test_dedup_preprocessing_is_exact_for_every_transform(tmp_path, tiny_schema, data):
    rows_a, rows_b = data
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(str(i) for i in (3, 1, 4, 5, 9, 2, 6)))
    dedup, plain = _batches(tiny_schema, rows_a, rows_b)
    for step in _transforms(str(vocab)):
        pipe = Pipeline([step], schema=tiny_schema)
        got = pipe(dedup)
        want = pipe(plain)
        assert isinstance(got.ikjts["g"], InverseKeyedJaggedTensor)
        assert torch.equal(got.ikjts["g"].inverse_lookup, dedup.ikjts["g"].inverse_lookup)
        assert got.ikjts["g"].num_unique == dedup.ikjts["g"].num_unique
        assert got.to_plain().kjt.equals(want.kjt), type(step).__name__


def test_dedup_preprocessing_runs_on_unique_rows_only(tiny_schema):
    seen = []

    @dataclass
    class Spy(SparseTransform):
        def apply_jagged(self, values, offsets):
            seen.append(len(offsets) - 1)
            return values, offsets

    rows = [[1, 2]] * 5 + [[3]] * 3
    dedup, _ = _batches(tiny_schema, rows, [[0]] * 8)
    Pipeline([Spy(features=("user_items",))], schema=tiny_schema)(dedup)
    assert seen == [2]


def test_pipeline_on_converted_batches(make_table, tiny_schema, tmp_path):
    from readers.convert import BatchConverter

    (tmp_path / "v.txt").write_text("\n".join(str(i) for i in range(0, 50, 3)))
    pipe = Pipeline.from_config(
        [
            {"transform": "HashModulo", "features": ["item_id", "item_tags"], "params": {"modulus": 64}},
            {"transform": "Truncate", "features": ["user_items"], "params": {"max_len": 3}},
            {"transform": "VocabLookup", "features": ["user_items"], "params": {"path": str(tmp_path / "v.txt")}},
            {"transform": "FillMissing", "features": ["user_age"]},
            {"transform": "Normalize", "features": ["user_age", "item_price"], "params": {"mean": 20.0, "std": 10.0}},
        ],
        schema=tiny_schema,
    )  # fmt: skip
    table = make_table(num_sessions=30, seed=4)
    dedup = pipe(BatchConverter(tiny_schema)(table))
    plain = pipe(BatchConverter(tiny_schema, dedup=False)(table))
    expanded = dedup.to_plain()
    for key in tiny_schema.sparse_names:
        assert expanded.kjt[key].equals(plain.kjt[key]), key
    assert torch.equal(dedup.dense, plain.dense)
    assert not torch.isnan(dedup.dense).any()
