"""``recpipe export``: any training checkpoint -> one file of one-process model weights.

::

    CKPT/checkpoint.pt (+ store/<table>/ | sparse/step-N/rank-* | towers/step-N/rank-*)
        --(the run's recorded model settings, the dataset's schema)--> a one-process DLRM
          every table starts from its initial rows (what every backend gives an untrained id)
          every row the checkpoint holds is written over its id's row
        --> OUT (torch.save): the model's state_dict and what rebuilds the model

A checkpoint of one process (``--store module``: its tables are in the model already;
``--store hybrid``: the rows are read from each table's store at the checkpoint's step), of a
multi-rank job (``--nproc N``: the rows of every rank file) and of a towers run (``--towers``:
the head from rank 0, each tower module from its host, the rows of every rank) exports alike;
pass-through towers give a plain DLRM, tower modules a ``TowerDLRM``. Sharded
and store rows are ``id -> row``; a one-process table is ``[num_embeddings, D]``: a saved id
outside ``0..num_embeddings-1`` (a run with ``--no-hash-ids``) cannot be placed and is refused.
Optimizer state is not exported.

The file is plain torch (``torch.load(OUT)``, ``weights_only`` is enough)::

    format            "recpipe-export"          format_version  1
    model             DLRM.state_dict()         model_config    asdict(ModelConfig), seed included
    schema            the schema it was built for, as TOML (dedup groups resolved)
    tower_model       None, or a towers run's plan and TowerModuleConfig (as dicts)
    config            the run's TrainConfig (asdict; store "module")
    step, dataset_id, source (layout, world size, store, checkpoint), tables (rows, from the
    checkpoint, at their initial values)

:func:`load_exported` rebuilds the model (``DLRM.from_schema(parse_schema(doc["schema"]),
ModelConfig(**doc["model_config"]))`` then ``load_state_dict(doc["model"])``), and
``recpipe predict OUT DATASET`` scores with it.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from recpipe.config_cli import add_quiet_option
from recpipe.errors import RecpipeError
from trainer.export_format import (
    EXPORT_FORMAT,
    EXPORT_VERSION,
    as_checkpoint,
    build_model,
    is_export,
    read_export,
)

if TYPE_CHECKING:
    from trainer.models import DLRM

__all__ = [
    "EXPORT_FORMAT",
    "ExportSummary",
    "TableExport",
    "as_checkpoint",
    "export_checkpoint",
    "is_export",
    "load_exported",
    "read_export",
    "register_cli",
    "run",
]

_log = logging.getLogger(__name__)


@dataclass
class TableExport:
    """One table of an export.

    Attributes:
        name: the table.
        rows: its rows (``num_embeddings``).
        saved: rows the checkpoint held (written over the initial rows).
        initial: rows still at their initial values (never trained).
    """

    name: str
    rows: int
    saved: int
    initial: int


@dataclass
class ExportSummary:
    """What :func:`export_checkpoint` wrote.

    Attributes:
        checkpoint: the checkpoint directory read.
        out: the file written.
        layout: ``local``, ``ranks`` or ``towers``.
        world_size: ranks of the run that wrote the checkpoint.
        store: ``module`` or ``hybrid``.
        step: the checkpoint's training step.
        tables: each table.
        bytes: size of ``out``.
    """

    checkpoint: str
    out: str
    layout: str
    world_size: int
    store: str
    step: int
    tables: list[TableExport] = field(default_factory=list)
    bytes: int = 0


# -------------------------------------------------------------------------------------------
# the checkpoint's rows


def _plain(value: Any) -> Any:
    """``value`` as plain containers and scalars (what ``torch.load(weights_only=True)`` reads)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_plain(v) for v in value)
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return os.fspath(value) if isinstance(value, os.PathLike) else str(value)


def _layout(state: dict[str, Any]) -> str:
    if state.get("kind") == "distributed":
        return "ranks"
    return str((state.get("layout") or {}).get("kind", "local"))


def _tables_by_name(model: DLRM) -> dict[str, Any]:
    """The model's parameter tables by table name."""
    from trainer.modules import ParameterTable

    return {m.config.name: m for m in model.modules() if isinstance(m, ParameterTable)}


def _place(table: Any, ids: Any, values: Any, *, path: Path) -> int:
    """Write ``values`` [n, >= D] over the rows ``ids`` of ``table``; the rows written.

    Raises:
        RecpipeError: an id outside the table (a ``--no-hash-ids`` run), naming it.
    """
    import numpy as np
    import torch

    c = table.config
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    bad = (ids < 0) | (ids >= c.num_embeddings)
    if bad.any():
        msg = (
            f"{path}: table {c.name!r} holds a row for id {int(ids[bad][0])}, outside its "
            f"{c.num_embeddings:,} rows ({int(bad.sum()):,} of its {ids.size:,} saved ids are, "
            f"up to {int(ids[bad].max())}): the run read ids unhashed (`--no-hash-ids`), so "
            "its rows do not fit a one-process table of `--num-embeddings` rows\nhint: export "
            "a run trained with `--hash-ids` (the default), or with `--num-embeddings` above "
            "its largest id"
        )
        raise RecpipeError(msg)
    values = torch.as_tensor(values)[:, : c.dim]
    with torch.no_grad():
        table.weight[torch.from_numpy(ids)] = values.to(table.weight.dtype)
    return int(np.unique(ids).size)


def _load_dense(model: DLRM, saved: dict[str, Any], *, path: Path, skip: str = "") -> None:
    """Load the checkpoint's dense model (its tables' rows come separately)."""
    tables = {f"{name}.weight" for name, m in model.named_modules() if hasattr(m, "config")
              and hasattr(m, "weight")}  # fmt: skip
    kept = {k: v for k, v in saved.items() if not (skip and k.startswith(skip))}
    try:
        missing, unexpected = model.load_state_dict(kept, strict=False)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[-1].strip()
        msg = f"{path}: its dense model does not fit the model its settings build: {first}"
        raise RecpipeError(msg) from None
    stray = [k for k in missing if k not in tables and not (skip and k.startswith(skip))]
    stray += list(unexpected)
    if stray:
        msg = (
            f"{path}: its dense model does not fit the model its settings build "
            f"({len(stray)} parameters differ, the first {stray[0]!r})"
        )
        raise RecpipeError(msg)


def _rows_from_parts(model: DLRM, parts: list[dict[str, Any]], *, path: Path) -> dict[str, int]:
    """Write the rows of every saved part (``{module path: {"ids", "values", ...}}``) into
    ``model``'s tables; rows written per table."""
    tables = _tables_by_name(model)
    written = dict.fromkeys(tables, 0)
    for part in parts:
        for key, entry in part.items():
            name = key.rsplit(".", 1)[-1]
            if name not in tables:
                msg = f"{path}: rows of table {name!r}, which the model its settings build has not"
                raise RecpipeError(msg)
            written[name] += _place(tables[name], entry["ids"], entry["values"], path=path)
    return written


def _rows_from_stores(model: DLRM, root: Path, *, step: int, path: Path) -> dict[str, int]:
    """Write every table's rows from its hybrid store (``root/store/<table>``) at ``step``."""
    from trainer.store.store import open_store

    written = {}
    for name, table in _tables_by_name(model).items():
        where = root / "store" / name
        if not (where / "meta.json").exists():
            msg = f"{path}: table {name!r} has no embedding store at {str(where)!r} (meta.json is missing)"
            raise RecpipeError(msg)
        with open_store(where, step=step) as store:
            ids, values = store.export()
        written[name] = _place(table, ids, values, path=path)
    return written


def _rows_from_rank_stores(
    model: DLRM, root: Path, state: dict[str, Any], *, path: Path
) -> dict[str, int]:
    """Write every table's rows from the stores of a multi-rank ``--store hybrid`` job
    (``root/store/rank-R-of-W/<table>``), read-only at the checkpoint's step."""
    from recpipe.errors import StoreError
    from trainer.distributed.store_shard import rank_store_dir, read_owned_rows

    world, step = int(state["store_world_size"]), int(state["step"])
    tables = _tables_by_name(model)
    written = dict.fromkeys(tables, 0)
    for rank in range(world):
        for name, table in tables.items():
            where = rank_store_dir(root, rank, world) / name
            if not (where / "meta.json").exists():
                msg = f"{path}: rank {rank}'s store of table {name!r} is missing at {str(where)!r} (meta.json)"
                raise RecpipeError(msg)
            try:
                rows = read_owned_rows(where, step=step, rank=0, world_size=1)
            except StoreError as exc:
                raise RecpipeError(f"{path}: {exc}") from None
            written[name] += _place(table, rows["ids"].numpy(), rows["values"], path=path)
    return written


# -------------------------------------------------------------------------------------------
# the export


def _schema_and_config(state: dict[str, Any], *, dataset: str | None, path: Path) -> Any:
    """The run's config (reading ``dataset``), its model config (seed included) and schema."""
    from trainer.predict import _model_config, _train_config
    from trainer.train import read_schema

    if not isinstance(state.get("config"), dict) or not isinstance(state.get("model_config"), dict):
        msg = f"{path}: records no settings of its run: not a checkpoint of `recpipe train`"
        raise RecpipeError(msg)
    target = dataset if dataset is not None else str(state["config"]["dataset"])
    if not Path(target).exists():
        msg = (
            f"`--dataset` {target!r} does not exist: the model is built for the schema of the "
            "dataset it trained on; give that dataset's directory"
        )
        raise RecpipeError(msg)
    config = _train_config(
        state["config"], _model_config(state["model_config"]), dataset=target, device="cpu"
    )
    schema = read_schema(config)
    mcfg = replace(config.model, seed=config.seed)
    return config, mcfg, schema


def export_checkpoint(
    checkpoint: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    dataset: str | os.PathLike[str] | None = None,
    progress: bool = False,
) -> ExportSummary:
    """Write the one-process weights of the checkpoint in ``checkpoint`` to ``out``.

    Args:
        checkpoint: a ``recpipe train --checkpoint`` directory (one process, ranks, towers,
            ``--store hybrid``).
        out: the file to write (replaced atomically).
        dataset: the dataset whose schema the model is built for (default: the run's).
        progress: show a progress bar on stderr.

    Raises:
        RecpipeError: no checkpoint, a damaged one, a run still holding it, a model the
            checkpoint does not fit, a saved id outside its table, or towers with tower
            modules from before checkpoints recorded their settings.
    """
    from recpipe.progress import progress_bar
    from trainer.checkpoint import checkpoint_file, claim_checkpoint, load_checkpoint

    root = Path(checkpoint)
    if root.name == "checkpoint.pt" and root.is_file():
        root = root.parent
    if not root.is_dir():
        msg = f"`CKPT` {str(checkpoint)!r} is not a checkpoint directory"
        raise RecpipeError(msg)
    path = checkpoint_file(root)
    with claim_checkpoint(root, resume=True, overwrite=False):  # no run writes it meanwhile
        state = load_checkpoint(path)
        assert state is not None  # claim_checkpoint(resume=True) refuses a directory without
        layout = _layout(state)
        config, mcfg, schema = _schema_and_config(
            state, dataset=None if dataset is None else os.fspath(dataset), path=path
        )
        world = _world(state, layout)
        bar = progress_bar(total=max(world, 1), unit="part", desc="export", file=sys.stderr,
                           disable=not progress, dynamic_ncols=True)  # fmt: skip
        with bar:
            parts = _read_parts(root, state, layout, bar=bar)
            tower_model = None
            if layout == "towers":
                from trainer.towers.model import model_tables

                plan_features = [f for t in state["layout"]["towers"] for f in t]
                mcfg = replace(mcfg, attention="none")
                mcfg = replace(mcfg, tables=model_tables(schema, mcfg, plan_features))
                tower_model = _tower_model(state["layout"], parts[0]["model"], path=path)
            model = build_model({"tower_model": tower_model}, schema, mcfg)
            initial = {n: t.weight.detach().clone() for n, t in _tables_by_name(model).items()}
            written = _fill(model, state, layout, parts, root=root, path=path)
        step, store = _step(state, layout), str(config.store)
    summary = ExportSummary(checkpoint=str(root), out=os.fspath(out), layout=layout,
                            world_size=world, store=store, step=step)  # fmt: skip
    for name, table in _tables_by_name(model).items():
        same = (table.weight.detach() == initial[name]).all(1)
        summary.tables.append(TableExport(name, table.config.num_embeddings, written.get(name, 0),
                                          int(same.sum())))  # fmt: skip
    doc = {
        "format": EXPORT_FORMAT,
        "format_version": EXPORT_VERSION,
        "model": model.state_dict(),
        "model_config": _plain(asdict(mcfg)),
        "schema": schema.to_toml(),
        "tower_model": tower_model,
        "config": _plain(
            {**state["config"], "dataset": config.dataset, "store": "module", "resume": False}
        ),
        "step": step,
        "dataset_id": state.get("dataset_id"),
        "source": {
            "layout": layout,
            "world_size": world,
            "store": store,
            "checkpoint": str(root.resolve()),
        },
        "tables": {
            t.name: {"rows": t.rows, "saved": t.saved, "initial": t.initial} for t in summary.tables
        },
    }
    summary.bytes = _write(doc, Path(out))
    return summary


def _step(state: dict[str, Any], layout: str) -> int:
    return int(state["step"]) if layout in ("ranks", "towers") else int(state["trainer"]["step"])


def _world(state: dict[str, Any], layout: str) -> int:
    if layout == "ranks":
        return int(state["world_size"])
    return int((state.get("layout") or {}).get("world_size", 1))


def _read_parts(root: Path, state: dict[str, Any], layout: str, *, bar: Any) -> list[Any]:
    """Every rank's part of a multi-rank or towers checkpoint (none for one process)."""
    from trainer.distributed.checkpoint import read_part

    if layout == "local":
        bar.update(1)
        return []
    area, world = ("sparse" if layout == "ranks" else "towers"), _world(state, layout)
    parts = []
    for rank in range(world):
        parts.append(read_part(root, state, area, rank=rank, world_size=world))
        bar.update(1)
    return parts


def _tower_model(layout: dict[str, Any], saved: dict[str, Any], *, path: Path) -> Any:
    """What rebuilds a towers run's model (``None``: pass-through towers, a plain DLRM)."""
    module = layout.get("tower_module")
    weights = sorted(k for k in saved if k.startswith("towers."))
    if not weights or (module is not None and module.get("kind") == "none"):
        return None
    if module is None:
        msg = (
            f"{path}: a towers run with tower modules (its model holds {weights[0]!r}, ...) "
            "written before checkpoints recorded the modules' settings; export a checkpoint "
            "of a newer run, or of pass-through towers (`--tower-module none`)"
        )
        raise RecpipeError(msg)
    return {"plan": [list(t) for t in layout["towers"]], "module": dict(module)}


def _fill(
    model: Any, state: dict[str, Any], layout: str, parts: list[Any], *, root: Path, path: Path
) -> dict[str, int]:
    """Load the checkpoint's weights into ``model``; rows written per table."""
    if layout == "local":
        store = (state.get("config") or {}).get("store", "module")
        trainer = state["trainer"]
        if store == "module":
            _load_dense(model, trainer["model"], path=path)
            return {name: t.config.num_embeddings for name, t in _tables_by_name(model).items()}
        _load_dense(model, _without_store_tables(trainer["model"]), path=path)
        return _rows_from_stores(model, root, step=int(trainer["step"]), path=path)
    if layout == "ranks":
        _load_dense(model, state["trainer"]["model"], path=path)
        if "store_world_size" in state:  # --store hybrid: the rows are in the ranks' stores
            return _rows_from_rank_stores(model, root, state, path=path)
    else:  # towers: the head is every rank's (DDP); tower t is trained on host t's ranks
        _load_dense(model, parts[0]["model"], path=path, skip="towers.")
        per_host = int(state["layout"].get("ranks_per_host") or 1)
        for t in range(len(getattr(model, "towers", ()))):
            saved = parts[0 if len(parts) == 1 else t * per_host]["model"]
            mine = {k.removeprefix(f"towers.{t}."): v for k, v in saved.items()
                    if k.startswith(f"towers.{t}.")}  # fmt: skip
            model.towers[t].load_state_dict(mine)
    if state["layout"].get("store") == "hybrid":  # the rows are in the tower ranks' stores
        return _rows_from_tower_stores(model, root, state, path=path)
    rows = [p["rows"] for p in parts if p.get("rows") is not None]
    return _rows_from_parts(model, rows, path=path)


def _rows_from_tower_stores(
    model: DLRM, root: Path, state: dict[str, Any], *, path: Path
) -> dict[str, int]:
    """Write every table's rows from the store of the one tower rank that holds it
    (``root/store/rank-R-of-W/<table>``), read-only at the checkpoint's step."""
    from recpipe.errors import StoreError
    from trainer.distributed.store_shard import read_owned_rows

    world, step = int(state["layout"]["world_size"]), int(state["step"])
    written = {}
    for name, table in _tables_by_name(model).items():
        found = sorted((root / "store").glob(f"rank-*-of-{world:05d}/{name}/meta.json"))
        if len(found) != 1:
            msg = f"{path}: table {name!r} is in {len(found)} tower ranks' stores under {str(root / 'store')!r}, not 1"
            raise RecpipeError(msg)
        try:
            rows = read_owned_rows(found[0].parent, step=step, rank=0, world_size=1)
        except StoreError as exc:
            raise RecpipeError(f"{path}: {exc}") from None
        written[name] = _place(table, rows["ids"].numpy(), rows["values"], path=path)
    return written


def _without_store_tables(saved: dict[str, Any]) -> dict[str, Any]:
    """A hybrid run's dense model: without its store tables' own entries (their rows are in
    the stores)."""
    return {k: v for k, v in saved.items() if ".bags." not in k}


def _write(doc: dict[str, Any], out: Path) -> int:
    """``torch.save`` of ``doc`` to ``out``, through a temporary file renamed into place."""
    import io

    import torch

    buffer = io.BytesIO()
    torch.save(doc, buffer)  # in memory: a write error is then an OSError naming the file
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        with open(tmp, "wb") as fh:
            fh.write(buffer.getbuffer())
        os.replace(tmp, out)
    except OSError as exc:
        msg = f"`--out` {str(out)!r}: cannot write the export: {exc.strerror or exc}"
        raise RecpipeError(msg) from None
    finally:
        tmp.unlink(missing_ok=True)
    return out.stat().st_size


# -------------------------------------------------------------------------------------------
# reading an export


def load_exported(path: str | os.PathLike[str]) -> tuple[DLRM, dict[str, Any]]:
    """The model of an export (built from the schema and model config it records, in eval
    mode on the CPU) and the export's document."""
    from schemas import parse_schema
    from trainer.predict import _model_config

    doc = read_export(path)
    schema = parse_schema(doc["schema"], source=f"{path} (schema)")
    model = build_model(doc, schema, _model_config(doc["model_config"]))
    model.load_state_dict(doc["model"])
    return model.eval(), doc


# -------------------------------------------------------------------------------------------
# the command


def register_cli(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``recpipe export`` to the top-level parser."""
    parser = subparsers.add_parser(
        "export",
        help="write any checkpoint as one-process model weights",
        description=(
            "Turn a `recpipe train --checkpoint DIR` checkpoint of any layout (one process, "
            "--store module or hybrid; --nproc N ranks; --towers) into one file of "
            "one-process DLRM weights (a TowerDLRM's with tower modules) that `recpipe predict "
            "FILE DATASET` and plain torch load. Every table starts from its initial rows (what an id never trained "
            "reads in every backend) and takes each row the checkpoint holds; a saved id "
            "outside a table's --num-embeddings rows (a --no-hash-ids run) is refused. The "
            "optimizer state is not exported: the file is for scoring, not for resuming. The "
            "model is built for the schema of the dataset the run trained on (--dataset to "
            "read it elsewhere)."
        ),
    )
    parser.add_argument(
        "checkpoint", metavar="CKPT", help="checkpoint directory of `recpipe train`"
    )
    parser.add_argument(
        "--out", metavar="FILE", required=True, help="the file to write (torch.save)"
    )
    parser.add_argument(
        "--dataset", metavar="DIR",
        help="the dataset whose schema the model is built for (default: the run's own)",
    )  # fmt: skip
    add_quiet_option(parser, aliases=())
    parser.set_defaults(func=run)


def format_summary(summary: ExportSummary) -> str:
    """The summary ``recpipe export`` prints."""
    ranks = f", {summary.world_size} ranks" if summary.layout != "local" else ""
    rows = [
        ("checkpoint", f"{summary.checkpoint} (step {summary.step}; {summary.layout}{ranks}, "
                       f"store {summary.store})"),
        ("out", f"{summary.out} ({_size(summary.bytes)}; optimizer state not exported)"),
    ]  # fmt: skip
    for t in summary.tables:
        rows.append((f"  {t.name}", f"{t.rows:,} rows: {t.saved:,} from the checkpoint, "
                                    f"{t.initial:,} at their initial values"))  # fmt: skip
    total = sum(t.rows for t in summary.tables)
    saved = sum(t.saved for t in summary.tables)
    untouched = sum(t.initial for t in summary.tables)
    rows.insert(2, ("tables", f"{len(summary.tables)}: {total:,} rows written, {saved:,} from "
                              f"the checkpoint, {untouched:,} never trained (initial values)"))  # fmt: skip
    width = max(len(k) for k, _ in rows)
    return "recpipe export: done\n" + "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"


def run(args: argparse.Namespace) -> int:
    """``recpipe export``: the exit code."""
    from recpipe.paths import check_outputs

    check_outputs((("--out", args.out, "file"),), inputs=[args.checkpoint])
    summary = export_checkpoint(args.checkpoint, args.out, dataset=args.dataset,
                                progress=not args.quiet)  # fmt: skip
    print(format_summary(summary))
    return 0
