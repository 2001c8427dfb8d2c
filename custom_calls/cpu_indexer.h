// CPU handler of indexer_topk (indexer_common.h): each row scores its visible entries only, then keeps the k best
// by (score descending, entry ascending) with a partial sort, so a row's work is O(len · H · dim + len · log k).
#pragma once
#include <algorithm>
#include <numeric>
#include <vector>

#include "indexer_common.h"

namespace dspark {

inline ffi::Error IndexerTopkCpu(ffi::AnyBuffer q, ffi::AnyBuffer keys, ffi::AnyBuffer layer, ffi::AnyBuffer w,
                                 ffi::AnyBuffer lengths, ffi::Result<ffi::AnyBuffer> picks,
                                 ffi::Result<ffi::AnyBuffer> scores) {
  IndexerDims d;
  if (auto e = check_indexer(q, keys, layer, w, lengths, *picks, *scores, &d); e.failure()) return e;
  const int64_t l = std::clamp<int64_t>(*static_cast<const int32_t*>(layer.untyped_data()), 0, d.L - 1);
  const auto* qp = static_cast<const float*>(q.untyped_data());
  const auto* kp = static_cast<const float*>(keys.untyped_data()) + l * d.B * d.N * d.dim;
  const auto* wp = static_cast<const float*>(w.untyped_data());
  const auto* lp = static_cast<const int32_t*>(lengths.untyped_data());
  auto* pp = static_cast<int32_t*>(picks->untyped_data());
  auto* sp = static_cast<float*>(scores->untyped_data());
  std::vector<uint32_t> order_key;
  std::vector<int32_t> entries;
  for (int64_t r = 0; r < d.B * d.Q; ++r) {
    const float* qr = qp + r * d.H * d.dim;
    const float* keys_b = kp + (r / d.Q) * d.N * d.dim;
    const int64_t len = std::clamp<int64_t>(lp[r], 0, d.N);
    order_key.resize(len);
    for (int64_t n = 0; n < len; ++n) {
      const float* key = keys_b + n * d.dim;
      float s = 0.0f;
      for (int g = 0; g < kIndexerHeadGroups; ++g)
        s += indexer_group_sum(qr, wp + r * d.H, [&](int64_t i) { return key[i]; }, d.H, d.dim, g);
      sp[r * d.N + n] = s;
      order_key[n] = indexer_order_key(s);
    }
    const int64_t taken = std::min(len, d.k);
    entries.resize(len);
    std::iota(entries.begin(), entries.end(), 0);
    std::partial_sort(entries.begin(), entries.begin() + taken, entries.end(), [&](int32_t a, int32_t b) {
      return order_key[a] != order_key[b] ? order_key[a] > order_key[b] : a < b;
    });
    int32_t* out = pp + r * d.k;
    for (int64_t j = 0; j < d.k; ++j) out[j] = j < taken ? entries[j] : (int32_t)j;
  }
  return ffi::Error::Success();
}

}  // namespace dspark
