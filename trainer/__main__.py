"""``torchrun --nproc-per-node N -m trainer DATASET ...``: one worker of a multi-rank
``recpipe train`` (the same options; see :mod:`trainer.distributed.launch`).

``recpipe train --nproc N`` starts its workers here too, with ``--launch-spec FILE``: the config
and options it parsed, pickled into a private temporary directory.
"""

from __future__ import annotations

import argparse
import logging
import os
import pickle
import sys
from pathlib import Path

from recpipe.errors import RecpipeError
from trainer.cli import register_cli, run
from trainer.distributed.launch import SPEC_FLAG


def worker_main(argv: list[str] | None = None) -> int:
    """Train this worker's rank; the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == [SPEC_FLAG] and len(argv) == 2:
        config, args = pickle.loads(Path(argv[1]).read_bytes())
        args.func = lambda a: run(config, a)
    else:
        parser = argparse.ArgumentParser(
            prog="torchrun ... -m trainer",
            description="A worker of `recpipe train` on several processes (started by torchrun).",
        )
        register_cli(parser.add_subparsers(dest="command"))
        args = parser.parse_args(["train", *argv])
        if args.nproc is not None:
            parser.error("--nproc is for `recpipe train`; under torchrun use --nproc-per-node")
    rank = os.environ.get("RANK", "?")
    try:
        return int(args.func(args) or 0)
    except RecpipeError as exc:
        print(f"recpipe train (rank {rank}): error: {exc}", file=sys.stderr)
        return 1


def _leave(code: int) -> None:
    """Exit once everything is written, without the interpreter's teardown: a worker's
    process group and torch's native thread pools are still alive then, and destroying them in
    C++ static destructors sometimes aborted a rank that had finished its work (SIGABRT,
    "terminate called without an active exception")."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _leave(worker_main())
