"""Reader throughput: the RecD reader path vs the pre-RecD path, measured in one run.

Generates the default synthetic logs (`etl.synth.generate`), builds them twice with the same
writer settings (`etl.build.build`, `order="session"` = clustered, `order="time"` = the pre-RecD
time-ordered baseline), and reads both with a realistic preprocessing pipeline (hash-modulo of
item/context ids, truncation and a vocabulary lookup of the liked-items history, hash-modulo of
the other user lists, missing-value fill + log1p + normalisation of dense features).

All timings run in this process on one core (torch, Arrow and Numba limited to one thread) and
are reported as samples per CPU-second (`time.process_time`), so other load on the machine
matters little; every figure is a ratio of two measurements taken in the same run: each case is
warmed up once untimed, the cases alternate with the order rotating each repeat
(`_common.alternate`), the median of `--repeats` is kept and each ratio's spread over the
paired repeats is written beside it (`<figure>_spread`, CPU-time and wall-time).

Figures (written to benchmarks/results/readers.json):
  reader_speedup_vs_baseline   RecD path (clustered + IKJT + dedup preprocessing) samples/s over
                               the pre-RecD path (time-ordered + plain KJT + same preprocessing).
                               Target >= 1.8 (RecD: 1.79x per reader).
  ikjt_vs_kjt_samples_per_s    the same clustered data, IKJT path / KJT path (with preprocessing).
  convert_overhead             per-batch time of read + IKJT conversion / read + KJT conversion
                               (no preprocessing), clustered data. Target <= 1.3.
  read_bytes_per_sample        compressed Parquet bytes read per sample, clustered vs time-ordered.
  reader_speedup_fitted        reader_speedup_vs_baseline with fitted preprocessing on: the same
                               pipeline with the liked-items vocabulary and the dense mean/std
                               fitted by `recpipe fit` (readers.fit, DuckDB, training rows only)
                               and loaded from the dataset's fitted state. Target >= 1.8.
  len_matches_delivered        len() of a make_dataloader over the clustered data with the fitted
                               pipeline, and the batches one epoch delivered (must be equal).
  partial_dedup_factor         the shifted-history feature of the schema's ``[dedup] partial``
                               (synth: user_recent_items, one id appended per request): ids of
                               its expanded rows / ids its partial IKJT stores, per batch of the
                               clustered data (time-ordered beside it).
  partial_convert_speed        read + convert samples/s with that feature as a partial IKJT /
                               with it in the plain KJT (the groups unchanged), clustered data,
                               no preprocessing; with its spread like the other ratios.

`measure_inprocess(...)` is the in-process measurement the service benchmark compares against.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from benchmarks._common import alternate, partial_schema, timing_ratio

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "readers.json"

__all__ = [
    "build_datasets",
    "fitted_config",
    "main",
    "measure_inprocess",
    "parse_args",
    "preprocess_config",
    "run",
]


def _limit_threads(threads: int) -> None:
    """One core per reader: torch, Arrow and Numba on ``threads`` threads."""
    import numba
    import pyarrow as pa
    import torch

    torch.set_num_threads(threads)
    pa.set_cpu_count(threads)
    pa.set_io_thread_count(threads)
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))


def build_datasets(work: Path, *, requests: int, seed: int) -> dict[str, Any]:
    """Synthetic logs -> a clustered and a time-ordered dataset (same writer settings)."""
    from etl.build import BuildConfig, build
    from etl.synth import SynthConfig, generate

    logs = generate(work / "raw", SynthConfig(num_requests=requests, seed=seed), progress=True)
    out = {"logs": logs}
    for order, name in (("session", "clustered"), ("time", "time_ordered")):
        manifest = build(
            logs.features, work / name, events=logs.events, schema=partial_schema(),
            config=BuildConfig(order=order), overwrite=True, progress=True,
        )  # fmt: skip
        out[name] = {"path": work / name, "manifest": manifest}
    return out


def preprocess_config(dataset: Path, vocab_path: Path, *, vocab_size: int) -> list[dict[str, Any]]:
    """The benchmark's pipeline; the vocabulary holds the most frequent liked items."""
    import numpy as np
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from readers.source import discover_files

    files = discover_files(dataset)
    liked = np.concatenate(
        [
            pc.list_flatten(pq.read_table(f, columns=["user_liked_items"])[0]).to_numpy()
            for f in files
        ]
    )
    ids, counts = np.unique(liked, return_counts=True)
    vocab = ids[np.argsort(-counts, kind="stable")[:vocab_size]]
    vocab_path.write_text("\n".join(str(int(i)) for i in vocab) + "\n")
    dense = ["user_age", "user_tenure_days", "item_price", "item_ctr", "context_hour"]
    table = pq.read_table(files[0], columns=dense)
    logged = [np.log1p(np.clip(np.nan_to_num(table[n].to_numpy()), 0, None)) for n in dense]
    return [
        {"transform": "HashModulo", "features": ["item_id", "item_seller", "item_category", "item_tags"],
         "params": {"modulus": 1 << 20}},
        {"transform": "HashModulo", "features": ["context_device", "context_surface"],
         "params": {"modulus": 1024}},
        {"transform": "Truncate", "features": ["user_liked_items"], "params": {"max_len": 32}},
        {"transform": "VocabLookup", "features": ["user_liked_items"],
         "params": {"path": str(vocab_path), "num_oov_buckets": 16}},
        {"transform": "HashModulo",
         "features": ["user_liked_sellers", "user_recent_queries", "user_follows", "user_segment",
                      "user_country"],
         "params": {"modulus": 1 << 18, "salt": 7}},
        {"transform": "FillMissing", "features": dense},
        {"transform": "Log1p", "features": dense},
        {"transform": "Normalize", "features": dense,
         "params": {"mean": [float(x.mean()) for x in logged],
                    "std": [float(max(x.std(), 1e-6)) for x in logged]}},
    ]  # fmt: skip


def fitted_config(config: list[dict[str, Any]], *, vocab_size: int) -> list[dict[str, Any]]:
    """``config`` with fitted steps: the liked-items vocabulary (the ``vocab_size`` most frequent
    ids of the training rows) and the dense mean/std (after the missing-value fill, instead of
    log1p + fixed statistics) come from ``recpipe fit``."""
    out = []
    for entry in config:
        name = entry["transform"]
        if name == "VocabLookup":
            params = {k: v for k, v in entry["params"].items() if k != "path"}
            out.append({**entry, "params": params, "fit": {"max_size": vocab_size}})
        elif name == "Normalize":
            out.append({"transform": "Normalize", "features": entry["features"], "fit": True})
        elif name != "Log1p":
            out.append(entry)
    return out


def _len_check(dataset: Path, *, batch_size: int, transforms: Any) -> dict[str, Any]:
    """``len(loader)`` of a fitted-preprocessing loader and the batches its epoch delivered."""
    from readers.dataset import make_dataloader
    from readers.source import ReaderConfig

    loader = make_dataloader(
        dataset, config=ReaderConfig(batch_size=batch_size), transforms=transforms
    )
    expected = len(loader)
    delivered = sum(1 for _ in loader)
    return {"len": expected, "delivered": delivered, "equal": expected == delivered}


def _timed(stream: Iterator[Any], count: Callable[[Any], int], max_batches: int | None) -> dict:
    samples = batches = 0
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for item in stream:
        samples += count(item)
        batches += 1
        if max_batches is not None and batches >= max_batches:
            break
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    return {
        "samples": samples,
        "batches": batches,
        "cpu_s": cpu,
        "wall_s": wall,
        "samples_per_cpu_s": samples / cpu if cpu else float("inf"),
        "samples_per_s": samples / wall if wall else float("inf"),
    }


def measure_inprocess(
    dataset: str | os.PathLike[str],
    *,
    batch_size: int = 4096,
    transforms: Any = None,
    dedup: bool = True,
    max_batches: int | None = None,
    schema: Any = None,
) -> dict[str, Any]:
    """Read (+ convert + preprocess) batches in this process and time it.

    Returns:
        ``samples``, ``batches``, ``cpu_s``, ``wall_s``, ``samples_per_cpu_s``,
        ``samples_per_s``.
    """
    from readers.dataset import iter_batches
    from readers.source import ReaderConfig

    stream = iter_batches(
        dataset, schema=schema, config=ReaderConfig(batch_size=batch_size), transforms=transforms,
        dedup=dedup,
    )  # fmt: skip
    return _timed(stream, lambda b: b.batch_size, max_batches)


def _measure_convert(dataset: Path, *, batch_size: int, dedup: bool, max_batches: int | None):
    """Read + convert only (no preprocessing)."""
    return measure_inprocess(dataset, batch_size=batch_size, dedup=dedup, max_batches=max_batches)


def _read_bytes(dataset: Path, schema: Any) -> dict[str, float]:
    from readers.source import DatasetSource

    source = DatasetSource(dataset, schema=schema)
    size = sum(s.compressed_bytes for s in source.splits)
    return {"bytes": size, "rows": source.num_rows, "per_sample": size / max(source.num_rows, 1)}


def _partial_factor(dataset: Path, schema: Any, *, batch_size: int, batches: int) -> float:
    """Expanded / stored ids of the schema's partial group over the first ``batches`` batches."""
    from readers.convert import group_name

    return _dedup_factors(dataset, schema, batch_size=batch_size, batches=batches)[
        group_name(schema.dedup_partial)
    ]


def _dedup_factors(
    dataset: Path, schema: Any, *, batch_size: int, batches: int
) -> dict[str, float]:
    from readers.dataset import iter_batches
    from readers.source import ReaderConfig

    stored: dict[str, int] = {}
    expanded: dict[str, int] = {}
    for i, batch in enumerate(
        iter_batches(dataset, schema=schema, config=ReaderConfig(batch_size=batch_size))
    ):
        for name, group in batch.ikjts.items():
            stored[name] = stored.get(name, 0) + group.num_values
            expanded[name] = expanded.get(name, 0) + group.num_expanded_values
        if i + 1 >= batches:
            break
    return {n: expanded[n] / max(stored[n], 1) for n in stored}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Build the datasets, run every measurement, return the results dict."""
    from tqdm import tqdm

    from readers.dataset import dataset_schema
    from readers.pipeline import Pipeline

    _limit_threads(args.threads)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="recpipe-bench-readers-"))
    work.mkdir(parents=True, exist_ok=True)
    data = build_datasets(work, requests=args.requests, seed=args.seed)
    clustered, timed = data["clustered"]["path"], data["time_ordered"]["path"]
    schema = dataset_schema(clustered)
    config = preprocess_config(clustered, work / "liked_items.vocab", vocab_size=args.vocab_size)
    pipeline = Pipeline.from_config(config, schema=schema)
    bsz, cap = args.batch_size, args.max_batches
    from readers.fit import fit_preprocess

    fitted = fitted_config(config, vocab_size=args.vocab_size)
    for dataset in (clustered, timed):  # the same sessions: the same training rows and state
        fit_preprocess(dataset, fitted, schema=schema)
    fitted_pipeline = Pipeline.from_config(fitted, schema=schema, dataset=clustered)

    no_partial = schema.with_dedup(schema.dedup_groups)  # the partial feature in the plain KJT
    cases: dict[str, Callable[[], dict]] = {
        "recd": lambda: measure_inprocess(clustered, batch_size=bsz, transforms=pipeline, dedup=True, max_batches=cap, schema=schema),
        "baseline": lambda: measure_inprocess(timed, batch_size=bsz, transforms=pipeline, dedup=False, max_batches=cap, schema=schema),
        "clustered_kjt": lambda: measure_inprocess(clustered, batch_size=bsz, transforms=pipeline, dedup=False, max_batches=cap, schema=schema),
        "convert_ikjt": lambda: _measure_convert(clustered, batch_size=bsz, dedup=True, max_batches=cap),
        "convert_kjt": lambda: _measure_convert(clustered, batch_size=bsz, dedup=False, max_batches=cap),
        "convert_no_partial": lambda: measure_inprocess(clustered, batch_size=bsz, dedup=True, max_batches=cap, schema=no_partial),
        "recd_fitted": lambda: measure_inprocess(clustered, batch_size=bsz, transforms=fitted_pipeline, dedup=True, max_batches=cap, schema=schema),
        "baseline_fitted": lambda: measure_inprocess(timed, batch_size=bsz, transforms=fitted_pipeline, dedup=False, max_batches=cap, schema=schema),
    }  # fmt: skip
    with tqdm(total=args.repeats * len(cases), desc="reader timings", file=sys.stderr) as bar:
        # every case warmed up once, untimed (Numba, page cache, vocabulary), then alternated
        timings = alternate(cases, repeats=args.repeats, progress=bar.update)
    runs = {name: [t.value for t in ts] for name, ts in timings.items()}

    def rate(name: str) -> float:
        return statistics.median(r["samples_per_cpu_s"] for r in runs[name])

    def per_batch(name: str) -> float:
        return statistics.median(r["cpu_s"] / max(r["batches"], 1) for r in runs[name])

    def ratio(a: str, b: str, *, per: str) -> dict[str, Any]:
        """Paired per-repeat ratio, the CPU-time one the headline (samples per CPU-second)."""
        return {**timing_ratio(timings, a, b, per=per), "headline": "cpu"}

    bytes_clustered, bytes_timed = _read_bytes(clustered, schema), _read_bytes(timed, schema)
    spreads = {
        "reader_speedup_vs_baseline": ratio("recd", "baseline", per="rate"),
        "ikjt_vs_kjt_samples_per_s": ratio("recd", "clustered_kjt", per="rate"),
        "convert_overhead": ratio("convert_ikjt", "convert_kjt", per="time"),
        "reader_speedup_fitted": ratio("recd_fitted", "baseline_fitted", per="rate"),
        "partial_convert_speed": ratio("convert_ikjt", "convert_no_partial", per="rate"),
    }
    results = {
        **{name: spread["cpu"]["median"] for name, spread in spreads.items()},
        **{f"{name}_spread": spread for name, spread in spreads.items()},
        "read_bytes_per_sample": {
            "clustered": bytes_clustered["per_sample"],
            "time_ordered": bytes_timed["per_sample"],
            "ratio_time_vs_clustered": bytes_timed["per_sample"] / bytes_clustered["per_sample"],
        },
        "samples_per_cpu_s": {name: rate(name) for name in cases},
        "ms_per_batch": {name: 1000 * per_batch(name) for name in cases},
        "dedup_factor_per_group": {
            "clustered": _dedup_factors(clustered, schema, batch_size=bsz, batches=4),
            "time_ordered": _dedup_factors(timed, schema, batch_size=bsz, batches=4),
        },
        "len_matches_delivered": _len_check(clustered, batch_size=bsz, transforms=fitted),
        "partial_dedup_factor": _partial_factor(clustered, schema, batch_size=bsz, batches=4),
        "partial_dedup_factor_time_ordered": _partial_factor(
            timed, schema, batch_size=bsz, batches=4
        ),
        "partial_feature": list(schema.dedup_partial),
        "targets": {
            "reader_speedup_vs_baseline": 1.8,
            "convert_overhead": 1.3,
            "reader_speedup_fitted": 1.8,
        },
        "settings": {
            "requests": args.requests,
            "rows": bytes_clustered["rows"],
            "batch_size": bsz,
            "max_batches": cap,
            "repeats": args.repeats,
            "threads": args.threads,
            "vocab_size": args.vocab_size,
            "seed": args.seed,
            "timing": (
                "median samples per CPU-second (time.process_time), one thread; every case "
                "warmed up once, then the cases alternated with the order rotating each repeat"
            ),
            "preprocess": config,
            "preprocess_fitted": fitted,
        },
        "raw": runs,
    }
    return results


def format_table(results: dict[str, Any]) -> str:
    """The one-screen summary."""
    rb = results["read_bytes_per_sample"]
    sp = results["samples_per_cpu_s"]
    ms = results["ms_per_batch"]
    lines = [
        f"{'figure':<34}{'value':>12}  note",
        "-" * 78,
        f"{'reader_speedup_vs_baseline':<34}{results['reader_speedup_vs_baseline']:>12.2f}  target >= 1.8 (RecD 1.79x)",
        f"{'ikjt_vs_kjt_samples_per_s':<34}{results['ikjt_vs_kjt_samples_per_s']:>12.2f}  clustered data, IKJT / KJT",
        f"{'convert_overhead':<34}{results['convert_overhead']:>12.2f}  target <= 1.3",
        f"{'reader_speedup_fitted':<34}{results['reader_speedup_fitted']:>12.2f}  target >= 1.8, fitted preprocessing",
        f"{'len(loader) / delivered':<34}{results['len_matches_delivered']['len']:>12}  {results['len_matches_delivered']['delivered']} delivered",
        f"{'read_bytes_per_sample clustered':<34}{rb['clustered']:>12.1f}",
        f"{'read_bytes_per_sample time-ordered':<34}{rb['time_ordered']:>12.1f}  {rb['ratio_time_vs_clustered']:.2f}x clustered",
        f"{'partial_dedup_factor':<34}{results['partial_dedup_factor']:>12.2f}  {'+'.join(results['partial_feature'])}, time-ordered {results['partial_dedup_factor_time_ordered']:.2f}",
        f"{'partial_convert_speed':<34}{results['partial_convert_speed']:>12.2f}  read + convert, partial IKJT / plain KJT",
        "-" * 78,
    ]  # fmt: skip
    for name in sp:
        lines.append(f"{name + ' samples/cpu-s':<34}{sp[name]:>12.0f}  {ms[name]:.1f} ms/batch")
    for order, groups in results["dedup_factor_per_group"].items():
        text = ", ".join(
            f"{g.split('+')[0]}{'+..' if '+' in g else ''} {f:.1f}" for g, f in groups.items()
        )
        lines.append(f"dedup factor ({order}): {text}")
    return "\n".join(lines)


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
        default=200_000,
        help="synthetic requests (default 200000, the synth default)",
    )
    parser.add_argument(
        "--batch-size", type=int, default=4096, help="rows per batch (default 4096)"
    )
    parser.add_argument(
        "--max-batches",
        type=int,
        default=None,
        help="batches per timing (default: the whole dataset)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed repeats per case, the median is kept (default 3)",
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch/Arrow/Numba threads (default 1: per core)"
    )
    parser.add_argument(
        "--vocab-size", type=int, default=50_000, help="liked-items vocabulary size (default 50000)"
    )
    parser.add_argument("--seed", type=int, default=0, help="synthetic data seed (default 0)")
    parser.add_argument(
        "--work",
        type=Path,
        default=None,
        help="working directory for logs and datasets (default: a temp dir)",
    )
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"JSON output (default {DEFAULT_OUT})"
    )
    return parser.parse_args(argv)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, write the JSON, print the table."""
    args = parse_args(argv)
    results = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(format_table(results))
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
