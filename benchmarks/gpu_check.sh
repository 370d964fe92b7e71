#!/usr/bin/env bash
# GPU check, one prepared call (< 8 minutes) on a machine with an NVIDIA GPU and no network whose
# Python has only jax 0.11 with the CUDA 13 plugin, flax, numba, optax, safetensors, pillow,
# torch 2.11 and transformers 5.17:
#   0. the wheels of benchmarks/gpu_wheels.sh (grain, simplejpeg, pytest and their
#      needs) into a temporary target, never into the machine's environment; the package itself is
#      this tree, on PYTHONPATH;
#   1. the parity tests with JAX on the GPU (HF reference on CPU, as the tests build it), the
#      Pallas Triton attention kernel included (tests/test_kernels.py: compiled, not interpreted),
#      every family's tiny towers (their parity tests), the real-size Qwen2.5-VL-3B / Qwen2-VL-2B;
#   2. the device suite (python -m benchmarks device): Qwen2.5-VL-3B, HF sdpa (and flash-attention-2 if it imports) vs ours with the
#      XLA schedule and with the Triton kernel, bf16 and fp32, on a 36x36 image, a [10, 36, 36]
#      video and the largest bucket ([16, 32, 32]): compile s, first call, median, peak memory.
# Logs and JSON go to $OUT if set, else benchmarks/results/gpu (six files; gpu_check.json sums up).
#   bash benchmarks/gpu_check.sh                        # WHEELS=DIR: wheels elsewhere than benchmarks/wheels
#   BENCH_ARGS=--quick bash benchmarks/gpu_check.sh     # dry run (tiny configs), works on CPU
#   PYTHON=/path/to/python3 ...                          # another interpreter than the python3 on PATH
#   CHECK_S=470 TESTS_S=150 FAMILY_S=80 SLOW_S=60 ...   # time limits (s): the check, the three parity steps
set -uo pipefail
cd "$(dirname "$0")/.." || exit
OUT="${OUT:-benchmarks/results/gpu}"
WHEELS="${WHEELS:-benchmarks/wheels}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
start=$(date +%s)
deadline=$((start + ${CHECK_S:-470})) # the whole check stays under 8 minutes
export PYTHONUNBUFFERED=1
steps=()
step() { # step NAME RC: recorded for gpu_check.json, and any failure fails the check
  steps+=("\"$1\": {\"rc\": $2, \"end_s\": $(($(date +%s) - start))}")
  [ "$2" -eq 0 ] || status=1
}
status=0

# 0. The wheels into a temporary target. --target makes pip ignore what is installed, so it would
# want jax, torch, numpy, ... from WHEELS too: --no-deps, and the folder holds exactly what the
# machine lacks (gpu_wheels.sh). Without pip, a wheel is a zip to unpack into the target.
site=$(mktemp -d "${TMPDIR:-/tmp}/qvj_gpu_site.XXXXXX")
trap 'rm -rf "$site"' EXIT
(
  shopt -s nullglob
  wheels=("$WHEELS"/*.whl)
  if [ ${#wheels[@]} -eq 0 ]; then
    echo "no wheels in $WHEELS: the machine's packages only (benchmarks/gpu_wheels.sh fetches them)"
  elif "$PY" -m pip --version >/dev/null 2>&1; then
    "$PY" -m pip install --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
      --find-links "$WHEELS" --target "$site" "${wheels[@]}"
  else
    echo "no pip: unpacking the wheels"
    for w in "${wheels[@]}"; do "$PY" -m zipfile -e "$w" "$site" || exit 1; done
  fi
) >"$OUT/install.txt" 2>&1
step install $?
cat "$OUT/install.txt"
export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}" # the tree first: no install of the package

{
  echo "gpu_check at $(git rev-parse --short HEAD 2>/dev/null || echo '(no git)') $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "nvidia-smi: none"
  JAX_PLATFORMS='' "$PY" - "$site" <<'EOF'
import importlib, importlib.metadata, os, platform, sys

site = sys.argv[1]
print("python", platform.python_version(), sys.executable)
missing = []
for name, dist in [("jax", "jax"), ("jaxlib", "jaxlib"), ("jax_plugins.xla_cuda13", "jax-cuda13-plugin"),
                   ("flax", "flax"), ("numba", "numba"), ("numpy", "numpy"), ("ml_dtypes", "ml_dtypes"),
                   ("optax", "optax"), ("safetensors", "safetensors"), ("PIL", "pillow"), ("torch", "torch"),
                   ("transformers", "transformers"), ("grain", "grain"), ("simplejpeg", "simplejpeg"),
                   ("pytest", "pytest"), ("qwen_vit_jax", None)]:
    try:
        m = importlib.import_module(name)
    except Exception as e:  # named and counted: the check cannot run without it
        missing.append(name)
        print(f"{name:24s} MISSING: {type(e).__name__}: {e}")
        continue
    where = os.path.dirname(m.__file__ or "")
    src = "wheels" if where.startswith(site) else ("tree" if where.startswith(os.getcwd()) else "machine")
    try:
        version = importlib.metadata.version(dist) if dist else m.__version__
    except importlib.metadata.PackageNotFoundError:
        version = getattr(m, "__version__", "?")
    print(f"{name:24s} {version:14s} {src}")
import jax, torch

print("jax backend", jax.default_backend(), jax.devices())
print("torch cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
sys.exit(f"missing: {', '.join(missing)}" if missing else 0)
EOF
} >"$OUT/env.txt" 2>&1
step env $?
cat "$OUT/env.txt"
grep -q "^jax backend gpu " "$OUT/env.txt" || echo "WARNING: JAX's default backend is not the GPU: a dry run" | tee -a "$OUT/env.txt"

echo "== parity tests (JAX on the default backend) =="
# JAX_PLATFORMS empty: tests/conftest.py would otherwise pin the CPU. The attention tests and the
# Qwen2 / 2.5 towers whole; the other families' parity tests (every family: their tiny towers vs
# transformers); the real-size 3B / 2B towers (slow-marked; SLOW_S=0 skips them: a slow CPU).
parity() { # parity SECONDS PYTEST-ARGS...: one pytest run, appended to pytest.txt
  local s=$1
  shift
  echo "-- pytest $* (up to $s s)"
  JAX_PLATFORMS='' timeout "$s" "$PY" -m pytest -q -rs -p no:cacheprovider "$@"
}
{
  parity "${TESTS_S:-150}" --junitxml "$OUT/pytest.xml" tests/test_parity.py tests/test_attention.py \
    tests/test_kernels.py -m "not slow"
  rc=$?
  parity "${FAMILY_S:-80}" tests/test_family.py tests/test_qwen3_model.py tests/test_glm4v.py tests/test_paddleocr.py \
    -m "not slow" -k parity
  rc=$((rc | $?))
  if [ "${SLOW_S:-60}" -gt 0 ]; then
    parity "${SLOW_S:-60}" tests/test_parity.py -m slow
    rc=$((rc | $?))
  else
    echo "-- SLOW_S=0: the real-size parity tests skipped"
  fi
  exit "$rc"
} 2>&1 | tee "$OUT/pytest.txt"
step pytest "${PIPESTATUS[0]}"

echo "== the device suite: HF vs ours (XLA, Triton kernel) (up to $((deadline - $(date +%s))) s) =="
# shellcheck disable=SC2086  # BENCH_ARGS is a list of options
timeout $((deadline - $(date +%s))) "$PY" -m benchmarks device --repeats 5 --sides hf-sdpa,hf-fa2,ours-xla,ours-kernel \
  --out "$OUT/device_gpu.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/device_gpu.txt"
step device "${PIPESTATUS[0]}"

summary=$(IFS=,; echo "${steps[*]}")
echo "{\"status\": $status, \"seconds\": $(($(date +%s) - start)), \"bench_args\": \"${BENCH_ARGS:-}\", \"steps\": {$summary}}" \
  >"$OUT/gpu_check.json"
echo "gpu_check: exit $status after $(($(date +%s) - start)) s; results in $OUT"
exit "$status"
