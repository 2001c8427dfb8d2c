// GPU (CUDA, and HIP through gpu_vendor.h) FFI handlers: packed quantized matmul, MoE matmul by expert id,
// mHC pre/post. Handlers only launch kernels on XLA's stream (no allocation, no sync): kCmdBufferCompatible.
//
// Q8_0, Q2_K, Q4_K and IQ2_XXS, the formats of the published DS4 files, run on integer dot products against an
// int8-limb form of the activations (gpu_i8_matvec.cuh): that path streams weights at memory speed. The other
// formats, and the rare calls the integer path cannot take (rows not 4-byte aligned, or K so large that one
// token's activations do not fit in shared memory), use the generic float path below: a CTA of kWarps warps
// owns kWarps/S rows; each warp serves one row and one of S slices of K (S depends on K only). Per K chunk
// (1024 weights) a warp stages the row's chunk in shared memory, then each lane decodes 4 groups of 8 weights
// (decode8 of quant_formats.h) and multiplies them with up to 8 token columns. Each lane accumulates in a
// fixed order with explicit fp32 intrinsics, the warp reduces with a fixed butterfly (warp_sums), and the S
// slice partials are added in slice order: an output's arithmetic is the same whatever T, the token's
// position or the other tokens (batch invariance).
#include "gpu_vendor.h"  // first: the HIP runtime header defines __host__/__device__ for the shared headers

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "ffi_common.h"
#include "tuning.h"
#include "hc_math.h"
#include "i8_math.h"
#include "indexer_common.h"

namespace dspark {
namespace {

constexpr int kLanes = 32;
constexpr int kWarps = 8;
constexpr int kMaxCols = 8;
constexpr int kGroupsPerLane = 4;
constexpr int kChunkGroups = kLanes * kGroupsPerLane;  // groups of 8 weights per chunk (1024 weights)

template <class Fmt>
constexpr int kChunkBytes = kChunkGroups * 8 / Fmt::kBlock * Fmt::kBytes;

struct ColTable {  // the token columns of one CTA pass
  int ncols;
  int x_row[kMaxCols];  // token index into x
  int y_row[kMaxCols];  // output row index (t for dense, t*k+j for MoE)
};

// Calls f(std::integral_constant<int, NC>) with the column-count bucket NC (1, 2, 4 or 8) that holds n columns
// (1 <= n; n > kMaxCols gives 8): one kernel instantiation per bucket.
#if defined(__CUDACC__) && !defined(__HIPCC__)
#pragma nv_exec_check_disable
#endif
template <class F>
__host__ __device__ void visit_cols(int64_t n, F&& f) {
  if (n == 1) f(std::integral_constant<int, 1>{});
  else if (n == 2) f(std::integral_constant<int, 2>{});
  else if (n <= 4) f(std::integral_constant<int, 4>{});
  else f(std::integral_constant<int, 8>{});
}

// MoE: the next pass of (token, slot) columns choosing expert e, from slot *start on, at most max_cols, built
// by warp 0 in `shared`, 32 slots per step by vote; *start moves past them. Returns the column count (the same in
// every thread). The caller synchronises the CTA before the next pass overwrites the table.
__device__ int next_expert_cols(const int32_t* ids, int32_t e, int topk, int P, int max_cols, int* start,
                                ColTable* shared, int* shared_next) {
  if (threadIdx.x < kLanes) {
    const int lane = threadIdx.x;
    int nc = 0, q0 = *start;
    for (; q0 < P && nc < max_cols; q0 += kLanes) {
      const int q = q0 + lane;
      const bool hit = q < P && ids[q] == e;
      const uint32_t votes = gpu_ballot(hit);
      const int rank = nc + __popc(votes & ((1u << lane) - 1u));
      if (hit && rank < max_cols) {
        shared->x_row[rank] = q / topk;
        shared->y_row[rank] = q;
      }
      if (hit && rank == max_cols) *shared_next = q;  // the first choosing slot this pass leaves
      nc += __popc(votes);
    }
    if (lane == 0) {
      shared->ncols = min(nc, max_cols);
      if (nc <= max_cols) *shared_next = min(q0, P);
    }
  }
  __syncthreads();
  *start = *shared_next;
  return shared->ncols;
}

// MoE: whether slot p is the first slot from `from` on choosing its expert (the CTAs of later slots leave the
// expert to it). The lanes of each warp compare 32 earlier slots at once: a slot-by-slot loop made every CTA of a
// repeated slot wait on one dependent load per earlier slot before exiting, work growing as the square of the slots.
__device__ bool first_slot_of_expert(const int32_t* ids, int from, int p) {
  const int lane = threadIdx.x % kLanes;
  const int32_t e = ids[p];
  for (int q0 = from; q0 < p; q0 += kLanes)
    if (gpu_any(q0 + lane < p && ids[q0 + lane] == e)) return false;
  return true;
}

// MoE, window mode: the first slot of [from, end) whose bit in `done` (bit i: slot base + i) is clear, or `end`;
// found by warp 0, 32 slots per step, and returned to every thread of the CTA.
__device__ int next_unserved_slot(const uint32_t* done, int base, int from, int end, int* shared_next) {
  if (threadIdx.x < kLanes) {
    const int lane = threadIdx.x;
    int found = end;
    for (int q0 = from; q0 < end; q0 += kLanes) {
      const int i = q0 + lane - base;
      const uint32_t open = gpu_ballot(q0 + lane < end && !((done[i / 32] >> (i % 32)) & 1u));
      if (open != 0u) {
        found = q0 + __ffs((int)open) - 1;
        break;
      }
    }
    if (lane == 0) *shared_next = found;
  }
  __syncthreads();
  const int next = *shared_next;
  __syncthreads();  // every thread has read it before warp 0 writes the next one
  return next;
}

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

// Copies a chunk (len <= CB bytes) into shared memory: unrolled 16- or 4-byte loads when the chunk is whole and
// aligned (`align`: the guaranteed alignment of every chunk start), else bytes.
template <int CB, class V>
__device__ __forceinline__ void stage_words(uint8_t* dst, const uint8_t* src, int lane) {
  constexpr int kWords = CB / (int)sizeof(V), kIters = (kWords + kLanes - 1) / kLanes;
  V r[kIters];
#pragma unroll
  for (int i = 0; i < kIters; ++i)
    if (i * kLanes + lane < kWords) r[i] = __ldg(reinterpret_cast<const V*>(src) + i * kLanes + lane);
#pragma unroll
  for (int i = 0; i < kIters; ++i)
    if (i * kLanes + lane < kWords) reinterpret_cast<V*>(dst)[i * kLanes + lane] = r[i];
}

template <int CB>
__device__ __forceinline__ void stage(uint8_t* dst, const uint8_t* src, int len, int align, int lane) {
  if (len == CB && align == 16) stage_words<CB, uint4>(dst, src, lane);
  else if (len == CB && align == 4) stage_words<CB, uint32_t>(dst, src, lane);
  else
    for (int i = lane; i < len; i += kLanes) dst[i] = __ldg(src + i);
}

// Alignment of every chunk start of the rows of w: 16, 4 or 1 bytes.
template <int CB>
__device__ __forceinline__ int chunk_align(const uint8_t* w, int64_t row_bytes) {
  const uintptr_t base = reinterpret_cast<uintptr_t>(w);
  if (CB % 16 == 0 && row_bytes % 16 == 0 && base % 16 == 0) return 16;
  if (CB % 4 == 0 && row_bytes % 4 == 0 && base % 4 == 0) return 4;
  return 1;
}

// The warp sum of the N values v[0..N) of every lane, by the butterfly xor 16, 8, 4, 2, 1 (M is this step's
// mask), transposed: while a lane holds more than one value, each step sends half of them to the partner lane
// and keeps the sums of the other half, so N outputs take about N + 5 shuffles instead of 5·N. Every
// value still adds the same lanes in the same pairs (a + b == b + a in fp32), so each output has the plain
// butterfly's bits, whatever N. Returns this lane's sum; `index` gains its position in v (lane bits 4, 3, ...).
template <int N, int M = kLanes / 2>
__device__ __forceinline__ float warp_sums(float* v, int lane, int& index) {
  if constexpr (M == 0) {
    return v[0];
  } else if constexpr (N == 1) {
    v[0] = __fadd_rn(v[0], gpu_shfl_xor(v[0], M));
    return warp_sums<1, M / 2>(v, lane, index);
  } else {
    constexpr int H = N / 2;
    const bool upper = (lane & M) != 0;
#pragma unroll
    for (int i = 0; i < H; ++i) {
      const float send = upper ? v[i] : v[i + H], keep = upper ? v[i + H] : v[i];
      v[i] = __fadd_rn(keep, gpu_shfl_xor(send, M));
    }
    if (upper) index += H;
    return warp_sums<H, M / 2>(v, lane, index);
  }
}

// A CTA owns rows [row0, row0 + kWarps/S): warp v serves row row0 + v/S, K slice v%S (chunks v%S, v%S+S, ...).
// Each lane accumulates its groups (chunk order, then group order, then the 8 weights) for each column in one
// register; then a fixed butterfly over the lanes, then the S slice partials in slice order.
template <class Fmt, class XT, int NC>
__device__ void rows_times_cols(const uint8_t* w, int64_t N, int64_t K, int64_t row_bytes, int S, int64_t row0,
                                const XT* x, float* y, const ColTable& cols, uint8_t* smem, float* partial) {
  constexpr int CB = kChunkBytes<Fmt>, RS = (CB + 15) / 16 * 16, kGroupsPerBlock = Fmt::kBlock / 8;
  const int warp = threadIdx.x / kLanes, lane = threadIdx.x % kLanes;
  const int64_t n = row0 + warp / S;
  const int slice = warp % S;
  const int64_t ngroups = K / 8, nchunks = (ngroups + kChunkGroups - 1) / kChunkGroups;
  uint8_t* sm = smem + warp * RS;
  float acc[NC];
#pragma unroll
  for (int c = 0; c < NC; ++c) acc[c] = 0.0f;
  if (n < N) {
    const uint8_t* row = w + n * row_bytes;
    const int align = chunk_align<CB>(w, row_bytes);
    for (int64_t ch = slice; ch < nchunks; ch += S) {
      const int64_t off = ch * CB;
      const int len = (int)(row_bytes - off < CB ? row_bytes - off : CB);
      gpu_syncwarp();
      stage<CB>(sm, row + off, len, align, lane);
      gpu_syncwarp();
#pragma unroll
      for (int r = 0; r < kGroupsPerLane; ++r) {
        const int gl = r * kLanes + lane;
        const int64_t gi = ch * kChunkGroups + gl;
        if (gi < ngroups) {
          float wv[8];
          Fmt::decode8(sm + (gl / kGroupsPerBlock) * Fmt::kBytes, gl % kGroupsPerBlock, wv);
#pragma unroll
          for (int c = 0; c < NC; ++c) {
            if (c < cols.ncols) {
              float xv[8];
              load8(x + (int64_t)cols.x_row[c] * K + gi * 8, xv);
#pragma unroll
              for (int j = 0; j < 8; ++j) acc[c] = __fmaf_rn(wv[j], xv[j], acc[c]);
            }
          }
        }
      }
    }
  }
  int c = 0;
  const float sum = warp_sums<NC>(acc, lane, c);
  if ((lane & (kLanes / NC - 1)) == 0) partial[warp * kMaxCols + c] = sum;
  __syncthreads();
  const int rows_cta = kWarps / S;
  if (threadIdx.x < rows_cta * cols.ncols) {
    const int rl = threadIdx.x / cols.ncols, c = threadIdx.x % cols.ncols;
    const int64_t nn = row0 + rl;
    if (nn < N) {
      float s = partial[(rl * S) * kMaxCols + c];
      for (int sl = 1; sl < S; ++sl) s = __fadd_rn(s, partial[(rl * S + sl) * kMaxCols + c]);
      y[(int64_t)cols.y_row[c] * N + nn] = s;
    }
  }
  __syncthreads();
}

template <class Fmt, class XT, int NC>
__global__ void __launch_bounds__(kWarps * kLanes) qmatmul_kernel(const uint8_t* __restrict__ w, const XT* __restrict__ x,
                                                                  float* __restrict__ y, int64_t T, int64_t N, int64_t K,
                                                                  int64_t row_bytes, int S) {
  __shared__ __align__(16) uint8_t smem[kWarps * ((kChunkBytes<Fmt> + 15) / 16 * 16)];
  __shared__ float partial[kWarps * kMaxCols];
  ColTable cols;
  const int64_t t0 = (int64_t)blockIdx.y * kMaxCols;
  cols.ncols = (int)(T - t0 < kMaxCols ? T - t0 : kMaxCols);
  for (int c = 0; c < kMaxCols; ++c) cols.x_row[c] = cols.y_row[c] = (int)(t0 + (c < cols.ncols ? c : 0));
  rows_times_cols<Fmt, XT, NC>(w, N, K, row_bytes, S, (int64_t)blockIdx.x * (kWarps / S), x, y, cols, smem, partial);
}

// MoE: the slots of [start, end) choosing expert e times the CTA's rows [row0, row0 + kWarps/S), kMaxCols slots
// per pass (zero rows for an id outside [0, E)); `done`, if given (bit i: slot base + i), gets every served slot's
// bit set. Each column goes through rows_times_cols alone, so its bits do not depend on which
// pass, CTA or column position serves it.
template <class Fmt, class XT>
__device__ void serve_expert(const uint8_t* w, const XT* x, const int32_t* ids, float* y, int64_t E, int64_t N,
                             int64_t K, int64_t row_bytes, int topk, int S, int64_t row0, int32_t e, int start, int end,
                             uint32_t* done, int base, uint8_t* smem, float* partial, ColTable* s_cols, int* s_next) {
  const bool valid = e >= 0 && e < E;
  const uint8_t* we = w + (valid ? e : 0) * N * row_bytes;
  while (start < end) {
    if (next_expert_cols(ids, e, topk, end, kMaxCols, &start, s_cols, s_next) == 0) break;
    const ColTable cols = *s_cols;
    if (done != nullptr && (int)threadIdx.x < cols.ncols) {
      const int i = cols.y_row[threadIdx.x] - base;
      atomicOr(&done[i / 32], 1u << (i % 32));
    }
    if (!valid) {
      for (int i = threadIdx.x; i < cols.ncols * (kWarps / S); i += blockDim.x) {
        const int64_t nn = row0 + i / cols.ncols;
        if (nn < N) y[(int64_t)cols.y_row[i % cols.ncols] * N + nn] = 0.0f;
      }
    } else {
      visit_cols(cols.ncols, [&](auto nc) {
        rows_times_cols<Fmt, XT, decltype(nc)::value>(we, N, K, row_bytes, S, row0, x, y, cols, smem, partial);
      });
    }
    __syncthreads();  // the pass's columns are read before warp 0 builds the next table
  }
}

// Window mode's most slots per window (a bit per slot in shared memory marks the served ones).
constexpr int kMaxMoeWindow = 2048;

// MoE. The P slots are cut into windows of `window` consecutive slots; an expert's rows are read once per window
// that chooses it, and its slots there are served kMaxCols per pass (serve_expert), on CTAs (row tile, ...):
//   slot mode (per_slot, grid y = P): CTA (tile, p) serves expert ids[p] if p is its first slot in p's window,
//     and exits otherwise: experts served side by side, for slots choosing many different experts;
//   window mode (grid y = windows): CTA (tile, w) serves every expert of window w, in the order of their first
//     slots: the passes of one expert chosen by a long run of slots (attention's keys of a sequence, `rowwise`)
//     spread over the windows' CTAs instead of running one after another on one CTA.
// Which CTA serves a slot never changes its bits (serve_expert), so the launcher picks the layout for speed.
template <class Fmt, class XT>
__global__ void __launch_bounds__(kWarps * kLanes) qmatmul_id_kernel(const uint8_t* __restrict__ w, const XT* __restrict__ x,
                                                                     const int32_t* __restrict__ ids, float* __restrict__ y,
                                                                     int64_t E, int64_t N, int64_t K, int64_t row_bytes,
                                                                     int topk, int P, int S, int window, bool per_slot) {
  __shared__ __align__(16) uint8_t smem[kWarps * ((kChunkBytes<Fmt> + 15) / 16 * 16)];
  __shared__ float partial[kWarps * kMaxCols];
  __shared__ ColTable s_cols;
  __shared__ int s_next;
  __shared__ uint32_t s_done[kMaxMoeWindow / 32];
  const int64_t row0 = (int64_t)blockIdx.x * (kWarps / S);
  if (per_slot) {
    const int p = blockIdx.y, from = p / window * window;
    if (!first_slot_of_expert(ids, from, p)) return;
    serve_expert<Fmt, XT>(w, x, ids, y, E, N, K, row_bytes, topk, S, row0, ids[p], p, min(from + window, P), nullptr,
                          0, smem, partial, &s_cols, &s_next);
    return;
  }
  const int from = (int)blockIdx.y * window, end = min(from + window, P);
  for (int i = threadIdx.x; i < kMaxMoeWindow / 32; i += blockDim.x) s_done[i] = 0u;
  __syncthreads();
  for (int lead = from;;) {
    lead = next_unserved_slot(s_done, from, lead, end, &s_next);
    if (lead >= end) break;
    serve_expert<Fmt, XT>(w, x, ids, y, E, N, K, row_bytes, topk, S, row0, ids[lead], lead, end, s_done, from, smem,
                          partial, &s_cols, &s_next);
  }
}

// Warps per row: enough K chunks per warp to keep all warps busy, a function of K only (batch invariance).
int k_split(int64_t K) {
  const int64_t nchunks = (K / 8 + kChunkGroups - 1) / kChunkGroups;
  int s = 1;
  while (s < kWarps && 2 * s <= nchunks) s *= 2;
  return s;
}

constexpr int64_t kMaxGridYZ = 65535;  // CUDA's grid y and z extents: token tiles, slots and mHC token rows go there

// Calls launch(first_row, rows) over consecutive chunks of at most max_rows of a call's T rows, so that no launch's
// grid y exceeds kMaxGridYZ. Every kernel computes a row the same way whatever the row count of its call (batch
// invariance, tests/test_invariance.py), so the split changes no bits.
template <class F>
void for_row_chunks(int64_t T, int64_t max_rows, F&& launch) {
  for (int64_t t0 = 0; t0 < T; t0 += max_rows) launch(t0, std::min(max_rows, T - t0));
}

// The error of the last launch (or of any earlier GPU call of this thread), naming the op that reports it.
ffi::Error launch_error(const char* op) {
  const gpuError_t err = gpuGetLastError();
  if (err != gpuSuccess)
    return ffi::Error::Internal(std::string("dsparkjax kernel launch (") + op + "): " + gpuGetErrorString(err));
  return ffi::Error::Success();
}

#include "gpu_i8_matvec.cuh"  // namespace i8: the integer path (uses the constants and ColTable above)
#include "gpu_i8_mma.cuh"     // namespace i8: its tensor-core kernel for several tokens (CUDA)
#include "gpu_indexer.cuh"    // IndexerTopkGpu: the CSA indexer's top-k over each row's visible entries

template <class XT>
void launch_qmatmul(gpuStream_t stream, const QDims& d, int32_t type, MmaMode mma, const uint8_t* w, const void* x,
                    float* y) {
  if (i8math::visit_i8_format(type, [&](auto fmt) {
        return i8::launch_qmatmul<decltype(fmt)>(stream, d, mma, w, x, std::is_same_v<XT, bf16_t>, y);
      }))
    return;
  const auto* xp = static_cast<const XT*>(x);
  const int S = k_split(d.K);
  const dim3 grid((unsigned)((d.N + kWarps / S - 1) / (kWarps / S)), (unsigned)((d.T + kMaxCols - 1) / kMaxCols));
  visit_format(type, [&](auto fmt) {
    visit_cols(d.T, [&](auto nc) {
      qmatmul_kernel<decltype(fmt), XT, decltype(nc)::value><<<grid, kWarps * kLanes, 0, stream>>>(
          w, xp, y, d.T, d.N, d.K, d.row_bytes, S);
    });
  });
}

ffi::Error QMatmulGpu(gpuStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> y,
                      int32_t ggml_type, int32_t mma) {
  QDims d;
  MmaMode mode;
  if (auto e = check_qdims(x, w, ggml_type, false, &d); e.failure()) return e;
  if (auto e = check_mma(mma, &mode); e.failure()) return e;
  if (d.T == 0 || d.N == 0) return ffi::Error::Success();
  const auto* wp = static_cast<const uint8_t*>(w.untyped_data());
  const bool bf16 = x.element_type() == ffi::DataType::BF16;
  for_row_chunks(d.T, kMaxGridYZ, [&](int64_t t0, int64_t rows) {
    QDims dc = d;
    dc.T = rows;
    const void* xc = static_cast<const char*>(x.untyped_data()) + t0 * d.K * (bf16 ? 2 : 4);
    float* yc = static_cast<float*>(y->untyped_data()) + t0 * d.N;
    if (bf16) launch_qmatmul<bf16_t>(stream, dc, ggml_type, mode, wp, xc, yc);
    else launch_qmatmul<float>(stream, dc, ggml_type, mode, wp, xc, yc);
  });
  return launch_error("qmatmul");
}

// Resident CTAs of the float path's MoE kernel kKernel on the current device (host-side, once per kernel).
template <auto kKernel>
int64_t moe_resident_ctas() {
  static const int64_t ctas = [] {
    int per_sm = 0;
    (void)gpuOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kKernel, kWarps * kLanes, 0);
    return (int64_t)std::max(per_sm, 1) * i8::sm_count();
  }();
  return ctas;
}

// The float path's MoE layout (qmatmul_id_kernel). Window mode for calls of one id per row, no declared groups and
// at least kMaxCols rows per expert on average: `rowwise` products, whose rows choose their sequence's (or row's)
// keys in long runs, e.g. 384 rows per sequence in attention at width 6; the windows are the fewest that still
// fill tuning::kMoeWindowWaves waves of resident CTAs, each a power-of-two multiple of kMaxCols slots. Otherwise
// slot mode over one window of all P slots: each expert's rows read once per call by the CTAs of its first slot.
struct MoeLayout {
  int window;
  bool per_slot;
  unsigned grid_y;
};
inline MoeLayout moe_layout(int64_t P, int64_t k, int64_t E, int32_t groups, int64_t tiles, int64_t resident) {
  if (k != 1 || groups > 0 || E <= 0 || P < kMaxCols * E) return {(int)P, true, (unsigned)P};
  int64_t window = kMaxCols;
  while (window < kMaxMoeWindow && window < P && tiles * ((P + window - 1) / window) > tuning::kMoeWindowWaves * resident)
    window *= 2;
  return {(int)window, false, (unsigned)((P + window - 1) / window)};
}

template <class XT>
void launch_qmatmul_id(gpuStream_t stream, const QDims& d, int32_t type, MmaMode mma, const uint8_t* w, const void* x,
                       const int32_t* ids, int32_t groups, float* y) {
  if (i8math::visit_i8_format(type, [&](auto fmt) {
        return i8::launch_qmatmul_id<decltype(fmt)>(stream, d, mma, w, x, std::is_same_v<XT, bf16_t>, ids, groups, y);
      }))
    return;
  const auto* xp = static_cast<const XT*>(x);
  const int S = k_split(d.K);
  const int64_t P = d.T * d.k, tiles = (d.N + kWarps / S - 1) / (kWarps / S);
  visit_format(type, [&](auto fmt) {
    constexpr auto kKernel = qmatmul_id_kernel<decltype(fmt), XT>;
    const MoeLayout lay = moe_layout(P, d.k, d.E, groups, tiles, moe_resident_ctas<kKernel>());
    kKernel<<<dim3((unsigned)tiles, lay.grid_y), kWarps * kLanes, 0, stream>>>(
        w, xp, ids, y, d.E, d.N, d.K, d.row_bytes, (int)d.k, (int)P, S, lay.window, lay.per_slot);
  });
}

ffi::Error QMatmulIdGpu(gpuStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer ids,
                        ffi::Result<ffi::AnyBuffer> y, int32_t ggml_type, int32_t groups, int32_t mma) {
  QDims d;
  MmaMode mode;
  if (auto e = check_qdims(x, w, ggml_type, true, &d); e.failure()) return e;
  if (auto e = check_mma(mma, &mode); e.failure()) return e;
  if (auto e = check_ids(ids, &d); e.failure()) return e;
  if (auto e = check_groups(d, groups); e.failure()) return e;
  if (d.T == 0 || d.k == 0 || d.N == 0) return ffi::Error::Success();
  // The float path's slot mode puts every (row, id) slot on grid y; a grouped call's chunks start at group rows.
  const int64_t granule = groups > 0 ? groups : 1, max_rows = kMaxGridYZ / d.k / granule * granule;
  if (max_rows == 0)
    return arg_error("qmatmul_id: " + std::to_string(d.k) + " ids per row (with groups = " + std::to_string(groups) +
                     ") exceed the GPU grid's 65535 slots of one row chunk");
  const auto* wp = static_cast<const uint8_t*>(w.untyped_data());
  const bool bf16 = x.element_type() == ffi::DataType::BF16;
  for_row_chunks(d.T, max_rows, [&](int64_t t0, int64_t rows) {
    QDims dc = d;
    dc.T = rows;
    const void* xc = static_cast<const char*>(x.untyped_data()) + t0 * d.K * (bf16 ? 2 : 4);
    const int32_t* ic = static_cast<const int32_t*>(ids.untyped_data()) + t0 * d.k;
    float* yc = static_cast<float*>(y->untyped_data()) + t0 * d.k * d.N;
    if (bf16) launch_qmatmul_id<bf16_t>(stream, dc, ggml_type, mode, wp, xc, ic, groups, yc);
    else launch_qmatmul_id<float>(stream, dc, ggml_type, mode, wp, xc, ic, groups, yc);
  });
  return launch_error("qmatmul_id");
}

// ---- mHC ----
constexpr int kHcThreads = 256;
static_assert(kHcMixChunk % kHcThreads == 0, "hc_mix_kernel: whole products per thread");
// hc_collapse_kernel reads this many of a token's chunk sums at once (DS4's 16384 stream values are 8 chunks).
constexpr int kHcChunkLoads = 8;

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

// Launches kKernel<<<grid, kHcThreads, 0, stream>>>(args...) allowed to start while the kernel before it on the
// stream still runs (programmatic dependent launch), where kKernel's binary was built for sm_90 or later: only
// there is its gpu_wait_for_predecessor() compiled in, so the binary's version decides, not the device's (an sm_80
// build running on an H100 launches in order). The kernel must call gpu_wait_for_predecessor() before reading what
// that kernel writes. Captured into XLA's command buffers as a programmatic edge between the two kernel nodes. A
// failed launch is reported by launch_error(), as for <<<...>>>.
template <auto kKernel, class... A>
void launch_dependent(dim3 grid, gpuStream_t stream, A... args) {
#if defined(__HIPCC__)
  kKernel<<<grid, kHcThreads, 0, stream>>>(args...);
#else
  static const bool early_start = [] {
    cudaFuncAttributes attributes{};
    return cudaFuncGetAttributes(&attributes, kKernel) == cudaSuccess && attributes.binaryVersion >= 90;
  }();
  cudaLaunchAttribute early{};
  early.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  early.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = dim3(kHcThreads);
  config.stream = stream;
  config.attrs = &early;
  config.numAttrs = early_start ? 1 : 0;
  (void)cudaLaunchKernelEx(&config, kKernel, args...);
#endif
}

// grid (M, C, T), C = hc_mix_chunks(F): chunk c's share of token t's mix row m and of its sum of squares,
//   part[t, c, m] = Σ_{i in chunk c} flat_t[i]·fn[l, m, i],   part[t, c, M] = Σ_{i in chunk c} flat_t[i]²,
// with l = *layer clamped into [0, L) (fn a stack of L layers' matrices, check_hc_pre),
// which hc_collapse_kernel sums over c in order. Splitting F gives DS4's T = 1 call 24·8 CTAs instead of 24 that
// each stream a 16384-value row; the chunk is a constant, so every token's sums run in
// the same order whatever T. Each thread's kHcMixChunk / kHcThreads products are unrolled, their loads in flight
// together. hc_collapse_kernel may start as soon as every CTA of this kernel has started.
template <class XT, class FT>
__global__ void __launch_bounds__(kHcThreads) hc_mix_kernel(const XT* __restrict__ x, const FT* __restrict__ fn,
                                                            const int32_t* __restrict__ layer, int64_t L,
                                                            float* __restrict__ part, int64_t F, int M) {
  __shared__ float scratch[kHcThreads / kLanes];
  gpu_launch_dependents();
  const int m = blockIdx.x;
  const int64_t c = blockIdx.y, t = blockIdx.z;
  const int64_t l = *layer < 0 ? 0 : (*layer >= L ? L - 1 : *layer);
  const XT* xt = x + t * F;
  const FT* fr = fn + (l * M + m) * F;
  float dot = 0.0f, sq = 0.0f;
#pragma unroll
  for (int k = 0; k < kHcMixChunk / kHcThreads; ++k) {
    const int64_t i = c * kHcMixChunk + k * kHcThreads + threadIdx.x;
    if (i < F) {
      const float v = to_float(xt[i]);
      dot = __fmaf_rn(v, to_float(fr[i]), dot);
      sq = __fmaf_rn(v, v, sq);
    }
  }
  dot = block_sum(dot, scratch);
  sq = block_sum(sq, scratch);
  float* pt = part + (t * gridDim.y + c) * (M + 1);
  if (threadIdx.x == 0) pt[m] = dot;
  if (threadIdx.x == 0 && m == 0) pt[M] = sq;
}

// Token t's gates and Sinkhorn comb into shared memory, one comb element per thread (thread e < n*n holds
// comb[e / n, e % n]): each half-step reads one buffer and writes the other, so one barrier per half-step
// orders it. The same per-element functions as the CPU's serial hc_gates, so the bits are the same as a
// serial run's on this device, without leaving the whole Sinkhorn to one thread.
// Returns which of the two buffers holds the final comb.
__device__ __forceinline__ int hc_gates_in_block(const float* mix, const float* base, const float* scale, int n,
                                                 int iters, float eps, float* s_pre, float* s_post,
                                                 float (*s_comb)[kMaxHc * kMaxHc]) {
  const int e = threadIdx.x, nn = n * n;
  if (e < n) {
    s_pre[e] = hc_pre_gate(mix, base, scale, eps, e);
    s_post[e] = hc_post_gate(mix, base, scale, n, e);
  }
  if (e < nn) s_comb[0][e] = hc_comb_start(mix, base, scale, n, eps, e / n, e % n);
  __syncthreads();
  int cur = 0;
  for (int h = 0; h < hc_sinkhorn_half_steps(iters); ++h, cur ^= 1) {
    if (e < nn) s_comb[cur ^ 1][e] = hc_sinkhorn_elem(s_comb[cur], n, eps, hc_sinkhorn_rows(h), e);
    __syncthreads();
  }
  return cur;
}

// Calls f(std::integral_constant<int, N>) for the stream count n, 1 <= n <= kMaxHc (check_hc_streams).
template <int N = 1, class F>
void visit_hc_streams(int n, F&& f) {
  if constexpr (N < kMaxHc) {
    if (n != N) return visit_hc_streams<N + 1>(n, f);
  }
  f(std::integral_constant<int, N>{});
}

// grid (ceil(D/256), T): token t's mix from hc_mix_kernel's C chunk sums, mix[m] = (Σ_c part[t, c, m]) ·
// rsqrt((Σ_c part[t, c, M]) / F + norm_eps), then the gates + Sinkhorn (hc_gates_in_block), then u[t, d] for this
// block's d, for N streams.
// N is a template argument so that the gates' and the Sinkhorn's loops unroll and their index arithmetic folds:
// with a runtime n, each of the 39 dependent half-steps ran about a hundred instructions on one warp's critical
// path (docs/kernels.md#tuning-mhc-kernels). The functions are the CPU's,
// so the bits are too. Every read from global memory is issued before the gates: this thread's N stream values
// into registers, and the token's (2 + N)·N + 1 chunk sums (one thread each, summing over the chunks), base
// logits and three scales into shared memory. It is launched to start while hc_mix_kernel runs
// (launch_dependent): it reads the streams, base and scales, then waits for the mix kernel's chunk sums.
template <class XT, int N>
__global__ void __launch_bounds__(kHcThreads) hc_collapse_kernel(const XT* __restrict__ x, const float* __restrict__ part,
                                                                 const float* __restrict__ base, const float* __restrict__ scale,
                                                                 float* __restrict__ u, float* __restrict__ post,
                                                                 float* __restrict__ comb, int64_t D, int chunks,
                                                                 int iters, float hc_eps, float norm_eps) {
  constexpr int kLogits = (2 + N) * N;
  static_assert(kHcThreads > kLogits, "one thread per logit (and so per comb element) and one for the squares");
  __shared__ float s_mix[kLogits + 1], s_base[kLogits], s_scale[3];
  __shared__ float s_pre[N], s_post[N], s_comb[2][kMaxHc * kMaxHc];
  const int64_t t = blockIdx.y;
  const int64_t d = (int64_t)blockIdx.x * kHcThreads + threadIdx.x;
  float xs[N];
#pragma unroll
  for (int j = 0; j < N; ++j) xs[j] = d < D ? to_float(x[(t * N + j) * D + d]) : 0.0f;
  if (threadIdx.x < kLogits) s_base[threadIdx.x] = base[threadIdx.x];
  if (threadIdx.x < 3) s_scale[threadIdx.x] = scale[threadIdx.x];
  gpu_wait_for_predecessor();  // hc_mix_kernel's chunk sums in part
  if (threadIdx.x <= kLogits) {
    const float* pt = part + t * chunks * (kLogits + 1) + threadIdx.x;
    float sum = 0.0f;
    for (int c0 = 0; c0 < chunks; c0 += kHcChunkLoads) {  // the loads of kHcChunkLoads chunks in flight together
      float v[kHcChunkLoads];
#pragma unroll
      for (int j = 0; j < kHcChunkLoads; ++j) v[j] = c0 + j < chunks ? pt[(c0 + j) * (kLogits + 1)] : 0.0f;
#pragma unroll
      for (int j = 0; j < kHcChunkLoads; ++j)
        if (c0 + j < chunks) sum += v[j];
    }
    s_mix[threadIdx.x] = sum;
  }
  __syncthreads();
  if (threadIdx.x < kLogits) s_mix[threadIdx.x] *= 1.0f / sqrtf(s_mix[kLogits] / (float)(N * D) + norm_eps);
  __syncthreads();
  const int cur = hc_gates_in_block(s_mix, s_base, s_scale, N, iters, hc_eps, s_pre, s_post, s_comb);
  if (blockIdx.x == 0) {
    if (threadIdx.x < N) post[t * N + threadIdx.x] = s_post[threadIdx.x];
    if (threadIdx.x < N * N) comb[t * N * N + threadIdx.x] = s_comb[cur][threadIdx.x];
  }
  if (d < D) u[t * D + d] = hc_collapse(s_pre, N, [&](int j) { return xs[j]; });
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

ffi::Error HcPreGpu(gpuStream_t stream, ffi::AnyBuffer streams, ffi::AnyBuffer fn, ffi::AnyBuffer layer,
                    ffi::AnyBuffer base, ffi::AnyBuffer scale, ffi::Result<ffi::AnyBuffer> u,
                    ffi::Result<ffi::AnyBuffer> post, ffi::Result<ffi::AnyBuffer> comb,
                    ffi::Result<ffi::AnyBuffer> workspace, int32_t iters, float hc_eps, float norm_eps) {
  HcDims d;
  if (auto e = check_hc_pre(streams, fn, layer, base, scale, *workspace, &d); e.failure()) return e;
  if (d.T > kMaxGridYZ) return arg_error("hc_pre: " + std::to_string(d.T) + " token rows exceed the GPU grid's 65535");
  if (d.T == 0) return ffi::Error::Success();
  const int64_t chunks = hc_mix_chunks(d.n * d.D);
  auto* part = static_cast<float*>(workspace->untyped_data());
  visit_float(streams.element_type(), [&](auto xt) {
    using XT = decltype(xt);
    const auto* xp = static_cast<const XT*>(streams.untyped_data());
    visit_float(fn.element_type(), [&](auto ft) {
      using FT = decltype(ft);
      hc_mix_kernel<XT, FT><<<dim3((unsigned)d.M, (unsigned)chunks, (unsigned)d.T), kHcThreads, 0, stream>>>(
          xp, static_cast<const FT*>(fn.untyped_data()), static_cast<const int32_t*>(layer.untyped_data()), d.L,
          part, d.n * d.D, (int)d.M);
    });
    visit_hc_streams((int)d.n, [&](auto n) {
      launch_dependent<hc_collapse_kernel<XT, n()>>(
          dim3((unsigned)((d.D + kHcThreads - 1) / kHcThreads), (unsigned)d.T), stream,
          xp, part, static_cast<const float*>(base.untyped_data()), static_cast<const float*>(scale.untyped_data()),
          static_cast<float*>(u->untyped_data()), static_cast<float*>(post->untyped_data()),
          static_cast<float*>(comb->untyped_data()), d.D, (int)chunks, iters, hc_eps, norm_eps);
    });
  });
  return launch_error("hc_pre");
}

ffi::Error HcPostGpu(gpuStream_t stream, ffi::AnyBuffer block_out, ffi::AnyBuffer streams, ffi::AnyBuffer post,
                     ffi::AnyBuffer comb, ffi::Result<ffi::AnyBuffer> out) {
  HcDims d;
  if (auto e = check_hc_post(block_out, streams, post, comb, &d); e.failure()) return e;
  if (d.T > kMaxGridYZ) return arg_error("hc_post: " + std::to_string(d.T) + " token rows exceed the GPU grid's 65535");
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
  return launch_error("hc_post");
}

// ---- RMSNorm ----
constexpr int kNormWarps = 8;

// One CTA of kNormWarps warps per row (a warp per row left a decode step's few rows on a few SMs, each lane walking
// K/32 values): thread i sums x[i + 256j]² in j order (fp32 FMAs), the warps reduce with the fixed butterfly, and
// warp 0 adds the 8 warp sums in the same butterfly; y = (x · r) · w with r = 1 / sqrt(Σ / K + eps). A row's
// arithmetic depends on K alone.
template <class XT>
__global__ void __launch_bounds__(kNormWarps * kLanes) rms_norm_kernel(const XT* __restrict__ x,
                                                                       const float* __restrict__ w,
                                                                       float* __restrict__ y, int64_t K, float eps) {
  constexpr int kThreads = kNormWarps * kLanes;
  __shared__ float warp_total[kNormWarps];
  __shared__ float row_scale;
  const int lane = threadIdx.x % kLanes, warp = threadIdx.x / kLanes;
  const int64_t t = blockIdx.x;
  const XT* row = x + t * K;
  float acc = 0.0f;
  for (int64_t i = threadIdx.x; i < K; i += kThreads) {
    const float v = to_float(row[i]);
    acc = __fmaf_rn(v, v, acc);
  }
  int index = 0;
  const float ws = warp_sums<1>(&acc, lane, index);
  if (lane == 0) warp_total[warp] = ws;
  __syncthreads();
  if (warp == 0) {
    float v = lane < kNormWarps ? warp_total[lane] : 0.0f;  // lanes past the warps add +0: no bits change
    index = 0;
    const float ss = warp_sums<1>(&v, lane, index);
    if (lane == 0) row_scale = __frcp_rn(__fsqrt_rn(__fadd_rn(__fdiv_rn(ss, (float)K), eps)));
  }
  __syncthreads();
  const float r = row_scale;
  for (int64_t i = threadIdx.x; i < K; i += kThreads) y[t * K + i] = __fmul_rn(__fmul_rn(to_float(row[i]), r), w[i]);
}

ffi::Error RmsNormGpu(gpuStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> y,
                      float eps) {
  NormDims d;
  if (auto e = check_rms_norm(x, w, *y, &d); e.failure()) return e;
  if (d.T == 0 || d.K == 0) return ffi::Error::Success();
  if (d.T > INT_MAX) return arg_error("rms_norm: more than 2^31 - 1 rows in one call");
  const auto* wp = static_cast<const float*>(w.untyped_data());
  auto* yp = static_cast<float*>(y->untyped_data());
  visit_float(x.element_type(), [&](auto xt) {
    using XT = decltype(xt);
    rms_norm_kernel<XT><<<(unsigned)d.T, kNormWarps * kLanes, 0, stream>>>(static_cast<const XT*>(x.untyped_data()), wp,
                                                                           yp, d.K, eps);
  });
  return launch_error("rms_norm");
}

// ---- Grouped float products (the invariant step's attention products) ----
// A CTA of 16 x 16 threads computes a TM x TN tile of one group's outputs, TM = 16·RM and TN = 16·RN, each thread
// RM x RN of them (rows ty + 16i, columns tx + 16j). K is walked in kGroupedTk slices staged in shared memory as
// float; each output is one __fmaf_rn chain over k in order (ffi_common.h), so its bits do not depend on G, M, N
// or the tile shape. The transposed layout (w[g] as [K, N], the values of probs · V) is staged the other way.
constexpr int kGroupedTk = 32;
constexpr int kGroupedSide = 16;

template <class WT, int RM, int RN>
__global__ void __launch_bounds__(kGroupedSide * kGroupedSide) grouped_matmul_kernel(
    const float* __restrict__ x, const WT* __restrict__ w, const int32_t* __restrict__ layer, int64_t L, int64_t G,
    float* __restrict__ y, int64_t M, int64_t N, int64_t K, int64_t m_tiles, int64_t n_tiles, bool transposed) {
  constexpr int TM = kGroupedSide * RM, TN = kGroupedSide * RN, kThreads = kGroupedSide * kGroupedSide;
  __shared__ float xs[kGroupedTk][TM + 1];  // +1: the staging stores' stride is odd, so no bank conflicts
  __shared__ float ws[kGroupedTk][TN + 1];
  const int tid = threadIdx.x, tx = tid % kGroupedSide, ty = tid / kGroupedSide;
  const int64_t tile = blockIdx.x, g = tile / (m_tiles * n_tiles);
  const int64_t m0 = tile / n_tiles % m_tiles * TM, n0 = tile % n_tiles * TN;
  const float* xg = x + g * M * K;
  const int64_t l = *layer < 0 ? 0 : (*layer >= L ? L - 1 : *layer);  // w's layer of a stack (L = 1: w itself)
  const WT* wg = w + (l * G + g) * N * K;
  float acc[RM][RN] = {};
  for (int64_t k0 = 0; k0 < K; k0 += kGroupedTk) {
    const int kn = K - k0 < kGroupedTk ? (int)(K - k0) : kGroupedTk;
    for (int e = tid; e < TM * kGroupedTk; e += kThreads) {
      const int kk = e % kGroupedTk, mm = e / kGroupedTk;
      xs[kk][mm] = (m0 + mm < M && kk < kn) ? xg[(m0 + mm) * K + k0 + kk] : 0.0f;
    }
    for (int e = tid; e < TN * kGroupedTk; e += kThreads) {
      const int kk = transposed ? e / TN : e % kGroupedTk, nn = transposed ? e % TN : e / kGroupedTk;
      const int64_t at = transposed ? (k0 + kk) * N + n0 + nn : (n0 + nn) * K + k0 + kk;
      ws[kk][nn] = (n0 + nn < N && kk < kn) ? to_float(wg[at]) : 0.0f;
    }
    __syncthreads();
    for (int kk = 0; kk < kn; ++kk) {  // only the real k: a padded 0·0 would turn an accumulated -0 into +0
      float a[RM], b[RN];
#pragma unroll
      for (int i = 0; i < RM; ++i) a[i] = xs[kk][ty + kGroupedSide * i];
#pragma unroll
      for (int j = 0; j < RN; ++j) b[j] = ws[kk][tx + kGroupedSide * j];
#pragma unroll
      for (int i = 0; i < RM; ++i)
#pragma unroll
        for (int j = 0; j < RN; ++j) acc[i][j] = dspark_mad(a[i], b[j], acc[i][j]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < RM; ++i) {
    const int64_t m = m0 + ty + kGroupedSide * i;
#pragma unroll
    for (int j = 0; j < RN; ++j) {
      const int64_t n = n0 + tx + kGroupedSide * j;
      if (m < M && n < N) y[(g * M + m) * N + n] = acc[i][j];
    }
  }
}

// Tiles of 32 x 64 outputs where the call has enough of them to fill the GPU, else 16 x 32 (more CTAs for the
// batch-1 calls); both give every output the same bits.
constexpr int64_t kGroupedBigTilesMin = 256;

// Tiles of RM x RN outputs per thread along M and N.
template <int RM, int RN>
struct GroupedTiles {
  int64_t m, n;
  explicit GroupedTiles(const GroupedDims& d)
      : m((d.M + kGroupedSide * RM - 1) / (kGroupedSide * RM)), n((d.N + kGroupedSide * RN - 1) / (kGroupedSide * RN)) {}
  int64_t ctas(const GroupedDims& d) const { return d.G * m * n; }
};

template <class WT, int RM, int RN>
void launch_grouped_matmul(gpuStream_t stream, const GroupedDims& d, const ffi::AnyBuffer& x, const ffi::AnyBuffer& w,
                           const ffi::AnyBuffer& layer, ffi::Result<ffi::AnyBuffer>& y, bool transposed) {
  const GroupedTiles<RM, RN> tiles(d);
  grouped_matmul_kernel<WT, RM, RN><<<(unsigned)tiles.ctas(d), kGroupedSide * kGroupedSide, 0, stream>>>(
      static_cast<const float*>(x.untyped_data()), static_cast<const WT*>(w.untyped_data()),
      static_cast<const int32_t*>(layer.untyped_data()), d.L, d.G, static_cast<float*>(y->untyped_data()), d.M, d.N,
      d.K, tiles.m, tiles.n, transposed);
}

ffi::Error GroupedMatmulGpu(gpuStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer layer,
                            ffi::Result<ffi::AnyBuffer> y, int32_t transposed) {
  GroupedDims d;
  if (auto e = check_grouped_matmul(x, w, layer, *y, transposed, &d); e.failure()) return e;
  if (d.G * d.M * d.N == 0) return ffi::Error::Success();
  const int64_t big_tiles = GroupedTiles<2, 4>(d).ctas(d);  // the small tiles' launch has < 4 x kGroupedBigTilesMin
  if (big_tiles > INT_MAX) return arg_error("grouped_matmul: G x M x N too large for one launch");
  visit_float(w.element_type(), [&](auto wt) {
    using WT = decltype(wt);
    if (big_tiles >= kGroupedBigTilesMin) launch_grouped_matmul<WT, 2, 4>(stream, d, x, w, layer, y, transposed);
    else launch_grouped_matmul<WT, 1, 2>(stream, d, x, w, layer, y, transposed);
  });
  return launch_error("grouped_matmul");
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
                                  .Attr<int32_t>("ggml_type").Attr<int32_t>("mma"),
                              {ffi::Traits::kCmdBufferCompatible});

DSPARK_EXPORT XLA_FFI_Error* DSPARK_GPU_SYMBOL(DsparkQMatmulId)(XLA_FFI_CallFrame*);
XLA_FFI_DEFINE_HANDLER_SYMBOL(DSPARK_GPU_SYMBOL(DsparkQMatmulId), dspark::QMatmulIdGpu,
                              DSPARK_GPU_BIND.Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>().Attr<int32_t>("ggml_type").Attr<int32_t>("groups")
                                  .Attr<int32_t>("mma"),
                              {ffi::Traits::kCmdBufferCompatible});

DSPARK_EXPORT XLA_FFI_Error* DSPARK_GPU_SYMBOL(DsparkHcPre)(XLA_FFI_CallFrame*);
XLA_FFI_DEFINE_HANDLER_SYMBOL(DSPARK_GPU_SYMBOL(DsparkHcPre), dspark::HcPreGpu,
                              DSPARK_GPU_BIND.Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("iters").Attr<float>("hc_eps").Attr<float>("norm_eps"),
                              {ffi::Traits::kCmdBufferCompatible});

DSPARK_EXPORT XLA_FFI_Error* DSPARK_GPU_SYMBOL(DsparkHcPost)(XLA_FFI_CallFrame*);
XLA_FFI_DEFINE_HANDLER_SYMBOL(DSPARK_GPU_SYMBOL(DsparkHcPost), dspark::HcPostGpu,
                              DSPARK_GPU_BIND.Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>(),
                              {ffi::Traits::kCmdBufferCompatible});

DSPARK_EXPORT XLA_FFI_Error* DSPARK_GPU_SYMBOL(DsparkIndexerTopk)(XLA_FFI_CallFrame*);
XLA_FFI_DEFINE_HANDLER_SYMBOL(DSPARK_GPU_SYMBOL(DsparkIndexerTopk), dspark::IndexerTopkGpu,
                              DSPARK_GPU_BIND.Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>(),
                              {ffi::Traits::kCmdBufferCompatible});

DSPARK_EXPORT XLA_FFI_Error* DSPARK_GPU_SYMBOL(DsparkRmsNorm)(XLA_FFI_CallFrame*);
XLA_FFI_DEFINE_HANDLER_SYMBOL(DSPARK_GPU_SYMBOL(DsparkRmsNorm), dspark::RmsNormGpu,
                              DSPARK_GPU_BIND.Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()
                                  .Attr<float>("eps"),
                              {ffi::Traits::kCmdBufferCompatible});

DSPARK_EXPORT XLA_FFI_Error* DSPARK_GPU_SYMBOL(DsparkGroupedMatmul)(XLA_FFI_CallFrame*);
XLA_FFI_DEFINE_HANDLER_SYMBOL(DSPARK_GPU_SYMBOL(DsparkGroupedMatmul), dspark::GroupedMatmulGpu,
                              DSPARK_GPU_BIND.Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("transposed"),
                              {ffi::Traits::kCmdBufferCompatible});

DSPARK_DEFINE_PLUGIN_INFO
