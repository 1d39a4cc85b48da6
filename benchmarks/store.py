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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=int, default=4096, help="samples per batch (B)")
    p.add_argument("--pooling", type=int, default=30, help="ids per sample")
    p.add_argument("--session-len", type=int, default=16, help="samples per session (dedup)")
    p.add_argument("--vocab", type=int, default=2_000_000, help="distinct ids in the data")
    p.add_argument("--dim", type=int, default=64, help="embedding dimension")
    p.add_argument("--steps", type=int, default=30, help="timed steps per measurement")
    p.add_argument("--ckpt-steps", type=int, default=300, help="steps of the checkpoint run")
    p.add_argument("--ckpt-every", type=int, default=100, help="checkpoint interval (steps)")
    p.add_argument("--index-rows", type=int, default=1_000_000, help="ids in the index")
    p.add_argument("--miss-steps", type=int, default=200, help="steps of the miss-rate runs")
    p.add_argument("--repeats", type=int, default=3, help="repeats (best time is kept)")
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


def bench_checkpoint(args, stream, tmp: Path) -> dict:
    def run(every: int | None, name: str) -> tuple[float, EmbeddingStore]:
        store = make_store(args, tmp / name)
        bag = StoreEmbeddingBag(store)
        t0 = time.perf_counter()
        for step, b in enumerate(stream):
            train_step(bag, b)
            if every and step % every == every - 1:
                store.checkpoint(step, wait=False)  # written in the background
        store.wait_checkpoint()  # the last one is durable before the clock stops
        return time.perf_counter() - t0, store

    times = {"with": [], "without": []}
    for r in range(args.repeats):
        for mode in ("without", "with"):
            t, store = run(args.ckpt_every if mode == "with" else None, f"{mode}{r}")
            times[mode].append(t)
            store.close()
            if not (r == args.repeats - 1 and mode == "with"):
                shutil.rmtree(tmp / f"{mode}{r}")
    last = tmp / f"with{args.repeats - 1}"
    info = [json.loads(x) for x in (last / "checkpoints.jsonl").read_text().splitlines()]
    blocking = sum(c["snapshot_seconds"] for c in info)
    return {
        "checkpoint_overhead": min(times["with"]) / min(times["without"]),
        "checkpoint_blocking_overhead": 1.0 + blocking / min(times["without"]),
        "checkpoint_seconds_mean": float(np.mean([c["seconds"] for c in info])),
        "checkpoint_rows_written_mean": float(np.mean([c["rows_written"] for c in info])),
        "train_seconds_without": min(times["without"]),
    }, last


def bench_recovery(args, path: Path, stream, tmp: Path) -> dict:
    store = open_store(path)
    bag = StoreEmbeddingBag(store)
    for b in stream[:10]:  # uncommitted work, then a "crash": the store is dropped unsaved
        train_step(bag, b)
    ids, values = store.export()
    store.close()
    rows = ids.size
    dump = tmp / "dump"
    dump.mkdir()
    np.save(dump / "ids.npy", ids)
    np.save(dump / "values.npy", values)
    os.sync()  # let the dump's write-back finish, so it does not slow the timings below

    def reload_dump():
        i = np.load(dump / "ids.npy")
        v = np.load(dump / "values.npy")
        IdIndex.from_ids(i)
        return v

    def recover():
        s = open_store(path)
        s.close()

    # time the first recovery after the "crash" alone too (cold structures)
    t0 = time.perf_counter()
    recover()
    t_first = time.perf_counter() - t0
    t_open = min(t_first, best(recover, args.repeats))
    t_dump = best(reload_dump, args.repeats)
    return {
        "recovery_speedup": t_dump / t_first,
        "recovery_speedup_warm_open": t_dump / t_open,
        "full_dump_reload_s": t_dump,
        "open_after_crash_s": t_first,
        "rows": rows,
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
        with tqdm(total=7, desc="store bench", file=sys.stderr) as bar:
            result.update(bench_index(args, rng))
            bar.update()
            batches = [session_batch(rng, args) for _ in range(args.steps)]
            result.update(bench_pull_push(args, batches))
            bar.update()
            result.update(bench_vs_fbgemm(args, batches))
            bar.update()
            result.update(bench_rho(args, rng))
            bar.update()
            stream = [session_batch(rng, args) for _ in range(args.ckpt_steps)]
            ckpt, path = bench_checkpoint(args, stream, tmp)
            result.update(ckpt)
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
        ("checkpoint overhead", f(r["checkpoint_overhead"], "{:.3f}"), "<= 1.05"),
        ("  of which blocking", f(r["checkpoint_blocking_overhead"], "{:.3f}"), ""),
        ("recovery speedup", f(r["recovery_speedup"], "{:.1f}x"), ">= 3"),
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
