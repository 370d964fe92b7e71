"""The notebooks under notebooks/ as the tests run them: each executed in a fresh kernel once per
test session (notebooks/execute.py), shared by the tests that read its outputs."""

from __future__ import annotations

import importlib.util
import pathlib

NOTEBOOKS = pathlib.Path(__file__).parent.parent / "notebooks"
_spec = importlib.util.spec_from_file_location("notebooks_execute", NOTEBOOKS / "execute.py")
runner = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(runner)

_executed: dict[str, object] = {}


def executed(name: str):
    """notebooks/<name> run in a fresh kernel, once per test session."""
    if name not in _executed:
        _executed[name] = runner.execute(NOTEBOOKS / name, timeout=300)
    return _executed[name]


def text_of(nb) -> str:
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    return "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
