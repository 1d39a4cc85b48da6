"""Running the ``recpipe`` CLI in-process and checking how it fails."""

from __future__ import annotations

from typing import Any


def run_cli(argv: list[Any], capsys: Any) -> tuple[int, str]:
    """``recpipe ARGV`` in this process: the exit code and what it wrote to stderr."""
    from recpipe_cli import main

    code = main([str(a) for a in argv])
    return code, capsys.readouterr().err


def one_error_line(err: str, *needles: str) -> None:
    """The CLI's error: one line (then at most ``hint:`` lines) holding every needle, and no
    traceback."""
    lines = err.strip().splitlines()
    assert lines and lines[0].startswith("recpipe ") and ": error: " in lines[0], err
    assert all(line.startswith("hint:") for line in lines[1:]), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], err
