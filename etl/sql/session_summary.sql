-- Samples per session: count, mean and quantiles.
WITH per_session AS (
    SELECT {session}, count(*) AS n
    FROM samples
    GROUP BY {session}
)
SELECT
    count(*) AS sessions,
    coalesce(sum(n), 0) AS rows,
    avg(n) AS mean,
    quantile_cont(n, 0.5) AS median,
    quantile_cont(n, 0.9) AS p90,
    quantile_cont(n, 0.99) AS p99,
    max(n) AS max
FROM per_session;
