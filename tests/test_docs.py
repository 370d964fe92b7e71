"""Every ```python block of README.md and docs/*.md runs, so documented code that breaks fails CI.

The convention the pages follow:
- Each ```python block is executed; the blocks of one file run in order, in one namespace (a page
  imports what it uses once, near its top; later blocks reuse its names). Its `__name__` is
  "__main__", so an `if __name__ == "__main__":` guard runs too.
- The working directory is a fresh temporary folder per file holding:
    hf/          a tiny random Qwen2.5-VL checkpoint in the HF layout, with the full VL model's
                 config (token ids included), as `qwen_vit_jax.tools.demo.write_random_hf_checkpoint`
                 writes it;
    ckpt/        that checkpoint converted (`qvj.convert_checkpoint("hf", "ckpt")`);
    photo.jpg, photo2.jpg   two small JPEG photographs (scikit-image's astronaut and coffee);
    clip.mp4     a short H.264 video (2 s at 4 frames per second, 96x64).
- A block that cannot run on a 2-core CPU box with no network (a cluster, a GPU, a hub id) is
  fenced ```python skip instead: highlighted as Python, not executed. Shell examples are ```bash
  or ```console and are not executed either.
- Every docs/*.md page is picked up by itself: a new page needs no change here.
The fixture is built once per session; each page gets its own copy.
"""

from __future__ import annotations

import pathlib
import re
import shutil

import numpy as np
import pytest
from PIL import Image

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# An opening fence, indented or not (a block inside a list item), and what follows "```python".
_FENCE = re.compile(r"^(?P<indent>[ \t]*)```python(?P<rest>.*)$")


def python_blocks(text: str) -> list[tuple[int, str, bool]]:
    """(first code line, 1-based; code with the fence's indent removed; skipped) per ```python block."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        rest = m["rest"].strip()
        if rest not in ("", "skip"):
            raise ValueError(f"line {i + 1}: unknown fence info {lines[i].strip()!r} (```python or ```python skip)")
        indent, start, body = m["indent"], i + 1, []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            line = lines[i]
            if line.strip() and not line.startswith(indent):
                raise ValueError(f"line {i + 1}: a line of the block at line {start} is indented less than its fence")
            body.append(line[len(indent) :])
            i += 1
        if i == len(lines):
            raise ValueError(f"line {start}: the ```python block is never closed")
        blocks.append((start + 1, "\n".join(body) + "\n", rest == "skip"))
        i += 1
    return blocks


def test_blocks_are_found():
    """The parser sees plain, indented and skipped blocks, and rejects a fence it does not know."""
    text = "x\n```python\na = 1\n```\n- item\n  ```python\n  b = a\n  ```\n```python skip\nc\n```\n"
    assert python_blocks(text) == [(3, "a = 1\n", False), (7, "b = a\n", False), (10, "c\n", True)]
    with pytest.raises(ValueError, match="unknown fence info"):
        python_blocks("```python3\n1\n```\n")
    with pytest.raises(ValueError, match="never closed"):
        python_blocks("```python\n1\n")


def _write_clip(path: pathlib.Path, frames: int = 8, fps: int = 4, width: int = 96, height: int = 64) -> None:
    import av

    with av.open(str(path), "w") as out:
        stream = out.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"crf": "18", "preset": "ultrafast"}
        y, x = np.mgrid[0:height, 0:width]
        for i in range(frames):
            # A gradient with a box moving left to right: [height, width, 3] uint8.
            img = np.stack([(x * 2 + i * 16) % 256, y * 3 % 256, (x + y) % 256], axis=-1).astype(np.uint8)
            img[20:40, i * 10 : i * 10 + 16] = (230, 30, 30)
            out.mux(stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")))
        out.mux(stream.encode())


@pytest.fixture(scope="session")
def docs_fixture(tmp_path_factory, tiny_dirs) -> pathlib.Path:
    """The folder every page's copy starts from: hf/, ckpt/, photo.jpg, photo2.jpg, clip.mp4 (hf/ and
    ckpt/: the session's demo checkpoint, tests/conftest.py's `tiny_dirs`)."""
    from skimage import data

    root = tmp_path_factory.mktemp("docs_fixture")
    shutil.copytree(tiny_dirs[0], root / "hf")
    shutil.copytree(tiny_dirs[1], root / "ckpt")
    Image.fromarray(data.astronaut()).resize((224, 224), Image.BICUBIC).save(root / "photo.jpg", quality=90)
    Image.fromarray(data.coffee()).resize((300, 200), Image.BICUBIC).save(root / "photo2.jpg", quality=90)
    _write_clip(root / "clip.mp4")
    return root


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_page_runs(page, docs_fixture, tmp_path, monkeypatch):
    blocks = [b for b in python_blocks(page.read_text()) if not b[2]]
    if not blocks:
        pytest.skip(f"{page.name} has no ```python block to run")
    work = tmp_path / "work"
    shutil.copytree(docs_fixture, work)
    monkeypatch.chdir(work)
    namespace = {"__name__": "__main__"}
    name = str(page.relative_to(ROOT))
    for line, code, _ in blocks:
        # Leading newlines keep a traceback's line numbers those of the page.
        program = compile("\n" * (line - 1) + code, name, "exec")
        try:
            exec(program, namespace)
        except Exception as e:
            raise AssertionError(f"{name}: the ```python block at line {line} failed: {type(e).__name__}: {e}") from e
