#!/usr/bin/env bash
# TPU check, one prepared script (< 8 minutes) for a machine with a TPU (VM) that has
# jax[tpu], torch (CPU) and transformers preinstalled and no network:
#   1. the parity tests with JAX on the TPU (HF reference on CPU, as the tests build it),
#      splash attention included (tests/test_kernels.py: compiled, not interpreted);
#   2. the device suite (python -m benchmarks device): Qwen2.5-VL-3B, ours with the XLA schedule and with splash attention, bf16 and
#      fp32, on a 36x36 image, a [10, 36, 36] video and the largest bucket ([16, 32, 32]): compile s,
#      first call, median, peak memory (no HF side: torch does not run on a TPU).
# Results (logs, JSON) go to $OUT if set, else benchmarks/results/tpu.
#   bash benchmarks/tpu_check.sh
#   BENCH_ARGS=--quick bash benchmarks/tpu_check.sh     # dry run (tiny configs), works on CPU
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results/tpu}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"   # no pip install: the tree as it is
PY="${PYTHON:-python3}"   # as gpu_check.sh: a VM may have no `python`
start=$(date +%s)
deadline=$((start + 470))   # the whole check stays under 8 minutes
status=0

{
  "$PY" -c "import jax; print('jax', jax.__version__, jax.default_backend(), jax.devices())"
  "$PY" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(),
    torch.cuda.get_device_name(0) if torch.cuda.is_available() else ''); print('transformers', transformers.__version__)"
} 2>&1 | tee "$OUT/env.txt"
grep -q "^jax .* tpu " "$OUT/env.txt" || echo "WARNING: JAX's default backend is not the TPU: a dry run" | tee -a "$OUT/env.txt"

echo "== parity tests (JAX on the default backend) =="
JAX_PLATFORMS= timeout 180 "$PY" -m pytest tests/test_parity.py tests/test_attention.py tests/test_kernels.py \
  -q -p no:cacheprovider 2>&1 | tee "$OUT/pytest.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== the device suite: ours (XLA, splash kernel); no HF side: torch does not run on a TPU (up to $((deadline - $(date +%s))) s) =="
# shellcheck disable=SC2086  # BENCH_ARGS is a list of options
timeout $((deadline - $(date +%s))) "$PY" -m benchmarks device --repeats 5 --sides ours-xla,ours-kernel \
  --out "$OUT/device_tpu.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/device_tpu.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "tpu_check: exit $status after $(( $(date +%s) - start )) s; results in $OUT"
exit "$status"
