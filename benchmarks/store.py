"""Benchmark of the hybrid embedding store (issue 6); writes benchmarks/results/store.json.

Everything is measured in one run, as ratios against a baseline in the same run where there is
one. Batches resemble the synthetic data (etl/synth.py): sessions of ``--session-len`` samples
share a user list of ``--pooling`` ids (so an IKJT holds B / session-len unique rows), ids follow
the synth's popularity law ``floor(V * u**3)`` over a vocabulary of ``--vocab`` ids, hashed over
the whole int64 range.

    python benchmarks/store.py            # defaults of the issue: batches of 4096 x 30 ids
    python benchmarks/store.py --help
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trainer.store import (  # noqa: E402
    EmbeddingStore,
    IdIndex,
    StoreConfig,
    StoreEmbeddingBag,
    open_store,
)
from trainer.store import _kernels as K  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "store.json"


MODEL_RATIO_MEANS = (
    "checkpoint_overhead = wall time of `recpipe train --store hybrid` (trainer.train.train: the "
    "DLRM of the trainer benchmark, adagrad, B=`batch`, one torch thread, the data read by the "
    "trainer's own loader) for `model_steps` steps with `--checkpoint-every ckpt_every` / the "
    "same run without checkpoints (TrainResult.wall_s: the training loop, the checkpoints taken "
    "inside it included; start-up and the final save excluded; no held-out split). A checkpoint = "
    "every table's store checkpointed (only rows changed since the last one; blocking, "
    "sync='full': fsync + atomic commit record) + the dense model, optimizers and reader "
    "position saved atomically. Runs interleaved (the order rotates each repeat), median of the "
    "per-pair ratios."
)


def _load_benchmark(name: str):
    """benchmarks/<name>.py as a module (its name may clash with a package of the project)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        f"_recpipe_bench_{name}", ROOT / "benchmarks" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bench_checkpoint_model(args, tmp: Path) -> dict:
    """checkpoint_overhead of real training (see MODEL_RATIO_MEANS)."""
    import io

    from trainer.train import TrainConfig, train

    work = tmp / "model"
    dataset, _ = _load_benchmark("trainer").build_dataset(
        work, requests=args.model_requests, seed=args.seed
    )

    def run(every: int, steps: int) -> tuple[float, list[dict]]:
        ckpt = work / "checkpoint"
        config = TrainConfig(
            dataset=str(dataset),
            steps=steps,
            batch_size=args.batch,
            store="hybrid",
            checkpoint=str(ckpt) if every else None,
            checkpoint_every=every,
            eval_fraction=0.0,  # no evaluation: every row group trains
            seed=args.seed,
        )
        result = train(config, progress=False, log=io.StringIO())
        info: list[dict] = []
        if every:
            for f in sorted((ckpt / "store").glob("*/checkpoints.jsonl")):
                info += [
                    dict(json.loads(x), store=f.parent.name) for x in f.read_text().splitlines()
                ]
            shutil.rmtree(ckpt)
        return result.wall_s, info

    run(0, 2)  # warm up: Numba's first calls, allocator, page cache of the dataset
    modes = {"without": 0, "with": args.ckpt_every}
    times: dict[str, list[float]] = {m: [] for m in modes}
    info: list[dict] = []
    for r in range(args.model_repeats):
        for mode in list(modes)[r % 2 :] + list(modes)[: r % 2]:
            wall, got = run(modes[mode], args.model_steps)
            times[mode].append(wall)
            info = got or info
    ratios = [w / wo for w, wo in zip(times["with"], times["without"])]
    by_step: dict[int, list[dict]] = {}  # store checkpoints per training step
    for c in info:
        by_step.setdefault(c["step"], []).append(c)
    return {
        "checkpoint_overhead": float(np.median(ratios)),
        "checkpoint_overhead_repeats": ratios,
        "checkpoint_overhead_measures": MODEL_RATIO_MEANS,
        "checkpoint_model": {
            "steps": args.model_steps,
            "every": args.ckpt_every,
            "requests": args.model_requests,
            "train_seconds_without": times["without"],
            "train_seconds_with": times["with"],
            "stores": len({c["store"] for c in info}),
            "checkpoints": [
                {
                    "step": step,
                    "store_checkpoints": len(cs),
                    "rows_written": sum(c["rows_written"] for c in cs),
                    "rows": sum(c["rows"] for c in cs),
                    "seconds": round(sum(c["seconds"] for c in cs), 4),
                }
                for step, cs in sorted(by_step.items())
            ],
        },
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=int, default=4096, help="samples per batch (B)")
    p.add_argument("--pooling", type=int, default=30, help="ids per sample")
    p.add_argument("--session-len", type=int, default=16, help="samples per session (dedup)")
    p.add_argument("--vocab", type=int, default=2_000_000, help="distinct ids in the data")
    p.add_argument("--dim", type=int, default=64, help="embedding dimension")
    p.add_argument("--steps", type=int, default=30, help="timed steps per measurement")
    p.add_argument("--ckpt-steps", type=int, default=500, help="timed steps of a checkpoint run")
    p.add_argument("--ckpt-every", type=int, default=100, help="checkpoint interval (steps)")
    p.add_argument(
        "--ckpt-warmup", type=int, default=100, help="untimed steps before (rows, allocations)"
    )
    p.add_argument(
        "--ckpt-repeats", type=int, default=5, help="interleaved repeats of the checkpoint runs"
    )
    p.add_argument(
        "--model-requests",
        type=int,
        default=200_000,
        help="synthetic requests of the dataset the DLRM checkpoint runs train on",
    )
    p.add_argument("--model-steps", type=int, default=200, help="steps of a DLRM checkpoint run")
    p.add_argument(
        "--model-repeats", type=int, default=3, help="interleaved repeats of the DLRM runs"
    )
    p.add_argument(
        "--storage-checkpoints",
        type=int,
        default=4,
        help="checkpoints per layout in the storage comparison (the first is reported apart)",
    )
    p.add_argument("--index-rows", type=int, default=1_000_000, help="ids in the index")
    p.add_argument("--miss-steps", type=int, default=200, help="steps of the miss-rate runs")
    p.add_argument(
        "--repeats", type=int, default=3, help="repeats (best time; checkpoint runs: median)"
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads (ours and fbgemm)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the JSON written")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- data


def to_ids(ranks: np.ndarray) -> np.ndarray:
    """Spread popularity ranks over the whole int64 range (a bijection)."""
    return K.hash_ids(np.ascontiguousarray(ranks, dtype=np.int64)).view(np.int64)


def ranks(rng: np.random.Generator, n: int, vocab: int) -> np.ndarray:
    return np.floor(vocab * rng.random(n) ** 3).astype(np.int64)


def session_batch(rng, args) -> dict:
    """One batch: unique rows (IKJT) and the expanded KJT of the same samples."""
    b, length, pool = args.batch, args.pooling, args.session_len
    u = -(-b // pool)
    rank = ranks(rng, u * length, args.vocab)  # (U * L)
    inverse = np.repeat(np.arange(u), pool)[:b]  # (B,)
    expanded = rank.reshape(u, length)[inverse].reshape(-1)  # (B * L)
    return {
        "ids": torch.from_numpy(to_ids(rank)),
        "ranks": torch.from_numpy(rank),
        "offsets": torch.arange(0, u * length + 1, length),
        "inverse": torch.from_numpy(inverse),
        "kjt_ranks": torch.from_numpy(expanded),
        "kjt_ids": torch.from_numpy(to_ids(expanded)),
        "kjt_offsets": torch.arange(0, b * length + 1, length),
    }


def best(fn, repeats: int) -> float:
    t = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        t = min(t, time.perf_counter() - t0)
    return t


# ----------------------------------------------------------------------------- measurements


def bench_index(args, rng) -> dict:
    known = to_ids(np.arange(args.index_rows))
    index = IdIndex(num_shards=16)
    index.insert(known)
    n = args.batch * args.pooling
    batches = [known[ranks(rng, n, args.index_rows)] for _ in range(args.steps)]
    fresh = iter(to_ids(np.arange(args.index_rows, args.index_rows + n * args.steps * 4)))

    def known_pass():
        for b in batches:
            index.insert(b)

    t_known = best(known_pass, args.repeats)
    new_batches = []
    for b in batches:
        b = b.copy()
        pos = rng.choice(n, n // 10, replace=False)
        b[pos] = np.fromiter(fresh, np.int64, count=pos.size)
        new_batches.append(b)
    t0 = time.perf_counter()
    for b in new_batches:
        index.insert(b)
    t_new = time.perf_counter() - t0
    total = n * len(batches)
    return {
        "index_ids_per_s_per_core": total / t_known,
        "index_ids_per_s_per_core_10pct_new": total / t_new,
        "index_rows_after": index.num_rows,
        "target_ids_per_s": 10e6,
    }


def make_store(args, path=None, **kw) -> EmbeddingStore:
    cfg = dict(dim=args.dim, optimizer="sgd", lr=0.01, chunk_rows=65536, sync="full")
    cfg.update(kw)
    return EmbeddingStore.create(path, StoreConfig(**cfg))


def train_step(bag, batch, *, dedup: bool = True) -> None:
    if dedup:
        out = bag(batch["ids"], batch["offsets"], inverse_lookup=batch["inverse"])
    else:
        out = bag(batch["kjt_ids"], batch["kjt_offsets"])
    out.sum().backward()
    bag.store.update()


def bench_pull_push(args, batches) -> dict:
    out = {}
    with make_store(args, hot_budget_rows=1 << 20) as store:
        for b in batches:  # create and cache every row
            store.prefetch(b["ids"])
        store.restart_counting(len(batches))
        locs = []
        for b in batches:
            locs.append(store.prefetch(b["ids"]))

        def cycle():
            for b in batches:
                loc = store.prefetch(b["ids"])
                store.push(loc, store.pull(loc))
                store.update()

        rows = sum(loc.num_unique for loc in locs)
        out["pull_push_rows_per_s"] = rows / best(cycle, args.repeats)
        store.reshard(min(store.num_rows, 1 << 20))  # every row of these batches is hot
        out["pull_push_rows_per_s_hot"] = rows / best(cycle, args.repeats)
        out["hot_rows_in_probe"] = store.stats().hot_rows
    return out


def bench_vs_fbgemm(args, batches) -> dict:
    try:
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            SplitTableBatchedEmbeddingBagsCodegen,
        )
    except Exception as exc:  # fbgemm-gpu-cpu missing or failing to load
        return {"step_vs_fbgemm_tbe": None, "fbgemm_error": str(exc)}
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(args.vocab, args.dim, EmbeddingLocation.HOST, ComputeDevice.CPU)],
        optimizer=EmbOptimType.EXACT_SGD,
        learning_rate=0.01,
        device="cpu",
    )

    def fbgemm():
        for b in batches:
            out = tbe(b["kjt_ranks"], b["kjt_offsets"])
            out.sum().backward()

    with make_store(args) as store:
        bag = StoreEmbeddingBag(store)
        for b in batches:  # same rows present in both: fbgemm's table is preallocated
            train_step(bag, b)
            train_step(bag, b, dedup=False)

        fbgemm()
        t_store = t_store_kjt = t_fbgemm = float("inf")
        for _ in range(args.repeats):  # interleaved, so load on the machine hits all alike
            t_fbgemm = min(t_fbgemm, best(fbgemm, 1))
            t_store = min(t_store, best(lambda: [train_step(bag, b) for b in batches], 1))
            t_store_kjt = min(
                t_store_kjt, best(lambda: [train_step(bag, b, dedup=False) for b in batches], 1)
            )
    samples = args.batch * len(batches)
    return {
        "step_vs_fbgemm_tbe": t_fbgemm / t_store,
        "step_vs_fbgemm_tbe_no_dedup": t_fbgemm / t_store_kjt,
        "store_samples_per_s": samples / t_store,
        "store_samples_per_s_no_dedup": samples / t_store_kjt,
        "fbgemm_samples_per_s": samples / t_fbgemm,
        "dedup_factor": args.batch * args.pooling / batches[0]["ids"].numel(),
    }


def bench_rho(args, rng) -> dict:
    with make_store(args, count_batches=100, hot_budget_rows=1 << 20) as store:
        for _ in range(100):
            store.prefetch(session_batch(rng, args)["ids"])
        plan = store.plan_hot_set()
        return {
            "rho": {str(r): store.rho(r) for r in (1_000, 10_000, 65_536)},
            "chosen_hot_rows": plan.num_hot,
            "chosen_rho": plan.rho,
            "cost_model": {
                "c_ar_s_per_row": plan.coefficients.c_ar,
                "c_a2a_s_per_id": plan.coefficients.c_a2a,
                "accesses_per_batch": plan.accesses_per_batch,
                "predicted_cost_ratio_vs_no_hot": plan.cost / plan.cost_no_hot,
                "coefficients": plan.coefficients.source,
            },
        }


CHECKPOINT_RATIO_MEANS = (
    "The stress case (no dense model: a step is only the store's lookup, backward and update, "
    "~4 ms): checkpoint_overhead_embedding_only = wall time of the steady-state intervals of a "
    "run that checkpoints "
    "every `ckpt_every` steps (sync='full': fsync + atomic commit record), divided by the same "
    "intervals of the same run without checkpoints: same batches, same torch threads, runs "
    "interleaved (the order rotates each repeat), median over repeats. A run trains "
    "`ckpt_warmup` untimed steps, then `ckpt_steps` timed steps in intervals of `ckpt_every`; "
    "an interval = waiting for the previous checkpoint if still running + the blocking "
    "snapshot + `ckpt_every` training steps with the writer thread running beside them; the "
    "last interval includes waiting for the last checkpoint. Steady state = every interval "
    "but the first; the first (the store's first checkpoint: every row new, the file freshly "
    "grown) is reported apart as checkpoint_overhead_first_interval (the other "
    "checkpoint_* figures below describe this stress case too)."
)


def bench_checkpoint(args, tmp: Path) -> tuple[dict, Path, list]:
    """Training time with a checkpoint every ``ckpt_every`` steps / without (see
    CHECKPOINT_RATIO_MEANS)."""
    rng = np.random.default_rng(args.seed + 1)
    warm, every = args.ckpt_warmup, args.ckpt_every
    stream = [session_batch(rng, args) for _ in range(warm + args.ckpt_steps)]

    def run(sync: str | None, name: str) -> dict:
        store = make_store(args, tmp / name, sync=sync or "full")
        bag = StoreEmbeddingBag(store)
        for b in stream[:warm]:
            train_step(bag, b)
        marks, cpu0 = [], time.thread_time()
        for i, b in enumerate(stream[warm:]):
            if i % every == 0:
                store.wait_checkpoint()  # a checkpoint slower than its interval stalls it
                marks.append(time.perf_counter())
                if sync:
                    store.checkpoint(warm + i - 1, wait=False)
            train_step(bag, b)
        store.wait_checkpoint()
        marks.append(time.perf_counter())
        out = {"intervals": np.diff(marks), "train_thread_cpu": time.thread_time() - cpu0}
        store.close()
        if sync:
            lines = (tmp / name / "checkpoints.jsonl").read_text().splitlines()
            out["info"] = [json.loads(x) for x in lines]
        return out

    modes = ["without", "full", "process"]
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    keep = tmp / "full-last"
    for r in range(args.ckpt_repeats):
        for mode in modes[r % 3 :] + modes[: r % 3]:  # interleaved, rotating order
            name = f"{mode}{r}"
            runs[mode].append(run(None if mode == "without" else mode, name))
            if mode == "full" and r == args.ckpt_repeats - 1:
                (tmp / name).rename(keep)
            else:
                shutil.rmtree(tmp / name)

    def ratios(mode: str, part: slice) -> list[float]:
        return [
            float(w["intervals"][part].sum() / wo["intervals"][part].sum())
            for w, wo in zip(runs[mode], runs["without"])
        ]

    steady = slice(1, None) if args.ckpt_steps > every else slice(0, None)
    base = float(np.median([x["intervals"][steady].sum() for x in runs["without"]]))
    info = [c for x in runs["full"] for c in x["info"][1:]] or [runs["full"][0]["info"][0]]
    first = [x["info"][0] for x in runs["full"]]
    blocking = [c["snapshot_seconds"] for c in info]
    n_steady = len(runs["full"][0]["intervals"][steady])
    writer_cpu = float(np.mean([c["writer_cpu_seconds"] for c in info]))
    train_cpu = float(np.median([x["train_thread_cpu"] for x in runs["without"]]))
    intervals = len(runs["without"][0]["intervals"])
    return (
        {
            "checkpoint_overhead_embedding_only": float(np.median(ratios("full", steady))),
            "checkpoint_overhead_embedding_only_repeats": ratios("full", steady),
            "checkpoint_overhead_first_interval": float(np.median(ratios("full", slice(0, 1)))),
            "checkpoint_overhead_whole_run": float(np.median(ratios("full", slice(None)))),
            "checkpoint_overhead_sync_process": float(np.median(ratios("process", steady))),
            "checkpoint_overhead_embedding_only_measures": CHECKPOINT_RATIO_MEANS,
            "checkpoint_blocking_overhead": 1.0 + float(np.mean(blocking)) * n_steady / base,
            "checkpoint_train_thread_cpu_ratio": float(
                np.median([w["train_thread_cpu"] for w in runs["full"]]) / train_cpu
            ),
            "checkpoint_writer_cpu_per_train_cpu": writer_cpu * intervals / train_cpu,
            "checkpoint_writer_cpu_seconds_mean": writer_cpu,
            "checkpoint_seconds_mean": float(np.mean([c["seconds"] for c in info])),
            "checkpoint_first_seconds": float(np.median([c["seconds"] for c in first])),
            "checkpoint_rows_written_mean": float(np.mean([c["rows_written"] for c in info])),
            "checkpoint_rows_at_end": int(runs["full"][-1]["info"][-1]["rows"]),
            "train_seconds_per_interval_without": base / max(n_steady, 1),
            # > 1: the writer is slower than the training it overlaps, so training waits for it
            "checkpoint_writer_seconds_per_interval": float(np.mean([c["seconds"] for c in info]))
            / (base / max(n_steady, 1)),
        },
        keep,
        stream,
    )


def _storage_layout(kind: str, path: Path, rows: int, width: int, dirty_sets, src) -> dict:
    """Seconds (wall, writer CPU) of checkpoints writing ``dirty_sets`` with one layout."""
    copies = 2 if kind.startswith("shadow") else 1
    size = rows * copies * (width + 1) * 4
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    os.ftruncate(fd, size)
    if kind != "shadow_copies_sparse":
        os.posix_fallocate(fd, 0, size)
    words = np.asarray(
        np.memmap(path, dtype=np.uint32, mode="r+", shape=(rows * copies, width + 1))
    )
    committed = np.zeros(rows, dtype=np.int64)
    with open(path.with_suffix(".log"), "wb") as log:
        wall, cpu = [], []
        for dirty in dirty_sets:
            t0, c0 = time.perf_counter(), time.thread_time()
            staged = src[: dirty.size]  # the rows' values, staged from the cache
            if kind.startswith("shadow"):  # write the copy that is not committed; fsync; commit
                pos = 2 * dirty + 1 - committed[dirty]
                K.write_block(staged, pos, words)
                os.fsync(fd)
                committed[dirty] ^= 1
            elif kind == "in_place_undo_log":  # log the old images, fsync, write in place, fsync
                log.seek(0)
                log.write(dirty)
                log.write(words[dirty])
                log.flush()
                os.fsync(log.fileno())
                K.write_block(staged, dirty, words)
                os.fsync(fd)
                log.truncate(0)
            else:  # log_structured_append: the dirty rows appended contiguously, fsync
                buf = np.empty((dirty.size, width + 1), dtype=np.uint32)
                K.write_block(staged, np.arange(dirty.size), buf)
                log.write(dirty)
                log.write(buf)
                log.flush()
                os.fsync(log.fileno())
            wall.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
    del words
    os.close(fd)
    path.unlink()
    path.with_suffix(".log").unlink()
    steady = slice(1, None) if len(wall) > 1 else slice(None)
    return {
        "first_seconds": wall[0],
        "steady_seconds": float(np.median(wall[steady])),
        "steady_writer_cpu_seconds": float(np.median(cpu[steady])),
        "file_bytes": size,
    }


def bench_storage_choice(args, tmp: Path, *, rows: int, dirty_rows: int) -> dict:
    """The write path of a checkpoint under each candidate layout, on the same dirty sets (as
    many rows as the checkpoint run wrote, uniformly spread: a simplification) and the same
    values; each layout on a fresh file, first checkpoint reported apart."""
    rng = np.random.default_rng(args.seed + 2)
    rows = max(rows, 2)
    dirty_rows = min(max(dirty_rows, 1), rows)
    dirty_sets = [
        np.sort(rng.choice(rows, dirty_rows, replace=False))
        for _ in range(args.storage_checkpoints)
    ]
    src = rng.random((dirty_rows, args.dim), dtype=np.float32).view(np.uint32)
    out = {
        "rows": rows,
        "dirty_rows": dirty_rows,
        "logical_bytes_per_checkpoint": dirty_rows * (args.dim + 1) * 4,
    }
    # the first big file a process writes pays extra (page cache refill): a pass not kept
    _storage_layout("shadow_copies", tmp / "warmup.bin", rows, args.dim, dirty_sets[:1], src)
    for kind in (
        "shadow_copies",
        "in_place_undo_log",
        "shadow_copies_sparse",
        "log_structured_append",
    ):
        out[kind] = _storage_layout(kind, tmp / f"{kind}.bin", rows, args.dim, dirty_sets, src)
    out["chosen"] = "shadow_copies"
    out["notes"] = (
        "shadow_copies: the store's writer (file order, preallocated file); "
        "shadow_copies_sparse: the same without preallocating the file (the previous writer); "
        "in_place_undo_log: the alternative with one copy per row; log_structured_append: a "
        "lower bound of what appending dirty rows to a log would cost (not implemented: it "
        "needs a row-location table, compaction and a read path over segments)"
    )
    return out


RECOVERY_CHILD = r"""
import os, sys, time
sys.path.insert(0, sys.argv[1])
import numpy as np
from trainer.store import IdIndex, open_store
what, path, tiny, cold = sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5] == "1"
# one-time costs of a fresh process (imports, Numba's first calls: ~1 s, the same for both
# ways and for any table size) are paid on a tiny store and a tiny dump first
open_store(tiny).close()
IdIndex.from_ids(np.load(os.path.join(tiny, "dump-ids.npy")))
np.load(os.path.join(tiny, "dump-values.npy"))
if cold:  # evict the files from the page cache (they are clean: written and synced before)
    for name in os.listdir(path):
        fd = os.open(os.path.join(path, name), os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
t0 = time.perf_counter()
if what == "dump":
    ids = np.load(os.path.join(path, "ids.npy"))
    values = np.load(os.path.join(path, "values.npy"))
    IdIndex.from_ids(ids)
elif what == "open":
    open_store(path).close()
else:  # "verify": open and check every row's checksum now
    open_store(path, verify=True).close()
print(time.perf_counter() - t0)
"""


def bench_recovery(args, path: Path, stream, tmp: Path) -> dict:
    """Time to reload a full dump (ids + rows as .npy, then rebuild the id index) / time for
    ``open_store`` of the store a crashed run left behind.

    Each recovery runs in a fresh process, as after a crash, whose one-time costs (imports and
    Numba's first calls, the same for both ways) are paid first on a tiny store; the timing
    then covers only what depends on the table. Page cache warm (the process crashed, the
    machine did not) and cold (the files evicted with ``posix_fadvise``, as after a reboot).
    Runs alternate; the median of ``--repeats`` is kept.
    """
    import subprocess

    store = open_store(path)
    bag = StoreEmbeddingBag(store)
    for b in stream[:10]:  # uncommitted work, then a "crash": the store is dropped unsaved
        train_step(bag, b)
    ids, values = store.export()
    store.close()
    dump = tmp / "dump"
    dump.mkdir()
    np.save(dump / "ids.npy", ids)
    np.save(dump / "values.npy", values)
    tiny = tmp / "tiny"
    with make_store(args, tiny) as small:
        small.prefetch(np.arange(100, dtype=np.int64))
        small.checkpoint(0)
    np.save(tiny / "dump-ids.npy", np.arange(100, dtype=np.int64))
    np.save(tiny / "dump-values.npy", np.zeros((100, args.dim), np.float32))
    os.sync()  # every file clean, so that write-back slows no timing and eviction works

    def child(what: str, target: Path, cold: bool) -> float:
        cmd = [sys.executable, "-c", RECOVERY_CHILD, str(ROOT), what, str(target), str(tiny)]
        env = dict(os.environ, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
        out = subprocess.run(
            [*cmd, "1" if cold else "0"], capture_output=True, text=True, env=env, check=True
        )
        return float(out.stdout.strip().splitlines()[-1])

    times: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        for cold in (False, True):
            for what, target in (("dump", dump), ("open", path), ("verify", path)):
                key = f"{what}_{'cold' if cold else 'warm'}"
                times.setdefault(key, []).append(child(what, target, cold))
    t = {k: float(np.median(v)) for k, v in times.items()}
    return {
        "recovery_speedup": t["dump_warm"] / t["open_warm"],
        "recovery_speedup_cold_cache": t["dump_cold"] / t["open_cold"],
        "recovery_speedup_verify_all_rows": t["dump_warm"] / t["verify_warm"],
        "recovery_seconds": t,
        "recovery_measures": (
            "fresh process per recovery, its one-time costs (imports, Numba's first calls) "
            "paid on a tiny store first; full dump = np.load of ids + rows and "
            "IdIndex.from_ids; open = open_store (rows are checked when first read); verify = "
            "open_store(verify=True), every row read and checked; warm / cold page cache; "
            "median of alternated runs"
        ),
        "rows": int(ids.size),
    }


def bench_miss_rate(args, rng) -> dict:
    steps, n = args.miss_steps, max(args.batch // args.session_len, 1) * args.pooling
    stream = [to_ids(ranks(rng, n, args.vocab)) for _ in range(steps)]
    total = np.unique(np.concatenate(stream)).size
    peak = max(np.unique(s).size for s in stream)
    out = {"rows": int(total), "ids_per_batch": n}
    for pct in (1, 10, 50):
        budget = max(int(total * pct / 100), peak)
        with make_store(args, cache_rows=budget, pin_window=1) as store:
            for ids in stream:
                loc = store.prefetch(ids)
                store.push(loc, store.pull(loc))
                store.update()
            st = store.stats()
            out[f"{pct}%"] = {
                "budget_rows": budget,
                "miss_rate": st.miss_rate,
                "evictions": st.evictions,
            }
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(args.seed)
    result: dict = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "torch_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
    }
    tmp = Path(tempfile.mkdtemp(prefix="recpipe-store-bench-"))
    try:
        with tqdm(total=9, desc="store bench", file=sys.stderr) as bar:
            result.update(bench_index(args, rng))
            bar.update()
            batches = [session_batch(rng, args) for _ in range(args.steps)]
            result.update(bench_pull_push(args, batches))
            bar.update()
            result.update(bench_vs_fbgemm(args, batches))
            bar.update()
            result.update(bench_rho(args, rng))
            bar.update()
            result.update(bench_checkpoint_model(args, tmp))
            bar.update()
            ckpt, path, stream = bench_checkpoint(args, tmp)
            result.update(ckpt)
            bar.update()
            result["storage_choice"] = bench_storage_choice(
                args,
                tmp,
                rows=ckpt["checkpoint_rows_at_end"],
                dirty_rows=int(ckpt["checkpoint_rows_written_mean"]),
            )
            bar.update()
            result.update(bench_recovery(args, path, stream, tmp))
            bar.update()
            result["miss_rate"] = bench_miss_rate(args, rng)
            bar.update()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print_table(result)
    print(f"wrote {args.out}")
    return 0


def print_table(r: dict) -> None:
    def f(x, fmt="{:,.0f}"):
        return "n/a" if x is None else fmt.format(x)

    rows = [
        ("index ids/s/core (known)", f(r["index_ids_per_s_per_core"]), ">= 10M"),
        ("index ids/s/core (10% new)", f(r["index_ids_per_s_per_core_10pct_new"]), ""),
        ("pull+push rows/s (host)", f(r["pull_push_rows_per_s"]), ""),
        ("pull+push rows/s (hot set)", f(r["pull_push_rows_per_s_hot"]), ""),
        ("step vs fbgemm TBE (IKJT)", f(r["step_vs_fbgemm_tbe"], "{:.2f}x"), ">= 1.0"),
        ("step vs fbgemm TBE (KJT)", f(r.get("step_vs_fbgemm_tbe_no_dedup"), "{:.2f}x"), ""),
        *[(f"rho({k})", f"{v:.3f}", "") for k, v in r["rho"].items()],
        ("hot rows chosen (rho)", f"{r['chosen_hot_rows']:,} ({r['chosen_rho']:.3f})", ""),
        ("checkpoint overhead (DLRM training)", f(r["checkpoint_overhead"], "{:.3f}"), "<= 1.05"),
        (
            "checkpoint overhead, embedding only",
            f(r["checkpoint_overhead_embedding_only"], "{:.3f}"),
            "",
        ),
        ("  first interval", f(r["checkpoint_overhead_first_interval"], "{:.3f}"), ""),
        ("  whole run", f(r["checkpoint_overhead_whole_run"], "{:.3f}"), ""),
        ("  sync=process (no fsync)", f(r["checkpoint_overhead_sync_process"], "{:.3f}"), ""),
        ("  blocking part", f(r["checkpoint_blocking_overhead"], "{:.3f}"), ""),
        ("  training-thread CPU", f(r["checkpoint_train_thread_cpu_ratio"], "{:.3f}"), ""),
        ("  writer CPU / train CPU", f(r["checkpoint_writer_cpu_per_train_cpu"], "{:.3f}"), ""),
        ("  writer s / interval s", f(r["checkpoint_writer_seconds_per_interval"], "{:.3f}"), ""),
        *[
            (f"ckpt write s, {k}", f(v["steady_seconds"], "{:.3f}"), "")
            for k, v in r["storage_choice"].items()
            if isinstance(v, dict)
        ],
        ("recovery speedup", f(r["recovery_speedup"], "{:.1f}x"), ">= 3"),
        ("  cold page cache", f(r["recovery_speedup_cold_cache"], "{:.1f}x"), ""),
        ("  open(verify=True)", f(r["recovery_speedup_verify_all_rows"], "{:.1f}x"), ""),
        *[
            (f"miss rate @ {k} rows", f"{v['miss_rate']:.3f}", "")
            for k, v in r["miss_rate"].items()
            if isinstance(v, dict)
        ],
    ]
    w = max(len(a) for a, _, _ in rows)
    print(f"{'metric':<{w}}  {'value':>16}  target")
    for a, b, c in rows:
        print(f"{a:<{w}}  {b:>16}  {c}")


if __name__ == "__main__":
    sys.exit(main())
