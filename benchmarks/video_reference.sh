#!/usr/bin/env bash
# The HF reference for video: transformers 5.24's Qwen2VLVideoProcessor / Qwen3VLVideoProcessor need
# torchvision, whose registry wheel links the CUDA build of torch and does not load beside the CPU
# torch of the test extra. So the reference runs in a venv of its own (torch 2.14.1 + torchvision
# 0.29.1, ~5.5 GB; pip takes them from local files where the machine carries them, else from the
# registry), never in CI's.
#
#   bash benchmarks/video_reference.sh            # build the venv once, then run the reference
#   VENV=/elsewhere bash benchmarks/video_reference.sh --out /tmp/ref.json
#
# The venv is also where the host and video suites find HF's torchvision backend (VIDEO_REF_PYTHON,
# default: this venv's python).
#
# Arguments go to video_reference.py (default: rewrite tests/data/video_reference.json).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-${QVJ_BENCH_CACHE:-$HOME/.cache/qwen_vit_jax_bench}/venv-video-ref}
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import torchvision, transformers, av, ml_dtypes" 2>/dev/null; then
    python3 -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
    "$VENV/bin/python" -m pip install -q torch==2.14.1 torchvision==0.29.1 transformers==5.24.0 av pillow numpy ml_dtypes
fi
"$VENV/bin/python" -c "import torch, torchvision, transformers, av; print('reference venv:', 'torch', torch.__version__, 'torchvision', torchvision.__version__, 'transformers', transformers.__version__, 'av', av.__version__)"
# The repo is put on the path, not installed: the reference imports only benchmarks/workloads/clips.py
# (PyAV + numpy) from it, to write the very same clips the tests write.
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$VENV/bin/python" benchmarks/video_reference.py "$@"
