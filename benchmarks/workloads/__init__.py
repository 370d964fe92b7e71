"""The workloads the benchmarks and the tests share, one module per kind:

  grids      the seed grids, the compile stream's and the peer stream's sizes, the service's image sizes
  traffic    `qwen-vit-jax serve` on 127.0.0.1: a server subprocess, JPEG bodies, closed- and open-loop
             clients, malformed bodies, the server's RSS and workers
  attacks    hostile clients: silent, slow and stalled sockets
  sessions   the live processes of a session (what a kill must leave behind: nothing)

Tests import them as `from benchmarks.workloads import traffic` (the repository root is on sys.path:
`python -m pytest`, or pytest's `pythonpath` setting in pyproject.toml). Nothing here imports jax or
torch at the top.
"""
