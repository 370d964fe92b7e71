"""The encoder's outputs are the ones stored before it was cut into named parts (encoder_golden.py
says how the file was made): bit for bit on the machine that made it, at the numerics bars on
another CPU. One child process with two host devices (the mesh case needs them before jax starts)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent


def test_outputs_equal_the_stored_ones():
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(HERE.parent))
    r = subprocess.run(
        [sys.executable, str(HERE / "encoder_golden.py"), "--check"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "arrays equal" in r.stdout
