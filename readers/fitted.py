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
(:data:`FITTED_NAME`). A pipeline made for that dataset (``make_dataloader(DATASET,
transforms="P.toml")``, ``recpipe train``, ``recpipe serve``) fills each fitted entry from it; an
entry with ``fit`` and no fitted state, or a state fitted for other ``fit`` entries, is an error
that says to run ``recpipe fit``.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from recpipe.errors import SchemaError

__all__ = [
    "FITTED_NAME",
    "FITTED_VERSION",
    "FIT_OPTIONS",
    "apply_fitted",
    "fit_entries",
    "fit_options",
    "fitted_holdout_mismatch",
    "fitted_path",
    "fitted_signature",
    "read_fitted",
]

FITTED_NAME = "_preprocess_fitted.json"
"""The fitted state's file name inside the dataset directory (``_``: readers skip it)."""

FITTED_VERSION = 1

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
    """A digest of the fitted entries (transform, features, ``fit`` options): a state fitted for
    other entries is refused."""
    key = [
        [e.get("transform"), list(_features(e)), e["fit"] if e["fit"] is not True else {}]
        for _, e in fit_entries(entries)
    ]
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


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
    if not isinstance(state, dict) or state.get("version") != FITTED_VERSION:
        msg = f"{os.fspath(path)}: not a fitted preprocessing state (version {FITTED_VERSION})"
        raise SchemaError(msg)
    return state


def apply_fitted(
    entries: Sequence[Mapping[str, Any]],
    *,
    dataset: str | os.PathLike[str] | None,
    origin: str = "",
) -> tuple[list[Mapping[str, Any]], list[str]]:
    """The entries with every ``fit`` entry filled from the dataset's fitted state.

    A fitted ``VocabLookup`` or ``Bucketize`` entry becomes one entry per feature (each has its
    own vocabulary or boundaries); entries without ``fit`` pass through.

    Args:
        entries: ``[[preprocess]]`` entries.
        dataset: the dataset directory (its :data:`FITTED_NAME` is read when some entry has
            ``fit``).
        origin: names the config in messages (a file name and a space, or ``""``).

    Returns:
        ``(entries, where)``: the entries and a label for each, naming the original table.

    Raises:
        SchemaError: an entry asks to be fitted and there is no fitted state, or the state was
            fitted for other entries.
    """
    fitted = fit_entries(entries)
    labels = [f"{origin}[[preprocess]] #{i + 1}" for i in range(len(entries))]
    if not fitted:
        return list(entries), labels
    for i, entry in fitted:
        fit_options(entry, where=labels[i])
    path = None if dataset is None else fitted_path(dataset)
    if path is None or not path.is_file():
        first = labels[fitted[0][0]]
        where = "no dataset directory" if path is None else f"no {path}"
        msg = (
            f"{first}: asks to be fitted (`fit`), and there is {where}\n"
            f"hint: run `recpipe fit DATASET --preprocess {origin.strip() or 'CONFIG'}`"
        )
        raise SchemaError(msg)
    state = read_fitted(path)
    if state.get("signature") != fitted_signature(entries):
        msg = (
            f"{path}: fitted for other `fit` entries than {origin.strip() or 'this config'}'s\n"
            f"hint: run `recpipe fit {os.fspath(dataset)} --preprocess "
            f"{origin.strip() or 'CONFIG'}` again"
        )
        raise SchemaError(msg)
    steps = iter(state["steps"])
    out: list[Mapping[str, Any]] = []
    where: list[str] = []
    for i, entry in enumerate(entries):
        if "fit" not in entry:
            out.append(entry)
            where.append(labels[i])
            continue
        step = next(steps)
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
    dataset: str | os.PathLike[str], *, eval_fraction: float, seed: int
) -> str | None:
    """Why the dataset's fitted state does not match a run's holdout (``None``: it matches, or
    there is no fitted state). Fitted on another holdout, the statistics saw held-out rows."""
    path = fitted_path(dataset)
    if not path.is_file():
        return None
    state = read_fitted(path)
    if state.get("eval_fraction") == eval_fraction and state.get("seed") == seed:
        return None
    return (
        f"{path} was fitted with --eval-fraction {state.get('eval_fraction')} --seed "
        f"{state.get('seed')}, this run holds out with {eval_fraction} and {seed}: the fitted "
        "statistics may include held-out rows; run `recpipe fit` with the run's options"
    )
