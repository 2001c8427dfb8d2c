// The CSA Lightning Indexer's top-k op, shared by the CPU and GPU handlers: argument checks (host) and the
// per-entry score (host and device, so both sides give the same bits).
//
// For query row r (batch b) with `len[r]` visible entries, entry n < len[r] scores
//   s[r, n] = Σ_g Σ_{h ≡ g mod kIndexerHeadGroups} w[r, h] · relu(Σ_d q[r, h, d] · key[b, n, d])
// with every sum in the order written (d ascending; heads of a group ascending; groups ascending), and the op
// returns the k entries of highest score, by score descending and ties by ascending entry, then k − len[r]
// slots j >= len[r] holding entry j when fewer are visible. Entries at or past len[r] are never read: the work
// of a row grows with its length, not with the capacity N of the key buffer.
#pragma once
#include <cstdint>
#include <string>

#include "dspark_hd.h"
#include "xla/ffi/api/ffi.h"

namespace dspark {
namespace ffi = xla::ffi;

// Heads are summed in this many interleaved groups (the GPU gives each group to its own warp, so a short row
// still spreads over many threads).
constexpr int kIndexerHeadGroups = 16;

// Σ over the heads h = g, g + G, ... of w[h] · relu(q[h] · key): the dots of four heads interleaved (each
// still summed d ascending, so the bits do not depend on the interleave). key(d) returns the key's d-th value.
template <class KeyAt>
DSPARK_HD float indexer_group_sum(const float* q, const float* w, KeyAt key, int64_t heads, int64_t dim, int g) {
  float sum = 0.0f;
  for (int64_t h0 = g; h0 < heads; h0 += 4 * kIndexerHeadGroups) {
    float dot[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    const float* qh[4];
    for (int j = 0; j < 4; ++j) qh[j] = q + (h0 + (int64_t)j * kIndexerHeadGroups) * dim;
    for (int64_t d = 0; d < dim; ++d) {
      const float kd = key(d);
      for (int j = 0; j < 4; ++j)
        if (h0 + (int64_t)j * kIndexerHeadGroups < heads) dot[j] = dspark_mad(qh[j][d], kd, dot[j]);
    }
    for (int j = 0; j < 4; ++j) {
      const int64_t h = h0 + (int64_t)j * kIndexerHeadGroups;
      if (h < heads) sum = dspark_mad(w[h], dot[j] > 0.0f ? dot[j] : 0.0f, sum);
    }
  }
  return sum;
}

// Order-preserving map of a float score to an unsigned key (larger score, larger key; -0 below +0).
DSPARK_HD uint32_t indexer_order_key(float s) {
  union { float f; uint32_t u; } v;
  v.f = s;
  return (v.u & 0x80000000u) ? ~v.u : (v.u | 0x80000000u);
}


// Sizes of an indexer_topk call: rows R = B·Q, keys [B, N, dim] (or L layers of them), heads H, k picks per row.
struct IndexerDims {
  int64_t B = 0, Q = 0, H = 0, dim = 0, N = 0, k = 0, L = 1;
};

// queries [B, Q, H, dim], keys [B, N, dim] or a stack [L, B, N, dim] of which the call reads layer `layer` (int32
// [], clamped into [0, L) as XLA's dynamic-slice clamps) in place (a scanned body's layer, not sliced out of the
// stack for each call), head_weights [B, Q, H] (float32), lengths [B, Q] (int32); picks [B, Q, k] (int32) with
// 1 <= k <= N, scores [B, Q, N] (float32 workspace of the GPU's two passes).
inline ffi::Error check_indexer(const ffi::AnyBuffer& q, const ffi::AnyBuffer& keys, const ffi::AnyBuffer& layer,
                                const ffi::AnyBuffer& w, const ffi::AnyBuffer& lengths, const ffi::AnyBuffer& picks,
                                const ffi::AnyBuffer& scores, IndexerDims* d) {
  auto err = [](const std::string& m) { return ffi::Error::InvalidArgument("dsparkjax: indexer_topk: " + m); };
  const auto qd = q.dimensions(), kd = keys.dimensions(), pd = picks.dimensions();
  if (q.element_type() != ffi::DataType::F32 || qd.size() != 4) return err("queries must be float32 [B, Q, H, dim]");
  d->B = qd[0], d->Q = qd[1], d->H = qd[2], d->dim = qd[3];
  const size_t r = kd.size();
  d->L = r == 4 ? kd[0] : 1;
  if (keys.element_type() != ffi::DataType::F32 || (r != 3 && r != 4) || d->L < 1 || kd[r - 3] != d->B ||
      kd[r - 1] != d->dim)
    return err("keys must be float32 [B, N, dim], or a stack of them [L, B, N, dim], with the B and dim of queries");
  d->N = kd[r - 2];
  if (layer.element_type() != ffi::DataType::S32 || layer.element_count() != 1) return err("layer must be int32 []");
  if (w.element_type() != ffi::DataType::F32 || (int64_t)w.element_count() != d->B * d->Q * d->H)
    return err("head_weights must be float32 [B, Q, H]");
  if (lengths.element_type() != ffi::DataType::S32 || (int64_t)lengths.element_count() != d->B * d->Q)
    return err("lengths must be int32 [B, Q]");
  if (picks.element_type() != ffi::DataType::S32 || pd.size() != 3 || pd[0] != d->B || pd[1] != d->Q)
    return err("picks must be int32 [B, Q, k]");
  d->k = pd[2];
  if (d->k < 1 || d->k > d->N)
    return err("k = " + std::to_string(d->k) + " must be in 1..N = " + std::to_string(d->N));
  if (scores.element_type() != ffi::DataType::F32 || (int64_t)scores.element_count() != d->B * d->Q * d->N)
    return err("the scores workspace must be float32 [B, Q, N]");
  return ffi::Error::Success();
}

}  // namespace dspark
