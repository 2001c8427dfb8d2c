// GPU packed matvec for Q8_0 and IQ2_XXS on integer dot products (included by gpu_ffi.cu).
//
// Why: at decode widths the matvec must stream weights at memory speed, and an fp32 multiply-add per
// weight plus the decode of each weight to fp32 costs more instructions than an H200 SM can issue at that
// rate for 2-bit weights. Here weights are decoded to int8 (4 per 32-bit word) and multiplied with
// integer dot products (dp4a) against an exact-enough integer form of the activations:
//
//   * activations, per token and per 32-element sub-block b: X_j = rint(x_j · 2^(22-e_b)) where
//     2^(e_b-1) <= max_j |x_j| < 2^e_b, so |X_j| <= 2^22 and each x_j is kept to 2^-23 of the sub-block's
//     largest magnitude. X_j = 65536·L0_j + 256·L1_j + L2_j with balanced int8 limbs (`quantize_x_kernel`,
//     once per call, into the caller's workspace);
//   * per sub-block, row and token: I_l = Σ_j w_j·L_lj exactly in int32 (dp4a), then in fp32
//     v = fma(I0, 65536, I1·256 + I2) and acc = fma(d_w · 2^(e_b-22), v, acc) over the sub-blocks in order.
//
// Every output's operation sequence depends only on its own row and token: batch invariant in T and in
// the rows sharing a warp.
//
// Layout: each warp owns groups of R rows (R = 1, 2, 4 per call) over the whole of K, taken in a
// grid-stride loop; a group's K is cut into chunks of 1024 weights (32 sub-blocks, one per lane). The warp
// streams (group, chunk) items through a ring of kStages shared-memory stages with asynchronous copies,
// kStages-1 items ahead, across group boundaries. IQ2_XXS grid and sign tables live in shared memory,
// replicated per lane of a half-warp (grid) or quarter-warp (signs) so random lookups never conflict.

namespace i8 {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * kLanes;
constexpr int kSubPerLane = 2;  // independent 32-weight sub-blocks per lane per chunk (instruction-level parallelism)
constexpr int kSubPerChunk = kSubPerLane * kLanes;

// Workspace layout for T tokens of K activations: limbs int8 [T, 3, K], then scales float [T, K/32].
DSPARK_HD int64_t limb_bytes(int64_t T, int64_t K) { return T * K * 3; }
DSPARK_HD int64_t workspace_bytes(int64_t T, int64_t K) { return limb_bytes(T, K) + T * (K / 32) * 4; }

// ---- activation limbs ----
// grid (ceil(K/32 / kWarps), T), kThreads threads: warp w turns sub-block blockIdx.x*kWarps + w of token
// blockIdx.y into limbs (lane = element). Non-finite activations give a NaN scale (NaN outputs).
template <class XT>
__global__ void __launch_bounds__(kThreads) quantize_x_kernel(const XT* __restrict__ x, int8_t* __restrict__ limbs,
                                                              float* __restrict__ scales, int64_t K) {
  const int64_t t = blockIdx.y, nsub = K / 32;
  const int64_t sb = (int64_t)blockIdx.x * kWarps + threadIdx.x / kLanes;
  const int lane = threadIdx.x % kLanes;
  if (sb >= nsub) return;
  const float v = to_float(x[t * K + sb * 32 + lane]);
  float m = fabsf(v);
  for (int s = kLanes / 2; s > 0; s >>= 1) m = fmaxf(m, gpu_shfl_xor(m, s));
  int e = 0;
  int X = 0;
  float scale = 0.0f;
  if (!(m <= 3.402823466e38f)) {
    scale = __int_as_float(0x7fc00000);  // inf or NaN somewhere in the sub-block
  } else if (m > 0.0f) {
    frexpf(m, &e);
    X = __float2int_rn(ldexpf(v, 22 - e));
    scale = ldexpf(1.0f, e - 22);
  }
  const int l2 = ((X + 128) & 255) - 128;
  X = (X - l2) >> 8;
  const int l1 = ((X + 128) & 255) - 128;
  const int l0 = (X - l1) >> 8;
  int8_t* out = limbs + t * 3 * K + sb * 32 + lane;
  out[0] = (int8_t)l0;
  out[K] = (int8_t)l1;
  out[2 * K] = (int8_t)l2;
  if (lane == 0) scales[t * nsub + sb] = scale;
}

// ---- sub-block decoders: 32 weights of a staged chunk as 8 words of int8, and the sub-block's scale ----
struct Tables {
  const uint2* grid;  // [256][16]: IQ2_XXS grid magnitudes (8 bytes), one copy per half-warp lane
  const uint4* sign;  // [128][8]: {byte masks 0xFF of negative weights (lo, hi word), -(mask & 0x01010101)}
};

template <class Fmt>
struct Sub;

template <>
struct Sub<FmtQ8_0> {  // half d @0; int8 qs[32] @2: a chunk is 64 blocks
  static constexpr int kChunkBytes = kSubPerChunk * 34;
  static constexpr int kTableBytes = 0;
  __device__ __forceinline__ static float decode(const uint8_t* chunk, int sub, uint32_t q[8], const Tables&) {
    const uint32_t b = 34u * (uint32_t)sub;
    const float d = __half2float(__ushort_as_half(*reinterpret_cast<const uint16_t*>(chunk + b)));
    const uint32_t* wp = reinterpret_cast<const uint32_t*>(chunk + ((b + 2u) & ~3u));
    const uint32_t sh = ((b + 2u) & 3u) * 8u;
    uint32_t w[9];
#pragma unroll
    for (int i = 0; i < 9; ++i) w[i] = wp[i];
#pragma unroll
    for (int i = 0; i < 8; ++i) q[i] = __funnelshift_r(w[i], w[i + 1], sh);
    return d;
  }
};

template <>
struct Sub<FmtIQ2_XXS> {  // half d @0; 8 x (u8 grid index[4], u32 signs|scale) @2: a chunk is 8 blocks
  static constexpr int kChunkBytes = kSubPerChunk / 8 * 66;
  static constexpr int kTableBytes = 256 * 16 * 8 + 128 * 8 * 16;
  __device__ __forceinline__ static float decode(const uint8_t* chunk, int sub, uint32_t q[8], const Tables& tab) {
    const uint32_t blk = 66u * (uint32_t)(sub >> 3);
    const uint32_t o = blk + 2u + 8u * (uint32_t)(sub & 7);
    const uint32_t* wp = reinterpret_cast<const uint32_t*>(chunk + (o & ~3u));
    const uint32_t sh = (o & 3u) * 8u;
    const uint32_t w0 = wp[0], w1 = wp[1], w2 = wp[2];
    const uint32_t idx = __funnelshift_r(w0, w1, sh), a1 = __funnelshift_r(w1, w2, sh);
    const float d = __half2float(__ushort_as_half(*reinterpret_cast<const uint16_t*>(chunk + blk)));
    const int rep = threadIdx.x & 15;
#pragma unroll
    for (int l = 0; l < 4; ++l) {
      const uint2 g = tab.grid[((idx >> (8 * l)) & 255u) * 16 + rep];
      const uint4 s = tab.sign[((a1 >> (7 * l)) & 127u) * 8 + (rep & 7)];
      // a negative byte m becomes (m - 1) ^ 0xFF = -m; grid bytes are >= 8, so m - 1 never borrows.
      q[2 * l] = (g.x + s.z) ^ s.x;
      q[2 * l + 1] = (g.y + s.w) ^ s.y;
    }
    return __fmul_rn(__fmul_rn(d, __fadd_rn(0.5f, (float)(a1 >> 28))), 0.25f);
  }
};

template <class Fmt>
__device__ void init_tables(uint8_t* smem, Tables* tab) {
  if constexpr (Sub<Fmt>::kTableBytes > 0) {
    uint2* grid = reinterpret_cast<uint2*>(smem);
    uint4* sign = reinterpret_cast<uint4*>(smem + 256 * 16 * 8);
    for (int i = threadIdx.x; i < 256 * 16; i += blockDim.x) {
      const uint64_t g = kIq2xxsGridDevice[i >> 4];
      grid[i] = make_uint2((uint32_t)g, (uint32_t)(g >> 32));
    }
    for (int i = threadIdx.x; i < 128 * 8; i += blockDim.x) {
      const uint32_t s = iq2_sign_byte((uint32_t)(i >> 3));
      uint32_t m[2];
      for (int h = 0; h < 2; ++h) {
        m[h] = 0;
        for (int j = 0; j < 4; ++j) m[h] |= ((s >> (4 * h + j)) & 1u) ? 0xFFu << (8 * j) : 0u;
      }
      sign[i] = make_uint4(m[0], m[1], 0u - (m[0] & 0x01010101u), 0u - (m[1] & 0x01010101u));
    }
    __syncthreads();
    tab->grid = grid;
    tab->sign = sign;
  }
}

struct Args {
  const uint8_t* w;        // rows of the selected matrix
  const int8_t* limbs;     // [T, 3, K] (global memory)
  const float* scales;     // [T, K/32]
  float* y;
  int64_t N, K, row_bytes;
  int copy_bytes;          // 16, 8 or 4: asynchronous copy width; 2: synchronous 2-byte copies
  int x_tokens;            // tokens whose activations a CTA copies to shared memory (0: read them from global)
};

// Where a warp reads activations: limbs/scales of token `tok0 + i` at limbs + i*3K, scales + i*K/32 (shared
// memory holding tokens [tok0, tok0 + x_tokens), or global memory with tok0 = 0).
struct XView {
  const int8_t* limbs;
  const float* scales;
  int tok0;
};

// Copies the activations of tokens [tok0, tok0 + ntok) into shared memory (16-byte limb words: 3K is a
// multiple of 96; 4-byte scale words), then a CTA barrier.
__device__ __forceinline__ XView stage_x(const Args& a, int tok0, int ntok, uint8_t* dst) {
  const int64_t nl = limb_bytes(ntok, a.K) / 16, ns = ntok * (a.K / 32);
  const uint4* src = reinterpret_cast<const uint4*>(a.limbs + limb_bytes(tok0, a.K));
  for (int64_t i = threadIdx.x; i < nl; i += blockDim.x) reinterpret_cast<uint4*>(dst)[i] = src[i];
  float* sc = reinterpret_cast<float*>(dst + limb_bytes(ntok, a.K));
  for (int64_t i = threadIdx.x; i < ns; i += blockDim.x) sc[i] = a.scales[tok0 * (a.K / 32) + i];
  __syncthreads();
  return XView{reinterpret_cast<const int8_t*>(dst), sc, tok0};
}

// Starts copying chunk c of rows [row0, row0 + nrows) into `dst` (row r at dst + r*RS), then commits the
// copy group (also when there is nothing to copy, so group counting stays uniform).
template <int CB, int RS>
__device__ __forceinline__ void issue_chunk(uint8_t* dst, const Args& a, int64_t row0, int nrows, int64_t c, int lane) {
  const int64_t off = c * CB;
  const int len = (int)(a.row_bytes - off < CB ? a.row_bytes - off : CB);
  const int v = a.copy_bytes, pieces = len / v;
  for (int r = 0; r < nrows; ++r) {
    const uint8_t* src = a.w + (row0 + r) * a.row_bytes + off;
    for (int p = lane; p < pieces; p += kLanes) gpu_copy_async(dst + r * RS + p * v, src + p * v, v);
  }
  gpu_copy_commit();
}

// A position in a warp's stream of (group of R rows, K chunk) items.
struct Cursor {
  int64_t group, chunk;
  __device__ __forceinline__ void next(int64_t stride, int64_t nchunks) {
    if (++chunk == nchunks) {
      chunk = 0;
      group += stride;
    }
  }
};

// One warp: its groups of R rows (group0, group0 + stride, ...) times the columns in `cols`.
// Stages of a warp's copy ring: enough that about 4 KB of each warp's rows are in flight while it computes.
template <class Fmt, int R>
constexpr int kStages = std::min(8, std::max(2, 1 + (4096 + R * Sub<Fmt>::kChunkBytes - 1) / (R * Sub<Fmt>::kChunkBytes)));

// |i| < 2^22 as float, exactly: 1.5·2^23 + i built in the mantissa, minus 1.5·2^23 (two full-rate operations).
__device__ __forceinline__ float small_int_to_float(int i) {
  return __fsub_rn(__int_as_float(0x4B400000 + i), 12582912.0f);
}

// Sub-block `sub` of a staged chunk (global sub-block index sb) for R rows and NC columns: exact int32 limb dot
// products (their summation order is free: integer adds are exact), then one fixed fp32 sequence into acc.
// Column t's activations: limbs at xv.limbs + xcol.limb[t] (int8, limb l at +l·K), scales at
// xv.scales + xcol.scale[t]; 32-bit offsets computed once per pass (activations are small).
template <int NC>
struct XCols {
  int limb[NC], scale[NC];
};

template <class Fmt, int NC, int R>
__device__ __forceinline__ void sub_block(const XView& xv, const XCols<NC>& xc, int ncols, int k16, const uint8_t* st,
                                          int RS, int sub, int sb, int nrows, const Tables& tab, float (&acc)[R][NC]) {
  uint32_t q[R][8];
  float dw[R];
#pragma unroll
  for (int r = 0; r < R; ++r)
    if (r < nrows) dw[r] = Sub<Fmt>::decode(st + r * RS, sub, q[r], tab);
#pragma unroll
  for (int t = 0; t < NC; ++t) {
    if (t < ncols) {
      const int4* xl = reinterpret_cast<const int4*>(xv.limbs + xc.limb[t]) + 2 * sb;
      int xw[3][8];
#pragma unroll
      for (int l = 0; l < 3; ++l) {
        const int4 u = xl[l * k16], v = xl[l * k16 + 1];
        xw[l][0] = u.x; xw[l][1] = u.y; xw[l][2] = u.z; xw[l][3] = u.w;
        xw[l][4] = v.x; xw[l][5] = v.y; xw[l][6] = v.z; xw[l][7] = v.w;
      }
      const float xs = xv.scales[xc.scale[t] + sb];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (r < nrows) {
          float I[3];
#pragma unroll
          for (int l = 0; l < 3; ++l) {
            int s0 = 0, s1 = 0;
#pragma unroll
            for (int j = 0; j < 8; j += 2) {
              s0 = gpu_dp4a((int)q[r][j], xw[l][j], s0);
              s1 = gpu_dp4a((int)q[r][j + 1], xw[l][j + 1], s1);
            }
            I[l] = small_int_to_float(s0 + s1);  // |I| <= 32 * 128 * 128 < 2^22
          }
          const float v = __fmaf_rn(I[0], 65536.0f, __fmaf_rn(I[1], 256.0f, I[2]));
          acc[r][t] = __fmaf_rn(__fmul_rn(dw[r], xs), v, acc[r][t]);
        }
      }
    }
  }
}

template <class Fmt, int NC, int R>
__device__ void warp_rows(const Args& a, const ColTable& cols, const XView& xv, int64_t group0, int64_t stride,
                          uint8_t* stages, const Tables& tab) {
  using S = Sub<Fmt>;
  constexpr int CB = S::kChunkBytes, RS = (CB + 4 + 15) / 16 * 16, D = kStages<Fmt, R>;
  const int lane = threadIdx.x % kLanes;
  const int64_t ngroups = (a.N + R - 1) / R, nsub = a.K / 32;
  const int64_t nchunks = (nsub + kSubPerChunk - 1) / kSubPerChunk;
  if (group0 >= ngroups) return;
  auto nrows_of = [&](int64_t group) { return (int)(a.N - group * R < R ? a.N - group * R : R); };
  Cursor in{group0, 0}, at{group0, 0};  // next item to copy, item to compute
  int slot_in = 0, slot_at = 0;
  auto issue = [&]() {
    if (in.group < ngroups) {
      issue_chunk<CB, RS>(stages + slot_in * R * RS, a, in.group * R, nrows_of(in.group), in.chunk, lane);
      in.next(stride, nchunks);
    } else {
      gpu_copy_commit();
    }
    slot_in = slot_in + 1 == D ? 0 : slot_in + 1;
  };
  for (int i = 0; i < D - 1; ++i) issue();
  const int k16 = (int)(a.K / 16);
  XCols<NC> xc;
#pragma unroll
  for (int t = 0; t < NC; ++t) {
    const int xi = t < cols.ncols ? cols.x_row[t] - xv.tok0 : 0;
    xc.limb[t] = xi * 3 * (int)a.K;
    xc.scale[t] = xi * (int)nsub;
  }
  float acc[R][NC];
  for (; at.group < ngroups; at.next(stride, nchunks), slot_at = slot_at + 1 == D ? 0 : slot_at + 1) {
    gpu_copy_wait<D - 2>();
    gpu_syncwarp();
    issue();  // overwrites the stage computed in the previous iteration, which every lane has left
    const int nrows = nrows_of(at.group);
    if (at.chunk == 0) {
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int t = 0; t < NC; ++t) acc[r][t] = 0.0f;
    }
    const uint8_t* st = stages + slot_at * R * RS;
#pragma unroll
    for (int h = 0; h < kSubPerLane; ++h) {
      const int sub = h * kLanes + lane;
      const int sb = (int)at.chunk * kSubPerChunk + sub;
      if (sb < nsub) sub_block<Fmt, NC, R>(xv, xc, cols.ncols, k16, st, RS, sub, sb, nrows, tab, acc);
    }
    if (at.chunk == nchunks - 1) {
      const int64_t row0 = at.group * R;
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int t = 0; t < NC; ++t) {
          float s = acc[r][t];
          for (int m = kLanes / 2; m > 0; m >>= 1) s = __fadd_rn(s, gpu_shfl_xor(s, m));
          if (lane == 0 && r < nrows && t < cols.ncols) a.y[(int64_t)cols.y_row[t] * a.N + row0 + r] = s;
        }
    }
  }
  gpu_copy_wait<0>();
  gpu_syncwarp();
}

// Shared memory of one CTA: the tables, per warp kStages stages of R staged row chunks, then the activations
// of x_tokens tokens in the workspace layout (workspace_bytes(x_tokens, K)).
template <class Fmt, int R>
constexpr int kWarpStageBytes = kStages<Fmt, R> * R * ((Sub<Fmt>::kChunkBytes + 4 + 15) / 16 * 16);
template <class Fmt, int R>
constexpr int kFixedSmemBytes = Sub<Fmt>::kTableBytes + kWarps * kWarpStageBytes<Fmt, R>;

template <class Fmt, int NC, int R>
__device__ void cta_rows(const Args& a, const ColTable& cols, const XView& xv, uint8_t* smem, const Tables& tab) {
  const int warp = threadIdx.x / kLanes;
  uint8_t* stages = smem + Sub<Fmt>::kTableBytes + warp * kWarpStageBytes<Fmt, R>;
  warp_rows<Fmt, NC, R>(a, cols, xv, (int64_t)blockIdx.x * kWarps + warp, (int64_t)gridDim.x * kWarps, stages, tab);
}

// Dense: grid (persistent CTAs, column tiles of kMaxCols tokens).
template <class Fmt, int NC, int R>
__global__ void __launch_bounds__(kThreads, 2) qmatmul_kernel(Args a, int64_t T) {
  extern __shared__ __align__(16) uint8_t smem[];
  Tables tab{};
  init_tables<Fmt>(smem, &tab);
  ColTable cols;
  const int64_t t0 = (int64_t)blockIdx.y * kMaxCols;
  cols.ncols = (int)(T - t0 < kMaxCols ? T - t0 : kMaxCols);
  for (int c = 0; c < kMaxCols; ++c) cols.x_row[c] = cols.y_row[c] = (int)(t0 + (c < cols.ncols ? c : 0));
  const XView xv = a.x_tokens > 0 ? stage_x(a, (int)t0, cols.ncols, smem + kFixedSmemBytes<Fmt, R>)
                                  : XView{a.limbs, a.scales, 0};
  cta_rows<Fmt, NC, R>(a, cols, xv, smem, tab);
}

// MoE: grid (persistent CTAs, slot p). The CTAs of slot p serve expert ids[p] only if p is its first slot,
// then loop over all slots choosing it, kMaxCols at a time: each selected expert is read once per call.
template <class Fmt, int R>
__global__ void __launch_bounds__(kThreads, 2) qmatmul_id_kernel(Args a, const int32_t* __restrict__ ids, int64_t E,
                                                                 int topk, int P) {
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ ColTable s_cols;
  __shared__ int s_next;
  const int p = blockIdx.y;
  const int32_t e = ids[p];
  for (int q = 0; q < p; ++q)
    if (ids[q] == e) return;  // an earlier slot's CTAs serve this expert
  Tables tab{};
  init_tables<Fmt>(smem, &tab);
  const XView xv = a.x_tokens > 0 ? stage_x(a, 0, a.x_tokens, smem + kFixedSmemBytes<Fmt, R>)
                                  : XView{a.limbs, a.scales, 0};
  const bool valid = e >= 0 && e < E;
  Args ae = a;
  ae.w = a.w + (valid ? e : 0) * a.N * a.row_bytes;
  for (int start = p; start < P;) {
    const ColTable cols = next_expert_cols(ids, e, topk, P, &start, &s_cols, &s_next);
    if (cols.ncols == 0) break;
    if (!valid) {
      for (int64_t i = (int64_t)blockIdx.x * kThreads + threadIdx.x; i < cols.ncols * a.N; i += (int64_t)gridDim.x * kThreads)
        a.y[(int64_t)cols.y_row[i / a.N] * a.N + i % a.N] = 0.0f;
    } else {
      visit_cols(cols.ncols, [&](auto nc) { cta_rows<Fmt, decltype(nc)::value, R>(ae, cols, xv, smem, tab); });
    }
  }
}

// ---- host side ----
// Largest copy width the rows, chunks and base address all allow.
inline int copy_width(const uint8_t* w, int64_t row_bytes, int chunk_bytes) {
  const auto base = reinterpret_cast<uintptr_t>(w);
  for (int v : {16, 8, 4})
    if (row_bytes % v == 0 && chunk_bytes % v == 0 && base % v == 0) return v;
  return 2;
}

// Resident CTAs of a kernel with `smem` bytes of dynamic shared memory on the current device. The kernel's
// shared-memory limit is raised once, and the occupancy is computed once per distinct `smem` (host-side calls
// only, no stream work: capture-safe; cached because the handler runs on every call outside command buffers).
// Streaming multiprocessors of the current device (queried once).
inline int sm_count() {
  static const int n = [] {
    int dev = 0, v = 0;
    (void)gpuGetDevice(&dev);
    (void)gpuDeviceGetAttribute(&v, gpuDevAttrMultiProcessorCount, dev);
    return v;
  }();
  return n;
}

template <auto kKernel>
int resident_ctas(int smem) {
  static const bool raised = [] {
    int dev = 0, optin = 0;
    (void)gpuGetDevice(&dev);
    (void)gpuDeviceGetAttribute(&optin, gpuDevAttrMaxSharedMemoryPerBlockOptin, dev);
    gpuFuncAttributes attr{};
    (void)gpuFuncGetAttributes(&attr, reinterpret_cast<const void*>(kKernel));
    return gpuFuncSetAttribute(reinterpret_cast<const void*>(kKernel), gpuFuncAttributeMaxDynamicSharedMemorySize,
                               optin - (int)attr.sharedSizeBytes) == gpuSuccess;
  }();
  (void)raised;
  static int cached_smem = -1, cached_ctas = 0;
  if (smem != cached_smem) {
    int per_sm = 0;
    (void)gpuOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kKernel, kThreads, smem);
    cached_ctas = sm_count() * std::max(per_sm, 1);
    cached_smem = smem;
  }
  return cached_ctas;
}

// Rows per warp: the largest R <= 4 that still gives every resident warp (about two CTAs of kWarps per SM)
// two groups of rows.
inline int pick_rows(int64_t rows_total) {
  const int64_t resident_warps = 2 * (int64_t)sm_count() * kWarps;
  int R = 4;
  while (R > 1 && rows_total / R < 2 * resident_warps) R /= 2;
  return R;
}

// Calls f(std::integral_constant<int, R>) for R in {1, 2, 4}, R <= kMaxR (wider column counts need the
// registers that more rows would take).
template <int kMaxR, class F>
void visit_rows(int R, F&& f) {
  if constexpr (kMaxR >= 4) {
    if (R >= 4) return f(std::integral_constant<int, 4>{});
  }
  if constexpr (kMaxR >= 2) {
    if (R >= 2) return f(std::integral_constant<int, 2>{});
  }
  f(std::integral_constant<int, 1>{});
}

template <class XT>
void quantize_x(gpuStream_t stream, const XT* x, int64_t T, int64_t K, uint8_t* ws) {
  const dim3 grid((unsigned)((K / 32 + kWarps - 1) / kWarps), (unsigned)T);
  quantize_x_kernel<XT><<<grid, kThreads, 0, stream>>>(x, reinterpret_cast<int8_t*>(ws),
                                                        reinterpret_cast<float*>(ws + limb_bytes(T, K)), K);
}

// Activations of up to this many bytes per CTA are copied to shared memory (read once per CTA instead of once
// per warp and row group); beyond it warps read them from global memory.
constexpr int64_t kXSmemBudget = 112 * 1024;

// Launches `kernel` over a grid of (persistent CTAs, ny): about as many CTAs per y as fit on the device at
// once when `busy_y` of the ny grid rows have work, at most one per kWarps row groups.
template <auto kKernel, int R, class... A>
void launch_persistent(gpuStream_t stream, const Args& a, int fixed_smem, unsigned ny, int busy_y, A... args) {
  const int smem = fixed_smem + (int)workspace_bytes(a.x_tokens, a.K);
  const int64_t groups = (a.N + R - 1) / R, ctas_needed = (groups + kWarps - 1) / kWarps;
  const int64_t per_y = std::max<int64_t>(1, resident_ctas<kKernel>(smem) / busy_y);
  kKernel<<<dim3((unsigned)std::min(ctas_needed, per_y), ny), kThreads, smem, stream>>>(a, args...);
}

inline Args make_args(const uint8_t* w, const uint8_t* ws, float* y, const QDims& d, int chunk_bytes, int64_t x_tokens) {
  return Args{w, reinterpret_cast<const int8_t*>(ws), reinterpret_cast<const float*>(ws + limb_bytes(d.T, d.K)), y,
              d.N, d.K, d.row_bytes, copy_width(w, d.row_bytes, chunk_bytes),
              workspace_bytes(x_tokens, d.K) <= kXSmemBudget ? (int)x_tokens : 0};
}

template <class Fmt, class XT>
void launch_qmatmul(gpuStream_t stream, const QDims& d, const uint8_t* w, const XT* x, uint8_t* ws, float* y) {
  quantize_x(stream, x, d.T, d.K, ws);
  const Args a = make_args(w, ws, y, d, Sub<Fmt>::kChunkBytes, std::min<int64_t>(d.T, kMaxCols));
  const unsigned tiles = (unsigned)((d.T + kMaxCols - 1) / kMaxCols);
  auto run = [&](auto nc, auto rc) {
    constexpr int kR = decltype(rc)::value;
    launch_persistent<qmatmul_kernel<Fmt, decltype(nc)::value, kR>, kR>(stream, a, kFixedSmemBytes<Fmt, kR>, tiles,
                                                                         (int)tiles, d.T);
  };
  const int R = pick_rows(d.N);
  visit_cols(d.T, [&](auto nc) { visit_rows<decltype(nc)::value == 8 ? 2 : 4>(R, [&](auto rc) { run(nc, rc); }); });
}

template <class Fmt, class XT>
void launch_qmatmul_id(gpuStream_t stream, const QDims& d, const uint8_t* w, const XT* x, const int32_t* ids,
                       uint8_t* ws, float* y) {
  quantize_x(stream, x, d.T, d.K, ws);
  const Args a = make_args(w, ws, y, d, Sub<Fmt>::kChunkBytes, d.T);
  const int P = (int)(d.T * d.k);
  visit_rows<2>(pick_rows(d.N * std::min(P, kMaxCols)), [&](auto rc) {
    constexpr int kR = decltype(rc)::value;
    // Slots beyond the first of each expert exit at once; with distinct experts per token about min(P, 8)
    // slots' CTAs run at a time.
    launch_persistent<qmatmul_id_kernel<Fmt, kR>, kR>(stream, a, kFixedSmemBytes<Fmt, kR>, (unsigned)P,
                                                      std::min(P, kMaxCols), ids, d.E, (int)d.k, P);
  });
}

}  // namespace i8
