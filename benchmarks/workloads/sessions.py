"""The live processes of a session (Linux /proc): what a test or benchmark that started a command with
`start_new_session=True` checks is gone after killing it (its workers, multiprocessing's resource
tracker). Shared by tests/test_faults.py and the faults suite."""

from __future__ import annotations

import pathlib


def session_pids(sid: int) -> list[int]:
    """The live (not zombie) processes of session `sid`."""
    pids = []
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # state, ppid, pgrp, session, ...
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids
