#!/usr/bin/env bash
# GPU check, one prepared script (< 8 minutes) for a machine with an NVIDIA GPU that has
# jax[cuda], torch and transformers preinstalled and no network:
#   1. the parity tests with JAX on the GPU (HF reference on CPU, as the tests build it),
#      the Pallas Triton attention kernel included (tests/test_kernels.py: compiled, not interpreted);
#   2. bench_device: Qwen2.5-VL-3B, HF sdpa (and flash-attention-2 if it imports) vs ours with the
#      XLA schedule and with the Triton kernel, bf16 and fp32, on a 36x36 image, a [10, 36, 36]
#      video and the largest bucket ([16, 32, 32]): compile s, first call, median, peak memory.
# Results (logs, JSON) go to $OUT if set, else benchmarks/results/gpu.
#   bash benchmarks/gpu_check.sh
#   BENCH_ARGS=--quick bash benchmarks/gpu_check.sh     # dry run (tiny configs), works on CPU
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results/gpu}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"   # no pip install: the tree as it is
start=$(date +%s)
deadline=$((start + 470))   # the whole check stays under 8 minutes
status=0

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "nvidia-smi: none"
  python -c "import jax; print('jax', jax.__version__, jax.default_backend(), jax.devices())"
  python -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(),
    torch.cuda.get_device_name(0) if torch.cuda.is_available() else ''); print('transformers', transformers.__version__)"
} 2>&1 | tee "$OUT/env.txt"
grep -q "^jax .* gpu " "$OUT/env.txt" || echo "WARNING: JAX's default backend is not the GPU: a dry run" | tee -a "$OUT/env.txt"

echo "== parity tests (JAX on the default backend) =="
JAX_PLATFORMS= timeout 180 python -m pytest tests/test_parity.py tests/test_attention.py tests/test_kernels.py \
  -q -p no:cacheprovider 2>&1 | tee "$OUT/pytest.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== bench_device: HF vs ours (XLA, Triton kernel) (up to $((deadline - $(date +%s))) s) =="
# shellcheck disable=SC2086  # BENCH_ARGS is a list of options
timeout $((deadline - $(date +%s))) python benchmarks/bench_device.py --repeats 5 \
  --out "$OUT/device_gpu.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/device_gpu.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "gpu_check: exit $status after $(( $(date +%s) - start )) s; results in $OUT"
exit "$status"
