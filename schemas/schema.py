"""Dataset schemas: feature specs loaded from TOML, validated, and turned into Arrow schemas.

A schema names the session, time, label and user keys of the raw logs and every
feature of the clustered dataset::

    [dataset]
    name = "feed"
    [[dense]]
    name = "user_age"
    fill = 0.0
    [[sparse]]
    name = "user_liked_items"
    kind = "user"        # user | item | context
    max_len = 50
    truncate = true      # false: longer lists are quarantined instead of cut
    [dedup]
    groups = [["user_liked_items", "user_liked_sellers"], ["user_segment"]]
    partial = ["user_recent_items"]   # lists that shift by one id: stored as windows

How the raw logs are laid out (``docs/data-contract.md``): ``[dataset] layout = "nested"`` (the
default: features inside ``dense`` / ``sparse`` objects) or ``"flat"`` (features at the top level
of the record), and a ``[keys]`` table mapping the request id and features to the keys the logs
use (``request_id = "req"``, ``user_age = "age"``).

:func:`load_schema` parses and validates such a file; every problem raises
:class:`~recpipe.errors.SchemaError` naming the file, the table and the key. Names are compared
ignoring case too (DuckDB, which builds and measures the dataset, matches column and JSON-key
names that way): features, the dataset keys and the fixed columns must differ in more than case.
"""

from __future__ import annotations

import difflib
import math
import re
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, cast, get_args

import pyarrow as pa

from recpipe.errors import SchemaError

__all__ = [
    "PASSTHROUGH_COLUMNS",
    "RESERVED_NAMES",
    "DatasetSchema",
    "DenseFeature",
    "FeatureKind",
    "IdKind",
    "Layout",
    "SparseFeature",
    "TimeUnit",
    "default_schema",
    "default_schema_path",
    "load_schema",
    "parse_schema",
]

FeatureKind = Literal["user", "item", "context"]
_KINDS: tuple[str, ...] = get_args(FeatureKind)
Layout = Literal["nested", "flat"]
_LAYOUTS: tuple[str, ...] = get_args(Layout)
TimeUnit = Literal["s", "ms", "us"]
_TIME_UNITS: tuple[str, ...] = get_args(TimeUnit)
IdKind = Literal["int", "hash"]
_ID_KINDS: tuple[str, ...] = get_args(IdKind)

#: Names a feature may not take: raw-log keys and the fixed columns of the clustered dataset.
RESERVED_NAMES: frozenset[str] = frozenset(
    {"session_id", "session_id_raw", "ts", "label", "user_id", "request_id", "dense", "sparse"}
)

# keys every raw feature record has whatever the schema says
_FIXED_RAW_KEYS = ("request_id", "dense", "sparse")

_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_MAX_LEN_LIMIT = 1_000_000

_DATASET_KEYS = (
    "name",
    "session_key",
    "time_key",
    "label_key",
    "user_key",
    "layout",
    "passthrough",
    "time_unit",
)
_DENSE_KEYS = ("name", "fill")
_SPARSE_KEYS = ("name", "kind", "max_len", "truncate", "ids")
_DEDUP_KEYS = ("groups", "partial")
# `[[preprocess]]` tables belong to the readers (readers.pipeline.Pipeline); the schema
# loader accepts them and leaves them alone.
_TOP_KEYS = ("dataset", "dense", "sparse", "dedup", "keys", "preprocess")
#: dataset columns a build adds after the features: the request id, the user key's value and the
#: raw session id, as strings (NULL where the record has none)
PASSTHROUGH_COLUMNS: tuple[str, ...] = ("request_id", "user_id", "session_id_raw")


def _fail(where: str, msg: str, hint: str | None = None) -> SchemaError:
    text = f"{where}: {msg}" if where else msg
    if hint:
        text += f"\nhint: {hint}"
    return SchemaError(text)


def _did_you_mean(key: str, allowed: Iterable[str]) -> str | None:
    close = difflib.get_close_matches(key, list(allowed), n=1, cutoff=0.6)
    return f"did you mean `{close[0]}`?" if close else None


def _check_keys(table: Mapping[str, Any], allowed: Sequence[str], where: str) -> None:
    for key in table:
        if key not in allowed:
            hint = _did_you_mean(key, allowed) or f"allowed keys: {', '.join(allowed)}"
            raise _fail(where, f"unknown key `{key}`", hint)


def _check_keys_fold(keys: Mapping[str, str]) -> None:
    """The session/time/label/user keys must differ from each other and from the fixed raw-log
    keys ignoring case (DuckDB reads them as columns and JSON keys, case-insensitively)."""
    seen = {n.casefold(): f"`{n}` (fixed raw-log key)" for n in _FIXED_RAW_KEYS}
    for role, name in keys.items():
        other = seen.get(name.casefold())
        if other is not None:
            raise SchemaError(
                f"[dataset]: `{role}` {name!r} collides with {other} ignoring case "
                "(DuckDB matches names ignoring case); rename one of them"
            )
        seen[name.casefold()] = f"`{role}` {name!r}"


def _check_name(name: Any, where: str, *, what: str = "name") -> str:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise _fail(
            where,
            f"`{what}` must be an identifier (letters, digits, `_`), got {name!r}",
        )
    return name


@dataclass(frozen=True)
class DenseFeature:
    """A float32 column; a missing value becomes ``fill``.

    Args:
        name: column name.
        fill: value used when a record lacks the feature.
    """

    name: str
    fill: float = 0.0

    def __post_init__(self) -> None:
        _check_name(self.name, f"dense feature {self.name!r}")
        if isinstance(self.fill, bool) or not isinstance(self.fill, int | float):
            raise SchemaError(
                f"dense feature `{self.name}`: `fill` must be a number, got {self.fill!r}"
            )
        if not math.isfinite(self.fill):
            raise SchemaError(
                f"dense feature `{self.name}`: `fill` must be finite, got {self.fill!r}"
            )
        object.__setattr__(self, "fill", float(self.fill))


@dataclass(frozen=True)
class SparseFeature:
    """A ``list<int64>`` column of categorical ids.

    Args:
        name: column name.
        kind: whose attribute it is: ``"user"`` (usually repeats within a session),
            ``"item"`` (changes per row) or ``"context"``.
        max_len: longest list kept.
        truncate: if True, longer lists are cut to their last ``max_len`` ids (the most recent);
            if False, such records are quarantined as ``list_too_long``.
        ids: how the logs write the ids: ``"int"`` (int64 integers, stored as they are) or
            ``"hash"`` (strings or integers, each stored as the stable 63-bit hash of its text:
            the first 8 bytes of its UTF-8 MD5, little-endian, top bit cleared; an integer is
            hashed as its decimal text, so ``5`` and ``"5"`` are one id).
    """

    name: str
    kind: FeatureKind
    max_len: int
    truncate: bool = True
    ids: IdKind = "int"

    def __post_init__(self) -> None:
        _check_name(self.name, f"sparse feature {self.name!r}")
        where = f"sparse feature `{self.name}`"
        if self.kind not in _KINDS:
            hint = _did_you_mean(str(self.kind), _KINDS) or f"one of: {', '.join(_KINDS)}"
            raise _fail(where, f"`kind` must be one of {list(_KINDS)}, got {self.kind!r}", hint)
        if isinstance(self.max_len, bool) or not isinstance(self.max_len, int):
            raise _fail(where, f"`max_len` must be an integer, got {self.max_len!r}")
        if not 1 <= self.max_len <= _MAX_LEN_LIMIT:
            raise _fail(where, f"`max_len` must be in [1, {_MAX_LEN_LIMIT}], got {self.max_len!r}")
        if not isinstance(self.truncate, bool):
            raise _fail(where, f"`truncate` must be true or false, got {self.truncate!r}")
        if self.ids not in _ID_KINDS:
            hint = _did_you_mean(str(self.ids), _ID_KINDS) or f"one of: {', '.join(_ID_KINDS)}"
            raise _fail(where, f"`ids` must be one of {list(_ID_KINDS)}, got {self.ids!r}", hint)


@dataclass(frozen=True)
class DatasetSchema:
    """A validated dataset schema.

    Args:
        name: dataset name.
        dense: dense features, in column order.
        sparse: sparse features, in column order.
        dedup_groups: groups of sparse features deduplicated together (one IKJT each).
        dedup_partial: sparse features stored as windows into the previous row's list (one
            partial IKJT of them all, RecD §7): lists that shift by one id per sample. A
            feature is in a group or here, not both.
        session_key: raw-log key (and dataset column) of the session.
        time_key: raw-log key of the timestamp (an integer in ``time_unit`` since the epoch),
            and the dataset column holding it in epoch milliseconds.
        label_key: event-log key (and dataset column) of the label.
        user_key: raw-log key of the user, used to derive sessions when there is no session key.
        layout: ``"nested"`` (features inside the record's ``dense`` / ``sparse`` objects) or
            ``"flat"`` (features at the top level of the record).
        raw_keys: ``(name, raw-log key)`` pairs renaming ``request_id`` or features: the logs
            call them by the raw key, the dataset by the name.
        passthrough: top-level raw-log keys copied to the dataset as string columns of the
            same name (after :data:`PASSTHROUGH_COLUMNS`), untouched by training.
        time_unit: the unit of the logs' timestamps: ``"s"``, ``"ms"`` (the default) or
            ``"us"``; the build stores milliseconds (seconds times 1000, microseconds floored).

    Raises:
        SchemaError: on duplicate or reserved names, bad dedup groups or bad key mappings.
    """

    name: str
    dense: tuple[DenseFeature, ...]
    sparse: tuple[SparseFeature, ...]
    dedup_groups: tuple[tuple[str, ...], ...] = ()
    dedup_partial: tuple[str, ...] = ()
    session_key: str = "session_id"
    time_key: str = "ts"
    label_key: str = "label"
    user_key: str = "user_id"
    layout: Layout = "nested"
    raw_keys: tuple[tuple[str, str], ...] = ()
    passthrough: tuple[str, ...] = ()
    time_unit: TimeUnit = "ms"
    _by_name: dict[str, DenseFeature | SparseFeature] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise SchemaError(f"`name` must be a non-empty string, got {self.name!r}")
        object.__setattr__(self, "dense", tuple(self.dense))
        object.__setattr__(self, "sparse", tuple(self.sparse))
        keys = {}
        for key in ("session_key", "time_key", "label_key", "user_key"):
            keys[key] = _check_name(getattr(self, key), "[dataset]", what=key)
        if len(set(keys.values())) != len(keys):
            raise SchemaError(
                f"[dataset]: the session/time/label/user keys must differ, got {keys}"
            )
        _check_keys_fold(keys)
        for key in ("session_key", "time_key", "label_key"):
            if keys[key] in PASSTHROUGH_COLUMNS:
                raise SchemaError(
                    f"[dataset]: `{key}` {keys[key]!r} is the name of a pass-through column of "
                    f"the dataset ({', '.join(PASSTHROUGH_COLUMNS)}); choose another"
                )
        reserved = RESERVED_NAMES | set(keys.values())
        # lower-cased name -> its spelling: DuckDB (the build and `recpipe stats`) matches
        # column and JSON-key names ignoring case, so `a` and `A` would be one column
        folded = {n.casefold(): n for n in sorted(reserved)}
        by_name: dict[str, DenseFeature | SparseFeature] = {}
        features: tuple[DenseFeature | SparseFeature, ...] = (*self.dense, *self.sparse)
        for feature in features:
            if feature.name in reserved:
                raise SchemaError(
                    f"feature `{feature.name}`: the name is reserved "
                    f"(reserved: {', '.join(sorted(reserved))})"
                )
            if feature.name in by_name:
                raise SchemaError(
                    f"feature `{feature.name}` is defined twice (names must be unique across "
                    "[[dense]] and [[sparse]])"
                )
            other = folded.get(feature.name.casefold())
            if other is not None:
                what = "a dataset column or raw-log key" if other in reserved else "feature"
                raise SchemaError(
                    f"feature `{feature.name}` collides with {what} `{other}` ignoring case "
                    "(DuckDB matches names ignoring case); rename one of them"
                )
            folded[feature.name.casefold()] = feature.name
            by_name[feature.name] = feature
        object.__setattr__(self, "_by_name", by_name)
        object.__setattr__(self, "dedup_groups", self._validated_groups(self.dedup_groups))
        object.__setattr__(self, "dedup_partial", self._validated_partial(self.dedup_partial))
        if self.layout not in _LAYOUTS:
            hint = _did_you_mean(str(self.layout), _LAYOUTS) or f"one of: {', '.join(_LAYOUTS)}"
            raise _fail(
                "[dataset]", f"`layout` must be one of {list(_LAYOUTS)}, got {self.layout!r}", hint
            )
        object.__setattr__(self, "raw_keys", self._validated_raw_keys(self.raw_keys, keys))
        object.__setattr__(self, "passthrough", self._validated_passthrough(self.passthrough))
        if self.time_unit not in _TIME_UNITS:
            hint = _did_you_mean(str(self.time_unit), _TIME_UNITS) or "one of: s, ms, us"
            raise _fail(
                "[dataset]",
                f"`time_unit` must be one of {list(_TIME_UNITS)}, got {self.time_unit!r}",
                hint,
            )

    def _validated_passthrough(self, names: Any) -> tuple[str, ...]:
        if isinstance(names, str) or not isinstance(names, Iterable):
            raise _fail("[dataset]", f"`passthrough` must be a list of key names, got {names!r}")
        names = tuple(names)
        taken = {
            n.casefold(): n
            for n in (
                *self.feature_names,
                *PASSTHROUGH_COLUMNS,
                "dense",
                "sparse",
                self.session_key,
                self.time_key,
                self.label_key,
                self.user_key,
            )
        }
        taken |= {raw.casefold(): raw for _, raw in self.raw_keys}
        for name in names:
            _check_name(name, "[dataset] passthrough", what="passthrough")
            other = taken.get(name.casefold())
            if other is not None:
                raise _fail(
                    "[dataset] passthrough",
                    f"`{name}` is already a column or raw-log key of the schema (`{other}`, "
                    "compared ignoring case)",
                    "request_id, user_id and the session id are kept already",
                )
            taken[name.casefold()] = name
        return cast("tuple[str, ...]", names)  # each one checked by _check_name

    def _validated_raw_keys(
        self, pairs: Any, keys: Mapping[str, str]
    ) -> tuple[tuple[str, str], ...]:
        pairs = tuple(
            (str(a), b) for a, b in (pairs.items() if isinstance(pairs, Mapping) else pairs)
        )
        allowed = ["request_id", *self._by_name]
        raw_seen: dict[str, str] = {}
        for name, raw in pairs:
            where = f"[keys] {name}"
            if name not in allowed:
                if name in keys.values():
                    role = next(r for r, v in keys.items() if v == name)
                    hint = f"set `{role}` in [dataset] instead"
                else:
                    hint = _did_you_mean(name, allowed) or "keys are `request_id` or feature names"
                raise _fail(where, f"unknown name `{name}`", hint)
            if not isinstance(raw, str) or not raw:
                raise _fail(where, f"the raw-log key must be a non-empty string, got {raw!r}")
            if raw in raw_seen:
                raise _fail(where, f"raw-log key {raw!r} is also mapped to `{raw_seen[raw]}`")
            raw_seen[raw] = name
        return cast("tuple[tuple[str, str], ...]", pairs)  # every raw key checked above

    def raw_key(self, name: str) -> str:
        """The key the raw logs use for ``name`` (``request_id`` or a feature): ``[keys]``'s
        mapping, else the name itself."""
        return dict(self.raw_keys).get(name, name)

    @property
    def remapped(self) -> bool:
        """Whether raw records differ from the nested layout with the dataset's names
        (``layout = "flat"`` or a ``[keys]`` mapping): the build then rewrites each record to it
        before validating (:func:`etl.build.layout.normalize_sql`)."""
        return self.layout != "nested" or bool(self.raw_keys)

    def _validated_groups(self, groups: Any) -> tuple[tuple[str, ...], ...]:
        if isinstance(groups, str) or not isinstance(groups, Iterable):
            raise SchemaError(f"[dedup]: `groups` must be a list of lists of names, got {groups!r}")
        seen: dict[str, int] = {}
        out = []
        for i, group in enumerate(groups):
            where = f"[dedup] groups[{i}]"
            if isinstance(group, str) or not isinstance(group, Iterable):
                raise _fail(where, f"must be a list of feature names, got {group!r}")
            group = tuple(group)
            if not group:
                raise _fail(where, "is empty")
            for name in group:
                if not isinstance(name, str):
                    raise _fail(where, f"feature names must be strings, got {name!r}")
                feature = self._by_name.get(name)
                if feature is None:
                    hint = _did_you_mean(name, self.sparse_names)
                    raise _fail(where, f"unknown feature `{name}`", hint)
                if isinstance(feature, DenseFeature):
                    raise _fail(
                        where,
                        f"`{name}` is a dense feature; only sparse features can be deduplicated",
                    )
                if name in seen:
                    other = seen[name]
                    msg = (
                        f"`{name}` appears twice in the group"
                        if other == i
                        else f"`{name}` is already in groups[{other}]; a feature belongs to one group"
                    )
                    raise _fail(where, msg)
                seen[name] = i
            out.append(group)
        return tuple(out)

    def _validated_partial(self, names: Any) -> tuple[str, ...]:
        where = "[dedup] partial"
        if isinstance(names, str) or not isinstance(names, Iterable):
            raise _fail(where, f"must be a list of sparse feature names, got {names!r}")
        names = tuple(names)
        grouped = {n: i for i, g in enumerate(self.dedup_groups) for n in g}
        for name in names:
            if not isinstance(name, str):
                raise _fail(where, f"feature names must be strings, got {name!r}")
            feature = self._by_name.get(name)
            if feature is None:
                raise _fail(
                    where, f"unknown feature `{name}`", _did_you_mean(name, self.sparse_names)
                )
            if isinstance(feature, DenseFeature):
                raise _fail(
                    where, f"`{name}` is a dense feature; only sparse features can be deduplicated"
                )
            if names.count(name) > 1:
                raise _fail(where, f"`{name}` appears twice")
            if name in grouped:
                raise _fail(
                    where,
                    f"`{name}` is already in groups[{grouped[name]}]; a feature is deduplicated "
                    "one way",
                    "keep it in `groups` (exact repeats) or in `partial` (lists that shift)",
                )
        return cast("tuple[str, ...]", names)  # each one checked above

    @property
    def dense_names(self) -> list[str]:
        """Dense feature names in column order."""
        return [f.name for f in self.dense]

    @property
    def sparse_names(self) -> list[str]:
        """Sparse feature names in column order."""
        return [f.name for f in self.sparse]

    @property
    def feature_names(self) -> list[str]:
        """All feature names: dense first, then sparse (the column order)."""
        return self.dense_names + self.sparse_names

    def feature(self, name: str) -> DenseFeature | SparseFeature:
        """Return the feature called ``name``.

        Raises:
            SchemaError: if there is none (with a "did you mean" hint).
        """
        try:
            return self._by_name[name]
        except KeyError:
            hint = _did_you_mean(name, self._by_name)
            raise _fail("", f"schema `{self.name}` has no feature `{name}`", hint) from None

    def arrow_schema(self) -> pa.Schema:
        """Arrow schema of the clustered dataset (README, "Build the clustered dataset").

        Columns: session key int64, time key int64, label float32, then one float32 column per
        dense feature and one ``list<int64>`` column per sparse feature, in schema order.
        """
        fields = [
            pa.field(self.session_key, pa.int64()),
            pa.field(self.time_key, pa.int64()),
            pa.field(self.label_key, pa.float32()),
        ]
        fields += [pa.field(f.name, pa.float32()) for f in self.dense]
        fields += [pa.field(f.name, pa.list_(pa.int64())) for f in self.sparse]
        return pa.schema(fields)

    def dataset_arrow_schema(self) -> pa.Schema:
        """Arrow schema of the Parquet files a build writes: :meth:`arrow_schema` then the
        pass-through string columns :data:`PASSTHROUGH_COLUMNS` (request id, user, raw session
        id) and ``passthrough``, which readers may select but need not."""
        fields = [pa.field(n, pa.string()) for n in (*PASSTHROUGH_COLUMNS, *self.passthrough)]
        return pa.schema([*self.arrow_schema(), *fields])

    def with_dedup(
        self, groups: Iterable[Iterable[str]], partial: Iterable[str] = ()
    ) -> DatasetSchema:
        """Return a copy whose ``[dedup]`` is ``groups`` and ``partial`` (validated)."""
        return replace(
            self, dedup_groups=tuple(tuple(g) for g in groups), dedup_partial=tuple(partial)
        )

    def to_toml(self) -> str:
        """Serialise to TOML text that :func:`parse_schema` reads back to an equal schema."""
        lines = ["[dataset]", f"name = {_toml_str(self.name)}"]
        defaults = DatasetSchema.__dataclass_fields__
        for key in ("session_key", "time_key", "label_key", "user_key"):
            value = getattr(self, key)
            if value != defaults[key].default:
                lines.append(f"{key} = {_toml_str(value)}")
        if self.layout != defaults["layout"].default:
            lines.append(f"layout = {_toml_str(self.layout)}")
        if self.passthrough:
            lines.append(f"passthrough = [{', '.join(_toml_str(n) for n in self.passthrough)}]")
        if self.time_unit != defaults["time_unit"].default:
            lines.append(f"time_unit = {_toml_str(self.time_unit)}")
        for f in self.dense:
            lines += [
                "",
                "[[dense]]",
                f"name = {_toml_str(f.name)}",
                f"fill = {_toml_float(f.fill)}",
            ]
        for s in self.sparse:
            lines += [
                "",
                "[[sparse]]",
                f"name = {_toml_str(s.name)}",
                f"kind = {_toml_str(s.kind)}",
                f"max_len = {s.max_len}",
                f"truncate = {'true' if s.truncate else 'false'}",
            ]
            if s.ids != "int":
                lines.append(f"ids = {_toml_str(s.ids)}")
        if self.raw_keys:
            lines += ["", "[keys]"]
            lines += [f"{_toml_str(n)} = {_toml_str(r)}" for n, r in self.raw_keys]
        if self.dedup_groups or self.dedup_partial:
            lines += ["", self.dedup_toml().rstrip("\n")]
        return "\n".join(lines) + "\n"

    def dedup_toml(self) -> str:
        """The ``[dedup]`` table alone, e.g. to paste into a schema file."""
        groups = ", ".join(
            "[" + ", ".join(_toml_str(n) for n in g) + "]" for g in self.dedup_groups
        )
        text = f"[dedup]\ngroups = [{groups}]\n"
        if self.dedup_partial:
            text += f"partial = [{', '.join(_toml_str(n) for n in self.dedup_partial)}]\n"
        return text


def _toml_str(value: str) -> str:
    escaped = value.replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'


def _toml_float(value: float) -> str:
    return repr(float(value))


def _table(doc: Mapping[str, Any], key: str, where: str) -> Mapping[str, Any]:
    value = doc.get(key, {})
    if not isinstance(value, Mapping):
        raise _fail(where, f"`{key}` must be a table ([{key}]), got {type(value).__name__}")
    return value


def _array_of_tables(doc: Mapping[str, Any], key: str, where: str) -> list[Mapping[str, Any]]:
    value = doc.get(key, [])
    if not isinstance(value, list) or not all(isinstance(t, Mapping) for t in value):
        raise _fail(where, f"`{key}` must be an array of tables ([[{key}]])")
    return value


def _build(doc: Mapping[str, Any], where: str) -> DatasetSchema:
    _check_keys(doc, _TOP_KEYS, where)
    dataset = _table(doc, "dataset", where)
    _check_keys(dataset, _DATASET_KEYS, f"{where} [dataset]")
    if "name" not in dataset:
        raise _fail(f"{where} [dataset]", "missing required key `name`")
    dense = []
    for i, table in enumerate(_array_of_tables(doc, "dense", where)):
        loc = f"{where} [[dense]] #{i + 1} ({table.get('name', '?')!s})"
        _check_keys(table, _DENSE_KEYS, loc)
        if "name" not in table:
            raise _fail(loc, "missing required key `name`")
        try:
            dense.append(DenseFeature(**table))
        except SchemaError as exc:
            raise _fail(loc, str(exc)) from None
    sparse = []
    for i, table in enumerate(_array_of_tables(doc, "sparse", where)):
        loc = f"{where} [[sparse]] #{i + 1} ({table.get('name', '?')!s})"
        _check_keys(table, _SPARSE_KEYS, loc)
        for required in ("name", "kind", "max_len"):
            if required not in table:
                raise _fail(loc, f"missing required key `{required}`")
        try:
            sparse.append(SparseFeature(**table))
        except SchemaError as exc:
            raise _fail(loc, str(exc)) from None
    dedup = _table(doc, "dedup", where)
    _check_keys(dedup, _DEDUP_KEYS, f"{where} [dedup]")
    raw_keys = _table(doc, "keys", where)
    if not dense and not sparse:
        raise _fail(where, "the schema defines no features ([[dense]] or [[sparse]])")
    try:
        return DatasetSchema(
            name=dataset["name"],
            dense=tuple(dense),
            sparse=tuple(sparse),
            dedup_groups=dedup.get("groups", ()),
            dedup_partial=dedup.get("partial", ()),
            raw_keys=tuple(raw_keys.items()),
            **{k: dataset[k] for k in _DATASET_KEYS[1:] if k in dataset},
        )
    except SchemaError as exc:
        raise _fail(where, str(exc)) from None


def parse_schema(text: str, *, source: str = "<string>") -> DatasetSchema:
    """Parse and validate schema TOML text.

    Args:
        text: the TOML document.
        source: name used in error messages (usually the file path).

    Raises:
        SchemaError: on invalid TOML or any invalid entry.
    """
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SchemaError(f"{source}: not valid TOML: {exc}") from None
    return _build(doc, source)


def default_schema_path() -> Path:
    """Path of the bundled example schema of the synthetic dataset."""
    return Path(__file__).resolve().parent / "examples" / "synth.toml"


def load_schema(path: str | Path | None = None) -> DatasetSchema:
    """Load and validate a schema file.

    Args:
        path: a ``.toml`` file; ``None`` loads the bundled default (:func:`default_schema_path`).

    Raises:
        SchemaError: if the file is missing, unreadable, or invalid.
    """
    path = default_schema_path() if path is None else Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SchemaError(f"`path`: schema file {str(path)!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SchemaError(f"`path`: cannot read schema file {str(path)!r}: {exc}") from None
    return parse_schema(text, source=str(path))


def default_schema() -> DatasetSchema:
    """The bundled example schema (describes the data of ``recpipe synth``)."""
    return load_schema(None)
