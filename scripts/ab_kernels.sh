#!/usr/bin/env bash
# A/B of GPU kernel variants in one device call. Each argument VARIANT[+FLAG=VALUE]:FORMATS:T_LIST[:SHAPES] times
# every call of scripts/profile_kernel.py under Nsight Compute (caches flushed, each launch alone) with the plugins
# in build/ab/VARIANT (through DSPARKJAX_LIB_DIR), with the extra flag --FLAG=VALUE where given (e.g.
# mma+mma=off: one build's matvec routes), and prints its table. A variant whose Python side differs from
# the working tree's (another FFI signature) carries its own dsparkjax/ and scripts/ in build/ab/VARIANT/src.
# Variants run in the order given within one call, so their numbers share a GPU (machines differ between
# calls): put the baseline first.
#
#   cmake -S . -B /tmp/b -DDSPARKJAX_CUDA=ON -DCMAKE_BUILD_TYPE=Release -DXLA_FFI_INCLUDE_DIR=<jaxlib include>
#   cmake --build /tmp/b -j2 && mkdir -p build/ab/new && cp /tmp/b/libdspark_*.so build/ab/new/    (per variant)
#   bash scripts/ab_kernels.sh base:Q8_0,IQ2_XXS:1,4 new:Q8_0,IQ2_XXS:1,4     (device; carry build/ab and .whl)
#
# Expects the gguf wheel in .whl/; each spec's ncu log, calls and table go to $OUT/<spec number>_<variant>.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/dsparkjax-out}"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1
date -u
n=0
for spec in "$@"; do
  IFS=: read -r v formats t_rows shapes <<< "$spec"
  setting=""; [[ "$v" == *+* ]] && { setting="${v#*+}"; v="${v%%+*}"; }
  n=$((n + 1)); o="$OUT/${n}_$v"; mkdir -p "$o"
  src="$PWD"; [[ -d "build/ab/$v/src" ]] && src="$PWD/build/ab/$v/src"
  PYTHONPATH="/tmp/site:$src" DSPARKJAX_LIB_DIR="$PWD/build/ab/$v" ncu --clock-control none \
    -k regex:'qmatmul|qmma|loop_add_fusion' --metrics gpu__time_duration.sum --csv --log-file "$o/d.csv" \
    python3 "$src/scripts/profile_kernel.py" --formats="$formats" --t_rows="$t_rows" ${shapes:+--shapes=$shapes} \
    --copy_mib=1024 --configs_out="$o/c.json" ${setting:+--$setting} > "$o/log.txt" 2>&1 || tail -5 "$o/log.txt"
  echo "== $v${setting:+ $setting} $formats T=$t_rows${shapes:+ $shapes}"
  PYTHONPATH="/tmp/site:$src" python3 "$src/scripts/profile_kernel.py" --table_from="$o/d.csv" \
    --configs_in="$o/c.json" | tee "$o/table.txt"
  date -u
done
