-- Histogram of samples per session in log2 bins: bin k holds sessions with 2^k <= n < 2^(k+1).
WITH per_session AS (
    SELECT {session}, count(*) AS n
    FROM samples
    GROUP BY {session}
)
SELECT
    floor(log2(n))::INTEGER AS bin,
    count(*) AS sessions,
    sum(n) AS samples
FROM per_session
GROUP BY bin
ORDER BY bin;
