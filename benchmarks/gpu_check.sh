#!/usr/bin/env bash
# GPU check of hetero (copy engine first): build the extension with CUDA, run the GPU tests, measure.
#
#   bash benchmarks/gpu_check.sh          # from anywhere; runs in the repository root
#
# Needs a machine with a GPU and torch with CUDA already installed (nothing is downloaded: the
# extension is built in place with the installed torch, setuptools and CUDA toolkit). Steps:
#   1. versions: python, torch, CUDA, GPU; fails at once if torch.cuda.is_available() is false
#   2. build hetero._C in place (python setup.py build_ext --inplace: a CUDAExtension with
#      -DHETERO_CUDA when a CUDA toolkit is found), only for this GPU's architecture
#   3. python -m pytest -q tests/test_cuda.py tests/test_copies.py
#   4. python benchmarks/bench_copy.py --json $OUT/copy.json: H2D / D2H GB/s of the copy engine
#      against a plain cudaMemcpyAsync, and the overlap of copies with compute
#   5. python benchmarks/bench_overlap.py --quick --json $OUT/overlap.json, if that file exists
# Results go to ${OUT:-/tmp}. Under 5 minutes on a 16-core H200 machine (most of it the build).
# Exit status: the first failing step's; 3 if everything ran but hetero._C has no CUDA path.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT_DIR="${OUT:-/tmp}"
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
unset HETERO_FORCE_PYTHON_COPY HETERO_FORCE_PYTHON_IO
START=$(date +%s)
STEP_START=$START
elapsed() { echo $(( $(date +%s) - START )); }
step() {
  local now
  now=$(date +%s)
  echo "    (previous step: $(( now - STEP_START ))s)"
  STEP_START=$now
  echo
  echo "=== [$(elapsed)s] $*"
}
PY=python
command -v python >/dev/null 2>&1 || PY=python3

echo "=== [0s] versions"
"$PY" - <<'EOF'
import sys

import torch

print(f"python {sys.version.split()[0]}, torch {torch.__version__}, torch CUDA {torch.version.cuda}")
if not torch.cuda.is_available():
    print("FAIL: torch.cuda.is_available() is False: this check needs a GPU and torch built with "
          f"CUDA (installed: torch {torch.__version__}, CUDA {torch.version.cuda})", file=sys.stderr)
    sys.exit(1)
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"cuda:{i} {p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}")
EOF
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
if command -v nvcc >/dev/null 2>&1; then nvcc --version | tail -1; else echo "nvcc: not on PATH"; fi
echo "CPUs: $(nproc)"

step "build hetero._C in place"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
if [ -z "${TORCH_CUDA_ARCH_LIST:-}" ]; then
  TORCH_CUDA_ARCH_LIST="$("$PY" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')"
  export TORCH_CUDA_ARCH_LIST
fi
echo "MAX_JOBS=$MAX_JOBS TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST"
"$PY" setup.py build_ext --inplace > "$OUT_DIR/gpu_check_build.log" 2>&1 || {
  tail -40 "$OUT_DIR/gpu_check_build.log"
  echo "FAIL: the extension did not build (log: $OUT_DIR/gpu_check_build.log)" >&2
  exit 1
}
tail -2 "$OUT_DIR/gpu_check_build.log"
CUDA_PATH=1
rc=0
"$PY" - <<'EOF' || rc=$?
import sys

import hetero
from hetero import copies

print(f"hetero from {hetero.__file__}")
if copies._C is None:
    print(f"FAIL: hetero._C does not import: {copies.EXTENSION_ERROR}", file=sys.stderr)
    sys.exit(1)
print(f"hetero._C copy engine CUDA path (HETERO_CUDA): {copies._C.COPY_CUDA}")
if not copies._C.COPY_CUDA:
    from torch.utils import cpp_extension
    print(f"WARNING: hetero._C was built without CUDA (CUDA_HOME={cpp_extension.CUDA_HOME}); CUDA "
          "copies will use the pure-Python engine and the extension's CUDA tests skip",
          file=sys.stderr)
    sys.exit(2)
EOF
case "$rc" in
  0) ;;
  2) CUDA_PATH=0 ;;  # go on: the Python engine's CUDA path is still worth testing and measuring
  *) exit 1 ;;
esac

step "GPU tests: pytest tests/test_cuda.py tests/test_copies.py"
"$PY" -m pytest -q -rs tests/test_cuda.py tests/test_copies.py

step "copy engine benchmark: benchmarks/bench_copy.py"
"$PY" benchmarks/bench_copy.py --json "$OUT_DIR/copy.json"

if [ -f benchmarks/bench_overlap.py ]; then
  step "overlap benchmark: benchmarks/bench_overlap.py --quick"
  "$PY" benchmarks/bench_overlap.py --quick --json "$OUT_DIR/overlap.json"
else
  step "benchmarks/bench_overlap.py does not exist (yet): skipped"
fi

step "done in $(elapsed)s; results in $OUT_DIR (copy.json$([ -f benchmarks/bench_overlap.py ] && echo ', overlap.json'))"
if [ "$CUDA_PATH" != 1 ]; then
  echo "FAIL: everything ran, but hetero._C has no CUDA path (see the warning after the build)" >&2
  exit 3
fi
