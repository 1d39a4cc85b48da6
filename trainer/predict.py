"""``recpipe predict``: score a part of a dataset with a trained model, or evaluate it, without
training.

::

    CKPT/checkpoint.pt --(recorded model settings, dedup groups)--> DLRM, its trained weights
    DATASET --(the checkpoint's --eval-fraction and --seed)--> held-out | training rows
    the part (--part heldout|train|all), read in order, the last short batch kept
            -> logits -> score = sigmoid(logit), with each row's request_id and user_id
            -> --out preds.parquet (request_id, user_id, label, score) and loss, AUC

The rows are read unshuffled, so every row of the part is scored exactly once. ``request_id`` and
``user_id`` come with each batch as the readers' pass-through ``extras`` (int64 keys, see
:mod:`readers.extras`) and are written back as the dataset's own values, so the file joins to
the logs on ``request_id``. The loss and AUC of ``--part heldout`` are the held-out evaluation
``recpipe train`` makes at the end of a run (over all held-out batches); ``--metrics-only``
prints them (and ``--json`` writes them) without writing predictions.

A one-process checkpoint with its tables in the model (``recpipe train --store module``) is
read as it is; a checkpoint of any other layout (ranks, towers, a hybrid store) is read once
``recpipe export`` has turned it into one file of one-process weights (``CKPT`` is then that
file); given directly it is refused with one line.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

from recpipe.config_cli import add_quiet_option
from recpipe.errors import DataError, RecpipeError

if TYPE_CHECKING:
    import numpy as np
    import pyarrow as pa

    from readers.dataset import ParquetBatchDataset
    from trainer.config import ModelConfig, TrainConfig
    from trainer.models import DLRM

__all__ = [
    "EXTRAS",
    "Part",
    "Predictions",
    "load_trained_model",
    "part_dataset",
    "predict",
    "register_cli",
    "write_predictions",
]

_log = logging.getLogger(__name__)

Part = Literal["heldout", "train", "all"]
_PARTS: tuple[str, ...] = get_args(Part)
_PART_NAMES = {"heldout": "held-out", "train": "training", "all": "whole"}

EXTRAS: tuple[str, ...] = ("request_id", "user_id")
"""The pass-through columns every prediction carries (see :mod:`readers.extras`)."""


# -------------------------------------------------------------------------------------------
# the model of a checkpoint


def _model_config(saved: dict[str, Any]) -> ModelConfig:
    """The :class:`~trainer.config.ModelConfig` a checkpoint recorded (``asdict`` of it)."""
    from trainer.config import ModelConfig, TableConfig

    known = {f.name for f in fields(ModelConfig)}
    kept = {k: v for k, v in saved.items() if k in known}
    if kept.get("tables") is not None:
        kept["tables"] = tuple(TableConfig(**t) for t in kept["tables"])
    return ModelConfig(**kept)


def _train_config(
    saved: dict[str, Any], model: ModelConfig, *, dataset: str, device: str
) -> TrainConfig:
    """The run's :class:`~trainer.config.TrainConfig`, reading ``dataset`` on ``device``."""
    from trainer.config import TrainConfig

    known = {f.name for f in fields(TrainConfig)} - {"model"}
    kept = {k: v for k, v in saved.items() if k in known}
    kept.update(dataset=dataset, device=device, resume=False, overwrite=False, model=model)
    return TrainConfig(**kept)


def _refuse_unloadable(state: dict[str, Any], path: Path) -> None:
    kind = state.get("kind")
    if kind == "distributed":
        msg = (
            f"{path}: a checkpoint of a multi-rank job ({state.get('world_size', '?')} ranks, "
            "its tables sharded over rank files under sparse/); `recpipe predict` reads a "
            "one-process `recpipe train --checkpoint` checkpoint or a `recpipe export` file"
            "\nhint: `recpipe export CKPT --out FILE` writes its one-process weights"
        )
        raise RecpipeError(msg)
    if (state.get("layout") or {}).get("kind") == "towers":
        msg = (
            f"{path}: a checkpoint of a towers run (its parts under towers/); `recpipe predict` "
            "reads a one-process `recpipe train --checkpoint` checkpoint or a `recpipe export` "
            "file\nhint: `recpipe export CKPT --out FILE` writes its one-process weights"
        )
        raise RecpipeError(msg)
    if kind is not None:
        msg = f"{path}: a {kind!r} checkpoint; `recpipe predict` reads a one-process `recpipe train` checkpoint"
        raise RecpipeError(msg)
    if not isinstance(state.get("config"), dict) or not isinstance(state.get("model_config"), dict):
        msg = f"{path}: records no settings of its run: not a checkpoint of `recpipe train`"
        raise RecpipeError(msg)
    store = state["config"].get("store", "module")
    if store != "module":
        msg = (
            f"{path}: its tables live in the {store!r} embedding store under "
            f"{path.parent / 'store'}, not in the checkpoint; `recpipe predict` reads a "
            "`recpipe train --store module` checkpoint or a `recpipe export` file"
            "\nhint: `recpipe export CKPT --out FILE` writes its one-process weights"
        )
        raise RecpipeError(msg)


def load_trained_model(
    checkpoint: str | os.PathLike[str],
    *,
    dataset: str | os.PathLike[str] | None = None,
    device: str = "cpu",
) -> tuple[DLRM, TrainConfig, dict[str, Any]]:
    """The trained model of a one-process ``recpipe train --checkpoint DIR`` run.

    The model is rebuilt from the settings the checkpoint recorded (model config, dedup groups)
    and the schema of ``dataset``, then given the checkpoint's weights.

    Args:
        checkpoint: the checkpoint directory (or its ``checkpoint.pt``).
        dataset: the dataset to read (default: the one the run trained on).
        device: where the model runs (``cpu``, ``cuda``, ``cuda:N``).

    Returns:
        the model (in eval mode, on ``device``), the run's config reading ``dataset`` on
        ``device``, and the checkpoint's state.

    Raises:
        RecpipeError: no checkpoint there, a damaged one, a multi-rank or hybrid-store one, or
            a model that does not fit ``dataset``'s features.
    """
    from trainer.checkpoint import CHECKPOINT_FILE, checkpoint_file, load_checkpoint
    from trainer.export_format import as_checkpoint, build_model, is_export, read_export
    from trainer.train import read_schema

    root = Path(checkpoint)
    if root.name == CHECKPOINT_FILE and root.is_file():
        root = root.parent
    path = root if is_export(root) else checkpoint_file(root)
    if not root.is_dir() and not is_export(root):
        msg = f"`CKPT` {str(checkpoint)!r} is not a checkpoint directory or a `recpipe export` file"
        raise RecpipeError(msg)
    state = as_checkpoint(read_export(path)) if is_export(root) else load_checkpoint(path)
    if state is None:
        msg = (
            f"`CKPT` {str(checkpoint)!r} holds no {CHECKPOINT_FILE} (write one with "
            "`recpipe train --checkpoint DIR`)"
        )
        raise RecpipeError(msg)
    _refuse_unloadable(state, path)
    saved = state["config"]
    target = str(dataset) if dataset is not None else str(saved["dataset"])
    config = _train_config(
        saved, _model_config(state["model_config"]), dataset=target, device=device
    )
    model = build_model(state, read_schema(config), config.model)
    try:
        model.load_state_dict(state["trainer"]["model"])
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[-1].strip() if str(exc).strip() else repr(exc)
        msg = (
            f"`DATASET` {target!r}: the model recorded in {path} does not fit its features: {first}"
        )
        raise RecpipeError(msg) from None
    return model.to(device).eval(), config, state


# -------------------------------------------------------------------------------------------
# the rows of a part


def part_dataset(config: TrainConfig, *, part: Part, batch_size: int) -> ParquetBatchDataset:
    """The rows of one part of ``config.dataset``, divided as the run divided them (its
    ``eval_fraction`` and ``seed``), read unshuffled with the last short batch kept and
    :data:`EXTRAS` delivered in ``Batch.extras``.

    Raises:
        RecpipeError: an unknown part, or an empty one.
    """
    from readers.dataset import ParquetBatchDataset
    from readers.holdout import holdout_splits
    from readers.source import ReaderConfig
    from trainer.train import read_schema

    if part not in _PARTS:
        msg = f"`part` must be one of {list(_PARTS)}, got {part!r}"
        raise RecpipeError(msg)
    reader = ReaderConfig(batch_size=batch_size, shuffle=False, last_batch="partial", extras=EXTRAS)
    ds = ParquetBatchDataset(
        config.dataset, schema=read_schema(config), config=reader,
        transforms=config.preprocess, dedup=config.dedup,
    )  # fmt: skip
    if part != "all":
        train, held = holdout_splits(
            ds.source.splits, session_key=ds.schema.session_key,
            fraction=config.eval_fraction, seed=config.seed,
        )  # fmt: skip
        ds.source.splits = held if part == "heldout" else train
    if not ds.source.splits:
        why = (
            f"the run held out no rows (`--eval-fraction` {config.eval_fraction:g})"
            if part == "heldout"
            else "it has no rows"
        )
        msg = f"`--part` {part!r}: the {_PART_NAMES[part]} part of {config.dataset} is empty: {why}"
        raise DataError(msg)
    return ds


# -------------------------------------------------------------------------------------------
# scoring


@dataclass
class Predictions:
    """The model's outputs on every row of a part, in reading order.

    Attributes:
        logits: ``[N]`` float32 logits.
        labels: ``[N]`` float32 labels.
        keys: ``{column: [N] int64}`` the rows' :data:`EXTRAS` keys (``Batch.extras``).
        loss: mean binary cross-entropy (log loss) of the logits.
        auc: ROC AUC (``nan`` with one class only).
        batches: batches read.
    """

    logits: np.ndarray
    labels: np.ndarray
    keys: dict[str, np.ndarray]
    loss: float
    auc: float
    batches: int

    @property
    def rows(self) -> int:
        return int(self.logits.shape[0])

    @property
    def scores(self) -> np.ndarray:
        """``sigmoid(logits)``, float32."""
        import torch

        return torch.sigmoid(torch.from_numpy(self.logits)).numpy()


def predict(
    model: DLRM, ds: ParquetBatchDataset, *, device: str = "cpu", progress: bool = False
) -> Predictions:
    """Run ``model`` on every batch of ``ds``; the logits, labels, keys, loss and AUC."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    from recpipe.progress import progress_bar
    from trainer.metrics import auc

    logits: list[torch.Tensor] = []
    labels: list[torch.Tensor] = []
    keys: dict[str, list[torch.Tensor]] = {name: [] for name in EXTRAS}
    bar = progress_bar(total=ds.num_batches(num_workers=0), unit="batch", desc="predict",
                       file=sys.stderr, disable=not progress, dynamic_ncols=True)  # fmt: skip
    model.eval()
    ds.set_epoch(0)
    with bar, torch.no_grad():
        for batch in ds:
            out = model(batch.to(device))
            logits.append(out.float().cpu())
            labels.append(batch.labels.float())
            for name in EXTRAS:
                keys[name].append(batch.extras[name])
            bar.update(1)
    logit = torch.cat(logits)
    label = torch.cat(labels)
    loss = float(F.binary_cross_entropy_with_logits(logit.double(), label.double()))
    return Predictions(
        logits=logit.numpy(), labels=label.numpy(), batches=len(logits),
        keys={n: torch.cat(k).numpy().astype(np.int64, copy=False) for n, k in keys.items()},
        loss=loss, auc=auc(logit, label),
    )  # fmt: skip


# -------------------------------------------------------------------------------------------
# the file


def _column_values(ds: ParquetBatchDataset) -> dict[str, pa.ChunkedArray]:
    """The :data:`EXTRAS` columns of the rows ``ds`` reads, as the dataset stores them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    session = ds.schema.session_key
    parts: list[pa.Table] = []
    for split in ds.source.splits:
        with pq.ParquetFile(split.path) as pf:
            table = pf.read_row_group(split.row_group, columns=[*EXTRAS, session])
        parts.append(split.kept(table, session_key=session).select(list(EXTRAS)))
    table = pa.concat_tables(parts)
    return {name: table.column(name) for name in EXTRAS}


def _values_of(name: str, keys: np.ndarray, column: pa.ChunkedArray) -> pa.Array:
    """The values of ``column`` whose extras keys are ``keys`` (each key must be there)."""
    import numpy as np
    import pyarrow as pa

    from readers.extras import extra_column_keys

    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    stored = extra_column_keys(name, column)
    unique, first, inverse = np.unique(stored, return_index=True, return_inverse=True)
    representative = column.take(pa.array(first[inverse]))
    if not representative.equals(column):
        msg = f"column `{name}`: two different values share one 64-bit key; cannot join back"
        raise DataError(msg)
    at = np.searchsorted(unique, keys)
    found = (at < unique.size) & (unique[np.minimum(at, unique.size - 1)] == keys)
    if not found.all():
        msg = f"column `{name}`: a key the readers delivered is not in the part's rows"
        raise DataError(msg)
    return column.take(pa.array(first[at]))


def write_predictions(
    preds: Predictions, ds: ParquetBatchDataset, out: str | os.PathLike[str]
) -> pa.Table:
    """Write ``preds`` (made from ``ds``) to the Parquet file ``out``: ``request_id`` and
    ``user_id`` (the dataset's values), ``label``, ``score``; written beside ``out`` and renamed
    into place. Returns the table."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    stored = _column_values(ds)
    columns = {name: _values_of(name, preds.keys[name], stored[name]) for name in EXTRAS}
    table = pa.table({**columns, "label": preds.labels, "score": preds.scores})
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        pq.write_table(table, tmp, compression="zstd")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return table


# -------------------------------------------------------------------------------------------
# the command


def register_cli(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``recpipe predict`` to the top-level parser."""
    parser = subparsers.add_parser(
        "predict",
        help="score or evaluate a dataset with a trained model",
        description=(
            "Score a part of a dataset with the model of a one-process `recpipe train "
            "--checkpoint DIR` run (rebuilt from the settings it recorded) and write "
            "request_id, user_id, label and score (sigmoid of the logit) to a Parquet file, "
            "one row per row of the part; print the rows, log loss and AUC. The parts are the "
            "run's own: its --eval-fraction and --seed divide the dataset's sessions. "
            "--metrics-only evaluates without writing predictions."
        ),
    )
    parser.add_argument(
        "checkpoint", metavar="CKPT",
        help="checkpoint directory of `recpipe train`, or a file of `recpipe export`",
    )  # fmt: skip
    parser.add_argument("dataset", metavar="DATASET", help="clustered dataset directory")
    parser.add_argument("--out", metavar="FILE", help="write the predictions to this Parquet file")
    parser.add_argument(
        "--part", choices=_PARTS, default="heldout",
        help="the rows to score: the run's held-out sessions (default), its training ones, or all",
    )  # fmt: skip
    parser.add_argument(
        "--metrics-only", action="store_true",
        help="only evaluate: print the loss and AUC (and --json), write no predictions",
    )  # fmt: skip
    parser.add_argument("--json", metavar="FILE", help="also write the summary as JSON")
    parser.add_argument(
        "--batch-size", type=int, metavar="N", help="rows per batch (default: the run's)"
    )
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    add_quiet_option(parser, aliases=())
    parser.set_defaults(func=run)


def _check_args(args: argparse.Namespace) -> None:
    from recpipe.paths import check_outputs

    if args.metrics_only and args.out is not None:
        msg = "give `--out` (write predictions) or `--metrics-only` (only evaluate), not both"
        raise RecpipeError(msg)
    if not args.metrics_only and args.out is None:
        msg = "`--out` is missing: give the Parquet file to write, or `--metrics-only`"
        raise RecpipeError(msg)
    if args.batch_size is not None and args.batch_size < 1:
        msg = f"`--batch-size` must be a positive integer, got {args.batch_size!r}"
        raise RecpipeError(msg)
    if not Path(args.dataset).exists():
        msg = f"`DATASET` {str(args.dataset)!r} does not exist"
        raise DataError(msg)
    check_outputs(
        (("--out", args.out, "file"), ("--json", args.json, "file")),
        inputs=[args.checkpoint, args.dataset],
    )


def _check_same_dataset(state: dict[str, Any], config: TrainConfig, part: str, path: Path) -> None:
    """A part other than ``all`` is the run's only on the dataset it trained on."""
    from trainer.checkpoint import dataset_identity

    was, now = state.get("dataset_id"), dataset_identity(config.dataset)
    if part != "all" and was is not None and now is not None and was != now:
        msg = (
            f"`DATASET` {config.dataset!r} is not the dataset {path} was trained on (its "
            f"manifest lists other files), so its {_PART_NAMES[part]} part is not the run's; "
            "give `--part all` to score every row of it"
        )
        raise RecpipeError(msg)


def _num(x: float) -> float | None:
    return None if math.isnan(x) else x


def summary_dict(
    args: argparse.Namespace, preds: Predictions, *, step: int, wall_s: float
) -> dict[str, Any]:
    """What ``recpipe predict`` reports, under the names ``--json`` writes."""
    return {
        "checkpoint": str(args.checkpoint), "step": step, "dataset": str(args.dataset),
        "part": args.part, "samples": preds.rows, "batches": preds.batches,
        "loss": _num(preds.loss), "auc": _num(preds.auc), "wall_s": wall_s, "out": args.out,
    }  # fmt: skip


def format_summary(doc: dict[str, Any]) -> str:
    """One line per key of :func:`summary_dict`: its value and what it is."""
    part = _PART_NAMES[doc["part"]]
    notes = {
        "step": "the checkpoint's training step",
        "part": f"the run's {part} rows",
        "samples": "rows scored, each once",
        "loss": "log loss (binary cross-entropy), mean per sample",
        "auc": "ROC AUC",
        "wall_s": "reading and scoring",
        "out": ", ".join((*EXTRAS, "label", "score")) if doc["out"] else "",
    }
    shown = {
        **doc,
        "samples": f"{doc['samples']:,}",
        "loss": "-" if doc["loss"] is None else f"{doc['loss']:.4f}",
        "auc": "-" if doc["auc"] is None else f"{doc['auc']:.4f}",
        "wall_s": f"{doc['wall_s']:.1f} s",
        "out": doc["out"] or "- (--metrics-only)",
    }
    width = max(map(len, shown))
    vwidth = max(len(str(v)) for k, v in shown.items() if notes.get(k))
    lines = [
        f"  {k:<{width}}  {v!s:<{vwidth}}  {notes.get(k, '')}".rstrip() for k, v in shown.items()
    ]
    return "recpipe predict: done\n" + "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """``recpipe predict``: the exit code."""
    _check_args(args)
    model, config, state = load_trained_model(args.checkpoint, dataset=args.dataset,
                                              device=args.device)  # fmt: skip
    _check_same_dataset(state, config, args.part, Path(args.checkpoint))
    batch_size = args.batch_size or config.batch_size
    ds = part_dataset(config, part=args.part, batch_size=batch_size)
    step = int(state["trainer"]["step"])
    _log.info("scoring the %s part of %s (%d row groups) with the model of step %d",
              _PART_NAMES[args.part], config.dataset, len(ds.source.splits), step)  # fmt: skip
    t0 = time.perf_counter()
    preds = predict(model, ds, device=args.device, progress=not args.quiet)
    if args.out is not None:
        if Path(args.out).exists():
            _log.info("replacing %s", args.out)
        write_predictions(preds, ds, args.out)
    doc = summary_dict(args, preds, step=step, wall_s=time.perf_counter() - t0)
    print(format_summary(doc))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(doc, fh, indent=2)
    return 0
