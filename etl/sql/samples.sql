-- One row per training sample. `_row` is the sample's position in file order (files in name
-- order, rows in file order): batches of B rows are `_row // B`, as a reader would cut them.
CREATE OR REPLACE TEMP VIEW samples AS
SELECT
    f.row_offset + p.file_row_number AS _row,
    p.* EXCLUDE (filename, file_row_number)
FROM read_parquet(
    getvariable('recpipe_files'),
    filename = true,
    file_row_number = true,
    hive_partitioning = false
) AS p
JOIN _files AS f ON f.path = p.filename;
