// GPU packed matvec for Q8_0, Q2_K, Q4_K and IQ2_XXS on integer dot products (included by gpu_ffi.cu; the
// arithmetic per lane is i8_math.h's, which the CPU plugin's model of this path shares).
//
// Why: at decode widths the matvec must stream weights at memory speed, and an fp32 multiply-add per
// weight plus the decode of each weight to fp32 costs more instructions than an H200 SM can issue at that
// rate for 2-bit weights. Here weights are decoded to int8 (4 per 32-bit word) and multiplied with
// integer dot products (dp4a) against an exact-enough integer form of the activations:
//
//   * activations, per token and per 32-element sub-block b: X_j = rint(x_j · 2^(22-e_b)) where
//     2^(e_b-1) <= max_j |x_j| < 2^e_b, so |X_j| <= 2^22 and each x_j is kept to 2^-23 of the sub-block's
//     largest magnitude. X_j = 65536·L0_j + 256·L1_j + L2_j with balanced int8 limbs. Each CTA computes the
//     limbs of the tokens it serves straight into shared memory (`stage_x`), so a call is one launch;
//   * per sub-block, row and token: I_l = Σ_j w_j·L_lj exactly in int32 (dp4a), then in fp32
//     v = fma(I0, 65536, I1·256 + I2) and acc = fma(d_w · 2^(e_b-22), v, acc) over the sub-blocks in order.
//     Q2_K's weights are q·sc (its 16-weight scale folded into the int8 weight, at most 3·15) with d_w = d,
//     and its mins add fma(-dmin · 2^(e_b-22), m_0·ΣX_0 + m_1·ΣX_1, acc), ΣX_h the exact sum of the
//     sub-block's half h (16 elements, staged with the limbs), so its 2.6-bit experts skip the float path.
//     Q4_K's weights are its 4-bit codes, its 6-bit sub-block scale folded into d_w = d·sc (exact in fp32), and
//     its mins add fma(-dmin·m · 2^(e_b-22), ΣX_0 + ΣX_1, acc) the same way.
//
// Every output's operation sequence depends only on its own row and token: batch invariant in T, in the
// tokens sharing a CTA and in the rows sharing a warp.
//
// Layout: each warp owns groups of R rows (R = 1, 2, 4 per call) over the whole of K, taken in a
// grid-stride loop; a group's K is cut into chunks of S sub-blocks of 32 weights per lane (S = 2, or 1 for Q8_0
// passes of several tokens: Chunk, kSubPerLaneMany). The warp
// streams (group, chunk) items through a ring of kStages shared-memory stages with asynchronous copies,
// kStages-1 items ahead, across group boundaries. IQ2_XXS selector tables live in shared memory,
// replicated per lane of a half-warp so random lookups take at most two wavefronts. The L1/TEX pipe was the
// busiest unit in an earlier profile, so every layout below is chosen for conflict-free 16-byte (activations)
// or 4-byte (tables) loads: fewer table copies measured slower (docs/kernels.md has the limits).

namespace i8 {
using namespace ::dspark::i8math;  // the arithmetic, shared with the CPU plugin's model of this path

// Warps per SM these kernels are laid out for (launch bounds, token_slots, the rows per group): two CTAs of
// kWarps, or, for most dense calls and grouped projections of several tokens (the launchers say which), one CTA
// of kWideWarps, which stages the tokens once per SM instead of twice. A third CTA of 8 warps per SM measured
// slower (docs/kernels.md#tuning-ctas-per-sm-and-token-slots).
constexpr int kWarpsPerSm = 16;
constexpr int kWarps = 8, kWideWarps = 16;

// ---- activations in shared memory ----
// Token slot i of a CTA: its limbs at i·3K bytes, as 6 arrays of K/32 16-byte words: array 2l+h holds half h
// (bytes 16h..16h+15) of the limb-l words of every sub-block, so the 32 lanes of a warp, reading consecutive
// sub-blocks, load consecutive 16-byte words. The scales (float [slots][K/32]) follow all slots' limbs, and
// for formats with mins (`sums`) the exact sums of each sub-block's two halves of X (int2 [slots][K/32]).
DSPARK_HD int64_t x_token_bytes(int64_t K, bool sums) { return K * 3 + (K / 32) * (sums ? 12 : 4); }

struct XView {
  const uint4* limbs;   // slot i, limb array a: limbs + i * 6 * nsub + a * nsub (16-byte words)
  const float* scales;  // slot i: scales + i * nsub
  const int2* sums;     // slot i: sums + i * nsub (formats with mins only)
  int nsub;
};

// Where a CTA's activations come from: tokens rows[0..ntok) of x (float32 or bfloat16 [T, K]), quantised into
// slots 0..ntok-1 at `dst` (the layout above, `slots` slots reserved).
struct XSource {
  const void* x;
  bool bf16;
  int64_t K;
  const int* rows;
  int ntok, slots;
  uint8_t* dst;
};

// Steps of a warp's staging loop whose global loads are in flight together (two sub-blocks per lane group).
constexpr int kStageBatch = 2;

// Where stage_tokens puts the limbs and the scale of (token slot, sub-block sb), for the lane holding elements
// 8q..8q+7 (its limb-0 word pair; limb l is l · limb_stride words further) and call index i = slot · nsub + sb.
// SlotMajor is the matvec's layout above; the tensor-core kernel has its own (gpu_i8_mma.cuh).
struct SlotMajor {
  __device__ __forceinline__ static uint2* limbs(uint8_t* dst, uint32_t K, uint32_t slot, uint32_t sb, uint32_t q) {
    return reinterpret_cast<uint2*>(dst + slot * 3 * K + (q / 2) * (K / 2) + sb * 16) + q % 2;
  }
  __device__ __forceinline__ static uint32_t limb_stride(uint32_t K) { return K / 8; }  // 2 arrays of K/2 bytes
  __device__ __forceinline__ static uint32_t scale_index(uint32_t i, uint32_t, uint32_t) { return i; }
};

// Quantises the activations of `src` into shared memory. Lane group g = lane / 4 of a warp takes sub-block
// i = 8·(warp step) + g of the call's (token, sub-block) sequence, lane q = lane % 4 its elements 8q..8q+7 (the
// index, address and reduction work per lane is paid once per 8 activations); the sub-block's largest
// magnitude is an integer max over the 4 lanes (on |bits|, so a NaN or inf anywhere wins and gives a NaN
// scale). Offsets in shared memory are 32-bit (it is at most 228 KB). Every step of the loop runs in every
// lane, past the last sub-block too (its loads skipped): an early exit from a batch raises the MoE kernel's
// register count. With kSums, lanes q = 0 and 2 also store the sum of X over their
// half of the sub-block (their 8 elements and lane q + 1's). `Layout` says where the limbs and scales go.
template <class XT, int W, bool kSums, class Layout>
__device__ __forceinline__ void stage_tokens(const XSource& src, float* scales, int* sums) {
  const uint32_t nsub = (uint32_t)(src.K / 32), total = (uint32_t)src.ntok * nsub, K = (uint32_t)src.K;
  const uint32_t warp = threadIdx.x / kLanes, lane = threadIdx.x % kLanes, q = lane % 4;
  const XT* x = static_cast<const XT*>(src.x);
  for (uint32_t i0 = warp * 8 + lane / 4; i0 - lane / 4 < total; i0 += W * 8 * kStageBatch) {
    float v[kStageBatch][8];
    uint32_t slot[kStageBatch], sb[kStageBatch];
#pragma unroll
    for (int u = 0; u < kStageBatch; ++u) {
      const uint32_t i = i0 + u * W * 8;
      slot[u] = i / nsub;
      sb[u] = i - slot[u] * nsub;
      if (i < total) load8(x + (int64_t)src.rows[slot[u]] * src.K + sb[u] * 32 + 8 * q, v[u]);
      else
#pragma unroll
        for (int k = 0; k < 8; ++k) v[u][k] = 0.0f;
    }
#pragma unroll
    for (int u = 0; u < kStageBatch; ++u) {
      const uint32_t i = i0 + u * W * 8;
      uint32_t m = 0;
#pragma unroll
      for (int k = 0; k < 8; ++k) m = max(m, __float_as_uint(v[u][k]) & 0x7FFFFFFFu);
      for (int s = 1; s < 4; s <<= 1) m = max(m, __float_as_uint(gpu_shfl_xor(__uint_as_float(m), s)));
      if (!kSums && i >= total) continue;
      float sc = 0.0f;
      uint32_t limbs[3][2] = {{0, 0}, {0, 0}, {0, 0}};
      int xsum = 0;
      if (m >= 0x7F800000u) {
        sc = __int_as_float(0x7fc00000);
      } else if (m > 0) {
        const int e = block_exponent(m);
        sc = exp2_int(e - 22);
        limbs8(v[u], e, limbs, xsum);
      }
      if constexpr (kSums) {  // every lane gets here (past the last sub-block its v are 0): the shuffle is whole
        xsum += __float_as_int(gpu_shfl_xor(__int_as_float(xsum), 1));
        if (i >= total) continue;
        if (q % 2 == 0) sums[2 * i + q / 2] = xsum;
      }
      uint2* out = Layout::limbs(src.dst, K, slot[u], sb[u], q);
#pragma unroll
      for (int l = 0; l < 3; ++l) out[l * Layout::limb_stride(K)] = make_uint2(limbs[l][0], limbs[l][1]);
      if (q == 0) scales[Layout::scale_index(i, slot[u], sb[u])] = sc;
    }
  }
}

// Quantises the activations of `src` into shared memory (with the half sums where kSums), then a CTA barrier
// (every thread of the W warps must call it).
template <int W, bool kSums, class Layout = SlotMajor>
__device__ __forceinline__ XView stage_x(const XSource& src) {
  const int nsub = (int)(src.K / 32);
  float* scales = reinterpret_cast<float*>(src.dst + (int64_t)src.slots * 3 * src.K);
  int* sums = reinterpret_cast<int*>(scales + src.slots * nsub);
  if (src.bf16) stage_tokens<bf16_t, W, kSums, Layout>(src, scales, sums);
  else stage_tokens<float, W, kSums, Layout>(src, scales, sums);
  __syncthreads();
  return XView{reinterpret_cast<const uint4*>(src.dst), scales, reinterpret_cast<const int2*>(sums), nsub};
}

// ---- sub-block decoders (i8_math.h) and the IQ2_XXS tables in shared memory ----
__device__ const Iq2Selectors kIq2SelectorsDevice = make_iq2_selectors();
__device__ const uint32_t kPoolLoDevice = kPoolLo;  // Tables::pool_lo's source

// The replicated tables of a CTA of W warps, filled from the device's constant arrays in two steps: `load` reads
// this thread's selector words (one global round trip, which the kernels start first so that it overlaps the
// MoE ids, the weights' first copies and the activations), `store` writes them, each as a 16-byte store of four
// copies of one entry, then a CTA barrier. Formats without tables do neither.
template <class Fmt, int W, bool = (Sub<Fmt>::kTableBytes > 0)>
struct TableFill {
  __device__ __forceinline__ void load() {}
  __device__ __forceinline__ Tables store(uint8_t* smem) const { return Tables{smem, kPoolLo}; }
};
template <class Fmt, int W>
struct TableFill<Fmt, W, true> {
  static constexpr int kThreads = W * kLanes;
  static constexpr int kGridPer = 256 * 4 / kThreads, kSignPer = 128 * 4 / kThreads;  // 16-byte stores per thread
  uint32_t g[kGridPer], m[kSignPer], pool_lo;

  __device__ __forceinline__ void load() {
    pool_lo = *static_cast<const volatile uint32_t*>(&kPoolLoDevice);  // volatile: not folded to the constant
#pragma unroll
    for (int j = 0; j < kGridPer; ++j) g[j] = kIq2SelectorsDevice.grid[(threadIdx.x + j * kThreads) >> 2];
#pragma unroll
    for (int j = 0; j < kSignPer; ++j) m[j] = kIq2SelectorsDevice.sign[(threadIdx.x + j * kThreads) >> 2];
  }
  __device__ __forceinline__ Tables store(uint8_t* smem) const {
    uint4* grid = reinterpret_cast<uint4*>(smem);
    uint4* sign = reinterpret_cast<uint4*>(smem + kGridBytes);
#pragma unroll
    for (int j = 0; j < kGridPer; ++j) grid[threadIdx.x + j * kThreads] = make_uint4(g[j], g[j], g[j], g[j]);
#pragma unroll
    for (int j = 0; j < kSignPer; ++j) sign[threadIdx.x + j * kThreads] = make_uint4(m[j], m[j], m[j], m[j]);
    __syncthreads();
    return Tables{smem + (threadIdx.x & 15) * 4, pool_lo};
  }
};

struct Args {
  const uint8_t* w;  // rows of the selected matrix
  float* y;
  int64_t N, K, row_bytes;
  int copy_bytes;  // 16, 8 or 4: asynchronous copy width (divides the rows, the chunks and the base address)
};

// A position in a warp's stream of (group of R rows, K chunk) items.
struct Cursor {
  int group;  // a weight has fewer than 2^31 rows
  int chunk;
  __device__ __forceinline__ void next(int stride, int nchunks) {
    if (++chunk == nchunks) {
      chunk = 0;
      group += stride;
    }
  }
};

// A chunk of a group's K: S sub-blocks per lane (sub-block h·32 + lane of the chunk is lane's h-th), staged
// per row at a 16-byte aligned stride (+ 4: the decoders read one word past a row).
template <class Fmt, int S>
struct Chunk {
  static constexpr int kSubs = S * kLanes;
  static constexpr int kBytes = Sub<Fmt>::bytes_of(kSubs);
  static constexpr int kRowStride = (kBytes + 4 + 15) / 16 * 16;
};

// Sub-blocks per lane per chunk. Two give one token's loop two independent sub-blocks (instruction-level
// parallelism); with several tokens per pass the tokens give it, and a Q8_0 chunk of one sub-block per lane
// (1 KB per row instead of 2) leaves room for more rows per group next to the tokens' activations, each
// activation load then serving more rows. IQ2_XXS chunks are small either way (528 bytes per row at two).
constexpr int kSubPerLaneOne = 2;
template <class Fmt>
constexpr int kSubPerLaneMany = Chunk<Fmt, 2>::kBytes > 1024 ? 1 : 2;

// Stages of a warp's copy ring: enough that about 4 KB of each warp's rows are in flight while it computes.
template <class Fmt, int R, int S>
constexpr int kStages = std::min(8, std::max(2, 1 + (4096 + R * Chunk<Fmt, S>::kBytes - 1) / (R * Chunk<Fmt, S>::kBytes)));

// Sub-block `sub` of a staged chunk (global sub-block index sb) for R rows and the first ncols of NC token
// slots: exact int32 limb dot products (their summation order is free: integer adds are exact), then one fixed
// fp32 sequence into acc. A group's rows past N hold copies of its last row (see warp_rows), so every row is
// computed without a branch and only the stores skip them.
template <class Fmt, int NC, int R, int S>
__device__ __forceinline__ void sub_block(const XView& xv, int ncols, const uint8_t* st, int sub, int sb,
                                          const Tables& tab, float (&acc)[R][NC]) {
  using D = Sub<Fmt>;
  uint32_t q[R][8];
  typename D::Scale dw[R];
#pragma unroll
  for (int r = 0; r < R; ++r) dw[r] = D::decode(st + r * Chunk<Fmt, S>::kRowStride, sub, q[r], tab);
#pragma unroll
  for (int t = 0; t < NC; ++t) {
    if (t < ncols) {
      const uint4* xl = xv.limbs + t * 6 * xv.nsub + sb;
      int xw[3][8];
#pragma unroll
      for (int l = 0; l < 3; ++l) {
        const uint4 u = xl[2 * l * xv.nsub], v = xl[(2 * l + 1) * xv.nsub];
        xw[l][0] = (int)u.x; xw[l][1] = (int)u.y; xw[l][2] = (int)u.z; xw[l][3] = (int)u.w;
        xw[l][4] = (int)v.x; xw[l][5] = (int)v.y; xw[l][6] = (int)v.z; xw[l][7] = (int)v.w;
      }
      const float xs = xv.scales[t * xv.nsub + sb];
      const int2 sums = D::kSums ? xv.sums[t * xv.nsub + sb] : int2{0, 0};
#pragma unroll
      for (int r = 0; r < R; ++r) acc[r][t] = D::add(dw[r], xs, sub_block_value(q[r], xw), sums.x, sums.y, acc[r][t]);
    }
  }
}

// Starts this lane's share of the asynchronous copy of R rows' chunks (at most CB bytes each) in V-byte
// pieces: row r from src[r] to dst + r · `stride`, both at the lane's first piece, `len` the chunk's length
// from there; the lane copies every 32nd piece. The loop is unrolled over a chunk's pieces with constant
// offsets (a rolled loop with 64-bit address arithmetic per piece cost about as many instructions per chunk as
// a token's dot products at T = 1).
template <int V, int CB, int R>
__device__ __forceinline__ void copy_rows(gpu_smem_t dst, int stride, const uint8_t* const (&src)[R], int len) {
  constexpr int kStep = kLanes * V;
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int o = 0; o < CB; o += kStep)
      if (o < len) gpu_copy_async(dst + r * stride + o, src[r] + o, V);
  }
}

// A warp's stream of (group of R rows, K chunk) items into its ring of kStages shared-memory stages: groups
// group0, group0 + stride, ... below group_end of R rows over all of K. `start` issues the first kStages - 1
// copies, `issue` the next one. The kernels start it right after the tables' loads (the token columns and the
// activations each cost a global round trip first), so the weights' DRAM latency overlaps them.
template <class Fmt, int R, int S>
struct RowStream {
  using C = Chunk<Fmt, S>;
  static constexpr int kCB = C::kBytes, kRS = C::kRowStride, kD = kStages<Fmt, R, S>;
  Args a;
  uint8_t* stages;  // this warp's ring
  int group0, stride, group_end;
  int nchunks, len_full, len_last;  // per row, from this lane's first copy piece on: a whole chunk, the last
  Cursor in;                        // next item to copy
  int slot_in;
  const uint8_t* src[R];  // chunk `in.chunk` of the rows of group `in.group`, from this lane's first copy piece on

  __device__ RowStream(const Args& args, uint8_t* warp_stages, int first_group, int group_stride, int end)
      : a(args), stages(warp_stages), group0(first_group), stride(group_stride), group_end(end), in{first_group, 0},
        slot_in(0) {
    const int lane = threadIdx.x % kLanes, nsub = (int)(a.K / 32);
    nchunks = (nsub + C::kSubs - 1) / C::kSubs;
    len_full = kCB - lane * a.copy_bytes;
    len_last = (int)(a.row_bytes - (int64_t)(nchunks - 1) * kCB) - lane * a.copy_bytes;
  }

  // Starts copying item `in` into stage slot_in, then commits the copy group (also when there is nothing to
  // copy, so group counting stays uniform). A group's rows past N copy its last row again.
  __device__ __forceinline__ void issue() {
    const int v = a.copy_bytes, lane = threadIdx.x % kLanes;
    if (in.group < group_end) {
      if (in.chunk == 0) {
        const int64_t row0 = (int64_t)in.group * R;
#pragma unroll
        for (int r = 0; r < R; ++r) src[r] = a.w + (row0 + r < a.N ? row0 + r : a.N - 1) * a.row_bytes + lane * v;
      }
      const gpu_smem_t dst = gpu_smem(stages) + (slot_in * R * kRS + lane * v);
      const int len = in.chunk == nchunks - 1 ? len_last : len_full;
      if (v == 16) copy_rows<16, kCB, R>(dst, kRS, src, len);
      else if (v == 8) copy_rows<8, kCB, R>(dst, kRS, src, len);
      else copy_rows<4, kCB, R>(dst, kRS, src, len);
#pragma unroll
      for (int r = 0; r < R; ++r) src[r] += kCB;
      in.next(stride, nchunks);
    }
    gpu_copy_commit();
    slot_in = slot_in + 1 == kD ? 0 : slot_in + 1;
  }

  __device__ __forceinline__ void start() {
    for (int i = 0; i < kD - 1; ++i) issue();
  }

  // Starts the stream again from its first group (another pass over the same rows).
  __device__ __forceinline__ void restart() {
    in = Cursor{group0, 0};
    slot_in = 0;
    start();
  }
};

// Shared memory of one CTA of W warps: the tables, per warp kStages stages of R staged row chunks, then the
// activations of up to `slots` tokens (slots * x_token_bytes(K, Sub<Fmt>::kSums)).
template <class Fmt, int R, int S>
constexpr int kWarpStageBytes = kStages<Fmt, R, S> * R * Chunk<Fmt, S>::kRowStride;
template <class Fmt, int R, int W, int S>
constexpr int kFixedSmemBytes = Sub<Fmt>::kTableBytes + W * kWarpStageBytes<Fmt, R, S>;

// This warp's stream of a CTA of W warps over groups of R rows of a.w: warp w takes group first + w, then every
// (stride·W)-th after it, below `end`.
template <class Fmt, int R, int W, int S>
__device__ __forceinline__ RowStream<Fmt, R, S> warp_stream(const Args& a, uint8_t* smem, int first, int stride,
                                                            int end) {
  const int warp = threadIdx.x / kLanes;
  return RowStream<Fmt, R, S>(a, smem + Sub<Fmt>::kTableBytes + warp * kWarpStageBytes<Fmt, R, S>, first + warp,
                              stride * W, end);
}

// One warp of a CTA of W: the groups of its started stream `rows` times the first ncols tokens of xs; output of
// token slot t goes to row y_rows[t] of rows.a.y. The warp takes part in staging the CTA's activations (while
// its first weight copies are in flight), then computes.
template <class Fmt, int NC, int R, int W, int S>
__device__ void warp_rows(RowStream<Fmt, R, S>& rows, const XSource& xs, const int* y_rows, int ncols, const Tables& tab) {
  using C = Chunk<Fmt, S>;
  constexpr int D = RowStream<Fmt, R, S>::kD;
  const Args& a = rows.a;
  const int lane = threadIdx.x % kLanes;
  const int nsub = (int)(a.K / 32), nchunks = rows.nchunks;
  Cursor at{rows.group0, 0};  // item to compute
  int slot_at = 0;
  const XView xv = stage_x<W, Sub<Fmt>::kSums>(xs);
  float acc[R][NC];
  for (; at.group < rows.group_end; at.next(rows.stride, nchunks), slot_at = slot_at + 1 == D ? 0 : slot_at + 1) {
    gpu_copy_wait<D - 2>();
    gpu_syncwarp();
    rows.issue();  // overwrites the stage computed in the previous iteration, which every lane has left
    if (at.chunk == 0) {
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int t = 0; t < NC; ++t) acc[r][t] = 0.0f;
    }
    const uint8_t* st = rows.stages + slot_at * R * C::kRowStride;
#pragma unroll
    for (int h = 0; h < S; ++h) {
      const int sub = h * kLanes + lane;
      const int sb = at.chunk * C::kSubs + sub;
      if (sb < nsub) sub_block<Fmt, NC, R, S>(xv, ncols, st, sub, sb, tab, acc);
    }
    if (at.chunk == nchunks - 1) {
      // V outputs, a power of two <= kLanes: lanes that differ only in bits below kLanes / V end with the same
      // sum, and the first of them stores it.
      constexpr int V = R * NC;
      static_assert(V <= kLanes && (V & (V - 1)) == 0, "one output per lane group");
      int index = 0;
      const float s = warp_sums<V>(&acc[0][0], lane, index);
      const int64_t row = (int64_t)at.group * R + index / NC;
      const int t = index % NC;
      if ((lane & (kLanes / V - 1)) == 0 && row < a.N && t < ncols) a.y[(int64_t)y_rows[t] * a.N + row] = s;
    }
  }
  gpu_copy_wait<0>();
  gpu_syncwarp();
}

// A dense call's token tile: grid row blockIdx.y takes tokens blockIdx.y · slots.. of T. Writes the rows of x
// and y that they read and write to rows[0..kMaxCols) (the caller's barrier publishes them) and returns how many
// tokens there are. Token t is row t, or row t · groups + group of a grouped projection's [T, groups] rows.
__device__ __forceinline__ int token_tile(int64_t T, int slots, int* rows, int groups = 1, int group = 0) {
  const int64_t t0 = (int64_t)blockIdx.y * slots;
  if (threadIdx.x < kMaxCols) rows[threadIdx.x] = (int)((t0 + threadIdx.x) * groups + group);
  return (int)(T - t0 < slots ? T - t0 : slots);
}

// Dense: grid (persistent CTAs of W warps, token tiles of `slots` tokens).
template <class Fmt, int NC, int R, int W, int S>
__global__ void __launch_bounds__(W * kLanes, kWarpsPerSm / W) qmatmul_kernel(Args a, const void* __restrict__ x,
                                                                              bool bf16, int64_t T, int slots) {
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ int s_rows[kMaxCols];
  TableFill<Fmt, W> tables;
  tables.load();
  // grid-stride over every group: CTA b's warps take groups b·W.., then every gridDim.x·W-th
  RowStream<Fmt, R, S> rows =
      warp_stream<Fmt, R, W, S>(a, smem, (int)blockIdx.x * W, (int)gridDim.x, (int)((a.N + R - 1) / R));
  rows.start();
  const Tables tab = tables.store(smem);
  const int ncols = token_tile(T, slots, s_rows);
  __syncthreads();
  warp_rows<Fmt, NC, R, W, S>(rows, XSource{x, bf16, a.K, s_rows, ncols, slots, smem + kFixedSmemBytes<Fmt, R, W, S>},
                              s_rows, ncols, tab);
}

// MoE: the C CTAs of a launch shared among its P <= C slots, as evenly as whole CTAs allow: slot q takes
// `base` of them, one more if q < `rem` (C = base·P + rem), the slots in order.
struct SlotShares {
  int base, rem;
  __device__ __forceinline__ SlotShares(int C, int P) : base(C / P), rem(C % P) {}
  __device__ __forceinline__ int first(int q) const { return q * base + min(q, rem); }
  __device__ __forceinline__ int count(int q) const { return base + (q < rem ? 1 : 0); }
  __device__ __forceinline__ int slot_of(int c) const {
    const int big = rem * (base + 1);  // the CTAs of the slots with one more
    return c < big ? c / (base + 1) : rem + (c - big) / base;
  }
};

// Share `share` of `shares` (CTAs, in order) of zeroing an output row of N floats: an invalid id's row.
__device__ __forceinline__ void zero_row_share(float* row, int64_t N, int share, int shares) {
  for (int64_t i = (int64_t)share * blockDim.x + threadIdx.x; i < N; i += (int64_t)shares * blockDim.x) row[i] = 0.0f;
}

// MoE: CTA c of slot p as one of the workers of p's expert e = ids[p]: every CTA of every slot choosing e is one,
// numbered in CTA order; `index` of them come before c, `count` in all. Every thread computes it, 32 slots per
// step: the CTAs of the choosing slots are `base` per slot plus one per slot below `rem`, two ballots' counts.
struct ExpertWorker {
  int index, count;
};
__device__ ExpertWorker expert_worker(const int32_t* ids, int32_t e, int P, const SlotShares& sh, int p, int c) {
  const int lane = threadIdx.x % kLanes;
  int before = 0, all = 0;
  for (int q0 = 0; q0 < P; q0 += kLanes) {
    const int q = q0 + lane;
    const bool hit = q < P && ids[q] == e;
    const uint32_t hits = gpu_ballot(hit), extra = gpu_ballot(hit && q < sh.rem);
    const uint32_t below = p - q0 >= kLanes ? 0xFFFFFFFFu : p <= q0 ? 0u : (1u << (p - q0)) - 1u;  // slots q < p
    before += sh.base * __popc(hits & below) + __popc(extra & below);
    all += sh.base * __popc(hits) + __popc(extra);
  }
  return {before + c - sh.first(p), all};
}

// MoE, expert-major grid: whether any of the P slots chose expert e (every warp finds the same answer).
__device__ bool expert_is_chosen(const int32_t* ids, int32_t e, int P) {
  const int lane = threadIdx.x % kLanes;
  for (int q0 = 0; q0 < P; q0 += kLanes)
    if (gpu_any(q0 + lane < P && ids[q0 + lane] == e)) return true;
  return false;
}

// MoE: C persistent CTAs, in one of two grids. Slot-major (expert_ctas = 0): the CTAs shared among the P slots
// (SlotShares), every slot's CTAs serving its expert: with m slots choosing expert e, all their CTAs are e's workers.
// Expert-major (expert_ctas = m > 0, C = E·m): CTAs e·m .. e·m + m - 1 are expert e's workers, and an expert nobody
// chose leaves before reading anything; for calls of many more slots than resident CTAs on at most as many experts as
// resident CTAs, where a slot-major grid launches at least one CTA per slot, each staging all its expert's tokens for
// a few of its rows. With more experts than that, one CTA per expert leaves an expert chosen by many tokens to one
// CTA, so those calls stay slot-major (tuning.h, kExpertMajorWaves). Either way the workers' warps take e's groups of
// R rows grid-stride, each group times every slot choosing e, `slots` (<= NC) slots per pass. Each selected expert's
// rows are read once per call when no more than `slots` tokens chose it, and the work per CTA is about the same
// whatever the experts' multiplicities (serving an expert on the CTAs of its first slot alone would leave an expert
// chosen by two or three tokens to one slot's CTAs while the others' exit at once). An invalid id's output row is
// zeroed: in the slot-major grid by its slot's CTAs, in the expert-major one by CTA p mod C.
template <class Fmt, int NC, int R, int W, int S>
__global__ void __launch_bounds__(W * kLanes, kWarpsPerSm / W)
    qmatmul_id_kernel(Args a, const void* __restrict__ x, bool bf16, const int32_t* __restrict__ ids, int64_t E, int topk,
                      int P, int slots, int expert_ctas) {
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ ColTable s_cols;
  __shared__ int s_next;
  TableFill<Fmt, W> tables;
  tables.load();
  const int c = (int)blockIdx.x;
  int32_t e;
  ExpertWorker wk;
  if (expert_ctas > 0) {
    for (int q = c; q < P; q += (int)gridDim.x)
      if (ids[q] < 0 || ids[q] >= E) zero_row_share(a.y + (int64_t)q * a.N, a.N, 0, 1);
    e = c / expert_ctas;
    if (!expert_is_chosen(ids, e, P)) return;
    wk = {c % expert_ctas, expert_ctas};
  } else {
    const SlotShares sh((int)gridDim.x, P);
    const int p = sh.slot_of(c);
    e = ids[p];
    if (e < 0 || e >= E) {  // an invalid id: zero rows, shared by the slot's CTAs
      zero_row_share(a.y + (int64_t)p * a.N, a.N, c - sh.first(p), sh.count(p));
      return;
    }
    wk = expert_worker(ids, e, P, sh, p, c);
  }
  Args ae = a;
  ae.w = a.w + e * a.N * a.row_bytes;
  RowStream<Fmt, R, S> rows = warp_stream<Fmt, R, W, S>(ae, smem, wk.index * W, wk.count, (int)((a.N + R - 1) / R));
  rows.start();
  const Tables tab = tables.store(smem);
  for (int col = 0;;) {
    const bool first_pass = col == 0;
    const int ncols = next_expert_cols(ids, e, topk, P, slots, &col, &s_cols, &s_next);
    if (ncols == 0) break;
    if (!first_pass) rows.restart();
    const XSource xs{x, bf16, a.K, s_cols.x_row, ncols, slots, smem + kFixedSmemBytes<Fmt, R, W, S>};
    warp_rows<Fmt, NC, R, W, S>(rows, xs, s_cols.y_row, ncols, tab);
    __syncthreads();  // every warp is done with this pass's activations and columns before the next pass
  }
}

// ---- host side ----
// An attribute of the current device, queried once per attribute.
template <auto kAttr>
int device_attribute() {
  static const int v = [] {
    int dev = 0, value = 0;
    (void)gpuGetDevice(&dev);
    (void)gpuDeviceGetAttribute(&value, kAttr, dev);
    return value;
  }();
  return v;
}
inline int sm_count() { return device_attribute<gpuDevAttrMultiProcessorCount>(); }
inline int smem_optin() { return device_attribute<gpuDevAttrMaxSharedMemoryPerBlockOptin>(); }
inline int smem_per_sm() { return device_attribute<gpuDevAttrMaxSharedMemoryPerMultiprocessor>(); }

// Raises kKernel's dynamic shared-memory limit to what the device allows next to its static shared memory, once
// per kernel (host-side, no stream work: capture-safe). Launches of more than 48 KB need it.
template <auto kKernel>
void allow_max_dynamic_smem() {
  static const bool raised = [] {
    gpuFuncAttributes attr{};
    (void)gpuFuncGetAttributes(&attr, reinterpret_cast<const void*>(kKernel));
    return gpuFuncSetAttribute(reinterpret_cast<const void*>(kKernel), gpuFuncAttributeMaxDynamicSharedMemorySize,
                               smem_optin() - (int)attr.sharedSizeBytes) == gpuSuccess;
  }();
  (void)raised;
}

// Resident CTAs of a kernel of W warps with `smem` bytes of dynamic shared memory on the current device, at
// most kWarpsPerSm / W per SM (after allow_max_dynamic_smem). The occupancy is computed once per distinct `smem`
// (host-side calls only, no stream work: capture-safe; cached because the handler runs on every call outside
// command buffers).
template <auto kKernel, int W>
int resident_ctas(int smem) {
  allow_max_dynamic_smem<kKernel>();
  static int cached_smem = -1, cached_ctas = 0;
  if (smem != cached_smem) {
    int per_sm = 0;
    (void)gpuOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kKernel, W * kLanes, smem);
    cached_ctas = sm_count() * std::clamp(per_sm, 1, kWarpsPerSm / W);
    cached_smem = smem;
  }
  return cached_ctas;
}

// Rows per group of a one-token dense call: the largest R <= kOneTokenMaxRows that still gives every resident
// warp (kWarpsPerSm per SM) kOneTokenGroupsPerWarp groups of rows (tuning.h).
inline int pick_rows(int64_t rows_total) {
  const int64_t resident_warps = (int64_t)kWarpsPerSm * sm_count();
  int R = tuning::kOneTokenMaxRows;
  while (R > 1 && rows_total / R < tuning::kOneTokenGroupsPerWarp * resident_warps) R /= 2;
  return R;
}

// Rows per group for N rows shared by `warps` warps: the largest R <= max_rows whose busiest warp
// (ceil(ceil(N / R) / warps) * R rows) has at most 1/kBalanceSlackDivisor more rows than with R = 1 (tuning.h):
// more rows per group share each activation load, which outweighs a slightly longer busiest warp.
inline int balanced_rows(int64_t N, int64_t warps, int max_rows) {
  const auto busiest = [&](int64_t R) { return ((N + R - 1) / R + warps - 1) / warps * R; };
  const int64_t bound = busiest(1) + busiest(1) / tuning::kBalanceSlackDivisor;
  int best = 1;
  for (int R = 2; R <= max_rows; R *= 2)
    if (busiest(R) <= bound) best = R;
  return best;
}

// Passes over the weights that `tokens` take with `slots` token slots per pass (a large count for none).
inline int64_t passes(int64_t tokens, int slots) { return slots > 0 ? (tokens + slots - 1) / slots : INT64_MAX; }

// Token slots per pass for `tokens` tokens and at most `slots` per pass: as few passes, evenly filled (8 tokens
// with room for 5 run two passes of 4, not 5 and 3: the kernel of 4 columns, and no pass longer than needed).
inline int even_slots(int64_t tokens, int slots) {
  return slots > 0 ? (int)((tokens + passes(tokens, slots) - 1) / passes(tokens, slots)) : 0;
}

// Rows per group for passes of `tokens` tokens: R (a power of two) halved until its copy rings leave room for
// at most `extra` passes more than one row per group (`slots_of(R)` slots per pass): more rows per group share
// each activation load, but a pass costs the weights' decode again. The MoE kernel's passes run one after another
// on the same CTAs (tuning::kMoeExtraPasses); a dense call's token tiles run side by side on a split grid, each
// CTA staging fewer tokens, so one tile more is cheaper than one row per group (tuning::kDenseExtraPasses).
template <class F>
int rows_with_room(int R, int64_t tokens, F&& slots_of, int64_t extra) {
  const int64_t one = passes(tokens, slots_of(1));
  while (R > 1 && passes(tokens, slots_of(R)) > one + extra) R /= 2;
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

// Largest copy width the rows, chunks and base address all allow (0: none, the call takes the float path).
inline int copy_width(const uint8_t* w, int64_t row_bytes, int chunk_bytes) {
  const auto base = reinterpret_cast<uintptr_t>(w);
  for (int v : {16, 8, 4})
    if (row_bytes % v == 0 && chunk_bytes % v == 0 && base % v == 0) return v;
  return 0;
}

// Token slots a CTA of W warps can stage next to `fixed_smem` bytes of shared memory, at most kMaxCols and
// `wanted` (0: not even one token's activations fit, the call takes the float path): as many as still let
// kWarpsPerSm / W CTAs share an SM (each SM reserves 1 KB per CTA; 1 KB of static shared memory per CTA) when
// at least one does, else as many as fit one CTA. One CTA of 8 warps per SM cannot hide the latency of this
// kernel's loop, and dense calls with wide tokens are faster with more CTAs per SM each serving fewer tokens
// than with more slots per CTA: the tiles read the same rows at about the same time, so the weights still come
// from DRAM about once (docs/kernels.md#tuning-ctas-per-sm-and-token-slots).
template <class Fmt, int W>
int token_slots(int64_t K, int64_t wanted, int fixed_smem) {
  const int64_t per_token = x_token_bytes(K, Sub<Fmt>::kSums);
  const auto fit = [&](int64_t room) {
    return std::max<int64_t>(0, std::min<int64_t>({kMaxCols, wanted, (room - fixed_smem) / per_token}));
  };
  const int64_t shared = fit(smem_per_sm() / (kWarpsPerSm / W) - 2 * 1024);
  return (int)(shared > 0 ? shared : fit(smem_optin() - 1024));
}

// CTAs of W warps it takes to give each group of R rows (of N) a warp of its own.
template <int W>
int64_t ctas_for_rows(int64_t N, int R) {
  return ((N + R - 1) / R + W - 1) / W;
}

// Tokens per CTA of W warps a dense call asks for: all T, unless its rows need fewer CTAs than the device
// holds; then the tokens split into tiles (grid y) that fill it. Attention's 1024 rows take 64 CTAs of 16
// warps on 132 SMs: at T = 4 two tiles of two tokens, which beat one tile of four.
template <int W>
int64_t tile_tokens(int64_t T, int64_t N, int R) {
  const int64_t tiles = std::clamp<int64_t>(kWarpsPerSm / W * sm_count() / ctas_for_rows<W>(N, R), 1, T);
  return (T + tiles - 1) / tiles;
}

// Largest R per chunk: four rows' chunks in at most 4.5 KB per stage (Q8_0 with two sub-blocks per lane has
// 2 KB per row, and four rows' copy rings would crowd out the activations).
template <class Fmt, int S>
constexpr int kMaxRows = 4 * Chunk<Fmt, S>::kBytes <= 4608 ? 4 : 2;

// Dynamic shared memory of a launch of CTAs of W warps, R rows per group, with `slots` token slots of K.
template <class Fmt, int R, int W, int S>
int launch_smem_bytes(int slots, int64_t K) {
  return kFixedSmemBytes<Fmt, R, W, S> + (int)(slots * x_token_bytes(K, Sub<Fmt>::kSums));
}

// kFixedSmemBytes for a run-time R in {1, 2, 4}.
template <class Fmt, int W, int S>
int fixed_smem_bytes(int R) {
  return R >= 4 ? kFixedSmemBytes<Fmt, 4, W, S> : R == 2 ? kFixedSmemBytes<Fmt, 2, W, S> : kFixedSmemBytes<Fmt, 1, W, S>;
}

// Rows per group with NC token columns: eight columns leave registers for at most two rows.
template <int NC, int R>
constexpr int kRowsWith = NC == 8 && R > 2 ? 2 : R;

// Launches the dense matmul: CTAs of W warps, tiles of `slots` <= NC tokens (grid y), S sub-blocks per lane and
// chunk. The CTAs that fit on the device at once are shared among the tiles, rounded down so that every
// launched CTA works (rounding up leaves a tail wave), at least one per tile
// and at most one per W row groups.
template <class Fmt, int NC, int R, int W, int S>
void launch_tiles(gpuStream_t stream, const QDims& d, const Args& a, int slots, const void* x, bool bf16) {
  constexpr int kR = kRowsWith<NC, R>;
  constexpr auto kKernel = qmatmul_kernel<Fmt, NC, kR, W, S>;
  const int64_t tiles = (d.T + slots - 1) / slots;
  const int smem = launch_smem_bytes<Fmt, kR, W, S>(slots, a.K);
  const int64_t per_tile = std::max<int64_t>(1, resident_ctas<kKernel, W>(smem) / tiles);
  kKernel<<<dim3((unsigned)std::min(ctas_for_rows<W>(a.N, kR), per_tile), (unsigned)tiles), W * kLanes, smem, stream>>>(
      a, x, bf16, d.T, slots);
}

// The launch arguments with the widest copy that the rows, a chunk of S sub-blocks per lane and the base address
// allow (copy_bytes 0: none, the call takes the float path).
template <class Fmt, int S>
Args args_for(const QDims& d, const uint8_t* w, float* y) {
  return Args{w, y, d.N, d.K, d.row_bytes, copy_width(w, d.row_bytes, Chunk<Fmt, S>::kBytes)};
}

// Launches the integer-path matmul; false (nothing launched) when the call does not fit it.
// Several tokens: the tensor-core kernel (gpu_i8_mma.cuh) where it takes the call, which gives the same bits;
// else one CTA of kWideWarps per SM, tiles of tokens that fill the device, kSubPerLaneMany
// sub-blocks per lane and rows per group by balance and room. One CTA of kWideWarps per SM stages the tokens
// once per SM instead of twice, and has room for twice as many.
// One token per tile (T = 1, or tokens that do not fit two to a CTA): pick_rows, two sub-blocks per lane;
// 16-warp CTAs too, except a T = 1 call whose rows need fewer wide CTAs than the device has SMs, which takes two
// CTAs of kWarps and so spreads its rows over all SMs (docs/kernels.md#tuning-ctas-per-sm-and-token-slots).
template <class Fmt>
bool launch_qmma(gpuStream_t stream, const QDims& d, MmaMode mma, const uint8_t* w, const void* x, bool bf16, float* y,
                 int64_t groups = 1);

template <class Fmt>
bool launch_qmatmul(gpuStream_t stream, const QDims& d, MmaMode mma, const uint8_t* w, const void* x, bool bf16,
                    float* y) {
  if (d.T > 1 && launch_qmma<Fmt>(stream, d, mma, w, x, bf16, y)) return true;
  bool launched = false;
  if (d.T > 1) {
    constexpr int S = kSubPerLaneMany<Fmt>;
    const Args a = args_for<Fmt, S>(d, w, y);
    const auto slots_of = [&](int R) {
      return token_slots<Fmt, kWideWarps>(d.K, tile_tokens<kWideWarps>(d.T, d.N, R), fixed_smem_bytes<Fmt, kWideWarps, S>(R));
    };
    const int rows =
        rows_with_room(balanced_rows(d.N, (int64_t)kWarpsPerSm * sm_count(), kMaxRows<Fmt, S>), d.T, slots_of, tuning::kDenseExtraPasses);
    if (a.copy_bytes > 0) visit_rows<kMaxRows<Fmt, S>>(rows, [&](auto rc) {
      constexpr int kR = decltype(rc)::value;
      const int slots = even_slots(d.T, slots_of(kR));
      if (slots < 2) return;
      visit_cols(slots, [&](auto nc) {
        constexpr int kNC = decltype(nc)::value;
        if constexpr (kNC > 1) launch_tiles<Fmt, kNC, kR, kWideWarps, S>(stream, d, a, slots, x, bf16);
      });
      launched = true;
    });
    if (launched) return launched;
  }
  constexpr int S = kSubPerLaneOne;
  const Args a = args_for<Fmt, S>(d, w, y);
  if (a.copy_bytes == 0) return launched;
  visit_rows<kMaxRows<Fmt, S>>(pick_rows(d.N), [&](auto rc) {
    constexpr int kR = decltype(rc)::value;
    const auto one_token_tiles = [&](auto wc) {
      constexpr int W = decltype(wc)::value;
      launched = token_slots<Fmt, W>(d.K, 1, kFixedSmemBytes<Fmt, kR, W, S>) == 1;
      if (launched) launch_tiles<Fmt, 1, kR, W, S>(stream, d, a, 1, x, bf16);
    };
    if (d.T == 1 && ctas_for_rows<kWideWarps>(d.N, kR) < sm_count()) one_token_tiles(std::integral_constant<int, kWarps>{});
    else one_token_tiles(std::integral_constant<int, kWideWarps>{});
  });
  return launched;
}

// Launches the MoE matmul (and grouped projections); false when the call does not fit the integer path. Experts busy
// at once: at most E distinct ones among the P slots (all P with DS4's 256 experts; the G groups of a grouped
// projection, which every token uses); the rows per group balance an expert's rows over its share of the device's
// warps (balanced_rows). Token slots per pass: what an expert's average share of the rows needs, evenly (even_slots).
// Where experts serve one row each on average (one token's k experts; the per-expert rows of a down projection, T·k
// rows of one id each), one slot: an expert that several rows chose takes one pass per row, but on as many more CTAs
// (all its slots' CTAs are its workers), so its work per CTA stays about that of any other expert; room for every row
// in one pass would compile that call for 8 columns to serve one. Where experts serve several tokens each on average
// (a grouped projection of T > 1), the dense calls' layout for several tokens: one CTA of kWideWarps per SM (its
// slots room for twice the tokens, staged once per SM), kSubPerLaneMany sub-blocks per lane, rows per group that cost
// no extra pass. A grouped projection (groups > 0: ids[p] = p mod groups, as `qmatmul_grouped` builds them) of
// several tokens per group goes to the tensor-core kernel first, where that takes it (gpu_i8_mma.cuh, tuning.h's
// kMmaCrossover).
template <class Fmt>
bool launch_qmatmul_id(gpuStream_t stream, const QDims& d, MmaMode mma, const uint8_t* w, const void* x, bool bf16,
                       const int32_t* ids, int64_t groups, float* y) {
  if (groups > 0 && launch_qmma<Fmt>(stream, d, mma, w, x, bf16, y, groups)) return true;
  const int P = (int)(d.T * d.k);
  const int busy = (int)std::clamp<int64_t>(d.E, 1, P);  // E = 0: every id invalid, the outputs zeroed
  const int64_t per_expert = std::min<int64_t>(d.T, (P + busy - 1) / busy);
  // Launches CTAs of W warps, S sub-blocks per lane, if `wanted` tokens per expert fit at least `min_slots` slots.
  const auto launch = [&](auto wc, auto sc, int64_t wanted, int min_slots) {
    constexpr int W = decltype(wc)::value, S = decltype(sc)::value;
    const Args a = args_for<Fmt, S>(d, w, y);
    bool launched = false;
    if (a.copy_bytes == 0) return launched;
    const int64_t warps = std::max<int64_t>(1, (int64_t)kWarpsPerSm * sm_count() / busy);  // per busy expert
    const auto slots_of = [&](int R) { return token_slots<Fmt, W>(d.K, wanted, fixed_smem_bytes<Fmt, W, S>(R)); };
    visit_rows<kMaxRows<Fmt, S>>(rows_with_room(balanced_rows(d.N, warps, kMaxRows<Fmt, S>), wanted, slots_of, tuning::kMoeExtraPasses), [&](auto rc) {
      const int room = token_slots<Fmt, W>(d.K, d.T, kFixedSmemBytes<Fmt, decltype(rc)::value, W, S>);
      const int slots = even_slots(wanted, room);
      if (slots < min_slots) return;
      visit_cols(slots, [&](auto nc) {
        constexpr int kNC = decltype(nc)::value, kR = kRowsWith<kNC, decltype(rc)::value>;
        if constexpr (kNC > 1 || W == kWarps) {  // passes of several tokens take wide CTAs only
          constexpr auto kKernel = qmatmul_id_kernel<Fmt, kNC, kR, W, S>;
          const int smem = launch_smem_bytes<Fmt, kR, W, S>(slots, d.K);
          const int64_t resident = resident_ctas<kKernel, W>(smem), row_ctas = ctas_for_rows<W>(d.N, kR);
          if (P > tuning::kExpertMajorWaves * resident && d.E > 0 && d.E <= resident) {
            // expert-major: about kExpertMajorWaves waves of CTAs over the experts, at most one per W row groups each
            const int64_t m = std::min<int64_t>(tuning::kExpertMajorWaves * resident / d.E, row_ctas);
            kKernel<<<(unsigned)(d.E * m), W * kLanes, smem, stream>>>(a, x, bf16, ids, d.E, (int)d.k, P, slots, (int)m);
          } else {
            // slot-major: every CTA that fits at once, shared among the slots (at least one each, at most one
            // per W row groups)
            const int64_t ctas = std::max<int64_t>(P, std::min<int64_t>(resident, P * row_ctas));
            kKernel<<<(unsigned)ctas, W * kLanes, smem, stream>>>(a, x, bf16, ids, d.E, (int)d.k, P, slots, 0);
          }
        }
      });
      launched = true;
    });
    return launched;
  };
  if (per_expert > 1 && launch(std::integral_constant<int, kWideWarps>{},
                               std::integral_constant<int, kSubPerLaneMany<Fmt>>{}, per_expert, 2))
    return true;
  return launch(std::integral_constant<int, kWarps>{}, std::integral_constant<int, kSubPerLaneOne>{}, 1, 1);
}

}  // namespace i8
