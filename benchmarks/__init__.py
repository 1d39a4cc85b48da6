"""recpipe's benchmarks: one module per component, each run as ``python -m benchmarks.NAME``
from the repository root (``make bench`` runs them all).

Every script measures ratios against a baseline in the same run, alternating the two, and writes
``benchmarks/results/NAME.json`` with the spread over repeats; ``python -m benchmarks.report``
writes the tables of docs/benchmarks.md from those files.
"""
