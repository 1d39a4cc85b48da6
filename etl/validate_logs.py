"""``recpipe etl validate``: a fast dry run of the build over a sample of raw feature logs.

It reads the first lines of each input with the build's own reader
(:func:`etl.build.inputs.read_lines`), validates them with the build's own validator
(:class:`etl.build.validate.Validator`, so a record quarantined here is quarantined by the
build, for the same reason), and looks at the parsed records for the mistakes that the build
accepts quietly or refuses with little help:

- features missing from all or most records (``missing_feature``), and keys the schema does not
  name, at the top level or inside ``dense`` / ``sparse`` (``unknown_key``), each with the
  ``[keys]`` mapping to write when a missing feature and an unknown key look alike;
- records in another layout than the schema's (``layout``: flat records under a nested schema,
  or the other way round);
- timestamps that look like another unit than the schema's ``time_unit`` (``ts_unit``; the fix
  names the unit to set);
- ids written as strings (``string_ids``): sparse ids of an ``ids = "int"`` feature (quarantined
  as ``wrong_type``; the fix suggests ``ids = "hash"``) and dense numbers in quotes;
- lists longer than ``max_len`` (``list_too_long``: cut, or quarantined with ``truncate = false``);
- a session key that never repeats (``session_key``), so every record is its own session;
- every quarantine reason met (``quarantine``), with the validator's detail;
- event records among the feature logs (``event_lines``, an error: a request id and the label,
  no feature; ``etl shard`` refuses them and the build would quarantine them as duplicates of
  their requests), left out of the other checks so that they raise no false warnings.

With ``events`` (``--events``) the event logs are sampled too and validated as the build
validates them (``quarantine`` findings on ``events``), and feature records among them are an
error (``feature_lines``). A file named both as a feature log (under a directory) and as an
event log is read as an event log only.

Each finding carries an example (``file:line`` and the field) and a suggested fix. Its severity
is ``error`` when the build would refuse the logs (a feature missing from every record, a
layout mismatch, which has the same effect) or keep nothing of them (every sampled record
quarantined), else ``warning``; the command exits non-zero on an error (and, with
``--strict``, on a warning). The log format is in docs/data-contract.md.

One concept, over 600 lines: the dry run's checks and their report.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import orjson
import pyarrow as pa

from etl.build._sql import schema_keys
from etl.build.inputs import InputFile, check_structure, list_inputs, read_lines
from etl.build.validate import Validator
from etl.rawio import DEFAULT_MAX_LINE_BYTES
from etl.shard import event_shaped
from recpipe.config_cli import positive_int
from schemas import DatasetSchema, SparseFeature, default_schema, load_schema

__all__ = ["Finding", "LogReport", "register_cli", "validate_logs"]

Severity = Literal["error", "warning"]

#: a feature missing from at least this share of the sampled records is reported (``warning``)
MOST = 0.5
#: epoch-millisecond timestamps of plausible logs lie in this range (2001-09-09 .. 2286-11-20)
_MS_RANGE = (10**12, 10**13)
#: sessions are judged only on at least this many sampled records with a session key
_MIN_SESSION_RECORDS = 20


@dataclass(frozen=True)
class Finding:
    """One problem met in the sample.

    Attributes:
        kind: ``missing_feature``, ``unknown_key``, ``layout``, ``ts_unit``, ``string_ids``,
            ``list_too_long``, ``session_key``, ``quarantine``, ``event_lines`` or
            ``feature_lines``.
        severity: ``"error"`` (the build would refuse the logs or keep none of them) or
            ``"warning"``.
        message: what was found, with counts.
        field: the record field concerned (``dense.user_age``, ``ts``, ...), or ``""``.
        example: ``file:line`` of one record showing it, or ``""`` (nothing to point at).
        fix: the suggested change (to the schema, or to the logs).
        count: sampled records showing it.
    """

    kind: str
    severity: Severity
    message: str
    field: str
    example: str
    fix: str
    count: int = 0


@dataclass
class LogReport:
    """What :func:`validate_logs` found.

    Attributes:
        files: the input files sampled.
        lines: lines sampled.
        quarantined: sampled lines the build would quarantine, by reason.
        findings: the problems, errors first.
        event_files: the event-log files sampled (``events``).
        event_lines: event lines sampled.
        events_quarantined: sampled event lines the build would quarantine, by reason.
    """

    files: list[str]
    lines: int
    quarantined: dict[str, int]
    findings: list[Finding] = field(default_factory=list)
    event_files: list[str] = field(default_factory=list)
    event_lines: int = 0
    events_quarantined: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """True when no finding is an error."""
        return not any(f.severity == "error" for f in self.findings)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict of the report."""
        d = asdict(self)
        d["ok"] = self.ok
        return d


# ---------------------------------------------------------------------------------------------
# sampling


@dataclass
class _Sample:
    """The sampled lines: their ``file:line`` names, texts, parsed records (None: not an
    object), and the validator's rows."""

    where: list[str]
    records: list[dict | None]
    checked: pa.Table
    keys: list[tuple[int, int]] = field(default_factory=list)  # (file_id, line_no)


def _take(files: list[InputFile], sample: int, max_line_bytes: int) -> pa.Table:
    """The first ``ceil(sample / len(files))`` lines of each file (about ``sample`` in all)."""
    per_file = max(1, math.ceil(sample / max(1, len(files))))
    tables = []
    for file_id, f in enumerate(files):
        check_structure(f)
        got = 0
        for batch in read_lines(f, file_id, max_line_bytes=max_line_bytes, batch_lines=per_file):
            tables.append(batch.slice(0, per_file - got))
            got += min(batch.num_rows, per_file - got)
            if got >= per_file:
                break
    return pa.concat_tables(tables) if tables else None


def _parse(text: str | None) -> dict | None:
    if text is None:
        return None
    try:
        rec = orjson.loads(text)
    except orjson.JSONDecodeError:
        try:  # integers beyond 64 bits, NaN: not strict JSON, still a record to look at
            rec = json.loads(text)
        except (ValueError, RecursionError):
            return None
    return rec if isinstance(rec, dict) else None


def _sample(
    files: list[InputFile],
    schema: DatasetSchema,
    sample: int,
    limit: int,
    kind: Literal["features", "events"] = "features",
) -> _Sample:
    lines = _take(files, sample, limit)
    validator = Validator(schema, max_line_bytes=limit)
    try:
        checked = getattr(validator, kind)(lines).sort_by(
            [("file_id", "ascending"), ("line_no", "ascending")]
        )
    finally:
        validator.close()
    lines = lines.sort_by([("file_id", "ascending"), ("line_no", "ascending")])
    where, keys = [], []
    for fid, n, src, src_line in zip(
        lines.column("file_id").to_pylist(),
        lines.column("line_no").to_pylist(),
        lines.column("source").to_pylist(),
        lines.column("source_line").to_pylist(),
    ):
        where.append(f"{src}:{src_line}" if src is not None else f"{files[fid].path}:{n}")
        keys.append((fid, n))
    records = [
        _parse(t) if size is None else None
        for t, size in zip(lines.column("line").to_pylist(), lines.column("too_long").to_pylist())
    ]
    return _Sample(where=where, records=records, checked=checked, keys=keys)


# ---------------------------------------------------------------------------------------------
# the checks


def _feature_value(rec: dict, schema: DatasetSchema, group: str, name: str) -> Any:
    raw = schema.raw_key(name)
    if schema.layout == "flat":
        return rec.get(raw)
    inner = rec.get(group)
    return inner.get(raw) if isinstance(inner, dict) else None


def _close(name: str, options: Iterable[str]) -> str | None:
    hits = difflib.get_close_matches(name, list(options), n=1, cutoff=0.6)
    return hits[0] if hits else None


def _toml_key(name: str) -> str:
    return name if name.replace("_", "a").isalnum() else json.dumps(name)


class _Checks:
    def __init__(self, schema: DatasetSchema, s: _Sample) -> None:
        self.schema = schema
        self.s = s
        parsed = [(i, r) for i, r in enumerate(s.records) if r is not None]
        #: event records among the feature logs: reported once, left out of the other checks
        self.events = [i for i, r in parsed if event_shaped(r, schema)]
        left_out = set(self.events)
        self.records = [(i, r) for i, r in parsed if i not in left_out]
        self.findings: list[Finding] = []
        self.unknown: dict[str, tuple[int, int]] = {}  # key as written -> (count, first index)

    def add(
        self,
        kind: str,
        severity: Severity,
        message: str,
        *,
        field: str,
        at: int | None,
        fix: str,
        count: int,
    ) -> None:
        example = self.s.where[at] if at is not None else ""
        self.findings.append(Finding(kind, severity, message, field, example, fix, count))

    def run(self) -> list[Finding]:
        self.event_lines()
        if not self.records:
            return self.findings
        layout_off = self.layout()
        self.collect_unknown()
        if not layout_off:
            self.missing()
            self.unknown_keys()
        self.ts_unit()
        self.string_ids()
        self.too_long()
        self.session_key()
        return self.findings

    # -- the kind of log ----------------------------------------------------------------------

    def event_lines(self) -> None:
        """Event records among the feature logs: sharded or built as features, each would be
        quarantined as a duplicate of its request (or for a missing ``ts``)."""
        if not self.events:
            return
        files = sorted({self.s.where[i].rsplit(":", 1)[0] for i in self.events})
        named = ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
        schema = self.schema
        self.add(
            "event_lines",
            "error",
            f"{len(self.events):,} of {len(self.s.records):,} sampled lines are event records "
            f"(`{schema.raw_key('request_id')}` and `{schema.label_key}`, no features), in "
            f"{named}: `etl shard` refuses them and the build would quarantine them as "
            "`duplicate_request_id`; the other checks leave them out",
            field=schema.label_key,
            at=self.events[0],
            count=len(self.events),
            fix="pass event logs with `--events` (`etl validate FEATURES --events EVENTS`, "
            "`etl build SHARDS --events EVENTS`), not among the feature logs",
        )

    # -- layout, missing and unknown keys -----------------------------------------------------

    def layout(self) -> bool:
        """Records flat under a nested schema, or nested under a flat one."""
        schema, n = self.schema, len(self.records)
        raw = {schema.raw_key(f) for f in schema.feature_names}
        if schema.layout == "nested":
            off = [i for i, r in self.records if raw & set(r) and not {"dense", "sparse"} & set(r)]
            keys = sorted(raw & set(self.s.records[off[0]])) if off else []
            what = (
                f"carry the features at the top level ({', '.join(f'`{k}`' for k in keys[:5])}) "
                "and no `dense`/`sparse` objects: every feature would be missing and the build "
                "refuses that"
            )
            fix = 'add `layout = "flat"` to [dataset] in the schema'
        else:
            off = [
                i
                for i, r in self.records
                if isinstance(r.get("dense"), dict) or isinstance(r.get("sparse"), dict)
            ]
            what = 'keep features in `dense`/`sparse` objects but the schema says `layout = "flat"`'
            fix = 'remove `layout = "flat"` from [dataset] (or set `layout = "nested"`)'
        if len(off) < MOST * n:
            return False
        self.add(
            "layout",
            "error",
            f"{len(off):,} of {n:,} records {what}",
            field="dense/sparse",
            at=off[0],
            count=len(off),
            fix=fix,
        )
        return True

    def collect_unknown(self) -> None:
        schema = self.schema
        top = {schema.raw_key("request_id"), *schema_keys(schema)[1:], *schema.passthrough}
        raw = {schema.raw_key(f.name): "dense" for f in schema.dense}
        raw |= {schema.raw_key(f.name): "sparse" for f in schema.sparse}
        for i, rec in self.records:
            if schema.layout == "flat":
                keys = [k for k in rec if k not in top and k not in raw]
            else:
                keys = [k for k in rec if k not in top and k not in ("dense", "sparse")]
                for group in ("dense", "sparse"):
                    inner = rec.get(group)
                    if isinstance(inner, dict):
                        keys += [f"{group}.{k}" for k in inner if raw.get(k) != group]
            for k in keys:
                c, first = self.unknown.get(k, (0, i))
                self.unknown[k] = (c + 1, first)

    def missing(self) -> None:
        n = len(self.records)
        for group, features in (("dense", self.schema.dense), ("sparse", self.schema.sparse)):
            for f in features:
                lacking = [
                    i
                    for i, r in self.records
                    if _feature_value(r, self.schema, group, f.name) is None
                ]
                if len(lacking) < MOST * n:
                    continue
                every = len(lacking) == n
                raw = self.schema.raw_key(f.name)
                written = raw if self.schema.layout == "flat" else f"{group}.{raw}"
                options = [
                    k.split(".", 1)[-1]
                    for k in self.unknown
                    if self.schema.layout == "flat" or k.startswith(group + ".")
                ]
                guess = _close(raw, options)
                if guess is not None:
                    fix = f'map it: `{_toml_key(f.name)} = "{guess}"` in [keys] of the schema'
                else:
                    fix = (
                        f"check the name `{raw}` in the logs, or remove the feature from the "
                        "schema; to build anyway: `etl build --allow-missing-features`"
                    )
                self.add(
                    "missing_feature",
                    "error" if every else "warning",
                    f"feature `{f.name}` ({group}) is missing from {len(lacking):,} of {n:,} "
                    f"records{' (every one: the build refuses that)' if every else ''}; "
                    f"{'its fill' if group == 'dense' else 'an empty list'} is used instead",
                    field=written,
                    at=lacking[0],
                    count=len(lacking),
                    fix=fix,
                )

    def unknown_keys(self) -> None:
        known = {schema_key for schema_key in schema_keys(self.schema)}
        missing = {fd.field for fd in self.findings if fd.kind == "missing_feature"}
        for key, (count, first) in sorted(self.unknown.items()):
            name = key.split(".", 1)[-1]
            target = _close(name, [m.split(".", 1)[-1] for m in missing])
            if target is not None:
                fix = f"it may be a missing feature: see the `missing_feature` fix for `{target}`"
            elif "." in key:
                group = key.split(".", 1)[0]
                fix = (
                    f"add it to the schema as a [[{group}]] feature to use it (else it is ignored)"
                )
            elif name in known:
                fix = "none needed"
            else:
                fix = "ignored by the build: add it to the schema to use it (nested layout: inside `dense`/`sparse`)"
            self.add(
                "unknown_key",
                "warning",
                f"key `{key}` is not in the schema ({count:,} of {len(self.records):,} records); "
                "the build ignores it",
                field=key,
                at=first,
                count=count,
                fix=fix,
            )

    # -- values ------------------------------------------------------------------------------

    def ts_unit(self) -> None:
        tk = self.schema.time_key
        declared = self.schema.time_unit
        per_ms = {"s": 1000, "ms": 1, "us": 0.001}[declared]  # the build's ts: raw * per_ms
        units: dict[str, list[int]] = {}
        for i, r in self.records:
            ts = r.get(tk)
            if isinstance(ts, bool) or not isinstance(ts, int | float) or ts <= 0:
                continue
            ts = ts * per_ms
            if ts < _MS_RANGE[0] / 10:
                unit = "seconds" if ts >= 10**8 else ""
            elif ts < _MS_RANGE[1]:
                unit = ""
            elif ts < 10**16:
                unit = "microseconds"
            else:
                unit = "nanoseconds"
            if unit:
                units.setdefault(unit, []).append(i)
        # what the logs' unit is, given how far off the declared one reads them
        names = {"s": "seconds", "ms": "milliseconds", "us": "microseconds"}
        actual = {"seconds": "s", "microseconds": "us", "nanoseconds": "ns"}
        steps = {"s": 0, "ms": 1, "us": 2, "ns": 3}
        for unit, at in units.items():
            ts = self.s.records[at[0]][tk]
            step = steps[declared] + steps[actual[unit]] - 1
            guess = next((u for u, k in steps.items() if k == step), None)
            if guess in names:
                fix = f'set `time_unit = "{guess}"` in the schema\'s [dataset] table'
            else:
                fix = f"write `{tk}` in epoch seconds, milliseconds or microseconds"
            self.add(
                "ts_unit",
                "error" if len(at) >= MOST * len(self.records) else "warning",
                f"`{tk}` looks like epoch {names.get(guess, 'nanoseconds')} in {len(at):,} of "
                f"{len(self.records):,} records (e.g. {ts}); the schema reads it as epoch "
                f"{names[declared]} (`time_unit` = {declared!r}), so sessions derived by the "
                "inactivity gap and hour partitions would be wrong",
                field=tk,
                at=at[0],
                count=len(at),
                fix=fix,
            )

    def string_ids(self) -> None:
        for group, features in (("sparse", self.schema.sparse), ("dense", self.schema.dense)):
            for f in features:
                if getattr(f, "ids", "int") == "hash":  # strings are what it reads
                    continue
                at = []
                for i, r in self.records:
                    v = _feature_value(r, self.schema, group, f.name)
                    listed = isinstance(v, list) and any(isinstance(x, str) for x in v)
                    if isinstance(v, str) or (group == "sparse" and listed):
                        at.append(i)
                if not at:
                    continue
                v = _feature_value(self.s.records[at[0]], self.schema, group, f.name)
                numeric = all(_numeric(x) for x in (v if isinstance(v, list) else [v]))
                what = "ids" if group == "sparse" else "a number"
                fix = f"write {what} as JSON {'integers: [12, 7]' if group == 'sparse' else 'numbers: 1.5'}, not strings"
                if group == "sparse" and not numeric:
                    fix = f'set `ids = "hash"` on the [[sparse]] feature `{f.name}` (string ids hashed in the build)'
                elif group == "sparse":
                    fix += f'; or set `ids = "hash"` on the [[sparse]] feature `{f.name}` (string ids hashed in the build)'

                self.add(
                    "string_ids",
                    "warning",
                    f"`{group}.{f.name}` holds strings ({json.dumps(v)[:60]}) in {len(at):,} of "
                    f"{len(self.records):,} records; the build quarantines them as `wrong_type`",
                    field=f"{group}.{f.name}",
                    at=at[0],
                    count=len(at),
                    fix=fix,
                )

    def too_long(self) -> None:
        for f in self.schema.sparse:
            lens = []
            for i, r in self.records:
                v = _feature_value(r, self.schema, "sparse", f.name)
                if isinstance(v, list) and len(v) > f.max_len:
                    lens.append((i, len(v)))
            if not lens:
                continue
            longest = max(n for _, n in lens)
            self._too_long(f, lens, longest)

    def _too_long(self, f: SparseFeature, lens: list[tuple[int, int]], longest: int) -> None:
        fate = (
            f"cut to their last {f.max_len} ids" if f.truncate else "quarantined as `list_too_long`"
        )
        self.add(
            "list_too_long",
            "warning",
            f"`sparse.{f.name}` is longer than max_len {f.max_len} in {len(lens):,} of "
            f"{len(self.records):,} records (up to {longest}): they are {fate}",
            field=f"sparse.{f.name}",
            at=lens[0][0],
            count=len(lens),
            fix=f"raise `max_len` of `{f.name}` to {longest} in the schema if the older ids matter",
        )

    def session_key(self) -> None:
        sk, uk = self.schema.session_key, self.schema.user_key
        keyed = [(i, r[sk]) for i, r in self.records if r.get(sk) is not None]
        if len(keyed) < _MIN_SESSION_RECORDS:
            return
        seen = Counter(json.dumps(v) for _, v in keyed)
        if max(seen.values()) > 1:
            return
        fix = (
            f"set `session_key` in [dataset] to the key that names a session; or, to derive "
            f"sessions from `{uk}` and an inactivity gap, leave `{sk}` out of the records"
        )
        self.add(
            "session_key",
            "warning",
            f"session key `{sk}` never repeats in {len(keyed):,} sampled records: every record "
            "would be its own session and deduplication gains nothing",
            field=sk,
            at=keyed[0][0],
            count=len(keyed),
            fix=fix,
        )


def _numeric(x: Any) -> bool:
    try:
        float(x)
    except (TypeError, ValueError):
        return False
    return True


def _quarantine(
    s: _Sample, *, skip: Iterable[int] = (), what: str = "lines"
) -> tuple[list[Finding], dict[str, int]]:
    """The ``quarantine`` findings of a sample, and its quarantined lines by reason; the lines
    at the positions ``skip`` (reported by another finding) are left out."""
    checked = s.checked
    skipped = {s.keys[i] for i in skip}
    reasons = checked.column("reason").to_pylist()
    details = checked.column("detail").to_pylist()
    fids = checked.column("file_id").to_pylist()
    lines = checked.column("line_no").to_pylist()
    index = {(f, n): i for i, (f, n) in enumerate(s.keys)}
    kept = [i for i, key in enumerate(zip(fids, lines)) if key not in skipped]
    first: dict[str, int] = {}
    for i in kept:
        if reasons[i] is not None:
            first.setdefault(reasons[i], i)
    counts = Counter(reasons[i] for i in kept if reasons[i] is not None)
    out = []
    total = len(kept)
    for reason, i in first.items():
        detail = details[i] or ""
        fld = detail.split("`")[1] if detail.startswith("field `") else ""
        every = counts[reason] == total
        out.append(
            Finding(
                "quarantine",
                "error" if every else "warning",
                f"{counts[reason]:,} of {total:,} sampled {what} would be quarantined as "
                f"`{reason}`"
                + (" (every one: the dataset would be empty)" if every else "")
                + f": {detail}",
                fld,
                s.where[index[(fids[i], lines[i])]],
                "see docs/data-contract.md for the record's keys and types",
                counts[reason],
            )
        )
    return out, dict(counts)


def _feature_lines(s: _Sample, schema: DatasetSchema) -> list[Finding]:
    """Feature records among the event logs (``dense``/``sparse`` or feature keys, no label)."""
    raw = {schema.raw_key(name) for name in schema.feature_names} | {"dense", "sparse"}
    at = [
        i
        for i, r in enumerate(s.records)
        if r is not None and schema.label_key not in r and raw & set(r)
    ]
    if not at:
        return []
    return [
        Finding(
            "feature_lines",
            "error",
            f"{len(at):,} of {len(s.records):,} sampled event lines are feature records "
            f"(features, no `{schema.label_key}`): the build would quarantine them as events "
            "without a label",
            schema.label_key,
            s.where[at[0]],
            "pass feature logs as the command's inputs (LOGS), not with `--events`",
            len(at),
        )
    ]


def validate_logs(
    inputs: str | Path | Iterable[str | Path],
    *,
    schema: DatasetSchema | None = None,
    sample: int = 10_000,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    events: str | Path | Iterable[str | Path] | None = None,
) -> LogReport:
    """Dry-run the build over the first ``sample`` lines of the feature logs ``inputs`` (and
    of the event logs ``events``).

    Args:
        inputs: ``.jsonl`` / ``.jsonl.zst`` / ``.parquet`` files, directories or globs.
        schema: the dataset schema (default: the bundled one).
        sample: lines read in all, split evenly over the files (the first of each); as many
            again from the event logs.
        max_line_bytes: the build's line limit.
        events: event-log files, directories or globs, validated as event logs (a file also
            found under ``inputs`` is read as an event log only); None: none.

    Returns:
        the report; ``report.ok`` is False when the build would refuse the logs.

    Raises:
        DataError: when there are no inputs; CorruptInputError naming a file (and line) that
            the build could not read either.
    """
    if isinstance(sample, bool) or not isinstance(sample, int) or sample < 1:
        from recpipe.errors import DataError

        raise DataError(f"`sample` must be a positive integer, got {sample!r}")
    schema = schema or default_schema()
    event_files = list_inputs(events) if events is not None else []
    as_events = {f.path.resolve() for f in event_files}
    files = [f for f in list_inputs(inputs) if f.path.resolve() not in as_events]
    if not files:
        from recpipe.errors import DataError

        raise DataError("`inputs`: every feature-log file is also named by `--events`")
    s = _sample(files, schema, sample, max_line_bytes)
    report = LogReport(files=[str(f.path) for f in files], lines=len(s.records), quarantined={})
    checks = _Checks(schema, s)
    findings = checks.run()
    quarantine, report.quarantined = _quarantine(s, skip=checks.events)
    if event_files:
        e = _sample(event_files, schema, sample, max_line_bytes, kind="events")
        report.event_files = [str(f.path) for f in event_files]
        report.event_lines = len(e.records)
        found, report.events_quarantined = _quarantine(e, what="event lines")
        quarantine += [*found, *_feature_lines(e, schema)]
    # a planted mistake already named by a specific finding keeps its quarantine line too
    ordered = sorted([*findings, *quarantine], key=lambda f: (f.severity != "error", f.kind))
    report.findings = ordered
    return report


def format_report(report: LogReport) -> str:
    """A readable report: one block per finding."""
    head = (
        f"sampled {report.lines:,} lines of {len(report.files)} file(s); "
        f"{sum(report.quarantined.values()):,} would be quarantined"
    )
    if report.event_files:
        head += (
            f"; {report.event_lines:,} event lines of {len(report.event_files)} file(s), "
            f"{sum(report.events_quarantined.values()):,} would be quarantined"
        )
    out = [head]
    for f in report.findings:
        out.append(f"{f.severity}: [{f.kind}] {f.message}")
        if f.example:
            out.append(f"  at {f.example}" + (f" field `{f.field}`" if f.field else ""))
        out.append(f"  fix: {f.fix}")
    out.append(
        "ok: the build would accept these logs"
        if report.ok
        else "FAILED: the build would refuse these logs (errors above)"
    )
    return "\n".join(out)


def _run_cli(args: argparse.Namespace) -> int:
    schema = load_schema(args.schema) if args.schema else default_schema()
    report = validate_logs(args.inputs, schema=schema, sample=args.sample, events=args.events)
    print(json.dumps(report.to_dict(), indent=2) if args.json else format_report(report))
    if not report.ok:
        return 1
    warned = any(f.severity == "warning" for f in report.findings)
    return 1 if args.strict and warned else 0


def register_cli(stages: argparse._SubParsersAction) -> None:
    """Add ``recpipe etl validate`` to the ``etl`` stage parsers."""
    parser = stages.add_parser(
        "validate",
        help="dry-run the build over a sample of raw logs: what it would refuse, and the fix",
        description=(
            "Read the first lines of raw feature logs (.jsonl / .jsonl.zst / .parquet files, "
            "directories, globs; their format: docs/data-contract.md) and validate them as "
            "`etl build` would. Reports features missing from all or most records, keys the "
            "schema does not name, flat records under a nested schema, timestamps in seconds "
            "or microseconds, ids written as strings, lists over max_len, a session key that "
            "never repeats, event records among the feature logs and every quarantine reason met, "
            "each with an example file:line and a suggested fix. --events validates the event "
            "logs too. Exits 1 when the build would refuse the logs."
        ),
    )
    parser.add_argument("inputs", nargs="+", metavar="LOGS", help="feature-log files/dirs/globs")
    parser.add_argument(
        "--events",
        nargs="+",
        metavar="EVENTS",
        help="event-log files/dirs/globs, validated as event logs (labels); event records "
        "among the feature logs are an error",
    )
    parser.add_argument("--schema", type=Path, help="schema TOML (default: the bundled one)")
    parser.add_argument(
        "--sample",
        type=positive_int,
        default=10_000,
        metavar="N",
        help="lines to read (default 10000)",
    )
    parser.add_argument("--strict", action="store_true", help="exit 1 on warnings too")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(func=_run_cli)
