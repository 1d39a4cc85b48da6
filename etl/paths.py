"""Where the ETL commands write: one check of an output path, run before any work.

``recpipe synth``, ``etl shard``, ``etl build`` and ``stats`` call :func:`check_output` on their
``--out`` first. It refuses, with a :class:`~recpipe.errors.DataError` naming the path and why:

- an output that **is**, **contains** or **lies inside** an input (paths compared after
  resolving symlinks), because writing or replacing it would destroy what the command reads;
  the one exception is ``stats`` writing into a folder of its dataset whose name starts with
  ``_`` or ``.`` (its default, ``DATASET/_stats``), which no reader of the dataset looks at;
- an output under a regular file (``AFILE/x``), or one that exists and is not a directory;
- an output whose directory cannot be created or written (``/proc/x``, a read-only mount,
  no permission), found by creating the directory and a probe in it;
- an existing, non-empty directory that is not this command's output: ``build`` and ``shard``
  replace their output whole, so they need ``--overwrite`` and then replace only a dataset
  (``_manifest.json``) or shards (``_shard.json``); ``synth`` rewrites only a folder of synthetic
  logs (``_synth.json``); ``stats`` writes ``stats.json`` and its plots into any directory.

>>> import tempfile, pathlib
>>> root = pathlib.Path(tempfile.mkdtemp())
>>> (root / "logs").mkdir()
>>> check_output(root / "logs" / "ds", kind="dataset", inputs=[root / "logs"])
Traceback (most recent call last):
...
recpipe.errors.DataError: `--out` '.../logs/ds' lies inside the input '.../logs'...
"""

from __future__ import annotations

import glob
import os
import secrets
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from recpipe.errors import DataError

__all__ = ["OutputKind", "check_output"]

#: What a command writes: ``"dataset"`` (``etl build``), ``"shards"`` (``etl shard``),
#: ``"synth"`` (``recpipe synth``) or ``"stats"`` (``recpipe stats``).
OutputKind = Literal["dataset", "shards", "synth", "stats"]

PathLike = str | os.PathLike[str]


@dataclass(frozen=True)
class _Rules:
    marker: str | None  # the file that marks this command's output
    what: str  # what the output is, for messages
    mode: Literal["replace", "rewrite", "write_into"]


_RULES: dict[str, _Rules] = {
    "dataset": _Rules("_manifest.json", "a recpipe dataset", "replace"),
    "shards": _Rules("_shard.json", "recpipe shards", "replace"),
    "synth": _Rules("_synth.json", "recpipe synthetic logs", "rewrite"),
    "stats": _Rules(None, "recpipe statistics", "write_into"),
}


def check_output(
    out: PathLike,
    *,
    kind: OutputKind,
    inputs: Iterable[PathLike | Iterable[PathLike] | None] = (),
    overwrite: bool = False,
    arg: str = "--out",
) -> None:
    """Refuse an output path the command must not or cannot write (see the module docstring).

    Creates the directory the command writes into (for ``dataset`` and ``shards`` the parent of
    ``out``, where the temporary output is made and renamed into place; otherwise ``out``).

    Args:
        out: the output path.
        kind: what the command writes there (:data:`OutputKind`).
        inputs: what the command reads: files, directories, globs, or lists of them; ``None``
            entries (an option not given) are ignored, and so are paths that do not exist (the
            command reports those itself).
        overwrite: the command was told to replace an existing output (``--overwrite``).
        arg: the option's name in messages.

    Raises:
        DataError: naming ``arg``, the path and the reason.
    """
    rules = _RULES.get(kind)
    if rules is None:
        msg = f"`kind` must be one of {list(_RULES)}, got {kind!r}"
        raise DataError(msg)
    text = os.fspath(out)
    name = f"`{arg}` {text!r}"
    real = Path(os.path.realpath(text))
    for given, path in _input_paths(inputs):
        _check_overlap(name, real, given, path, rules)
    _check_parents(name, real)
    if real.exists():
        _check_existing(name, real, rules, overwrite=overwrite)
    _check_writable(name, real, rules)


def _input_paths(
    inputs: Iterable[PathLike | Iterable[PathLike] | None],
) -> Iterator[tuple[str, Path]]:
    """``(as given, real path)`` of every existing input (globs expanded)."""
    for item in inputs:
        if item is None:
            continue
        if not isinstance(item, str | os.PathLike):
            yield from _input_paths(item)
            continue
        text = os.fspath(item)
        if os.path.lexists(text):
            yield text, Path(os.path.realpath(text))
        elif glob.has_magic(text):
            for match in glob.glob(text, recursive=True):
                yield match, Path(os.path.realpath(match))


def _check_overlap(name: str, real: Path, given: str, path: Path, rules: _Rules) -> None:
    if real == path:
        relation = "is"
    elif path.is_relative_to(real):
        relation = "contains"
    elif real.is_relative_to(path):
        first = real.relative_to(path).parts[0]
        if rules.mode == "write_into" and first.startswith(("_", ".")):
            return  # stats into DATASET/_stats: no reader of the dataset looks there
        relation = "lies inside"
    else:
        return
    resolved = "" if os.path.abspath(given) == str(path) else f" (which resolves to {str(path)!r})"
    msg = (
        f"{name} {relation} the input {given!r}{resolved}: writing there would overwrite or "
        "delete what the command reads\nhint: choose an output outside the inputs"
    )
    raise DataError(msg)


def _check_parents(name: str, real: Path) -> None:
    """The nearest existing ancestor of ``real`` must be a directory (``AFILE/x``)."""
    for parent in real.parents:
        if parent.exists():
            if not parent.is_dir():
                msg = f"{name}: {str(parent)!r} is a file, not a directory"
                raise DataError(msg)
            return


def _check_existing(name: str, real: Path, rules: _Rules, *, overwrite: bool) -> None:
    if not real.is_dir():
        msg = f"{name} exists and is not a directory\nhint: remove it or choose another output"
        raise DataError(msg)
    if rules.marker is None or not any(real.iterdir()):
        return  # stats writes its own files into any directory; an empty one is free
    if not (real / rules.marker).is_file():
        verb = "replace" if rules.mode == "replace" else "write into"
        msg = (
            f"{name} exists, is not empty and is not {rules.what} (it has no {rules.marker}): "
            f"refusing to {verb} it\nhint: choose a new or empty directory, or remove it yourself"
        )
        raise DataError(msg)
    if rules.mode == "replace" and not overwrite:
        msg = f"{name} already exists ({rules.what})\nhint: pass --overwrite to replace it"
        raise DataError(msg)


def _check_writable(name: str, real: Path, rules: _Rules) -> None:
    """Create the directory the command writes into and a probe in it (then remove the probe).

    For ``replace`` the probe is a sibling named like the command's temporary output, so a name
    too long for the file system fails here too.
    """
    where = real.parent if rules.mode == "replace" else real
    try:
        where.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        msg = f"{name} cannot be created: {_reason(exc)}"
        raise DataError(msg) from None
    probe = where / (
        f".{real.name}.recpipe-probe-{os.getpid()}-{secrets.token_hex(4)}"
        if rules.mode == "replace"
        else f".recpipe-probe-{os.getpid()}-{secrets.token_hex(4)}"
    )
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError as exc:
        msg = f"{name}: cannot write in {str(where)!r}: {_reason(exc)}"
        raise DataError(msg) from None


def _reason(exc: OSError) -> str:
    where = f" ({exc.filename!r})" if exc.filename else ""
    return f"{exc.strerror or exc}{where}"
