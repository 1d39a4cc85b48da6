-- Ids a partial IKJT stores for one sparse feature, in batches of $batch_size rows in file
-- order (recpipe.kernels.partial_dedup's rule): each row is compared with the row before it
-- in its batch (p = prev, c = cur; slices 1-based and inclusive) and appends
--   0            when c = p                                    (an exact repeat)
--   1            when c = p + [x]          (len(c) = len(p) + 1, c[1:len(p)] = p)
--                  or c = p[2:] + [x]      (len(c) = len(p) >= 1, c[1:len(c)-1] = p[2:len(p)])
--   len(c)       otherwise, and for the first row of a batch.
-- Partial DedupeFactor = ids in all rows / ids stored. `shifted` counts the rows stored as a
-- one-id shift of the row before them (exact repeats not included).
WITH rows AS (
    SELECT
        row_number() OVER w = 1 AS first,
        coalesce({feature}, []) AS c,
        coalesce(lag({feature}) OVER w, []) AS p
    FROM samples
    WINDOW w AS (PARTITION BY _row // $batch_size ORDER BY _row)
),
classified AS (
    SELECT
        len(c) AS n,
        CASE
            WHEN first THEN 'whole'
            WHEN c = p THEN 'repeat'
            WHEN len(c) = len(p) + 1 AND c[1:len(p)] = p THEN 'shift'
            WHEN len(c) = len(p) AND len(c) >= 1 AND c[1:len(c) - 1] = p[2:len(p)] THEN 'shift'
            ELSE 'whole'
        END AS how
    FROM rows
)
SELECT
    coalesce(sum(n), 0) AS expanded_values,
    coalesce(sum(CASE how WHEN 'whole' THEN n WHEN 'shift' THEN 1 ELSE 0 END), 0)
        AS partial_values,
    count(*) FILTER (WHERE how = 'shift' AND n > 1) AS shifted
FROM classified;
