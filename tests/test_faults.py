"""`encode` under faults: the main process killed (SIGKILL) with workers running, a full disk (a
small file system the test mounts where it may, and writes made to fail with ENOSPC everywhere), two
runs on one output, and a damaged file to resume.

Where a process boundary is what is tested (a kill, a second process holding OUT, a mount) the run is
the real command line in a subprocess, started through a few lines of test code (WRAPPER) that can
pause at the start of an encode call until a flag file exists (saying PAUSED on stderr). The rest
call `cli.main` in this process; a full disk is played there by making the writes of OUT's format
fail with ENOSPC from a given write on, the way the writers themselves report it (each writes its
bytes first, so a partial file exists).
"""

from __future__ import annotations

import errno
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from sample_images import make_image

from benchmarks.workloads.sessions import session_pids
from qwen_vit_jax import files
from qwen_vit_jax.data import parquet
from qwen_vit_jax.data.embeddings import read_embeddings
from qwen_vit_jax.processes import die_with_parent
from qwen_vit_jax.tools import cli

WRAPPER = r"""
import os, sys, time

pause_at = int(os.environ.get("QVJ_PAUSE_AT", "0"))  # the encode call to pause at, until $QVJ_FLAG exists
if pause_at:
    from qwen_vit_jax.runtime import encoder

    real_encode, calls = encoder.VisionEncoder.encode, []
    def encode(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == pause_at:
            print("PAUSED", file=sys.stderr, flush=True)
            while not os.path.exists(os.environ["QVJ_FLAG"]):
                time.sleep(0.05)
        return real_encode(self, *args, **kwargs)
    encoder.VisionEncoder.encode = encode

from qwen_vit_jax.tools import cli
cli.run()
"""


SIZES = [(112, 84), (84, 112), (56, 140), (112, 112), (84, 84), (140, 56)]  # 36 .. 64 patches


def _folder(path: pathlib.Path, n: int) -> pathlib.Path:
    """`n` small images: with --batch-patches 64 each is a call of its own."""
    path.mkdir()
    for i in range(n):
        make_image(*SIZES[i % len(SIZES)], seed=i).save(path / f"im{i:02d}.png")
    return path


@pytest.fixture
def images(tmp_path):
    return _folder(tmp_path / "images", 6)


def _command(ckpt, images, out, *extra) -> list[str]:
    return ["encode", str(ckpt), str(images), "-o", str(out), "--batch-patches", "64", *map(str, extra)]


def _env(**kw) -> dict:
    return dict(os.environ, **{k: str(v) for k, v in kw.items()})


def run(capsys, args: list[str]) -> tuple[int, str]:
    """The CLI with `args` in this process (a second process is not what these cases test), to its
    end -> (exit status, stderr)."""
    rc = cli.main(args)
    return rc, capsys.readouterr().err


def full_disk_from(monkeypatch, at: int) -> None:
    """Make the writes of every output format fail with ENOSPC from write `at` on, the way each writer
    reports a full disk (an OSError: pyarrow's, our safetensors and npz writers'), after writing its
    bytes (a partial file is left to clean up)."""
    import pyarrow.parquet as pq

    from qwen_vit_jax.data import embeddings
    from qwen_vit_jax.weights import safetensors_io

    writes = []

    def failing(real, error):
        def write(*args, **kwargs):
            writes.append(1)
            real(*args, **kwargs)
            if len(writes) >= at:
                raise error

        return write

    no_space = "Error writing bytes to file. Detail: [errno 28] No space left on device"
    monkeypatch.setattr(
        pq.ParquetWriter, "write_table", failing(pq.ParquetWriter.write_table, OSError(errno.ENOSPC, no_space))
    )
    for module, name in ((safetensors_io, "write_safetensors"), (embeddings, "savez")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, failing(real, OSError(errno.ENOSPC, "No space left on device")))


def start_paused(args: list[str], flag: pathlib.Path, at: int = 2, **popen) -> subprocess.Popen:
    """The CLI with `args`, paused at the start of encode call `at` until `flag` exists."""
    cmd = [sys.executable, "-c", WRAPPER, *args]
    env = _env(QVJ_PAUSE_AT=at, QVJ_FLAG=flag)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, **popen)
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if line.startswith("PAUSED"):
            return proc
    proc.kill()
    pytest.fail(f"the run never paused:\n{''.join(lines)}{proc.communicate()[1]}")


def clean_run(ckpt, images, out) -> None:
    assert cli.main(_command(ckpt, images, out)) == 0


def assert_same_rows(a, b) -> None:
    a, b = read_embeddings(a), read_embeddings(b)
    assert a.names == b.names and np.array_equal(a.grid_thw, b.grid_thw)
    np.testing.assert_array_equal(a.embeddings, b.embeddings)


def leftovers(folder: pathlib.Path) -> list[str]:
    """Temporary files and lock files under `folder`: none may be left."""
    return sorted(str(p) for p in folder.rglob("*") if p.name.endswith((".tmp", ".lock")) or ".tmp-" in p.name)


# ---- the main process killed: nothing keeps running -----------------------------------------------
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="lists processes in /proc")
def test_sigkill_leaves_no_process_and_resume_is_whole(tiny_dirs, tmp_path, capsys):
    _, ckpt = tiny_dirs
    images = _folder(tmp_path / "images", 12)  # the workers are still at work at the third call
    out = tmp_path / "out" / "emb.parquet"
    out.parent.mkdir()
    args = _command(ckpt, images, out, "--workers", "2", "--save-every", "0")
    proc = start_paused(args, tmp_path / "never", at=3, start_new_session=True)  # its own session: what it starts
    try:
        started = session_pids(proc.pid)
        assert len(started) >= 3, started  # this run, its two workers (and multiprocessing's resource tracker)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 15
        while session_pids(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert session_pids(proc.pid) == [], "processes outlived the killed run"
    finally:
        for pid in session_pids(proc.pid):
            os.kill(pid, signal.SIGKILL)
        proc.stdout.close()
        proc.stderr.close()
    assert len(parquet.part_files(out)) == 2  # the first two calls' rows, checkpointed
    assert (out.parent / "emb.parquet.lock").exists()  # its holder is gone

    rc, err = run(
        capsys, _command(ckpt, images, out, "--resume", "--workers", "0")
    )  # (any worker count: the same rows)
    assert rc == 0, err
    assert "was left by a run that is gone" in err and "taken over" in err, err
    assert "resume: 2 of 12 inputs already in" in err
    assert os.listdir(out.parent) == ["emb.parquet"]
    clean_run(ckpt, images, tmp_path / "clean.parquet")
    assert_same_rows(out, tmp_path / "clean.parquet")


PARENT = r"""
import multiprocessing, sys, time
from qwen_vit_jax.processes import die_with_parent

def busy():  # a worker busy in Python, reading no pipe: only the watch can end it
    die_with_parent()
    while True:
        sum(range(1000))

if __name__ == "__main__":
    child = multiprocessing.get_context("spawn").Process(target=busy, daemon=True)
    child.start()
    print(child.pid, flush=True)
    time.sleep(300)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="lists processes in /proc")
def test_a_busy_child_dies_with_its_parent(tmp_path):
    """The helper every pool's workers call (the service's too), on its own."""
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    proc = subprocess.Popen([sys.executable, script], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        child = int(proc.stdout.readline())
        assert child in session_pids(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 15
        while session_pids(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert session_pids(proc.pid) == []
    finally:
        for pid in session_pids(proc.pid):
            os.kill(pid, signal.SIGKILL)
        proc.stdout.close()
    with pytest.raises(RuntimeError, match="not started by multiprocessing"):
        die_with_parent()  # this test's own process


# ---- a full disk: an error naming OUT and the space, nothing half-written, checkpoints kept ------------
PARTS = [f"emb.parquet.parts/part-0000{i}.parquet" for i in range(6)]
FULL = [
    # (OUT, the failing write, the files then in OUT's folder, what the error says is kept)
    ("emb.parquet", 2, PARTS[:1], "emb.parquet.parts/ keeps the 1 input checkpointed;"),
    ("emb.parquet", 8, PARTS, "emb.parquet.parts/ keeps the 6 inputs checkpointed;"),
    ("emb.safetensors", 2, ["emb.safetensors"], "keeps the 1 new input of its last save"),
    ("emb.npz", 3, ["emb.npz"], "keeps the 2 new inputs of its last save"),
]


@pytest.mark.parametrize("name, at, held, kept", FULL, ids=["parquet-part", "parquet-merge", "safetensors", "npz"])
def test_a_full_disk_is_an_error_and_leaves_nothing_half_written(
    tiny_dirs, images, tmp_path, capsys, monkeypatch, name, at, held, kept
):
    _, ckpt = tiny_dirs
    folder = tmp_path / "out"
    folder.mkdir()
    out = folder / name
    args = _command(ckpt, images, out, "--save-every", "0", "--workers", "0")
    with monkeypatch.context() as m:
        full_disk_from(m, at)
        rc, err = run(capsys, args)
    assert rc == 1 and "Traceback" not in err, err
    error = err.strip().splitlines()[-1]
    assert error.startswith(f"error: no space left on the device of {out} ("), error
    assert "): finishing the run needs about " in error and " free; " in error and kept in error, error
    assert error.endswith("free space, then the same command with --resume continues"), error
    assert sorted(str(f.relative_to(folder)) for f in folder.rglob("*") if f.is_file()) == held
    if name == "emb.parquet" and at == 2:  # --resume then ends whole
        rc, err = run(capsys, [*args, "--resume"])
        assert rc == 0, err
        assert os.listdir(folder) == ["emb.parquet"]
        clean_run(ckpt, images, tmp_path / "clean.parquet")
        assert_same_rows(out, tmp_path / "clean.parquet")


INNER = r"""
import contextlib, io, json, os, shutil, subprocess, sys
from qwen_vit_jax.tools import cli

mount, cmd, resume, copy = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", mount], check=True)
runs = []
for args in (cmd, resume):  # the command line's main, in this process: the mount namespace's
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        rc = cli.main(args)
    files = sorted(os.path.relpath(os.path.join(r, f), mount) for r, _, fs in os.walk(mount) for f in fs)
    runs.append({"rc": rc, "stderr": err.getvalue(), "files": files})
    subprocess.run(["mount", "-o", "remount,size=16m", mount], check=True)  # space freed: --resume goes on
shutil.copytree(mount, copy)
print(json.dumps(runs))
"""


def _unshare() -> list[str] | None:
    """The command that runs a program in a mount namespace of its own (a mount there leaves the
    machine as it was, whatever happens), or None where this user may not."""
    if shutil.which("unshare") is None or not sys.platform.startswith("linux"):
        return None
    for cmd in (["unshare", "--mount"], ["unshare", "--user", "--map-root-user", "--mount"]):
        probe = [*cmd, "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt 2>/dev/null || mount -t tmpfs tmpfs /tmp"]
        if subprocess.run(probe, capture_output=True, timeout=30).returncode == 0:
            return cmd
    return None


@pytest.mark.parametrize("name", ["emb.parquet", "emb.safetensors"])
def test_a_full_small_file_system(tiny_dirs, images, tmp_path, name):
    """A 64 kB tmpfs mounted for the run: OUT does not fit; then, with space, --resume ends whole."""
    unshare = _unshare()
    if unshare is None:
        pytest.skip("cannot mount a file system here (no root, no user namespaces): the ENOSPC test covers it")
    _, ckpt = tiny_dirs
    mount = tmp_path / "small"
    mount.mkdir()
    cmd = _command(ckpt, images, mount / name, "--save-every", "0", "--workers", "0")
    inner = [sys.executable, "-c", INNER, mount, json.dumps(cmd), json.dumps([*cmd, "--resume"]), tmp_path / "copy"]
    p = subprocess.run([*unshare, *map(str, inner)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    full, resumed = json.loads(p.stdout)
    assert full["rc"] == 1 and "Traceback" not in full["stderr"], full["stderr"]
    error = full["stderr"].strip().splitlines()[-1]
    assert error.startswith(f"error: no space left on the device of {mount / name} ("), error
    assert "): finishing the run needs about " in error, error
    assert error.endswith("free space, then the same command with --resume continues"), error
    assert not [f for f in full["files"] if f.endswith((".tmp", ".lock")) or ".tmp-" in f], full["files"]
    assert full["files"], "the checkpointed rows are kept"
    assert resumed["rc"] == 0, resumed["stderr"]
    assert resumed["files"] == [name]
    clean_run(ckpt, images, tmp_path / name)
    assert_same_rows(tmp_path / "copy" / name, tmp_path / name)


# ---- one output, one writer -------------------------------------------------------------------------
def test_a_second_run_on_the_same_output_refuses_at_once(tiny_dirs, images, tmp_path, capsys):
    _, ckpt = tiny_dirs
    out = tmp_path / "out" / "emb.parquet"
    out.parent.mkdir()
    args = _command(ckpt, images, out, "--save-every", "0", "--workers", "0")
    first = start_paused(args, tmp_path / "go")  # another process holds OUT
    try:
        for extra in ([], ["--resume"], ["--overwrite"]):
            t0 = time.monotonic()
            rc, err = run(capsys, [*args, *extra])
            assert rc == 1, err
            assert err.startswith(f"error: {out} is being written by another run (pid {first.pid} on "), err
            assert " since " in err and "Traceback" not in err
            assert time.monotonic() - t0 < 60 and first.poll() is None  # at once: the first still runs
        (tmp_path / "go").touch()
        _, err = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
            first.communicate()
    assert first.returncode == 0, err
    assert os.listdir(out.parent) == ["emb.parquet"]  # no lock, no parts left
    clean_run(ckpt, images, tmp_path / "clean.parquet")
    assert_same_rows(out, tmp_path / "clean.parquet")


def test_a_file_system_without_locks_is_said_and_the_run_goes_on(tmp_path, monkeypatch):
    import errno
    import fcntl

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with files.output_lock(tmp_path / "emb.parquet") as lock:
        assert "has no locks (No locks available)" in lock.note and "going on" in lock.note
    assert os.listdir(tmp_path) == []


def test_an_interrupt_waits_for_a_write_to_end():
    """What keeps a parquet part's rows from being written twice: Ctrl-C / SIGTERM in the middle of
    `interrupts_deferred` arrive as it ends."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        steps = []
        with pytest.raises(KeyboardInterrupt), files.sigterm_as_interrupt(), files.interrupts_deferred():
            os.kill(os.getpid(), sig)
            time.sleep(0.01)  # (a signal is handled between two bytecodes: here, had it not waited)
            steps.append(sig)
        assert steps == [sig]


def test_save_every_flag(capsys, tiny_dirs, images, tmp_path):
    assert cli.main(["encode", "--help"]) == 0
    assert "--save-every S" in capsys.readouterr().out
    for bad in ("-1", "nan"):
        assert cli.main(_command(tiny_dirs[1], images, tmp_path / "e.npz", "--save-every", bad)) == 1
        assert f"error: --save-every must be >= 0 seconds, got {float(bad)}" in capsys.readouterr().err
    assert os.listdir(tmp_path) == ["images"]


# ---- a damaged file to resume ---------------------------------------------------------------------
@pytest.mark.parametrize("name", ["emb.parquet", "emb.safetensors"])
def test_a_truncated_file_to_resume_is_named(tiny_dirs, images, tmp_path, capsys, name):
    _, ckpt = tiny_dirs
    out = tmp_path / name
    clean_run(ckpt, images / "im00.png", out)
    damaged = out.read_bytes()[: out.stat().st_size // 2]
    out.write_bytes(damaged)
    rc, err = run(capsys, _command(ckpt, images, out, "--resume"))
    assert rc == 1 and "Traceback" not in err, err
    error = err.strip().splitlines()[-1]
    assert error.startswith(f"error: --resume: cannot read {out} ("), error
    assert error.endswith("--overwrite replaces it, or move it aside to keep it"), error
    assert out.read_bytes() == damaged and sorted(os.listdir(tmp_path)) == sorted(["images", name])
