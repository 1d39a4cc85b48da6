-- Sessions seen by each batch of $batch_size rows in file order. S, the average number of
-- samples a session contributes to a batch, is rows / (batch, session) pairs.
WITH pairs AS (
    SELECT _row // $batch_size AS batch, {session}, count(*) AS n
    FROM samples
    GROUP BY batch, {session}
)
SELECT
    count(*) AS batch_sessions,
    coalesce(sum(n), 0) AS rows,
    count(DISTINCT batch) AS batches
FROM pairs;
