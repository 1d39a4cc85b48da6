"""What the ranks of ``test_towers_adam.py`` run (spawned gloo processes; results go to a JSON
file the test reads): SPTT under ``--optimizer adam`` (the tables' lazy Adam on the rank that
holds them, the tower and head under torch's Adam), and one process on the global batches."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from readers.dataset import dataset_schema
from tests.distributed.dist_cases import rank_batches
from tests.towers.dedup_cases import make_layout, plan_for
from tests.towers.towers_cases import MODEL, MODULES
from trainer.distributed.batches import global_batches
from trainer.distributed.comm import Comm
from trainer.distributed.trainer import DistributedTrainer, sharded_table_factory
from trainer.towers.model import TowerDLRM
from trainer.towers.sptt import SPTTGroups, SPTTTrainer

STEPS = 10
CASES = ("none", "dlrm2")  # pass-through towers, and DLRM tower modules at compression 2


def tower_model(dataset: str, modules: str, hosts: int) -> TowerDLRM:
    factory = sharded_table_factory(optimizer="adam")
    return TowerDLRM.from_schema(dataset_schema(dataset), MODEL, plan=plan_for(dataset, hosts),
                                 towers=MODULES[modules], table_factory=factory)  # fmt: skip


def run_all(rank: int, world_size: int, dataset: str, out: str, per_host: int) -> None:
    """Every case of :data:`CASES` on ``world_size`` ranks, ``per_host`` a host: per-step
    losses, each rank's tables' optimizer step, and (rank 0) one process's losses."""
    torch.manual_seed(0)
    layout = make_layout(dataset, world_size, per_host)
    groups = SPTTGroups.create(layout, timeout_s=60.0)
    results = {}
    for modules in CASES:
        trainer = SPTTTrainer(tower_model(dataset, modules, layout.num_hosts), layout=layout,
                              groups=groups, optimizer="adam")  # fmt: skip
        batches = rank_batches(dataset, rank=rank, world=world_size, dedup=True, steps=STEPS)
        losses = [float(trainer.train_step(b)[0]) for b in batches]
        step = -1 if trainer.sparse is None else trainer.sparse.optimizer_step
        steps = [int(s) for s in groups.world.all_gather(torch.tensor([step]), what="test")]
        if rank != 0:
            continue
        streams = [rank_batches(dataset, rank=r, world=world_size, dedup=True, steps=STEPS)
                   for r in range(world_size)]  # fmt: skip
        one = DistributedTrainer(tower_model(dataset, modules, layout.num_hosts),
                                 comm=Comm.single(), optimizer="adam")  # fmt: skip
        ref = [float(one.train_step(b)[0]) for b in global_batches(streams)]
        results[modules] = {"losses": losses, "reference": ref, "table_steps": steps}
    if rank == 0:
        Path(out, "adam.json").write_text(json.dumps(results))
    dist.barrier()
