"""Progress bars that suit where their output goes: a live bar on a terminal, a line now and then
in a log.

Every long-running recpipe command shows its progress through :func:`progress_bar`. On a terminal
it is a ``tqdm`` bar redrawn in place. When the stream is not a terminal (a log file, a pipe, CI)
redrawing would fill the log with ``\\r`` frames, so the same bar writes one plain line at most
every :data:`LOG_EVERY_S` seconds, and its final state when it closes::

    shard:  41%|████      | 2.05M/5.00M [00:30<00:43, 68.2k lines/s]
    shard: 100%|██████████| 5.00M/5.00M [01:13<00:00, 68.4k lines/s]

``RECPIPE_PROGRESS_EVERY_S`` sets that interval (seconds; ``0`` writes every update).
"""

from __future__ import annotations

import io
import os
import re
import sys
import time
from collections.abc import Iterable
from typing import IO, Any

__all__ = ["LOG_EVERY_S", "progress_bar"]

LOG_EVERY_S = 30.0
"""Seconds between two progress lines when the output is not a terminal."""

_CONTROL = re.compile(r"\r|\x1b\[[0-9;]*[A-Za-z]")  # carriage returns and cursor moves


def progress_bar(iterable: Iterable[Any] | None = None, **kwargs: Any) -> Any:
    """A ``tqdm`` bar on ``file`` (default stderr): live on a terminal, lines in a log.

    Takes ``tqdm``'s arguments. When the bar is enabled and ``file`` is not a terminal, it
    writes through :class:`_Lines` and refreshes at most every ``RECPIPE_PROGRESS_EVERY_S``
    seconds (default :data:`LOG_EVERY_S`).
    """
    from tqdm import tqdm

    stream: IO[str] = kwargs.pop("file", None) or sys.stderr
    if kwargs.get("disable") or _is_terminal(stream):
        return tqdm(iterable, file=stream, **kwargs)
    every = _log_every_s()
    kwargs.pop("dynamic_ncols", None)
    kwargs.setdefault("ncols", 100)
    kwargs["mininterval"] = every
    kwargs["maxinterval"] = max(every, float(kwargs.get("maxinterval", 10.0)))
    return tqdm(iterable, file=_Lines(stream, every_s=every), **kwargs)


def _is_terminal(stream: IO[str]) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def _log_every_s() -> float:
    text = os.environ.get("RECPIPE_PROGRESS_EVERY_S", "")
    try:
        value = float(text) if text else LOG_EVERY_S
    except ValueError:
        return LOG_EVERY_S
    return value if value >= 0 else LOG_EVERY_S


class _Lines(io.TextIOBase):
    """A text stream that turns a bar's redraws into whole lines, at most one per ``every_s``.

    A redraw is written as one line when ``every_s`` has passed since the last line; the last
    redraw is kept and written when the bar ends its line (its closing ``\\n``), unless it was
    written already.
    """

    def __init__(self, stream: IO[str], *, every_s: float) -> None:
        super().__init__()
        self._stream = stream
        self._every_s = every_s
        self._pending = ""  # the latest redraw not written yet
        self._written_at = -float("inf")

    def write(self, text: str) -> int:
        for part in re.split(r"(\n)", text):
            if part == "\n":
                self._emit()
                continue
            frame = _CONTROL.sub("", part).strip()
            if not frame:
                continue
            self._pending = frame
            if time.monotonic() - self._written_at >= self._every_s:
                self._emit()
        return len(text)

    def _emit(self) -> None:
        if self._pending:
            self._stream.write(self._pending + "\n")
            self._stream.flush()
            self._pending = ""
            self._written_at = time.monotonic()

    def flush(self) -> None:
        self._stream.flush()

    def isatty(self) -> bool:
        return False
