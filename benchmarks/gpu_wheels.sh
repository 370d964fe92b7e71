#!/usr/bin/env bash
# The wheels gpu_check.sh installs on a GPU machine with no network: what the check needs beyond
# the packages that machine's Python already has (BASE), for CPython 3.12 on manylinux x86-64.
# Run it where PyPI is reachable, from any directory, with any Python >= 3.9 that has pip:
#   bash benchmarks/gpu_wheels.sh                      # into benchmarks/wheels (git-ignored)
#   bash benchmarks/gpu_wheels.sh DEST                 # elsewhere
#   PYVER=3.13 bash benchmarks/gpu_wheels.sh DEST      # wheels for another CPython (a dry run)
# pip resolves BASE alone, then BASE + NEED, for the target (not this machine), and downloads only
# the packages the second resolution adds: the machine's own jax, torch, numpy, ... are never
# fetched, so the check cannot shadow them. The package itself is not fetched: gpu_check.sh puts
# the tree on PYTHONPATH.
set -euo pipefail
cd "$(dirname "$0")/.." || exit
DEST="${1:-benchmarks/wheels}"
PY="${PYTHON:-python3}"
PYVER="${PYVER:-3.12}"
# What the GPU machine has: jax 0.11 with the CUDA 13 plugin, flax, numba, optax, safetensors,
# pillow, torch 2.11, transformers 5.17 (and what they depend on).
read -r -a BASE <<<"${BASE:-jax==0.11.* jaxlib==0.11.* jax-cuda13-plugin==0.11.* flax numba optax safetensors pillow torch==2.11.* transformers==5.17.*}"
# What the check imports beyond BASE: the package's runtime dependencies (pyproject.toml) that are
# not in BASE, and the test runner with what the parity tests import.
read -r -a NEED <<<"${NEED:-grain>=0.2.18 simplejpeg>=1.7 pytest>=8}"
# pip matches platform tags exactly: glibc 2.28 and older first (what the check's own wheels
# need), newer ones last (some of the machine's CUDA libraries, only resolved, never fetched).
PLATFORM=(--only-binary=:all: --implementation cp --python-version "$PYVER")
for n in 28 27 26 25 24 23 22 21 20 19 18 17 12 5 29 30 31 32 33 34 35 36 37 38 39; do
  PLATFORM+=(--platform "manylinux_2_${n}_x86_64")
done
PLATFORM+=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64)

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
resolve() {  # resolve OUT.json REQ...: what pip would install for the target, nothing installed here
  local out=$1
  shift
  "$PY" -m pip install --dry-run --ignore-installed --quiet --report "$out" "${PLATFORM[@]}" "$@"
}
resolve "$work/base.json" "${BASE[@]}"
resolve "$work/full.json" "${BASE[@]}" "${NEED[@]}"
"$PY" - "$work/base.json" "$work/full.json" >"$work/extra.txt" <<'EOF'
import json, re, sys

def pins(path):
    norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
    return {norm(i["metadata"]["name"]): i["metadata"]["version"] for i in json.load(open(path))["install"]}

base, full = pins(sys.argv[1]), pins(sys.argv[2])
moved = sorted(n for n in base if full.get(n) != base[n])
if moved:  # NEED must fit the machine's packages, not upgrade them
    sys.exit(f"gpu_wheels: adding the check's packages changes the machine's own: {moved}")
for name in sorted(set(full) - set(base)):
    print(f"{name}=={full[name]}")
EOF
echo "gpu_wheels: $(wc -l <"$work/extra.txt") packages beyond the machine's for CPython $PYVER: $(tr '\n' ' ' <"$work/extra.txt")"
mkdir -p "$DEST"
rm -f "$DEST"/*.whl  # one version of each: gpu_check.sh installs every wheel here
"$PY" -m pip download --quiet --no-deps "${PLATFORM[@]}" -d "$DEST" -r "$work/extra.txt"
ls -l "$DEST"
echo "gpu_wheels: $(find "$DEST" -maxdepth 1 -name '*.whl' | wc -l) wheels, $(du -sh "$DEST" | cut -f1) in $DEST"
