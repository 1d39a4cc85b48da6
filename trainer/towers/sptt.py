"""SPTT, DMT's semantic-preserving tower transform, on ``torch.distributed`` subgroups.

Rank ``g`` trains on its micro-batch of B rows; the step's global batch is every rank's, in
rank order. Tower ``t``'s tables live on host ``t`` (:class:`~trainer.towers.layout.SPTTLayout`).
One step, every rank calling the same collectives in the same order::

    1. sparse a2a (world)   each rank sends every feature's ids to the rank holding its table:
                            counts first, then lengths + ids (int64); a dedup group's features
                            go as their unique rows plus the group's [B] inverse lookup (see
                            below). Rank g now holds its features' bags for all G·B rows
                            (sources in rank order)
    2. local lookup         pooled [G·B, n_g, N] (the tables' 2FP exchange on a world of one),
                            a dedup group's bags pooled once per unique row
    3. peer permute         rows reordered by (destination local rank l', peer order of l')
    4. host a2a (host)      chunk l' -> local rank l': every rank of host t now holds all n_t
                            features of tower t for its peers' T·B rows
    5. reshape              (features, peers) -> (peers, features): [T, B, n_t, N]
    6. tower module         [T·B, n_t, N] -> [T·B, k_t, N]                (before leaving the host)
    7. peer a2a (peers)     chunk p -> peer p (the L peer groups at once, T ranks each):
                            rank g now holds every tower's [B, k_t, N] for its own B rows
    8. head (world, DDP)    bottom MLP, dot interaction, top MLP on the rank's B rows

The backward runs 7, 6, 4 in reverse (gradients take the way back), sums the tower module's
gradients over the host's ranks (the only ranks that hold that tower), and updates the local
tables with the pooled rows' gradients of all G·B rows. Only steps 1 and 7 cross hosts; a tower
module with compression r shrinks step 7's bytes (and its gradients') by exactly r.

Dedup survives step 1. A rank's features of a dedup group travel as the unique rows of those
features alone (the group's unique rows deduplicated again on the features the destination
holds, numbered by first occurrence) and their ``[B]`` inverse lookup: the ids on the wire shrink
with the dedup factor. With ``--dedup off`` the ranks send the B plain rows and the destination
deduplicates each source's rows of the same features the same way (the model's dedup groups,
:meth:`~trainer.models.DLRM.set_dedup_groups`), so the two compute the same unique rows, the
same sums and, on the CPU, the same losses bit for bit. Partial groups travel expanded.

``schedule="flat"`` runs the flat model-parallel path instead: steps 1-2, then one world a2a of
the pooled embeddings straight back to the ranks their rows belong to (TorchRec's table-wise
sharding). With pass-through towers both deliver the same pooled numbers, bit for bit.

:class:`Traffic` counts every collective of the schedule: bytes each rank sent to other ranks,
and the part of them that crossed hosts. See ``docs/towers.md``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from recpipe.batch import Batch
from recpipe.errors import RecpipeError
from recpipe.ikjt import InverseKeyedJaggedTensor, PartialInverseKeyedJaggedTensor
from recpipe.jagged import JaggedTensor, KeyedJaggedTensor
from trainer.config import DEFAULT_LR
from trainer.distributed.batches import concat_batches
from trainer.distributed.comm import Comm
from trainer.distributed.dense import global_batch_norms, wrap_ddp
from trainer.distributed.exchange import ShardedEmbeddings
from trainer.distributed.shard import sparse_optimizer
from trainer.distributed.trainer import PendingLosses, evaluate_on_ranks
from trainer.modules import PooledEmbeddings, dedup_batch
from trainer.runlog import EvalResult
from trainer.towers.layout import SPTTLayout
from trainer.towers.model import TowerDLRM
from trainer.train import make_optimizers

__all__ = ["COLLECTIVES", "RoutedIds", "SPTTGroups", "SPTTTrainer", "Schedule", "Traffic"]

Schedule = Literal["sptt", "flat"]

COLLECTIVES: tuple[str, ...] = (
    "sparse_counts",  # 1. sizes of the ids
    "sparse_ids",  # 1. lengths and ids
    "host_a2a",  # 4. pooled embeddings inside a host
    "host_a2a_grad",
    "peer_a2a",  # 7. tower outputs across hosts
    "peer_a2a_grad",
    "flat_a2a",  # the flat path: pooled embeddings to their rows' ranks
    "flat_a2a_grad",
    "tower_grads",  # the tower module's gradient all-reduce (host group)
)
"""The collectives :class:`Traffic` counts, by name."""


# -------------------------------------------------------------------------------------------
# process groups and traffic


@dataclass
class SPTTGroups:
    """The process groups of an SPTT job, as seen by this rank.

    Attributes:
        world: every rank (the sparse ids, the flat path, the loss); its ``dense_group`` is the
            dense head's DDP group.
        host: the ranks of this rank's host (the host all-to-all, the tower's gradients).
        peer: this rank's peers (the peer all-to-all).
        host_ranks, peer_ranks: the global rank of each group rank of ``host`` and ``peer``.
    """

    world: Comm
    host: Comm
    peer: Comm
    host_ranks: list[int]
    peer_ranks: list[int]

    @classmethod
    def create(
        cls,
        layout: SPTTLayout,
        *,
        world: Comm | None = None,
        device: torch.device | str = "cpu",
        timeout_s: float = 300.0,
    ) -> SPTTGroups:
        """Create the groups (collective: every rank of the default group calls it, in the
        same order): one group per host, one per local rank, and, unless ``world`` is given
        (e.g. :func:`trainer.distributed.comm.init_from_env`'s), the world twice (exchange,
        DDP).
        """
        from datetime import timedelta

        if not dist.is_initialized():
            msg = "SPTTGroups.create needs an initialised default process group (torchrun)"
            raise RecpipeError(msg)
        if dist.get_world_size() != layout.world_size:
            msg = f"the job has {dist.get_world_size()} ranks, the layout {layout.world_size}"
            raise RecpipeError(msg)
        rank = dist.get_rank()
        timeout = timedelta(seconds=timeout_s)
        of = {"device": device, "timeout_s": timeout_s}
        if world is None:
            group, dense = dist.new_group(timeout=timeout), dist.new_group(timeout=timeout)
            world = Comm.of(group, dense_group=dense, **of)
        hosts = [dist.new_group(layout.host_ranks(h), timeout=timeout)
                 for h in range(layout.num_hosts)]  # fmt: skip
        peers = [dist.new_group(layout.peers(k), timeout=timeout)
                 for k in range(layout.ranks_per_host)]  # fmt: skip
        host, local = layout.host_of(rank), layout.local_of(rank)
        return cls(
            world=world,
            host=Comm.of(hosts[host], **of),
            peer=Comm.of(peers[local], **of),
            host_ranks=_group_members(hosts[host]),
            peer_ranks=_group_members(peers[local]),
        )

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> SPTTGroups:
        """A job of one rank (one host, one tower): every collective a local copy."""
        one = Comm.single(device)
        return cls(one, one, one, [0], [0])


def _group_members(group: Any) -> list[int]:
    """The global rank of each rank of ``group``, in group-rank order."""
    size = dist.get_world_size(group)
    return [dist.get_global_rank(group, r) for r in range(size)]


@dataclass
class CollectiveTraffic:
    """One collective's traffic from one rank (or summed over ranks).

    Attributes:
        calls: times it ran.
        bytes: bytes sent to other ranks (what stays on the rank is not counted).
        cross_host: of those, bytes sent to ranks on other hosts.
    """

    calls: int = 0
    bytes: int = 0
    cross_host: int = 0


class Traffic:
    """Bytes per collective of an SPTT job (see :data:`COLLECTIVES`), summed over steps.

    Args:
        layout: the job's layout (which ranks share a host).
        rank: this rank.
    """

    def __init__(self, layout: SPTTLayout, rank: int) -> None:
        self.layout, self.rank = layout, rank
        self.by_name = {name: CollectiveTraffic() for name in COLLECTIVES}

    def record(self, name: str, sizes: Sequence[int], ranks: Sequence[int], itemsize: int) -> None:
        """One call of ``name`` that sent ``sizes[i]`` elements to global rank ``ranks[i]``."""
        entry = self.by_name[name]
        entry.calls += 1
        host = self.layout.host_of(self.rank)
        for size, to in zip(sizes, ranks, strict=True):
            if to == self.rank:
                continue
            entry.bytes += int(size) * itemsize
            if self.layout.host_of(to) != host:
                entry.cross_host += int(size) * itemsize

    def as_tensor(self) -> torch.Tensor:
        keys = [f.name for f in fields(CollectiveTraffic)]
        return torch.tensor([[getattr(self.by_name[n], k) for k in keys] for n in COLLECTIVES])

    def merged(self, comm: Comm) -> dict[str, CollectiveTraffic]:
        """Every rank's counts summed (collective): ``{collective: CollectiveTraffic}``."""
        total = comm.all_reduce(self.as_tensor(), what="the traffic counters")
        return {n: CollectiveTraffic(*map(int, row.tolist())) for n, row in zip(COLLECTIVES, total)}

    def reset(self) -> None:
        """Start counting again."""
        self.by_name = {name: CollectiveTraffic() for name in COLLECTIVES}


@dataclass
class RoutedIds:
    """What step 1 sent, to every rank (this one included), summed over calls.

    Attributes:
        rows: bag rows (one per feature and row sent: B per plain feature, the unique rows of
            a dedup group's features).
        ids: the ids of those rows.
        inverse: inverse-lookup entries (B per dedup group and destination).
    """

    rows: int = 0
    ids: int = 0
    inverse: int = 0

    def add(self, other: RoutedIds) -> None:
        self.rows += other.rows
        self.ids += other.ids
        self.inverse += other.inverse


@dataclass(frozen=True)
class _Segment:
    """A run of one destination's features on the wire: B plain rows each (``group`` None),
    or the unique rows of one dedup group's features with their ``[B]`` inverse lookup."""

    keys: tuple[str, ...]
    group: str | None = None


def _segments(batch: Batch, features: Sequence[str]) -> list[_Segment]:
    """How ``features`` travel for ``batch``: the plain ones (and those of partial groups,
    expanded) together, then each dedup group's, in the batch's group order."""
    grouped = {k: name for name, g in batch.ikjts.items()
               if isinstance(g, InverseKeyedJaggedTensor) for k in g.keys()}  # fmt: skip
    out = []
    plain = tuple(f for f in features if f not in grouped)
    if plain:
        out.append(_Segment(plain))
    for name in batch.ikjts:
        keys = tuple(f for f in features if grouped.get(f) == name)
        if keys:
            out.append(_Segment(keys, name))
    return out


def _sub_group(group: InverseKeyedJaggedTensor, keys: Sequence[str]) -> InverseKeyedJaggedTensor:
    """The unique rows of ``keys`` of a dedup group, numbered by first occurrence among the B
    rows, and their ``[B]`` inverse lookup: what deduplicating the group's expanded ``keys``
    gives (:meth:`InverseKeyedJaggedTensor.from_jagged`), computed on its U unique rows."""
    sub = InverseKeyedJaggedTensor.from_jagged({k: group[k] for k in keys})  # over U rows
    inverse = sub.inverse_lookup[group.inverse_lookup]  # (B,) into the sub's rows
    rows, n = inverse.numel(), sub.num_unique
    first = torch.full((n,), rows, dtype=torch.int64, device=inverse.device)
    first.scatter_reduce_(0, inverse, torch.arange(rows, device=inverse.device), "amin")
    order = torch.argsort(first)
    if torch.equal(order, torch.arange(n, device=order.device)):
        return InverseKeyedJaggedTensor.from_unique(sub.unique, inverse, validate=False)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(n, device=order.device)
    return InverseKeyedJaggedTensor.from_unique(
        sub.unique.index_select(order, validate=False), rank[inverse], validate=False
    )


def _sparse_only(
    kjt: KeyedJaggedTensor, groups: dict[str, Any], rows: int, device: torch.device
) -> Batch:
    """A Batch of sparse features alone (no dense features, zero labels)."""
    return Batch(
        dense=torch.zeros(rows, 0, device=device),
        labels=torch.zeros(rows, device=device),
        kjt=kjt,
        ikjts=groups,
    )


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of a flat tensor (``send[i]`` elements to group rank ``i``);
    backward sends the gradients back the same way (the sizes swapped). The zero-size
    ``anchor`` requires grad, so every rank runs the backward collective even when its own
    part of the input needs no gradient."""

    @staticmethod
    def forward(ctx, anchor, x, route, send, recv, names):
        comm, ranks, traffic = route
        ctx.route, ctx.send, ctx.recv, ctx.names = route, send, recv, names
        traffic.record(names[0], send, ranks, x.element_size())
        return comm.all_to_all(x, send, recv, what=f"the {names[0]}")

    @staticmethod
    def backward(ctx, grad):
        comm, ranks, traffic = ctx.route
        traffic.record(ctx.names[1], ctx.recv, ranks, grad.element_size())
        back = comm.all_to_all(grad.contiguous(), ctx.recv, ctx.send, what=f"the {ctx.names[1]}")
        return None, back, None, None, None, None


class _Head(nn.Module):
    """The dense head of a :class:`TowerDLRM` alone (bottom MLP, batch norm, top MLP), for DDP
    on every rank: the towers' and tables' parameters stay out of it."""

    def __init__(self, model: TowerDLRM) -> None:
        super().__init__()
        self.bottom, self.dense_norm, self.top = model.bottom, model.dense_norm, model.top
        self._model = [model]  # not a submodule

    def forward(self, dense: torch.Tensor, outputs: list[torch.Tensor]) -> torch.Tensor:
        return self._model[0].head(dense, outputs)


# -------------------------------------------------------------------------------------------
# the trainer


class SPTTTrainer:
    """One rank of an SPTT job: its tables, its host's tower module, the dense head under DDP.

    Args:
        model: a :class:`TowerDLRM` built with
            :func:`trainer.distributed.sharded_table_factory` tables (every rank builds the
            whole model with the same seed; each uses its tables, its tower, the head).
        layout: the job's layout.
        groups: the job's process groups (:meth:`SPTTGroups.create`).
        optimizer: ``"sgd"``, ``"adagrad"`` (row-wise for the tables) or ``"adam"``
            (``SparseAdam``'s lazy Adam for the tables).
        lr: learning rate (default per optimizer).
        device: where the model runs.
        schedule: ``"sptt"``, or ``"flat"`` (pass-through towers only).
    """

    def __init__(
        self,
        model: TowerDLRM,
        *,
        layout: SPTTLayout,
        groups: SPTTGroups,
        optimizer: Literal["sgd", "adagrad", "adam"] = "adagrad",
        lr: float | None = None,
        device: torch.device | str = "cpu",
        schedule: Schedule = "sptt",
    ) -> None:
        if schedule not in ("sptt", "flat"):
            msg = f"`schedule` must be 'sptt' or 'flat', got {schedule!r}"
            raise RecpipeError(msg)
        if schedule == "flat" and not model.passthrough:
            msg = "`schedule` 'flat' moves pooled embeddings: it needs pass-through towers"
            raise RecpipeError(msg)
        if optimizer not in ("sgd", "adagrad", "adam"):
            msg = f"`optimizer` must be 'sgd', 'adagrad' or 'adam' with towers, got {optimizer!r}"
            raise RecpipeError(msg)
        self.layout, self.groups, self.schedule = layout, groups, schedule
        self.rank = groups.world.rank
        self.device = torch.device(device)
        self.lr = DEFAULT_LR[optimizer] if lr is None else float(lr)
        self.model = model.to(self.device)
        global_batch_norms(self.model, groups.world)
        self._head = _Head(self.model)
        self.head = wrap_ddp(self._head, groups.world, device=self.device)
        self.tower_index = layout.host_of(self.rank)
        self.tower = self.model.towers[self.tower_index]
        self.features = layout.features_of(self.rank)
        self.local: PooledEmbeddings | None = None
        self.sparse: ShardedEmbeddings | None = None
        tables = layout.tables_of(self.rank)
        if tables:
            mine = self.model.ebc.tables
            self.local = PooledEmbeddings(tables, table_factory=lambda cfg, _seed: mine[cfg.name])
            self.sparse = ShardedEmbeddings(self.local, comm=Comm.single(self.device),
                                            optimizer=sparse_optimizer(optimizer, self.lr),
                                            count_steps=0)  # fmt: skip
        self.optimizers = make_optimizers(self._head, optimizer, lr=self.lr)
        if any(p.requires_grad for p in self.tower.parameters()):
            self.optimizers += make_optimizers(self.tower, optimizer, lr=self.lr)
        self.traffic = Traffic(layout, self.rank)
        self.routed = RoutedIds()  # what step 1 sent in training steps
        self.last_routed = RoutedIds()  # ... in the last route_sparse call
        # the model's dedup groups on this rank's features: a plain batch's rows of them are
        # deduplicated on arrival, as a deduplicated batch's travel (see the module docstring)
        self.dedup_groups = tuple(
            keys for g in self.model.dedup_groups
            if (keys := tuple(f for f in self.features if f in g))
        )  # fmt: skip
        self._anchor = torch.zeros(0, requires_grad=True)
        self.step = 0
        self._pending = PendingLosses()
        self._perm: dict[int, torch.Tensor] = {}

    # -- the schedule ----------------------------------------------------------------------------
    def _all_to_all(self, x: torch.Tensor, comm: Comm, ranks: list[int], send: list[int],
                    recv: list[int], name: str) -> torch.Tensor:  # fmt: skip
        route = (comm, ranks, self.traffic)
        return _AllToAll.apply(self._anchor, x, route, send, recv, (name, f"{name}_grad"))

    def route_sparse(self, batch: Batch) -> Batch:
        """Step 1: this rank's features' bags for the global batch (``G·B`` rows, sources in
        rank order), from every rank's micro-batch: a sparse-only :class:`Batch` whose dedup
        groups hold the unique rows of this rank's features of each group (of the model's
        dedup groups too when the ranks read plain batches). :attr:`last_routed` counts what
        this rank sent."""
        world, layout, rows = self.groups.world, self.layout, batch.batch_size
        partial = [
            g for g in batch.ikjts.values() if isinstance(g, PartialInverseKeyedJaggedTensor)
        ]
        plain = (
            KeyedJaggedTensor.concat([batch.kjt, *(g.to_kjt() for g in partial)])
            if partial
            else batch.kjt
        )
        sent = RoutedIds()
        parts, counts = [], []
        for dest in range(layout.world_size):
            pieces: list[torch.Tensor] = []
            for seg in _segments(batch, layout.features_of(dest)):
                if seg.group is None:
                    sub, head = plain.select(seg.keys), []
                else:
                    group = _sub_group(batch.ikjts[seg.group], seg.keys)  # type: ignore[arg-type]
                    sub = group.unique
                    u = torch.tensor([group.num_unique], device=group.inverse_lookup.device)
                    head = [u, group.inverse_lookup]
                    sent.inverse += rows
                pieces += [*head, sub.lengths(), sub.values()]
                sent.rows += sub.lengths().numel()
                sent.ids += sub.values().numel()
            payload = torch.cat([p.to(torch.int64) for p in pieces]) if pieces else (
                torch.zeros(0, dtype=torch.int64, device=batch.dense.device))  # fmt: skip
            parts.append(payload)
            counts.append(payload.numel())
        self.last_routed = sent
        ranks = list(range(layout.world_size))
        self.traffic.record("sparse_counts", [1] * len(ranks), ranks, 8)
        got_counts = world.all_to_all_counts(
            torch.tensor(counts, dtype=torch.int64).unsqueeze(1), what="the sparse ids' counts"
        ).squeeze(1)
        recv = [int(c) for c in got_counts.tolist()]
        self.traffic.record("sparse_ids", counts, ranks, 8)
        got = world.all_to_all(torch.cat(parts), counts, recv, what="the sparse ids")
        segments = _segments(batch, self.features)
        sources = [self._source_bags(chunk, segments, rows=rows, source=s)
                   for s, chunk in enumerate(got.split(recv))]  # fmt: skip
        return concat_batches(sources)

    def _source_bags(
        self, chunk: torch.Tensor, segments: Sequence[_Segment], *, rows: int, source: int
    ) -> Batch:
        """This rank's features from one source's chunk (per segment: for a dedup group the
        unique rows U and the ``[B]`` inverse, then lengths, then ids, key-major), the plain
        rows of the model's dedup groups deduplicated (:func:`~trainer.modules.dedup_batch`)."""
        at, plain, groups = 0, {}, {}
        for seg in segments:
            n, inverse = len(seg.keys), None
            count = rows
            if seg.group is not None:
                count = int(chunk[at])
                inverse = chunk[at + 1 : at + 1 + rows]
                at += 1 + rows
            lens = chunk[at : at + n * count].view(n, count)
            at += n * count
            sizes = lens.sum(1).tolist()
            values = chunk[at : at + sum(sizes)].split(sizes)
            at += sum(sizes)
            jagged = {
                k: JaggedTensor.from_lengths(v, ln, validate=False)
                for k, v, ln in zip(seg.keys, values, lens, strict=True)
            }
            if inverse is None:
                plain.update(jagged)
            else:
                unique = KeyedJaggedTensor.from_jagged_dict(jagged, stride=count)
                groups[seg.group] = InverseKeyedJaggedTensor.from_unique(
                    unique, inverse, validate=False
                )
        if at != chunk.numel():
            msg = (
                f"rank {source} sent {chunk.numel()} sparse values, rank {self.rank} read "
                f"{at}: the ranks' batches differ in their features or dedup groups"
            )
            raise RecpipeError(msg)
        kjt = KeyedJaggedTensor.from_jagged_dict(plain, stride=rows)
        bags = _sparse_only(kjt, groups, rows, chunk.device)
        return dedup_batch(bags, self.dedup_groups) if self.dedup_groups else bags

    def lookup(self, bags: Batch, *, train: bool) -> torch.Tensor:
        """Step 2: the pooled ``[G·B, n_g, N]`` embeddings of this rank's features (a dedup
        group's pooled once per unique row, then expanded by its inverse lookup)."""
        rows, dim = bags.batch_size, self.model.config.embedding_dim
        if self.local is None or self.sparse is None:
            return torch.zeros(rows, 0, dim, device=self.device)
        bags = self.sparse.prepare(bags, train=train)  # with its id plan
        pooled = self.local(bags)
        return torch.stack([pooled[f] for f in self.features], dim=1)  # (G·B, n_g, N)

    def _peer_permute(self, rows: int) -> torch.Tensor:
        """Step 3's row order: for each local rank l', its peers' rows in peer order."""
        if rows not in self._perm:
            layout = self.layout
            order = [s * rows + i for k in range(layout.ranks_per_host)
                     for s in layout.peers(k) for i in range(rows)]  # fmt: skip
            self._perm[rows] = torch.tensor(order, dtype=torch.int64, device=self.device)
        return self._perm[rows]

    def exchange(self, pooled: torch.Tensor, *, rows: int) -> list[torch.Tensor]:
        """Steps 3-7 (or the flat path): every tower's ``[B, k_t, N]`` output for this rank's
        ``rows`` rows."""
        if self.schedule == "flat":
            return self._flat(pooled, rows=rows)
        layout, groups = self.layout, self.groups
        towers, dim = layout.num_hosts, self.model.config.embedding_dim
        x = pooled.index_select(0, self._peer_permute(rows))  # (L·T·B, n_g, N)
        width = towers * rows * dim
        send = [width * len(self.features)] * layout.ranks_per_host
        recv = [width * len(layout.features_of(g)) for g in groups.host_ranks]
        y = self._all_to_all(x.reshape(-1), groups.host, groups.host_ranks, send, recv, "host_a2a")
        parts = [p.view(towers, rows, -1, dim) for p in y.split(recv)]  # (T, B, n_l, N) each
        z = torch.cat(parts, dim=2)  # (features, peers) -> (peers, features): (T, B, n_t, N)
        n_t = z.shape[2]
        out = self.tower(z.reshape(towers * rows, n_t, dim))  # (T·B, k_t, N)
        k = out.shape[1]
        by_peer = out.reshape(towers, rows * k * dim)  # row p: peer p's rows (peer order)
        peers = layout.peers(layout.local_of(self.rank))
        order = torch.tensor([peers.index(g) for g in groups.peer_ranks], device=self.device)
        flat = by_peer.index_select(0, order).reshape(-1)  # in group-rank order
        vectors = [self.model.vectors[layout.host_of(g)] for g in groups.peer_ranks]
        send = [rows * k * dim] * len(peers)
        recv = [rows * v * dim for v in vectors]
        w = self._all_to_all(flat, groups.peer, groups.peer_ranks, send, recv, "peer_a2a")
        got = {layout.host_of(g): p.view(rows, v, dim)
               for g, p, v in zip(groups.peer_ranks, w.split(recv), vectors, strict=True)}  # fmt: skip
        return [got[t] for t in range(towers)]

    def _flat(self, pooled: torch.Tensor, *, rows: int) -> list[torch.Tensor]:
        """The flat path: each source rank's rows of the pooled embeddings back to it."""
        layout, world = self.layout, self.groups.world
        dim = self.model.config.embedding_dim
        ranks = list(range(layout.world_size))
        send = [rows * len(self.features) * dim] * layout.world_size
        recv = [rows * len(layout.features_of(g)) * dim for g in ranks]
        y = self._all_to_all(pooled.reshape(-1), world, ranks, send, recv, "flat_a2a")
        pooled_by_feature = {}
        for g, part in zip(ranks, y.split(recv), strict=True):
            feats = layout.features_of(g)
            view = part.view(rows, len(feats), dim)  # (B, n_g, N)
            pooled_by_feature.update({f: view[:, j] for j, f in enumerate(feats)})
        return [self.model.tower_input(pooled_by_feature, t) for t in range(layout.num_hosts)]

    def forward(self, batch: Batch, *, train: bool) -> torch.Tensor:
        """The ``[B]`` logits of this rank's micro-batch (collective)."""
        bags = self.route_sparse(batch)
        pooled = self.lookup(bags, train=train)
        outputs = self.exchange(pooled, rows=batch.batch_size)
        return (self.head if train else self._head)(batch.dense, outputs)

    # -- training ---------------------------------------------------------------------------------
    def _sync_tower_grads(self) -> None:
        """Sum the tower module's gradients over the host's ranks (the ranks holding it)."""
        params = [p for p in self.tower.parameters() if p.requires_grad]
        if not params:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        host = self.groups.host
        self.traffic.record("tower_grads", [flat.numel()] * host.world_size, self.groups.host_ranks,
                            flat.element_size())  # fmt: skip
        host.all_reduce(flat, what="the tower module's gradient all-reduce")
        at = 0
        for p in params:
            p.grad = flat[at : at + p.numel()].view_as(p).clone()
            at += p.numel()

    def train_step(
        self, batch: Batch, *, reduce_loss: bool = True
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """One step on this rank's micro-batch (collective); returns the global batch's mean
        loss (``None`` with ``reduce_loss=False``, see :meth:`pending_losses`) and this rank's
        logits."""
        self.model.train()
        batch = batch.to(self.device, non_blocking=True)
        global_rows = batch.batch_size * self.layout.world_size
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        logits = self.forward(batch, train=True)
        self.routed.add(self.last_routed)
        loss_sum = F.binary_cross_entropy_with_logits(
            logits, batch.labels.to(logits.dtype), reduction="sum"
        )
        (loss_sum / global_rows).backward()
        self._sync_tower_grads()
        for opt in self.optimizers:
            opt.step()
        if self.sparse is not None:
            self.sparse.step()
        self.step += 1
        self._pending.add(loss_sum, global_rows)
        if not reduce_loss:
            return None, logits.detach()
        return torch.tensor(self.pending_losses()[-1]), logits.detach()

    def pending_losses(self) -> list[float]:
        """The global mean losses of the steps since the last call, in order (collective)."""
        return self._pending.reduce(self.groups.world)

    def evaluate(self, batches: Iterable[Batch], *, max_batches: int | None = None) -> EvalResult:
        """Loss and AUC over every rank's ``batches`` (collective: every rank brings the same
        number of batches of the same size)."""
        self.model.eval()
        return evaluate_on_ranks(
            lambda batch: self.forward(batch, train=False),
            batches,
            comm=self.groups.world,
            device=self.device,
            max_batches=max_batches,
        )
