""":func:`build`: one ``etl build``, phase by phase, with whichever engine the config names.

The driver owns what no engine may vary: the output directory (written into a temporary
sibling that replaces it at the end, ``_manifest.json`` written last, so a crashed run never
leaves a dataset that looks complete; the next run removes a stale one), the input checks, the
order of the phases and their timing, the check of missing features, and the shared writers.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import re
import secrets
import shutil
import sys
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from etl.build.config import BuildConfig
from etl.build.engine import BuildJob, Engine, engine_class
from etl.build.inputs import check_structure, check_unchanged, digest, list_inputs
from etl.build.output import (
    BuildCounts,
    build_manifest,
    dataset_writer,
    output_error,
    write_quarantine,
    write_rows,
)
from etl.build.validate import Validator
from etl.paths import check_output
from recpipe._process import pid_alive
from recpipe.errors import DataError
from schemas import DatasetSchema, default_schema

__all__ = ["build", "check_missing_features"]

_log = logging.getLogger(__name__)

_TMP_PREFIX = ".tmp-"
_OLD_PREFIX = ".old-"


def build(
    features: str | Path | Iterable[str | Path],
    out_dir: str | Path,
    *,
    events: str | Path | Iterable[str | Path] | None = None,
    schema: DatasetSchema | None = None,
    config: BuildConfig | None = None,
    overwrite: bool = False,
    progress: bool = False,
) -> dict:
    """Build the session-clustered dataset (``docs/etl-engines.md``) from raw logs.

    Args:
        features: feature logs: a path, directory, glob, or a list of them (``.jsonl``,
            ``.jsonl.zst``, ``.parquet``).
        out_dir: the dataset directory to create (replaced atomically at the end).
        events: event logs (same forms); without them every label is 0 (a manifest warning).
        schema: the dataset schema (default: the bundled example schema).
        config: build options (default: :class:`BuildConfig()`).
        overwrite: replace an existing ``out_dir``.
        progress: show tqdm bars per phase on stderr.

    Returns:
        The manifest (also written to ``out_dir/_manifest.json``).

    Raises:
        DataError: bad arguments, missing inputs, an existing ``out_dir`` without
            ``overwrite``, or schema features missing from the records (see
            :func:`check_missing_features`).
        CorruptInputError: an input file that cannot be decoded (named in the message).
        RecpipeError: the output cannot be written (a full disk: naming ``out_dir``; an
            existing dataset there is left as it was).
    """
    t_start = time.perf_counter()
    schema = schema if schema is not None else default_schema()
    config = config if config is not None else BuildConfig()
    engine = engine_class(config.engine)
    engine.check_config(config)
    out_dir = _check_out_dir(Path(out_dir), inputs=[features, events], overwrite=overwrite)
    feat_files = list_inputs(features)
    ev_files = list_inputs(events) if events is not None else []
    tmp = out_dir.parent / f".{out_dir.name}{_TMP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
    try:
        tmp.mkdir()
        phases = _Phases(progress)
        job = BuildJob(
            schema=schema,
            config=config,
            feature_files=feat_files,
            event_files=ev_files,
            validator=Validator(schema, max_line_bytes=config.max_line_bytes),
            work_dir=tmp,
            bar=phases.bar,
        )
        try:
            manifest = _run(engine, job, phases)
        finally:
            job.validator.close()
        manifest["elapsed_s"] = round(time.perf_counter() - t_start, 3)
        (tmp / "_manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        _commit(tmp, out_dir)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError):  # inputs are read with errors of their own: the output
            raise output_error(out_dir, exc) from None
        raise
    manifest["elapsed_s"] = round(time.perf_counter() - t_start, 3)
    _log.info(
        "built %s: %d rows out of %d in, %d quarantined, %.1f s",
        out_dir, manifest["rows_out"], manifest["rows_in"], manifest["rows_quarantined"],
        manifest["elapsed_s"],
    )  # fmt: skip
    return manifest


def _run(engine_cls: type[Engine], job: BuildJob, phases: _Phases) -> dict:
    """The phases, in order; returns the manifest (without ``elapsed_s``)."""
    t = phases.start()
    inputs = _Inputs(job)
    with engine_cls(job) as engine:
        t = phases.timed("setup", t)
        engine.load("features")
        engine.load("events")
        inputs.digests()
        t = phases.timed("parse", t)
        counts = _combine(engine, phases)
        t = phases.timed("dedup_join_sessionize", t)
        check_missing_features(counts, job.config)
        _write_quarantine(engine, job)
        t = phases.timed("quarantine", t)
        written = engine.write_dataset(counts.rows_out)  # the engine's workers write
        if written is None:  # the engine's rows, through the shared writer here
            writer = dataset_writer(job.work_dir, job.schema, job.config, rows=counts.rows_out)
            with phases.bar(
                "write parquet", total=counts.rows_out, unit="row", unit_scale=True
            ) as bar:
                files = write_rows(writer, engine.rows(), config=job.config, progress=bar.update)
        else:
            writer, files = written
        phases.timed("write", t)
    inputs.check_unchanged()
    return build_manifest(
        schema=job.schema,
        config=job.config,
        inputs=inputs.digests(),
        feat_files=job.feature_files,
        ev_files=job.event_files,
        counts=counts,
        writer=writer,
        files=files,
        phase_s=phases.times,
        phase_cpu_s=phases.cpu_times,
    )


class _Inputs:
    """The build's input files: checked before anything reads them (failing fast on a truncated
    or mislabelled file), digested on a second thread (overlapping the parse), and checked
    again at the end: the digests describe exactly the bytes the build parsed, or the build
    fails naming the file that changed."""

    def __init__(self, job: BuildJob) -> None:
        self.files = [*job.feature_files, *job.event_files]
        self.since = time.time()
        self.checked = [check_structure(f) for f in self.files]
        pool = ThreadPoolExecutor(max_workers=1)
        try:
            self.futures: list[Future] = [
                pool.submit(digest, f, st) for f, st in zip(self.files, self.checked)
            ]
        finally:
            pool.shutdown(wait=False)

    def digests(self) -> list[dict]:
        """``{path, bytes, sha256}`` of each input (waits for the hashing)."""
        return [d.result() for d in self.futures]

    def check_unchanged(self) -> None:
        """Refuse an input that changed since it was checked (:func:`check_unchanged`)."""
        for f, st, rec in zip(self.files, self.checked, self.digests()):
            check_unchanged(f, st, rec, since=self.since)


def _combine(engine: Engine, phases: _Phases) -> BuildCounts:
    with phases.bar("dedup, join, sessionize", total=4) as bar:
        engine.deduplicate()
        bar.update(1)
        engine.join_labels()
        bar.update(1)
        engine.sessionize()
        bar.update(1)
        counts = engine.counts()
        bar.update(1)
    return counts


def _write_quarantine(engine: Engine, job: BuildJob) -> None:
    qdir = job.work_dir / "_quarantine"
    qdir.mkdir()
    for kind in ("features", "events"):
        path = qdir / f"{kind}.parquet"
        if not engine.write_quarantine(kind, path):
            write_quarantine(engine.quarantined(kind), job.files(kind), path)
    trace_shard_lines(qdir / "features.parquet")


_SHARD_NAME = re.compile(r"shard-(\d+)\.jsonl\.zst")
_SEEN_AT = re.compile(r"(.* already seen at )(.+):(\d+)$", re.DOTALL)
#: the shard's replay, imported when a quarantine names shard lines (``etl.shard`` reads
#: Parquet inputs with this package's reader: a static import would be a cycle)
_SHARD_ORIGINS = "etl.shard:shard_origins"


def trace_shard_lines(path: Path) -> int:
    """Point the feature quarantine ``path``'s lines that came through ``etl shard`` at the
    file and line they came from, and the first record a ``duplicate_request_id`` detail names
    (``already seen at FILE:LINE``) too (:func:`etl.shard.shard_origins`, replaying the shard
    over its inputs). Lines of a shard whose inputs are gone or changed keep the shard's name
    and line, with a warning. Returns how many places were rewritten.
    """
    table = pq.read_table(path)
    sources, lines = table.column("source").to_pylist(), table.column("line").to_pylist()
    details = table.column("detail").to_pylist()
    seen = [_SEEN_AT.match(d or "") for d in details]
    places = {*zip(sources, lines), *((m[2], int(m[3])) for m in seen if m)}
    wanted: dict[Path, dict[tuple[int, int], tuple[str, int]]] = {}
    for src, line in places:
        p = Path(src)
        hit = _SHARD_NAME.fullmatch(p.name)
        if hit and (p.parent / "_shard.json").is_file():
            wanted.setdefault(p.parent, {})[(int(hit[1]), line)] = (src, line)
    if not wanted:
        return 0
    module, _, name = _SHARD_ORIGINS.partition(":")
    shard_origins = getattr(importlib.import_module(module), name)
    origin: dict[tuple[str, int], tuple[str, int]] = {}
    for folder, where in wanted.items():
        found = shard_origins(folder, where)
        if found is None:
            _log.warning(
                "%s: quarantined lines keep the shard's file and line: the inputs listed in its "
                "_shard.json are gone or changed",
                folder,
            )
            continue
        origin |= {where[k]: v for k, v in found.items()}
    if not origin:
        return 0
    for i, (src, line) in enumerate(zip(sources, lines)):
        sources[i], lines[i] = origin.get((src, line), (src, line))
        m = seen[i]
        if m and (m[2], int(m[3])) in origin:
            first, first_line = origin[(m[2], int(m[3]))]
            details[i] = f"{m[1]}{first}:{first_line}"
    columns = {"source": pa.array(sources, pa.string()), "line": pa.array(lines, pa.int64())}
    columns["detail"] = pa.array(details, pa.string())
    for name, values in columns.items():
        table = table.set_column(table.schema.get_field_index(name), name, values)
    pq.write_table(table, path, compression="zstd", write_page_checksum=True)
    return len(origin)


def check_missing_features(counts: BuildCounts, config: BuildConfig) -> None:
    """Fail when a schema feature is missing from ``config.fail_missing_share`` of the valid
    records or more (1.0: from every one), unless ``config.allow_missing_features``.

    Raises:
        DataError: naming the features, how many records lack them, and the top-level keys
            the records carry instead (features written outside ``dense``/``sparse``).
    """
    valid = counts.rows_valid
    if config.allow_missing_features or not valid:
        return
    share = config.fail_missing_share
    over = {f: n for f, n in counts.features_missing.items() if n >= share * valid}
    if not over:
        return
    names = list(over)
    listed = ", ".join(f"`{f}` ({over[f]:,})" for f in names[:10])
    more = f" and {len(names) - 10} more" if len(names) > 10 else ""
    where = "every one" if share >= 1.0 else f"at least {share:.0%}"
    msg = (
        f"{len(names)} schema feature(s) missing from {where} of the {valid:,} valid records: "
        f"{listed}{more}"
    )
    if counts.unknown_keys:
        keys = ", ".join(f"`{k}`" for k in sorted(counts.unknown_keys)[:10])
        msg += f"\nthe records carry top-level keys the build does not read: {keys}"
    msg += (
        "\nhint: features belong under `dense` and `sparse` (records with features at the top "
        'level need `layout = "flat"` in [dataset]; other key names, a [keys] mapping: '
        "docs/data-contract.md); `recpipe etl validate` names the fix; check the records and the "
        "schema, or pass --allow-missing-features (allow_missing_features=True) to build anyway "
        "(--fail-missing-share sets the share)"
    )
    raise DataError(msg)


def _check_out_dir(out_dir: Path, *, inputs: list[Any], overwrite: bool) -> Path:
    """``out_dir``, once it may be written (:func:`etl.paths.check_output`: not an input, nor
    inside or around one; absent, empty, or an earlier dataset replaced with ``overwrite``)."""
    check_output(out_dir, kind="dataset", inputs=inputs, overwrite=overwrite, arg="out_dir")
    _clean_stale(out_dir)
    return out_dir


def _commit(tmp: Path, out_dir: Path) -> None:
    """Put the finished ``tmp`` in place of ``out_dir`` (the old one removed after the swap)."""
    if out_dir.exists():
        old = out_dir.parent / f".{out_dir.name}{_OLD_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out_dir)


def _clean_stale(out_dir: Path) -> list[str]:
    """Remove temporary/old directories of crashed builds of ``out_dir``."""
    removed = []
    for prefix in (_TMP_PREFIX, _OLD_PREFIX):
        for p in out_dir.parent.glob(f".{_glob_escape(out_dir.name)}{prefix}*"):
            pid = p.name[len(out_dir.name) + 1 + len(prefix) :].split("-")[0]
            if pid.isdigit() and int(pid) != os.getpid() and pid_alive(int(pid)):
                continue
            shutil.rmtree(p, ignore_errors=True)
            removed.append(str(p))
    return removed


def _glob_escape(name: str) -> str:
    import glob

    return glob.escape(name)


class _Phases:
    """A tqdm bar per phase (stderr), and the time each phase took: wall seconds, and CPU
    seconds of this process (every thread: DuckDB's, the encoders'; not a Spark JVM's)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.times: dict[str, float] = {}
        self.cpu_times: dict[str, float] = {}
        self._cpu = time.process_time()

    def bar(self, desc: str, total: float | None = None, unit: str = "it", **kw: Any):
        from recpipe.progress import progress_bar

        return progress_bar(
            total=total,
            desc=desc,
            unit=unit,
            disable=not self.enabled,
            file=sys.stderr,
            leave=True,
            **kw,
        )

    def start(self) -> float:
        """The wall clock where the first phase starts (its CPU clock starts here too)."""
        self._cpu = time.process_time()
        return time.perf_counter()

    def timed(self, name: str, t0: float) -> float:
        now, cpu = time.perf_counter(), time.process_time()
        self.times[name] = round(self.times.get(name, 0.0) + now - t0, 3)
        self.cpu_times[name] = round(self.cpu_times.get(name, 0.0) + cpu - self._cpu, 3)
        self._cpu = cpu
        return now
