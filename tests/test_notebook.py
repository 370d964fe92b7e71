"""notebooks/encode.ipynb executes top to bottom (so it cannot rot) and is stored without outputs."""

from __future__ import annotations

import os
import pathlib
import sys

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOK = pathlib.Path(__file__).parent.parent / "notebooks" / "encode.ipynb"


def test_notebook_is_saved_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None


def test_notebook_executes(tmp_path, monkeypatch):
    # The kernel is started as `python` from PATH: make that this interpreter.
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    monkeypatch.delenv("QWEN_VIT_JAX_CKPT", raising=False)  # build the tiny random checkpoint
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "programs compiled: 1" in text and "pixel_values (768, 1176)" in text
    shown = [o for o in outputs if o.output_type in ("display_data", "execute_result")]
    images = [o for o in shown if "image/png" in o.data]
    assert len(images) == 2  # the input image and the PCA picture
