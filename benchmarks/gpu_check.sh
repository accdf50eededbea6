#!/usr/bin/env bash
# GPU check of hetero: build the extension with CUDA, run the GPU tests, measure.
#
#   bash benchmarks/gpu_check.sh          # from anywhere; runs in the repository root
#
# Needs a machine with a GPU and torch with CUDA already installed (nothing is downloaded: the
# extension is built in place with the installed torch, setuptools and CUDA toolkit). Steps:
#   1. versions: python, torch, CUDA, GPU, CPU SIMD; fails at once if torch.cuda.is_available() is false
#   2. build hetero._C in place (python setup.py build_ext --inplace: a CUDAExtension with
#      -DHETERO_CUDA when a CUDA toolkit is found), only for this GPU's architecture
#   3. GPU tests, one pytest process per file (a crash in one does not hide the others):
#      tests/test_cuda.py, test_copies.py, test_mixed_precision.py (its CUDA cases) and
#      test_cpu_adam.py (the CPU Adam kernel's AVX-512 path, where this machine's CPU has it),
#      then python benchmarks/mp_diag.py --device cuda: which variant closes the gap between
#      mixed precision and torch's recipe that test_mixed_precision.py's CUDA cases showed
#   4. python benchmarks/bench_copy.py --json $OUT/copy.json: H2D / D2H GB/s of the copy engine
#      against a plain cudaMemcpyAsync, and the overlap of copies with compute
#   5. python benchmarks/bench_overlap.py --device cuda --steps 12 --turn 4 --json $OUT/overlap.json: step time
#      resident / device budget 25% / optimizer states on NVMe, on the GPU
#   6. python -m hetero plan --device cuda for the nvme_opt configuration of step 5
#      (--json $OUT/plan_nvme_opt.json): the plan's estimate to compare
#   7. python benchmarks/bench_adam.py (64M parameters, quick) --json $OUT/adam.json
#   8. with GPU_CHECK_SUITE=1 only, the whole test suite (pytest -n with pytest-xdist when
#      installed; the CPU CI runs it, and alone it takes longer than the rest of this script)
# Every step runs even when an earlier one failed (after a failed build only what needs no
# extension is meaningful, but it still runs); each step has a time limit (GPU_CHECK_STEP_S,
# default 240 s). A step that crashes (SIGSEGV, SIGABRT) is run again under cuda-gdb or gdb, when
# one is installed, for the native backtrace of every thread (Python's faulthandler shows only
# Python frames). Results go to ${OUT:-/tmp}: gpu_check.log (all output), gpu_check_build.log,
# copy.json, overlap.json, plan_nvme_opt.json, adam.json and NAME.gdb.log for a crashed step. Meant
# to take under 5 minutes on a 16-core H200 machine (the eighth session's run took 295 s with the
# steps it had then; mp_diag and the plan were added since, and bench_overlap shortened).
# Exit status: the first failing step's; 3 if everything passed but hetero._C has no CUDA path.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT_DIR="${OUT:-/tmp}"
mkdir -p "$OUT_DIR"
exec > >(tee "$OUT_DIR/gpu_check.log") 2>&1
export PYTHONUNBUFFERED=1
unset HETERO_FORCE_PYTHON_COPY HETERO_IO_BACKEND
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
status=$?
if [ "$status" -ne 0 ]; then  # no usable GPU: nothing below would measure anything
  echo "gpu_check: stopping (exit $status)" >&2
  exit "$status"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
if command -v nvcc >/dev/null 2>&1; then nvcc --version | tail -1; else echo "nvcc: not on PATH"; fi
echo "CPUs: $(nproc); $(grep -m1 'model name' /proc/cpuinfo)"
echo "CPU SIMD: $(grep -o -w -E 'avx512f|avx512bw|avx2|fma|f16c' /proc/cpuinfo | sort -u | tr '\n' ' ')"
echo "disk under $(pwd): $(df -h . | tail -1)"

FIRST_FAIL=0
STEP_LIMIT="${GPU_CHECK_STEP_S:-240}"
DEBUGGER=$(command -v cuda-gdb || command -v gdb || true)
[ -z "$DEBUGGER" ] && [ -x /usr/local/cuda/bin/cuda-gdb ] && DEBUGGER=/usr/local/cuda/bin/cuda-gdb
# run NAME CMD...: run a step under the time limit and remember a failure; a crash is run again
# under the debugger for native backtraces ($OUT_DIR/NAME.gdb.log)
run() {
  local name=$1 rc=0
  shift
  timeout -k 10 "$STEP_LIMIT" "$@" || rc=$?
  if [ "$rc" != 0 ]; then
    echo "FAIL: step $name exited $rc$([ "$rc" = 124 ] && echo " (over its ${STEP_LIMIT}s limit)")" >&2
    [ "$FIRST_FAIL" = 0 ] && FIRST_FAIL=$rc
    if [ "$rc" -gt 128 ] && [ "$rc" != 137 ] && [ -n "$DEBUGGER" ]; then
      echo "    step $name crashed (signal $((rc - 128))): again under $DEBUGGER -> $OUT_DIR/$name.gdb.log"
      local cmd=("$@")
      # the debugger needs the interpreter itself, not a wrapper script (pyenv's shims are)
      [ "${cmd[0]}" = "$PY" ] && cmd[0]=$("$PY" -c 'import sys; print(sys.executable)')
      timeout -k 10 "$STEP_LIMIT" "$DEBUGGER" -q -batch -ex "set pagination off" -ex run \
        -ex "echo \n=== the crashing thread\n" -ex "bt 40" -ex "echo \n=== all threads\n" \
        -ex "thread apply all bt 25" --args "${cmd[@]}" > "$OUT_DIR/$name.gdb.log" 2>&1 || true
      grep -A40 "=== the crashing thread" "$OUT_DIR/$name.gdb.log" | head -45
    fi
  fi
  return 0
}

step "build hetero._C in place"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
if [ -z "${TORCH_CUDA_ARCH_LIST:-}" ]; then
  TORCH_CUDA_ARCH_LIST="$("$PY" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')"
  export TORCH_CUDA_ARCH_LIST
fi
echo "MAX_JOBS=$MAX_JOBS TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST"
if "$PY" setup.py build_ext --inplace > "$OUT_DIR/gpu_check_build.log" 2>&1; then
  tail -2 "$OUT_DIR/gpu_check_build.log"
else
  tail -40 "$OUT_DIR/gpu_check_build.log"
  echo "FAIL: the extension did not build (log: $OUT_DIR/gpu_check_build.log)" >&2
  FIRST_FAIL=1
fi
CUDA_PATH=1
rc=0
"$PY" - <<'EOF' || rc=$?
import sys

import hetero
from hetero import copies, engine
from hetero.optim import kernel

print(f"hetero from {hetero.__file__}")
if copies._C is None:
    print(f"FAIL: hetero._C does not import: {copies.EXTENSION_ERROR}", file=sys.stderr)
    sys.exit(1)
print(f"hetero._C copy engine CUDA path (HETERO_CUDA): {copies._C.COPY_CUDA}")
print(f"swap I/O backends: {engine.available_backends()}; CPU Adam code paths: {kernel.available_isas()}")
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
  *) [ "$FIRST_FAIL" = 0 ] && FIRST_FAIL=1 ;;
esac

for f in test_cuda test_copies test_mixed_precision test_cpu_adam; do
  step "GPU tests: pytest tests/$f.py"
  run "$f" "$PY" -m pytest -q -rs --tb=short -p no:cacheprovider "tests/$f.py"
done

step "mixed precision against torch's recipe, four variants: benchmarks/mp_diag.py --device cuda"
run mp_diag "$PY" benchmarks/mp_diag.py --device cuda

step "copy engine benchmark: benchmarks/bench_copy.py"
run bench_copy "$PY" benchmarks/bench_copy.py --json "$OUT_DIR/copy.json"

step "step time on the GPU: benchmarks/bench_overlap.py --device cuda"
run bench_overlap "$PY" benchmarks/bench_overlap.py --device cuda --model "${GPU_CHECK_MODEL:-large}" \
  --batch-size "${GPU_CHECK_BATCH:-32}" --chunk-size "${GPU_CHECK_CHUNK:-64MiB}" --steps 12 --turn 4 --no-progress \
  --json "$OUT_DIR/overlap.json"

step "hetero plan on the GPU, for bench_overlap's nvme_opt configuration"
# The plan's estimate against the step times just measured: its dry run uses the CPU, its
# pricing this GPU's copy engine, the swap directory's disk and the model's forward and backward.
# Budgets as close to bench_overlap's as the CLI takes them: its NVMe budget is left to the disk,
# so the bytes compare approximately.
MODEL="${GPU_CHECK_MODEL:-large}"
STATE=$("$PY" -c "from hetero import models; print(models.state_bytes(models.GPT(models.get_config('$MODEL'))))")
PLAN=("$PY" -m hetero plan --device cuda --model "$MODEL" --batch-size "${GPU_CHECK_BATCH:-32}"
      --chunk-size "${GPU_CHECK_CHUNK:-64MiB}" --device-budget $((STATE / 4)))
run plan_nvme_opt "${PLAN[@]}" --host-budget $((STATE * 45 / 100)) --nvme-path . --json "$OUT_DIR/plan_nvme_opt.json"

step "CPU Adam benchmark: benchmarks/bench_adam.py (64M parameters)"
run bench_adam "$PY" benchmarks/bench_adam.py --sizes 64M --threads "1,$(nproc)" --reps 3 --no-deepspeed \
  --no-progress --json "$OUT_DIR/adam.json"

if [ "${GPU_CHECK_SUITE:-0}" != 0 ]; then
  step "the whole test suite"
  if "$PY" -c "import xdist" 2>/dev/null; then XDIST=(-n "$(( $(nproc) > 8 ? 8 : $(nproc) ))"); else XDIST=(); fi
  run suite "$PY" -m pytest -q "${XDIST[@]}" tests
fi

step "done in $(elapsed)s; results in $OUT_DIR"
if [ "$FIRST_FAIL" != 0 ]; then
  echo "FAIL: a step failed (the first exited $FIRST_FAIL); the logs are in $OUT_DIR" >&2
  exit "$FIRST_FAIL"
fi
if [ "$CUDA_PATH" != 1 ]; then
  echo "FAIL: everything ran, but hetero._C has no CUDA path (see the warning after the build)" >&2
  exit 3
fi
