-- Duplicates of one dense feature: a sample whose value equals that of the previous sample of
-- its session (ordered by time, then file position) is an exact duplicate.
WITH flagged AS (
    SELECT
        row_number() OVER w > 1 AS has_prev,
        {feature} IS NOT DISTINCT FROM lag({feature}) OVER w AS same
    FROM samples
    WINDOW w AS (PARTITION BY {session} ORDER BY {time}, _row)
)
SELECT
    count(*) AS rows,
    count(*) FILTER (WHERE has_prev) AS rows_with_prev,
    count(*) FILTER (WHERE has_prev AND same) AS exact,
    0 AS partial,
    count(*) AS "values"
FROM flagged;
