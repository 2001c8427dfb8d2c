// GPU handler of indexer_topk (indexer_common.h), included by gpu_ffi.cu (CUDA and HIP); two launches:
//   1. scores: a fixed grid of CTAs per query row walks the row's visible entries in tiles of kIndexerTile
//      (CTAs past the length exit at once), each warp group summing its heads (indexer_group_sum on the tile's
//      keys in shared memory) and one thread per entry adding the groups in order: the CPU's bits.
//   2. selection: one CTA per row finds the k-th largest order key by an 8-bit radix select over the row's
//      scores, gathers the entries above it and the lowest-numbered ones equal to it with a fixed-order
//      compaction, and places each at its rank under (score descending, entry ascending).
// Both loops stop at the row's length, so the work grows with it and the capacity N only sizes the buffers;
// nothing depends on other rows (integer histograms and ranks are order-free), so results are batch invariant.
// Included inside gpu_ffi.cu's namespace dspark::{anonymous}, after launch_error(); indexer_common.h is
// included at its top.

constexpr int kIndexerTile = 32;                                         // entries per scoring tile
constexpr int kIndexerScoreThreads = kIndexerTile * kIndexerHeadGroups;  // one thread per (entry, head group)
constexpr int kIndexerScoreCtas = 128;  // scoring CTAs per row: enough to fill the device at batch 1
constexpr int kIndexerSelectThreads = 512;
constexpr int kIndexerMaxSharedBytes = 48 * 1024;  // the dynamic shared memory a launch gets without opting in

__global__ void __launch_bounds__(kIndexerScoreThreads)
    indexer_score_kernel(const float* __restrict__ q, const float* __restrict__ keys,
                         const int32_t* __restrict__ layer, int64_t L, const float* __restrict__ w,
                         const int32_t* __restrict__ lengths, float* __restrict__ scores, int64_t B, int64_t Q,
                         int64_t H, int64_t dim, int64_t N) {
  extern __shared__ __align__(16) uint8_t smem[];
  float* s_key = reinterpret_cast<float*>(smem);  // [kIndexerTile][dim + 1]: the pad spreads lanes over banks
  __shared__ float s_part[kIndexerHeadGroups][kIndexerTile];
  const int64_t r = blockIdx.y;
  const int64_t len = min((int64_t)max(lengths[r], 0), N);
  const float* qr = q + r * H * dim;
  const float* wr = w + r * H;
  const int64_t l = *layer < 0 ? 0 : (*layer >= L ? L - 1 : *layer);  // clamped into the stack (check_indexer)
  const float* kb = keys + (l * B + r / Q) * N * dim;
  const int e = threadIdx.x % kIndexerTile, g = threadIdx.x / kIndexerTile;
  const int64_t stride = dim + 1;
  for (int64_t t0 = (int64_t)blockIdx.x * kIndexerTile; t0 < len; t0 += (int64_t)gridDim.x * kIndexerTile) {
    const int64_t count = min((int64_t)kIndexerTile, len - t0);
    for (int64_t i = threadIdx.x; i < count * dim; i += blockDim.x) s_key[(i / dim) * stride + i % dim] = kb[t0 * dim + i];
    __syncthreads();
    if (e < count) {
      const float* key = s_key + e * stride;
      s_part[g][e] = indexer_group_sum(qr, wr, [key](int64_t d) { return key[d]; }, H, dim, g);
    }
    __syncthreads();
    if (threadIdx.x < count) {
      float s = 0.0f;
      for (int j = 0; j < kIndexerHeadGroups; ++j) s += s_part[j][threadIdx.x];
      scores[r * N + t0 + threadIdx.x] = s;
    }
  }
}

// Inclusive prefix sum of s[0, n) in place, n <= blockDim.x; every thread of the CTA must call it.
__device__ void cta_inclusive_scan(int* s, int n) {
  const int t = threadIdx.x;
  for (int off = 1; off < n; off <<= 1) {
    const int v = t < n && t >= off ? s[t - off] : 0;
    __syncthreads();
    if (t < n) s[t] += v;
    __syncthreads();
  }
}

__global__ void __launch_bounds__(kIndexerSelectThreads)
    indexer_select_kernel(const float* __restrict__ scores, const int32_t* __restrict__ lengths,
                          int32_t* __restrict__ picks, int64_t N, int64_t k) {
  extern __shared__ __align__(16) uint8_t smem[];
  uint32_t* s_sel_key = reinterpret_cast<uint32_t*>(smem);  // [k] order keys of the selected entries
  int32_t* s_sel_idx = reinterpret_cast<int32_t*>(s_sel_key + k);  // [k] their entry numbers
  __shared__ int s_scan[kIndexerSelectThreads];
  __shared__ int s_digit, s_left;
  const int t = threadIdx.x;
  const int64_t r = blockIdx.x;
  const int64_t len = min((int64_t)max(lengths[r], 0), N);
  const float* sr = scores + r * N;
  const int64_t taken = min(len, k);
  // Keep every entry whose key is above `threshold`, and the first `ties` entries equal to it.
  uint32_t threshold = 0;
  int ties = (int)len;
  if (len > k) {
    int left = (int)k;  // entries still to find among those matching the digits chosen so far
    for (int shift = 24; shift >= 0; shift -= 8) {
      const uint32_t high = shift == 24 ? 0u : 0xFFFFFFFFu << (shift + 8);
      if (t < 256) s_scan[t] = 0;
      __syncthreads();
      for (int64_t i = t; i < len; i += blockDim.x) {
        const uint32_t u = indexer_order_key(sr[i]);
        if ((u & high) == threshold) atomicAdd(&s_scan[255 - ((u >> shift) & 255u)], 1);  // digit-descending bins
      }
      __syncthreads();
      cta_inclusive_scan(s_scan, 256);
      if (t < 256) {
        const int before = t ? s_scan[t - 1] : 0;
        if (before < left && s_scan[t] >= left) {
          s_digit = 255 - t;
          s_left = left - before;
        }
      }
      __syncthreads();
      threshold |= (uint32_t)s_digit << shift;
      left = s_left;
      __syncthreads();
    }
    ties = left;
  }
  // Fixed-order compaction: thread t owns entries [lo, hi), so the ties kept are the lowest-numbered ones.
  const int64_t per = (len + blockDim.x - 1) / blockDim.x;
  const int64_t lo = min(len, t * per), hi = min(len, lo + per);
  int above = 0, equal = 0;
  for (int64_t i = lo; i < hi; ++i) {
    const uint32_t u = indexer_order_key(sr[i]);
    above += u > threshold;
    equal += u == threshold;
  }
  s_scan[t] = equal;
  __syncthreads();
  cta_inclusive_scan(s_scan, blockDim.x);
  int keep_equal = min(max(ties - (s_scan[t] - equal), 0), equal);
  __syncthreads();
  s_scan[t] = above + keep_equal;
  __syncthreads();
  cta_inclusive_scan(s_scan, blockDim.x);
  int pos = s_scan[t] - (above + keep_equal);
  for (int64_t i = lo; i < hi; ++i) {
    const uint32_t u = indexer_order_key(sr[i]);
    if (u > threshold || (u == threshold && keep_equal-- > 0)) {
      s_sel_key[pos] = u;
      s_sel_idx[pos] = (int32_t)i;
      ++pos;
    }
  }
  __syncthreads();
  int32_t* out = picks + r * k;
  for (int64_t c = t; c < taken; c += blockDim.x) {
    const uint32_t u = s_sel_key[c];
    const int32_t idx = s_sel_idx[c];
    int64_t rank = 0;
    for (int64_t j = 0; j < taken; ++j) rank += s_sel_key[j] > u || (s_sel_key[j] == u && s_sel_idx[j] < idx);
    out[rank] = idx;
  }
  for (int64_t j = taken + t; j < k; j += blockDim.x) out[j] = (int32_t)j;
}

ffi::Error IndexerTopkGpu(gpuStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer keys, ffi::AnyBuffer layer,
                          ffi::AnyBuffer w, ffi::AnyBuffer lengths, ffi::Result<ffi::AnyBuffer> picks,
                          ffi::Result<ffi::AnyBuffer> scores) {
  IndexerDims d;
  if (auto e = check_indexer(q, keys, layer, w, lengths, *picks, *scores, &d); e.failure()) return e;
  const int64_t rows = d.B * d.Q;
  if (rows == 0) return ffi::Error::Success();
  const int64_t key_bytes = kIndexerTile * (d.dim + 1) * (int64_t)sizeof(float);
  const int64_t pick_bytes = d.k * 2 * (int64_t)sizeof(int32_t);
  if (key_bytes > kIndexerMaxSharedBytes || pick_bytes > kIndexerMaxSharedBytes || rows > 65535)
    return arg_error("indexer_topk: dim = " + std::to_string(d.dim) + ", k = " + std::to_string(d.k) + " or B*Q = " +
                     std::to_string(rows) + " exceeds the GPU kernel's limits (dim <= 383, k <= 6144, B*Q <= 65535)");
  const int64_t ctas = std::min<int64_t>((d.N + kIndexerTile - 1) / kIndexerTile, kIndexerScoreCtas);
  auto* sp = static_cast<float*>(scores->untyped_data());
  const auto* lp = static_cast<const int32_t*>(lengths.untyped_data());
  indexer_score_kernel<<<dim3((unsigned)ctas, (unsigned)rows), kIndexerScoreThreads, (size_t)key_bytes, stream>>>(
      static_cast<const float*>(q.untyped_data()), static_cast<const float*>(keys.untyped_data()),
      static_cast<const int32_t*>(layer.untyped_data()), d.L, static_cast<const float*>(w.untyped_data()), lp, sp,
      d.B, d.Q, d.H, d.dim, d.N);
  indexer_select_kernel<<<(unsigned)rows, kIndexerSelectThreads, (size_t)pick_bytes, stream>>>(
      sp, lp, static_cast<int32_t*>(picks->untyped_data()), d.N, d.k);
  return launch_error("indexer_topk");
}
