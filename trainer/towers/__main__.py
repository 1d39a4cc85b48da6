"""``torchrun --nproc-per-node N -m trainer.towers train DATASET --towers FILE ...``: one worker
of a multi-rank ``recpipe towers train`` (the same options).

``recpipe towers train --nproc N`` starts its workers here too, with ``--launch-spec FILE``:
the configs and options it parsed, pickled into a private temporary directory.
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
from pathlib import Path

from recpipe.errors import RecpipeError
from trainer.distributed.launch import SPEC_FLAG
from trainer.towers.cli import register_cli, run_train


def worker_main(argv: list[str] | None = None) -> int:
    """Train this worker's rank; the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == [SPEC_FLAG] and len(argv) == 2:
        configs, args = pickle.loads(Path(argv[1]).read_bytes())
        args.func = lambda a: run_train(configs, a)
    else:
        parser = argparse.ArgumentParser(
            prog="torchrun ... -m trainer.towers",
            description="A worker of `recpipe towers train` on several processes (torchrun).",
        )
        register_cli(parser.add_subparsers(dest="command"))
        args = parser.parse_args(["towers", *argv])
        if getattr(args, "nproc", None) is not None:
            parser.error(
                "--nproc is for `recpipe towers train`; under torchrun use --nproc-per-node"
            )
    rank = os.environ.get("RANK", "?")
    try:
        return int(args.func(args) or 0)
    except RecpipeError as exc:
        print(f"recpipe towers (rank {rank}): error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(worker_main())
