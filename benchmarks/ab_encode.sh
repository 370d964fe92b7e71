#!/usr/bin/env bash
# The encode loop at the working tree against REV, alternating fresh processes (a shared VM's
# speed drifts; compare within one run only). REV runs from a git worktree under the bench cache
# (made here if missing) put first on PYTHONPATH. Per run: the encode seconds the CLI reports
# (the loop, compile excluded), and the CPU seconds of the main process and of its children (the
# Grain workers), so a wall-time gap can be told apart from a change in work. Round 0 warms
# numba's caches (a new worktree has none) and is not shown.
#   PYTHON=/path/to/venv/bin/python bash benchmarks/ab_encode.sh REV CHECKPOINT INPUTS [ROUNDS] [WORKERS]
# e.g. REV=873f9fa, CHECKPOINT=the host-bound tiny tower of bench_dataset.py, INPUTS=a folder of
# 1,000 small JPEGs (RESULTS.md, "The encode loop against 873f9fa").
set -euo pipefail
cd "$(dirname "$0")/.."
REV=$1 CK=$2 INPUTS=$3 ROUNDS=${4:-5} WORKERS=${5:-2}
PY=${PYTHON:-python}
HASH=$(git rev-parse --short=12 "$REV")
WT="${QVJ_BENCH_CACHE:-$HOME/.cache/qwen_vit_jax_bench}/worktree-$HASH"
[ -d "$WT" ] || git worktree add --detach "$WT" "$HASH" >/dev/null 2>&1
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
echo "CPU: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; tree $(git rev-parse --short HEAD) vs $HASH, --workers $WORKERS"
for r in $(seq 0 "$ROUNDS"); do
  order="tree rev"
  if [ $((r % 2)) -eq 0 ]; then order="rev tree"; fi # who goes first alternates
  for side in $order; do
    if [ "$side" = tree ]; then pp=$PWD; else pp=$WT; fi
    (cd "$TMP" && PYTHONPATH=$pp JAX_PLATFORMS=cpu "$PY" -c "
import resource, sys
from qwen_vit_jax.tools.cli import main
try:
    main(sys.argv[1:])
finally:
    s, c = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    print(f'cpu main {s.ru_utime + s.ru_stime:.2f} s, children {c.ru_utime + c.ru_stime:.2f} s')
" encode "$CK" "$INPUTS" -o "$TMP/$side.safetensors" --workers "$WORKERS" --overwrite >"$TMP/log" 2>&1) || {
      tail -20 "$TMP/log" >&2
      echo "the $side run failed (above)" >&2
      exit 1
    }
    line=$(grep -oE "inputs \([0-9,]+ tokens x [0-9]+\) in [0-9.]+ s|cpu main.*" "$TMP/log" | sed 's/.* in /encode /' | paste -sd' ')
    if [ "$r" -gt 0 ]; then echo "round $r $side: $line"; fi
  done
done
"$PY" - "$TMP/tree.safetensors" "$TMP/rev.safetensors" <<'EOF'
import json, sys

import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file

a, b = (load_file(p) for p in sys.argv[1:])
names = [json.loads(safe_open(p, "np").metadata()["names"]) for p in sys.argv[1:]]
same = a.keys() == b.keys() and all(np.array_equal(a[k], b[k], equal_nan=a[k].dtype.kind == "f") for k in a)
print("outputs of the last round:", "bit for bit equal" if same and names[0] == names[1] else "DIFFER")
EOF
