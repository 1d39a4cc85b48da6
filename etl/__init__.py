"""recpipe ETL: raw logs -> session-clustered zstd Parquet, and DuckDB duplication statistics.

Stages: :mod:`etl.synth` (synthetic logs), :mod:`etl.shard` (RecD O1), :mod:`etl.build` (O2),
:mod:`etl.stats`. This package never imports torch.
"""
