// GPU packed matmul of several tokens on int8 tensor cores (mma.sync m16n8k32), for Q8_0 and IQ2_XXS rows,
// with the bits of the dp4a matvec (gpu_i8_matvec.cuh). Included by gpu_ffi.cu after the matvec; CUDA only
// (HIP builds keep the matvec for every call).
//
// Why: at verify widths the matvec is compute bound. Per row, token and 32 weights it pays 24 dp4a, six
// limb loads and the fp32 steps, so T = 4 costs about 1.6x T = 1 on the dense shapes (docs/kernels.md). Here
// one MMA per limb multiplies a 16-row tile's decoded sub-block into up to 8 tokens at once: the decode is
// paid once for all the tokens, and the integer work leaves the issue slots. What stays per (row, token,
// sub-block) is the fp32 epilogue, the same for every width up to 8 tokens.
//
// Same bits as the matvec: per (row, token, sub-block) the three limb dot products are exact int32 sums
// whatever unit adds them (limb 0 starting from 1.5·2^23, as the dp4a chain does), and the fp32 steps are the
// same functions of them (sub-block value, Sub<Fmt>::add) in the same order. That order, per output: chain
// c = b mod 32 sums its sub-blocks b in K order, and the 32 chains are added in the warp butterfly's tree
// (pairs c, c + 16, then + 8, + 4, + 2, + 1; cpu_i8_model.h). Warp w of a row tile's 8 owns the residues
// w, w + 8, w + 16, w + 24: it takes the sub-blocks b = w mod 8 in K order into chain (b / 8) mod 4, adds the
// tree's first two levels (16 and 8) in registers, and the CTA adds the last three over the 8 warps in shared
// memory. So a call gives the same outputs whichever kernel takes it, and a q-wide verify equals q steps.
//
// Layout: a CTA is 16 warps, 8 residue classes x 2 tiles of 16 rows: a CTA tile of 32 rows, persistent CTAs
// over the row tiles, one per SM (the activations of its tokens are staged once). The CTA streams (row tile,
// chunk) items, a chunk being MmaChunk::kSubs sub-blocks of each of the 32 rows, through kStages shared-memory
// stages with cp.async. MMA fragments (PTX ISA, m16n8k32 .s8; lane = 4g + t): A a0 = row g, k 4t..4t+3, a1 =
// row g + 8, a2 = row g, k 16 + 4t.., a3 = row g + 8, k 16 + 4t..; B b0 = k 4t..4t+3 of column g, b1 = k
// 16 + 4t..; D d0, d1 = row g, columns 2t, 2t + 1, d2, d3 = row g + 8. The k positions of thread t carry the
// sub-block's weights 8t..8t+7 in both operands (a permutation of k: the integer sums do not change), so a
// thread decodes one 8-weight group per row (IQ2_XXS: one grid entry) and loads 8 bytes of a token's limb.
// Columns are token slots, one MMA per limb.

namespace i8 {

#if defined(__HIPCC__)
template <class Fmt>
bool launch_qmma(gpuStream_t, const QDims&, MmaMode, const uint8_t*, const void*, bool, float*, int64_t) {
  return false;
}
#else

constexpr int kMmaClasses = 8, kMmaRowTiles = 2, kMmaWarps = kMmaClasses * kMmaRowTiles;
constexpr int kMmaThreads = kMmaWarps * kLanes;
constexpr int kMmaRows = 16 * kMmaRowTiles;  // rows per CTA tile

// A chunk per row: kSubs sub-blocks (kSubs / 8 per warp, a multiple of 4 so that chain (b / 8) mod 4 is the
// static i mod 4), kBytes of the row at a kRowStride stride in a stage (16-byte aligned for the copies, and
// putting the 8 rows of a warp's loads in distinct banks: 528 = 16 mod 128 bytes, 1104 = 20 banks apart).
template <class Fmt>
struct MmaChunk;
template <>
struct MmaChunk<FmtIQ2_XXS> {  // 8 blocks
  static constexpr int kSubs = 64, kBytes = 528, kRowStride = 528, kStages = 4;
};
template <>
struct MmaChunk<FmtQ8_0> {  // 32 blocks
  static constexpr int kSubs = 32, kBytes = 1088, kRowStride = 1104, kStages = 3;
};
template <class Fmt>
constexpr bool kHasMma = std::is_same_v<Fmt, FmtQ8_0> || std::is_same_v<Fmt, FmtIQ2_XXS>;

// Weights 8t..8t+7 of sub-block `sub` of a staged row chunk as two int8 words (the words 2t, 2t + 1 that
// Sub<Fmt>::decode gives), and the sub-block's scale.
template <class Fmt>
struct MmaGroup;
template <>
struct MmaGroup<FmtQ8_0> {
  __device__ __forceinline__ static float decode(const uint8_t* chunk, int sub, int t, uint32_t& lo, uint32_t& hi,
                                                 const Tables&) {
    const uint32_t b = 34u * (uint32_t)sub;
    uint32_t q[2];
    words_at<2>(chunk, b + 2u + 8u * (uint32_t)t, q);
    lo = q[0];
    hi = q[1];
    return half_to_float(*reinterpret_cast<const uint16_t*>(chunk + b));
  }
};
template <>
struct MmaGroup<FmtIQ2_XXS> {
  __device__ __forceinline__ static float decode(const uint8_t* chunk, int sub, int t, uint32_t& lo, uint32_t& hi,
                                                 const Tables& tab) {
    const uint32_t blk = 66u * (uint32_t)(sub >> 3);
    const uint32_t o = blk + 2u + 8u * (uint32_t)(sub & 7);  // 4 grid indices, then the signs and the scale
    uint32_t a1;
    words_at<1>(chunk, o + 4u, &a1);
    const uint32_t grid_index = chunk[o + (uint32_t)t];
    iq2_group(tab, grid_index << 6, ((a1 >> (7 * t)) & 127u) << 6, lo, hi);
    return iq2_scale(half_to_float(*reinterpret_cast<const uint16_t*>(chunk + blk)), a1);
  }
};

// The kernel's activations: per sub-block and limb, NT token slots of 32 bytes (element k at byte k), so a
// limb's B fragment is one 8-byte load per lane and a warp's loads are NT · 32 contiguous bytes; the scales
// float [nsub][NT].
template <int NT>
struct SubBlockMajor {
  __device__ __forceinline__ static uint2* limbs(uint8_t* dst, uint32_t, uint32_t slot, uint32_t sb, uint32_t q) {
    return reinterpret_cast<uint2*>(dst + ((sb * 3) * NT + slot) * 32 + 8 * q);
  }
  __device__ __forceinline__ static uint32_t limb_stride(uint32_t) { return NT * 32 / 8; }
  __device__ __forceinline__ static uint32_t scale_index(uint32_t, uint32_t slot, uint32_t sb) { return sb * NT + slot; }
};

// d = A·B + c (c in every element): one 16 x 8 x 32 int8 product, exact in int32.
__device__ __forceinline__ void mma_s8(int (&d)[4], const uint32_t (&a)[4], uint2 b, int c) {
  asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%10,%10,%10};"
      : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b.x), "r"(b.y), "r"(c));
}

// The CTA's stream of (row tile, chunk) items into its ring of kStages stages: row tiles first, first + stride,
// ... below `end`. Each thread copies its kPieces 16-byte pieces of a stage (piece p = thread + k · kMmaThreads
// of the stage's rows x kBytes / 16); a tile's rows past N copy its last row again. `start` issues the first
// kStages - 1 items, `issue` the next (committing a copy group even when there is nothing left to copy).
template <class Fmt>
struct MmaStream {
  using C = MmaChunk<Fmt>;
  static constexpr int kPiecesPerRow = C::kBytes / 16;
  static constexpr int kPieces = (kMmaRows * kPiecesPerRow + kMmaThreads - 1) / kMmaThreads;
  static constexpr int kStageBytes = kMmaRows * C::kRowStride;
  Args a;
  gpu_smem_t stages;
  int stride, end, nchunks, len_last;
  int tile, chunk, slot;  // the next item to copy, and its stage
  const uint8_t* src[kPieces];
  int dst[kPieces], col[kPieces];  // a piece's offset in a stage and in a row's chunk (INT_MAX: no piece)

  __device__ MmaStream(const Args& args, uint8_t* ring, int first, int tile_stride, int tile_end)
      : a(args), stages(gpu_smem(ring)), stride(tile_stride), end(tile_end), tile(first), chunk(0), slot(0) {
    nchunks = (int)((a.row_bytes + C::kBytes - 1) / C::kBytes);
    len_last = (int)(a.row_bytes - (int64_t)(nchunks - 1) * C::kBytes);
#pragma unroll
    for (int k = 0; k < kPieces; ++k) {
      const int p = (int)threadIdx.x + k * kMmaThreads, row = p / kPiecesPerRow, c = (p % kPiecesPerRow) * 16;
      const bool real = p < kMmaRows * kPiecesPerRow;
      dst[k] = real ? row * C::kRowStride + c : 0;
      col[k] = real ? c : INT_MAX;
    }
  }

  __device__ __forceinline__ void issue() {
    if (tile < end) {
      if (chunk == 0) {
#pragma unroll
        for (int k = 0; k < kPieces; ++k) {
          const int64_t row = (int64_t)tile * kMmaRows + dst[k] / C::kRowStride;
          src[k] = a.w + (row < a.N ? row : a.N - 1) * a.row_bytes + (dst[k] % C::kRowStride);
        }
      }
      const int len = chunk == nchunks - 1 ? len_last : C::kBytes;
      const gpu_smem_t stage = stages + slot * kStageBytes;
#pragma unroll
      for (int k = 0; k < kPieces; ++k) {
        if (col[k] < len) gpu_copy_async(stage + dst[k], src[k], 16);
        src[k] += C::kBytes;
      }
      if (++chunk == nchunks) {
        chunk = 0;
        tile += stride;
      }
    }
    gpu_copy_commit();
    slot = slot + 1 == C::kStages ? 0 : slot + 1;
  }

  __device__ __forceinline__ void start() {
    for (int i = 0; i < C::kStages - 1; ++i) issue();
  }
};

// What a lane multiplies in a chunk: its residue class and quad index t, the chunk's first sub-block, and its
// B fragments' and scales' addresses at sub-block 0.
struct MmaLane {
  int cls, t, sb0;
  const uint8_t* limbs;
  const float* scales;
};

// One chunk of a lane's 16-row tile (`st`: row g of the tile in the stage) into its chains: sub-blocks
// cls + 8i of the chunk, chain i mod 4. kCheck: the chunk may run past the row's last sub-block (a branch per
// sub-block, which also keeps the compiler from overlapping them, so full chunks take the other instance).
template <class Fmt, int NT, bool kCheck>
__device__ __forceinline__ void mma_chunk(const uint8_t* st, const MmaLane& ln, int nsub, const Tables& tab,
                                          float (&acc)[4][4]) {
  using C = MmaChunk<Fmt>;
#pragma unroll
  for (int i = 0; i < C::kSubs / kMmaClasses; ++i) {
    const int sub = ln.cls + kMmaClasses * i, sb = ln.sb0 + sub;
    if (kCheck && sb >= nsub) continue;
    uint32_t w[4];
    const float d_lo = MmaGroup<Fmt>::decode(st, sub, ln.t, w[0], w[2], tab);
    const float d_hi = MmaGroup<Fmt>::decode(st + 8 * C::kRowStride, sub, ln.t, w[1], w[3], tab);
    const uint8_t* xl = ln.limbs + sb * 3 * NT * 32;
    int I0[4], I1[4], I2[4];
    mma_s8(I0, w, *reinterpret_cast<const uint2*>(xl), kBiasedZero);
    mma_s8(I1, w, *reinterpret_cast<const uint2*>(xl + NT * 32), 0);
    mma_s8(I2, w, *reinterpret_cast<const uint2*>(xl + 2 * NT * 32), 0);
    const float2 xs = *reinterpret_cast<const float2*>(ln.scales + sb * NT);
#pragma unroll
    for (int o = 0; o < 4; ++o) {
      const float v = f32_fma(unbias(I0[o]), 65536.0f, i2f_rn(I1[o] * 256 + I2[o]));  // sub_block_value
      acc[i % 4][o] = Sub<Fmt>::add(o < 2 ? d_lo : d_hi, o % 2 ? xs.y : xs.x, v, 0, 0, acc[i % 4][o]);
    }
  }
}

// Shared memory of a launch for NT token slots of K: the IQ2_XXS tables, the ring, the activations, then the
// warps' partial sums (levels 16 and 8 of the tree: [row tile][class][16 rows][NT]).
template <int NT>
constexpr int64_t kMmaPartialBytes = (int64_t)kMmaRowTiles * kMmaClasses * 16 * NT * 4;
template <class Fmt, int NT>
int64_t mma_smem_bytes(int64_t K) {
  return Sub<Fmt>::kTableBytes + (int64_t)MmaChunk<Fmt>::kStages * MmaStream<Fmt>::kStageBytes +
         NT * x_token_bytes(K, false) + kMmaPartialBytes<NT>;
}

// Grid (persistent CTAs over the row tiles, token tiles of `slots` <= NT tokens, groups). T tokens times a.w, or,
// with gridDim.z = G groups, a grouped projection: token t's row t · G + g of x times matrix g of a.w ([G, N]
// rows) into row t · G + g of y.
template <class Fmt, int NT>
__global__ void __launch_bounds__(kMmaThreads, 1) qmma_kernel(Args a, const void* __restrict__ x, bool bf16, int64_t T,
                                                              int slots) {
  using C = MmaChunk<Fmt>;
  using Stream = MmaStream<Fmt>;
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ int s_rows[kMaxCols];
  TableFill<Fmt, kMmaWarps> tables;
  tables.load();
  const int row_tiles = (int)((a.N + kMmaRows - 1) / kMmaRows);
  a.w += (int64_t)blockIdx.z * a.N * a.row_bytes;
  uint8_t* ring = smem + Sub<Fmt>::kTableBytes;
  Stream rows(a, ring, (int)blockIdx.x, (int)gridDim.x, row_tiles);
  rows.start();
  const Tables tab = tables.store(smem);
  const int ncols = token_tile(T, slots, s_rows, (int)gridDim.z, (int)blockIdx.z);
  __syncthreads();
  uint8_t* xdst = ring + C::kStages * Stream::kStageBytes;
  const XView xv = stage_x<kMmaWarps, false, SubBlockMajor<NT>>(XSource{x, bf16, a.K, s_rows, ncols, NT, xdst});
  float* partial = reinterpret_cast<float*>(xdst + NT * x_token_bytes(a.K, false));

  const int warp = (int)threadIdx.x / kLanes, lane = (int)threadIdx.x % kLanes, g = lane / 4, t = lane % 4;
  const int cls = warp % kMmaClasses, half = warp / kMmaClasses;
  const int nsub = (int)(a.K / 32);
  // this lane's B fragments (token g, weights 8t..8t+7; slots past NT repeat, their outputs unused) and scales
  const uint8_t* xl0 = reinterpret_cast<const uint8_t*>(xv.limbs) + (g % NT) * 32 + 8 * t;
  const float* xs0 = xv.scales + (2 * t) % NT;
  float acc[4][4];  // [chain][output d0..d3]
  int slot = 0;
  for (int tile = (int)blockIdx.x, chunk = 0; tile < row_tiles;) {
    gpu_copy_wait<C::kStages - 2>();
    __syncthreads();  // every thread's copies of this item have landed, and the previous item's stage is free
    rows.issue();
    if (chunk == 0) {
#pragma unroll
      for (int c = 0; c < 4; ++c)
#pragma unroll
        for (int o = 0; o < 4; ++o) acc[c][o] = 0.0f;
    }
    const uint8_t* st = smem + Sub<Fmt>::kTableBytes + slot * Stream::kStageBytes + (half * 16 + g) * C::kRowStride;
    const MmaLane lane_at{cls, t, chunk * C::kSubs, xl0, xs0};
    if ((chunk + 1) * C::kSubs <= nsub) mma_chunk<Fmt, NT, false>(st, lane_at, nsub, tab, acc);
    else mma_chunk<Fmt, NT, true>(st, lane_at, nsub, tab, acc);  // the last chunk of a row, partial
    if (chunk == rows.nchunks - 1) {
      float* mine = partial + (half * kMmaClasses + cls) * 16 * NT;
#pragma unroll
      for (int o = 0; o < 4; ++o) {
        const int row = g + 8 * (o / 2), tok = 2 * t + o % 2;
        if (tok < NT) mine[row * NT + tok] = f32_add(f32_add(acc[0][o], acc[2][o]), f32_add(acc[1][o], acc[3][o]));
      }
      __syncthreads();
      for (int j = (int)threadIdx.x; j < kMmaRowTiles * 16 * NT; j += kMmaThreads) {
        const int r = j % 16, tok = (j / 16) % NT, h = j / (16 * NT);
        const float* p = partial + (h * kMmaClasses * 16 + r) * NT + tok;  // class L at + L · 16 · NT
        float s[kMmaClasses];
#pragma unroll
        for (int L = 0; L < kMmaClasses; ++L) s[L] = p[L * 16 * NT];
#pragma unroll
        for (int m = kMmaClasses / 2; m >= 1; m /= 2)
#pragma unroll
          for (int L = 0; L < m; ++L) s[L] = f32_add(s[L], s[L + m]);
        const int64_t row = (int64_t)tile * kMmaRows + h * 16 + r;
        if (row < a.N && tok < ncols) a.y[(int64_t)s_rows[tok] * a.N + row] = s[0];
      }
    }
    slot = slot + 1 == C::kStages ? 0 : slot + 1;
    if (++chunk == rows.nchunks) {
      chunk = 0;
      tile += (int)gridDim.x;
    }
  }
  gpu_copy_wait<0>();
}

// Whether the tensor-core kernel beats the matvec on a call of T tokens of K in `tiles` token tiles over
// `row_tiles` tiles of 32 rows (tuning.h, kMmaCrossover).
inline bool mma_pays(int64_t T, int64_t K, int64_t row_tiles, int64_t tiles) {
  constexpr tuning::MmaCrossover c = tuning::kMmaCrossover;
  if (T < c.min_tokens_per_tile * tiles || row_tiles < c.min_row_tiles) return false;
  return T >= c.any_shape_tokens || (K >= c.long_k && row_tiles >= c.long_row_tiles);
}

// Launches the tensor-core kernel for a call of T >= 2 tokens: dense (groups = 1: x [T, K], w [N] rows), or a
// grouped projection (x [T · groups, K], w [groups, N] rows, d.T = T · groups); false (nothing launched) when it
// does not take the call: another format, rows the 16-byte copies cannot read, not even 4 tokens' activations
// fit, or (unless forced) the matvec is faster there (mma_pays, counting the row tiles of every group). Token
// tiles (grid y) of up to 8 tokens, or 4 where 8 do not fit, split evenly; the SMs split evenly among the
// (token tile, group) pairs (grid z: groups).
template <class Fmt>
bool launch_qmma(gpuStream_t stream, const QDims& d, MmaMode mode, const uint8_t* w, const void* x, bool bf16,
                 float* y, int64_t groups) {
  if constexpr (!kHasMma<Fmt>) {
    return false;
  } else {
    const int64_t T = d.T / groups;
    if (T < 2 || mode == MmaMode::kOff || copy_width(w, d.row_bytes, MmaChunk<Fmt>::kBytes) != 16) return false;
    const int64_t row_tiles = (d.N + kMmaRows - 1) / kMmaRows;
    const int sms = sm_count();
    const auto launch = [&](auto ntc) {
      constexpr int NT = decltype(ntc)::value;
      constexpr auto kKernel = qmma_kernel<Fmt, NT>;
      const int64_t smem = mma_smem_bytes<Fmt, NT>(d.K);
      if (smem + (int64_t)kMaxCols * 4 > smem_optin()) return false;
      const int64_t tiles = (T + NT - 1) / NT;
      if (mode == MmaMode::kAuto && !mma_pays(T, d.K, groups * row_tiles, tiles)) return false;
      allow_max_dynamic_smem<kKernel>();
      const int64_t ctas = std::clamp<int64_t>(sms / (tiles * groups), 1, row_tiles);
      const int slots = (int)((T + tiles - 1) / tiles);
      kKernel<<<dim3((unsigned)ctas, (unsigned)tiles, (unsigned)groups), kMmaThreads, (int)smem, stream>>>(
          Args{w, y, d.N, d.K, d.row_bytes, 16}, x, bf16, T, slots);
      return true;
    };
    return (T > 4 && launch(std::integral_constant<int, 8>{})) || launch(std::integral_constant<int, 4>{});
  }
}

#endif

}  // namespace i8
