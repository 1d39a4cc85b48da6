"""``recpipe etl infer-schema``: a dataset schema guessed from a sample of raw feature logs.

It reads the first lines of the logs with the build's own reader (JSON Lines, zstd, Parquet)
and writes a schema that :func:`schemas.load_schema` reads and ``etl build`` builds as it is:

- the **keys**: ``request_id`` (required), the session, user and time keys (their usual names:
  ``session_id`` / ``sid`` / ``session``, ``user_id`` / ``uid`` / ``user``, ``ts`` /
  ``timestamp`` / ``time``);
- the **layout**: ``nested`` when records carry ``dense`` / ``sparse`` objects, else ``flat``
  (every other top-level number is a dense feature, every list a sparse one);
- ``time_unit``: ``s``, ``ms`` or ``us``, from the magnitude of the median timestamp;
- each sparse feature's ``ids``: ``"hash"`` when any sampled id is a string (or not an int64),
  else ``"int"``; its ``max_len``: the 99th percentile of the sampled list lengths;
- each sparse feature's ``kind``, from how its value repeats within a user (or a session,
  when there is no user key), records in time order: ``user`` when a record's list shares at
  least half its ids with the same user's previous record on average (a user attribute, or a
  history that shifts), else ``context`` when the feature takes few distinct values over the
  sample, else ``item``.

The output starts with a comment block giving the evidence for each guess; read it before
building, and change what you know better.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from etl.build.inputs import list_inputs
from etl.rawio import DEFAULT_MAX_LINE_BYTES
from etl.validate_logs import _parse, _take
from recpipe.config_cli import positive_int
from recpipe.errors import DataError, SchemaError
from schemas import DatasetSchema, DenseFeature, SparseFeature, parse_schema

__all__ = ["infer_schema", "register_cli"]

_SESSION_KEYS = ("session_id", "sid", "session", "session_key")
_USER_KEYS = ("user_id", "uid", "user", "userid", "user_key")
_TIME_KEYS = ("ts", "timestamp", "time", "event_time", "ts_ms", "t")
_INT64 = (-(2**63), 2**63 - 1)
#: upper bounds of the median timestamp of each unit (years 1973..5138 in each)
_UNITS = (("s", 10**11), ("ms", 10**14), ("us", 10**17))
_USER_OVERLAP = 0.5  # mean share of ids shared with the user's previous record
_CONTEXT_DISTINCT = 0.05  # distinct values / records, at most


@dataclass(frozen=True)
class _Evidence:
    """Why a sparse feature got its kind and length: for the output's comment block."""

    name: str
    overlap: float | None
    distinct: int
    records: int
    p99: int
    longest: int
    strings: bool


def _pick(candidates: tuple[str, ...], counts: dict[str, int]) -> str | None:
    """The candidate key found in the most records, or None."""
    present = [c for c in candidates if counts.get(c)]
    return max(present, key=lambda c: counts[c]) if present else None


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and _INT64[0] <= x <= _INT64[1]


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _time_unit(values: list[Any], key: str) -> str:
    numbers = sorted(abs(v) for v in values if _is_number(v))
    if not numbers:
        got = next((v for v in values if v is not None), None)
        raise SchemaError(
            f"`{key}`: no integer timestamps in the sample (e.g. {got!r})\n"
            "hint: the build reads epoch seconds, milliseconds or microseconds as JSON integers"
        )
    median = numbers[len(numbers) // 2]
    for unit, bound in _UNITS:
        if median < bound:
            return unit
    raise SchemaError(
        f"`{key}`: the median timestamp {median!r} looks like epoch nanoseconds\n"
        'hint: write it in microseconds or coarser (`time_unit` is one of "s", "ms", "us")'
    )


def _percentile(sizes: list[int], q: float) -> int:
    """The nearest-rank ``q`` quantile of ``sizes`` (not empty)."""
    ordered = sorted(sizes)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def _overlap(rows: list[tuple[Any, Any, list]]) -> float | None:
    """Mean share of a list's ids found in the same owner's previous list (time order), over
    the records that have a previous one; None when none has."""
    by_owner: dict[Any, list[tuple[Any, list]]] = defaultdict(list)
    for owner, ts, ids in rows:
        by_owner[owner].append((ts, ids))
    shares = []
    for seq in by_owner.values():
        seq.sort(key=lambda p: (not _is_number(p[0]), p[0] if _is_number(p[0]) else 0))
        for (_, before), (_, now) in itertools.pairwise(seq):
            if not now and not before:
                shares.append(1.0)
            elif now:
                prev = {repr(x) for x in before}
                shares.append(sum(repr(x) in prev for x in now) / len(now))
            else:
                shares.append(0.0)
    return sum(shares) / len(shares) if shares else None


def _kind(e: _Evidence) -> str:
    if e.overlap is not None and e.overlap >= _USER_OVERLAP:
        return "user"
    if e.distinct <= max(2, _CONTEXT_DISTINCT * e.records):
        return "context"
    return "item"


def infer_schema(
    inputs: str | Path | Iterable[str | Path],
    *,
    name: str | None = None,
    sample: int = 10_000,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
) -> tuple[DatasetSchema, str]:
    """Guess the schema of the feature logs ``inputs`` from their first ``sample`` lines.

    Args:
        inputs: ``.jsonl`` / ``.jsonl.zst`` / ``.parquet`` files, directories or globs.
        name: the dataset name (default: the first input's name without its suffixes).
        sample: lines read in all, split evenly over the files (the first of each).
        max_line_bytes: the build's line limit.

    Returns:
        ``(schema, toml)``: the schema and its TOML text, led by a comment block with the
        evidence for each guess.

    Raises:
        DataError: no inputs, or no JSON object among the sampled lines.
        SchemaError: no ``request_id`` or time key in the records, or timestamps that are not
            integers of a supported unit.
    """
    if isinstance(sample, bool) or not isinstance(sample, int) or sample < 1:
        raise DataError(f"`sample` must be a positive integer, got {sample!r}")
    files = list_inputs(inputs)
    lines = _take(files, sample, max_line_bytes)
    texts = [] if lines is None else lines.column("line").to_pylist()
    records = [r for r in map(_parse, texts) if r is not None]
    if not records:
        raise DataError(f"no JSON object in the first {len(texts):,} lines of {files[0].path}")
    counts: dict[str, int] = defaultdict(int)
    for r in records:
        for k in r:
            counts[k] += 1
    if not counts.get("request_id"):
        raise SchemaError(
            f"no `request_id` key in {len(records):,} sampled records of {files[0].path} "
            f"(keys: {', '.join(sorted(counts)[:12])})\n"
            "hint: every feature record needs a `request_id` (docs/data-contract.md)"
        )
    tk = _pick(_TIME_KEYS, counts)
    if tk is None:
        raise SchemaError(
            f"no time key ({', '.join(_TIME_KEYS)}) in the sampled records of {files[0].path}"
        )
    sk = _pick(_SESSION_KEYS, counts)
    uk = _pick(_USER_KEYS, counts)
    time_unit = _time_unit([r.get(tk) for r in records], tk)
    nested = sum(
        isinstance(r.get("dense"), dict) or isinstance(r.get("sparse"), dict) for r in records
    )
    layout = "nested" if 2 * nested >= len(records) else "flat"
    taken = {"request_id", tk, sk, uk, "label", "dense", "sparse"}

    def values(group: str) -> dict[str, list[tuple[int, Any]]]:
        out: dict[str, list[tuple[int, Any]]] = defaultdict(list)
        for i, r in enumerate(records):
            inner = r.get(group) if layout == "nested" else r
            if not isinstance(inner, dict):
                continue
            for k, v in inner.items():
                if layout == "flat" and k in taken:
                    continue
                if v is not None:
                    out[k].append((i, v))
        return out

    dense_vals = values("dense") if layout == "nested" else {}
    sparse_vals = values("sparse") if layout == "nested" else {}
    if layout == "flat":
        for k, got in values("flat").items():
            if all(isinstance(v, list) for _, v in got):
                sparse_vals[k] = got
            elif all(_is_number(v) for _, v in got):
                dense_vals[k] = got
    owner_key = uk or sk
    dense = [DenseFeature(k) for k, got in dense_vals.items() if all(_is_number(v) for _, v in got)]
    sparse, evidence = [], []
    for k, got in sparse_vals.items():
        lists = [v for _, v in got if isinstance(v, list)]
        if not lists or len(lists) < len(got):
            continue  # not lists: the build could not read it as a sparse feature
        sizes = [len(v) for v in lists]
        strings = any(not _is_int(x) for v in lists for x in v)
        rows = [(records[i].get(owner_key), records[i].get(tk), v) for i, v in got if owner_key]
        rows = [row for row in rows if row[0] is not None]
        e = _Evidence(
            name=k,
            overlap=_overlap(rows) if rows else None,
            distinct=len({repr(v) for v in lists}),
            records=len(lists),
            p99=max(1, _percentile(sizes, 0.99)),
            longest=max(sizes),
            strings=strings,
        )
        evidence.append(e)
        sparse.append(
            SparseFeature(k, kind=_kind(e), max_len=e.p99, ids="hash" if strings else "int")
        )
    if not dense and not sparse:
        raise SchemaError(
            f"no features found in {len(records):,} sampled records of {files[0].path}\n"
            "hint: features are numbers (dense) or lists of ids (sparse), inside `dense` / "
            "`sparse` objects or at the top level of the record"
        )
    if name is None:
        name = Path(str(files[0].path)).name.split(".")[0] or "dataset"
        name = "".join(c if c.isalnum() or c == "_" else "_" for c in name)
    keys = {"time_key": tk}
    if sk:
        keys["session_key"] = sk
    if uk:
        keys["user_key"] = uk
    schema = DatasetSchema(
        name=name,
        dense=tuple(dense),
        sparse=tuple(sparse),
        layout=layout,  # type: ignore[arg-type]
        time_unit=time_unit,  # type: ignore[arg-type]
        **keys,
    )
    text = _header(schema, evidence, len(records), files[0].path, owner_key) + schema.to_toml()
    parse_schema(text, source="<inferred>")  # what the build will read: refuse it here if bad
    return schema, text


def _header(
    schema: DatasetSchema, evidence: list[_Evidence], n: int, first: Any, owner: str | None
) -> str:
    lines = [
        f"# Inferred by `recpipe etl infer-schema` from {n:,} records (first file: {first}).",
        f'# layout = "{schema.layout}", time_unit = "{schema.time_unit}"; sparse features, '
        f"ids shared with the same {owner or 'owner'}'s previous record (user if >= "
        f"{_USER_OVERLAP}), distinct values, lengths:",
    ]
    for e in evidence:
        share = "n/a" if e.overlap is None else f"{e.overlap:.2f}"
        lines.append(
            f"#   {e.name}: shared {share}, {e.distinct:,} distinct of {e.records:,}, "
            f"p99 length {e.p99} (longest {e.longest}){', string ids' if e.strings else ''}"
        )
    lines.append(
        "# Check the kinds and lengths before you build; `[dedup]` comes from `recpipe stats`."
    )
    return "\n".join(lines) + "\n\n"


def _run_cli(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.is_dir():
        raise DataError(f"`--out`: {str(out)!r} is a directory; name the schema file to write")
    if out.exists() and not args.overwrite:
        raise DataError(
            f"`--out`: {str(out)!r} exists\nhint: pass `--overwrite` to replace it, or choose "
            "another path"
        )
    if out.exists() and any(out.resolve() == f.path.resolve() for f in list_inputs(args.inputs)):
        raise DataError(f"`--out`: {str(out)!r} is one of the logs read; choose another path")
    schema, text = infer_schema(args.inputs, name=args.name, sample=args.sample)
    tmp = out.with_name(f".{out.name}.tmp")
    try:  # whole or not at all: an existing --out is replaced only by a complete file
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(out)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise DataError(f"`--out`: cannot write {str(out)!r}: {exc.strerror or exc}") from None
    print(
        f"wrote {out}: {len(schema.dense)} dense and {len(schema.sparse)} sparse features, "
        f'layout "{schema.layout}", time_unit "{schema.time_unit}", hashed ids: '
        f"{', '.join(f.name for f in schema.sparse if f.ids == 'hash') or 'none'}"
    )
    return 0


def register_cli(stages: argparse._SubParsersAction) -> None:
    """Add ``recpipe etl infer-schema`` to the ``etl`` stage parsers."""
    parser = stages.add_parser(
        "infer-schema",
        help="guess a dataset schema (TOML) from a sample of raw feature logs",
        description=(
            "Read the first lines of raw feature logs (.jsonl / .jsonl.zst / .parquet files, "
            "directories, globs) and write a schema that `etl build` builds as it is: the "
            "keys, the layout, `time_unit` (s/ms/us), each sparse feature's kind (from how its "
            "ids repeat within a user), `max_len` (99th percentile of the lengths) and `ids` "
            '("hash" when the logs write string ids). A comment block gives the evidence.'
        ),
    )
    parser.add_argument("inputs", nargs="+", metavar="LOGS", help="feature-log files/dirs/globs")
    parser.add_argument("--out", required=True, type=Path, help="the schema TOML to write")
    parser.add_argument("--name", help="dataset name (default: the first input's name)")
    parser.add_argument(
        "--sample",
        type=positive_int,
        default=10_000,
        metavar="N",
        help="lines to read (default 10000)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    parser.set_defaults(func=_run_cli)
