"""What ``recpipe train`` and its alias ``recpipe towers train`` share: their options, the
settings a resume takes from its checkpoint, and the claim of a multi-rank job's checkpoint.
Parsing imports nothing heavy."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from typing import Any

from recpipe.config_cli import Option, add_config_options
from trainer.config import ModelConfig, TrainConfig
from trainer.distributed import launch as distributed

__all__ = ["claim_for_workers", "train_options", "with_saved_settings"]

# Model options `recpipe train` exposes (the rest of ModelConfig keeps its defaults).
_MODEL_OPTIONS = (
    "embedding_dim", "num_embeddings", "hash_ids", "pooling", "bottom_mlp", "top_mlp",
    "attention", "attention_heads", "attention_layers", "sparse_grad",
)  # fmt: skip


def train_options(parser: argparse.ArgumentParser) -> tuple[Any, Any]:
    """The run's and the model's options (:class:`TrainConfig`, :class:`ModelConfig`) on
    ``parser``; their builders."""
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
    return run_options, model_options


def with_saved_settings(
    config: TrainConfig, args: argparse.Namespace
) -> tuple[TrainConfig, dict[str, Any] | None]:
    """With ``--resume``, ``config`` with the model's and the run's settings of its checkpoint,
    except the options written on the command line (a contradiction is then refused by name),
    and the checkpoint's state as read (``None``: none read). Only the command line's own
    process merges (torchrun workers get the merged config)."""
    explicit = getattr(args, "explicit", None)
    if not config.resume or config.checkpoint is None or explicit is None:
        return config, None
    from trainer.checkpoint import checkpoint_file, load_checkpoint, settings_from_checkpoint

    try:
        state = load_checkpoint(checkpoint_file(config.checkpoint))
    except Exception:  # unreadable: the run's own checks name it
        return config, None
    if state is None:
        return config, None
    world = 1
    if distributed.requested(args):
        launch = distributed.launch_config(args)
        world = (launch.nproc or 1) * launch.nnodes
    return settings_from_checkpoint(state, config, explicit=explicit, world_size=world), state


@contextlib.contextmanager
def claim_for_workers(config: TrainConfig, args: argparse.Namespace) -> Iterator[None]:
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
    from recpipe.errors import RecpipeError
    from trainer.checkpoint import check_resume, checkpoint_file, claim_checkpoint, load_checkpoint
    from trainer.distributed.run import check_config
    from trainer.train import layout_refusal

    check_config(config)  # refused before an --overwrite removes anything
    with claim_checkpoint(config.checkpoint, resume=config.resume, overwrite=config.overwrite):
        if config.resume:
            path = checkpoint_file(config.checkpoint)
            launch = distributed.launch_config(args)
            world = (launch.nproc or 1) * launch.nnodes
            state = load_checkpoint(path)
            check_resume(state, config, path=path, world_size=world)
            towers = getattr(args, "towers", None) is not None
            why = layout_refusal(state, path=path, world_size=world, towers=towers)
            if why is not None:
                raise RecpipeError(why)
        yield
