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
    from trainer.distributed.config import DistributedConfig, LaunchConfig
    from trainer.distributed.run import DistributedSummary
    from trainer.runlog import TrainResult

__all__ = [
    "SPEC_FLAG",
    "add_distributed_arguments",
    "describe",
    "distributed_config",
    "dump",
    "launch_config",
    "launch_workers",
    "requested",
    "run",
]

SPEC_FLAG = "--launch-spec"


def _hot_rows(text: str) -> str | int:
    """``--hot-rows``: ``auto`` or a non-negative integer."""
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


def add_distributed_arguments(parser: argparse.ArgumentParser, *, exchange: bool = True) -> None:
    """Add the multi-rank options to the ``recpipe train`` parser: the fields of
    :class:`~trainer.distributed.config.LaunchConfig` and ten of
    :class:`~trainer.distributed.config.DistributedConfig` (:mod:`recpipe.config_cli`; its
    ``exact_dense`` as ``--fast-dense``, which turns it off, and ``--exact-dense``, a no-op).

    ``exchange=False`` (a command without the 2FP exchange and the sample dispatch, e.g.
    ``recpipe towers train``): of :class:`~trainer.distributed.config.DistributedConfig` only
    ``--dist-timeout``."""
    from recpipe.config_cli import Option, add_config_options
    from trainer.distributed.config import DistributedConfig, LaunchConfig

    group = parser.add_argument_group(
        "several processes and machines",
        "Launch through torchrun's API (or run under torchrun: `torchrun --nproc-per-node N -m "
        "trainer DATASET ...`). --batch-size is per rank; see docs/distributed.md.",
    )
    launch = add_config_options(
        group,
        LaunchConfig,
        overrides={
            "nproc": Option(metavar="N"),
            "nnodes": Option(metavar="M"),
            "node_rank": Option(metavar="K"),
            "master_addr": Option(metavar="HOST"),
            "master_port": Option(metavar="PORT"),
        },
        owner=parser,
    )
    exchange = add_config_options(
        group,
        DistributedConfig,
        include=(
            (
                "hot_rows",
                "count_steps",
                "timeout_s",
                "dispatch",
                "alpha",
                "cache_rows",
                "bandwidths",
                "probe_rows",
                "probe_repeats",
            )
            if exchange
            else ("timeout_s",)
        ),
        overrides={
            "hot_rows": Option(metavar="R", type=_hot_rows),
            "alpha": Option(metavar="A"),
            "cache_rows": Option(metavar="ROWS"),
            "bandwidths": Option(metavar="B[,B...]"),
            "count_steps": Option(metavar="S"),
            "probe_rows": Option(metavar="ROWS"),
            "probe_repeats": Option(metavar="N"),
            "timeout_s": Option(flag="--dist-timeout", metavar="SEC"),
        },
        owner=parser,
    )
    if exchange:
        dense = group.add_mutually_exclusive_group()
        dense.add_argument(
            "--fast-dense", dest="exact_dense", action="store_false", default=True,
            help="torch's float32 dense gradients (on ranks: DDP's float32 all-reduce): "
            "faster, but runs then drift apart with the batch's split (about 1e-6 to 1e-3 over "
            "training); by default every dense gradient is summed in float64 over rows (and "
            "ranks) and rounded once, so N ranks train exactly like one process",
        )  # fmt: skip
        dense.add_argument(
            "--exact-dense", dest="exact_dense", action="store_true",
            help="the default (kept so that older command lines still run)",
        )  # fmt: skip
    parser.set_defaults(_launch_options=launch, _exchange_options=exchange)


def launch_config(args: argparse.Namespace) -> LaunchConfig:
    """The :class:`~trainer.distributed.config.LaunchConfig` of parsed ``recpipe train`` options
    (a bad value exits with a usage error naming the option)."""
    return args._launch_options.build(args)


def distributed_config(args: argparse.Namespace) -> DistributedConfig:
    """The :class:`~trainer.distributed.config.DistributedConfig` of parsed options (in a worker
    started by ``--nproc``: the one the launching process parsed)."""
    given = getattr(args, "distributed", None)
    if given is not None:
        return given
    dense = {"exact_dense": args.exact_dense} if hasattr(args, "exact_dense") else {}
    return args._exchange_options.build(args, **dense)


def requested(args: argparse.Namespace) -> bool:
    """Whether ``args`` asks for a multi-rank run (``--nproc``, or started by torchrun)."""
    from trainer.distributed.comm import launched_by_torchrun

    return getattr(args, "nproc", None) is not None or launched_by_torchrun()


def _torchrun_args(launch: LaunchConfig, spec: Path, *, module: str = "trainer") -> list[str]:
    nnodes = launch.nnodes
    argv = ["--nproc-per-node", str(launch.nproc), "--nnodes", str(nnodes), "--max-restarts", "0"]
    if nnodes == 1 and launch.master_addr is None:
        argv.append("--standalone")
    else:
        if launch.master_addr is None:
            msg = f"`--master-addr` is needed with --nnodes {nnodes}: the address of node 0"
            raise _error(msg)
        if not 0 <= launch.node_rank < nnodes:
            msg = f"`--node-rank` must be in [0, {nnodes}), got {launch.node_rank!r}"
            raise _error(msg)
        argv += ["--node-rank", str(launch.node_rank), "--master-addr", launch.master_addr,
                 "--master-port", str(launch.master_port), "--rdzv-backend", "static"]  # fmt: skip
    return [*argv, "-m", module, SPEC_FLAG, str(spec)]


def _error(msg: str) -> Exception:
    from trainer.distributed.comm import DistributedError

    return DistributedError(msg)


def _failures(exc: Any) -> str:
    """Name each failed rank, the likely cause first: a rank killed by a signal left no error of
    its own, and the ranks that lost it fail a moment later with "another rank died"; which of
    them torchrun saw first is a race, so a signal outranks an exit code, then time decides."""

    def why(failure: Any) -> str:
        code = failure.exitcode
        return f"exit code {code}" if code >= 0 else f"killed by signal {-code}"

    order = sorted(exc.failures.items(), key=lambda kv: (kv[1].exitcode >= 0, kv[1].timestamp))
    named = ", ".join(f"rank {rank} ({why(failure)})" for rank, failure in order)
    return f"{named}; the errors they printed are above"


def launch_workers(
    launch: LaunchConfig, worker: argparse.Namespace, config: Any, *, module: str = "trainer"
) -> None:
    """Be torchrun's agent for this machine's ``--nproc`` workers of ``python -m module
    --launch-spec FILE``; FILE holds ``(config, worker)`` pickled (``worker``: the options the
    workers need, parsed here), readable by this user only.

    Raises:
        DistributedError: a worker failed (naming each, the likely cause first), or the node options
            are wrong.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args
    from torch.distributed.run import run as torchrun

    with tempfile.TemporaryDirectory(prefix="recpipe-launch-") as tmp:
        spec = Path(tmp) / "args.pkl"
        spec.write_bytes(pickle.dumps((config, worker)))
        try:
            torchrun(parse_args(_torchrun_args(launch, spec, module=module)))
        except ChildFailedError as exc:
            msg = f"{len(exc.failures)} of {launch.nproc} worker(s) failed: " + _failures(exc)
            raise _error(msg) from exc


def run(
    args: argparse.Namespace, config: TrainConfig
) -> tuple[TrainResult, DistributedSummary] | None:
    """Run ``recpipe train`` on several ranks: launch the workers (``--nproc``), or train this
    worker's rank. Returns rank 0's result (``None`` elsewhere and in the launching process)."""
    from trainer.distributed.comm import destroy, init_from_env, launched_by_torchrun
    from trainer.distributed.run import check_config, train_rank

    options = distributed_config(args)
    quiet = bool(getattr(args, "quiet", False))
    if not launched_by_torchrun():
        check_config(config, options)  # before any worker starts (a worker checks again)
        worker = argparse.Namespace(
            nproc=None, quiet=quiet, json=getattr(args, "json", None), distributed=options
        )
        launch_workers(launch_config(args), worker, config)
        return None
    comm = init_from_env(device=config.device, timeout_s=options.timeout_s)
    try:
        result, summary = train_rank(config, options, comm=comm, progress=not quiet)
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
