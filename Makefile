# Two commands on a fresh machine (Linux or macOS, Python >= 3.10):
#   make demo   a venv with the runtime only, then `qwen-vit-jax demo`
#   make test   the test pieces on top (torch's CPU wheel first), ruff, the vLLM venv, then the whole suite
# Both are idempotent: an install step runs again only when pyproject.toml changes (its stamp file
# is named by the file's hash), so a second run installs nothing.
#   make test VENV=/tmp/v PYTEST_ARGS='-m "not slow"'   another venv, the fast subset
#   make test JOBS=0                                     the suite in one process (default: 2 pytest-xdist workers)

VENV ?= .venv
PYTHON ?= python3
PYTEST_ARGS ?=
# pytest-xdist workers (0: the suite in this process); 2 fits CI's 2 cores (docs/testing.md).
JOBS ?= 2
TORCH_VERSION ?= 2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu

PY := $(VENV)/bin/python
# INSTALL compiles no bytecode (--no-compile): compiling all ~24,000 modules took ~40% of the install's
# time, and a run imports a quarter of them. The first import of a module writes its bytecode: the demo
# and the suite run with PYTHONDONTWRITEBYTECODE cleared, else every run would compile again.
PIP := $(PY) -m pip
INSTALL := $(PIP) install -q --no-compile
WRITES_BYTECODE := env -u PYTHONDONTWRITEBYTECODE
# The stamps are keyed by pyproject.toml's content: an edited dependency list installs again.
HASH := $(shell $(PYTHON) -c "import hashlib; print(hashlib.sha256(open('pyproject.toml', 'rb').read()).hexdigest()[:12])")
RUNTIME := $(VENV)/.stamp-runtime-$(HASH)
TESTING := $(VENV)/.stamp-test-$(HASH)

.PHONY: demo test lint install install-test vllm-venv

demo: $(RUNTIME)
	$(WRITES_BYTECODE) $(VENV)/bin/qwen-vit-jax demo

install: $(RUNTIME)

install-test: $(TESTING)

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(INSTALL) --upgrade pip

# The runtime only: jax, flax, numba, grain, pillow, simplejpeg, safetensors. No torch, no PyAV
# (`pip install -e ".[video]"` adds video files; the demo encodes generated images).
$(RUNTIME): | $(PY)
	$(INSTALL) -e .
	rm -f $(VENV)/.stamp-runtime-*
	touch $@

# torch is the tests' reference only. Without the CPU index pin the release: pip would otherwise be
# free to take any torch the test extra's range allows, and on Linux x86-64 the registry's torch is
# the CUDA build (multi-GB); a torch already in the venv is kept.
$(TESTING): $(RUNTIME)
	@if $(PY) -c "import torch" 2>/dev/null; then \
		echo "torch: keeping the one installed"; \
	elif $(PY) -c "import urllib.request as u; u.urlopen('$(TORCH_CPU_INDEX)/torch/', timeout=5)" 2>/dev/null; then \
		echo "torch: the CPU wheel from $(TORCH_CPU_INDEX)"; \
		$(INSTALL) "torch==$(TORCH_VERSION)" --index-url $(TORCH_CPU_INDEX); \
	else \
		echo "torch: $(TORCH_CPU_INDEX) is not reachable; torch==$(TORCH_VERSION) from the configured index"; \
		$(INSTALL) "torch==$(TORCH_VERSION)"; \
	fi
	@$(PY) -c "import shutil, torch; torch.version.cuda and not shutil.which('nvidia-smi') and print( \
		'warning: torch', torch.__version__, 'is a CUDA build and this machine has no nvidia-smi;', \
		'README.md (Quick start) says how to take the CPU wheel')"
	$(INSTALL) -e ".[test,accel]"
	rm -f $(VENV)/.stamp-test-*
	touch $@

lint: $(TESTING)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# vLLM's CPU build in a venv of its own (vLLM pins transformers and numba apart from ours; in the user's
# cache folder, shared by clones), for tests/test_vllm.py. benchmarks/workloads/vllm_env.py builds it, or
# reuses it while its pins stay the same (a stamp named by their hash); where the registry lacks a package
# it says so and the tests skip.
vllm-venv:
	$(PYTHON) benchmarks/workloads/vllm_env.py

# The venv and the vLLM venv are installed side by side (-j2: both are mostly pip's downloads and
# unpacking). JAX runs on the CPU; the accel extra's TPU and CUDA compilers are used deviceless by
# tests/test_aot.py, which must not skip here. The suite runs on JOBS pytest-xdist workers (0: in this
# process), a test module, the real-size cases and the users of the session's Ray each on one worker
# (tests/conftest.py); its ~45 interpreters write bytecode (above). pytest exits 5 when it collected no
# test: a failure. The 15 slowest tests are listed at the end: the budget (docs/testing.md) is watched
# there.
test:
	@$(MAKE) --no-print-directory -j2 lint vllm-venv
	@$(PIP) list 2>/dev/null | grep -iE '^(jax|jaxlib|flax|numba|numpy|torch|transformers|libtpu|jax-cuda13-plugin) ' || true
	@$(WRITES_BYTECODE) JAX_PLATFORMS=cpu QVJ_REQUIRE_ACCEL=1 $(PY) -m pytest -q -p no:cacheprovider --durations=15 \
		-n $(JOBS) --dist loadgroup --no-loadscope-reorder $(PYTEST_ARGS); rc=$$?; \
		if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 1; fi; exit $$rc
