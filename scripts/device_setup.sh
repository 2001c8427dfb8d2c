# Sourced by the device scripts (device_suite.sh, device_bench.sh) from the repository root: installs the
# carried wheels (.whl/, e.g. gguf, which the device lacks) into /tmp/site, puts them and the checkout on
# PYTHONPATH, prints the date, GPU and JAX, and builds the CPU and CUDA plugins into dsparkjax/_lib unless they
# were carried there (the build takes about two minutes) or DSPARKJAX_NO_BUILD is set. Without a GPU (a CPU dry run) it builds nothing and
# expects DSPARKJAX_LIB_DIR or carried plugins. $OUT must be set; the build log goes there.
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
date -u
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
fi
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
if [[ -f dsparkjax/_lib/libdspark_cuda_ffi.so && -f dsparkjax/_lib/libdspark_cpu_ffi.so ]]; then
  echo "== using the carried plugins in dsparkjax/_lib"
elif [[ -n "${DSPARKJAX_NO_BUILD:-}" ]]; then
  echo "== no plugin build (DSPARKJAX_NO_BUILD): the sections run must not need one"
elif command -v nvidia-smi >/dev/null; then
  echo "== build (CMake, sm_90)"
  inc=$(python3 -c 'import jax.ffi; print(jax.ffi.include_dir())')
  { cmake -S . -B /tmp/b -DDSPARKJAX_CUDA=ON -DCMAKE_BUILD_TYPE=Release -DXLA_FFI_INCLUDE_DIR="$inc" >/dev/null \
    && cmake --build /tmp/b -j16 >/dev/null && mkdir -p dsparkjax/_lib && cp /tmp/b/libdspark_*.so dsparkjax/_lib/; } \
    > "$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
fi
