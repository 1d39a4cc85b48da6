"""What the main process pays to receive a batch from DataLoader workers: packed vs per tensor.

A loader with workers (``readers.dataset.make_dataloader``) hands each batch from a worker
process to the main process. Per tensor (``packed=False``), every tensor of the batch crosses
as its own shared-memory segment, whose file descriptor the main process fetches from the worker
in a round trip; packed (the default with workers), the worker copies the batch into one buffer
(``Batch.pack``) and the main process rebuilds it as views (``PackedBatch.unpack``). This
script measures, on the readers' own data, in one run with the two ways alternated:

  receive_ms           wall time of ``next(loader)`` once the workers are ahead (they have
                       filled the prefetch queue while the main process slept): receiving,
                       unpickling and unpacking one batch; with ``--device cuda`` also pinning
                       (torch's pin-memory thread) and ``batch.to(device, non_blocking=True)``
  receive_cpu_ms       the main thread's CPU time for the same
  other_threads_cpu_ms the main process's other threads (the pin-memory thread) per batch
  packed_vs_tensors    receive_ms packed / per tensor (< 1: packed is cheaper), per round
  batch                tensors, bytes and distinct storages of one received batch, both ways
  worker_samples_per_s one reader's production rate (in this process, one thread), which
                       with the target rate gives an estimate of the workers needed
  epoch_gap_ms         the wait for an epoch's first batch when the consumer had all the time
                       it needed (it slept ``--settle`` after the last batch of the epoch before):
                       with ``epochs_ahead`` (the workers read on into the next epoch) vs
                       without (every worker starts the epoch only when it is asked for),
                       packed both ways, alternated over ``--gap-rounds``

Each round builds a fresh loader per way (the order rotating each round), drops the first
two batches, then sleeps ``--settle`` seconds before each burst of ``workers * prefetch - 1``
timed batches; a burst never crosses an epoch end (a new epoch restarts the workers).

    python -m benchmarks.transport --dataset .gpu_data/clustered --out /tmp/transport.json
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks._common import ratio_spread, spread, write_results

WAYS = ("packed", "tensors")


def batch_facts(batch: Any) -> dict[str, int]:
    """Tensors, bytes and distinct storages of a batch as the loader handed it out."""
    tensors = batch._parts()[1]
    return {
        "tensors": len(tensors),
        "bytes": sum(t.numel() * t.element_size() for t in tensors),
        "storages": len({t.untyped_storage().data_ptr() for t in tensors}),
    }


def worker_rate(dataset: Path, config: Any, *, batches: int) -> dict[str, float]:
    """Samples/s of one reader in this process (wall and CPU), after one untimed batch."""
    import torch

    from readers.dataset import ParquetBatchDataset

    torch.set_num_threads(1)  # as in a DataLoader worker
    stream = iter(ParquetBatchDataset(str(dataset), config=config, dedup=True))
    next(stream)
    rows, wall0, cpu0 = 0, time.perf_counter(), time.process_time()
    for _ in range(batches):
        rows += next(stream).batch_size
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    return {"samples_per_s_wall": rows / wall, "samples_per_s_cpu": rows / cpu}


def measure_round(
    dataset: Path, config: Any, *, packed: bool, args: argparse.Namespace
) -> dict[str, Any]:
    """One loader's per-batch receive cost, over one epoch (see the module docstring)."""
    import torch

    from readers.dataset import make_dataloader

    device = torch.device(args.device)
    pin = device.type == "cuda"
    loader = make_dataloader(
        dataset, config=config, num_workers=args.workers, pin_memory=pin, dedup=True,
        packed=packed, prefetch_factor=args.prefetch,
    )  # fmt: skip
    burst = args.workers * args.prefetch - 1
    walls: list[float] = []
    cpus: list[float] = []
    others: list[float] = []
    facts: dict[str, int] = {}
    it: Iterator[Any] = iter(loader)
    left = len(loader)
    for _ in range(2):  # the workers' start is not receiving
        facts = batch_facts(next(it))
        left -= 1
    while left > 0:
        time.sleep(args.settle)
        for _ in range(min(burst, left)):
            wall0, cpu0, proc0 = time.perf_counter(), time.thread_time(), time.process_time()
            batch = next(it)
            if pin:
                batch = batch.to(device, non_blocking=True)
            wall, cpu = time.perf_counter() - wall0, time.thread_time() - cpu0
            walls.append(wall)
            cpus.append(cpu)
            others.append(time.process_time() - proc0 - cpu)
            left -= 1
    if pin:
        torch.cuda.synchronize(device)
    for _ in it:  # the epoch's end marker
        pass
    return {
        "receive_ms": 1e3 * statistics.median(walls),
        "receive_cpu_ms": 1e3 * statistics.median(cpus),
        "other_threads_cpu_ms": 1e3 * statistics.median(others),
        "batches": len(walls),
        "batch": facts,
    }


def epoch_gaps(dataset: Path, config: Any, *, ahead: bool, args: argparse.Namespace) -> float:
    """Median wait (ms) for the first batch of epochs 1 and 2, the consumer idle before it."""
    from readers.dataset import make_dataloader

    loader = make_dataloader(
        dataset, config=config, num_workers=args.workers, dedup=True, epochs_ahead=ahead,
        prefetch_factor=args.prefetch,
    )  # fmt: skip
    gaps = []
    for epoch in range(3):
        it = iter(loader)
        time.sleep(args.settle)
        wall0 = time.perf_counter()
        next(it)
        if epoch:
            gaps.append(time.perf_counter() - wall0)
        for _ in it:
            pass
    return 1e3 * statistics.median(gaps)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Both ways, alternated over ``--rounds``; the worker rate; the estimate."""
    from readers.source import ReaderConfig

    config = ReaderConfig(batch_size=args.batch_size, shuffle=True, seed=1, last_batch="drop")
    rounds: dict[str, list[dict[str, Any]]] = {way: [] for way in WAYS}
    for r in range(args.rounds):
        order = WAYS[r % 2 :] + WAYS[: r % 2]
        for way in order:
            got = measure_round(args.dataset, config, packed=way == "packed", args=args)
            rounds[way].append(got)
            print(
                f"  round {r} {way:8s} receive {got['receive_ms']:7.2f} ms "
                f"(main-thread cpu {got['receive_cpu_ms']:6.2f} ms, "
                f"other threads {got['other_threads_cpu_ms']:6.2f} ms) over {got['batches']}",
                file=sys.stderr,
            )
    gaps: dict[str, list[float]] = {"ahead": [], "at_end": []}
    for r in range(args.gap_rounds):
        for way in list(gaps)[r % 2 :] + list(gaps)[: r % 2]:
            gaps[way].append(epoch_gaps(args.dataset, config, ahead=way == "ahead", args=args))
            print(f"  round {r} epoch gap {way:6s} {gaps[way][-1]:8.1f} ms", file=sys.stderr)
    rate = worker_rate(args.dataset, config, batches=args.worker_batches)
    per_worker = rate["samples_per_s_cpu"]
    out: dict[str, Any] = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "batch": {way: rounds[way][0]["batch"] for way in WAYS},
        "worker_samples_per_s": rate,
        "target_samples_per_s": args.target,
        "workers_for_target": math.ceil(args.target / per_worker),
    }
    for key in ("receive_ms", "receive_cpu_ms", "other_threads_cpu_ms"):
        out[key] = {way: spread([g[key] for g in rounds[way]]) for way in WAYS}
    packed = [g["receive_ms"] for g in rounds["packed"]]
    tensors = [g["receive_ms"] for g in rounds["tensors"]]
    out["packed_vs_tensors"] = ratio_spread(packed, tensors)
    out["packed_vs_tensors_cpu"] = ratio_spread(
        [g["receive_cpu_ms"] for g in rounds["packed"]],
        [g["receive_cpu_ms"] for g in rounds["tensors"]],
    )
    if args.gap_rounds:
        out["epoch_gap_ms"] = {way: spread(values) for way, values in gaps.items()}
    batches_per_s = args.target / args.batch_size
    out["main_process_ms_budget_at_target"] = 1e3 / batches_per_s
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see ``--help``)."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--dataset",
        type=Path,
        default=Path(".gpu_data/clustered"),
        help="a clustered dataset (default .gpu_data/clustered, the one "
        "benchmarks.trainer.build_dataset writes for the GPU benchmark)",
    )
    parser.add_argument("--batch-size", type=int, default=32_768, help="rows (default 32768)")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers (default 2)")
    parser.add_argument("--prefetch", type=int, default=3, help="prefetch_factor (default 3)")
    parser.add_argument(
        "--rounds", type=int, default=5, help="alternated rounds of the receive figures (default 5)"
    )
    parser.add_argument(
        "--settle",
        type=float,
        default=2.0,
        help="seconds the workers get to fill the queue before a burst (default 2)",
    )
    parser.add_argument(
        "--gap-rounds",
        type=int,
        default=3,
        help="alternated rounds of the epoch-gap figure (default 3; 0: skip it)",
    )
    parser.add_argument(
        "--worker-batches",
        type=int,
        default=4,
        help="batches timed for one reader's rate (default 4)",
    )
    parser.add_argument(
        "--target",
        type=float,
        default=1.5e6,
        help="samples/s the readers must feed (default 1.5e6)",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="cpu, or cuda: pin and copy each batch to the device as the "
        "trainer does (default cpu)",
    )
    parser.add_argument("--out", type=Path, default=None, help="JSON output (default: none)")
    return parser.parse_args(argv)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Run, print the figures, write the JSON where ``--out`` says."""
    import json

    args = parse_args(argv)
    if args.rounds < 1 or args.gap_rounds < 0:
        print(f"benchmarks.transport: error: `--rounds` must be >= 1 and `--gap-rounds` >= 0, "
              f"got {args.rounds} and {args.gap_rounds}", file=sys.stderr)  # fmt: skip
        return 1
    if not args.dataset.is_dir():
        print(f"benchmarks.transport: error: no dataset at `--dataset` {args.dataset}; "
              "hint: benchmarks.trainer.build_dataset builds it", file=sys.stderr)  # fmt: skip
        return 1
    results = run(args)
    if args.out is not None:
        write_results(results, args.out)
    print(json.dumps({k: v for k, v in results.items() if k != "config"}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
