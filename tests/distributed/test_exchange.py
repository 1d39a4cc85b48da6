"""The exchange's pieces in one process: owners, row shards, the cost model, global batches, the
global batch norm, and the one-process path against the single-process store trainer."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from readers.ranks import RankBatchDataset
from readers.source import ReaderConfig
from recpipe.errors import RecpipeError
from trainer.config import TrainConfig
from trainer.distributed import costs
from trainer.distributed.batches import concat_batches, global_batches
from trainer.distributed.comm import Comm
from trainer.distributed.costs import CostFit, LineFit, choose_num_hot, fit_costs
from trainer.distributed.dense import GlobalBatchNorm
from trainer.distributed.exchange import HotCandidates
from trainer.distributed.run import DistributedConfig, check_config
from trainer.distributed.shard import RowShard, SparseOptimizer, owner_of
from trainer.distributed.trainer import DistributedTrainer, sharded_table_factory
from trainer.models import DLRM, ModelConfig

MODEL = ModelConfig(
    embedding_dim=8, num_embeddings=1000, bottom_mlp=(16,), top_mlp=(16,), attention_heads=2
)


def _batches(dataset, *, world=1, rank=0, count=3, dedup=True):
    ds = RankBatchDataset(
        str(dataset), config=ReaderConfig(batch_size=48, shuffle=True, seed=2), dedup=dedup,
        rank=rank, world_size=world,
    )  # fmt: skip
    return [b for _, b in zip(range(count), ds, strict=False)]


# -- owners and shards ----------------------------------------------------------------------------
def test_owner_of_spreads_ids_evenly_and_deterministically():
    ids = np.arange(200_000, dtype=np.int64) * 4096  # ids sharing their low bits
    for world in (2, 3, 4, 7):
        owners = owner_of(ids, world)
        assert owners.min() >= 0 and owners.max() < world
        counts = np.bincount(owners, minlength=world)
        assert np.all(np.abs(counts - ids.size / world) < 0.02 * ids.size / world), counts
        assert np.array_equal(owners, owner_of(ids.copy(), world))
    assert (
        owner_of(np.array([-1, -(2**63), 2**63 - 1]), 3).tolist()
        == owner_of(np.array([-1, -(2**63), 2**63 - 1]), 3).tolist()
    )


def test_row_shard_creates_reads_writes_and_exports():
    shard = RowShard(dim=4, dtype=torch.float64, seed=3, init_scale=0.1)
    ids = np.array([10, -5, 10, 2**62], dtype=np.int64)
    rows = shard.rows(ids)
    assert rows[0] == rows[2] and shard.num_rows == 3
    values = shard.gather(rows)
    assert torch.equal(values[0], values[2])
    assert torch.equal(shard.init_values(ids), values)  # a row starts from a hash of its id
    unseen = shard.lookup(np.array([77], dtype=np.int64))  # no row is made by a lookup
    assert shard.num_rows == 3 and torch.equal(unseen, shard.init_values(np.array([77])))
    shard.write(np.array([-5, 99]), torch.ones(2, 4), torch.tensor([2.0, 3.0]))
    got_ids, got_values, got_state = shard.export()
    assert got_ids.tolist() == [10, -5, 2**62, 99]
    assert torch.equal(got_values[1], torch.ones(4, dtype=torch.float64))
    assert got_state.tolist() == [0.0, 2.0, 0.0, 3.0]


def test_rowwise_adagrad_is_the_stores_formula():
    opt = SparseOptimizer("rowwise_adagrad", lr=0.1, eps=1e-8)
    values = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64)
    state = torch.tensor([0.5, 0.0], dtype=torch.float64)
    g = torch.tensor([[0.2, -0.4]], dtype=torch.float64)
    opt.apply(values, state, torch.tensor([0]), g)
    s = 0.5 + (0.04 + 0.16) / 2
    assert state.tolist() == pytest.approx([s, 0.0])
    want = [1.0 - 0.1 / (math.sqrt(s) + 1e-8) * 0.2, 2.0 + 0.1 / (math.sqrt(s) + 1e-8) * 0.4]
    assert values[0].tolist() == pytest.approx(want) and values[1].tolist() == [3.0, 4.0]
    with pytest.raises(RecpipeError, match="`kind` must be one of"):
        SparseOptimizer("lamb")


# -- the exchange's fused kernels -----------------------------------------------------------------
@pytest.mark.parametrize("big", [False, True], ids=["one-unique", "per-table"])
def test_unique_per_table_matches_torch_unique_per_table(big):
    """All tables in one hash pass (ids with room for the table's number in the high bits)
    and one table at a time (ids that leave none) give each table's distinct ids in order of
    first appearance, and the inverse."""
    from trainer.idplan import unique_per_table

    rng = np.random.default_rng(3)
    per_table = [2, 1, 3]
    ids = [torch.from_numpy(rng.integers(0, 50, size=n)) for n in (7, 0, 11, 5, 9, 4)]
    if big:  # a negative id and one near 2**62: no room left in the key
        ids[0][0], ids[3][1] = -3, 2**62 + 1
    uniq, inverse = unique_per_table(ids, per_table)
    at, start = 0, 0
    for t, n in enumerate(per_table):
        flat = torch.cat(ids[at : at + n])
        at += n
        firsts = list(dict.fromkeys(flat.tolist()))  # distinct, first seen first
        assert uniq[t].tolist() == firsts
        inv = inverse[start : start + flat.numel()]
        start += flat.numel()
        assert uniq[t][inv].tolist() == flat.tolist()


def test_owner_sums_and_row_wise_adagrad_kernels_match_torch():
    """The owner's one-pass sum per row equals index_add_ bitwise (same float64 order); the
    Numba row-wise Adagrad equals the torch formula to rounding."""
    from trainer.distributed import _kernels as K

    rng = np.random.default_rng(4)
    got = torch.from_numpy(rng.standard_normal((40, 4)))
    sel = rng.permutation(40)[:25]
    rows = rng.integers(0, 9, size=25)
    slot = np.full(12, -1, dtype=np.int64)
    uniq, sums = K.sum_by_row(got.numpy(), sel, rows, slot)
    want = torch.zeros(12, 4, dtype=torch.float64)
    want.index_add_(0, torch.from_numpy(rows), got[torch.from_numpy(sel)])
    assert sorted(uniq.tolist()) == sorted(set(rows.tolist())) and (slot == -1).all()
    assert torch.equal(torch.from_numpy(sums), want[torch.from_numpy(uniq)])
    values = torch.from_numpy(rng.standard_normal((12, 4))).float()
    state = torch.rand(12)
    grads = torch.from_numpy(sums).float()
    ref_values, ref_state = values.clone(), state.clone()
    at = torch.from_numpy(uniq)
    s = ref_state[at] + (grads * grads).sum(1) / 4
    ref_state[at] = s
    ref_values.index_add_(0, at, grads * (0.05 / (s.sqrt() + 1e-8)).unsqueeze(1), alpha=-1.0)
    SparseOptimizer("rowwise_adagrad", lr=0.05).apply(values, state, at, grads)
    torch.testing.assert_close(values, ref_values, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(state, ref_state, rtol=1e-6, atol=0)


def test_row_copy_kernels_match_numpy():
    """The exchange's row copies (into the response, into the batch's rows) are numpy's fancy
    gathers and scatters; the shard's ``gather_into`` is its ``gather`` placed at ``at``."""
    from trainer.distributed import _kernels as K

    rng = np.random.default_rng(5)
    src = rng.standard_normal((30, 4)).astype(np.float32)
    src_index, out_index = rng.integers(0, 30, size=12), rng.permutation(20)[:12]
    out, want = np.zeros((20, 4), np.float32), np.zeros((20, 4), np.float32)
    K.copy_rows(src, src_index, out, out_index)
    want[out_index] = src[src_index]
    assert np.array_equal(out, want)
    out, want = np.zeros((20, 4), np.float32), np.zeros((20, 4), np.float32)
    K.scatter_rows(src[:12], out_index, out)
    want[out_index] = src[:12]
    assert np.array_equal(out, want)
    shard = RowShard(dim=4, seed=1)
    rows = shard.rows(np.array([7, 3, 9, 11], dtype=np.int64))
    placed = torch.zeros(6, 4)
    shard.gather_into(rows[[2, 0]], placed, np.array([5, 1]))
    assert torch.equal(placed[[5, 1]], shard.gather(rows[[2, 0]]))
    assert not placed[[0, 2, 3, 4]].any()


def test_exact_dense_gradients_do_not_depend_on_how_the_batch_is_split():
    """The Linear layers' gradients as float64 sums rounded once: a batch in one piece and the
    same batch in two (two ranks' partial sums, added in float64) give the same float32
    gradients bit for bit; the input gradients and the forward are torch's own."""
    from trainer.distributed.dense import ExactDense

    torch.manual_seed(0)
    x, y = torch.randn(96, 6), torch.randn(96, 1)

    def grads(pieces):
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        plain = [p.detach().clone() for p in model.parameters()]
        exact = ExactDense(model, Comm.single())
        for part in pieces:
            out = model(x[part])
            ((out - y[part]) ** 2).sum().backward()
        assert all(p.grad is None for p in model.parameters())  # held in float64 until reduce
        exact.reduce()
        return exact.linears, [p.grad for p in model.parameters()], plain

    linears, whole, plain = grads([slice(0, 96)])
    _, split, _ = grads([slice(0, 40), slice(40, 96)])
    assert linears == 2
    assert all(torch.equal(a, b) for a, b in zip(whole, split, strict=True))
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    with torch.no_grad():
        for p, q in zip(model.parameters(), plain, strict=True):
            p.copy_(q)
    ((model(x) - y) ** 2).sum().backward()  # float32 sums: within rounding of the exact ones
    for a, p in zip(whole, model.parameters(), strict=True):
        torch.testing.assert_close(a, p.grad, rtol=1e-5, atol=1e-5)


# -- the cost model -------------------------------------------------------------------------------
def test_line_fit_and_choice_of_r_match_brute_force():
    fit = LineFit.of([1, 2, 4, 8], [3.0, 5.0, 9.0, 17.0])
    assert fit.slope == pytest.approx(2.0) and fit.intercept == pytest.approx(1.0)
    assert fit.r2 == pytest.approx(1.0)
    rng = np.random.default_rng(0)
    counts = np.sort(rng.zipf(1.3, 500).astype(np.int64))[::-1]
    cand = HotCandidates(counts, np.zeros(500, np.int64), np.arange(500), int(counts.sum()) + 50, 4)
    model = CostFit(
        all_reduce=LineFit(3e-7, 2e-5, 1.0, (), ()),
        all_to_all=LineFit(9e-7, 0.0, 1.0, (), ()),
        hot_lookup=LineFit(1e-7 + 2 * 3e-7, 0.0, 1.0, (), ()),  # W·C_ar in the slope
        world_size=2,
    )
    assert model.hot_lookup_slope == pytest.approx(1e-7)
    plan = choose_num_hot(cand, model)
    rho = cand.rho()
    brute = [(model.cost(r, rho[r], cand.accesses_per_step), r) for r in range(501)]
    assert plan.num_hot == min(brute)[1]
    assert 0 < plan.num_hot < 500
    assert plan.coefficients.c_a2a == pytest.approx(4e-7)  # (9e-7 - 1e-7) / 2 ranks


def test_line_fit_slope_error_is_the_textbook_one():
    # (1, 1), (2, 3), (3, 2), (4, 4): slope 0.8, residuals ±0.3, ±0.9, SSR 1.8, Sxx 5
    fit = LineFit.of([1, 2, 3, 4], [1.0, 3.0, 2.0, 4.0])
    assert fit.slope == pytest.approx(0.8)
    assert fit.slope_se == pytest.approx(np.sqrt(1.8 / 2 / 5))
    assert LineFit.of([1, 2], [1.0, 3.0]).slope_se == 0.0  # nothing to estimate it from
    assert LineFit.of([1, 2, 4], [3.0, 5.0, 9.0]).slope_se == pytest.approx(0.0, abs=1e-12)


def test_choice_of_r_keeps_no_hot_set_when_the_saving_is_within_the_fits_noise():
    rng = np.random.default_rng(0)
    counts = np.sort(rng.zipf(1.3, 500).astype(np.int64))[::-1]
    cand = HotCandidates(counts, np.zeros(500, np.int64), np.arange(500), int(counts.sum()) + 50, 4)
    rho, n = cand.rho(), cand.accesses_per_step

    def fit(se: float) -> CostFit:
        return CostFit(
            all_reduce=LineFit(3e-7, 2e-5, 1.0, (), ()),
            all_to_all=LineFit(9e-7, 0.0, 1.0, (), (), se),
            hot_lookup=LineFit(1e-7 + 2 * 3e-7, 0.0, 1.0, (), ()),
            world_size=2,
        )

    exact = fit(0.0)
    plain = choose_num_hot(cand, exact)
    saving = exact.cost(0, 0.0, n) - exact.cost(plain.num_hot, rho[plain.num_hot], n)
    assert plain.num_hot > 0 and saving > 0
    # c_a2a's error is se / W; the best R's saving within 2 errors of it: no hot set
    noisy = fit(2 * saving / (n * rho[plain.num_hot]))
    assert noisy.c_a2a_se == pytest.approx(saving / (n * rho[plain.num_hot]))
    assert choose_num_hot(cand, noisy).num_hot == 0
    assert choose_num_hot(cand, noisy, confidence=0.0).num_hot == plain.num_hot
    for bad in (-1.0, float("nan"), float("inf"), "2"):
        with pytest.raises(RecpipeError, match="confidence"):
            choose_num_hot(cand, noisy, confidence=bad)
    # a little noise: a hot set that is still surely worth it, the smallest-cost one among them
    slight = fit(0.2 * saving / (n * rho[plain.num_hot]))
    chosen = choose_num_hot(cand, slight)
    sizes = np.arange(rho.size)
    sure = slight.cost(0, 0.0, n) - slight.cost(sizes, rho, n) > 2 * slight.saving_se(sizes, rho, n)
    assert chosen.num_hot > 0 and sure[chosen.num_hot]
    assert slight.cost(chosen.num_hot, rho[chosen.num_hot], n) == pytest.approx(
        slight.cost(sizes[sure], rho[sure], n).min()
    )


def test_cost_fit_runs_on_one_process():
    fit = fit_costs(Comm.single(), dim=4, ar_rows=(64, 256), a2a_rows=(64, 256), repeats=1)
    assert fit.world_size == 1 and fit.backend == "local"
    assert fit.c_ar > 0 and fit.c_a2a > 0
    assert len(fit.all_reduce.seconds) == len(fit.all_to_all.seconds) == 2


def test_cost_probe_warms_up_after_every_change_of_size_and_keeps_the_fastest_visit():
    # scripted step times, no clock: every visit's first `warm` steps are slow (a new size's
    # buffers), and one visit of "a" is slowed down by other load
    script = {
        "a": iter([9.0, 9.0, 5.0, 3.0, 9.0, 9.0, 4.0, 6.0, 9.0, 9.0, 90.0, 80.0]),
        "b": iter([9.0, 9.0, 2.0, 2.0] * 3),
    }
    log = []

    def setup(name):
        def visit():
            log.append(("setup", name))

            def step():
                log.append(("step", name))
                return next(script[name])

            return step

        return visit

    times = costs._slowest_rank_fastest(
        Comm.single(), [setup("a"), setup("b")], rounds=3, warm=2, calls=2
    )
    assert times == [3.0, 2.0]  # visits' fastest: a 3, 4, 80; b 2, 2, 2 (warm-ups: 9)
    visits = [name for what, name in log if what == "setup"]
    assert visits == ["a", "b", "b", "a", "a", "b"]  # every round starts one case later
    for k in range(0, len(log), 5):  # a visit: its setup, then warm + calls steps of it
        assert log[k : k + 5] == [("setup", log[k][1])] + [("step", log[k][1])] * 4


def test_all_reduce_probe_times_the_backward_exchange_only(monkeypatch):
    # a fake clock that prepare() and step() advance: what the probe returns is what it timed
    clock = [0.0]
    monkeypatch.setattr(costs, "perf_counter", lambda: clock[0])
    probe = costs._Probe(Comm.single(), dim=4, dtype=torch.float32)

    def advance(seconds, real):
        def run(*args, **kwargs):
            clock[0] += seconds
            return real(*args, **kwargs)

        return run

    monkeypatch.setattr(probe.sparse, "prepare", advance(1.0, probe.sparse.prepare))
    monkeypatch.setattr(probe.sparse, "step", advance(0.25, probe.sparse.step))
    ids = np.arange(8, dtype=np.int64)
    assert probe.step(ids)() == 1.25
    assert probe.step(ids, timed="step")() == 0.25


# -- global batches and batch norm ----------------------------------------------------------------
def test_concat_batches_keeps_every_row(dist_dataset):
    parts = _batches(dist_dataset, count=2)
    both = concat_batches(parts)
    assert both.batch_size == sum(p.batch_size for p in parts)
    assert torch.equal(both.dense, torch.cat([p.dense for p in parts]))
    assert torch.equal(both.labels, torch.cat([p.labels for p in parts]))
    plain, want = both.to_plain().kjt, [p.to_plain().kjt for p in parts]
    for key in plain.keys():
        assert torch.equal(plain[key].values(), torch.cat([w[key].values() for w in want]))
        assert torch.equal(plain[key].lengths(), torch.cat([w[key].lengths() for w in want]))
    streams = [_batches(dist_dataset, world=2, rank=r, count=2) for r in range(2)]
    glued = list(global_batches(streams))
    assert len(glued) == 2 and glued[1].batch_size == 2 * streams[0][1].batch_size


def test_global_batch_norm_is_batch_norm_in_one_process():
    torch.manual_seed(0)
    x = torch.randn(64, 5) * 3 + 2
    x[:, 4] = 1.5  # a constant column: exactly 0 here, rounding noise in torch's
    norm = torch.nn.BatchNorm1d(5, affine=False)
    mine = GlobalBatchNorm.replacing(norm, Comm.single())
    a, b = norm(x), mine(x)
    assert torch.allclose(a[:, :4], b[:, :4], atol=1e-6) and torch.equal(b[:, 4], torch.zeros(64))
    assert torch.allclose(norm.running_var, mine.running_var, atol=1e-6)
    norm.eval(), mine.eval()
    assert torch.allclose(norm(x)[:, :4], mine(x)[:, :4], atol=1e-6)


# -- one process against the single-process store trainer -----------------------------------------
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_one_process_equals_the_store_trainer(dist_dataset, optimizer):
    """The sharded tables' rows start and update like the hybrid store's (same init from a hash
    of the id, same row-wise Adagrad), so a world of one trains like `recpipe train --store
    hybrid` (with the same, global, batch norm)."""
    from readers.dataset import dataset_schema
    from trainer.config import DEFAULT_LR
    from trainer.distributed.dense import global_batch_norms
    from trainer.modules import table_seed
    from trainer.store import StoreConfig
    from trainer.store.store import EmbeddingStore
    from trainer.store.table import StoreTable
    from trainer.train import Trainer

    schema = dataset_schema(str(dist_dataset))
    batches = _batches(dist_dataset, count=4)
    factory = sharded_table_factory(optimizer=optimizer)
    ours = DistributedTrainer(
        DLRM.from_schema(schema, MODEL, table_factory=factory), comm=Comm.single(),
        optimizer=optimizer,
    )  # fmt: skip
    losses = [float(ours.train_step(b)[0]) for b in batches]

    def store_table(table, seed):
        config = StoreConfig(
            dim=table.dim, lr=DEFAULT_LR[optimizer], seed=table_seed(seed, table.name) % (1 << 31),
            optimizer="sgd" if optimizer == "sgd" else "rowwise_adagrad",
            init_scale=math.sqrt(1.0 / table.num_embeddings), pin_window=len(table.features) + 2,
        )  # fmt: skip
        return StoreTable(table, EmbeddingStore.create(None, config))

    model = DLRM.from_schema(schema, MODEL, table_factory=store_table)
    global_batch_norms(model, Comm.single())
    theirs = Trainer(model, optimizer=optimizer)
    want = [float(theirs.train_step(b)[0]) for b in batches]
    if optimizer == "sgd":  # the same float32 sums in the same order
        assert losses == want
    else:  # gradients summed in float64 here, in float32 by the store
        assert max(abs(a - b) / b for a, b in zip(losses, want, strict=True)) < 1e-6


def test_exchange_counts_and_refusals(dist_dataset):
    from readers.dataset import dataset_schema

    schema = dataset_schema(str(dist_dataset))
    batches = _batches(dist_dataset, count=2)
    trainer = DistributedTrainer(
        DLRM.from_schema(schema, MODEL, table_factory=sharded_table_factory(optimizer="sgd")),
        comm=Comm.single(), optimizer="sgd", hot_budget_rows=1 << 20,
    )  # fmt: skip
    sparse = trainer.sparse
    with pytest.raises(RecpipeError, match="needs access counts"):
        sparse.reshard(5)
    for b in batches:
        sparse.count(b)
    cand = sparse.gather_counts()
    assert cand.steps == 2 and cand.total == int(cand.counts.sum())  # every pair is a candidate
    assert sparse.reshard(10**9) == cand.counts.size  # R is capped at the rows seen
    sparse.reshard(7)
    with pytest.raises(RecpipeError, match="`num_hot` must be a non-negative integer"):
        sparse.reshard(-1)
    sparse.prepare(batches[0])
    with pytest.raises(RecpipeError, match="at a step boundary"):
        sparse.reshard(3)
    sparse.step()
    with pytest.raises(RecpipeError, match=r"step\(\) without a prepare"):
        sparse.step()
    st = sparse.stats
    assert st.steps == 1 and st.accesses == st.hot_accesses + st.cold_rows
    assert st.remote_rows == 0 and st.a2a_bytes == 0  # one process: nothing crosses a wire


def test_options_and_configs_are_checked(dist_dataset):
    with pytest.raises(RecpipeError, match="`hot_rows` must be 'auto' or a non-negative integer"):
        DistributedConfig(hot_rows=-3)
    with pytest.raises(RecpipeError, match="`count_steps` must be a positive integer"):
        DistributedConfig(count_steps=0)
    base = {"dataset": str(dist_dataset), "batch_size": 8}
    check_config(TrainConfig(**base, store="hybrid"))  # each rank's rows in its own stores
    check_config(TrainConfig(**base, store="hybrid", optimizer="adam"))  # moments in the stores
    check_config(TrainConfig(**base, optimizer="adam"))  # Adam's state lives with each row
    with pytest.raises(RecpipeError, match="must be >= 2 with several processes"):
        check_config(TrainConfig(dataset=str(dist_dataset), batch_size=1))
    with pytest.raises(RecpipeError, match="'sgd', 'adagrad' or 'adam' with sharded tables"):
        DistributedTrainer(DLRM.from_schema(_schema(dist_dataset), MODEL), comm=Comm.single(),
                           optimizer="lamb")  # fmt: skip


def _schema(dataset):
    from readers.dataset import dataset_schema

    return dataset_schema(str(dataset))


def test_hot_rows_no_rank_touched_are_not_updated(dist_dataset):
    """The touched-rows mask: the optimizer sees exactly the hot rows the step's batch used (a
    row-wise Adagrad step with a zero gradient changes nothing, but a row no rank touched must
    not be handed to the optimizer at all)."""
    batches = _batches(dist_dataset, count=2)
    trainer = DistributedTrainer(
        DLRM.from_schema(_schema(dist_dataset), MODEL,
                         table_factory=sharded_table_factory(optimizer="adagrad")),
        comm=Comm.single(), optimizer="adagrad", hot_budget_rows=1 << 20,
    )  # fmt: skip
    sparse = trainer.sparse
    for b in batches:
        sparse.count(b)
    sparse.gather_counts()
    sparse.reshard(10**9)  # every row seen in either batch is hot
    seen: list[int] = []

    class Recording(type(sparse.optimizer)):
        def apply(self, values, state, rows, grads, **kwargs):
            seen.append(int(rows.numel()))
            super().apply(values, state, rows, grads, **kwargs)

    sparse.optimizer = Recording(**{f: getattr(sparse.optimizer, f) for f in ("kind", "lr", "eps")})
    ids = sparse.plan(batches[0]).plan.ids
    trainer.train_step(batches[0])
    touched = [int(np.isin(t.hot_ids, u).sum()) for t, u in zip(sparse.tables, ids, strict=True)]
    hot_tables = [n for n, t in zip(touched, sparse.tables, strict=True) if t.num_hot]
    assert seen[0] == sum(hot_tables)  # hot step (every table's replica at once): touched rows
    assert sum(hot_tables) < sparse.num_hot  # batch 1's rows were hot and left alone
