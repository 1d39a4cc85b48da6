-- Distinct values of one dense feature within each batch of $batch_size rows in file order.
-- Measured DedupeFactor = rows / unique_rows.
SELECT
    count(*) AS unique_rows,
    count(*) AS unique_values
FROM (
    SELECT DISTINCT _row // $batch_size AS batch, {feature}
    FROM samples
);
