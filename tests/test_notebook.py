"""Every notebook under notebooks/ executes top to bottom (so it cannot rot) and is stored with the
outputs of such a run (so a reader on a code host sees them): a fresh execution must give the
stored outputs up to what varies from run to run (notebooks/execute.py's `signature`: timings and
other decimal numbers masked, pictures compared by kind). After changing a notebook or what it
prints, store fresh outputs with `python notebooks/execute.py`."""

from __future__ import annotations

import re

import pytest
from notebook_runs import executed, runner, text_of

pytestmark = pytest.mark.xdist_group("notebooks")  # each notebook executed once (notebook_runs)

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("nbclient")


@pytest.mark.parametrize("path", runner.notebooks(), ids=lambda p: p.name)
def test_notebook_is_stored_with_fresh_outputs(path):
    stored = nbformat.read(path, as_version=4)
    nbformat.validate(stored)
    code = [cell for cell in stored.cells if cell.cell_type == "code"]
    assert code and all(cell.execution_count is not None for cell in code), "stored without running it"
    fresh = executed(path.name)
    assert runner.signature(fresh) == runner.signature(stored), (
        f"{path.name}: the stored outputs are stale; run `python notebooks/execute.py`"
    )


def test_signature_masks_timings_and_nothing_else():
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("print()")]
    out = nbformat.v4.new_output("stream", name="stdout", text="first call 3.21 s; programs compiled: 1\n")
    nb.cells[0].outputs = [out]
    before = runner.signature(nb)
    out.text = "first call 0.57 s; programs compiled: 1\n"
    assert runner.signature(nb) == before  # a timing changed
    nb.cells[0].outputs = [
        nbformat.v4.new_output("stream", name="stdout", text="first call 0.57 s; "),
        nbformat.v4.new_output("stream", name="stdout", text="programs compiled: 1\n"),
        nbformat.v4.new_output("stream", name="stderr", text="a warning\n"),
    ]
    assert runner.signature(nb) == before  # cut into other chunks, a warning on stderr
    nb.cells[0].outputs = [out]
    out.text = "first call 0.57 s; programs compiled: 2\n"
    assert runner.signature(nb) != before  # a count changed
    nb.cells[0].outputs = []
    assert runner.signature(nb) != before  # an output went missing


def test_flax_module_notebook_executes():
    text = text_of(executed("flax_module.ipynb"))
    assert "image tokens equal encode's: max |diff| 0.0e+00" in text
    compiled = re.search(r"programs compiled: (\d+) for (\d+) distinct buckets", text)
    assert compiled and compiled[1] == compiled[2]  # one program per bucket
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+) in 20 steps; programs compiled: 1", text).groups())
    assert last < 0.5 * first


def test_notebook_executes():
    nb = executed("encode.ipynb")
    text = text_of(nb)
    assert "programs compiled: 1" in text and "pixel_values (768, 1176)" in text
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    shown = [o for o in outputs if o.output_type in ("display_data", "execute_result")]
    images = [o for o in shown if "image/png" in o.data]
    assert len(images) == 3  # the input image, its PCA picture, the video's PCA strip
    assert "36 frames -> grid_thw [[3, 24, 32]], 576 tokens" in text
