#!/usr/bin/env bash
# Everything the H200 checks and measures, in one device call (see docs/PERFORMANCE.md):
#   the GPU kernel suite, the model on packed weights, exact-vs-plain generation in bf16 on 64 prompts
#   with the fast mode's mismatch rate, and tok/s of plain vs speculative decoding in the same run.
# Expects the gguf wheel in .whl/ and the built plugins in dsparkjax/_lib/ (both carried); results go to $OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/dsparkjax-out}"; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
date -u
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
git log -1 --format='commit %H' 2>/dev/null || true
echo "== GPU kernels and packed model"
python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_packed_model.py -k "gpu or cuda or packed" \
  2>&1 | tee "$OUT/tests.log" | tail -5
echo "== generation benchmark (bf16)"
XLA_FLAGS= python3 scripts/bench_generate.py --config wide --dtype bfloat16 --prompts 64 --max_new_tokens 32 \
  --q 4 --acceptance 0.7 --output "$OUT/generate_bf16.json" 2>&1 | tee "$OUT/generate_bf16.log" | grep -v '^ '
