// GPU (CUDA, and HIP through gpu_vendor.h) FFI handlers: packed quantized matmul, MoE matmul by expert id,
// mHC pre/post. Handlers only launch kernels on XLA's stream (no allocation, no sync): kCmdBufferCompatible.
//
// Packed matmul layout: a CTA of kWarps warps owns (kWarps/S)*R rows; each warp serves R rows (R = 1, 2, 4,
// chosen per call to fill the GPU) and one of S slices of K (S depends on K only). Per K chunk (1024
// weights) a warp stages its R rows' chunks into shared memory with unrolled 16- or 4-byte loads (all
// issued before the first store), then each lane decodes 4 groups of 8 weights per row (Q8_0 and IQ2_XXS
// with word reads, byte permutes and shared-memory tables; other formats with decode8 from quant_formats.h)
// and multiplies them with up to 8 token columns, whose activations are loaded once for the R rows. Each
// lane accumulates in a fixed order with explicit fp32 intrinsics, the warp reduces with a fixed butterfly,
// and the S slice partials are added in slice order: an output's arithmetic is the same whatever T, R, the
// token's position or the other tokens (batch invariance).
#include "gpu_vendor.h"  // first: the HIP runtime header defines __host__/__device__ for the shared headers

#include <cstdint>
#include <type_traits>

#include "ffi_common.h"
#include "hc_math.h"

namespace dspark {
namespace {

constexpr int kLanes = 32;
constexpr int kWarps = 8;
constexpr int kMaxCols = 8;
constexpr int kGroupsPerLane = 4;
constexpr int kChunkGroups = kLanes * kGroupsPerLane;  // groups of 8 weights per chunk (1024 weights)
constexpr int kTargetCtas = 2 * 132;                   // fewer rows per warp below this many CTAs (2 per H200 SM)
constexpr int kSmemBudget = 44 * 1024;                 // static shared memory for the staged weight chunks
constexpr int kMinCtas = 2;                            // resident CTAs per SM the register use must allow

template <class Fmt>
constexpr int kChunkBytes = kChunkGroups * 8 / Fmt::kBlock * Fmt::kBytes;
// Shared-memory stride of one staged row chunk: 16-byte aligned, with >= 4 bytes of slack for the
// word-wise decoders below (they may read up to 4 bytes past a chunk's last block; those bytes are unused).
template <class Fmt>
constexpr int kRegion = (kChunkBytes<Fmt> + 4 + 15) / 16 * 16;
template <class Fmt>
constexpr bool kFastFormat = std::is_same<Fmt, FmtQ8_0>::value || std::is_same<Fmt, FmtIQ2_XXS>::value;
// Largest rows-per-warp (1, 2, 4) whose staging buffers fit the budget; other formats than the fast ones use 1
// (fewer kernel instantiations, so the plugin builds in a few minutes).
// Q8_0 stops at 2: its 4-row staging needs ~48 more registers, and kMinCtas CTAs per SM cap them at 128.
template <class Fmt>
constexpr int kMaxRowsFor = !kFastFormat<Fmt> ? 1
                            : std::is_same<Fmt, FmtIQ2_XXS>::value && kWarps * 4 * kRegion<Fmt> <= kSmemBudget ? 4
                            : kWarps * 2 * kRegion<Fmt> <= kSmemBudget ? 2 : 1;

// 8 consecutive activations as float (p is 16-byte aligned: K is a multiple of 8).
__device__ __forceinline__ void load8(const float* p, float v[8]) {
  const float4 a = __ldg(reinterpret_cast<const float4*>(p)), b = __ldg(reinterpret_cast<const float4*>(p) + 1);
  v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}
__device__ __forceinline__ void load8(const bf16_t* p, float v[8]) {
  const uint4 a = __ldg(reinterpret_cast<const uint4*>(p));
  const uint32_t u[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[2 * i] = bits_to_float(u[i] << 16);
    v[2 * i + 1] = bits_to_float(u[i] & 0xFFFF0000u);
  }
}

// ---- IQ2_XXS lookup tables in shared memory (filled once per CTA) ----
template <class Fmt>
constexpr int kGridFloats = std::is_same<Fmt, FmtIQ2_XXS>::value ? 256 * 8 : 4;
template <class Fmt>
constexpr int kSignWords = std::is_same<Fmt, FmtIQ2_XXS>::value ? 128 * 8 : 4;

// grid[e*8 + j] = magnitude j of grid entry e (as float); sgn[i*8 + j] = sign bit (bit 31) of element j
// for the 7 stored sign bits i (the 8th from parity, iq2_sign_byte).
template <class Fmt>
__device__ __forceinline__ void init_tables(float* grid, uint32_t* sgn) {
  if constexpr (std::is_same<Fmt, FmtIQ2_XXS>::value) {
    for (int e = threadIdx.x; e < 256; e += blockDim.x) {
      const uint64_t g = kIq2xxsGridDevice[e];
      float4 a, b;
      a.x = (float)(uint32_t)(g & 0xFF); a.y = (float)(uint32_t)((g >> 8) & 0xFF);
      a.z = (float)(uint32_t)((g >> 16) & 0xFF); a.w = (float)(uint32_t)((g >> 24) & 0xFF);
      b.x = (float)(uint32_t)((g >> 32) & 0xFF); b.y = (float)(uint32_t)((g >> 40) & 0xFF);
      b.z = (float)(uint32_t)((g >> 48) & 0xFF); b.w = (float)(uint32_t)((g >> 56) & 0xFF);
      reinterpret_cast<float4*>(grid)[2 * e] = a;
      reinterpret_cast<float4*>(grid)[2 * e + 1] = b;
    }
    for (int i = threadIdx.x; i < 128; i += blockDim.x) {
      const uint32_t s = iq2_sign_byte((uint32_t)i);
      uint4 a, b;
      a.x = (s & 1u) << 31; a.y = ((s >> 1) & 1u) << 31; a.z = ((s >> 2) & 1u) << 31; a.w = ((s >> 3) & 1u) << 31;
      b.x = ((s >> 4) & 1u) << 31; b.y = ((s >> 5) & 1u) << 31; b.z = ((s >> 6) & 1u) << 31; b.w = (s >> 7) << 31;
      reinterpret_cast<uint4*>(sgn)[2 * i] = a;
      reinterpret_cast<uint4*>(sgn)[2 * i + 1] = b;
    }
    __syncthreads();
  }
}

// ---- group decoders: the 8 weights of group gl (0..127) of a staged chunk ----
// Generic: w = the exact weights (Fmt::decode8), accumulated one by one (kScaled = false).
// Fast formats: w = the weights divided by the group scale, which decode returns (kScaled = true); the group's
// dot product is then scaled once. Same products in a different rounding order (the tests' bound).
template <class Fmt>
struct Dec {
  static constexpr bool kScaled = false;
  __device__ __forceinline__ static float group(const uint8_t* chunk, int gl, float w[8], const float*, const uint32_t*) {
    constexpr int kGroupsPerBlock = Fmt::kBlock / 8;
    Fmt::decode8(chunk + (gl / kGroupsPerBlock) * Fmt::kBytes, gl % kGroupsPerBlock, w);
    return 1.0f;
  }
};

// int8 byte j of `u` (already xor 0x80: u = q + 128) as float q, exactly: 2^23 + u built with one byte
// permute, minus 2^23 + 128.
template <int j>
__device__ __forceinline__ float q8_at(uint32_t u) {
  return __fsub_rn(__uint_as_float(__byte_perm(u, 0x4Bu, 0x4550u | j)), 8388736.0f);
}

template <>
struct Dec<FmtQ8_0> {  // half d @0; int8 qs[32] @2; 34-byte blocks, so chunk offsets are 2-byte aligned
  static constexpr bool kScaled = true;
  __device__ __forceinline__ static float group(const uint8_t* chunk, int gl, float w[8], const float*, const uint32_t*) {
    const int bi = gl >> 2, g = gl & 3;
    const uint32_t boff = (uint32_t)bi * 34u;
    const float d = __half2float(__ushort_as_half(*reinterpret_cast<const uint16_t*>(chunk + boff)));
    const uint32_t off = boff + 2u + 8u * (uint32_t)g;
    const uint32_t* wp = reinterpret_cast<const uint32_t*>(chunk + (off & ~3u));
    const uint32_t sh = (off & 3u) * 8u;
    const uint32_t w0 = wp[0], w1 = wp[1], w2 = wp[2];
    const uint32_t lo = __funnelshift_r(w0, w1, sh) ^ 0x80808080u, hi = __funnelshift_r(w1, w2, sh) ^ 0x80808080u;
    w[0] = q8_at<0>(lo); w[1] = q8_at<1>(lo); w[2] = q8_at<2>(lo); w[3] = q8_at<3>(lo);
    w[4] = q8_at<0>(hi); w[5] = q8_at<1>(hi); w[6] = q8_at<2>(hi); w[7] = q8_at<3>(hi);
    return d;
  }
};

template <>
struct Dec<FmtIQ2_XXS> {  // half d @0; 8 x (u8 grid idx[4], u32 signs/scale) @2; 66-byte blocks
  static constexpr bool kScaled = true;
  __device__ __forceinline__ static float group(const uint8_t* chunk, int gl, float w[8], const float* grid,
                                                const uint32_t* sgn) {
    const int bi = gl >> 5, g = gl & 31, ib32 = g >> 2, l = g & 3;
    const uint8_t* blk = chunk + bi * 66;
    const uint8_t* q = blk + 2 + 8 * ib32;  // 2-byte aligned
    const uint16_t* q16 = reinterpret_cast<const uint16_t*>(q);
    const uint32_t a1 = (uint32_t)q16[2] | ((uint32_t)q16[3] << 16);
    const float d = __half2float(__ushort_as_half(*reinterpret_cast<const uint16_t*>(blk)));
    const float db = __fmul_rn(__fmul_rn(d, __fadd_rn(0.5f, (float)(a1 >> 28))), 0.25f);
    const float4* gt = reinterpret_cast<const float4*>(grid) + 2 * q[l];
    const uint4* st = reinterpret_cast<const uint4*>(sgn) + 2 * ((a1 >> (7 * l)) & 127u);
    const float4 g0 = gt[0], g1 = gt[1];
    const uint4 s0 = st[0], s1 = st[1];
    w[0] = __uint_as_float(__float_as_uint(g0.x) ^ s0.x); w[1] = __uint_as_float(__float_as_uint(g0.y) ^ s0.y);
    w[2] = __uint_as_float(__float_as_uint(g0.z) ^ s0.z); w[3] = __uint_as_float(__float_as_uint(g0.w) ^ s0.w);
    w[4] = __uint_as_float(__float_as_uint(g1.x) ^ s1.x); w[5] = __uint_as_float(__float_as_uint(g1.y) ^ s1.y);
    w[6] = __uint_as_float(__float_as_uint(g1.z) ^ s1.z); w[7] = __uint_as_float(__float_as_uint(g1.w) ^ s1.w);
    return db;
  }
};

// Copies the chunks of nrows <= R rows (row r at src + r*row_bytes, len <= CB bytes) into shared memory
// (row r at dst + r*RS). Full chunks use unrolled 16- or 4-byte loads, all issued before the first store,
// so each lane has R*ceil(CB/512) loads in flight; `align` is the guaranteed alignment of every chunk start.
template <int CB, int R, class V>
__device__ __forceinline__ void stage_words(uint8_t* dst, int RS, const uint8_t* src, int64_t row_bytes, int nrows,
                                            int lane) {
  constexpr int kWords = CB / (int)sizeof(V), kIters = (kWords + kLanes - 1) / kLanes;
  V r[R][kIters];
#pragma unroll
  for (int rr = 0; rr < R; ++rr)
#pragma unroll
    for (int i = 0; i < kIters; ++i)
      if (rr < nrows && i * kLanes + lane < kWords)
        r[rr][i] = __ldg(reinterpret_cast<const V*>(src + rr * row_bytes) + i * kLanes + lane);
#pragma unroll
  for (int rr = 0; rr < R; ++rr)
#pragma unroll
    for (int i = 0; i < kIters; ++i)
      if (rr < nrows && i * kLanes + lane < kWords) reinterpret_cast<V*>(dst + rr * RS)[i * kLanes + lane] = r[rr][i];
}

template <int CB, int R>
__device__ __forceinline__ void stage(uint8_t* dst, int RS, const uint8_t* src, int64_t row_bytes, int nrows, int len,
                                      int align, int lane) {
  if (len == CB && align == 16) {
    stage_words<CB, R, uint4>(dst, RS, src, row_bytes, nrows, lane);
  } else if (len == CB && align == 4) {
    stage_words<CB, R, uint32_t>(dst, RS, src, row_bytes, nrows, lane);
  } else {
    for (int rr = 0; rr < nrows; ++rr)
      for (int i = lane; i < len; i += kLanes) dst[rr * RS + i] = __ldg(src + rr * row_bytes + i);
  }
}

// Alignment of every chunk start of the rows of w: 16, 4 or 1 bytes.
template <int CB>
__device__ __forceinline__ int chunk_align(const uint8_t* w, int64_t row_bytes) {
  const uintptr_t base = reinterpret_cast<uintptr_t>(w);
  if (CB % 16 == 0 && row_bytes % 16 == 0 && base % 16 == 0) return 16;
  if (CB % 4 == 0 && row_bytes % 4 == 0 && base % 4 == 0) return 4;
  return 1;
}

struct ColTable {  // the token columns of one CTA pass
  int ncols;
  int x_row[kMaxCols];  // token index into x
  int y_row[kMaxCols];  // output row index (t for dense, t*k+j for MoE)
};

// A CTA owns rows [row0, row0 + (kWarps/S)*R): warp v serves the R rows starting at row0 + (v/S)*R, K slice
// v%S (chunks v%S, v%S+S, ...). Each lane accumulates its groups (chunk order, then group order) for each row
// and column in one register, with the same fp32 operations whatever R, NC or the other columns; then a fixed
// butterfly over the lanes, then the S slice partials in slice order. S depends on K only: batch invariance.
template <class Fmt, class XT, int NC, int R>
__device__ void rows_times_cols(const uint8_t* w, int64_t N, int64_t K, int64_t row_bytes, int S, int64_t row0,
                                const XT* x, float* y, const ColTable& cols, uint8_t* smem, float* partial,
                                const float* grid, const uint32_t* sgn) {
  using D = Dec<Fmt>;
  constexpr int CB = kChunkBytes<Fmt>, RS = kRegion<Fmt>;
  const int warp = threadIdx.x / kLanes, lane = threadIdx.x % kLanes;
  const int64_t n0 = row0 + (int64_t)(warp / S) * R;
  const int slice = warp % S;
  const int64_t ngroups = K / 8, nchunks = (ngroups + kChunkGroups - 1) / kChunkGroups;
  const int nrows = (int)(N - n0 < 0 ? 0 : (N - n0 < R ? N - n0 : R));
  uint8_t* sm = smem + warp * R * RS;
  float acc[R][NC];
#pragma unroll
  for (int rr = 0; rr < R; ++rr)
#pragma unroll
    for (int c = 0; c < NC; ++c) acc[rr][c] = 0.0f;
  if (nrows > 0) {
    const uint8_t* rows = w + n0 * row_bytes;
    const int align = chunk_align<CB>(w, row_bytes);
    for (int64_t ch = slice; ch < nchunks; ch += S) {
      const int64_t off = ch * CB;
      const int len = (int)(row_bytes - off < CB ? row_bytes - off : CB);
      gpu_syncwarp();
      stage<CB, R>(sm, RS, rows + off, row_bytes, nrows, len, align, lane);
      gpu_syncwarp();
#pragma unroll
      for (int r = 0; r < kGroupsPerLane; ++r) {
        const int gl = r * kLanes + lane;
        const int64_t gi = ch * kChunkGroups + gl;
        if (gi < ngroups) {
          float wv[R][8], sc[R];
#pragma unroll
          for (int rr = 0; rr < R; ++rr)
            if (rr < nrows) sc[rr] = D::group(sm + rr * RS, gl, wv[rr], grid, sgn);
#pragma unroll
          for (int c = 0; c < NC; ++c) {
            if (c < cols.ncols) {
              float xv[8];
              load8(x + (int64_t)cols.x_row[c] * K + gi * 8, xv);
#pragma unroll
              for (int rr = 0; rr < R; ++rr) {
                if (rr < nrows) {
                  if constexpr (D::kScaled) {
                    float s = __fmul_rn(wv[rr][0], xv[0]);
#pragma unroll
                    for (int j = 1; j < 8; ++j) s = __fmaf_rn(wv[rr][j], xv[j], s);
                    acc[rr][c] = __fmaf_rn(sc[rr], s, acc[rr][c]);
                  } else {
#pragma unroll
                    for (int j = 0; j < 8; ++j) acc[rr][c] = __fmaf_rn(wv[rr][j], xv[j], acc[rr][c]);
                  }
                }
              }
            }
          }
        }
      }
    }
  }
#pragma unroll
  for (int rr = 0; rr < R; ++rr)
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      float a = acc[rr][c];
      for (int m = kLanes / 2; m > 0; m >>= 1) a = __fadd_rn(a, gpu_shfl_xor(a, m));
      if (lane == 0) partial[(warp * R + rr) * kMaxCols + c] = a;
    }
  __syncthreads();
  const int rows_cta = (kWarps / S) * R;
  if (threadIdx.x < rows_cta * cols.ncols) {
    const int rl = threadIdx.x / cols.ncols, c = threadIdx.x % cols.ncols;
    const int grp = rl / R, rr = rl % R;
    const int64_t nn = row0 + rl;
    if (nn < N) {
      float s = partial[((grp * S) * R + rr) * kMaxCols + c];
      for (int sl = 1; sl < S; ++sl) s = __fadd_rn(s, partial[((grp * S + sl) * R + rr) * kMaxCols + c]);
      y[(int64_t)cols.y_row[c] * N + nn] = s;
    }
  }
  __syncthreads();
}

template <class Fmt, class XT, int NC, int R>
__global__ void __launch_bounds__(kWarps * kLanes, kMinCtas) qmatmul_kernel(const uint8_t* __restrict__ w, const XT* __restrict__ x,
                                                                  float* __restrict__ y, int64_t T, int64_t N, int64_t K,
                                                                  int64_t row_bytes, int S) {
  __shared__ __align__(16) uint8_t smem[kWarps * R * kRegion<Fmt>];
  __shared__ float partial[kWarps * R * kMaxCols];
  __shared__ __align__(16) float grid[kGridFloats<Fmt>];
  __shared__ __align__(16) uint32_t sgn[kSignWords<Fmt>];
  init_tables<Fmt>(grid, sgn);
  ColTable cols;
  const int64_t t0 = (int64_t)blockIdx.y * kMaxCols;
  cols.ncols = (int)(T - t0 < kMaxCols ? T - t0 : kMaxCols);
  for (int c = 0; c < kMaxCols; ++c) cols.x_row[c] = cols.y_row[c] = (int)(t0 + (c < cols.ncols ? c : 0));
  rows_times_cols<Fmt, XT, NC, R>(w, N, K, row_bytes, S, (int64_t)blockIdx.x * ((kWarps / S) * R), x, y, cols, smem,
                                  partial, grid, sgn);
}

// MoE: CTA (row tile, slot p) serves expert ids[p] only if p is that expert's first slot, then loops over all
// slots choosing it, 8 at a time: each selected expert's rows are read once per call.
template <class Fmt, class XT, int R>
__global__ void __launch_bounds__(kWarps * kLanes, kMinCtas) qmatmul_id_kernel(const uint8_t* __restrict__ w, const XT* __restrict__ x,
                                                                     const int32_t* __restrict__ ids, float* __restrict__ y,
                                                                     int64_t E, int64_t N, int64_t K, int64_t row_bytes,
                                                                     int topk, int P, int S) {
  __shared__ __align__(16) uint8_t smem[kWarps * R * kRegion<Fmt>];
  __shared__ float partial[kWarps * R * kMaxCols];
  __shared__ __align__(16) float grid[kGridFloats<Fmt>];
  __shared__ __align__(16) uint32_t sgn[kSignWords<Fmt>];
  __shared__ ColTable s_cols;
  __shared__ int s_next;
  const int p = blockIdx.y;
  const int32_t e = ids[p];
  for (int q = 0; q < p; ++q)
    if (ids[q] == e) return;  // an earlier slot's CTA serves this expert
  init_tables<Fmt>(grid, sgn);
  const int rows_cta = (kWarps / S) * R;
  const int64_t row0 = (int64_t)blockIdx.x * rows_cta;
  const bool valid = e >= 0 && e < E;
  const uint8_t* we = w + (valid ? e : 0) * N * row_bytes;
  for (int start = p; start < P;) {
    if (threadIdx.x == 0) {
      int nc = 0, q = start;
      for (; q < P && nc < kMaxCols; ++q)
        if (ids[q] == e) {
          s_cols.x_row[nc] = q / topk;
          s_cols.y_row[nc] = q;
          ++nc;
        }
      s_cols.ncols = nc;
      s_next = q;
    }
    __syncthreads();
    const ColTable cols = s_cols;
    start = s_next;
    __syncthreads();
    if (cols.ncols == 0) break;
    if (!valid) {
      for (int i = threadIdx.x; i < cols.ncols * rows_cta; i += blockDim.x) {
        const int64_t nn = row0 + i / cols.ncols;
        if (nn < N) y[(int64_t)cols.y_row[i % cols.ncols] * N + nn] = 0.0f;
      }
    } else if (cols.ncols == 1) {
      rows_times_cols<Fmt, XT, 1, R>(we, N, K, row_bytes, S, row0, x, y, cols, smem, partial, grid, sgn);
    } else if (cols.ncols == 2) {
      rows_times_cols<Fmt, XT, 2, R>(we, N, K, row_bytes, S, row0, x, y, cols, smem, partial, grid, sgn);
    } else if (cols.ncols <= 4) {
      rows_times_cols<Fmt, XT, 4, R>(we, N, K, row_bytes, S, row0, x, y, cols, smem, partial, grid, sgn);
    } else {
      rows_times_cols<Fmt, XT, 8, R>(we, N, K, row_bytes, S, row0, x, y, cols, smem, partial, grid, sgn);
    }
  }
}

// Warps per row: enough K chunks per warp to keep all warps busy, a function of K only (batch invariance).
int k_split(int64_t K) {
  const int64_t nchunks = (K / 8 + kChunkGroups - 1) / kChunkGroups;
  int s = 1;
  while (s < kWarps && 2 * s <= nchunks) s *= 2;
  return s;
}

// Rows per warp: the largest R <= rmax that still gives kTargetCtas CTAs. R only changes which rows share a
// warp (and its activation loads), never an output's arithmetic, so it may depend on T.
int pick_rows(int64_t N, int S, int64_t tiles, int rmax) {
  int R = rmax;
  while (R > 1 && (N + (kWarps / S) * R - 1) / ((kWarps / S) * R) * tiles < kTargetCtas) R /= 2;
  return R;
}

// Calls f(std::integral_constant<int, R>) for R in {1, 2, 4}, R <= kMaxRowsFor<Fmt>.
template <class Fmt, class F>
void visit_rows(int R, F&& f) {
  constexpr int M = kMaxRowsFor<Fmt>;
  if constexpr (M >= 4) {
    if (R >= 4) return f(std::integral_constant<int, 4>{});
  }
  if constexpr (M >= 2) {
    if (R >= 2) return f(std::integral_constant<int, 2>{});
  }
  f(std::integral_constant<int, 1>{});
}

ffi::Error launch_error() {
  const gpuError_t err = gpuGetLastError();
  if (err != gpuSuccess) return ffi::Error::Internal(std::string("dsparkjax kernel launch: ") + gpuGetErrorString(err));
  return ffi::Error::Success();
}

template <class XT>
void launch_qmatmul(gpuStream_t stream, const QDims& d, int32_t type, const uint8_t* w, const void* x, float* y) {
  const int S = k_split(d.K);
  const int64_t tiles = (d.T + kMaxCols - 1) / kMaxCols;
  const auto* xp = static_cast<const XT*>(x);
  visit_format(type, [&](auto fmt) {
    using Fmt = decltype(fmt);
    visit_rows<Fmt>(pick_rows(d.N, S, tiles, kMaxRowsFor<Fmt>), [&](auto rc) {
      constexpr int R = decltype(rc)::value;
      const dim3 grid((unsigned)((d.N + (kWarps / S) * R - 1) / ((kWarps / S) * R)), (unsigned)tiles);
      if (d.T == 1) qmatmul_kernel<Fmt, XT, 1, R><<<grid, kWarps * kLanes, 0, stream>>>(w, xp, y, d.T, d.N, d.K, d.row_bytes, S);
      else if (d.T == 2) qmatmul_kernel<Fmt, XT, 2, R><<<grid, kWarps * kLanes, 0, stream>>>(w, xp, y, d.T, d.N, d.K, d.row_bytes, S);
      else if (d.T <= 4) qmatmul_kernel<Fmt, XT, 4, R><<<grid, kWarps * kLanes, 0, stream>>>(w, xp, y, d.T, d.N, d.K, d.row_bytes, S);
      else qmatmul_kernel<Fmt, XT, 8, R><<<grid, kWarps * kLanes, 0, stream>>>(w, xp, y, d.T, d.N, d.K, d.row_bytes, S);
    });
  });
}

ffi::Error QMatmulGpu(gpuStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> y,
                      int32_t ggml_type) {
  QDims d;
  if (auto e = check_qdims(x, w, ggml_type, false, &d); e.failure()) return e;
  if (d.T == 0 || d.N == 0) return ffi::Error::Success();
  const auto* wp = static_cast<const uint8_t*>(w.untyped_data());
  auto* yp = static_cast<float*>(y->untyped_data());
  if (x.element_type() == ffi::DataType::BF16) launch_qmatmul<bf16_t>(stream, d, ggml_type, wp, x.untyped_data(), yp);
  else launch_qmatmul<float>(stream, d, ggml_type, wp, x.untyped_data(), yp);
  return launch_error();
}

template <class XT>
void launch_qmatmul_id(gpuStream_t stream, const QDims& d, int32_t type, const uint8_t* w, const void* x,
                       const int32_t* ids, float* y) {
  const int S = k_split(d.K);
  const int P = (int)(d.T * d.k);
  const auto* xp = static_cast<const XT*>(x);
  visit_format(type, [&](auto fmt) {
    using Fmt = decltype(fmt);
    visit_rows<Fmt>(pick_rows(d.N, S, P < 8 ? P : 8, kMaxRowsFor<Fmt>), [&](auto rc) {
      constexpr int R = decltype(rc)::value;
      const dim3 grid((unsigned)((d.N + (kWarps / S) * R - 1) / ((kWarps / S) * R)), (unsigned)P);
      qmatmul_id_kernel<Fmt, XT, R><<<grid, kWarps * kLanes, 0, stream>>>(w, xp, ids, y, d.E, d.N, d.K, d.row_bytes,
                                                                          (int)d.k, P, S);
    });
  });
}

ffi::Error QMatmulIdGpu(gpuStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer ids,
                        ffi::Result<ffi::AnyBuffer> y, int32_t ggml_type) {
  QDims d;
  if (auto e = check_qdims(x, w, ggml_type, true, &d); e.failure()) return e;
  if (auto e = check_ids(ids, &d); e.failure()) return e;
  if (d.T * d.k > 65535) return arg_error("qmatmul_id: T*k must be <= 65535");
  if (d.T == 0 || d.k == 0 || d.N == 0) return ffi::Error::Success();
  const auto* wp = static_cast<const uint8_t*>(w.untyped_data());
  const auto* ip = static_cast<const int32_t*>(ids.untyped_data());
  auto* yp = static_cast<float*>(y->untyped_data());
  if (x.element_type() == ffi::DataType::BF16) launch_qmatmul_id<bf16_t>(stream, d, ggml_type, wp, x.untyped_data(), ip, yp);
  else launch_qmatmul_id<float>(stream, d, ggml_type, wp, x.untyped_data(), ip, yp);
  return launch_error();
}

// ---- mHC ----
constexpr int kHcThreads = 256;

// Fixed-order block sum (butterfly in each warp, then warps in order); every thread gets the result.
__device__ float block_sum(float v, float* scratch) {
  for (int m = kLanes / 2; m > 0; m >>= 1) v += gpu_shfl_xor(v, m);
  if (threadIdx.x % kLanes == 0) scratch[threadIdx.x / kLanes] = v;
  __syncthreads();
  float s = scratch[0];
  for (int i = 1; i < kHcThreads / kLanes; ++i) s += scratch[i];
  __syncthreads();
  return s;
}

// grid (M, T): mix[t, m] = (flat_t · fn[m]) · rsqrt(mean(flat_t²) + norm_eps).
template <class XT, class FT>
__global__ void __launch_bounds__(kHcThreads) hc_mix_kernel(const XT* __restrict__ x, const FT* __restrict__ fn,
                                                            float* __restrict__ mix, int64_t F, int M, float norm_eps) {
  __shared__ float scratch[kHcThreads / kLanes];
  const int m = blockIdx.x;
  const int64_t t = blockIdx.y;
  const XT* xt = x + t * F;
  const FT* fr = fn + (int64_t)m * F;
  float dot = 0.0f, sq = 0.0f;
  for (int64_t i = threadIdx.x; i < F; i += kHcThreads) {
    const float v = to_float(xt[i]);
    dot = __fmaf_rn(v, to_float(fr[i]), dot);
    sq = __fmaf_rn(v, v, sq);
  }
  dot = block_sum(dot, scratch);
  sq = block_sum(sq, scratch);
  if (threadIdx.x == 0) mix[t * M + m] = dot * (1.0f / sqrtf(sq / (float)F + norm_eps));
}

// grid (ceil(D/256), T): gates + Sinkhorn (thread 0, into shared memory), then u[t, d] for this block's d.
template <class XT>
__global__ void __launch_bounds__(kHcThreads) hc_collapse_kernel(const XT* __restrict__ x, const float* __restrict__ mix,
                                                                 const float* __restrict__ base, const float* __restrict__ scale,
                                                                 float* __restrict__ u, float* __restrict__ post,
                                                                 float* __restrict__ comb, int n, int64_t D, int iters,
                                                                 float hc_eps) {
  __shared__ float s_pre[kMaxHc], s_post[kMaxHc], s_comb[kMaxHc * kMaxHc];
  const int64_t t = blockIdx.y;
  const int M = (2 + n) * n;
  if (threadIdx.x == 0) {
    hc_gates(mix + t * M, base, scale, n, iters, hc_eps, s_pre, s_post, s_comb);
    if (blockIdx.x == 0) {
      for (int j = 0; j < n; ++j) post[t * n + j] = s_post[j];
      for (int j = 0; j < n * n; ++j) comb[t * n * n + j] = s_comb[j];
    }
  }
  __syncthreads();
  const int64_t d = (int64_t)blockIdx.x * kHcThreads + threadIdx.x;
  if (d < D) u[t * D + d] = hc_collapse(x + t * n * D, s_pre, n, D, d);
}

template <class XT, class FT>
__global__ void __launch_bounds__(kHcThreads) hc_post_kernel(const FT* __restrict__ f, const XT* __restrict__ x,
                                                             const float* __restrict__ post, const float* __restrict__ comb,
                                                             float* __restrict__ out, int n, int64_t D) {
  const int64_t t = blockIdx.z;
  const int k = blockIdx.y;
  const int64_t d = (int64_t)blockIdx.x * kHcThreads + threadIdx.x;
  if (d < D)
    out[(t * n + k) * D + d] = hc_post_elem(f + t * D, x + t * n * D, post + t * n, comb + t * n * n, n, D, k, d);
}

ffi::Error HcPreGpu(gpuStream_t stream, ffi::AnyBuffer streams, ffi::AnyBuffer fn, ffi::AnyBuffer base,
                    ffi::AnyBuffer scale, ffi::Result<ffi::AnyBuffer> u, ffi::Result<ffi::AnyBuffer> post,
                    ffi::Result<ffi::AnyBuffer> comb, ffi::Result<ffi::AnyBuffer> mix, int32_t iters, float hc_eps,
                    float norm_eps) {
  HcDims d;
  if (auto e = check_hc_pre(streams, fn, base, scale, &d); e.failure()) return e;
  if (d.T == 0) return ffi::Error::Success();
  auto* mp = static_cast<float*>(mix->untyped_data());
  visit_float(streams.element_type(), [&](auto xt) {
    using XT = decltype(xt);
    const auto* xp = static_cast<const XT*>(streams.untyped_data());
    visit_float(fn.element_type(), [&](auto ft) {
      using FT = decltype(ft);
      hc_mix_kernel<XT, FT><<<dim3((unsigned)d.M, (unsigned)d.T), kHcThreads, 0, stream>>>(
          xp, static_cast<const FT*>(fn.untyped_data()), mp, d.n * d.D, (int)d.M, norm_eps);
    });
    hc_collapse_kernel<XT><<<dim3((unsigned)((d.D + kHcThreads - 1) / kHcThreads), (unsigned)d.T), kHcThreads, 0, stream>>>(
        xp, mp, static_cast<const float*>(base.untyped_data()), static_cast<const float*>(scale.untyped_data()),
        static_cast<float*>(u->untyped_data()), static_cast<float*>(post->untyped_data()),
        static_cast<float*>(comb->untyped_data()), (int)d.n, d.D, iters, hc_eps);
  });
  return launch_error();
}

ffi::Error HcPostGpu(gpuStream_t stream, ffi::AnyBuffer block_out, ffi::AnyBuffer streams, ffi::AnyBuffer post,
                     ffi::AnyBuffer comb, ffi::Result<ffi::AnyBuffer> out) {
  HcDims d;
  if (auto e = check_hc_post(block_out, streams, post, comb, &d); e.failure()) return e;
  if (d.T == 0) return ffi::Error::Success();
  visit_float(streams.element_type(), [&](auto xt) {
    using XT = decltype(xt);
    visit_float(block_out.element_type(), [&](auto ft) {
      using FT = decltype(ft);
      const dim3 grid((unsigned)((d.D + kHcThreads - 1) / kHcThreads), (unsigned)d.n, (unsigned)d.T);
      hc_post_kernel<XT, FT><<<grid, kHcThreads, 0, stream>>>(
          static_cast<const FT*>(block_out.untyped_data()), static_cast<const XT*>(streams.untyped_data()),
          static_cast<const float*>(post.untyped_data()), static_cast<const float*>(comb.untyped_data()),
          static_cast<float*>(out->untyped_data()), (int)d.n, d.D);
    });
  });
  return launch_error();
}

}  // namespace
}  // namespace dspark

namespace ffi = xla::ffi;
#define DSPARK_CAT2(a, b) a##b
#define DSPARK_CAT(a, b) DSPARK_CAT2(a, b)
#define DSPARK_GPU_SYMBOL(stem) DSPARK_CAT(stem, DSPARK_GPU_PLATFORM_SUFFIX)
#define DSPARK_EXPORT extern "C" __attribute__((visibility("default")))
#define DSPARK_GPU_BIND ffi::Ffi::Bind().Ctx<ffi::PlatformStream<gpuStream_t>>()

DSPARK_EXPORT XLA_FFI_Error* DSPARK_GPU_SYMBOL(DsparkQMatmul)(XLA_FFI_CallFrame*);
XLA_FFI_DEFINE_HANDLER_SYMBOL(DSPARK_GPU_SYMBOL(DsparkQMatmul), dspark::QMatmulGpu,
                              DSPARK_GPU_BIND.Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("ggml_type"),
                              {ffi::Traits::kCmdBufferCompatible});

DSPARK_EXPORT XLA_FFI_Error* DSPARK_GPU_SYMBOL(DsparkQMatmulId)(XLA_FFI_CallFrame*);
XLA_FFI_DEFINE_HANDLER_SYMBOL(DSPARK_GPU_SYMBOL(DsparkQMatmulId), dspark::QMatmulIdGpu,
                              DSPARK_GPU_BIND.Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>().Attr<int32_t>("ggml_type"),
                              {ffi::Traits::kCmdBufferCompatible});

DSPARK_EXPORT XLA_FFI_Error* DSPARK_GPU_SYMBOL(DsparkHcPre)(XLA_FFI_CallFrame*);
XLA_FFI_DEFINE_HANDLER_SYMBOL(DSPARK_GPU_SYMBOL(DsparkHcPre), dspark::HcPreGpu,
                              DSPARK_GPU_BIND.Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Attr<int32_t>("iters")
                                  .Attr<float>("hc_eps").Attr<float>("norm_eps"),
                              {ffi::Traits::kCmdBufferCompatible});

DSPARK_EXPORT XLA_FFI_Error* DSPARK_GPU_SYMBOL(DsparkHcPost)(XLA_FFI_CallFrame*);
XLA_FFI_DEFINE_HANDLER_SYMBOL(DSPARK_GPU_SYMBOL(DsparkHcPost), dspark::HcPostGpu,
                              DSPARK_GPU_BIND.Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>(),
                              {ffi::Traits::kCmdBufferCompatible});

DSPARK_DEFINE_API_VERSION
