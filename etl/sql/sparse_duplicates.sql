-- Duplicates of one sparse (list) feature against the previous sample of the same session
-- (ordered by time, then file position).
--   exact:   cur equals prev (same ids, same order).
--   partial: not exact, and cur is prev moved by exactly one id (lp = len(prev), lc = len(cur),
--            slices 1-based and inclusive):
--              append         lp >= 1, lc = lp + 1, cur[1:lp] = prev           (prev + [x])
--              prepend        lp >= 1, lc = lp + 1, cur[2:lc] = prev           ([x] + prev)
--              slide left     lp >= 2, lc = lp,     cur[1:lc-1] = prev[2:lp]   (prev[1:] + [x])
--              slide right    lp >= 2, lc = lp,     cur[2:lc] = prev[1:lp-1]   ([x] + prev[:-1])
WITH flagged AS (
    SELECT
        row_number() OVER w > 1 AS has_prev,
        {feature} AS cur,
        lag({feature}) OVER w AS prev,
        len({feature}) AS lc,
        len(lag({feature}) OVER w) AS lp
    FROM samples
    WINDOW w AS (PARTITION BY {session} ORDER BY {time}, _row)
)
SELECT
    count(*) AS rows,
    count(*) FILTER (WHERE has_prev) AS rows_with_prev,
    count(*) FILTER (WHERE has_prev AND cur IS NOT DISTINCT FROM prev) AS exact,
    count(*) FILTER (
        WHERE has_prev AND cur IS DISTINCT FROM prev AND (
            (lp >= 1 AND lc = lp + 1 AND cur[1:lp] = prev)
            OR (lp >= 1 AND lc = lp + 1 AND cur[2:lc] = prev)
            OR (lp >= 2 AND lc = lp AND cur[1:lc - 1] = prev[2:lp])
            OR (lp >= 2 AND lc = lp AND cur[2:lc] = prev[1:lp - 1])
        )
    ) AS partial,
    coalesce(sum(lc), 0) AS "values"
FROM flagged;
