-- The dataset's Parquet files in the order given (`recpipe_files`: file order = name order) and
-- the global position of each file's first row, so that `_row` below numbers the samples in
-- exactly the order a reader streams them.
CREATE OR REPLACE TEMP TABLE _files AS
SELECT
    file_name AS path,
    num_rows,
    coalesce(
        sum(num_rows) OVER (
            ORDER BY list_position(getvariable('recpipe_files'), file_name)
            ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING
        ),
        0
    ) AS row_offset
FROM parquet_file_metadata(getvariable('recpipe_files'));
