"""Launching a multi-rank ``recpipe train``: through torchrun, never a launcher of our own.

Two ways in, one code path:

* ``recpipe train DATASET ... --nproc N [--nnodes M --node-rank K --master-addr HOST]``: this
  process becomes torchrun's agent (``torch.distributed.run``, the module behind ``torchrun``):
  it starts N workers running ``python -m trainer --launch-spec FILE``, where FILE holds the
  parsed options; on one node the rendezvous is local (torchrun's ``--standalone``), on several
  it is static (``--node-rank``, ``--master-addr``, ``--master-port``).
* ``torchrun --nproc-per-node N [--nnodes M ...] -m trainer DATASET ...``: each worker parses
  the ``recpipe train`` options itself.

A worker joins the process group from torchrun's environment and trains its rank
(:func:`trainer.distributed.run.train_rank`); rank 0 prints the summary and writes ``--json``.
When a worker fails (an error, or killed), torchrun's agent stops the others and the command
exits non-zero; on another node the peers' collectives fail with a clear error within the
group timeout (``--dist-timeout``).
"""

from __future__ import annotations

import argparse
import pickle
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainer.config import TrainConfig
    from trainer.distributed.run import DistributedSummary
    from trainer.train import TrainResult

__all__ = ["SPEC_FLAG", "add_distributed_arguments", "describe", "dump", "requested", "run"]

SPEC_FLAG = "--launch-spec"


def _hot_rows(text: str) -> str | int:
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        msg = f"must be 'auto' or a non-negative integer, got {text!r}"
        raise argparse.ArgumentTypeError(msg)
    return value


def _positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = 0
        if not value > 0:
            msg = f"must be a positive number, got {text!r}"
            raise argparse.ArgumentTypeError(msg)
        return value

    return parse


def add_distributed_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the multi-rank options to the ``recpipe train`` parser."""
    group = parser.add_argument_group(
        "several processes and machines",
        "Launch through torchrun's API (or run under torchrun: `torchrun --nproc-per-node N -m "
        "trainer DATASET ...`). --batch-size is per rank; see docs/distributed.md.",
    )
    group.add_argument(
        "--nproc",
        type=_positive(int),
        metavar="N",
        help="train with N processes on this machine (gloo on CPU, NCCL on CUDA)",
    )
    group.add_argument(
        "--nnodes",
        type=_positive(int),
        default=1,
        metavar="M",
        help="machines in the job (each runs the same command, default 1)",
    )
    group.add_argument(
        "--node-rank",
        type=int,
        default=0,
        metavar="K",
        help="this machine's rank among --nnodes (default 0)",
    )
    group.add_argument(
        "--master-addr", metavar="HOST", help="address of node 0 (needed with --nnodes > 1)"
    )
    group.add_argument(
        "--master-port",
        type=_positive(int),
        default=29500,
        metavar="PORT",
        help="port on node 0 (default 29500)",
    )
    group.add_argument(
        "--hot-rows",
        type=_hot_rows,
        default="auto",
        metavar="R",
        help="hot rows replicated on every rank: auto (cost model) or a number",
    )
    group.add_argument(
        "--count-steps",
        type=_positive(int),
        default=20,
        metavar="S",
        help="steps whose id accesses are counted before choosing R (default 20)",
    )
    group.add_argument(
        "--dist-timeout",
        type=_positive(float),
        default=300.0,
        metavar="SEC",
        help="collective timeout: a hung rank fails the job after it (default 300)",
    )


def requested(args: argparse.Namespace) -> bool:
    """Whether ``args`` asks for a multi-rank run (``--nproc``, or started by torchrun)."""
    from trainer.distributed.comm import launched_by_torchrun

    return getattr(args, "nproc", None) is not None or launched_by_torchrun()


def _options(args: argparse.Namespace) -> Any:
    from trainer.distributed.run import DistributedConfig

    return DistributedConfig(
        hot_rows=args.hot_rows, count_steps=args.count_steps, timeout_s=args.dist_timeout
    )


def _torchrun_args(args: argparse.Namespace, spec: Path) -> list[str]:
    nnodes = args.nnodes
    argv = ["--nproc-per-node", str(args.nproc), "--nnodes", str(nnodes), "--max-restarts", "0"]
    if nnodes == 1 and args.master_addr is None:
        argv.append("--standalone")
    else:
        if args.master_addr is None:
            msg = f"`--master-addr` is needed with --nnodes {nnodes}: the address of node 0"
            raise _error(msg)
        if not 0 <= args.node_rank < nnodes:
            msg = f"`--node-rank` must be in [0, {nnodes}), got {args.node_rank!r}"
            raise _error(msg)
        argv += ["--node-rank", str(args.node_rank), "--master-addr", args.master_addr,
                 "--master-port", str(args.master_port), "--rdzv-backend", "static"]  # fmt: skip
    return [*argv, "-m", "trainer", SPEC_FLAG, str(spec)]


def _error(msg: str) -> Exception:
    from trainer.distributed.comm import DistributedError

    return DistributedError(msg)


def _launch(args: argparse.Namespace, config: TrainConfig) -> None:
    """Be torchrun's agent for this machine's ``--nproc`` workers (they get ``config`` and the
    options as parsed here, in a pickle only this user can read)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args
    from torch.distributed.run import run as torchrun

    with tempfile.TemporaryDirectory(prefix="recpipe-launch-") as tmp:
        spec = Path(tmp) / "args.pkl"
        options = {k: v for k, v in vars(args).items() if k != "func"}  # func: a closure
        worker = argparse.Namespace(**{**options, "nproc": None})
        spec.write_bytes(pickle.dumps((config, worker)))
        try:
            torchrun(parse_args(_torchrun_args(args, spec)))
        except ChildFailedError as exc:
            first = min(exc.failures.items(), key=lambda kv: kv[1].timestamp)
            rank, failure = first
            why = (
                f"exit code {failure.exitcode}"
                if failure.exitcode >= 0
                else f"killed by signal {-failure.exitcode}"
            )
            msg = (
                f"{len(exc.failures)} of {args.nproc} worker(s) failed; the first was rank "
                f"{rank} ({why}); its error is above"
            )
            raise _error(msg) from exc


def run(
    args: argparse.Namespace, config: TrainConfig
) -> tuple[TrainResult, DistributedSummary] | None:
    """Run ``recpipe train`` on several ranks: launch the workers (``--nproc``), or train this
    worker's rank. Returns rank 0's result (``None`` elsewhere and in the launching process)."""
    from trainer.distributed.comm import destroy, init_from_env, launched_by_torchrun
    from trainer.distributed.run import check_config, train_rank

    check_config(config)
    if not launched_by_torchrun():
        _launch(args, config)
        return None
    options = _options(args)
    comm = init_from_env(device=config.device, timeout_s=options.timeout_s)
    try:
        result, summary = train_rank(
            config, options, comm=comm, progress=not getattr(args, "quiet", False)
        )
    finally:
        destroy()
    if comm.rank != 0:
        return None
    return result, summary


def describe(summary: DistributedSummary) -> str:
    """The exchange's summary lines, printed after ``format_summary``."""
    from trainer.distributed.run import describe as lines

    return lines(summary)


def dump(summary: DistributedSummary) -> dict[str, Any]:
    """The exchange's summary for ``--json``."""
    from trainer.distributed.run import dump as values

    return values(summary)
