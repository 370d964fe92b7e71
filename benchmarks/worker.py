"""One worker process of a suite: `python benchmarks/worker.py MODULE KIND` runs
benchmarks.MODULE.WORKERS[KIND] on the JSON payload read from stdin and prints `RESULT {json}`
(common.run_worker starts it and reads that line).

The package `benchmarks` is this file's folder, whatever PYTHONPATH says, while `qwen_vit_jax` is
whatever PYTHONPATH finds first: a revision's worktree for --against (common.rev_env), else the
working tree. So this file is run by path, never with `-m` (which would put the working directory,
and its qwen_vit_jax, first).
"""

import importlib
import importlib.util
import json
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent


def main() -> None:
    if sys.path and pathlib.Path(sys.path[0]).resolve() == HERE:
        del sys.path[0]  # the script's folder: its modules are the package's, not top-level names
    spec = importlib.util.spec_from_file_location(
        "benchmarks", HERE / "__init__.py", submodule_search_locations=[str(HERE)]
    )
    package = importlib.util.module_from_spec(spec)
    sys.modules["benchmarks"] = package
    spec.loader.exec_module(package)
    module, kind = sys.argv[1:3]
    common = importlib.import_module("benchmarks.common")
    result = importlib.import_module(f"benchmarks.{module}").WORKERS[kind](json.loads(sys.stdin.read()))
    print(common.RESULT_TAG + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
