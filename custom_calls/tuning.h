// Tuning thresholds of the GPU integer path: which kernel and launch shape a call takes. One table per decision,
// in the manner of llama.cpp's mmvq parameter tables; each entry's one-line reason links to the section of
// docs/kernels.md ("Tuning tables") that holds its measurements. Changing a value changes speed, never bits.
#pragma once

#include <cstdint>

namespace dspark::tuning {

// The tensor-core kernel against the matvec for a call of T tokens (docs/kernels.md#tuning-mma-crossover).
struct MmaCrossover {
  int64_t min_tokens_per_tile;  // its time is flat in a tile's tokens, the matvec's grows: it pays from here
  int64_t min_row_tiles;        // fewer 32-row tiles leave SMs idle that the matvec would use
  int64_t any_shape_tokens;     // from this many tokens it was faster on every measured shape
  int64_t long_k;               // below any_shape_tokens it pays only on rows this long...
  int64_t long_row_tiles;       // ...and this many row tiles
};
inline constexpr MmaCrossover kMmaCrossover{4, 48, 5, 4096, 64};

// Rows per group of a one-token dense call (docs/kernels.md#tuning-rows-per-group).
inline constexpr int kOneTokenMaxRows = 4;          // more rows share an activation load, up to the registers' room
inline constexpr int kOneTokenGroupsPerWarp = 2;    // but every resident warp keeps two groups to hide latency

// balanced_rows: a busiest warp may take this fraction more rows than with one row per group
// (docs/kernels.md#tuning-rows-per-group).
inline constexpr int64_t kBalanceSlackDivisor = 8;

// Passes over the weights a larger row group may add (docs/kernels.md#tuning-extra-passes).
inline constexpr int64_t kDenseExtraPasses = 1;  // a dense call's tiles run side by side: one more tile is cheap
inline constexpr int64_t kMoeExtraPasses = 0;    // the MoE kernel's passes run one after another

// MoE grid: expert-major when the slots exceed this many waves of resident CTAs and the experts fit one wave
// (docs/kernels.md#tuning-moe-grid).
inline constexpr int64_t kExpertMajorWaves = 2;

// The float path's MoE kernel in window mode (long runs of rows per expert, attention's `rowwise` products): its
// windows of slots no smaller than it takes to fill this many waves of resident CTAs, so an expert's rows are read
// again per window only where the device has room for it (docs/kernels.md#tuning-float-moe-windows).
inline constexpr int64_t kMoeWindowWaves = 2;

}  // namespace dspark::tuning
