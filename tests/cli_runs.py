"""The command line as a test runs it: in-process (`main`: `cli.main`, which returns the exit status
and prints exactly what the command line would) or, where the process boundary is what is tested,
in fresh interpreters without torch (`run`, `run_processes`)."""

from __future__ import annotations

import os
import subprocess
import sys

from qwen_vit_jax.tools import cli

# The command line in a fresh interpreter where `import torch` / `import transformers` fail, as on
# a machine without them: the runtime (convert, encode, demo) must never need them.
WITHOUT_TORCH = (
    "import sys; sys.modules.update(torch=None, transformers=None); "
    "from qwen_vit_jax.tools.cli import main; sys.exit(main(sys.argv[1:]))"
)


def run(*args, env=None, timeout=300):
    """`qwen-vit-jax ARGS` in a subprocess without torch -> CompletedProcess (text)."""
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_TORCH, *map(str, args)],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


def main(capsys, *args) -> tuple[int, str, str]:
    rc = cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def assert_clean_error(rc: int, err: str, *fragments: str) -> None:
    assert rc != 0
    assert err.startswith("error: ") or "\nerror: " in err, err
    assert "Traceback" not in err
    for f in fragments:
        assert f in err, err


def free_port() -> int:
    """A TCP port on 127.0.0.1 free now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_processes(n: int, *args, timeout: float = 150) -> list[tuple[int, str]]:
    """`qwen-vit-jax ARGS --coordinator 127.0.0.1:PORT --num-processes n --process-id I` in n
    processes of 2 host devices each -> [(exit status, stderr)]; all killed after `timeout` s."""
    import time

    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    port = free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                WITHOUT_TORCH,
                *map(str, args),
                "--coordinator",
                f"127.0.0.1:{port}",
                "--num-processes",
                str(n),
                "--process-id",
                str(i),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(n)
    ]
    end, results = time.monotonic() + timeout, []
    try:
        for p in procs:
            _, err = p.communicate(timeout=max(1.0, end - time.monotonic()))
            results.append((p.returncode, err))
    finally:
        for p in procs:  # a hung process (e.g. its peer died before the barrier) must not stall CI
            if p.poll() is None:
                p.kill()
                p.communicate()
    return results
