"""What the ranks of the towers' dedup tests run (spawned gloo processes; results go to a JSON
file the tests read): SPTT with ``--dedup on`` batches (IKJTs) and ``--dedup off`` batches
(plain) on the same rows, the ids the sparse all-to-all sends, and one process's reference on
the global batches. The job's layout comes in as (world size, ranks per host)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from readers.dataset import dataset_schema
from recpipe.ikjt import InverseKeyedJaggedTensor
from tests.distributed.dist_cases import rank_batches
from tests.towers.towers_cases import MODEL, MODULES
from trainer.distributed.batches import global_batches
from trainer.distributed.comm import Comm
from trainer.distributed.trainer import DistributedTrainer, sharded_table_factory
from trainer.models import default_tables
from trainer.towers.config import TowerPlan
from trainer.towers.layout import SPTTLayout
from trainer.towers.model import TowerDLRM
from trainer.towers.sptt import SPTTGroups, SPTTTrainer

STEPS = 3
CASES = ("none", "dlrm2")  # pass-through towers, and DLRM tower modules at compression 2


def plan_for(dataset: str, hosts: int) -> TowerPlan:
    return TowerPlan.strided(dataset_schema(dataset).sparse_names, hosts)


def tower_model(dataset: str, modules: str, hosts: int) -> TowerDLRM:
    factory = sharded_table_factory(optimizer="adagrad")
    return TowerDLRM.from_schema(dataset_schema(dataset), MODEL, plan=plan_for(dataset, hosts),
                                 towers=MODULES[modules], table_factory=factory)  # fmt: skip


def make_layout(dataset: str, world: int, per_host: int) -> SPTTLayout:
    schema = dataset_schema(dataset)
    return SPTTLayout(plan_for(dataset, world // per_host), default_tables(schema, MODEL),
                      world, per_host)  # fmt: skip


def sptt(dataset: str, layout: SPTTLayout, groups: SPTTGroups, modules: str) -> SPTTTrainer:
    model = tower_model(dataset, modules, layout.num_hosts)
    return SPTTTrainer(model, layout=layout, groups=groups, optimizer="adagrad")


def expected_ids(plain_batch: Any, layout: SPTTLayout, dedup_groups: list) -> int:
    """The ids of the unique rows of every destination's features of every dedup group (each
    group's features a destination holds deduplicated on the B plain rows), plus the plain
    features' ids: what a deduplicated batch's sparse all-to-all must send."""
    kjt = plain_batch.kjt
    total = 0
    for dest in range(layout.world_size):
        features = layout.features_of(dest)
        grouped = set()
        for group in dedup_groups:
            keys = [f for f in features if f in group]
            if keys:
                ikjt = InverseKeyedJaggedTensor.from_jagged({k: kjt[k] for k in keys})
                total += ikjt.values().numel()
                grouped.update(keys)
        total += sum(kjt[f].values().numel() for f in features if f not in grouped)
    return total


def counting(comm: Comm) -> list[list[int]]:
    """Instrument ``comm``'s all-to-all: every call's send sizes (elements per rank)."""
    calls: list[list[int]] = []
    inner = comm.all_to_all

    def all_to_all(x: torch.Tensor, send: list[int], recv: list[int], **kw: Any) -> torch.Tensor:
        assert x.numel() == sum(send)
        calls.append(list(send))
        return inner(x, send, recv, **kw)

    comm.all_to_all = all_to_all  # type: ignore[method-assign]
    return calls


def case_ids(dataset: str, layout: SPTTLayout, groups: SPTTGroups, rank: int) -> dict:
    """What one step's sparse all-to-all sends from this rank, dedup on and off."""
    world = layout.world_size
    on = rank_batches(dataset, rank=rank, world=world, dedup=True, steps=STEPS)[0]
    off = rank_batches(dataset, rank=rank, world=world, dedup=False, steps=STEPS)[0]
    trainer = sptt(dataset, layout, groups, "none")
    calls = counting(groups.world)  # the world group carries the sparse all-to-all
    out: dict[str, Any] = {
        "plain_ids": off.kjt.values().numel(),
        "ikjt_ids": on.kjt.values().numel() + sum(g.values().numel() for g in on.ikjts.values()),
        "expected_on": expected_ids(off, layout, dataset_schema(dataset).dedup_groups),
        "rows": off.batch_size,
        "groups": len(on.ikjts),
    }
    for name, batch in (("on", on), ("off", off)):
        del calls[:]
        bags = trainer.route_sparse(batch)
        routed = trainer.last_routed
        headers = sum(1 for d in range(world) for _ in _group_segments(batch, layout, d))
        out[name] = {
            "ids": routed.ids,
            "rows": routed.rows,
            "inverse": routed.inverse,
            "headers": headers,
            "sent": sum(calls[0]),
            "bag_rows": bags.batch_size,
        }
    comm_restore(groups.world)
    return out


def _group_segments(batch: Any, layout: SPTTLayout, dest: int) -> list[str]:
    features = layout.features_of(dest)
    return [name for name, g in batch.ikjts.items() if any(f in g.keys() for f in features)]


def comm_restore(comm: Comm) -> None:
    if "all_to_all" in vars(comm):
        del comm.all_to_all  # type: ignore[attr-defined]


def _params(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([torch.zeros(0), *(p.detach().reshape(-1) for p in module.parameters())])


def _rows(trainer: SPTTTrainer) -> torch.Tensor:
    """This rank's tables' rows and optimizer state, in id order."""
    if trainer.sparse is None:
        return torch.zeros(0)
    parts = [torch.zeros(0)]
    for table in trainer.sparse.owned_rows().values():
        parts += [table["ids"].to(torch.float64), table["values"].reshape(-1).double()]
        if table["state"] is not None:
            parts.append(table["state"].reshape(-1).double())
    return torch.cat(parts)


def case_losses(dataset: str, layout: SPTTLayout, groups: SPTTGroups, rank: int) -> dict:
    """Per-step losses, logits, tower and head parameters, table rows and their optimizer
    state with dedup on and off (bitwise), and one process's losses on the global batches."""
    world, out = layout.world_size, {}
    for modules in CASES:
        got: dict[str, Any] = {}
        for name, dedup in (("on", True), ("off", False)):
            trainer = sptt(dataset, layout, groups, modules)
            steps = [trainer.train_step(b)
                     for b in rank_batches(dataset, rank=rank, world=world, dedup=dedup,
                                           steps=STEPS)]  # fmt: skip
            got[name] = {
                "losses": [float(loss) for loss, _ in steps],
                "logits": torch.cat([lg for _, lg in steps]),
                "tower": _params(trainer.tower),
                "head": _params(trainer._head),
                "rows": _rows(trainer),
                "routed_ids": trainer.routed.ids,
            }
        same = (
            got["on"]["losses"] == got["off"]["losses"]
            and torch.equal(got["on"]["logits"], got["off"]["logits"])
            and torch.equal(got["on"]["tower"], got["off"]["tower"])
            and torch.equal(got["on"]["head"], got["off"]["head"])
            and torch.equal(got["on"]["rows"], got["off"]["rows"])
        )
        flag = torch.tensor([0 if same else 1])
        groups.world.all_reduce(flag, what="test")
        ref = {d: reference(dataset, layout, modules, dedup=d) for d in (True, False)}
        out[modules] = {
            "on": got["on"]["losses"],
            "off": got["off"]["losses"],
            "bitwise": int(flag.item()) == 0,
            "routed_on": got["on"]["routed_ids"],
            "routed_off": got["off"]["routed_ids"],
            "reference_on": ref[True],
            "reference_off": ref[False],
        }
    return out


def reference(dataset: str, layout: SPTTLayout, modules: str, *, dedup: bool) -> list[float]:
    """One process on the global batches of the job."""
    streams = [rank_batches(dataset, rank=r, world=layout.world_size, dedup=dedup, steps=STEPS)
               for r in range(layout.world_size)]  # fmt: skip
    model = tower_model(dataset, modules, layout.num_hosts)
    trainer = DistributedTrainer(model, comm=Comm.single(), optimizer="adagrad")
    return [float(trainer.train_step(b)[0]) for b in global_batches(streams)]


def run_all(rank: int, world_size: int, dataset: str, out: str, per_host: int) -> None:
    """Every case in one job of ``world_size`` processes, ``per_host`` ranks per host."""
    torch.manual_seed(0)
    layout = make_layout(dataset, world_size, per_host)
    groups = SPTTGroups.create(layout, timeout_s=60.0)
    ids = gather_json(groups.world, case_ids(dataset, layout, groups, rank))
    results = {"ids": ids, "losses": case_losses(dataset, layout, groups, rank)}
    if rank == 0:
        Path(out, "dedup.json").write_text(json.dumps(results))
    dist.barrier()


def gather_json(comm: Comm, value: dict) -> list[dict]:
    """Every rank's ``value``, in rank order (collective on the default group)."""
    gathered: list[Any] = [None] * comm.world_size
    dist.all_gather_object(gathered, value)
    return gathered
