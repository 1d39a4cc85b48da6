"""What the ranks of the tower tests run (4 spawned processes: 2 "hosts" x 2 ranks); results
go to a JSON file the tests read. Every rank computes the references itself, in the same job: one
process on the concatenated global batches (``DistributedTrainer`` with a world of one)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from readers.dataset import dataset_schema
from tests.distributed.dist_cases import rank_batches as _rank_batches
from tests.distributed.dist_cases import relative
from trainer.config import ModelConfig
from trainer.distributed.batches import global_batches
from trainer.distributed.comm import Comm
from trainer.distributed.trainer import DistributedTrainer, sharded_table_factory
from trainer.models import DLRM, default_tables
from trainer.towers.config import TowerModuleConfig, TowerPlan
from trainer.towers.layout import SPTTLayout
from trainer.towers.model import TowerDLRM
from trainer.towers.sptt import SPTTGroups, SPTTTrainer

WORLD, PER_HOST = 4, 2
STEPS = 3
MODEL = ModelConfig(embedding_dim=8, num_embeddings=1000, bottom_mlp=(16,), top_mlp=(16,),
                    attention="none")  # fmt: skip
MODULES = {
    "none": TowerModuleConfig(),
    "dlrm2": TowerModuleConfig("dlrm", compression=2),
    "dlrm3": TowerModuleConfig("dlrm", compression=3),
    "dcn2": TowerModuleConfig("dcn", compression=2, cross_layers=1),
}

TOWER_CASES = (
    ("dlrm2", "dlrm2", torch.float32),
    ("dcn2", "dcn2", torch.float32),
    ("dcn2_float64", "dcn2", torch.float64),
)


def plan_for(dataset: str) -> TowerPlan:
    """Two towers of the dataset's sparse features, strided (6 + 6 for the default synth)."""
    return TowerPlan.strided(dataset_schema(dataset).sparse_names, WORLD // PER_HOST)


def batches(dataset: str, rank: int) -> list:
    return _rank_batches(dataset, rank=rank, world=WORLD, dedup=True, steps=STEPS)


def tower_model(
    dataset: str, modules: str, opt: str, dtype: torch.dtype = torch.float32
) -> TowerDLRM:
    schema = dataset_schema(dataset)
    factory = sharded_table_factory(optimizer=opt, dtype=dtype)
    return TowerDLRM.from_schema(schema, MODEL, plan=plan_for(dataset), towers=MODULES[modules],
                                 table_factory=factory).to(dtype)  # fmt: skip


def sptt(dataset: str, groups: SPTTGroups, *, modules: str = "none", schedule: str = "sptt",
         opt: str = "adagrad", dtype: torch.dtype = torch.float32) -> SPTTTrainer:  # fmt: skip
    schema = dataset_schema(dataset)
    layout = SPTTLayout(plan_for(dataset), default_tables(schema, MODEL), WORLD, PER_HOST)
    return SPTTTrainer(tower_model(dataset, modules, opt, dtype), layout=layout, groups=groups,
                       optimizer=opt, schedule=schedule)  # fmt: skip


def delivered(trainer: SPTTTrainer, batch) -> list[torch.Tensor]:
    """Every tower's output for this rank's rows, as the schedule delivers it."""
    trainer.model.eval()
    with torch.no_grad():
        bags = trainer.route_sparse(batch)
        pooled = trainer.lookup(bags, train=False)
        return [t.clone() for t in trainer.exchange(pooled, rows=batch.batch_size)]


def equal_everywhere(comm: Comm, flag: bool) -> bool:
    t = torch.tensor([0 if flag else 1])
    comm.all_reduce(t, what="test")
    return int(t.item()) == 0


def case_outputs(groups: SPTTGroups, dataset: str, rank: int) -> dict:
    """SPTT with pass-through towers, the flat table-wise path and the 2FP exchange (issue
    14's trainer on a DLRM) on the same micro-batches: outputs bitwise, losses."""
    mine = batches(dataset, rank)
    runs = {"sptt": sptt(dataset, groups), "flat": sptt(dataset, groups, schedule="flat")}
    schema = dataset_schema(dataset)
    dlrm = DLRM.from_schema(schema, MODEL, table_factory=sharded_table_factory(optimizer="adagrad"))
    twofp = DistributedTrainer(dlrm, comm=groups.world, optimizer="adagrad")
    same_delivery = all(
        torch.equal(a, b)
        for a, b in zip(delivered(runs["sptt"], mine[0]), delivered(runs["flat"], mine[0]))
    )
    losses: dict[str, list[float]] = {}
    logits: dict[str, list[torch.Tensor]] = {}
    for name, trainer in (*runs.items(), ("2fp", twofp)):
        steps = [trainer.train_step(b) for b in mine]
        losses[name] = [float(loss) for loss, _ in steps]
        logits[name] = [lg for _, lg in steps]
    first = [logits[name][0] for name in ("sptt", "flat", "2fp")]
    same_logits = all(torch.equal(first[0], other) for other in first[1:])
    return {
        "delivery_bitwise": equal_everywhere(groups.world, same_delivery),
        "logits_bitwise": equal_everywhere(groups.world, same_logits),
        "losses": losses,
    }


def case_traffic(groups: SPTTGroups, dataset: str, rank: int) -> dict:
    """One training step per tower config: every collective's bytes, summed over ranks."""
    mine = batches(dataset, rank)
    out = {}
    for name in ("none", "dlrm2", "dlrm3", "dcn2"):
        trainer = sptt(dataset, groups, modules=name)
        trainer.train_step(mine[0])
        merged = trainer.traffic.merged(groups.world)
        out[name] = {k: vars(v) for k, v in merged.items()}
    flat = sptt(dataset, groups, schedule="flat")
    flat.train_step(mine[0])
    out["flat"] = {k: vars(v) for k, v in flat.traffic.merged(groups.world).items()}
    return out


def case_towers(groups: SPTTGroups, dataset: str, rank: int, refs: dict) -> dict:
    """SPTT with tower modules against one process on the global batches: losses, and the
    tower modules' parameters (equal on the ranks of a host, as one process computes them);
    in float32 and, to show that only rounding differs, in float64."""
    out = {}
    for key, name, dtype in TOWER_CASES:
        trainer = sptt(dataset, groups, modules=name, dtype=dtype)
        losses = [float(trainer.train_step(b)[0]) for b in batches(dataset, rank)]
        params = torch.cat([p.detach().reshape(-1) for p in trainer.tower.parameters()])
        every = groups.host.all_gather(params, what="test")
        same_on_host = all(torch.equal(every[0], p) for p in every)
        ref = refs.get(key)
        if ref is None:
            ref = refs[key] = reference_towers(dataset, name, dtype)
        ref_params = ref["towers"][trainer.tower_index]
        out[key] = {
            "losses": losses,
            "reference": ref["losses"],
            "same_on_host": equal_everywhere(groups.world, same_on_host),
            "param_dev": relative(params, ref_params),
        }
        devs = groups.world.all_gather(torch.tensor([out[key]["param_dev"]]), what="test")
        out[key]["param_dev"] = max(float(d) for d in devs)
    return out


def reference_towers(dataset: str, modules: str, dtype: torch.dtype) -> dict:
    """One process on the global batches of the 4-rank job."""
    streams = [batches(dataset, r) for r in range(WORLD)]
    model = tower_model(dataset, modules, "adagrad", dtype)
    trainer = DistributedTrainer(model, comm=Comm.single(), optimizer="adagrad")
    losses = [float(trainer.train_step(b)[0]) for b in global_batches(streams)]
    towers = [torch.cat([p.detach().reshape(-1) for p in m.parameters()]) for m in model.towers]
    return {"losses": losses, "towers": towers}


def run_all(rank: int, world_size: int, dataset: str, out: str) -> None:
    """Every case, in one job of 4 processes."""
    torch.manual_seed(0)
    schema = dataset_schema(dataset)
    layout = SPTTLayout(plan_for(dataset), default_tables(schema, MODEL), WORLD, PER_HOST)
    groups = SPTTGroups.create(layout, timeout_s=60.0)
    refs: dict = {}
    results = {
        "outputs": case_outputs(groups, dataset, rank),
        "traffic": case_traffic(groups, dataset, rank),
        "towers": case_towers(groups, dataset, rank, refs),
    }
    if rank == 0:
        Path(out, "towers.json").write_text(json.dumps(results))
    dist.barrier()
