"""Reader service: bytes on the wire (KJT vs IKJT) and service vs in-process throughput.

Generates the default synthetic logs and builds the clustered dataset (`etl.synth`,
`etl.build`), or uses `--dataset`. The reader pipeline is the one of benchmarks/readers.py
(its `preprocess_config`: hash-modulo, truncation, a vocabulary lookup of the liked-items
history, dense fill/log1p/normalisation), run by `recpipe serve`'s `ReaderServer` with
`--readers` reader processes; a `ServiceClient` in this process reads over loopback TCP.

Figures (written to benchmarks/results/service.json):
  sent_bytes_per_sample   bytes on the wire per sample (framing included) for a whole epoch,
                          plain KJT (`--dedup off`) vs IKJT (`--dedup on`), same pipeline.
                          RecD: 837 -> 713 GB.
  service_vs_inprocess    samples/s delivered to the client by the service / samples/s of the
                          same pipeline run in this process (`readers.dataset.iter_batches`),
                          IKJT path. Wall clock, steady state: from the first batch received
                          (reader start-up is reported apart); beside it the CPU-time twin:
                          CPU seconds per sample in-process / over the service (this process
                          and the reader processes). Target >= 0.8 (the wall median).
  kept_reader             two clients one after the other on one server with one reader
                          process (a trainer's epochs; the second gets the first one's
                          process): start-up (time to the first batch), samples/s and the
                          reader's CPU seconds per batch of each, with the reader warmed up
                          before the first client (the default) and without; and the kept
                          reader's resident memory.
  read_ahead_speedup      samples/s with `--read-ahead` (default 1: a second thread decodes the
                          next row group) / with 0, in-process and over the service, IKJT path;
                          measured in the same alternated loop (not with `--read-ahead 0`).
                          Short epochs are ruled by a few row-group loads, so the ratio is
                          only stable over whole epochs of the default 1M-request dataset.

Each service case starts a server (its reader process starts with it and warms up on
`DatasetProducer.warmup_batches` batches before the client's first batch: the start-up figure
includes that) and reads one whole epoch through one client.

Every thread pool is limited to one thread (OMP/Numba/Arrow), in this process and in the
reader processes, so `--readers 1` compares one reader with one reader; with read-ahead each of
them also runs its decode thread. Cases run through `_common.alternate` (one untimed warm-up
call each, then `--repeats` alternated repeats in rotating order), and every ratio reports its
median with its spread (min, median, max over the repeats, each repeat's cases paired).
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks._common import Timing, alternate, spread, timing_ratio, write_results

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "service.json"
TARGET_SERVICE_VS_INPROCESS = 0.8

__all__ = ["main", "measure_inprocess", "measure_service", "parse_args", "run"]


def _bench_readers() -> Any:
    """benchmarks/readers.py, loaded by path (its name clashes with the `readers` package)."""
    path = Path(__file__).resolve().parent / "readers.py"
    spec = importlib.util.spec_from_file_location("recpipe_bench_readers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_dataset(work: Path, *, requests: int, seed: int) -> Path:
    """Synthetic logs -> the clustered dataset (session order), under ``work``."""
    from etl.build import BuildConfig, build
    from etl.synth import SynthConfig, generate
    from schemas import default_schema

    logs = generate(work / "raw", SynthConfig(num_requests=requests, seed=seed), progress=True)
    out = work / "clustered"
    build(
        logs.features,
        out,
        events=logs.events,
        schema=default_schema(),
        config=BuildConfig(),
        overwrite=True,
        progress=True,
    )
    return out


def measure_inprocess(
    dataset: Path,
    *,
    batch_size: int,
    preprocess: Any,
    dedup: bool,
    max_batches: int | None,
    read_ahead: int = 1,
) -> dict[str, float]:
    """Run the reader pipeline in this process; steady-state wall clock from the first batch."""
    from readers.dataset import iter_batches
    from readers.source import ReaderConfig

    config = ReaderConfig(batch_size=batch_size, read_ahead=read_ahead)
    stream = iter_batches(dataset, config=config, transforms=preprocess, dedup=dedup)
    return _timed(stream, max_batches, lambda: 0, cpu=_cpu_of([]))


def measure_service(
    dataset: Path,
    *,
    batch_size: int,
    preprocess: Any,
    dedup: bool,
    readers: int,
    queue_depth: int,
    max_batches: int | None,
    read_ahead: int = 1,
) -> dict[str, float]:
    """Serve the same pipeline over loopback TCP and read it with a client in this process."""
    from readers.service import DatasetProducer, ReaderServer, ServiceClient, ServiceConfig

    producer = DatasetProducer(
        str(dataset),
        batch_size=batch_size,
        dedup=dedup,
        preprocess=preprocess,
        read_ahead=read_ahead,
    )
    config = ServiceConfig(readers=readers, queue_depth=queue_depth, report_every_s=0)
    with ReaderServer(producer, config=config, log=io.StringIO()) as server:
        client = ServiceClient(*server.address, read_timeout_s=600)
        cpu = _cpu_of(server.reader_pids())  # the kept reader the client will get
        result = _timed(iter(client), max_batches, lambda: client.bytes_received, cpu=cpu)
        client.close()
    return result


def measure_next_client(
    dataset: Path, *, batch_size: int, preprocess: Any, max_batches: int | None
) -> dict[str, Any]:
    """Two clients one after the other on one server with one reader process (a trainer's
    epochs): the second gets the first one's process. For each: start-up (time to the first
    batch), samples/s and the reader process's CPU seconds per batch after the first batch;
    with the reader warmed up before the first client (the default) and without
    (``warmup_batches=0``). Also the kept reader's resident memory."""
    import psutil

    from readers.service import DatasetProducer, ReaderServer, ServiceClient, ServiceConfig

    out: dict[str, Any] = {}
    for name, warmup in (("warmed_up", DatasetProducer.warmup_batches), ("not_warmed_up", 0)):
        producer = DatasetProducer(
            str(dataset), batch_size=batch_size, preprocess=preprocess, warmup_batches=warmup
        )
        config = ServiceConfig(readers=1, report_every_s=0)
        with ReaderServer(producer, config=config, log=io.StringIO()) as server:
            (pid,) = server.reader_pids()
            reader = psutil.Process(pid)
            runs = {}
            for client_name in ("first_client", "next_client"):
                client = ServiceClient(*server.address, read_timeout_s=600)
                run = _timed(
                    iter(client),
                    max_batches,
                    lambda c=client: c.bytes_received,
                    cpu=lambda r=reader: sum(r.cpu_times()[:2]),
                )
                runs[client_name] = {**run, "reader_cpu_s_per_batch": run["cpu_s_per_batch"]}
                client.close()
                server.join_sessions(timeout=60)
            runs["reader_processes_started"] = server.stats().reader_processes_started
            runs["reader_rss_mb"] = reader.memory_info().rss / 2**20
        first, nxt = runs["first_client"], runs["next_client"]
        runs["first_vs_next_reader_cpu_per_batch"] = (
            first["reader_cpu_s_per_batch"] / nxt["reader_cpu_s_per_batch"]
        )
        out[name] = runs
    return out


def _cpu_of(pids: list[int]) -> Callable[[], float]:
    """CPU seconds (user + system) of this process and of the processes ``pids``, so far."""
    import psutil

    processes = [psutil.Process(pid) for pid in pids]
    return lambda: time.process_time() + sum(sum(p.cpu_times()[:2]) for p in processes)


def _timed(
    stream: Any, max_batches: int | None, received: Any, *, cpu: Callable[[], float]
) -> dict[str, float]:
    """Steady-state figures of a batch stream, from its first batch on; ``cpu`` gives the CPU
    seconds so far of whatever does the work, measured over the same window."""
    start = time.perf_counter()
    first_at = first_bytes = None
    samples = batches = 0
    cpu0 = 0.0
    for batch in stream:
        if first_at is None:  # steady state starts after the first batch
            first_at, first_bytes, cpu0 = time.perf_counter(), received(), cpu()
        else:
            samples += batch.batch_size
        batches += 1
        if max_batches is not None and batches >= max_batches:
            break
    end = time.perf_counter()
    if first_at is None or batches < 2:
        msg = "the benchmark needs at least 2 batches; lower --batch-size or raise --requests"
        raise SystemExit(msg)
    total_bytes = received()
    cpu_s = cpu() - cpu0
    return {
        "batches": batches,
        "samples_after_first": samples,
        "startup_s": first_at - start,
        "steady_s": end - first_at,
        "samples_per_s": samples / (end - first_at),
        "bytes": total_bytes,
        "bytes_after_first": total_bytes - first_bytes,
        "cpu_s": cpu_s,
        "cpu_s_per_batch": cpu_s / (batches - 1),
    }


def _per_sample(runs: list[Timing]) -> list[Timing]:
    """Each repeat's steady-state wall and CPU seconds per sample (what `timing_ratio` pairs)."""
    out = []
    for run in runs:
        figures = run.value
        n = max(figures["samples_after_first"], 1)
        out.append(Timing(figures["steady_s"] / n, figures["cpu_s"] / n, figures))
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Build (or reuse) the dataset, run every measurement, return the results dict."""
    from tqdm import tqdm

    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="recpipe-bench-service-"))
    work.mkdir(parents=True, exist_ok=True)
    dataset = args.dataset or build_dataset(work, requests=args.requests, seed=args.seed)
    preprocess = _bench_readers().preprocess_config(
        dataset, work / "liked_items.vocab", vocab_size=args.vocab_size
    )
    common = {
        "batch_size": args.batch_size,
        "preprocess": preprocess,
        "max_batches": args.max_batches,
    }
    service = {
        "readers": args.readers,
        "queue_depth": args.queue_depth,
        "read_ahead": args.read_ahead,
    }
    cases = {
        "inprocess_ikjt": lambda: measure_inprocess(
            dataset, dedup=True, read_ahead=args.read_ahead, **common
        ),
        "service_ikjt": lambda: measure_service(dataset, dedup=True, **common, **service),
        "service_kjt": lambda: measure_service(dataset, dedup=False, **common, **service),
    }
    if args.read_ahead:  # the same two IKJT paths without read-ahead, for its speedup
        cases["inprocess_ikjt_no_read_ahead"] = lambda: measure_inprocess(
            dataset, dedup=True, read_ahead=0, **common
        )
        cases["service_ikjt_no_read_ahead"] = lambda: measure_service(
            dataset, dedup=True, **common, **{**service, "read_ahead": 0}
        )
    with tqdm(total=args.repeats * len(cases), desc="service timings", file=sys.stderr) as bar:
        timings = alternate(cases, repeats=args.repeats, progress=bar.update)
    runs = {name: _per_sample(ts) for name, ts in timings.items()}

    def median(name: str, key: str) -> float:
        return statistics.median(t.value[key] for t in runs[name])

    def per_sample(name: str) -> float:
        return median(name, "bytes_after_first") / max(median(name, "samples_after_first"), 1)

    kjt, ikjt = per_sample("service_kjt"), per_sample("service_ikjt")
    reuse = measure_next_client(dataset, **common)
    ratio = timing_ratio(runs, "service_ikjt", "inprocess_ikjt", per="rate")
    read_ahead_speedup = None
    if args.read_ahead:
        read_ahead_speedup = {
            path: timing_ratio(runs, f"{path}_ikjt", f"{path}_ikjt_no_read_ahead", per="rate")
            for path in ("inprocess", "service")
        }
    return {
        "sent_bytes_per_sample": {"kjt": kjt, "ikjt": ikjt, "ratio_kjt_over_ikjt": kjt / ikjt},
        "service_vs_inprocess": ratio,
        "samples_per_s": {
            name: spread([t.value["samples_per_s"] for t in runs[name]]) for name in cases
        },
        "startup_s": {name: spread([t.value["startup_s"] for t in runs[name]]) for name in cases},
        "kept_reader": reuse,
        "read_ahead_speedup": read_ahead_speedup,
        "targets": {"service_vs_inprocess": TARGET_SERVICE_VS_INPROCESS},
        "meets_target": ratio["median"] >= TARGET_SERVICE_VS_INPROCESS,
        "settings": {
            "dataset": str(dataset),
            "requests": None if args.dataset else args.requests,
            "batch_size": args.batch_size,
            "readers": args.readers,
            "queue_depth": args.queue_depth,
            "read_ahead": args.read_ahead,
            "max_batches": args.max_batches,
            "repeats": args.repeats,
            "vocab_size": args.vocab_size,
            "seed": args.seed,
            "timing": "steady-state wall clock and CPU (all processes) per sample after the "
            "first batch; alternated repeats, paired ratios; 1 thread per process",
        },
        "raw": {name: [t.value for t in ts] for name, ts in runs.items()},
    }


def format_table(results: dict[str, Any]) -> str:
    """The figures as a small table."""
    sent = results["sent_bytes_per_sample"]
    rates = results["samples_per_s"]
    kept, cold = results["kept_reader"]["warmed_up"], results["kept_reader"]["not_warmed_up"]
    rows = [
        ("sent bytes/sample, KJT", f"{sent['kjt']:,.1f}"),
        ("sent bytes/sample, IKJT", f"{sent['ikjt']:,.1f}"),
        ("KJT / IKJT bytes", f"{sent['ratio_kjt_over_ikjt']:.2f}x"),
        ("in-process samples/s (IKJT)", f"{rates['inprocess_ikjt']['median']:,.0f}"),
        ("service samples/s (IKJT)", f"{rates['service_ikjt']['median']:,.0f}"),
        ("service samples/s (KJT)", f"{rates['service_kjt']['median']:,.0f}"),
        (
            "service_vs_inprocess",
            f"{_fmt_ratio(results['service_vs_inprocess'])} "
            f"(target >= {TARGET_SERVICE_VS_INPROCESS})",
        ),
        ("service start-up (s)", f"{results['startup_s']['service_ikjt']['median']:.2f}"),
        (
            "start-up, first / next client (s)",
            f"{kept['first_client']['startup_s']:.2f} / {kept['next_client']['startup_s']:.3f}",
        ),
        (
            "reader CPU/batch, first / next client",
            f"{kept['first_vs_next_reader_cpu_per_batch']:.2f}x warmed up, "
            f"{cold['first_vs_next_reader_cpu_per_batch']:.2f}x not",
        ),
        ("kept reader RSS (MB)", f"{kept['reader_rss_mb']:,.0f}"),
    ]
    speedup = results.get("read_ahead_speedup")
    if speedup:
        rows.append(("read-ahead on / off, in-process", _fmt_ratio(speedup["inprocess"])))
        rows.append(("read-ahead on / off, service", _fmt_ratio(speedup["service"])))
    width = max(len(name) for name, _ in rows)
    lines = ["benchmark: reader service", "-" * (width + 24)]
    lines += [f"{name:<{width}}  {value}" for name, value in rows]
    return "\n".join(lines)


def _fmt_ratio(ratio: dict[str, Any]) -> str:
    wall, cpu = ratio["wall"], ratio["cpu"]
    return f"{wall['median']:.2f}x ({wall['min']:.2f}-{wall['max']:.2f}; CPU {cpu['median']:.2f}x)"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see ``--help``)."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--requests",
        type=int,
        default=1_000_000,
        help="synthetic requests (default 1000000: ~245 batches per epoch; with 200000 an epoch "
        "lasts 0.4 s and three row-group loads of 70-240 ms dominate the timing)",
    )
    parser.add_argument(
        "--dataset",
        type=Path,
        default=None,
        help="use this clustered dataset instead of generating one",
    )
    parser.add_argument(
        "--batch-size", type=int, default=4096, help="rows per batch (default 4096)"
    )
    parser.add_argument(
        "--readers",
        type=int,
        default=1,
        help="reader processes of the service (default 1; 0 = a thread)",
    )
    parser.add_argument(
        "--queue-depth", type=int, default=8, help="service queue depth (default 8)"
    )
    parser.add_argument(
        "--read-ahead",
        type=int,
        default=1,
        help="row groups decoded ahead in a second thread, in both paths (default 1, the "
        "readers' default; 0: one thread per reader)",
    )
    parser.add_argument(
        "--max-batches",
        type=int,
        default=None,
        help="batches per timing (default: the whole epoch)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="timed repeats per case, alternated; medians and spreads reported (default 5)",
    )
    parser.add_argument(
        "--vocab-size", type=int, default=50_000, help="liked-items vocabulary size (default 50000)"
    )
    parser.add_argument("--seed", type=int, default=0, help="synthetic data seed (default 0)")
    parser.add_argument(
        "--work", type=Path, default=None, help="working directory (default: a temp dir)"
    )
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"JSON output (default {DEFAULT_OUT})"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, write the JSON, print the table."""
    args = parse_args(argv)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
        os.environ.setdefault(var, "1")  # before torch/numba load; reader processes inherit it
    results = run(args)
    write_results(results, args.out)
    print(format_table(results))
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
