-- Ids stored for one dedup group within each batch of $batch_size rows in file order, as the
-- group's IKJT stores them: a row is merged with another only when every list of the group
-- repeats, so the distinct rows are distinct tuples of the group's lists.
SELECT coalesce(sum({lengths}), 0) AS unique_values
FROM (
    SELECT DISTINCT _row // $batch_size AS batch, {features}
    FROM samples
);
