"""``recpipe towers``: partition features into towers, and train a towered DLRM (SPTT).

* ``recpipe towers partition DATASET --towers T [--strategy coherent|diverse] [--balance K]``
  writes a tower plan (TOML) and, with ``--plot``, a PNG of the MDS embedding.
* ``recpipe towers train DATASET --towers FILE [--tower-module none|dlrm|dcn]
  [--compression R] [--nproc N --ranks-per-host L | torchrun ... -m trainer.towers train ...]``.

Options come from :class:`~trainer.towers.config.PartitionConfig`,
:class:`~trainer.towers.config.TowersConfig` and the train configs; parsing imports no torch.
See ``docs/towers.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from typing import Any

from recpipe.config_cli import Option, add_config_options, add_quiet_option
from trainer.cli_common import train_options
from trainer.config import ModelConfig, TrainConfig
from trainer.distributed import launch
from trainer.towers.config import PartitionConfig, TowersConfig

__all__ = ["add_towers_arguments", "register_cli", "run_train"]

_MODEL_OPTIONS = ("embedding_dim", "num_embeddings", "hash_ids", "pooling", "bottom_mlp", "top_mlp")


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    """Add ``recpipe towers`` (``partition``, ``train``) to the top-level parser."""
    parser = subparsers.add_parser(
        "towers",
        help="partition features into towers; train a towered DLRM with SPTT",
        description=(
            "Disaggregated multi-tower (DMT): group the sparse features into towers that live "
            "on one host each (`partition`: learned from the features' embeddings), and train "
            "the towered model (`train`: in one process, or on several hosts with SPTT, where "
            "only tower outputs cross hosts). See docs/towers.md."
        ),
    )
    commands = parser.add_subparsers(dest="towers_command", metavar="<command>")
    _add_partition(commands)
    _add_train(commands)
    parser.set_defaults(func=lambda args: _missing(parser))


def _missing(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def _add_partition(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "partition",
        help="towers from the features' learned embeddings",
        description=(
            "Train briefly (or read a `recpipe train` checkpoint), take the mean of R Rᵀ over "
            "training batches (R: a sample's pooled embeddings), turn it into |cos| "
            "affinities, embed the features in 2-D by metric MDS (distance 1 - affinity for "
            "coherent towers, the affinity for diverse ones) and cut them into --towers "
            "balanced towers by constrained k-means. Deterministic for a seed."
        ),
    )
    parser.add_argument("--towers", type=int, required=True, metavar="T",
                        help="towers T (an SPTT job puts one on each host)")  # fmt: skip
    options = add_config_options(
        parser,
        PartitionConfig,
        exclude=("towers", "model"),
        overrides={
            "out": Option(metavar="FILE"),
            "plot": Option(metavar="PNG"),
            "checkpoint": Option(metavar="DIR"),
            "balance": Option(metavar="K"),
        },
    )
    model_options = add_config_options(
        parser.add_argument_group("the short run's model"), ModelConfig, include=_MODEL_OPTIONS,
        owner=parser,
    )  # fmt: skip
    add_quiet_option(parser)

    def build(args: argparse.Namespace) -> int:
        model = model_options.build(args, attention="none")
        return run_partition(options.build(args, towers=args.towers, model=model), args)

    parser.set_defaults(func=build)


def run_partition(config: PartitionConfig, args: argparse.Namespace) -> int:
    """Partition, write the plan (and the plot), print the towers."""
    from recpipe.paths import check_outputs
    from trainer.towers.partition import plot_partition
    from trainer.towers.run import describe_partition, partition

    check_outputs(
        [("--out", config.out, "file"), ("--plot", config.plot, "file")],
        inputs=[config.dataset, config.checkpoint],
    )
    part = partition(config, progress=not args.quiet)
    path = part.plan.save(config.out)
    print(f"recpipe towers partition: {part.plan.num_towers} towers -> {path}")
    print(describe_partition(part))
    if config.plot is not None:
        print(f"  plot  {plot_partition(part, config.plot)}")
    return 0


def _add_train(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "train",
        help="train a towered DLRM (one process, or SPTT on several hosts)",
        description=(
            "Train a DLRM whose sparse features form the towers of --towers FILE. In one "
            "process the towers are model structure only. With --nproc (or under torchrun) "
            "tower t's tables live on host t (--ranks-per-host ranks each) and SPTT moves the "
            "data: the ids by a global all-to-all, the pooled embeddings inside each host, and "
            "only the tower modules' outputs across hosts. --batch-size is per rank."
        ),
    )
    run_options, model_options = train_options(parser)
    tower_options = add_towers_arguments(parser, required=True)
    parser.add_argument("--json", metavar="FILE", help="also write the summary as JSON")
    add_quiet_option(parser)
    launch.add_distributed_arguments(parser, exchange=False)

    def build(args: argparse.Namespace) -> int:
        config = run_options.build(args, model=model_options.build(args))
        towers = tower_options.build(args, towers=args.towers)
        return run_train((config, towers), args)

    parser.set_defaults(func=build)


def add_towers_arguments(parser: argparse.ArgumentParser, *, required: bool = False) -> Any:
    """``--towers FILE`` and the towers' options (:class:`trainer.towers.config.TowersConfig`):
    with a plan, ``recpipe train`` trains a towered DLRM through the same loop (SPTT on ranks).
    Returns the options' builder."""
    from trainer.towers.config import TowersConfig

    group = parser.add_argument_group("towers (DMT: with --towers FILE)")
    group.add_argument(
        "--towers", required=required, default=None, metavar="FILE",
        help="train a towered DLRM on this tower plan (`recpipe towers partition --out FILE`): "
        "in one process the towers are model structure only; with --nproc tower t's tables "
        "live on host t and SPTT moves the data (no attention pooling: towers pool only)",
    )  # fmt: skip
    return add_config_options(
        group, TowersConfig, exclude=("towers",),
        overrides={"ranks_per_host": Option(metavar="L")}, owner=parser,
    )  # fmt: skip


def run_train(configs: tuple[TrainConfig, TowersConfig], args: argparse.Namespace) -> int:
    """Train a towered DLRM (``recpipe train --towers``, or its alias ``recpipe towers train``;
    launching torchrun's workers with ``--nproc``), print the summary, write ``--json``; the
    exit code. A worker of ``--nproc`` enters here too."""
    from trainer.checkpoint import claim_checkpoint
    from trainer.cli_common import claim_for_workers, with_saved_settings
    from trainer.distributed.comm import destroy, init_from_env, launched_by_torchrun
    from trainer.outputs import check_train_outputs
    from trainer.runlog import format_summary, summary_dict
    from trainer.towers.run import checked_plan, train_towers
    from trainer.train import set_threads

    config, towers = configs
    check_train_outputs(config, json=args.json, reads=[towers.towers])
    config, _ = with_saved_settings(config, args)
    checked_plan(config, towers)  # before any worker starts
    config = replace(config, model=replace(config.model, attention="none"))  # towers pool only
    set_threads(config)
    timeout_s = launch.distributed_config(args).timeout_s
    if launch.requested(args) and not launched_by_torchrun():
        worker = argparse.Namespace(
            nproc=None, quiet=args.quiet, json=args.json,
            distributed=launch.distributed_config(args),
            towers_command=getattr(args, "towers_command", None),
        )  # fmt: skip
        with claim_for_workers(config, args):
            launch.launch_workers(
                launch.launch_config(args), worker, (config, towers), module="trainer.towers"
            )
        return 0
    if launched_by_torchrun():
        comm = init_from_env(device=config.device, timeout_s=timeout_s)
        try:
            result, summary = train_towers(config, towers, comm=comm, progress=not args.quiet)
        finally:
            destroy()
        if comm.rank != 0:
            return 0
    else:
        with claim_checkpoint(config.checkpoint, resume=config.resume, overwrite=config.overwrite):
            result, summary = train_towers(config, towers, progress=not args.quiet)
    text = format_summary(config, result)
    if getattr(args, "towers_command", None) == "train":  # the alias names itself
        text = text.replace("recpipe train", "recpipe towers train", 1)
    print(text)
    rows = summary.lines()
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"  {k:<{width}}  {v}" for k, v in rows))
    if args.json:
        doc = {**summary_dict(config, result), "towers": summary.dump()}
        with open(args.json, "w") as fh:
            json.dump(doc, fh, indent=2)
    sys.stdout.flush()
    return 0
