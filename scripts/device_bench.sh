#!/usr/bin/env bash
# Issue 38's numbers in one device call (docs/bench.md): scripts/bench.py on DeepSeek-V4-Flash with random
# weights made on the GPU, then scripts/bench_load.py, the full-size sparse file loaded and run through the
# public API. 43 layers need an H200 (86.7 GB of weights: run with needs_h200); an 80 GB H100 takes 32.
#   bash scripts/device_bench.sh                          # 43 layers: both parts (about 9 minutes, estimated
#                                                         # before any GPU run: split with --sections if tight)
#   bash scripts/device_bench.sh --layers 32              # an H100's slice
#   bash scripts/device_bench.sh --sections load          # one part: bench or load
#   bash scripts/device_bench.sh --config tiny            # the CPU dry run (tiny model, no GPU)
#   bash scripts/device_bench.sh --layers 32 --sections load --load_workers 1,4,1,4   # serial vs prefetching loads
# --load_workers goes to bench_load.py (a list: one target load per entry, docs/bench.md). Any other argument goes
# to bench.py (e.g. --compile_threads 1, --measure steps,speculative).
# Results go to $OUT: <name>.json and bench.log from bench.py, <name>_load.json and load.log from the load run,
# where <name> is ds4_full_h200 for 43 layers on an H200 (what docs/bench/ holds), ds4_<N>layers_<gpu> otherwise.
# Expects the gguf wheel in .whl/ (carried) and takes carried plugins in dsparkjax/_lib (scripts/device_setup.sh).
# The compilation cache is build/dsparkjax-cache/xla (kept on a warm machine between calls): the load run's
# generate loads the programs bench.py's start-up compiled, and a second call starts warm. Set DSPARKJAX_COMMIT
# to the commit when the copied checkout has no .git.
set -uo pipefail
LAYERS=43 CONFIG=ds4 SECTIONS="bench load" EXTRA=() LOAD_EXTRA=()
while (($#)); do
  case "$1" in
    --layers) LAYERS="$2"; shift 2 ;;
    --config) CONFIG="$2"; shift 2 ;;
    --sections) SECTIONS="$2"; shift 2 ;;
    --load_workers) LOAD_EXTRA+=(--load_workers "$2"); shift 2 ;;
    *) EXTRA+=("$1"); shift ;;
  esac
done
want() { [[ " $SECTIONS " == *" $1 "* ]]; }
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/dsparkjax-out}"; mkdir -p "$OUT"
source scripts/device_setup.sh
export DSPARKJAX_CACHE="${DSPARKJAX_CACHE:-$PWD/build/dsparkjax-cache}"
if [[ "$CONFIG" == tiny ]]; then
  NAME=tiny MODEL=(--config tiny --layers 2)
else
  GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -oiE 'h[0-9]+' | tr 'A-Z' 'a-z')
  NAME="ds4_$([[ "$LAYERS" == 43 ]] && echo full || echo "${LAYERS}layers")_${GPU:-gpu}"
  MODEL=(--layers "$LAYERS")
fi
if want bench; then
  echo "== bench.py ${MODEL[*]} ${EXTRA[*]}"
  python3 scripts/bench.py "${MODEL[@]}" "${EXTRA[@]}" --json_out "$OUT/$NAME.json" > "$OUT/bench.log" 2>&1
  echo "exit $?"; grep -E "^(==|   [a-z_]+: [0-9.]+ s$|   compiled)" "$OUT/bench.log"
  sed -n '/^device /,$p' "$OUT/bench.log"
fi
if want load; then
  # On the checkout's disk, not /tmp, which may be a RAM-backed tmpfs: there the zero pages read would stay in memory.
  SPARSE="$PWD/build/dsparkjax-sparse"; mkdir -p "$SPARSE"; df -hT "$SPARSE" | tail -1
  echo "== bench_load.py ${MODEL[*]}: the sparse file, loaded and run"
  python3 scripts/bench_load.py "${MODEL[@]}" "${LOAD_EXTRA[@]}" --dir "$SPARSE" --json_out "$OUT/${NAME}_load.json" > "$OUT/load.log" 2>&1
  echo "exit $?"; grep -vE "^[IW][0-9]{4}|it/s\]|B/s\]" "$OUT/load.log" | tail -8
  rm -rf "$SPARSE"
fi
