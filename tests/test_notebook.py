"""The notebooks execute top to bottom (so they cannot rot) and are stored without outputs."""

from __future__ import annotations

import os
import pathlib
import re
import sys

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = pathlib.Path(__file__).parent.parent / "notebooks"


@pytest.mark.parametrize("name", ["encode.ipynb", "flax_module.ipynb"])
def test_notebook_is_saved_without_outputs(name):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None


def execute(name: str, tmp_path, monkeypatch) -> tuple[list, str]:
    """Run notebooks/<name> in a fresh kernel: (its outputs, their stream text)."""
    # The kernel is started as `python` from PATH: make that this interpreter.
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    monkeypatch.delenv("QWEN_VIT_JAX_CKPT", raising=False)  # build the tiny random checkpoint
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    return outputs, "".join(o.get("text", "") for o in outputs if o.output_type == "stream")


def test_flax_module_notebook_executes(tmp_path, monkeypatch):
    _, text = execute("flax_module.ipynb", tmp_path, monkeypatch)
    assert "image tokens equal encode's: max |diff| 0.0e+00" in text
    compiled = re.search(r"programs compiled: (\d+) for (\d+) distinct buckets", text)
    assert compiled and compiled[1] == compiled[2]  # one program per bucket
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+) in 20 steps; programs compiled: 1", text).groups())
    assert last < 0.5 * first


def test_notebook_executes(tmp_path, monkeypatch):
    outputs, text = execute("encode.ipynb", tmp_path, monkeypatch)
    assert "programs compiled: 1" in text and "pixel_values (768, 1176)" in text
    shown = [o for o in outputs if o.output_type in ("display_data", "execute_result")]
    images = [o for o in shown if "image/png" in o.data]
    assert len(images) == 3  # the input image, its PCA picture, the video's PCA strip
    assert "36 frames -> grid_thw [[3, 24, 32]], 576 tokens" in text
