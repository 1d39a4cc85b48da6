"""``recpipe train``: train a DLRM on a clustered dataset, with or without dedup.

Parsing imports nothing heavy; torch and the trainer are imported when the command runs.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from trainer.distributed import launch as distributed

__all__ = ["register_cli"]


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        msg = f"must be a positive integer, got {text!r}"
        raise argparse.ArgumentTypeError(msg)
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        msg = f"must be a non-negative integer, got {text!r}"
        raise argparse.ArgumentTypeError(msg)
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value < 1.0:
        msg = f"must be in [0, 1), got {text!r}"
        raise argparse.ArgumentTypeError(msg)
    return value


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    """Add ``recpipe train`` to the top-level parser."""
    parser = subparsers.add_parser(
        "train",
        help="train a DLRM with or without dedup",
        description=(
            "Train a DLRM (bottom MLP, embedding bags, dot interaction, top MLP, attention "
            "over the user history) on a clustered dataset through the readers. With "
            "--dedup on the embedding lookups and the attention run on the unique rows of "
            "each dedup group (RecD O5-O7); --dedup off runs the same model on plain "
            "batches and gives the same losses. Shows loss, AUC, samples/s and peak memory, "
            "evaluates on held-out row groups (whole sessions), writes a checkpoint that "
            "--resume continues exactly, and ends with a summary."
        ),
    )
    parser.add_argument(
        "dataset",
        metavar="DATASET",
        help="clustered dataset directory (with --service: the held-out evaluation data)",
    )
    parser.add_argument(
        "--dedup", choices=("on", "off"), default="on", help="deduplicate (default on)"
    )
    length = parser.add_mutually_exclusive_group()
    length.add_argument(
        "--steps", type=_positive_int, help="total optimizer steps (default: one epoch)"
    )
    length.add_argument("--epochs", type=_positive_int, help="passes over the training data")
    parser.add_argument(
        "--batch-size", type=_positive_int, default=4096, help="rows per batch (default 4096)"
    )
    parser.add_argument(
        "--lr", type=float, help="learning rate (default: adagrad 0.05, sgd 0.1, adam 0.001)"
    )
    parser.add_argument(
        "--optimizer",
        choices=("adagrad", "sgd", "adam"),
        default="adagrad",
        help="(default adagrad)",
    )
    parser.add_argument(
        "--eval-fraction",
        type=_fraction,
        default=0.1,
        help="share of row groups held out for evaluation (default 0.1)",
    )
    parser.add_argument(
        "--eval-every", type=_non_negative_int, default=0, help="also evaluate every N steps"
    )
    parser.add_argument(
        "--eval-batches", type=_positive_int, help="most held-out batches per evaluation"
    )
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    parser.add_argument("--checkpoint", metavar="DIR", help="write checkpoints into DIR")
    parser.add_argument(
        "--checkpoint-every",
        type=_non_negative_int,
        default=0,
        help="also checkpoint every N steps",
    )
    parser.add_argument(
        "--resume", action="store_true", help="continue from the checkpoint in --checkpoint DIR"
    )
    parser.add_argument(
        "--service", metavar="HOST:PORT", help="read training batches from `recpipe serve`"
    )
    parser.add_argument(
        "--store",
        choices=("module", "hybrid"),
        default="module",
        help="embedding tables as parameters (module) or in the hybrid embedding store",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of init, shuffles, hold-out")
    parser.add_argument(
        "--workers", type=_non_negative_int, default=0, help="DataLoader worker processes"
    )
    parser.add_argument("--preprocess", metavar="FILE", help="readers preprocessing config")
    parser.add_argument(
        "--embedding-dim", type=_positive_int, default=16, help="embedding dimension (default 16)"
    )
    parser.add_argument(
        "--num-embeddings",
        type=_positive_int,
        default=100_000,
        help="rows per table; raw ids are taken modulo this (default 100000)",
    )
    parser.add_argument(
        "--attention",
        default="auto",
        help="features pooled by attention: auto, none, or a comma-separated list",
    )
    parser.add_argument("--json", metavar="FILE", help="also write the summary as JSON")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    distributed.add_distributed_arguments(parser)
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from trainer.models import ModelConfig
    from trainer.train import TrainConfig, format_summary, train

    attention: Any = args.attention
    if attention not in ("auto", "none"):
        attention = tuple(a.strip() for a in attention.split(",") if a.strip())
    config = TrainConfig(
        dataset=args.dataset,
        dedup=args.dedup == "on",
        steps=args.steps,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        optimizer=args.optimizer,
        eval_fraction=args.eval_fraction,
        eval_every=args.eval_every,
        eval_batches=args.eval_batches,
        device=args.device,
        checkpoint=args.checkpoint,
        checkpoint_every=args.checkpoint_every,
        resume=args.resume,
        service=args.service,
        store=args.store,
        seed=args.seed,
        workers=args.workers,
        preprocess=args.preprocess,
        model=ModelConfig(
            embedding_dim=args.embedding_dim,
            num_embeddings=args.num_embeddings,
            attention=attention,
        ),
    )
    summary = None
    if distributed.requested(args):
        ran = distributed.run(args, config)
        if ran is None:  # the launching process, or a rank other than 0
            return 0
        result, summary = ran
    else:
        result = train(config, progress=not args.no_progress)
    print(format_summary(config, result))
    if summary is not None:
        print(distributed.describe(summary))
    if args.json:
        ev = result.final_eval
        doc = {
            "steps": result.steps,
            "samples": result.samples,
            "final_loss": result.losses[-1] if result.losses else None,
            "train_auc": _num(result.train_auc),
            "eval_loss": _num(ev.loss) if ev else None,
            "eval_auc": _num(ev.auc) if ev else None,
            "samples_per_s": _num(result.samples_per_s),
            "peak_memory_bytes": result.peak_memory_bytes,
            "dedup_factor": result.dedup_factor,
            "wall_s": result.wall_s,
            "checkpoint": result.checkpoint,
        }
        if summary is not None:
            doc["distributed"] = distributed.dump(summary)
        with open(args.json, "w") as fh:
            json.dump(doc, fh, indent=2)
    sys.stdout.flush()
    return 0


def _num(x: float) -> float | None:
    return None if math.isnan(x) else x
