"""notebooks/finetune.ipynb executes top to bottom on the tiny tower (LoRA + optax + Orbax + the
data-parallel step + export_hf + the check in HF) and its task is learned, not noise."""

from __future__ import annotations

import re

import pytest
from notebook_runs import executed, text_of

pytestmark = pytest.mark.xdist_group("notebooks")  # each notebook executed once (notebook_runs)

pytest.importorskip("nbformat")


def test_finetune_notebook_executes_and_learns(monkeypatch):
    monkeypatch.delenv("QWEN_VIT_JAX_HF", raising=False)  # the tiny random tower
    monkeypatch.delenv("QWEN_VIT_JAX_STEPS", raising=False)
    nb = executed("finetune.ipynb")  # one run per session, shared with test_notebook's freshness check
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    text = text_of(nb)
    assert "2 cpu device(s)" in text  # the data-parallel step really splits the batch
    resumed, uninterrupted = re.search(
        r"restored from Orbax: next loss ([\d.]+), uninterrupted run ([\d.]+)", text
    ).groups()
    assert resumed == uninterrupted
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+) in 30 steps", text).groups())
    assert last < 0.3 * first
    w0, w1, c0, c1 = map(
        float, re.search(r"warm ([+-][\d.]+) -> ([+-][\d.]+), cool ([+-][\d.]+) -> ([+-][\d.]+)", text).groups()
    )
    assert w1 - w0 > 0.5 and abs(c1) < 0.1  # held-out warm images move to the target, cool ones do not
    assert re.search(r"HF transformers on the export vs ours: rel \S+, max abs / max\|ref\| \S+: PASS", text)
    assert len([o for o in outputs if o.output_type == "display_data" and "image/png" in o.data]) == 1  # the loss curve
