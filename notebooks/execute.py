"""Execute every notebook in this folder and store its outputs, so that a reader on a code host
sees the numbers and pictures:

    python notebooks/execute.py            # all notebooks/*.ipynb, outputs written back
    python notebooks/execute.py --check    # execute, compare with the stored outputs, write nothing

Each notebook runs top to bottom in a fresh kernel (nbclient; the kernel is this interpreter,
`python` from this interpreter's folder) in a temporary working directory, without
QWEN_VIT_JAX_CKPT (the notebooks then build the demo's tiny random tower: no download). Needs
nbclient, nbformat and ipykernel (the test extra). tests/test_notebook.py runs the same
execution in CI and fails when the stored outputs are stale: `signature` is what it compares.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
# What varies from run to run and is left out of the comparison: decimal numbers (timings,
# compile seconds, losses, FLOP counts printed as floats) and the compiled programs' temp bytes
# (they follow XLA's version).
_VARIES = re.compile(r"'temp_bytes': \d+|[-+]?\d+\.\d+(?:e[-+]?\d+)?|\d+e[-+]?\d+")


def notebooks() -> list[pathlib.Path]:
    """Every notebook of this folder, by name."""
    return sorted(HERE.glob("*.ipynb"))


def execute(path: pathlib.Path, timeout: int = 600):
    """Run the notebook at `path` in a fresh kernel; returns the executed nbformat notebook."""
    import nbclient
    import nbformat

    nb = nbformat.read(path, as_version=4)
    env_path = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    saved = {k: os.environ.get(k) for k in ("PATH", "QWEN_VIT_JAX_CKPT")}
    os.environ["PATH"] = env_path  # the kernel starts as `python` from PATH: this interpreter
    os.environ.pop("QWEN_VIT_JAX_CKPT", None)  # the tiny random checkpoint, built in the notebook
    try:
        with tempfile.TemporaryDirectory(prefix="qwen_vit_jax_nb_run_") as cwd:
            nbclient.NotebookClient(
                nb, timeout=timeout, kernel_name="python3", record_timing=False, resources={"metadata": {"path": cwd}}
            ).execute()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return nb


def signature(nb) -> list[list[tuple]]:
    """What must not change between a stored notebook and a fresh run: per code cell, each
    output's type, its mime types (an image is compared by kind, not bytes) and its text with the
    varying numbers (`_VARIES`) masked. Consecutive stdout chunks are joined (how the kernel cuts
    a cell's printing into stream outputs depends on timing). stderr is left out: warnings and
    logs depend on the environment (a compilation cache, a jax plugin), not on the notebook."""
    cells = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        outs = []
        for o in cell.outputs:
            if o.output_type == "stream" and o.name == "stderr":
                continue
            if o.output_type == "stream" and outs and outs[-1][0] == "stream":
                outs[-1] = ("stream", o.name, outs[-1][2] + o.text)
            elif o.output_type == "stream":
                outs.append(("stream", o.name, o.text))
            elif o.output_type in ("display_data", "execute_result"):
                outs.append((o.output_type, tuple(sorted(o.data)), _VARIES.sub("#", o.data.get("text/plain", ""))))
            else:
                outs.append((o.output_type, o.get("ename", ""), ""))
        cells.append([(t, name, _VARIES.sub("#", text)) for t, name, text in outs])
    return cells


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare with the stored outputs; write nothing")
    args = ap.parse_args()
    import nbformat

    stale = []
    for path in notebooks():
        print(f"executing {path.name} ...", flush=True)
        nb = execute(path)
        if args.check:
            if signature(nb) != signature(nbformat.read(path, as_version=4)):
                stale.append(path.name)
        else:
            for cell in nb.cells:  # stderr (warnings, logs) says where it ran, not what the notebook shows
                if cell.cell_type == "code":
                    cell.outputs = [o for o in cell.outputs if not (o.output_type == "stream" and o.name == "stderr")]
            nbformat.write(nb, path)
            print(f"  stored its outputs in {path}")
    if stale:
        sys.exit(f"stale outputs (rerun python notebooks/execute.py): {', '.join(stale)}")


if __name__ == "__main__":
    main()
