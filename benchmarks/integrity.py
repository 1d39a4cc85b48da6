"""What checking a dataset's integrity costs, measured in one run.

Generates synthetic logs, builds the clustered dataset, and rewrites its part files with Parquet
page checksums (the same row groups, zstd level and dictionary columns) so that both sides of
every comparison read the same bytes; only the check differs. Cases are alternated, the order
rotating every repeat, after one untimed warm-up; every ratio is reported with its spread, wall
and CPU time.

Figures (written to benchmarks/results/integrity.json):
  read_pages_vs_off     time to read every split (DatasetSource, one thread, no read-ahead)
                        with ReaderConfig(verify="pages") / with verify="off": the price of the
                        default page-checksum check on the raw decode.
  loader_pages_vs_off   the same for whole batches (ParquetBatchDataset: decode + IKJT
                        conversion), what a training loop pays.
  stats_digest_share    time of the size + sha256 check `recpipe stats` runs first
                        (etl.verify.verify_digests) / time of the statistics themselves.
  verify_mb_per_s       `recpipe etl verify` throughput (sha256 + every page), MB of Parquet/s.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks._common import alternate, spread, timing_ratio, write_results

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "integrity.json"

__all__ = ["main", "parse_args", "run"]


def _with_page_checksums(dataset: Path) -> None:
    """Rewrite the dataset's part files with page checksums; record their sizes and sha256."""
    import pyarrow.parquet as pq

    from recpipe.integrity import MANIFEST_NAME, file_sha256

    manifest = json.loads((dataset / MANIFEST_NAME).read_text())
    settings = manifest["parquet"]
    for entry in manifest["files"]:
        part = dataset / entry["path"]
        with pq.ParquetFile(part) as pf:
            groups = [pf.read_row_group(i) for i in range(pf.num_row_groups)]
            schema = pf.schema_arrow
        with pq.ParquetWriter(
            part,
            schema,
            compression="zstd",
            compression_level=settings["level"],
            use_dictionary=settings["dictionary_columns"],
            write_page_checksum=True,
        ) as writer:
            for group in groups:
                writer.write_table(group, row_group_size=group.num_rows)
        entry["bytes"], entry["sha256"] = file_sha256(part)
    manifest["bytes_out"] = sum(entry["bytes"] for entry in manifest["files"])  # its total too
    (dataset / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Build the dataset under ``args.work`` (or a temp dir) and measure every figure."""
    if args.work is None:
        with tempfile.TemporaryDirectory(prefix="recpipe-integrity-") as tmp:
            return _measure(Path(tmp), args)
    return _measure(args.work, args)


def _measure(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from etl.build import BuildConfig, build
    from etl.stats import compute_stats
    from etl.synth import SynthConfig, generate
    from etl.verify import verify_dataset, verify_digests
    from readers.dataset import ParquetBatchDataset
    from readers.source import DatasetSource, ReaderConfig
    from schemas import default_schema

    torch.set_num_threads(1)
    schema = default_schema()
    logs = generate(work / "raw", SynthConfig(num_requests=args.requests, seed=args.seed))
    dataset = work / "dataset"
    build(logs.features, dataset, events=logs.events, schema=schema, config=BuildConfig(),
          overwrite=True)  # fmt: skip
    _with_page_checksums(dataset)

    def config(verify: str) -> ReaderConfig:
        return ReaderConfig(batch_size=args.batch_size, read_ahead=0, verify=verify)

    sources = {v: DatasetSource(dataset, schema=schema, config=config(v)) for v in ("off", "pages")}
    loaders = {v: ParquetBatchDataset(dataset, config=config(v)) for v in ("off", "pages")}

    def read(verify: str):
        source = sources[verify]
        return lambda: sum(t.num_rows for t, _ in source.iter_tables(source.splits))

    def load(verify: str):
        return lambda: sum(b.labels.shape[0] for b in loaders[verify])

    runs = alternate(
        {
            "read_off": read("off"),
            "read_pages": read("pages"),
            "loader_off": load("off"),
            "loader_pages": load("pages"),
            "stats": lambda: compute_stats(dataset, schema=schema, threads=1),
            "digests": lambda: verify_digests(dataset),
            "verify": lambda: verify_dataset(dataset),
        },
        repeats=args.repeats,
    )
    mb = sum(p.stat().st_size for p in dataset.rglob("part-*.parquet")) / 1e6
    report = verify_dataset(dataset)
    return {
        "read_pages_vs_off": timing_ratio(runs, "read_pages", "read_off"),
        "loader_pages_vs_off": timing_ratio(runs, "loader_pages", "loader_off"),
        "stats_digest_share": timing_ratio(runs, "digests", "stats"),
        "verify_mb_per_s": spread([mb / t.wall_s for t in runs["verify"]]),
        "settings": {
            "requests": args.requests,
            "rows": report.rows,
            "row_groups": report.row_groups,
            "parquet_mb": round(mb, 3),
            "batch_size": args.batch_size,
            "repeats": args.repeats,
            "verified_ok": report.ok,
        },
    }


def format_table(results: dict[str, Any]) -> str:
    """The figures as a few lines (median wall ratio, its range, the CPU ratio's median)."""
    lines = []
    for key in ("read_pages_vs_off", "loader_pages_vs_off", "stats_digest_share"):
        r = results[key]
        lines.append(
            f"{key:<20} {r['median']:.3f}x  (wall {r['wall']['min']:.3f}-{r['wall']['max']:.3f}, "
            f"cpu median {r['cpu']['median']:.3f})"
        )
    v = results["verify_mb_per_s"]
    lines.append(f"{'verify_mb_per_s':<20} {v['median']:.1f} MB/s  ({v['min']:.1f}-{v['max']:.1f})")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see ``--help``)."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--requests", type=int, default=200_000, help="synthetic requests (200000)")
    parser.add_argument("--batch-size", type=int, default=4096, help="rows per batch (4096)")
    parser.add_argument("--repeats", type=int, default=7, help="alternated repeats per case (7)")
    parser.add_argument("--seed", type=int, default=0, help="synthetic data seed (0)")
    parser.add_argument("--work", type=Path, default=None, help="working directory (a temp dir)")
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"JSON output ({DEFAULT_OUT})"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, write the JSON, print the figures."""
    args = parse_args(argv)
    results = run(args)
    path = write_results(results, args.out)
    print(format_table(results))
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
