"""``recpipe store PATH``: inspect an embedding store (rows, chunks, hot set, checkpoints, sizes)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Any

from recpipe.config_cli import add_config_options

__all__ = ["InspectOptions", "register_cli", "run"]


@dataclass(frozen=True)
class InspectOptions:
    """What ``recpipe store`` does (its options are generated from these fields).

    Attributes:
        path: the store directory.
        json: print JSON instead of a table.
        verify: check every committed file and row checksum (read-only).
    """

    path: str
    json: bool = False
    verify: bool = False


def register_cli(subparsers: Any) -> None:
    """Add the ``store`` subcommand to the ``recpipe`` parser."""
    parser = subparsers.add_parser(
        "store",
        help="inspect a hybrid embedding store",
        description=(
            "Describe an embedding store directory without loading it: rows, chunks of the home "
            "file, the hot set, the last checkpoints and file sizes. --verify also checks every "
            "file of the last checkpoint against its commit record and the checksum of every "
            "committed row. Neither writes to the store."
        ),
    )
    add_config_options(parser, InspectOptions)
    parser.set_defaults(func=run)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _logged(info: dict[str, Any]) -> str:
    skipped = info["checkpoint_log_lines_skipped"]
    unreadable = f" ({skipped} unreadable line{'s' * (skipped != 1)} skipped)" if skipped else ""
    return f"{info['checkpoints']}{unreadable}"


def run(args: argparse.Namespace) -> int:
    """Print the description of the store at ``args.path``."""
    from trainer.store.persist import inspect_store
    from trainer.store.recovery import verify_store

    info = inspect_store(args.path)
    if args.verify:
        info["verified_rows"] = verify_store(args.path)
    if args.json:
        json.dump(info, sys.stdout, indent=1)
        print()
        return 0
    last = info["last_checkpoint"]
    table = [
        ("path", info["path"]),
        ("dim / optimizer", f"{info['dim']} / {info['optimizer']}"),
        ("rows", f"{info['rows']:,}"),
        (
            "chunks",
            f"{info['chunks']} x {info['chunk_rows']:,} rows ({info['row_bytes_on_disk']} B/row)",
        ),
        ("hot set", f"{info['hot_rows']:,} rows, first ids {info['hot_ids_head']}"),
        (
            "last checkpoint",
            "none" if last["step"] < 0 else f"step {last['step']} (#{last['epoch']})",
        ),
        (
            "can roll back to",
            "-"
            if info["previous_checkpoint_step"] is None
            else f"step {info['previous_checkpoint_step']} (no row written since the last one)",
        ),
        ("checkpoints logged", _logged(info)),
        ("total size", _human(info["total_bytes"])),
    ]
    if "verified_rows" in info:
        table.append(("verified", f"{info['verified_rows']:,} rows, all checksums match"))
    width = max(len(k) for k, _ in table)
    for key, value in table:
        print(f"{key:<{width}}  {value}")
    if info["recent_checkpoints"]:
        print("\nrecent checkpoints:")
        print(f"  {'step':>8} {'rows written':>13} {'bytes':>11} {'seconds':>9}")
        for c in info["recent_checkpoints"]:
            print(
                f"  {c['step']:>8} {c['rows_written']:>13,} {_human(c['bytes_written']):>11} "
                f"{c['seconds']:>9.4f}"
            )
    print("\nfiles:")
    for name, size in info["sizes"].items():
        print(f"  {name:<20} {_human(size):>11}")
    return 0
