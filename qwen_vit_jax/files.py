"""Files written whole or not at all, one writer per output, a full disk in words, JSON objects read
with a clear error, and SIGTERM as Ctrl-C.

Every writer of the package (converted checkpoints, exports, embeddings files and their indexes)
goes through `atomic_file` or `atomic_dir`: the output is built as a temporary sibling, fsynced
and renamed into place, and any failure (Ctrl-C and SIGTERM included, see `sigterm_as_interrupt`)
removes the temporary and leaves an earlier output as it was. A full disk is `DiskFull`, saying
what was being written, the space it needed and what is free (`disk_full`); a long-running writer
holds `output_lock` on its output for its whole life. The bottom layer of the package: it imports
nothing of ours.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import tempfile
import threading
import time
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


@contextlib.contextmanager
def interrupts_deferred():
    """While the block runs, SIGINT and SIGTERM wait; the first to arrive is handled (by the handler
    in place before: KeyboardInterrupt) as the block ends. For a few steps that must happen together
    or not at all (rows written, then taken off the list of rows to write). Outside the main thread
    (where Python cannot install handlers) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[tuple] = []
    signals = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.signal(s, lambda signum, frame: held.append((signum, frame))) for s in signals}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if held:
            signum, frame = held[0]
            if callable(previous[signum]):
                previous[signum](signum, frame)
            elif previous[signum] == signal.SIG_DFL:
                signal.raise_signal(signum)  # its default action, now


# ---- a full disk --------------------------------------------------------------------------------
_FULL = (errno.ENOSPC, errno.EDQUOT)
# what writers that raise their own error types say: safetensors' Rust "... (os error 28)", pyarrow's
# "Detail: [errno 28] ..." (pyarrow's is an OSError, with or without errno set)
_FULL_WORDS = re.compile(r"No space left on device|Disk quota exceeded|os error (?:28|122)\b")


class DiskFull(OSError):
    """No space left on the device (or the quota) of `path` while `what` ("writing ..."): `need`
    bytes needed by `needed_for` (default: that write; an estimate, None when unknown), `free`
    bytes free once the partial file was removed."""

    def __init__(self, path: str | os.PathLike, need: int | None, what: str, needed_for: str | None = None):
        self.path, self.need, self.what, self.needed_for = pathlib.Path(path), need, what, needed_for
        try:
            self.free = shutil.disk_usage(self.path.parent).free
        except OSError:
            self.free = None
        super().__init__(errno.ENOSPC, str(self))

    def __str__(self) -> str:
        if self.need is None:
            need = "more space needed"
        else:
            need = (
                f"{self.needed_for} needs about {_size(self.need)}"
                if self.needed_for
                else f"about {_size(self.need)} needed"
            )
        free = f", {_size(self.free)} free" if self.free is not None else ""
        return f"no space left on the device of {self.path} ({self.what}): {need}{free}"


def disk_full(err: BaseException) -> bool:
    """Whether `err` (an OSError, or a writer's own error type) is a full disk or a used-up quota."""
    return getattr(err, "errno", None) in _FULL or bool(_FULL_WORDS.search(str(err)))


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


# ---- one writer per output ---------------------------------------------------------------------
class OutputBusy(OSError):
    """Another live process holds the output's lock (the message names it)."""


@dataclasses.dataclass(frozen=True)
class Lock:
    """A held `output_lock`: `note` is a line to show (a stale lock taken over, a file system
    without locks), or None."""

    path: pathlib.Path
    note: str | None = None


# flock's answers on a file system that has no locks (NFS without lockd, some FUSE mounts)
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS}


@contextlib.contextmanager
def output_lock(path: str | os.PathLike) -> Iterator[Lock]:
    """Hold an exclusive lock on `path` (`flock` on PATH.lock, which names the holder: pid, host,
    start time) while the block runs; PATH.lock is removed at the end. Another process holding it:
    `OutputBusy` at once, naming it. A PATH.lock whose holder is gone (killed: the kernel drops a
    flock with its process) is taken over, and `Lock.note` says so. A file system without locks:
    the block runs unlocked, and `Lock.note` says so."""
    path = pathlib.Path(path)
    try:
        import fcntl
    except ImportError:  # (Windows)
        yield Lock(path, f"warning: no file locks on this platform: nothing stops another run from writing {path}")
        return
    lock = path.with_name(path.name + ".lock")
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise OutputBusy(f"{path} is being written by another run ({holder or 'starting now'})") from None
        except OSError as e:
            os.close(fd)
            if e.errno not in _NO_LOCKS:
                raise
            fd, reason = None, os.strerror(e.errno)
            break
        try:
            same = os.fstat(fd).st_ino == os.stat(lock).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # its holder removed it as we opened it: lock the file now at that path
    if fd is None:
        with contextlib.suppress(OSError):
            if lock.stat().st_size == 0:
                lock.unlink()  # ours, empty: nothing to tell another run
        note = (
            f"warning: the file system of {path} has no locks ({reason}): "
            "nothing stops another run from writing it at the same time; going on"
        )
        yield Lock(path, note)
        return
    try:
        stale = _holder(fd)
        os.ftruncate(fd, 0)
        since = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {since}\n".encode(), 0)
        yield Lock(path, _stale_note(lock, stale) if stale else None)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(lock)  # while still held: a run that opened it meanwhile sees it gone and retries
        os.close(fd)


def _stale_note(lock: pathlib.Path, stale: str) -> str:
    host = re.search(r" on (\S+) since ", stale)
    if host is None or host[1] == socket.gethostname():
        return f"note: {lock} was left by a run that is gone ({stale}): taken over"
    # on this host the kernel's word is final; another host's lock is seen only where the file system shares locks
    return (
        f"note: {lock} names a run on another host that holds no lock ({stale}): taken over (if that run "
        "still writes, this file system does not share locks between hosts: stop one of them)"
    )


def _holder(fd: int) -> str:
    """What a lock file says of its holder ("pid N on HOST since T"), or "" when empty."""
    return os.pread(fd, 512, 0).decode(errors="replace").strip()
