"""Files written whole or not at all, JSON objects read with a clear error, and SIGTERM as Ctrl-C.

Every writer of the package (converted checkpoints, exports, embeddings files and their indexes)
goes through `atomic_file` or `atomic_dir`: the output is built as a temporary sibling, fsynced
and renamed into place, and any failure (Ctrl-C and SIGTERM included, see `sigterm_as_interrupt`)
removes the temporary and leaves an earlier output as it was. The bottom layer of the package:
it imports nothing of ours.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from typing import Any


def fsync(path: str | os.PathLike) -> None:
    """Flush a file's (or a directory's) data and metadata to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _umask() -> int:
    umask = os.umask(0o22)
    os.umask(umask)
    return umask


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, durable: bool = True) -> Iterator[pathlib.Path]:
    """Yield a temporary sibling of `path` to write; on success it is fsynced (unless not `durable`:
    for files whose readers detect a torn write themselves) and renamed over `path` (an ordinary
    file: mode 0666 & ~umask), on any failure removed, `path` untouched."""
    path = pathlib.Path(path)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = pathlib.Path(name)
    try:
        yield tmp
        if durable:
            fsync(tmp)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it 0600
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[pathlib.Path]:
    """Yield a temporary sibling directory of `path` to fill; on success it is fsynced and renamed
    into place (an existing `path` is moved aside first and removed only once the new one is in),
    on any failure removed, `path` untouched. The caller decides whether `path` may be replaced."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it 0700; the result is an ordinary directory
        yield tmp
        fsync(tmp)
        _install(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _install(tmp: pathlib.Path, out: pathlib.Path) -> None:
    if os.path.lexists(out):  # overwrite: old aside, new in, then drop old
        aside = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        try:
            os.rename(out, aside)  # replaces the empty placeholder
        except BaseException:
            aside.rmdir()
            raise
        try:
            os.rename(tmp, out)
        except BaseException:
            os.rename(aside, out)
            raise
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.rename(tmp, out)
    fsync(out.parent)


def load_json_object(path_or_dict, filename: str, what: str) -> tuple[dict[str, Any], str]:
    """(the JSON object, where it came from) from a dict, a JSON file, or a directory holding
    `filename`. FileNotFoundError for a missing file, ValueError for bad JSON or a non-object."""
    if isinstance(path_or_dict, dict):
        return path_or_dict, f"{what} dict"
    path = os.fspath(path_or_dict)
    if os.path.isdir(path):
        path = os.path.join(path, filename)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no {what} at {path}")
    try:
        with open(path) as f:
            d = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(d).__name__}")
    return d, path


@contextlib.contextmanager
def sigterm_as_interrupt():
    """While the block runs, SIGTERM raises KeyboardInterrupt in the main thread, as Ctrl-C does.

    SIGTERM's default action ends the process on the spot: no `except` / `finally` runs, so a
    temporary file or directory being written would be left behind. As an exception it unwinds
    like Ctrl-C: the writers remove their temporary output and the previous output stays intact.
    Outside the main thread (where Python cannot install handlers) it does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
