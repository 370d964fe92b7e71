"""The workloads the benchmarks and the tests share, one module per kind:

  grids      the seed grids, the compile stream's and the peer stream's sizes, the service's image sizes
  traffic    `qwen-vit-jax serve` on 127.0.0.1: a server subprocess, JPEG bodies, closed- and open-loop
             clients, malformed bodies, the server's RSS and workers
  attacks    hostile clients: silent, slow and stalled sockets
  sessions   the live processes of a session (what a kill must leave behind: nothing)
  clips      test videos written with PyAV (moving shapes over a gradient, odd sizes and frame rates)
  vllm_env   vLLM's CPU build in a venv of its own (`make test` builds it: a script, run by path)
  vllm_cases tiny checkpoints vLLM serves (tokenizer, processor), their inputs, and the run of
             vllm_engine.py (vLLM's side, a script of the vLLM venv)

Tests import them as `from benchmarks.workloads import traffic` (the repository root is on sys.path:
`python -m pytest`, or pytest's `pythonpath` setting in pyproject.toml). Nothing here imports jax or
torch at the top.
"""
