"""The benchmarks: named suites run by one runner, results stored as JSON, the results page rendered
from them.

    python -m benchmarks                        # the suites, one line each
    python -m benchmarks SUITE [--quick] [--against REV] [--repeats N] [--rounds N] [...]
    python -m benchmarks render [--check]       # benchmarks/RESULTS.md from benchmarks/results/*.json

Not part of the installed package: run from the repository root (README.md in this folder). This
file imports nothing, so `benchmarks.workloads` (shared with the tests) stays light.
"""
