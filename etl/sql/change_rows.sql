-- Samples (by file position) whose value of one feature differs from the previous sample of the
-- same session. First samples of sessions are left out: every feature "changes" there.
SELECT _row
FROM (
    SELECT
        _row,
        row_number() OVER w > 1 AS has_prev,
        {feature} IS DISTINCT FROM lag({feature}) OVER w AS changed
    FROM samples
    WINDOW w AS (PARTITION BY {session} ORDER BY {time}, _row)
)
WHERE has_prev AND changed
ORDER BY _row;
