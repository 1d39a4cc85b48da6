"""``recpipe train``: train a DLRM on a clustered dataset, with or without dedup.

The options are generated from :class:`~trainer.config.TrainConfig` and
:class:`~trainer.config.ModelConfig` (:mod:`recpipe.config_cli`): their docstrings are the help.
Parsing imports nothing heavy; torch and the trainer are imported when the command runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator

from recpipe.config_cli import Option, add_config_options, add_quiet_option
from trainer.config import ModelConfig, TrainConfig
from trainer.distributed import launch as distributed

__all__ = ["register_cli", "run"]


# Model options `recpipe train` exposes (the rest of ModelConfig keeps its defaults).
_MODEL_OPTIONS = (
    "embedding_dim", "num_embeddings", "hash_ids", "pooling", "bottom_mlp", "top_mlp",
    "attention", "attention_heads", "attention_layers", "sparse_grad",
)  # fmt: skip


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
    run_options = add_config_options(
        parser,
        TrainConfig,
        exclude=("model",),
        overrides={
            "dedup": Option(choices={"on": True, "off": False}),
            "dedup_groups": Option(metavar="auto|FILE"),
            "checkpoint": Option(metavar="DIR"),
            "service": Option(metavar="HOST:PORT"),
            "preprocess": Option(metavar="FILE"),
            "metrics": Option(metavar="FILE"),
            "tensorboard": Option(metavar="DIR"),
            "threads": Option(metavar="N"),
        },
        exclusive=[("steps", "epochs")],
    )
    model_options = add_config_options(
        parser.add_argument_group("model"),
        ModelConfig,
        include=_MODEL_OPTIONS,
        overrides={"attention": Option(metavar="ATTENTION")},
        owner=parser,
    )
    parser.add_argument("--json", metavar="FILE", help="also write the summary as JSON")
    add_quiet_option(parser)
    distributed.add_distributed_arguments(parser)
    parser.set_defaults(
        func=lambda args: run(run_options.build(args, model=model_options.build(args)), args)
    )


def run(config: TrainConfig, args: argparse.Namespace) -> int:
    """Train ``config`` (on several ranks when ``args`` asks for it), print the summary and
    write ``--json``; the exit code. A torchrun worker of ``--nproc`` enters here too."""
    from trainer.outputs import check_train_outputs
    from trainer.runlog import format_summary, summary_dict
    from trainer.train import resolve_model, set_threads, train

    check_train_outputs(config, json=args.json)
    # the features --attention auto names and the thread count, as the summary shows them; a
    # torchrun worker of --nproc resolves its own (its share of the node's cores)
    config = resolve_model(config)
    set_threads(config)
    summary = None
    if distributed.requested(args):
        with _claim_for_workers(config, args):
            ran = distributed.run(args, config)
        if ran is None:  # the launching process, or a rank other than 0
            return 0
        result, summary = ran
    else:
        result = train(config, progress=not args.quiet)
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


@contextlib.contextmanager
def _claim_for_workers(config: TrainConfig, args: argparse.Namespace) -> Iterator[None]:
    """A multi-rank job's ``--checkpoint``, claimed as :func:`trainer.train.train` claims a
    process's own (:func:`trainer.checkpoint.claim_checkpoint`, and with ``--resume`` the
    settings compared by :func:`trainer.checkpoint.check_resume`) by the process launching the
    first node's workers (``--nproc``), which holds the lock until they end. The workers, the
    launchers of other nodes and a job started by plain torchrun do not claim it."""
    from trainer.distributed.comm import launched_by_torchrun

    if (
        config.checkpoint is None
        or launched_by_torchrun()
        or distributed.launch_config(args).node_rank != 0
    ):
        yield
        return
    from trainer.checkpoint import check_resume, checkpoint_file, claim_checkpoint, load_checkpoint
    from trainer.distributed.run import check_config

    check_config(config)  # refused before an --overwrite removes anything
    with claim_checkpoint(config.checkpoint, resume=config.resume, overwrite=config.overwrite):
        if config.resume:
            path = checkpoint_file(config.checkpoint)
            check_resume(load_checkpoint(path), config, path=path, multi_rank=True)
        yield
