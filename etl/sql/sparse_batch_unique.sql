-- Distinct lists of one sparse feature within each batch of $batch_size rows in file order,
-- as an IKJT would store them. Measured DedupeFactor = ids in all rows / ids in unique rows.
SELECT
    count(*) AS unique_rows,
    coalesce(sum(len(v)), 0) AS unique_values
FROM (
    SELECT DISTINCT _row // $batch_size AS batch, {feature} AS v
    FROM samples
);
