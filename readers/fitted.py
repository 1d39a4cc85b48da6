"""Fitted preprocessing state: what ``recpipe fit`` writes beside a dataset, and how a pipeline
config takes it.

A ``[[preprocess]]`` entry asks to be fitted with a ``fit`` key instead of the parameters the
fit computes::

    [[preprocess]]
    transform = "VocabLookup"
    features = ["item_category", "context_surface"]
    fit = { min_count = 2, max_size = 100_000 }   # one vocabulary per feature
    params = { num_oov_buckets = 4 }

    [[preprocess]]
    transform = "Normalize"
    features = ["user_age", "item_price"]
    fit = true                                     # mean and std per feature

    [[preprocess]]
    transform = "Bucketize"
    features = ["item_price"]
    fit = { num_buckets = 8 }                      # quantile boundaries per feature

=========== ============================ =====================================================
transform   ``fit`` options              fitted parameters (over the training rows only)
=========== ============================ =====================================================
VocabLookup ``min_count`` (1),           ``vocab`` per feature: ids seen at least
            ``max_size`` (none)          ``min_count`` times, most frequent first (ties: the
                                         smaller id first), at most ``max_size`` of them
Normalize   none (``fit = true``)        ``mean``, ``std`` per feature: of the values that
                                         are not missing (population std; 1.0 if it is 0)
Bucketize   ``num_buckets`` (>= 2)       ``boundaries`` per feature: the distinct quantiles
                                         ``i / num_buckets`` (linear interpolation,
                                         ``numpy.quantile``'s default), ``i = 1..n-1``
=========== ============================ =====================================================

``recpipe fit DATASET --preprocess P.toml`` computes them in DuckDB over the dataset's training
rows (the sessions :func:`readers.holdout.holdout_splits` does not hold out, for its
``--eval-fraction`` and ``--seed``) and writes ``DATASET/_preprocess_fitted.json``
(:data:`FITTED_NAME`), or with ``--out FITTED.json`` that file and nothing into the dataset (a
read-only or shared dataset, several fitted states of one dataset). A pipeline made for that
dataset (``make_dataloader(DATASET, transforms="P.toml", fitted=...)``, ``recpipe train
--fitted``, ``recpipe serve --fitted``) fills each fitted entry from the file it is given, or
else from ``DATASET/_preprocess_fitted.json``; an entry with ``fit`` and no fitted state is an
error that says to run ``recpipe fit``.

**Fitted on the values the step sees.** A fitted entry is fitted on its features' values as
the pipeline hands them to it: after every earlier entry of the config that names the same
feature (a ``HashModulo`` before a ``VocabLookup``: the vocabulary holds hashed ids; a
``Log1p`` before a ``Normalize``: the mean and std of the logs; a fitted ``Normalize`` before a
fitted ``Bucketize``: quantiles of the normalised values). Without earlier entries that is the
stored column.

**Whose state it is.** The file records two digests and readers refuse a file whose digests
are not theirs, in one line: ``config_digest`` (:func:`fitted_signature`: the fitted entries'
transforms, features and ``fit`` options, and every earlier entry naming one of their features,
whole) and ``dataset_digest`` (:func:`dataset_digest`: the dataset's part files by path, size
and content digest).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from recpipe.errors import DataError, SchemaError
from recpipe.integrity import MANIFEST_NAME, file_sha256, listed_files, read_manifest

__all__ = [
    "FITTED_NAME",
    "FITTED_VERSION",
    "FIT_OPTIONS",
    "apply_fitted",
    "dataset_digest",
    "fill_fitted",
    "fit_entries",
    "fit_options",
    "fitted_file",
    "fitted_holdout_mismatch",
    "fitted_path",
    "fitted_signature",
    "read_fitted",
]

FITTED_NAME = "_preprocess_fitted.json"
"""The fitted state's file name inside the dataset directory (``_``: readers skip it)."""

FITTED_VERSION = 2
"""Version 2 records ``config_digest`` and ``dataset_digest`` and fits on each step's inputs;
a version-1 state (fitted on the stored columns) is refused with a hint to fit again."""

FIT_OPTIONS: dict[str, dict[str, Any]] = {
    "VocabLookup": {"min_count": 1, "max_size": None},
    "Normalize": {},
    "Bucketize": {"num_buckets": None},
}
"""The transforms that can be fitted and their ``fit`` options with defaults (``None`` for
``num_buckets``: required)."""

_FITTED_PARAMS = {"VocabLookup": ("vocab", "path"), "Normalize": ("mean", "std"),
                  "Bucketize": ("boundaries",)}  # fmt: skip


def fitted_path(dataset: str | os.PathLike[str]) -> Path:
    """Where the fitted state of ``dataset`` lives."""
    return Path(dataset) / FITTED_NAME


def fit_entries(entries: Sequence[Mapping[str, Any]]) -> list[tuple[int, Mapping[str, Any]]]:
    """``(index, entry)`` of the entries with a ``fit`` key, in order."""
    return [(i, e) for i, e in enumerate(entries) if isinstance(e, Mapping) and "fit" in e]


def fit_options(entry: Mapping[str, Any], *, where: str) -> dict[str, Any]:
    """The checked ``fit`` options of one entry (defaults filled in).

    Raises:
        SchemaError: a transform that cannot be fitted, a fitted parameter also given in
            ``params``, or a bad or unknown option (named with ``where``).
    """
    name = entry.get("transform")
    if name not in FIT_OPTIONS:
        msg = f"{where}: `fit` is for {', '.join(FIT_OPTIONS)}, not {name!r}"
        raise SchemaError(msg)
    fit = entry["fit"]
    if fit is True:
        fit = {}
    if not isinstance(fit, Mapping):
        msg = f"{where}: `fit` must be true or a table of options, got {fit!r}"
        raise SchemaError(msg)
    defaults = FIT_OPTIONS[name]
    unknown = sorted(set(fit) - set(defaults))
    if unknown:
        allowed = ", ".join(defaults) or "none (write `fit = true`)"
        msg = f"{where}: {name} has no `fit` option {unknown[0]!r}; its options: {allowed}"
        raise SchemaError(msg)
    clash = sorted(set(entry.get("params") or {}) & set(_FITTED_PARAMS[name]))
    if clash:
        msg = f"{where}: `params.{clash[0]}` is what `fit` computes; give one or the other"
        raise SchemaError(msg)
    options = {**defaults, **fit}
    for key in ("min_count", "num_buckets"):
        value = options.get(key, 1)
        low = 2 if key == "num_buckets" else 1
        if key in options and (
            isinstance(value, bool) or not isinstance(value, int) or value < low
        ):
            msg = f"{where}: `fit.{key}` must be an integer >= {low}, got {value!r}"
            raise SchemaError(msg)
    size = options.get("max_size")
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        msg = f"{where}: `fit.max_size` must be a positive integer, got {size!r}"
        raise SchemaError(msg)
    return options


def fitted_signature(entries: Sequence[Mapping[str, Any]]) -> str:
    """The config digest of a fitted state: a state fitted for another config is refused.

    It covers what decides the fitted figures: each fitted entry's transform, features and
    ``fit`` options, and, whole, every earlier entry that names one of its features (what the
    fitted step is fitted after). Other entries, and a fitted entry's own ``params`` (its
    ``num_oov_buckets``...), can change without fitting again."""
    key = []
    for i, entry in fit_entries(entries):
        names = set(_features(entry))
        before = [_plain(e) for e in entries[:i] if names & set(_features(e))]
        fit = entry["fit"] if entry["fit"] is not True else {}
        key.append([before, entry.get("transform"), list(_features(entry)), fit])
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def _plain(entry: Mapping[str, Any]) -> Any:
    """An entry as JSON can hold it (a digest's input)."""
    return json.loads(json.dumps(entry, sort_keys=True, default=repr))


_TAIL = 1 << 16  # the bytes of a part file digested when the manifest has no sha256 of it


def dataset_digest(dataset: str | os.PathLike[str]) -> str:
    """The dataset digest of a fitted state: a state fitted on another dataset is refused.

    A digest of the part files the readers read (:func:`readers.listing.discover_files`): each
    one's path inside the dataset, size and content digest, the ``sha256`` the manifest lists
    (``recpipe etl build`` records it) or else that of the file's last 64 KiB (its Parquet
    footer, which holds every column chunk's statistics). A copy of the dataset has the same
    digest; a rebuilt one, another.

    Raises:
        DataError: the dataset's files cannot be listed or read.
    """
    from readers.listing import discover_files

    root = Path(dataset)
    known: dict[str, str | None] = {}
    if (root / MANIFEST_NAME).is_file():
        manifest = read_manifest(root)
        if isinstance(manifest.get("files"), list):
            source = os.fspath(root / MANIFEST_NAME)
            known = {f.path: f.sha256 for f in listed_files(manifest, source=source)}
    key = []
    for path in discover_files(root):
        rel = path.relative_to(root).as_posix()
        try:
            size = path.stat().st_size
            sha = known.get(rel) or _tail_sha256(path, size)
        except OSError as exc:
            msg = f"{os.fspath(path)}: cannot read the part file to identify the dataset: {exc}"
            raise DataError(msg) from exc
        key.append([rel, size, sha])
    return hashlib.sha256(json.dumps(sorted(key)).encode()).hexdigest()[:16]


def _tail_sha256(path: Path, size: int) -> str:
    if size > _TAIL:
        with path.open("rb") as fh:
            fh.seek(size - _TAIL)
            return hashlib.sha256(fh.read()).hexdigest()
    return file_sha256(path)[1]


def _features(entry: Mapping[str, Any]) -> tuple[str, ...]:
    features = entry.get("features") or ()
    return (features,) if isinstance(features, str) else tuple(features)


def read_fitted(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a fitted state file.

    Raises:
        SchemaError: it cannot be read or is not a fitted state of this version.
    """
    try:
        state = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        msg = f"{os.fspath(path)}: cannot read the fitted preprocessing state: {exc}"
        raise SchemaError(msg) from exc
    version = state.get("version") if isinstance(state, dict) else None
    if isinstance(version, int) and not isinstance(version, bool) and version < FITTED_VERSION:
        msg = (
            f"{os.fspath(path)}: a fitted state of version {version}, written by an older "
            f"`recpipe fit` (this one reads version {FITTED_VERSION})\n"
            "hint: run `recpipe fit` again"
        )
        raise SchemaError(msg)
    if version != FITTED_VERSION or not isinstance(state.get("steps"), list):
        msg = f"{os.fspath(path)}: not a fitted preprocessing state (version {FITTED_VERSION})"
        raise SchemaError(msg)
    return state


def fitted_file(
    dataset: str | os.PathLike[str] | None, fitted: str | os.PathLike[str] | None = None
) -> Path | None:
    """The fitted state a reader of ``dataset`` uses: ``fitted`` when given, else the
    dataset's own :data:`FITTED_NAME` (``None``: neither)."""
    if fitted is not None:
        return Path(fitted)
    return None if dataset is None else fitted_path(dataset)


def apply_fitted(
    entries: Sequence[Mapping[str, Any]],
    *,
    dataset: str | os.PathLike[str] | None,
    fitted: str | os.PathLike[str] | None = None,
    origin: str = "",
) -> tuple[list[Mapping[str, Any]], list[str]]:
    """The entries with every ``fit`` entry filled from a fitted state.

    A fitted ``VocabLookup`` or ``Bucketize`` entry becomes one entry per feature (each has its
    own vocabulary or boundaries); entries without ``fit`` pass through.

    Args:
        entries: ``[[preprocess]]`` entries.
        dataset: the dataset directory read (``None``: not a directory). Its
            :data:`FITTED_NAME` is read when some entry has ``fit`` and ``fitted`` is not given,
            and a state fitted on another dataset is refused.
        fitted: the fitted state file (``recpipe fit --out``).
        origin: names the config in messages (a file name and a space, or ``""``).

    Returns:
        ``(entries, where)``: the entries and a label for each, naming the original table.

    Raises:
        SchemaError: an entry asks to be fitted and there is no fitted state, or the state was
            fitted for another config or on another dataset.
    """
    fitted_at = fit_entries(entries)
    labels = [f"{origin}[[preprocess]] #{i + 1}" for i in range(len(entries))]
    if not fitted_at:
        return list(entries), labels
    for i, entry in fitted_at:
        fit_options(entry, where=labels[i])
    config = origin.strip() or "CONFIG"
    path = fitted_file(dataset, fitted)
    if path is None or not path.is_file():
        first = labels[fitted_at[0][0]]
        what = "no dataset directory" if path is None else f"no {path}"
        msg = (
            f"{first}: asks to be fitted (`fit`), and there is {what}\n"
            f"hint: run `recpipe fit DATASET --preprocess {config}`"
        )
        raise SchemaError(msg)
    state = read_fitted(path)
    refit = f"recpipe fit {os.fspath(dataset) if dataset is not None else 'DATASET'} --preprocess {config}"
    if state.get("config_digest") != fitted_signature(entries):
        msg = (
            f"{path}: fitted for another preprocessing config ({state.get('config') or '?'}, "
            f"config digest {state.get('config_digest')}) than {origin.strip() or 'this one'} "
            f"({fitted_signature(entries)})\nhint: run `{refit}`"
        )
        raise SchemaError(msg)
    if dataset is not None and state.get("dataset_digest") != (here := dataset_digest(dataset)):
        msg = (
            f"{path}: fitted on another dataset ({state.get('dataset') or '?'}, dataset digest "
            f"{state.get('dataset_digest')}) than {os.fspath(dataset)} ({here})\n"
            f"hint: run `{refit}`"
        )
        raise SchemaError(msg)
    return fill_fitted(entries, state["steps"], labels)


def fill_fitted(
    entries: Sequence[Mapping[str, Any]],
    steps: Sequence[Mapping[str, Any]],
    labels: Sequence[str],
) -> tuple[list[Mapping[str, Any]], list[str]]:
    """The entries with their ``fit`` entries filled from ``steps`` (one per fitted entry, in
    order: a fitted state's ``steps``), and their labels. See :func:`apply_fitted`."""
    it = iter(steps)
    out: list[Mapping[str, Any]] = []
    where: list[str] = []
    for i, entry in enumerate(entries):
        if "fit" not in entry:
            out.append(entry)
            where.append(labels[i])
            continue
        step = next(it)
        base = {k: v for k, v in entry.items() if k != "fit"}
        params = dict(entry.get("params") or {})
        if entry["transform"] == "Normalize":
            per = step["features"]
            params["mean"] = [per[f]["mean"] for f in _features(entry)]
            params["std"] = [per[f]["std"] for f in _features(entry)]
            out.append({**base, "params": params})
            where.append(f"{labels[i]} (fitted)")
            continue
        for feature in _features(entry):
            out.append(
                {**base, "features": [feature], "params": {**params, **step["features"][feature]}}
            )
            where.append(f"{labels[i]} (fitted, {feature})")
    return out, where


def fitted_holdout_mismatch(
    dataset: str | os.PathLike[str],
    *,
    eval_fraction: float,
    seed: int,
    fitted: str | os.PathLike[str] | None = None,
) -> str | None:
    """Why the fitted state a run uses (``fitted``, else the dataset's) does not match the run's
    holdout (``None``: it matches, or there is no fitted state). Fitted on another holdout, the
    statistics saw held-out rows."""
    path = fitted_file(dataset, fitted)
    if path is None or not path.is_file():
        return None
    state = read_fitted(path)
    if state.get("eval_fraction") == eval_fraction and state.get("seed") == seed:
        return None
    return (
        f"{path} was fitted with --eval-fraction {state.get('eval_fraction')} --seed "
        f"{state.get('seed')}, this run holds out with {eval_fraction} and {seed}: the fitted "
        "statistics may include held-out rows; run `recpipe fit` with the run's options"
    )
