#!/usr/bin/env bash
# Everything the H200 checks and measures, in one device call (see docs/PERFORMANCE.md):
#   build the CPU and CUDA plugins, the GPU kernel suite and the model on packed weights, the kernel
#   benchmark (Q8_0 and IQ2_XXS), then exact-vs-plain generation in bf16 on 64 prompts with the fast mode's
#   mismatch rate and tok/s of plain vs speculative decoding in the same run.
# Expects the gguf wheel in .whl/ (carried); results go to $OUT as they are produced. Plugins carried in
# dsparkjax/_lib (built here with `DSPARKJAX_CUDA=ON`, sm_90) skip the 2-minute build on the device
# (scripts/device_setup.sh). The default sections no longer fit one call: `tests` alone ran 580 s on an H100 for
# 207 of its 211 tests (G28), so run it as its own call (a device call's limit is 10 minutes) and pass section
# names to run fewer, e.g.
#   bash scripts/device_suite.sh kernels generate        (the build runs unless plugins are carried)
# Not run by default: `layers` (the GPU tests of the kernels that read one layer of a stacked operand, HC-pre, the
# indexer's top-k and the grouped products, then tests/test_scan.py on the GPU; not measured yet), `ds4`
# (DeepSeek-V4-Flash's own dims with 8 of its layers: the step at widths 1-6 at batch 1
# and 8, and generation at batch 1), `step` (the compiled generation step alone, widths 1 and 6, with its trace: where a step's
# device time goes), `hc` (the mHC custom calls' time per call, outputs saved for comparing builds), `durations` (every kernel benchmark call's kernel time alone, under Nsight Compute),
# `profile` (one call of each of two kernels in depth, with each pipe's utilisation), `routes` (the packed
# kernel against the model's dense copy on XLA's GEMM at small and large row counts: what sets
# KernelPolicy.gemm_min_rows), `policy` (the tensor-core mode's FFI attribute, off/auto/force, on the GPU), `q4k` (the Q4_K GPU tests alone, then Q4_K against Q2_K and IQ2_XXS at DS4's expert
# shapes, T = 1, 2, 4, 8; its time is not measured yet, the kernels section's size) and `indexer` (the
# length-bound CSA indexer top-k: its GPU tests, then DS4's step at a 1k context in 1k- and 64k-capacity states;
# about five minutes, not measured yet), `serve` (32 streaming clients against `python -m dsparkjax.serve` on the
# embedded pair, scripts/bench_serve.py three times; needs wheels of the serve and test extras carried in .whl/:
# starlette, uvicorn, h11, prometheus_client, openai and its dependencies; about two minutes, not measured yet),
# `train` (scripts/train_tiny.py on the GPU, bounded to about five
# minutes: a hidden-128 pair with an F16 target of about 5 MB into $OUT/pair, the loss PNG and training_run.json
# into $OUT; it needs no plugin, so run it alone as `DSPARKJAX_NO_BUILD=1 bash scripts/device_suite.sh train`),
# `invmoe` (the invariant step's row-invariant products: the grouped products of attention and the float MoE path,
# their GPU bit tests, then DS4's 4-layer step at widths 1 and 6, batch 1 (and 8 if time allows), invariant
# against XLA's, and the batch-8 width-6 invariant step's trace; about four minutes),
# `invariance` (issue 42, its whole acceptance in one call of at most 9.5 minutes: scripts/check_invariance.py on the
# embedded pair and on DS4's dims with 4 layers in bf16 and f32; DS4 4-layer generation at batch 1 and 8, exact
# plain against XLA's width-1 program and exact speculative (oracle p = 0.8, q = 6) against the old fixed-width
# exact mode; batch 64 spec == plain; everything in $OUT/invariance.tgz; run it alone) and `sampling` (the generation
# benchmark with every run sampling at T = 0.7: plain vs exact and lossless speculative sampling, tok/s; run it
# beside `generate` for the greedy numbers, `bash scripts/device_suite.sh generate sampling`: each section is one
# bench_generate.py run, files generate_bf16.{json,log} and generate_sampled_bf16.{json,log}; the lossless run's
# oracle proposes plain sampling's tokens with a point-mass q, so each is accepted with the target's probability of
# it: its lossless_matched_per_offered in the JSON says what acceptance its tok/s had) and `scan` (issue 38:
# unrolled vs scanned layers at DS4's dims, compile seconds, step ms and the cold and warm start to the first token;
# SCAN_LAYERS picks the layer counts), `warmstart` (issue 38: tests/test_exported.py on the GPU, then
# scripts/startup_compile.py twice on one cache, DS4's 43-layer width-1 step: the warm start's trace + lower seconds)
# and `slow` (the tests marked slow, which CI skips, on the host's CPUs with JAX_PLATFORMS=cpu and 4 pytest-xdist
# workers; not measured yet).
set -uo pipefail
SECTIONS="${*:-tests kernels generate}"
want() { [[ " $SECTIONS " == *" $1 "* ]]; }
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/dsparkjax-out}"; mkdir -p "$OUT"
source scripts/device_setup.sh
export PYTEST_ADDOPTS="-n 0 ${PYTEST_ADDOPTS:-}"  # GPU runs in one process (pyproject asks 2 workers for CI)
if want tests; then
echo "== GPU kernels and packed model"
python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_packed_model.py -k "gpu or packed" \
  > "$OUT/tests.log" 2>&1; tail -3 "$OUT/tests.log"
fi
if want layers; then  # the kernels that read one layer of a stacked operand (a scanned body's), and test_scan
echo "== layer operands: HC-pre, indexer top-k and grouped products on stacks; scanned == unrolled steps on the GPU"
python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels.py -k "stacked or stack or grouped_matmul" \
  > "$OUT/layers_kernels.log" 2>&1; tail -1 "$OUT/layers_kernels.log"
python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_indexer.py > "$OUT/layers_indexer.log" 2>&1
tail -1 "$OUT/layers_indexer.log"
python3 -m pytest -q -p no:cacheprovider tests/test_scan.py > "$OUT/layers_scan.log" 2>&1; tail -1 "$OUT/layers_scan.log"
fi
if want policy; then  # about a minute: the part of `tests` that checks the `mma` FFI attribute
echo "== kernel policy: the tensor-core mode as an FFI attribute (off, auto, force give the CPU model's bits)"
python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_packed_model.py \
  -k "several_tokens or mma_mode or two_kernel_policies" > "$OUT/policy.log" 2>&1; tail -3 "$OUT/policy.log"
fi
if want q4k; then
echo "== Q4_K: GPU tests, then the kernel benchmark at DS4's expert shapes"
python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_packed_model.py -k "gpu and Q4_K or q4k" \
  > "$OUT/q4k_tests.log" 2>&1; tail -3 "$OUT/q4k_tests.log"
python3 scripts/bench_kernels.py --formats=Q4_K,Q2_K,IQ2_XXS --t_rows=1,2,4,8 --calls=64 --reps=20 \
  --shapes=exp_up6,exp_up24,exp_down6,exp_down24,exp_gate_up6,exp_gate_up24 \
  --json_out="$OUT/q4k_kernels.json" > "$OUT/q4k_kernels.log" 2>&1; tail -40 "$OUT/q4k_kernels.log"
fi
if want kernels; then
echo "== kernel benchmark"
python3 scripts/bench_kernels.py --formats=Q8_0,IQ2_XXS --t_max=5 --calls=64 --reps=20 \
  --json_out="$OUT/kernels.json" > "$OUT/kernels.log" 2>&1; tail -14 "$OUT/kernels.log"
fi
if want generate; then
echo "== generation benchmark (bf16)"
XLA_FLAGS= python3 scripts/bench_generate.py --config wide --dtype bfloat16 --prompts 64 --max_new_tokens 32 \
  --q 4 --acceptance 0.7 --output "$OUT/generate_bf16.json" > "$OUT/generate_bf16.log" 2>&1
grep -v '^ ' "$OUT/generate_bf16.log" | tail -8
fi
if want sampling; then  # about as long as `generate`: the same benchmark, every run sampling at T = 0.7
echo "== generation benchmark, sampled (bf16, T = 0.7): plain vs exact / lossless speculative sampling"
XLA_FLAGS= python3 scripts/bench_generate.py --config wide --dtype bfloat16 --prompts 64 --max_new_tokens 32 \
  --q 4 --acceptance 0.7 --temperature 0.7 --output "$OUT/generate_sampled_bf16.json" \
  > "$OUT/generate_sampled_bf16.log" 2>&1
grep -v '^ ' "$OUT/generate_sampled_bf16.log" | tail -9
fi
if want step; then  # about two minutes
echo "== compiled step alone (wide model, published recipe), widths 1 and 6, traced"
XLA_FLAGS= python3 scripts/bench_step.py --config wide --dtype bfloat16 --recipe published --prompts 64 \
  --widths 1,6 --steps 32 --reps 5 --trace --top 25 > "$OUT/step.txt" 2>&1
grep -E "^width|^== |^   line" "$OUT/step.txt"
fi
if want ds4; then  # about eight minutes: DS4's own dims, its first 8 layers, batch 1 and 8
echo "== DS4-sized model (8 of 43 layers, random packed blocks, published recipe): the step by width, generation"
for b in 1 8; do
  XLA_FLAGS= python3 scripts/bench_step.py --config ds4 --layers 8 --dtype bfloat16 --recipe published \
    --prompts $b --widths 1,2,3,4,5,6 --steps 16 --reps 3 > "$OUT/ds4_step_b$b.txt" 2>&1
  grep -E "^device|^width|Error" "$OUT/ds4_step_b$b.txt"
done
XLA_FLAGS= python3 scripts/bench_generate.py --config ds4 --layers 8 --dtype bfloat16 --recipe published \
  --prompts 1 --max_new_tokens 32 --q 4 --acceptance 0.7 --reps 3 --output "$OUT/ds4_generate_b1.json" \
  > "$OUT/ds4_generate_b1.log" 2>&1
grep -v '^ ' "$OUT/ds4_generate_b1.log" | tail -9
fi
if want indexer; then
echo "== indexer_topk: GPU tests, then the step by (context, capacity) with the FFI and the jnp indexer (DS4, 8 layers)"
python3 -m pytest -q -p no:cacheprovider tests/test_indexer.py -m gpu > "$OUT/indexer_tests.log" 2>&1
tail -3 "$OUT/indexer_tests.log"
for ix in ffi reference; do
  cases=1k:1k,1k:64k,8k:64k,64k:64k; [[ $ix == reference ]] && cases=1k:1k,1k:64k
  XLA_FLAGS= python3 scripts/bench_step.py --config ds4 --layers 8 --dtype bfloat16 --recipe published \
    --prompts 1 --widths 1 --steps 32 --reps 5 --indexer $ix --cases $cases > "$OUT/indexer_step_$ix.txt" 2>&1
  grep -E "^device|^width|Error" "$OUT/indexer_step_$ix.txt"
done
fi
if want serve; then
echo "== server: 32 streaming clients, 8 leaving early (embedded pair, 16 rows, exact speculative decoding)"
python3 -m dsparkjax.serve --port 8000 > "$OUT/serve.log" 2>&1 &
server=$!
python3 - <<'PY' || tail -20 "$OUT/serve.log"
import time, urllib.request
for _ in range(300):
    try:
        urllib.request.urlopen("http://127.0.0.1:8000/health", timeout=1); break
    except OSError:
        time.sleep(1)
else:
    raise SystemExit("the server did not come up")
PY
for run in 1 2 3; do python3 scripts/bench_serve.py --url http://127.0.0.1:8000/v1 | tee -a "$OUT/serve.jsonl"; done
python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:8000/metrics').read().decode())" \
  | grep -E '^dsparkjax_(draft|engine_steps|generated)' | tee "$OUT/serve_metrics.txt"
kill $server
fi
if want train; then  # about five minutes: the loops stop at their budgets (120 s and 90 s); the shipped pair's run
echo "== train the embedded pair on the GPU (scripts/train_tiny.py)"
python3 scripts/train_tiny.py --out "$OUT/pair" --docs "$OUT" --hidden 128 --expert_ffn 128 --target_recipe f16 \
  --batch 32 --seq_len 256 --lr 2e-3 --target_steps 20000 --target_seconds 120 \
  --draft_sequences 512 --drafter_batch 16 --anchors 32 --drafter_steps 10000 --drafter_seconds 90 \
  > "$OUT/train.log" 2>&1
tr '\r' '\n' < "$OUT/train.log" | grep -v "it/s]$" | tail -40
ls -l "$OUT/pair"
fi
if want invariance; then  # issue 42's acceptance in one call, bounded to 9.5 minutes (later parts are skipped)
echo "== batch invariance (issue 42): check_invariance.py (embedded pair; DS4 4 layers bf16, f32), exact vs XLA width-1"
INV="$OUT/invariance"; mkdir -p "$INV"; left() { echo $((570 - SECONDS)); }
run_inv() { local name=$1; shift; if (( $(left) < 30 )); then echo "$name: skipped (time)"; return; fi
  XLA_FLAGS= timeout "$(left)" "$@" > "$INV/$name.log" 2>&1; echo "$name: rc $?"; }
run_inv invariance_tiny python3 scripts/check_invariance.py; tail -1 "$INV/invariance_tiny.log"
DS4="--config ds4 --layers 4"
GEN="scripts/bench_generate.py $DS4 --recipe published --max_new_tokens 32 --q 6 --acceptance 0.8"
run_inv generate_b1 python3 $GEN --dtype bfloat16 --prompts 1 --reps 3 \
  --runs plain_exact,plain_fast,spec_exact,old_exact --output "$INV/generate_b1.json"
run_inv invariance_ds4_bfloat16 python3 scripts/check_invariance.py $DS4 --dtype bfloat16
run_inv invariance_ds4_float32 python3 scripts/check_invariance.py $DS4 --dtype float32
run_inv generate_b8 python3 $GEN --dtype bfloat16 --prompts 8 --reps 2 \
  --runs plain_exact,plain_fast,spec_exact,old_exact --output "$INV/generate_b8.json"
run_inv generate_b64 python3 $GEN --dtype bfloat16 --prompts 64 --reps 1 --runs plain_exact,plain_fast,spec_exact \
  --output "$INV/generate_b64.json"
for f in "$INV"/invariance_*.log; do echo "$(basename "$f"): $(tail -1 "$f")"; done
for f in "$INV"/generate_*.log; do grep -E "tok/s|Error" "$f"; done
python3 - "$INV" <<'PY'
import glob, json, sys
keys = ("plain_exact_over_plain_fast_step", "spec_exact_over_spec_old_exact", "exact_spec_equals_plain",
        "old_exact_spec_equals_old_plain", "fast_plain_vs_exact_plain_mismatch", "ms_per_step")
for path in sorted(glob.glob(f"{sys.argv[1]}/generate_*.json")):
    d = json.load(open(path))
    print(path.rsplit("/", 1)[-1], {k: d[k] for k in keys if k in d})
PY
tar czf "$OUT/invariance.tgz" -C "$OUT" invariance && rm -rf "$INV"
fi
if want invmoe; then  # about five minutes (G28: 290 s); the batch-8 timing only while the section is under 150 s
echo "== row-invariant products (attention's grouped products, float MoE): GPU bit tests, then DS4's step, invariant vs XLA"
start=$SECONDS
python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels.py -k "attention_products or grouped_matmul or qmatmul_id" \
  > "$OUT/invmoe_tests.log" 2>&1; tail -3 "$OUT/invmoe_tests.log"
python3 -m pytest -q -p no:cacheprovider tests/test_invariance.py -k "rowwise or grouped_rows" \
  > "$OUT/invmoe_rowwise.log" 2>&1; tail -1 "$OUT/invmoe_rowwise.log"
STEP="scripts/bench_step.py --config ds4 --layers 4 --dtype bfloat16 --recipe published --widths 1,6 --steps 16"
STEP="$STEP --reps 3"
XLA_FLAGS= python3 $STEP --prompts 1 --programs invariant,fast > "$OUT/invmoe_step_b1.txt" 2>&1
grep -E "^device|^width|Error" "$OUT/invmoe_step_b1.txt"
if (( SECONDS - start < 150 )); then
  XLA_FLAGS= timeout 150 python3 $STEP --prompts 8 --programs invariant,fast > "$OUT/invmoe_step_b8.txt" 2>&1
  grep -E "^device|^width|Error" "$OUT/invmoe_step_b8.txt"
fi
XLA_FLAGS= timeout 120 python3 ${STEP/--widths 1,6/--widths 6} --prompts 8 --programs invariant --trace --top 20 \
  > "$OUT/invmoe_trace_b8.txt" 2>&1
grep -E "^width|^== |^   line" "$OUT/invmoe_trace_b8.txt"
fi
if want scan; then  # issue 38's start-up: about 4-5 minutes per layer count at 32 layers (the unrolled compiles)
# Unrolled vs scanned layers (load_target's scan_layers) at DS4's dims, each layer count of $SCAN_LAYERS
# (default "8"; 32 fits an 80 GB H100: run `SCAN_LAYERS=32 bash scripts/device_suite.sh scan` as its own call):
# compile seconds (compile.first_program_s: the batch-1 width-1 program alone), step ms at widths 1 and 6, the cold
# start to the first token (compiling generate's programs) and a second process's warm start from the persistent
# compilation cache (startup.warm: cache_entries_written 0 shows nothing was compiled), each in a fresh cache.
echo "== scanned vs unrolled layers (DS4 dims): compile s, step ms, cold and warm start to the first token"
for n in ${SCAN_LAYERS:-8}; do
  for layout in unrolled scanned; do
    flag=--noscan_layers; [[ $layout == scanned ]] && flag=--scan_layers
    DSPARKJAX_CACHE="$(mktemp -d)" XLA_FLAGS= python3 scripts/bench.py --layers "$n" $flag --measure startup,steps \
      --widths 1,6 --contexts 1024 --reps 3 --steps 16 --cold_start --compile_threads 2 \
      --json_out "$OUT/scan_${layout}_${n}layers.json" > "$OUT/scan_${layout}_${n}layers.log" 2>&1
    echo "exit $?"
    python3 - "$OUT/scan_${layout}_${n}layers.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
get = lambda *ks: (lambda d: [d := (d or {}).get(k) for k in ks][-1])(r)
print(sys.argv[1].rsplit("/", 1)[-1], "compile w1 %s s," % get("compile", "first_program_s"),
      "steps ms q1 %s q6 %s," % (get("steps", "1", "ms"), get("steps", "6", "ms")),
      "first token cold %s s warm %s s (warm compiled %s)" % (get("startup", "cold", "process_to_first_token_s"),
      get("startup", "warm", "process_to_first_token_s"), get("startup", "warm", "cache_entries_written")))
PY
  done
done
fi
if want hc; then  # under a minute; compare two builds with bench_hc.py --compare=A.npz,B.npz
echo "== mHC custom calls"
python3 scripts/bench_hc.py --save="$OUT/hc.npz" 2>&1 | grep -v '^[IW][0-9]'
fi
if want durations; then  # about three minutes: each call's kernel alone, caches flushed (no overlap, no launch gap)
echo "== kernel durations (ncu, every shape, T = 1 and 4, against a 1 GiB copy kernel timed the same way)"
ncu --clock-control none -k regex:'qmatmul|qmma|loop_add_fusion' --metrics gpu__time_duration.sum --csv \
  --log-file "$OUT/durations.csv" python3 scripts/profile_kernel.py --formats=Q8_0,Q2_K,IQ2_XXS --t_rows=1,4 \
  --copy_mib=1024 --copy_sizes_mb=1.1,4.4,13.4,35.6 --configs_out="$OUT/configs.json" > "$OUT/durations.log" 2>&1
python3 scripts/profile_kernel.py --table_from="$OUT/durations.csv" --configs_in="$OUT/configs.json" \
  | tee "$OUT/durations.txt"
fi
if want routes; then  # about three minutes
echo "== kernel vs dense copy + GEMM, Q8_0 dense shapes, T = 1..384 (the copy route with a weight per call)"
for route in "" "--dense_copy"; do
  python3 scripts/bench_kernels.py --formats=Q8_0 --shapes=attn_a,wide_b,grouped_o,dense_8k \
    --t_rows=1,2,4,8,16,64,384 --calls=16 --reps=10 --copy_mib=256 $route 2>&1 | grep -v '^[IW][0-9]'
done
fi
if want profile; then  # not in the default set: about a minute, one Nsight Compute report per call
echo "== ncu: one IQ2_XXS expert call and one Q8_0 attention call"
# Which unit binds: each pipe's share of its peak issue rate (ALU: logic, shifts, byte permutes; FMA-heavy:
# IMAD and dp4a; LSU: shared-memory and global accesses) and the shared-memory wavefronts (128 bytes per SM cycle).
PIPE_METRICS=sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active,\
sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active,\
sm__inst_executed_pipe_fmaheavy.avg.pct_of_peak_sustained_active,\
sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active,\
l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,\
l1tex__data_pipe_lsu_wavefronts_mem_shared.avg.pct_of_peak_sustained_elapsed,\
l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum
for spec in "IQ2_XXS exp_up24" "Q8_0 attn_a"; do
  set -- $spec
  ncu --clock-control none -k regex:'qmatmul|qmma' --launch-skip 1 --launch-count 1 --section SpeedOfLight \
    --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats \
    --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section InstructionStats \
    --metrics "$PIPE_METRICS" python3 scripts/profile_kernel.py --formats="$1" --shapes="$2" \
    > "$OUT/ncu_$1_$2.txt" 2>&1
  grep -E "Duration|DRAM Throughput|Achieved Occupancy|Eligible Warps|Dynamic Shared|Issue Slots Busy|SM Busy|\
Executed Instructions  |pipe_|wavefronts" "$OUT/ncu_$1_$2.txt"
done
fi
if want warmstart; then  # not in the default set; about four minutes (not measured yet)
echo "== warm start (issue 38): the exported-program cache's tests, then DS4's width-1 step (43 unrolled layers,"
echo "   shapes only) started twice on one cache: seconds to trace + lower and to compile, entries written"
python3 -m pytest -q tests/test_exported.py 2>&1 | tail -3
rm -rf /tmp/warmstart_cache
for run in cold warm; do
  DSPARKJAX_CACHE=/tmp/warmstart_cache python3 scripts/startup_compile.py --config=ds4 --layers=43 \
    2>"$OUT/warmstart_$run.log" | tee "$OUT/warmstart_$run.json"
done
echo "   bytes on disk per entry (what DSPARKJAX_CACHE_MAX_SIZE's 10 GiB default must hold):"
find /tmp/warmstart_cache -type f \( -name "*-cache" -o -name "*.jaxexp" \) -printf "%s %f\n" | sort -n | tail -5
du -sb /tmp/warmstart_cache
fi
if want slow; then  # not measured yet: CI runs `pytest -q` without --run-slow, so this is where they run
echo "== tests marked slow (CI skips them), on the CPU: JAX_PLATFORMS=cpu pytest --run-slow -m slow"
JAX_PLATFORMS=cpu python3 -m pytest -q -p no:cacheprovider -n 4 --run-slow -m slow tests/ > "$OUT/slow_tests.log" 2>&1
tail -3 "$OUT/slow_tests.log"
fi
