"""Test helpers for dataset integrity: seal a dataset (page checksums + manifest digests) and
flip bytes inside one data page.

``seal_dataset`` rewrites each part file with Parquet page checksums (keeping its row groups,
zstd level and dictionary columns) and records ``bytes`` and ``sha256`` in the manifest's ``files[]`` entries: what the build
writes itself once it records digests, so the tests hold either way. The manifest's totals
(``bytes_out``, ``row_groups``, ``rows_out``) are updated to match.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq

from recpipe.integrity import MANIFEST_NAME, file_sha256


def seal_dataset(root: Path) -> Path:
    """Rewrite ``root``'s part files with page checksums and record their sizes and digests.

    Without a manifest, one listing every ``*.parquet`` outside ``_``/``.`` folders is written.
    """
    path = root / MANIFEST_NAME
    if path.is_file():
        manifest = json.loads(path.read_text())
    else:
        parts = sorted(
            p.relative_to(root).as_posix()
            for p in root.rglob("*.parquet")
            if not any(s.startswith(("_", ".")) for s in p.relative_to(root).parts)
        )
        manifest = {"files": [{"path": p} for p in parts]}
    settings = manifest.get("parquet", {})
    options = {
        "compression": "zstd",
        "compression_level": settings.get("level"),
        "use_dictionary": settings.get("dictionary_columns", True),
        "write_page_checksum": True,
    }
    for entry in manifest["files"]:
        part = root / entry["path"]
        pf = pq.ParquetFile(part)
        groups = [pf.read_row_group(i) for i in range(pf.num_row_groups)]
        schema = pf.schema_arrow
        pf.close()
        with pq.ParquetWriter(part, schema, **options) as w:
            for group in groups:
                w.write_table(group, row_group_size=max(group.num_rows, 1))
        size, sha = file_sha256(part)
        entry.update(
            rows=sum(g.num_rows for g in groups), row_groups=len(groups), bytes=size, sha256=sha
        )
    # the totals describe the files as rewritten (recpipe.integrity.check_totals)
    for key, field in (("bytes_out", "bytes"), ("row_groups", "row_groups"), ("rows_out", "rows")):
        if key in manifest:
            manifest[key] = sum(entry[field] for entry in manifest["files"])
    path.write_text(json.dumps(manifest, indent=2) + "\n")
    return root


def flip_data_page(path: Path, *, row_group: int, column: str, count: int = 64) -> None:
    """Invert ``count`` bytes in the middle of the data pages of one column chunk.

    The bytes lie past the page header (the chunk's data must span at least ``4 * count``
    bytes), so the file still parses: only a page checksum, or the file's sha256, can tell.
    """
    meta = pq.read_metadata(path)
    names = [meta.schema.column(i).path.split(".")[0] for i in range(meta.num_columns)]
    chunk = meta.row_group(row_group).column(names.index(column))
    first = chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset
    start, end = chunk.data_page_offset, first + chunk.total_compressed_size
    assert end - start >= 4 * count, f"{column} row group {row_group}: {end - start} bytes"
    middle = (start + end) // 2
    data = bytearray(path.read_bytes())
    for i in range(middle, middle + count):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))
