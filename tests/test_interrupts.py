"""`convert` and `encode` killed by SIGINT or SIGTERM: the previous output stays intact, no
temporary file is left, and `encode --resume` after a kill ends with the file an uninterrupted
run writes.

Each case runs the real command line (`qwen_vit_jax.tools.cli.main`) in a subprocess and signals it at
a known point. To make that point deterministic, the subprocess is started through a small
wrapper (below, test code only) that pauses at it and says so on stderr: right after a
safetensors file has been written under its temporary name (mid-write: nothing renamed into
place yet), or at the start of encode's second batch. The test waits for that line, then sends
the signal.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np
import pytest
from sample_images import make_image

from qwen_vit_jax.data.embeddings import read_embeddings
from qwen_vit_jax.tools import cli

WRAPPER = r"""
import faulthandler, signal, sys, time
faulthandler.register(signal.SIGUSR1)  # a stuck run's stacks, for the failure message
from qwen_vit_jax.tools import cli
from qwen_vit_jax.weights import convert
from qwen_vit_jax.runtime import encoder
from qwen_vit_jax.weights import safetensors_io

def pause(what):
    print(f"PAUSED {what}", file=sys.stderr, flush=True)
    for _ in range(3000):  # the signal arrives here. Short sleeps: Python runs its handler in the main
        time.sleep(0.1)  # thread, which a long sleep keeps waiting if the kernel handed it to another

if sys.argv[1] == "write":  # pause once the file exists under its temporary name
    real_write = convert.write_safetensors
    def write_then_pause(path, *args, **kwargs):
        real_write(path, *args, **kwargs)
        pause(f"mid-write {path}")
    convert.write_safetensors = safetensors_io.write_safetensors = write_then_pause  # convert's, encode's
else:  # "batch2": pause at the start of encode's second batch
    real_encode, calls = encoder.VisionEncoder.encode, []
    def encode(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            pause("batch 2")
        return real_encode(self, *args, **kwargs)
    encoder.VisionEncoder.encode = encode
sys.exit(cli.main(sys.argv[2:]))
"""
SIGNALS = [signal.SIGINT, signal.SIGTERM]


def run_and_signal(pause_at: str, sig: int, *args) -> tuple[int, str]:
    """Run the CLI with ARGS, pausing at `pause_at`; send `sig` there. -> (exit status, stderr)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", WRAPPER, pause_at, *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines = []
    try:
        for line in proc.stderr:
            lines.append(line)
            if line.startswith("PAUSED"):
                break
        else:
            pytest.fail(f"the command never reached the pause point:\n{''.join(lines)}")
        proc.send_signal(sig)
        try:
            _, rest = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running 120 s after {signal.Signals(sig).name}:\n{stuck(proc)}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, "".join(lines) + rest


def stuck(proc: subprocess.Popen) -> str:
    """What a process that did not end has to say: its signal masks, then every thread's stack."""
    with open(f"/proc/{proc.pid}/status") as f:
        masks = "".join(line for line in f if line.startswith(("SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt")))
    proc.send_signal(signal.SIGUSR1)
    try:
        _, err = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    return masks + err


def snapshot(folder) -> dict[str, bytes]:
    """Every file under `folder` (relative path -> bytes): a changed or stray file shows."""
    out = {}
    for root, _, files in os.walk(folder):
        for f in files:
            p = os.path.join(root, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, folder)] = fh.read()
    return out


@pytest.fixture
def images(tmp_path):
    d = tmp_path / "images"
    d.mkdir()
    for i, (h, w) in enumerate([(112, 84), (84, 112), (56, 140), (112, 112)]):
        make_image(h, w, seed=i).save(d / f"im{i}.png")
    return d


# ---- convert ------------------------------------------------------------------------------------
@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: s.name)
def test_convert_killed_mid_write_keeps_the_previous_output(tiny_dirs, tmp_path, sig):
    hf, _ = tiny_dirs
    parent = tmp_path / "parent"
    parent.mkdir()
    out = parent / "converted"
    rc, err = run_and_signal("write", sig, "convert", hf, out)  # never finishes: nothing installed
    assert rc == 130 and "error: interrupted" in err and "Traceback" not in err, err
    assert os.listdir(parent) == []

    assert cli.main(["convert", str(hf), str(out)]) == 0
    before = snapshot(parent)
    rc, err = run_and_signal("write", sig, "convert", hf, out, "--overwrite", "--dtype", "bfloat16")
    assert rc == 130 and "error: interrupted" in err and "Traceback" not in err, err
    assert snapshot(parent) == before  # the float32 output, byte for byte, and nothing else


# ---- encode -------------------------------------------------------------------------------------
@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: s.name)
def test_encode_killed_mid_write_keeps_the_previous_output(tiny_dirs, images, tmp_path, sig):
    _, ckpt = tiny_dirs
    parent = tmp_path / "out"
    parent.mkdir()
    out = parent / "emb.safetensors"
    assert cli.main(["encode", str(ckpt), str(images / "im0.png"), "-o", str(out)]) == 0
    before = snapshot(parent)
    rc, err = run_and_signal("write", sig, "encode", ckpt, images, "-o", out, "--overwrite")
    assert rc == 130 and "error: interrupted" in err and "Traceback" not in err, err
    assert snapshot(parent) == before
    assert read_embeddings(out).names == [str(images / "im0.png")]


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: s.name)
def test_encode_resume_after_a_kill_equals_an_uninterrupted_run(tiny_dirs, images, tmp_path, sig):
    _, ckpt = tiny_dirs
    args = [ckpt, images, "--batch-patches", "48"]  # one image per batch (each is 40 .. 64 patches)
    whole = tmp_path / "whole.safetensors"
    assert cli.main(["encode", *map(str, args), "-o", str(whole)]) == 0

    parent = tmp_path / "out"
    parent.mkdir()
    out = parent / "emb.safetensors"
    rc, err = run_and_signal("batch2", sig, "encode", *args, "-o", out)
    # interrupted after the first batch: what is done is saved, the rest left for --resume
    assert rc == 130 and "interrupted; 1 new input written" in err and "Traceback" not in err, err
    assert sorted(os.listdir(parent)) == ["emb.safetensors"]
    assert read_embeddings(out).names == [str(images / "im0.png")]

    assert cli.main(["encode", *map(str, args), "-o", str(out), "--resume"]) == 0
    assert sorted(os.listdir(parent)) == ["emb.safetensors"]
    a, b = read_embeddings(out), read_embeddings(whole)
    assert a.names == b.names and np.array_equal(a.grid_thw, b.grid_thw)
    np.testing.assert_array_equal(a.embeddings, b.embeddings)
    assert out.read_bytes() == whole.read_bytes()  # the same file, byte for byte
