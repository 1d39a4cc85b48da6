"""``recpipe train``: train a DLRM on a clustered dataset, with or without dedup.

The options are generated from :class:`~trainer.config.TrainConfig` and
:class:`~trainer.config.ModelConfig` (:mod:`recpipe.config_cli`): their docstrings are the help.
Parsing imports nothing heavy; torch and the trainer are imported when the command runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from recpipe.config_cli import add_quiet_option
from trainer.cli_common import claim_for_workers, train_options, with_saved_settings
from trainer.config import TrainConfig
from trainer.distributed import launch as distributed

__all__ = ["register_cli", "run"]


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    """Add ``recpipe train`` to the top-level parser; its options are :class:`TrainConfig`'s."""
    parser = subparsers.add_parser(
        "train",
        help="train a DLRM with or without dedup",
        description=(
            "Train a DLRM (bottom MLP, embedding bags, dot interaction, top MLP, attention "
            "over the user history) on a clustered dataset through the readers. With "
            "--dedup on the embedding lookups and the attention run on the unique rows of "
            "each dedup group (RecD O5-O7); --dedup off runs the same model on plain "
            "batches and gives the same losses. Shows loss, AUC, samples/s and peak memory, "
            "evaluates on held-out sessions (by session-id hash), writes a checkpoint that "
            "--resume continues exactly, and ends with a summary."
        ),
    )
    run_options, model_options = train_options(parser)
    from trainer.towers.cli import add_towers_arguments

    towers = add_towers_arguments(parser)
    parser.add_argument("--json", metavar="FILE", help="also write the summary as JSON")
    add_quiet_option(parser)
    distributed.add_distributed_arguments(parser)

    def build(args: argparse.Namespace) -> int:
        config = run_options.build(args, model=model_options.build(args))
        if args.towers is None:
            return run(config, args)
        from trainer.towers.cli import run_train

        return run_train((config, towers.build(args, towers=args.towers)), args)

    parser.set_defaults(func=build)


def rank_checkpoint_options(state: dict[str, Any] | None) -> Any:
    """For a multi-rank job's checkpoint ``state`` (read by ``--resume``), the job's exchange
    options (one process continues it on a world of one); else ``None``."""
    if state is None or state.get("kind") != "distributed":
        return None
    from dataclasses import fields

    from trainer.distributed.config import DistributedConfig

    saved = state.get("options") or {}
    known = {f.name for f in fields(DistributedConfig)}
    return DistributedConfig(**{k: v for k, v in saved.items() if k in known})


def run(config: TrainConfig, args: argparse.Namespace) -> int:
    """Train ``config`` (on several ranks when ``args`` asks for it), print the summary and
    write ``--json``; the exit code. A torchrun worker of ``--nproc`` enters here too."""
    from trainer.outputs import check_train_outputs
    from trainer.runlog import format_summary, summary_dict
    from trainer.train import resolve_model, set_threads, train

    check_train_outputs(config, json=args.json)
    config, saved = with_saved_settings(config, args)
    # the features --attention auto names and the thread count, as the summary shows them; a
    # torchrun worker of --nproc resolves its own (its share of the node's cores)
    config = resolve_model(config)
    set_threads(config)
    summary = None
    if distributed.requested(args):
        with claim_for_workers(config, args):
            ran = distributed.run(args, config)
        if ran is None:  # the launching process, or a rank other than 0
            return 0
        result, summary = ran
    else:
        options = rank_checkpoint_options(saved)
        if options is None:
            result = train(config, progress=not args.quiet,
                           exact_dense=getattr(args, "exact_dense", True))  # fmt: skip
        else:  # a multi-rank job's checkpoint goes on here: its engine on a world of one
            from trainer.checkpoint import claim_checkpoint
            from trainer.distributed.comm import Comm
            from trainer.distributed.run import train_rank

            with claim_checkpoint(config.checkpoint, resume=True, overwrite=config.overwrite):
                result, summary = train_rank(
                    config, options, comm=Comm.single(config.device), progress=not args.quiet
                )
    print(format_summary(config, result))
    if summary is not None:
        print(distributed.describe(summary))
    if args.json:
        doc = summary_dict(config, result)
        if summary is not None:
            doc["distributed"] = distributed.dump(summary)
        with open(args.json, "w") as fh:
            json.dump(doc, fh, indent=2)
    sys.stdout.flush()
    return 0
