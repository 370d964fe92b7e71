"""Shared fixtures: one tiny random checkpoint per session, built the way the demo builds it
(HF layout on disk -> the real converter), so CLI, encode_images and notebook tests share it.

The session also shares one JAX persistent compilation cache (a temporary folder, unless the
caller set JAX_COMPILATION_CACHE_DIR): the CLI and notebook tests start fresh processes that
compile the same tiny-tower buckets again, and on two cores those compiles would dominate.
It is set before anything imports jax, and subprocesses inherit it through the environment.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import tempfile

# JAX's own backend is the CPU, even where the accel extra installed the TPU and CUDA compilers
# (they would otherwise be probed for devices at start-up): tests/test_aot.py uses them deviceless.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="qwen_vit_jax_test_jax_cache_")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ.update(
        JAX_COMPILATION_CACHE_DIR=_cache,
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )

import sys

import pytest

from qwen_vit_jax.tools.demo import TINY

try:  # absl (grain's and Ray's logging) keeps the stderr of its import: here pytest's capture file. A test
    # that configures logging (uvicorn's dictConfig: the serve CLI run in-process) closes every handler,
    # absl's closes its stream, and every later test in the process fails. sys.__stderr__ it never closes.
    from absl import logging as absl_logging

    absl_logging.get_absl_handler().python_handler.stream = sys.__stderr__
except ImportError:
    pass

# The CLIs the tests start and then Ctrl-C must start as a terminal's foreground job does. A suite
# started as a background job (`pytest &`) has SIGINT ignored, every child inherits that, and a CLI
# started so rightly keeps ignoring it (test_feed's and test_interrupts' SIGINT cases then hang).
# A handler here is reset to the default in every child.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def towers(tmp_path_factory):
    """The registry of tests/towers.py: each tower built at most once per session, on first use."""
    from towers import Towers

    return Towers(tmp_path_factory.mktemp("towers"))


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """(hf_dir, converted_dir) of the demo's tiny Qwen2.5-VL tower (window + full layers)."""
    from qwen_vit_jax.tools.demo import write_random_hf_checkpoint
    from qwen_vit_jax.weights.convert import convert_checkpoint

    root = tmp_path_factory.mktemp("tiny_ckpt")
    hf = write_random_hf_checkpoint(TINY, root / "hf", seed=0)
    return hf, convert_checkpoint(hf, root / "converted")


@pytest.fixture(scope="session")
def tiny_encoder(tiny_dirs):
    from qwen_vit_jax.runtime.encoder import VisionEncoder

    return VisionEncoder.from_pretrained(tiny_dirs[1])


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray for the session (2 CPUs, no dashboard): Ray Data's stages (test_scale.py) and
    Ray Serve (test_serve_ray.py) share it; it stops after its last user (below)."""
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook, which reads the groups
def pytest_collection_modifyitems(config, items):
    """The units pytest-xdist hands to a worker (`make test`: -n 2 --dist loadgroup): a test module
    (its module fixtures built once), all real-size cases (one at a time: each holds GBs), all
    users of the session's Ray (one cluster) and a unit a module declares (`pytestmark =
    pytest.mark.xdist_group(...)`: the readers of the executed notebooks, each notebook run once).
    The two heavy units come first, so that neither ends the run alone on one worker; without xdist
    the order changes the same way and nothing else."""

    def group(item) -> str:
        if item.get_closest_marker("slow"):
            return "real-size"
        if "ray_local" in item.fixturenames:
            return "ray"
        if declared := item.get_closest_marker("xdist_group"):
            return declared.args[0]
        return item.nodeid.split("::")[0]

    groups = {item.nodeid: group(item) for item in items}
    for item in items:
        item.add_marker(pytest.mark.xdist_group(groups[item.nodeid]))
    items.sort(key=lambda item: {"real-size": 0, "ray": 1}.get(groups[item.nodeid], 2))


@pytest.hookimpl(specname="pytest_collection_modifyitems", trylast=True)  # after pytest-xdist's hook
def pytest_groups_reached_xdist(config, items):
    """A worker of `--dist loadgroup` whose tests lack their group suffix would run every test as a
    unit of its own (each module's fixtures built on both workers, two Ray clusters): refuse to start."""
    if os.environ.get("PYTEST_XDIST_WORKER") and config.getvalue("loadgroup"):
        lost = [item.nodeid for item in items if "@" not in item.nodeid.rsplit("]", 1)[-1]]
        if lost:
            why = (
                f"pytest-xdist did not group {len(lost)} tests (e.g. {lost[0]}): pytest {pytest.__version__} "
                "with pytest-xdist's --dist loadgroup (pytest-xdist#1386); the test extra pins pytest<9.2"
            )
            print(why, file=sys.__stderr__)  # (a worker's error reaches the terminal only as xdist's own)
            raise pytest.UsageError(why)


def pytest_runtest_teardown(item, nextitem):
    """Stop the session's Ray once no later test uses it: the tests after it run without its processes."""
    if "ray_local" in item.fixturenames:
        later = item.session.items[item.session.items.index(item) + 1 :]
        if not any("ray_local" in i.fixturenames for i in later):
            import ray

            ray.shutdown()


@pytest.fixture
def restore_compilation_cache():
    """enable_compilation_cache is process-wide: put the session's cache (above) back after a test."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    saved = {
        k: getattr(jax.config, k) for k in ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
    }
    yield
    for k, v in saved.items():
        jax.config.update(k, v)
    compilation_cache.reset_cache()
