"""Where the commands write: one check of an output path, run before any work.

Every command that writes calls :func:`check_output` on each of its outputs first: ``recpipe
synth``, ``etl shard``, ``etl build`` and ``stats`` on their ``--out``; ``recpipe train`` on
``--json``, ``--metrics``, ``--checkpoint`` and ``--tensorboard``; ``recpipe towers`` on
``--out``, ``--plot`` and ``--json``; ``recpipe fit`` on the fitted state it writes (into its
dataset, or to ``--out``); ``recpipe predict`` on ``--out`` and ``--json``. It refuses, with a :class:`~recpipe.errors.DataError` naming the option, the path and
why:

- an output that **is**, **contains** or **lies inside** an input (paths compared after
  resolving symlinks), because writing or replacing it would destroy what the command reads;
  the one exception is ``stats`` writing into a folder of its dataset whose name starts with
  ``_`` or ``.`` (its default, ``DATASET/_stats``), which no reader of the dataset looks at;
- an output under a regular file (``AFILE/x``); a directory output that exists and is not a
  directory; a file output that is an existing directory;
- an output whose directory cannot be created or written (``/proc/x``, a read-only mount,
  no permission), found by creating the directory and a probe in it;
- an existing, non-empty directory that is not this command's output: ``build`` and ``shard``
  replace their output whole, so they need ``--overwrite`` and then replace only a dataset
  (``_manifest.json``) or shards (``_shard.json``); ``synth`` rewrites only a folder of synthetic
  logs (``_synth.json``); ``stats`` writes ``stats.json`` and its plots into any directory, and
  so do a ``directory`` output (a checkpoint, TensorBoard logs) its own files.

The kinds of output (:data:`OutputKind`): ``dataset``, ``shards``, ``synth`` and ``stats`` (the
ETL's), ``file`` (one file, written or replaced: a summary, a plan, a plot) and ``directory``
(a folder the command writes its own files into: a checkpoint, TensorBoard logs).

>>> import tempfile, pathlib
>>> root = pathlib.Path(tempfile.mkdtemp())
>>> (root / "logs").mkdir()
>>> check_output(root / "logs" / "ds", kind="dataset", inputs=[root / "logs"])
Traceback (most recent call last):
...
recpipe.errors.DataError: `--out` '.../logs/ds' lies inside the input '.../logs'...
>>> check_output(root / "logs" / "_manifest.json", kind="file", inputs=[root / "logs"], arg="--json")
Traceback (most recent call last):
...
recpipe.errors.DataError: `--json` '.../logs/_manifest.json' lies inside the input '.../logs'...
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

__all__ = ["OutputKind", "check_output", "check_outputs"]

#: What a command writes: ``"dataset"`` (``etl build``), ``"shards"`` (``etl shard``),
#: ``"synth"`` (``recpipe synth``), ``"stats"`` (``recpipe stats``), ``"file"`` (one file, e.g.
#: ``--json``) or ``"directory"`` (a folder of the command's own files, e.g. ``--checkpoint``).
OutputKind = Literal["dataset", "shards", "synth", "stats", "file", "directory"]

PathLike = str | os.PathLike[str]


@dataclass(frozen=True)
class _Rules:
    marker: str | None  # the file that marks this command's output
    what: str  # what the output is, for messages
    mode: Literal["replace", "rewrite", "write_into", "file"]
    hidden_ok: bool = False  # may lie in a `_` or `.` folder of an input (stats)


_RULES: dict[str, _Rules] = {
    "dataset": _Rules("_manifest.json", "a recpipe dataset", "replace"),
    "shards": _Rules("_shard.json", "recpipe shards", "replace"),
    "synth": _Rules("_synth.json", "recpipe synthetic logs", "rewrite"),
    "stats": _Rules(None, "recpipe statistics", "write_into", hidden_ok=True),
    "file": _Rules(None, "a file", "file"),
    "directory": _Rules(None, "a directory", "write_into"),
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

    Creates the directory the command writes into (for ``dataset``, ``shards`` and ``file`` the
    parent of ``out``, where the output or its temporary is made and renamed into place;
    otherwise ``out``).

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


def check_outputs(
    outputs: Iterable[tuple[str, PathLike | None, OutputKind]],
    *,
    inputs: Iterable[PathLike | Iterable[PathLike] | None] = (),
    overwrite: bool = False,
) -> None:
    """Check every output of one command: each as :func:`check_output` does, and no two of
    them the same path or one inside the other.

    Args:
        outputs: ``(option, path, kind)`` of each output; a ``None`` path (an option not
            given) is skipped.
        inputs, overwrite: as for :func:`check_output`.

    Raises:
        DataError: naming the option(s), the path(s) and the reason.
    """
    given = [(arg, os.fspath(out), kind) for arg, out, kind in outputs if out is not None]
    inputs = list(inputs)
    for i, (arg, out, _) in enumerate(given):
        real = Path(os.path.realpath(out))
        for other_arg, other, _ in given[:i]:
            theirs = Path(os.path.realpath(other))
            relation = (
                "is the same path as" if real == theirs
                else "lies inside" if real.is_relative_to(theirs)
                else "contains" if theirs.is_relative_to(real)
                else None
            )  # fmt: skip
            if relation is not None:
                msg = (
                    f"`{arg}` {out!r} {relation} `{other_arg}` {other!r}: one output would "
                    "overwrite the other\nhint: give each output a path of its own"
                )
                raise DataError(msg)
    for arg, out, kind in given:
        check_output(out, kind=kind, inputs=inputs, overwrite=overwrite, arg=arg)


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
        if rules.hidden_ok and first.startswith(("_", ".")):
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
    if rules.mode == "file":
        if real.is_dir():
            msg = f"{name} is a directory, not a file\nhint: name a file to write"
            raise DataError(msg)
        if not os.access(real, os.W_OK):
            msg = f"{name} exists and cannot be written (no permission)"
            raise DataError(msg)
        return  # a file output is written or replaced whole
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

    For ``replace`` and ``file`` the probe is a sibling named like the command's temporary
    output, so a name too long for the file system fails here too.
    """
    sibling = rules.mode in ("replace", "file")
    where = real.parent if sibling else real
    try:
        where.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        msg = f"{name} cannot be created: {_reason(exc)}"
        raise DataError(msg) from None
    probe = where / (
        f".{real.name}.recpipe-probe-{os.getpid()}-{secrets.token_hex(4)}"
        if sibling
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
