#!/usr/bin/env bash
# CI build check of the dsparkjax XLA FFI plugins:
#   1. Bazel (Debian bazel-bootstrap 4.2, offline) builds the CPU plugin and loads it in JAX;
#   2. if nvcc exists, Bazel builds the CUDA plugin through the nvcc genrule;
#   3. hipcc (HIP_PLATFORM=amd, gfx90a) compiles the shared GPU source custom_calls/gpu_ffi.cu.
# Installs bazel-bootstrap / hipcc with apt-get when missing. Exits non-zero on the first failure.
# Environment: DSPARK_PYTHON (python with jaxlib, default python3), NVCC, SKIP_CUDA=1, SKIP_HIP=1.
set -euo pipefail
cd "$(dirname "$0")/.."
export DSPARK_PYTHON="${DSPARK_PYTHON:-$(command -v python3)}"

need_apt() {  # need_apt <command> <package>
  if ! command -v "$1" >/dev/null 2>&1; then
    echo "== installing $2"
    apt-get update -qq && apt-get install -y -qq "$2" >/dev/null
  fi
}

need_apt bazel bazel-bootstrap
echo "== bazel: CPU plugin"
bazel build //custom_calls:all
bin="$(bazel info bazel-bin 2>/dev/null)/custom_calls"
DSPARKJAX_LIB_DIR="$bin" "$DSPARK_PYTHON" - <<'PY'
import numpy as np
import dsparkjax.kernels as K
from dsparkjax.kernels import ffi
ffi.require("cpu")
w = np.zeros((2, 34), np.uint8)
assert K.qmatmul(np.ones((1, 32), np.float32), w, 8, backend="ffi").shape == (1, 2)
print("CPU plugin loads and runs")
PY

if [[ "${SKIP_CUDA:-0}" != 1 ]] && command -v "${NVCC:-nvcc}" >/dev/null 2>&1; then
  echo "== bazel: CUDA plugin (nvcc genrule)"
  bazel build //custom_calls:libdspark_cuda_ffi.so
  nm -D "$bin/libdspark_cuda_ffi.so" | grep DsparkQMatmulCuda >/dev/null
  nm -D "$bin/libdspark_cuda_ffi.so" | grep DsparkPluginAbi >/dev/null  # ffi.py refuses a plugin without it
else
  echo "== skipping the CUDA plugin (no nvcc or SKIP_CUDA=1)"
fi

if [[ "${SKIP_HIP:-0}" != 1 ]]; then
  need_apt hipcc hipcc
  echo "== hipcc: HIP compile check of custom_calls/gpu_ffi.cu (gfx90a)"
  inc="$("$DSPARK_PYTHON" -c 'import jax.ffi; print(jax.ffi.include_dir())')"
  out="$(mktemp -d)"
  HIP_PLATFORM=amd hipcc -std=c++17 -O2 --offload-arch=gfx90a -fPIC -isystem "$inc" \
    -x hip -c custom_calls/gpu_ffi.cu -o "$out/gpu_ffi_hip.o"
  nm "$out/gpu_ffi_hip.o" | grep DsparkQMatmulRocm >/dev/null
  rm -rf "$out"
fi
echo "== all build checks passed"
