-- Compressed and uncompressed Parquet bytes per top-level column, from the file footers.
SELECT
    split_part(path_in_schema, ', ', 1) AS "column",
    sum(total_compressed_size) AS compressed,
    sum(total_uncompressed_size) AS uncompressed
FROM parquet_metadata(getvariable('recpipe_files'))
GROUP BY 1;
