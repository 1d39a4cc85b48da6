"""The preprocessing pipeline: ``[[preprocess]]`` configs parsed into transforms
(:func:`transform_from_config`, :func:`load_preprocess_entries`, errors with file, table, key and
"did you mean") and :class:`Pipeline`, which runs them on batches, deduplicated groups on their
unique rows. The transforms themselves are in :mod:`readers.transforms`.
"""

from __future__ import annotations

import difflib
import os
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from readers.fitted import apply_fitted
from readers.transforms import (
    DenseTransform,
    FillMissing,
    SparseTransform,
    Transform,
    transform_registry,
)
from recpipe.batch import Batch
from recpipe.errors import DataError, SchemaError
from recpipe.ikjt import InverseKeyedJaggedTensor, PartialInverseKeyedJaggedTensor
from recpipe.jagged import JaggedTensor, KeyedJaggedTensor

if TYPE_CHECKING:
    from schemas import DatasetSchema

__all__ = ["Pipeline", "PipelineSource", "load_preprocess_entries", "transform_from_config"]


_ENTRY_KEYS = ("transform", "features", "params")


def _did_you_mean(name: str, choices: Sequence[str]) -> str:
    """`` (did you mean `x`?)`` for the closest of ``choices``, or ``""``."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f" (did you mean `{close[0]}`?)" if close else ""


def _fail(where: str, message: str, hint: str | None = None) -> SchemaError:
    text = f"{where}: {message}"
    return SchemaError(text if hint is None else f"{text}\nhint: {hint}")


def transform_from_config(entry: Mapping[str, Any], *, where: str = "preprocess") -> Transform:
    """Build one transform from ``{"transform": name, "features": [...], "params": {...}}``.

    Args:
        entry: one ``[[preprocess]]`` table.
        where: names the table in messages, e.g. ``"pre.toml [[preprocess]] #2"``.

    Raises:
        SchemaError: a missing or unknown key, an unknown transform or parameter (with the
            closest name: "did you mean"), or a bad value; the message starts with ``where``.
    """
    if not isinstance(entry, Mapping):
        msg = f"must be a table ({{transform = ..., features = [...]}}), got {entry!r}"
        raise _fail(where, msg)
    for key in entry:
        if key not in _ENTRY_KEYS:
            hint = f"the keys are {', '.join(_ENTRY_KEYS)}"
            raise _fail(where, f"unknown key `{key}`{_did_you_mean(key, _ENTRY_KEYS)}", hint)
    if "transform" not in entry:
        raise _fail(
            where, "missing required key `transform`", f"one of {sorted(transform_registry())}"
        )
    name = entry["transform"]
    registry = transform_registry()
    cls = registry.get(str(name))
    if cls is None:
        msg = f"unknown `transform` {name!r}{_did_you_mean(str(name), sorted(registry))}"
        raise _fail(where, msg, f"registered transforms: {', '.join(sorted(registry))}")
    features = entry.get("features")
    if isinstance(features, str):
        features = [features]
    if not isinstance(features, list | tuple) or not features:
        msg = f"`features` must be a non-empty list of feature names, got {features!r}"
        raise _fail(where, msg)
    params = entry.get("params") or {}
    if not isinstance(params, Mapping):
        raise _fail(where, f"`params` must be a table ({{name = value}}), got {params!r}")
    allowed = sorted(
        f.name
        for f in fields(cls)
        if f.init and not f.name.startswith("_") and f.name not in ("features", "dense_fill")
    )
    for key in params:
        if key not in allowed:
            msg = f"{name} has no parameter `params.{key}`{_did_you_mean(key, allowed)}"
            raise _fail(where, msg, f"{name} takes {', '.join(allowed) or 'no parameters'}")
    try:
        return cls(features=tuple(features), **params)
    except SchemaError as exc:
        raise _fail(where, str(exc)) from exc
    except (TypeError, ValueError) as exc:
        raise _fail(where, f"bad parameters for {name}: {exc}") from exc


def load_preprocess_entries(source: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Read the ``[[preprocess]]`` tables of a TOML file (a pipeline config or a schema file).

    Relative vocabulary paths are resolved against the file's folder.

    Raises:
        SchemaError: the file cannot be read or is not TOML, ``preprocess`` is not an array of
            tables, or an entry's ``params`` is not a table (messages name the file).
    """
    path = Path(source)
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        msg = f"{path}: cannot read the preprocessing config: {exc}"
        raise SchemaError(msg) from exc
    entries = data.get("preprocess", [])
    if not isinstance(entries, list):
        msg = f"{path}: `preprocess` must be an array of tables ([[preprocess]])"
        raise SchemaError(msg)
    out = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, Mapping):
            raise _fail(f"{path} [[preprocess]] #{i + 1}", f"must be a table, got {entry!r}")
        entry = dict(entry)
        params = entry.get("params") or {}
        if not isinstance(params, Mapping):
            msg = f"`params` must be a table ({{name = value}}), got {params!r}"
            raise _fail(f"{path} [[preprocess]] #{i + 1}", msg)
        params = dict(params)
        vocab_path = params.get("path")
        if isinstance(vocab_path, str) and not os.path.isabs(vocab_path):
            params["path"] = os.fspath(path.parent / vocab_path)
        if params:
            entry["params"] = params
        out.append(entry)
    return out


PipelineSource = Mapping[str, Any] | Sequence[Mapping[str, Any]] | str | os.PathLike[str] | None


class Pipeline:
    """An ordered list of transforms applied to batches, deduplicated groups on unique rows.

    For each sparse feature the steps naming it run in config order on its (values, offsets):
    on the B rows when the feature is in ``batch.kjt``, on the U unique rows when it is in a
    dedup group (the IKJT keeps its inverse lookup). Dense steps rewrite their columns of
    ``batch.dense``. Everything is checked against the schema once, here.

    Args:
        transforms: the steps, in order.
        schema: the dataset schema (feature kinds, dense column order, dense fills).
        where: names each step in messages (default ``"preprocess step N (Name)"``;
            :meth:`from_config` gives the file and the ``[[preprocess]]`` table).

    Raises:
        SchemaError: a step names an unknown feature (with the closest name of the schema) or
            one of the wrong kind.
    """

    def __init__(
        self,
        transforms: Sequence[Transform],
        *,
        schema: DatasetSchema,
        where: Sequence[str] | None = None,
    ) -> None:
        self.transforms = list(transforms)
        self.schema = schema
        dense_index = {n: i for i, n in enumerate(schema.dense_names)}
        sparse = set(schema.sparse_names)
        self._sparse: dict[str, list[SparseTransform]] = {}
        self._dense: list[tuple[DenseTransform, torch.Tensor]] = []
        for i, step in enumerate(self.transforms):
            label = f"preprocess step {i + 1}" if where is None else where[i]
            where_i = f"{label} ({type(step).__name__})"
            if not isinstance(step, Transform):
                raise _fail(where_i, f"not a Transform: {step!r}")
            kinds = {"dense" if n in dense_index else "sparse" if n in sparse else None
                     for n in step.features}  # fmt: skip
            if None in kinds:
                bad = next(n for n in step.features if n not in dense_index and n not in sparse)
                msg = f"`features` names {bad!r}, not a feature of the schema"
                msg += _did_you_mean(bad, schema.feature_names)
                raise _fail(
                    where_i, msg, f"the schema's features: {', '.join(schema.feature_names)}"
                )
            if len(kinds) > 1:
                msg = f"`features` mixes dense and sparse features {list(step.features)}"
                raise _fail(where_i, msg)
            kind = kinds.pop()
            if kind not in step.applies_to:
                msg = (
                    f"applies to {sorted(step.applies_to)} features, but "
                    f"{list(step.features)} are {kind}"
                )
                raise _fail(where_i, msg)
            if isinstance(step, FillMissing):
                step.bind_schema(schema)
            if kind == "dense":
                cols = torch.tensor([dense_index[n] for n in step.features], dtype=torch.int64)
                self._dense.append((step, cols))  # type: ignore[arg-type]
            else:
                for name in step.features:
                    self._sparse.setdefault(name, []).append(step)  # type: ignore[arg-type]

    @classmethod
    def from_config(
        cls,
        config: PipelineSource,
        *,
        schema: DatasetSchema,
        dataset: str | os.PathLike[str] | None = None,
        fitted: str | os.PathLike[str] | None = None,
    ) -> Pipeline:
        """Build from ``[[preprocess]]`` entries: a dict with a ``preprocess`` list, a list of
        entries, a TOML file (a pipeline config, or a schema file with ``[[preprocess]]``
        tables), or ``None`` (no steps).

        Entries with a ``fit`` key take their fitted parameters from the fitted state file
        ``fitted`` (``recpipe fit --out``), or else from the dataset directory ``dataset`` (what
        ``recpipe fit`` wrote there); a state fitted for another config or on another dataset
        is refused (see :mod:`readers.fitted`)."""
        origin = ""
        if config is None:
            entries: Sequence[Mapping[str, Any]] = []
        elif isinstance(config, str | os.PathLike):
            entries = load_preprocess_entries(config)
            origin = f"{os.fspath(config)} "
        elif isinstance(config, Mapping):
            entries = config.get("preprocess", [])
        else:
            entries = config
        if not isinstance(entries, Sequence) or isinstance(entries, str):
            msg = f"{origin}`preprocess` must be an array of tables ([[preprocess]])"
            raise SchemaError(msg)
        if fitted is not None and not any(isinstance(e, Mapping) and "fit" in e for e in entries):
            msg = (
                f"`fitted` {os.fspath(fitted)!r} is given, but {origin or 'the config '}has no "
                "[[preprocess]] entry with a `fit` key to fill from it"
            )
            raise SchemaError(msg)
        entries, where = apply_fitted(entries, dataset=dataset, fitted=fitted, origin=origin)
        steps = [transform_from_config(e, where=w) for e, w in zip(entries, where)]
        return cls(steps, schema=schema, where=where)

    def __len__(self) -> int:
        return len(self.transforms)

    @property
    def sparse_features(self) -> tuple[str, ...]:
        """Sparse features some step rewrites."""
        return tuple(self._sparse)

    def apply_jagged(
        self, name: str, values: torch.Tensor, offsets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run every step of sparse feature ``name`` on its rows, in order."""
        for step in self._sparse.get(name, ()):
            values, offsets = step.apply_jagged(values, offsets)
        return values, offsets

    def apply_dense(self, dense: torch.Tensor) -> torch.Tensor:
        """Run the dense steps on a ``[B, F]`` block (a new tensor; the input is not changed)."""
        if not self._dense:
            return dense
        dense = dense.clone()
        for step, cols in self._dense:
            dense[:, cols] = step.apply_dense(dense[:, cols])
        return dense

    def _apply_kjt(self, kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        touched = [k for k in kjt.keys() if k in self._sparse]
        if not touched:
            return kjt
        features = kjt.to_dict()
        for key in touched:
            jt = features[key]
            values, offsets = self.apply_jagged(key, jt.values(), jt.offsets())
            features[key] = JaggedTensor(values, offsets, validate=False)
        return KeyedJaggedTensor.from_jagged_dict(features, stride=kjt.stride())

    def _apply_partial(
        self, name: str, group: PartialInverseKeyedJaggedTensor
    ) -> PartialInverseKeyedJaggedTensor:
        """Run each key's steps once on the packed ids its windows read (element-wise steps only:
        a step that changes lengths cannot run on ids shared by several rows)."""
        for key in group.keys():
            steps = self._sparse.get(key, ())
            for step in steps:
                if not step.elementwise:
                    msg = (
                        f"`ikjts[{name!r}]` stores {key!r} as a partial IKJT (windows into ids "
                        f"shared by several rows); {type(step).__name__} changes lengths, so it "
                        "cannot run on shared ids\nhint: only element-wise steps (HashModulo, "
                        f"VocabLookup, Clamp, Bucketize) run there; leave {key!r} out of "
                        "`[dedup] partial` to preprocess it as a plain list"
                    )
                    raise DataError(msg)
            if steps:
                group = group.map_key_values(key, lambda ids, k=key: self._apply_ids(k, ids))
        return group

    def _apply_ids(self, key: str, ids: torch.Tensor) -> torch.Tensor:
        offsets = torch.tensor([0, ids.numel()], dtype=torch.int64, device=ids.device)
        return self.apply_jagged(key, ids, offsets)[0]

    def __call__(self, batch: Batch) -> Batch:
        """Preprocess one batch; IKJT groups are rewritten on their unique rows only."""
        if not self.transforms:
            return batch
        ikjts = {}
        for name, group in batch.ikjts.items():
            if not any(k in self._sparse for k in group.keys()):
                ikjts[name] = group
                continue
            if isinstance(group, PartialInverseKeyedJaggedTensor):
                ikjts[name] = self._apply_partial(name, group)
                continue
            if not isinstance(group, InverseKeyedJaggedTensor):
                msg = f"preprocessing supports IKJT groups, `ikjts[{name!r}]` is {type(group).__name__}"
                raise DataError(msg)
            unique = self._apply_kjt(group.unique)
            ikjts[name] = InverseKeyedJaggedTensor.from_unique(
                unique, group.inverse_lookup, validate=False
            )
        return Batch(
            dense=self.apply_dense(batch.dense),
            labels=batch.labels,
            kjt=self._apply_kjt(batch.kjt),
            ikjts=ikjts,
            session_ids=batch.session_ids,
            extras=batch.extras,
        )
