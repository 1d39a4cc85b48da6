"""Preprocessing transforms, written once against jagged values/offsets.

A sparse transform rewrites one feature's jagged rows::

    values  [N]    ids of all rows, row after row
    offsets [R+1]  row r is values[offsets[r]:offsets[r+1]]

and a dense transform rewrites a ``[B, F]`` float32 block (the columns of its features).

**Row-wise contract.** Output row ``r`` may depend only on input row ``r`` (and the transform's
own parameters), never on other rows or batch statistics. That is what makes deduplicated
preprocessing exact: on an :class:`~recpipe.jagged.InverseKeyedJaggedTensor` the pipeline runs a
sparse transform on the ``U`` unique rows only and keeps the inverse lookup, and expanding the
result equals running the transform on the ``B`` expanded rows.

Writing a custom transform: subclass :class:`SparseTransform` (implement ``apply_jagged``) or
:class:`DenseTransform` (implement ``apply_dense``), make it a dataclass (parameters are its
fields, checked in ``validate()``), and register it so that configs can name it. Keep it row-wise,
return new tensors (inputs may share read-only Arrow buffers: never write into them), and keep
the values dtype::

    from dataclasses import dataclass

    import torch

    from readers.transforms import SparseTransform, register_transform
    from recpipe.jagged import lengths_to_offsets

    @register_transform
    @dataclass
    class DropIds(SparseTransform):
        '''Drop every id >= ``limit`` from each list.'''

        limit: int = 1000

        def apply_jagged(self, values, offsets):
            keep = values < self.limit
            lengths = torch.diff(offsets)
            row = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
            new_lengths = torch.bincount(row[keep], minlength=len(lengths))
            return values[keep], lengths_to_offsets(new_lengths)

A pipeline (:class:`readers.pipeline.Pipeline`) is configured from a dict, a TOML file (``[[preprocess]]`` tables), or the
``[[preprocess]]`` tables of the schema file::

    [[preprocess]]
    transform = "HashModulo"
    features = ["item_id", "item_tags"]
    params = { modulus = 1_000_000 }
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Literal

import torch

from recpipe.errors import DataError, SchemaError
from recpipe.jagged import lengths_to_offsets
from recpipe.kernels.hashing import hash_modulo_tensor

if TYPE_CHECKING:
    from schemas import DatasetSchema

__all__ = [
    "Bucketize",
    "Clamp",
    "DenseTransform",
    "FillMissing",
    "HashModulo",
    "Log1p",
    "Normalize",
    "SparseTransform",
    "Transform",
    "Truncate",
    "VocabLookup",
    "register_transform",
    "transform_registry",
]

_REGISTRY: dict[str, type[Transform]] = {}


def register_transform(cls: type[Transform]) -> type[Transform]:
    """Class decorator: make a transform nameable in configs by its class name."""
    _REGISTRY[cls.__name__] = cls
    return cls


def transform_registry() -> dict[str, type[Transform]]:
    """Name -> class of every registered transform."""
    return dict(_REGISTRY)


@dataclass
class Transform:
    """Base of every transform: the features it applies to.

    Attributes:
        features: names of the features (all sparse, or all dense) the transform rewrites.
    """

    features: tuple[str, ...] = ()
    applies_to: ClassVar[frozenset[str]] = frozenset()

    def __post_init__(self) -> None:
        if isinstance(self.features, str):
            self.features = (self.features,)
        self.features = tuple(self.features)
        if not self.features:
            msg = f"{type(self).__name__}: `features` must name at least one feature"
            raise SchemaError(msg)
        self.validate()

    def validate(self) -> None:
        """Check the parameters; raise :class:`SchemaError` naming the bad one."""


@dataclass
class SparseTransform(Transform):
    """A row-wise rewrite of jagged id lists. Implement :meth:`apply_jagged`.

    ``elementwise`` (default ``False``): the rewrite maps each id on its own and keeps every
    row's length, so it may run once on ids shared by several rows (a partial IKJT's packed
    ids, RecD §7). Set it ``True`` only where that holds.
    """

    applies_to: ClassVar[frozenset[str]] = frozenset({"sparse"})
    elementwise: ClassVar[bool] = False

    def apply_jagged(
        self, values: torch.Tensor, offsets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rewrite rows: ``values`` [N], ``offsets`` [R+1] -> new (values, offsets) of R rows."""
        raise NotImplementedError


@dataclass
class DenseTransform(Transform):
    """A row-wise rewrite of dense features. Implement :meth:`apply_dense`."""

    applies_to: ClassVar[frozenset[str]] = frozenset({"dense"})

    def apply_dense(self, dense: torch.Tensor) -> torch.Tensor:
        """Rewrite a ``[B, F]`` float32 block, column j being ``features[j]``."""
        raise NotImplementedError


def _check(cond: bool, cls: object, name: str, value: object, why: str) -> None:
    if not cond:
        msg = f"{type(cls).__name__}: `{name}` {why}, got {value!r}"
        raise SchemaError(msg)


@register_transform
@dataclass
class HashModulo(SparseTransform):
    """Map ids into ``[0, modulus)``: a salted splitmix64 of the id, mod ``modulus``.

    The hash is :func:`recpipe.kernels.hashing.hash_modulo_tensor` (the same numbers on every
    device and in every release); ``hash=False`` gives the plain modulo.

    Attributes:
        modulus: size of the id space after the transform (an embedding table's rows).
        salt: seeds the hash, so two features can hash differently.
        hash: ``False`` gives the plain ``id mod modulus`` (non-negative).
    """

    elementwise: ClassVar[bool] = True

    modulus: int = 1 << 20
    salt: int = 0
    hash: bool = True

    def validate(self) -> None:
        _check(
            isinstance(self.modulus, int) and self.modulus >= 1, self, "modulus", self.modulus,
            "must be a positive integer",
        )  # fmt: skip

    def apply_jagged(self, values, offsets):
        ids = values.to(torch.int64)
        if self.hash:
            out = hash_modulo_tensor(ids, salt=self.salt, modulus=self.modulus)
        else:
            out = torch.remainder(ids, self.modulus)
        return out.to(values.dtype), offsets


@register_transform
@dataclass
class Truncate(SparseTransform):
    """Keep at most ``max_len`` ids per row: the last ones (most recent) or the first ones."""

    max_len: int = 50
    keep: Literal["last", "first"] = "last"

    def validate(self) -> None:
        _check(
            isinstance(self.max_len, int) and self.max_len >= 0, self, "max_len", self.max_len,
            "must be a non-negative integer",
        )  # fmt: skip
        _check(self.keep in ("last", "first"), self, "keep", self.keep, "must be 'last' or 'first'")

    def apply_jagged(self, values, offsets):
        lengths = torch.diff(offsets)
        if len(lengths) == 0 or int(lengths.max()) <= self.max_len:
            return values, offsets
        new_lengths = lengths.clamp(max=self.max_len)
        new_offsets = lengths_to_offsets(new_lengths)
        starts = offsets[1:] - new_lengths if self.keep == "last" else offsets[:-1]
        # output position i of row r reads values[starts[r] + (i - new_offsets[r])]
        index = torch.repeat_interleave(starts - new_offsets[:-1], new_lengths)
        index += torch.arange(int(new_offsets[-1]), dtype=torch.int64, device=values.device)
        return values[index], new_offsets


@register_transform
@dataclass
class VocabLookup(SparseTransform):
    """Replace raw ids by their index in a vocabulary; unknown ids go to OOV buckets.

    The vocabulary is a text file with one integer id per line (line order = index; blank lines
    and lines starting with ``#`` ignored), or an inline ``vocab`` list. Index ``i`` of the
    vocabulary maps to ``i``; an id not in it maps to ``V + hash(id) mod num_oov_buckets`` (the hash of :class:`HashModulo`, salt 0).

    Attributes:
        path: the vocabulary file.
        vocab: inline vocabulary (instead of ``path``).
        num_oov_buckets: buckets for out-of-vocabulary ids (>= 1).
    """

    elementwise: ClassVar[bool] = True

    path: str | None = None
    vocab: Sequence[int] | None = None
    num_oov_buckets: int = 1
    _keys: torch.Tensor = field(init=False, repr=False, compare=False)
    _index: torch.Tensor = field(init=False, repr=False, compare=False)

    def validate(self) -> None:
        _check(
            (self.path is None) != (self.vocab is None), self, "path", self.path,
            "or `vocab` must be given (exactly one of them)",
        )  # fmt: skip
        _check(
            isinstance(self.num_oov_buckets, int) and self.num_oov_buckets >= 1, self,
            "num_oov_buckets", self.num_oov_buckets, "must be a positive integer",
        )  # fmt: skip
        ids = self._load() if self.path is not None else torch.tensor(list(self.vocab or ()))
        ids = ids.to(torch.int64)
        keys, order = torch.sort(ids, stable=True)
        if len(keys) > 1 and bool((keys[1:] == keys[:-1]).any()):
            dup = int(keys[1:][keys[1:] == keys[:-1]][0])
            msg = f"VocabLookup: vocabulary {self.path or 'vocab'!r} lists id {dup} twice"
            raise SchemaError(msg)
        self._keys, self._index = keys, order

    @property
    def size(self) -> int:
        """Output id space: vocabulary size + OOV buckets."""
        return len(self._keys) + self.num_oov_buckets

    def _load(self) -> torch.Tensor:
        path = os.fspath(self.path)  # type: ignore[arg-type]
        try:
            text = Path(path).read_text()
        except OSError as exc:
            msg = f"VocabLookup: cannot read vocabulary file `path` {path!r}: {exc}"
            raise SchemaError(msg) from exc
        ids = []
        for lineno, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            try:
                ids.append(int(line))
            except ValueError:
                msg = f"{path}: line {lineno}: vocabulary id {line!r} is not an integer"
                raise DataError(msg) from None
        return torch.tensor(ids, dtype=torch.int64)

    def apply_jagged(self, values, offsets):
        ids = values.to(torch.int64)
        vocab_size = len(self._keys)
        if vocab_size == 0:
            out = vocab_size + hash_modulo_tensor(ids, salt=0, modulus=self.num_oov_buckets)
            return out.to(values.dtype), offsets
        pos = torch.searchsorted(self._keys, ids).clamp_(max=vocab_size - 1)
        found = self._keys[pos] == ids
        if self.num_oov_buckets == 1:
            oov = torch.full_like(ids, vocab_size)
        else:
            oov = vocab_size + hash_modulo_tensor(ids, salt=0, modulus=self.num_oov_buckets)
        return torch.where(found, self._index[pos], oov).to(values.dtype), offsets


@dataclass
class _Elementwise(SparseTransform, DenseTransform):
    """A value-by-value rewrite; applies to sparse ids and to dense columns alike."""

    elementwise: ClassVar[bool] = True

    applies_to: ClassVar[frozenset[str]] = frozenset({"sparse", "dense"})

    def _map(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def apply_jagged(self, values, offsets):
        return self._map(values).to(values.dtype), offsets

    def apply_dense(self, dense):
        return self._map(dense).to(dense.dtype)


@register_transform
@dataclass
class Bucketize(_Elementwise):
    """Replace a value by its bucket: ``i`` such that ``boundaries[i-1] <= x < boundaries[i]``.

    Values below ``boundaries[0]`` go to bucket 0, at or above the last boundary to
    ``len(boundaries)``. Dense outputs are the bucket index as float32.
    """

    boundaries: Sequence[float] = ()
    _bounds: torch.Tensor = field(init=False, repr=False, compare=False)

    def validate(self) -> None:
        b = list(self.boundaries)
        _check(
            len(b) > 0 and all(x < y for x, y in itertools.pairwise(b)), self, "boundaries", b,
            "must be a non-empty, strictly increasing list",
        )  # fmt: skip
        self.boundaries = tuple(b)
        self._bounds = torch.tensor(self.boundaries, dtype=torch.float64)

    def _map(self, x):
        return torch.bucketize(x.to(torch.float64), self._bounds.to(x.device), right=True)


@register_transform
@dataclass
class Clamp(_Elementwise):
    """Clamp values into ``[min, max]`` (either bound may be omitted)."""

    min: float | None = None
    max: float | None = None

    def validate(self) -> None:
        _check(
            self.min is not None or self.max is not None, self, "min", self.min,
            "or `max` must be given",
        )  # fmt: skip
        if self.min is not None and self.max is not None:
            _check(self.min <= self.max, self, "min", self.min, f"must be <= `max` ({self.max})")

    def _map(self, x):
        if x.is_floating_point():
            return x.clamp(min=self.min, max=self.max)
        lo = None if self.min is None else math.ceil(self.min)
        hi = None if self.max is None else math.floor(self.max)
        return x.clamp(min=lo, max=hi)


@register_transform
@dataclass
class Log1p(DenseTransform):
    """``log(1 + max(x, 0))``: compresses heavy-tailed counts (DLRM's dense preprocessing)."""

    def apply_dense(self, dense):
        return torch.log1p(dense.clamp(min=0.0))


@register_transform
@dataclass
class Normalize(DenseTransform):
    """``(x - mean) / std`` with fixed statistics (scalars or one per feature)."""

    mean: float | Sequence[float] = 0.0
    std: float | Sequence[float] = 1.0
    _mean: torch.Tensor = field(init=False, repr=False, compare=False)
    _std: torch.Tensor = field(init=False, repr=False, compare=False)

    def validate(self) -> None:
        n = len(self.features)
        for name in ("mean", "std"):
            v = getattr(self, name)
            vals = list(v) if isinstance(v, Sequence) else [v] * n
            _check(len(vals) == n, self, name, v, f"must be a number or a list of {n} numbers")
            _check(all(math.isfinite(x) for x in vals), self, name, v, "must be finite")
            setattr(self, name, tuple(float(x) for x in vals))
        _check(all(s > 0 for s in self.std), self, "std", self.std, "must be > 0")
        # float64 once here; the per-batch cast rounds exactly as building from the floats would
        self._mean = torch.tensor(self.mean, dtype=torch.float64)
        self._std = torch.tensor(self.std, dtype=torch.float64)

    def apply_dense(self, dense):
        mean = self._mean.to(dtype=dense.dtype, device=dense.device)
        std = self._std.to(dtype=dense.dtype, device=dense.device)
        return (dense - mean) / std


@register_transform
@dataclass
class FillMissing(SparseTransform, DenseTransform):
    """Fill missing values: NaN dense values, and empty sparse rows (which become ``[value]``).

    Attributes:
        value: the fill; ``None`` on dense features uses each feature's schema ``fill``.
    """

    applies_to: ClassVar[frozenset[str]] = frozenset({"sparse", "dense"})
    value: float | None = None
    dense_fill: tuple[float, ...] | None = field(default=None, repr=False)

    def validate(self) -> None:
        if self.value is not None:
            _check(math.isfinite(self.value), self, "value", self.value, "must be finite")

    def bind_schema(self, schema: DatasetSchema) -> None:
        """Take the dense fills from the schema when ``value`` is not given."""
        if self.value is None and all(n in schema.dense_names for n in self.features):
            self.dense_fill = tuple(float(schema.feature(n).fill) for n in self.features)

    def apply_dense(self, dense):
        if self.value is not None:
            fill = torch.full((dense.shape[1],), float(self.value), dtype=dense.dtype)
        elif self.dense_fill is not None:
            fill = torch.tensor(self.dense_fill, dtype=dense.dtype)
        else:
            fill = torch.zeros(dense.shape[1], dtype=dense.dtype)
        return torch.where(torch.isnan(dense), fill.to(dense.device), dense)

    def apply_jagged(self, values, offsets):
        lengths = torch.diff(offsets)
        empty = lengths == 0
        if not bool(empty.any()):
            return values, offsets
        fill = 0 if self.value is None else int(self.value)
        new_lengths = torch.where(empty, torch.ones_like(lengths), lengths)
        new_offsets = lengths_to_offsets(new_lengths)
        out = torch.full((int(new_offsets[-1]),), fill, dtype=values.dtype, device=values.device)
        # copy every non-empty row to its new place; the empty ones keep the fill
        shift = torch.repeat_interleave(new_offsets[:-1] - offsets[:-1], lengths)
        out[torch.arange(len(values), device=values.device) + shift] = values
        return out, new_offsets
