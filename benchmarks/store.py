"""Benchmark of the hybrid embedding store; writes benchmarks/results/store.json.

Everything is measured in one run, as ratios against a baseline in the same run where there is
one, with the cases alternated (the order rotating each repeat), the median kept and the spread
(min / median / max over repeats) reported beside it, and, where wall time is measured, the
CPU-time ratio too (``benchmarks/_common.py``). Batches resemble the synthetic data
(etl/synth.py): sessions of ``--session-len`` samples share a user list of ``--pooling`` ids (so
an IKJT holds B / session-len unique rows), ids follow the synth's popularity law
``floor(V * u**3)`` over a vocabulary of ``--vocab`` ids, spread over the whole int64 range.

Before anything is timed, every code path of the store runs once on a tiny store (Numba compiles
or loads each kernel on its first call in a process: seconds with an empty cache, a new user's
first run), so no first-call cost lands inside a timed section.

    python -m benchmarks.store            # defaults of the issue: batches of 4096 x 30 ids
    python -m benchmarks.store --only checkpoint   # only checkpoint_overhead (and its twins)
    python -m benchmarks.store --help

``--only checkpoint`` runs just the DLRM checkpoint runs (checkpoint_overhead, its CPU-time and
in-run twins: ``checkpoint_overhead_*`` and ``checkpoint_model``) and merges them into ``--out``;
the other figures, and the environment they were measured in, stay as they are (these carry
theirs, and the load average before and after, under ``checkpoint_model``).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from benchmarks._common import (
    RESULTS,
    alternate,
    environment,
    ratio_spread,
    spread,
    timing_ratio,
    write_results,
)
from trainer.store import (
    EmbeddingStore,
    IdIndex,
    StoreConfig,
    StoreEmbeddingBag,
    open_store,
)
from trainer.store.persist import write_row_block

ROOT = Path(__file__).resolve().parents[1]

DEFAULT_OUT = RESULTS / "store.json"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=int, default=4096, help="samples per batch (B)")
    p.add_argument("--pooling", type=int, default=30, help="ids per sample")
    p.add_argument("--session-len", type=int, default=16, help="samples per session (dedup)")
    p.add_argument("--vocab", type=int, default=2_000_000, help="distinct ids in the data")
    p.add_argument("--dim", type=int, default=64, help="embedding dimension")
    p.add_argument("--steps", type=int, default=30, help="batches per measurement")
    p.add_argument("--ckpt-steps", type=int, default=500, help="timed steps of a checkpoint run")
    p.add_argument("--ckpt-every", type=int, default=100, help="checkpoint interval (steps)")
    p.add_argument(
        "--ckpt-warmup", type=int, default=100, help="untimed steps before (rows, allocations)"
    )
    p.add_argument(
        "--ckpt-repeats", type=int, default=5, help="alternated repeats of the checkpoint runs"
    )
    p.add_argument(
        "--model-requests",
        type=int,
        default=200_000,
        help="synthetic requests of the dataset the DLRM checkpoint runs train on",
    )
    p.add_argument("--model-steps", type=int, default=200, help="steps of a DLRM checkpoint run")
    p.add_argument(
        "--model-repeats", type=int, default=5, help="alternated repeats of the DLRM runs"
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
        "--recovery-repeats",
        type=int,
        default=11,
        help="alternated repeats of the recovery processes (a second or two each; wall times of "
        "tens of ms on a shared machine: more repeats steady the median)",
    )
    p.add_argument("--repeats", type=int, default=5, help="alternated repeats of the other cases")
    p.add_argument("--threads", type=int, default=1, help="torch threads (ours and fbgemm)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the JSON written")
    p.add_argument(
        "--only",
        choices=["checkpoint"],
        help="checkpoint: only the DLRM checkpoint runs (checkpoint_overhead), merged into --out",
    )
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- data


def to_ids(ranks: np.ndarray) -> np.ndarray:
    """Spread popularity ranks over the whole int64 range (a bijection: an odd multiplier)."""
    return (np.asarray(ranks, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)).view(np.int64)


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


def rate(count: float, timings) -> dict[str, Any]:
    """``count`` per second of each timed repeat: the median and its spread."""
    s = spread([count / t.wall_s for t in timings])
    return {"median": s["median"], "wall": s}


# ----------------------------------------------------------------------------- warm-up


def warm_up_kernels(tmp: Path, *, dim: int) -> None:
    """Run every code path of the store once on a tiny store (see the module docstring)."""
    cfg = StoreConfig(dim=dim, optimizer="sgd", chunk_rows=64, cache_rows=256, pin_window=1)
    rng = np.random.default_rng(0)
    path = tmp / "warm-up"
    with EmbeddingStore.create(path, cfg) as store:
        bag = StoreEmbeddingBag(store)
        for step in range(6):  # evictions, reads back, checksums
            batch = {
                "ids": torch.from_numpy(to_ids(rng.integers(0, 400, 120))),
                "offsets": torch.arange(0, 121, 4),
                "inverse": torch.arange(30),
            }
            train_step(bag, batch)
            if step == 2:
                store.checkpoint(step, wait=False)  # the next update copies on write
        store.wait_checkpoint()
        store.reshard(8)
        train_step(bag, batch)
        store.checkpoint(6)
    open_store(path, cache_rows=256, pin_window=1, verify=True).close()
    shutil.rmtree(path)


# ----------------------------------------------------------------------------- measurements


def bench_index(args, rng) -> dict:
    known = to_ids(np.arange(args.index_rows))
    index = IdIndex(num_shards=16)
    index.insert(known)
    n = args.batch * args.pooling
    batches = [known[ranks(rng, n, args.index_rows)] for _ in range(args.steps)]
    fresh = iter(to_ids(np.arange(args.index_rows, args.index_rows + n * args.steps * 40)))

    def known_pass():
        for b in batches:
            index.insert(b)

    def new_pass():  # 10% of each batch's ids are new (fresh ones every pass)
        for b in batches:
            b = b.copy()
            pos = rng.choice(n, n // 10, replace=False)
            b[pos] = np.fromiter(fresh, np.int64, count=pos.size)
            index.insert(b)

    runs = alternate({"known": known_pass, "new": new_pass}, repeats=args.repeats)
    total = n * len(batches)
    known_rate, new_rate = rate(total, runs["known"]), rate(total, runs["new"])
    return {
        "index_ids_per_s_per_core": known_rate["median"],
        "index_ids_per_s_per_core_10pct_new": new_rate["median"],
        "index_ids_per_s_spread": {"known": known_rate["wall"], "10pct_new": new_rate["wall"]},
        "index_rows_after": index.num_rows,
        "target_ids_per_s": 10e6,
    }


def bench_pull_push(args, batches) -> dict:
    with make_store(args, hot_budget_rows=1 << 20) as store:
        for b in batches:  # create and cache every row
            store.prefetch(b["ids"])
        store.restart_counting(len(batches))
        rows = 0
        for b in batches:
            rows += store.prefetch(b["ids"]).num_unique

        def cycle():
            for b in batches:
                loc = store.prefetch(b["ids"])
                store.push(loc, store.pull(loc))
                store.update()

        host = rate(rows, alternate({"host": cycle}, repeats=args.repeats)["host"])
        store.reshard(min(store.num_rows, 1 << 20))  # every row of these batches is hot
        hot = rate(rows, alternate({"hot": cycle}, repeats=args.repeats)["hot"])
        return {
            "pull_push_rows_per_s": host["median"],
            "pull_push_rows_per_s_hot": hot["median"],
            "pull_push_rows_per_s_spread": {"host": host["wall"], "hot": hot["wall"]},
            "hot_rows_in_probe": store.stats().hot_rows,
        }


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
            tbe(b["kjt_ranks"], b["kjt_offsets"]).sum().backward()

    with make_store(args) as store:
        bag = StoreEmbeddingBag(store)
        for b in batches:  # same rows present in both: fbgemm's table is preallocated
            train_step(bag, b)
            train_step(bag, b, dedup=False)
        cases = {
            "fbgemm": fbgemm,
            "store": lambda: [train_step(bag, b) for b in batches],
            "store_kjt": lambda: [train_step(bag, b, dedup=False) for b in batches],
        }
        runs = alternate(cases, repeats=args.repeats)
    samples = args.batch * len(batches)
    ikjt = timing_ratio(runs, "store", "fbgemm", per="rate")
    kjt = timing_ratio(runs, "store_kjt", "fbgemm", per="rate")
    return {
        "step_vs_fbgemm_tbe": ikjt["median"],
        "step_vs_fbgemm_tbe_spread": ikjt,
        "step_vs_fbgemm_tbe_no_dedup": kjt["median"],
        "step_vs_fbgemm_tbe_no_dedup_spread": kjt,
        "store_samples_per_s": rate(samples, runs["store"])["median"],
        "store_samples_per_s_no_dedup": rate(samples, runs["store_kjt"])["median"],
        "fbgemm_samples_per_s": rate(samples, runs["fbgemm"])["median"],
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


MODEL_RATIO_MEANS = (
    "checkpoint_overhead = wall time of `recpipe train --store hybrid` (trainer.train.train: the "
    "trainer benchmark's DLRM on a synthetic dataset of `requests`, adagrad, B=`batch`, one "
    "torch thread, the data read by the trainer's own loader) for `model_steps` steps with "
    "`--checkpoint-every ckpt_every` / the same run without checkpoints (TrainResult.wall_s: the "
    "training loop, the checkpoints taken inside it included; start-up and the final save "
    "excluded; no held-out split). A checkpoint = every table's store checkpointed, the stores "
    "together (each one's writer thread at once: "
    "trainer.store.checkpoints.checkpoint_stores; only "
    "rows changed since the last one; blocking, sync='full': fsync + atomic commit record) + the "
    "dense model, optimizers and reader position saved atomically. Runs alternated (the order "
    "rotates each repeat) after one short untimed run of each mode (with a checkpoint: the "
    "writer's kernels are loaded before any timed run); median of the per-repeat ratios, with "
    "their spread and the process-CPU-time ratio of the same runs (whole train() call). "
    "checkpoint_overhead_in_run: 1 + the seconds the stores spent checkpointing inside the loop "
    "(checkpoints.jsonl: each step's commits from the first start to the last end) / the rest of "
    "the same run's loop; it has none of the run-to-run noise, "
    "but leaves out the dense state's save and any slowdown after a checkpoint."
)


def build_dataset(work: Path, *, requests: int, seed: int) -> Path:
    """Synthetic logs of ``requests`` -> the clustered dataset the DLRM runs train on."""
    from etl.build import BuildConfig, build
    from etl.synth import SynthConfig, generate
    from schemas import default_schema

    logs = generate(work / "raw", SynthConfig(num_requests=requests, seed=seed))
    out = work / "clustered"
    schema = default_schema()
    build(logs.features, out, events=logs.events, schema=schema, config=BuildConfig())
    return out


def _commit_seconds(info: list[dict]) -> float:
    """Wall seconds the stores' checkpoints of each step took together (they commit at once:
    from the first one's start to the last one's end), summed over the steps."""
    by_step: dict[int, list[dict]] = {}
    for c in info:
        by_step.setdefault(c["step"], []).append(c)
    return sum(
        max(c["time"] for c in cs) - min(c["time"] - c["seconds"] for c in cs)
        for cs in by_step.values()
    )


def bench_checkpoint_model(args, tmp: Path) -> dict:
    """checkpoint_overhead of real training (see MODEL_RATIO_MEANS)."""
    from trainer.train import TrainConfig, train

    work = tmp / "model"
    dataset = build_dataset(work, requests=args.model_requests, seed=args.seed)

    def run(every: int, steps: int) -> dict:
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
        return {"wall": result.wall_s, "info": info}

    run(0, 2)  # warm-up of each mode: Numba's first calls, allocator, page cache of the dataset
    run(1, 2)
    runs = alternate(
        {
            "without": lambda: run(0, args.model_steps),
            "with": lambda: run(args.ckpt_every, args.model_steps),
        },
        repeats=args.model_repeats,
        warmup=False,
    )
    wall = {m: [t.value["wall"] for t in runs[m]] for m in runs}
    ratio = ratio_spread(wall["with"], wall["without"])
    cpu = ratio_spread([t.cpu_s for t in runs["with"]], [t.cpu_s for t in runs["without"]])
    in_run = []
    for t in runs["with"]:  # the checkpoints inside the loop (the final save is not timed)
        inside = _commit_seconds([c for c in t.value["info"] if c["step"] % args.ckpt_every == 0])
        in_run.append(t.value["wall"] / (t.value["wall"] - inside))
    info = runs["with"][-1].value["info"]
    by_step: dict[int, list[dict]] = {}  # store checkpoints per training step
    for c in info:
        by_step.setdefault(c["step"], []).append(c)
    return {
        "checkpoint_overhead": ratio["median"],
        "checkpoint_overhead_spread": {"wall": ratio, "cpu": cpu},
        "checkpoint_overhead_in_run": spread(in_run)["median"],
        "checkpoint_overhead_in_run_spread": spread(in_run),
        "checkpoint_overhead_measures": MODEL_RATIO_MEANS,
        "checkpoint_model": {
            "steps": args.model_steps,
            "every": args.ckpt_every,
            "requests": args.model_requests,
            "train_seconds_without": wall["without"],
            "train_seconds_with": wall["with"],
            "stores": len({c["store"] for c in info}),
            "checkpoints": [
                {
                    "step": step,
                    "store_checkpoints": len(cs),
                    "rows_written": sum(c["rows_written"] for c in cs),
                    "rows": sum(c["rows"] for c in cs),
                    "seconds": round(_commit_seconds(cs), 4),  # first start to last end
                }
                for step, cs in sorted(by_step.items())
            ],
        },
    }


CHECKPOINT_RATIO_MEANS = (
    "The stress case (no dense model: a step is only the store's lookup, backward and update, "
    "a few ms): checkpoint_overhead_embedding_only = wall time of the steady-state intervals of "
    "a run that checkpoints every `ckpt_every` steps (sync='full': fsync + atomic commit record), "
    "divided by the same intervals of the same run without checkpoints: same batches, same torch "
    "threads, runs alternated (the order rotates each repeat), median over repeats with its "
    "spread. A run trains `ckpt_warmup` untimed steps, then `ckpt_steps` timed steps in "
    "intervals of `ckpt_every`; an interval = waiting for the previous checkpoint if still "
    "running + the blocking snapshot + `ckpt_every` training steps with the writer thread "
    "running beside them; the last interval includes waiting for the last checkpoint. Steady "
    "state = every interval but the first; the first (the store's first checkpoint: every row "
    "new, the file freshly grown) is reported apart as checkpoint_overhead_first_interval (the "
    "other checkpoint_* figures below describe this stress case too)."
)


def bench_checkpoint(args, tmp: Path) -> tuple[dict, Path, list]:
    """Training time with a checkpoint every ``ckpt_every`` steps / without (see
    CHECKPOINT_RATIO_MEANS)."""
    rng = np.random.default_rng(args.seed + 1)
    warm, every = args.ckpt_warmup, args.ckpt_every
    stream = [session_batch(rng, args) for _ in range(warm + args.ckpt_steps)]
    keep = tmp / "full-last"
    count = {"n": 0}

    def run(sync: str | None) -> dict:
        count["n"] += 1
        path = tmp / f"ckpt-run-{count['n']}"
        store = make_store(args, path, sync=sync or "full")
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
            out["info"] = [
                json.loads(x) for x in (path / "checkpoints.jsonl").read_text().splitlines()
            ]
        if sync == "full":  # the last full run's store is the recovery benchmark's crashed one
            shutil.rmtree(keep, ignore_errors=True)
            path.rename(keep)
        else:
            shutil.rmtree(path)
        return out

    cases: dict[str, Callable[[], dict]] = {
        "without": lambda: run(None),
        "full": lambda: run("full"),
        "process": lambda: run("process"),
    }
    timed = alternate(cases, repeats=args.ckpt_repeats, warmup=False)
    runs = {m: [t.value for t in timed[m]] for m in timed}

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
    cpu_ratio = ratio_spread(
        [w["train_thread_cpu"] for w in runs["full"]],
        [wo["train_thread_cpu"] for wo in runs["without"]],
    )
    return (
        {
            "checkpoint_overhead_embedding_only": spread(ratios("full", steady))["median"],
            "checkpoint_overhead_embedding_only_spread": spread(ratios("full", steady)),
            "checkpoint_overhead_first_interval": spread(ratios("full", slice(0, 1)))["median"],
            "checkpoint_overhead_whole_run": spread(ratios("full", slice(None)))["median"],
            "checkpoint_overhead_sync_process": spread(ratios("process", steady))["median"],
            "checkpoint_overhead_embedding_only_measures": CHECKPOINT_RATIO_MEANS,
            "checkpoint_blocking_overhead": 1.0 + float(np.mean(blocking)) * n_steady / base,
            "checkpoint_train_thread_cpu_ratio": cpu_ratio["median"],
            "checkpoint_train_thread_cpu_ratio_spread": cpu_ratio,
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
                write_row_block(words, staged, pos)
                os.fsync(fd)
                committed[dirty] ^= 1
            elif kind == "in_place_undo_log":  # log the old images, fsync, write in place, fsync
                log.seek(0)
                log.write(dirty)
                log.write(words[dirty])
                log.flush()
                os.fsync(log.fileno())
                write_row_block(words, staged, dirty)
                os.fsync(fd)
                log.truncate(0)
            else:  # log_structured_append: the dirty rows appended contiguously, fsync
                buf = np.empty((dirty.size, width + 1), dtype=np.uint32)
                write_row_block(buf, staged, np.arange(dirty.size))
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
        "steady_seconds_spread": spread(wall[steady]),
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
import json, os, sys, time
import numpy as np
from trainer.store import IdIndex, open_store
what, path, tiny, cold, ballast = sys.argv[1:4] + [sys.argv[4] == "1", int(sys.argv[5])]
# one-time costs of a fresh process (imports, every kernel's first call: the same for all ways
# and for any table size) are paid on a tiny store and a tiny dump first, every way each time
open_store(tiny).close()
open_store(tiny, verify=True).close()
IdIndex.from_ids(np.load(os.path.join(tiny, "dump-ids.npy")))
np.load(os.path.join(tiny, "dump-values.npy"))
if cold:  # evict the files from the page cache (they are clean: written and synced before)
    for name in os.listdir(path):
        fd = os.open(os.path.join(path, name), os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
# as after a crash, the memory the crashed process held is free: fault in and release as much,
# so that no way pays for reclaiming or compacting memory that other processes hold
np.ones(ballast, dtype=np.uint8)
c0, t0 = time.process_time(), time.perf_counter()
if what == "dump":
    ids = np.load(os.path.join(path, "ids.npy"))
    values = np.load(os.path.join(path, "values.npy"))
    IdIndex.from_ids(ids)
elif what == "open":
    open_store(path).close()
else:  # "verify": open and check every row's checksum now
    open_store(path, verify=True).close()
print(json.dumps({"wall": time.perf_counter() - t0, "cpu": time.process_time() - c0}))
"""

RECOVERY_MEASURES = (
    "fresh process per recovery, as after a crash; before the timed part each pays its one-time "
    "costs (imports, every kernel's first call) on a tiny store and dump, and faults in and "
    "releases as much memory as the dump takes twice (the crashed process's memory is free "
    "again); full dump = np.load of ids + rows and IdIndex.from_ids; open = open_store (rows are "
    "checked when first read); verify = open_store(verify=True), every row read and checked; "
    "warm page cache, and cold (the files evicted with posix_fadvise first); the six cases "
    "alternated (order rotating) `recovery_repeats` times, median of the per-repeat ratios with "
    "their spread and the CPU-time ratio of the same processes"
)


def _tiny_recovery_store(args, tiny: Path) -> None:
    """A small store whose open runs every recovery path: a saved index plus later ids that
    grow its shards, and a dump beside it."""
    with make_store(args, tiny, chunk_rows=4096) as small:
        small.prefetch(np.arange(7000, dtype=np.int64))
        small.checkpoint(0)  # the index is saved here ...
        small.prefetch(np.arange(7000, 8700, dtype=np.int64))
        small.checkpoint(1)  # ... not here (grew by less than 1/4): open inserts the rest,
        # which grows a shard of the index
    np.save(tiny / "dump-ids.npy", np.arange(100, dtype=np.int64))
    np.save(tiny / "dump-values.npy", np.zeros((100, args.dim), np.float32))


def bench_recovery(args, path: Path, stream, tmp: Path) -> dict:
    """Time to reload a full dump (ids + rows as .npy, then rebuild the id index) / time for
    ``open_store`` of the store a crashed run left behind (see RECOVERY_MEASURES)."""
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
    _tiny_recovery_store(args, tiny)
    ballast = 2 * (ids.nbytes + values.nbytes)
    os.sync()  # every file clean, so that write-back slows no timing and eviction works

    def child(what: str, target: Path, cold: bool) -> Callable[[], dict]:
        cmd = [sys.executable, "-c", RECOVERY_CHILD, what, str(target), str(tiny)]
        cmd += ["1" if cold else "0", str(ballast)]
        env = dict(os.environ, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1")

        def call() -> dict:
            out = subprocess.run(
                cmd, capture_output=True, text=True, env=env, cwd=ROOT, check=True, timeout=600
            )
            return json.loads(out.stdout.strip().splitlines()[-1])

        return call

    cases = {
        f"{what}_{'cold' if cold else 'warm'}": child(what, target, cold)
        for cold in (False, True)
        for what, target in (("dump", dump), ("open", path), ("verify", path))
    }
    runs = alternate(cases, repeats=args.recovery_repeats, warmup=False)
    measured = {k: {m: [t.value[m] for t in v] for m in ("wall", "cpu")} for k, v in runs.items()}

    def speedup(num: str, den: str) -> dict:
        wall = ratio_spread(measured[num]["wall"], measured[den]["wall"])
        cpu = ratio_spread(measured[num]["cpu"], measured[den]["cpu"])
        return {"median": wall["median"], "wall": wall, "cpu": cpu}

    warm = speedup("dump_warm", "open_warm")
    cold = speedup("dump_cold", "open_cold")
    verify = speedup("dump_warm", "verify_warm")
    return {
        "recovery_speedup": warm["median"],
        "recovery_speedup_spread": warm,
        "recovery_speedup_cold_cache": cold["median"],
        "recovery_speedup_cold_cache_spread": cold,
        "recovery_speedup_verify_all_rows": verify["median"],
        "recovery_speedup_verify_all_rows_spread": verify,
        "recovery_seconds": {k: spread(v["wall"]) for k, v in measured.items()},
        "recovery_cpu_seconds": {k: spread(v["cpu"]) for k, v in measured.items()},
        "recovery_measures": RECOVERY_MEASURES,
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


def run_checkpoint_only(args: argparse.Namespace) -> dict:
    """``--only checkpoint``: checkpoint_overhead and its twins, merged into ``args.out`` (its
    other figures and their ``environment`` stay)."""
    tmp = Path(tempfile.mkdtemp(prefix="recpipe-store-bench-"))
    try:
        t0, before = time.perf_counter(), list(os.getloadavg())
        got = bench_checkpoint_model(args, tmp)
        got["checkpoint_model"].update(
            load_average_before_after=[*before, *os.getloadavg()],
            wall_s=round(time.perf_counter() - t0, 1),
            environment=environment(),
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    merged = json.loads(args.out.read_text()) if args.out.exists() else {}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**merged, **got}, indent=1, default=float) + "\n")
    return got


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    if args.only == "checkpoint":
        got = run_checkpoint_only(args)
        ck = got["checkpoint_overhead_spread"]
        print(
            f"checkpoint_overhead {got['checkpoint_overhead']:.3f} (wall "
            f"{ck['wall']['min']:.3f}-{ck['wall']['max']:.3f}; CPU {ck['cpu']['median']:.3f}); "
            f"in the run {got['checkpoint_overhead_in_run']:.3f}"
        )
        print(f"wrote {args.out}")
        return 0
    rng = np.random.default_rng(args.seed)
    result: dict = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "torch_threads": torch.get_num_threads(),
    }
    tmp = Path(tempfile.mkdtemp(prefix="recpipe-store-bench-"))
    try:
        with tqdm(total=10, desc="store bench", file=sys.stderr) as bar:
            warm_up_kernels(tmp, dim=args.dim)
            bar.update()
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
    write_results(result, args.out)
    print_table(result)
    print(f"wrote {args.out}")
    return 0


def print_table(r: dict) -> None:
    def f(x, fmt="{:,.0f}"):
        return "n/a" if x is None else fmt.format(x)

    def sp(s: dict | None, fmt="{:.3f}") -> str:
        """' (min-max, CPU c)' of a ratio's spread."""
        if not s:
            return ""
        wall = s.get("wall", s)
        text = f" ({fmt.format(wall['min'])}-{fmt.format(wall['max'])}"
        return text + (f", CPU {fmt.format(s['cpu']['median'])})" if "cpu" in s else ")")

    ck = r["checkpoint_overhead_spread"]
    rows = [
        ("index ids/s/core (known)", f(r["index_ids_per_s_per_core"]), ">= 10M"),
        ("index ids/s/core (10% new)", f(r["index_ids_per_s_per_core_10pct_new"]), ""),
        ("pull+push rows/s (host)", f(r["pull_push_rows_per_s"]), ""),
        ("pull+push rows/s (hot set)", f(r["pull_push_rows_per_s_hot"]), ""),
        (
            "step vs fbgemm TBE (IKJT)",
            f(r["step_vs_fbgemm_tbe"], "{:.2f}x")
            + sp(r.get("step_vs_fbgemm_tbe_spread"), "{:.2f}"),
            ">= 1.0",
        ),
        ("step vs fbgemm TBE (KJT)", f(r.get("step_vs_fbgemm_tbe_no_dedup"), "{:.2f}x"), ""),
        *[(f"rho({k})", f"{v:.3f}", "") for k, v in r["rho"].items()],
        ("hot rows chosen (rho)", f"{r['chosen_hot_rows']:,} ({r['chosen_rho']:.3f})", ""),
        (
            "checkpoint overhead (DLRM training)",
            f(r["checkpoint_overhead"], "{:.3f}") + sp({"wall": ck["wall"], "cpu": ck["cpu"]}),
            "<= 1.05",
        ),
        ("  within the run (store part)", f(r["checkpoint_overhead_in_run"], "{:.3f}"), ""),
        (
            "checkpoint overhead, embedding only",
            f(r["checkpoint_overhead_embedding_only"], "{:.3f}")
            + sp(r["checkpoint_overhead_embedding_only_spread"]),
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
        (
            "recovery speedup",
            f(r["recovery_speedup"], "{:.1f}x") + sp(r["recovery_speedup_spread"], "{:.1f}"),
            ">= 3",
        ),
        ("  cold page cache", f(r["recovery_speedup_cold_cache"], "{:.1f}x"), ""),
        ("  open(verify=True)", f(r["recovery_speedup_verify_all_rows"], "{:.1f}x"), ""),
        *[
            (f"miss rate @ {k} rows", f"{v['miss_rate']:.3f}", "")
            for k, v in r["miss_rate"].items()
            if isinstance(v, dict)
        ],
    ]
    w = max(len(a) for a, _, _ in rows)
    vw = max(len(b) for _, b, _ in rows)
    print(f"{'metric':<{w}}  {'value':>{vw}}  target")
    for a, b, c in rows:
        print(f"{a:<{w}}  {b:>{vw}}  {c}")


if __name__ == "__main__":
    sys.exit(main())
