"""Measure Parquet settings (zstd level, row-group size, dictionary per column) on real rows.

``etl build`` takes its defaults from these measurements (``DEFAULT_ZSTD_LEVEL``,
``DEFAULT_ROW_GROUP_SIZE``) and decides dictionary encoding per column at build time with
:func:`etl.build.writer.choose_dictionary`. Re-run on a clustered dataset to re-check them::

    python -m etl.build.tune DATASET_DIR [--rows 200000] [--json out.json]
"""

from __future__ import annotations

import argparse
import io
import json
import time
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from etl.build.writer import choose_dictionary

__all__ = ["measure_settings"]


def _write(
    table: pa.Table, *, level: int, row_group_size: int, dictionary
) -> tuple[int, float, float]:
    buf = io.BytesIO()
    t0 = time.perf_counter()
    pq.write_table(
        table,
        buf,
        compression="zstd",
        compression_level=level,
        row_group_size=row_group_size,
        use_dictionary=dictionary,
    )
    t1 = time.perf_counter()
    pq.read_table(io.BytesIO(buf.getvalue()))
    return buf.tell(), t1 - t0, time.perf_counter() - t1


def measure_settings(
    table: pa.Table,
    *,
    levels: Sequence[int] = (1, 3, 6, 9, 12),
    row_group_sizes: Sequence[int] = (8_192, 16_384, 32_768, 65_536, 131_072, 262_144),
    base_level: int = 3,
    base_row_group: int = 65_536,
) -> dict:
    """Bytes, write and read seconds of ``table`` under each setting, one knob at a time.

    Returns:
        ``{"rows", "dictionary": {col: {dict, plain, use}}, "levels": [...],
        "row_group_sizes": [...]}``; every entry has ``bytes``, ``write_s``, ``read_s``.
    """
    dict_measured = choose_dictionary(table.slice(0, min(table.num_rows, 65_536)), level=base_level)
    dictionary = [c for c, m in dict_measured.items() if m["use"]]
    out: dict = {
        "rows": table.num_rows,
        "dictionary": dict_measured,
        "levels": [],
        "row_group_sizes": [],
    }
    for level in levels:
        b, w, r = _write(table, level=level, row_group_size=base_row_group, dictionary=dictionary)
        out["levels"].append(
            {"level": level, "bytes": b, "write_s": round(w, 3), "read_s": round(r, 3)}
        )
    for rg in row_group_sizes:
        b, w, r = _write(table, level=base_level, row_group_size=rg, dictionary=dictionary)
        out["row_group_sizes"].append(
            {"row_group_size": rg, "bytes": b, "write_s": round(w, 3), "read_s": round(r, 3)}
        )
    for use, label in ((True, "all"), (False, "none")):
        b, w, r = _write(table, level=base_level, row_group_size=base_row_group, dictionary=use)
        out[f"dictionary_{label}"] = {"bytes": b, "write_s": round(w, 3), "read_s": round(r, 3)}
    b, w, r = _write(table, level=base_level, row_group_size=base_row_group, dictionary=dictionary)
    out["dictionary_measured"] = {"bytes": b, "write_s": round(w, 3), "read_s": round(r, 3)}
    return out


def _main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dataset", type=Path, help="a clustered dataset directory")
    p.add_argument("--rows", type=int, default=200_000, help="rows measured (default 200000)")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args()
    files = sorted(args.dataset.rglob("part-*.parquet"))
    table = pq.ParquetDataset(files).read().slice(0, args.rows)
    res = measure_settings(table)
    print(f"rows measured: {res['rows']:,}")
    print("zstd level   bytes        write s  read s")
    for x in res["levels"]:
        print(
            f"  {x['level']:>3}       {x['bytes']:>12,}  {x['write_s']:>6.2f}  {x['read_s']:>6.2f}"
        )
    print("row group    bytes        write s  read s")
    for x in res["row_group_sizes"]:
        print(
            f"  {x['row_group_size']:>7,}  {x['bytes']:>12,}  {x['write_s']:>6.2f}  {x['read_s']:>6.2f}"
        )
    for k in ("dictionary_all", "dictionary_none", "dictionary_measured"):
        print(f"{k:<20} {res[k]['bytes']:>12,}")
    print("dictionary on:", [c for c, m in res["dictionary"].items() if m["use"]])
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    _main()
